"""The project's own fully bidirectional tiny targets (`train_target --attention bidirectional`): the states they
train on, and the checkpoint they save loading through the `llada` family's native path, where control decodes
what the training script's own decoder decodes and SPOT equals control. No ../shared needed."""

from __future__ import annotations

import pytest
import torch

from research.train_target import ModelConfig, TrainConfig, make_bidirectional_batch, train

MASK, EOS = 99, 98


def test_a_batch_row_is_clean_before_its_active_block_and_all_masks_after():
    g = torch.Generator().manual_seed(0)
    seqs = [(list(range(1, 6)) + list(range(10, 21)) + [EOS], 5), (list(range(1, 4)) + [30, 31, EOS], 3)]
    L, G = 4, 16
    for _ in range(20):
        b = make_bidirectional_batch(seqs, L, G, MASK, EOS, 1e-3, g)
        assert b.input_ids.shape == (2, 5 + G)
        for i, (ids, p) in enumerate(seqs):
            row, lab = b.input_ids[i].tolist(), b.labels[i].tolist()
            assert lab[: len(ids)] == ids and all(t == EOS for t in lab[len(ids) :])  # eos padding
            assert row[:p] == ids[:p]  # the prompt is never masked
            loss_at = b.masked[i].nonzero().flatten().tolist()
            gen_masks = [j for j in range(p, p + G) if row[j] == MASK]
            assert set(loss_at) <= set(gen_masks)
            if loss_at:
                k = (loss_at[0] - p) // L  # the active block
                assert set(gen_masks) == set(loss_at) | set(range(p + (k + 1) * L, p + G))
            else:  # the active block drew no mask: the masks are exactly the blocks after it
                k = (min(gen_masks, default=p + G) - p) // L - 1
                assert (min(gen_masks, default=p + G) - p) % L == 0
            assert 0 <= k <= (len(ids) - 1 - p) // L  # never past the eos's block
            assert row[p : p + k * L] == lab[p : p + k * L]  # earlier blocks clean
            assert all(row[j] == MASK for j in range(p + (k + 1) * L, p + G))  # later blocks all masks
            assert all(p + k * L <= j < p + (k + 1) * L for j in loss_at)
            # a row's padding past its own canvas is seen by none of its positions
            if p + G < b.input_ids.shape[1]:
                assert torch.isinf(b.attention_mask[i, 0, 0, p + G :]).all()
                assert not torch.isinf(b.attention_mask[i, 0, 0, : p + G]).any()


@pytest.fixture(scope="module")
def bidirectional_target(tmp_path_factory):
    out = tmp_path_factory.mktemp("bidir")
    cfg = TrainConfig(out=str(out), model=ModelConfig(hidden=32, layers=1, heads=2, kv_heads=2), steps=4, batch=4,
                      block_len=8, attention="bidirectional", max_new=128, eval_n=0, val_every=0, threads=1,
                      warmup=2)
    final = train(cfg)
    return out, final


def test_the_saved_checkpoint_is_a_llada_checkpoint_control_decodes_as_the_training_decoder(bidirectional_target):
    import json

    from lm_eval_spot.arith import generator as gen
    from lm_eval_spot.arith.tokenizer import build_tokenizer
    from lm_eval_spot.settings.args import parse_args
    from lm_eval_spot.decoding.loop import DecodeConfig, decode
    from lm_eval_spot.families import load_target
    from research.train_target import build_model, greedy_decode_bidirectional, load_checkpoint

    out, final = bidirectional_target
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["model_type"] == "llada" and cfg["block_length"] == 8
    loaded = load_target(parse_args({"pretrained": str(final), "device": "cpu", "mode": "control"}))
    assert (loaded.family, loaded.impl) == ("llada", "native")
    info = loaded.adapter.info
    assert info.block_len == 8 and info.exact_prefix_cache  # exact mode: the whole canvas every forward
    # The reference: the training run's own weights (its checkpoint, Llama names) under its own decoder.
    tok = build_tokenizer()
    model = build_model(ModelConfig(hidden=32, layers=1, heads=2, kv_heads=2), tok, 8, "bidirectional")
    model.load_state_dict(load_checkpoint(out / "checkpoint.pt")["model"])
    model.eval()
    # Every position's logits on a canvas, through the family's loader and the project's canvas forward, against
    # the training weights run bidirectionally (no mask at all: every position attends every other).
    ids = torch.randint(0, len(tok), (2, 40), generator=torch.Generator().manual_seed(0))
    keep = torch.arange(40)
    got = loaded.adapter.protocol.forward(loaded.adapter.model, ids, keep)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=torch.zeros(2, 1, 40, 40)).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for q in gen.make_split("test", 3):
        prompt = tok.encode(gen.make_prompt(q["question"]), add_special_tokens=False)
        ref = greedy_decode_bidirectional(model, prompt, 8, tok.mask_token_id, tok.eos_token_id, 24)
        res = decode(loaded.adapter, prompt, DecodeConfig(max_gen_toks=24), seed=0)
        assert res.token_ids == ref


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_spot_equals_control_on_the_bidirectional_target(bidirectional_target, T):
    from lm_eval_spot.arith import generator as gen
    from lm_eval_spot.arith.tokenizer import build_tokenizer
    from lm_eval_spot.settings.args import parse_args
    from lm_eval_spot.decoding.loop import DecodeConfig, decode
    from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
    from lm_eval_spot.drafter.spot_proposer import LearnedOrder, TreeConfig, TreeProposer
    from lm_eval_spot.families import load_target

    _, final = bidirectional_target
    adapter = load_target(parse_args({"pretrained": str(final), "device": "cpu", "mode": "control"})).adapter
    torch.manual_seed(1)
    drafter = FactoredOrderModel(FactoredConfig(relative_slots=True, slot_embedding=False)).eval()
    tok = build_tokenizer()
    for i, q in enumerate(gen.make_split("test", 3)):
        prompt = tok.encode(gen.make_prompt(q["question"]), add_special_tokens=False)
        cfg = DecodeConfig(max_gen_toks=24, temperature=T)
        ctrl = decode(adapter, prompt, cfg, seed=i)
        spot = decode(adapter, prompt, cfg, seed=i, proposer=TreeProposer(LearnedOrder(drafter), TreeConfig(budget=6)))
        assert spot.token_ids == ctrl.token_ids
        assert spot.nfe.total <= ctrl.nfe.total


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_batch_sizes_4_and_8_equal_one_at_a_time_on_the_bidirectional_target(bidirectional_target, T):
    """The trained target through the llada family (native, exact): eight test prompts of different lengths,
    control and SPOT, at batch size 4 and 8 give every request's ids and NFE of its decode alone, in one model
    forward per step."""
    from lm_eval_spot.arith import generator as gen
    from lm_eval_spot.arith.tokenizer import build_tokenizer
    from lm_eval_spot.settings.args import parse_args
    from lm_eval_spot.decoding.batch import DecodeRequest, StepTally, decode_many
    from lm_eval_spot.decoding.loop import DecodeConfig, decode
    from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
    from lm_eval_spot.drafter.spot_proposer import LearnedOrder, TreeConfig, TreeProposer
    from lm_eval_spot.families import load_target

    _, final = bidirectional_target
    adapter = load_target(parse_args({"pretrained": str(final), "device": "cpu", "mode": "control"})).adapter
    torch.manual_seed(1)
    drafter = FactoredOrderModel(FactoredConfig(relative_slots=True, slot_embedding=False)).eval()
    tok = build_tokenizer()
    # The task's prompts have one length: some lose their first tokens, so canvases differ in prompt and length.
    prompts = [tok.encode(gen.make_prompt(q["question"]), add_special_tokens=False)[i % 3:]
               for i, q in enumerate(gen.make_split("test", 8))]
    for prop in (None, TreeProposer(LearnedOrder(drafter), TreeConfig(budget=4))):
        jobs = [DecodeRequest(p, DecodeConfig(max_gen_toks=8 + 8 * (i % 3), temperature=T), seed=i, proposer=prop)
                for i, p in enumerate(prompts)]
        alone = [decode(adapter, j.prompt_ids, j.cfg, j.seed, proposer=prop) for j in jobs]
        for bs in (4, 8):
            tally = StepTally()
            together = decode_many(adapter, jobs, batch_size=bs, tally=tally)
            assert [r.token_ids for r in together] == [r.token_ids for r in alone]
            assert [r.nfe.total for r in together] == [r.nfe.total for r in alone]
            assert tally.forwards == tally.steps < sum(r.nfe.total for r in alone)


def test_full_mask_rows_mask_every_generated_position_with_one_ratio():
    g = torch.Generator().manual_seed(1)
    seqs = [(list(range(1, 6)) + list(range(10, 21)) + [EOS], 5), (list(range(1, 4)) + [30, 31, EOS], 3)]
    seen_late_clean = False
    for _ in range(30):
        b = make_bidirectional_batch(seqs, 4, 16, MASK, EOS, 1e-3, g, full_mask_frac=1.0)
        for i, (ids, p) in enumerate(seqs):
            row = b.input_ids[i]
            gen_masks = (row == MASK).nonzero().flatten()
            assert torch.equal(gen_masks, b.masked[i].nonzero().flatten())  # the loss on every masked position
            assert row[:p].tolist() == ids[:p] and bool(((gen_masks >= p) & (gen_masks < p + 16)).all())
            assert bool((b.t[i, p : p + 16] == b.t[i, p]).all())
            # unlike the semi-autoregressive rows, a clean position may follow a masked one
            if len(gen_masks) and bool((row[int(gen_masks[0]) : p + 16] != MASK).any()):
                seen_late_clean = True
    assert seen_late_clean
