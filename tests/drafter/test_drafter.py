"""Drafter: features, prefix-replay data, checkpoint metadata checks, the training command, spot-dlm modes."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from lm_eval.api.instance import Instance

from lm_eval_spot.settings.args import SpotArgError
from lm_eval_spot.drafter.data import Trajectories, TrajectoryRecorder, make_batch, make_round_batch, replay_examples
from lm_eval_spot.drafter.factored import FACTORED_FEATURE_VERSION, FactoredConfig, FactoredOrderModel
from lm_eval_spot.drafter.features import COMMITTED, FEATURE_VERSION, INACTIVE, MASKED, ON_PATH
from lm_eval_spot.drafter.model import (DrafterMeta, DrafterMismatchError, OrderModel, OrderModelConfig,
                                        feature_version_of, load_drafter, n_params, save_drafter)
from lm_eval_spot.training.train import main as train_main
from lm_eval_spot.harness.model import SpotDLM
from helpers.summaries import view


def test_order_model_size_matches_paper():
    assert 600_000 <= n_params(OrderModel(OrderModelConfig())) <= 640_000
    assert 600_000 <= n_params(FactoredOrderModel(FactoredConfig())) <= 640_000


def toy_trajectory(L: int = 4) -> Trajectories:
    # one block: slots committed in the order 2, 0, 3, 1
    order = [2, 0, 3, 1]
    committed, eligible = [], []
    state = torch.zeros(L, dtype=torch.bool)
    for p in order:
        committed.append(state.clone())
        eligible.append(~state)
        state[p] = True
    R = len(order)
    return Trajectories(
        topk=torch.rand(R, L, 32).sort(-1, descending=True).values.half(), conf=torch.rand(R, L),
        log1m=-torch.rand(R, L), top1=torch.zeros(R, L, dtype=torch.int32),
        committed=torch.stack(committed), eligible=torch.stack(eligible), pos=torch.tensor(order),
        tok=torch.tensor([5, 6, 7, 8]), block_id=torch.zeros(R, dtype=torch.long), sample_id=torch.zeros(R, dtype=torch.long),
    )


def test_prefix_replay_examples_and_batch():
    traj = toy_trajectory()
    ex = replay_examples(traj, max_depth=4)
    # r in 1..3; k with r + k <= 3
    assert sorted(map(tuple, ex.tolist())) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (3, 0)]
    b = make_batch(traj, torch.tensor([[1, 2]]))
    # root = round 1 (slot 2 committed); path replays commits of rounds 1, 2 (slots 0 then 3); label slot 1
    assert b.label.tolist() == [1]
    assert b.depth[0].tolist() == [1, 0, 0, 2]
    assert b.status[0].tolist() == [ON_PATH, MASKED, COMMITTED, ON_PATH]
    # stale probabilities are those of round 0, one commit before the root
    torch.testing.assert_close(b.stale_conf[0], traj.topk[0, :, 0].float())


def test_round_batch_replays_every_depth_of_a_root():
    traj = toy_trajectory()
    b = make_round_batch(traj, torch.tensor([1]), max_depth=4, rank_pad=64)
    # root = round 1 (slot 2 committed); depths k = 0, 1, 2 are inside the block, k = 3 is not
    assert b.valid[0].tolist() == [True, True, True, False]
    assert b.label[0, :3].tolist() == [0, 3, 1]
    assert b.last[0, :3].tolist() == [-1, 0, 3]
    assert b.on_path[0, 0].tolist() == [False] * 4
    assert b.on_path[0, 2].tolist() == [True, False, False, True]
    assert b.status[0].tolist() == [MASKED, MASKED, COMMITTED, MASKED]
    # rank by the stale (round 0) float32 confidence among eligible slots; ineligible slots get the pad
    conf = traj.conf[0]
    elig = [0, 1, 3]
    expect = sorted(elig, key=lambda i: (-float(conf[i]), i))
    assert [int(b.rank[0, i]) for i in expect] == [0, 1, 2] and int(b.rank[0, 2]) == 64


def test_factored_training_inputs_equal_inference_inputs():
    """The tables the model is trained on (from stored trajectories) equal those it drafts from (live logits)."""
    torch.manual_seed(0)
    L, V = 8, 40
    logits = torch.randn(3, L, V) * 4
    logits[1, 5] = -20.0
    logits[1, 5, 7] = 25.0  # a near-1 confidence: float16 top-k rounds it to 1, log1m keeps it
    logits[1, 6] = logits[1, 5]  # an exact confidence tie: the rank must break it by lowest slot
    rec = TrajectoryRecorder(0, 0)
    state = torch.full((L,), 1)
    for r, p in enumerate([2, 4, 0]):
        elig = state == 1
        rec.on_commit(0, state.clone(), elig, view(logits[r]), p, 9)
        state[p] = 9
    traj = rec.result(mask_id=1)
    model = FactoredOrderModel(FactoredConfig(d_model=32, n_heads=4, n_layers=1, d_ff=64, max_block_len=L)).eval()
    b = make_round_batch(traj, torch.tensor([2]), max_depth=1, rank_pad=L)
    with torch.no_grad():
        trained = model.node_logits(model.tables(b.feat, b.rank, b.status), b.on_path, b.last)[0, 0]
        live = model.prepare(view(logits[1]), traj.committed[2], traj.eligible[2])
        drafted = model.node_logits(live, torch.zeros(1, 1, L, dtype=torch.bool), torch.full((1, 1), -1))[0, 0]
    torch.testing.assert_close(trained, drafted)
    assert int(b.rank[0, 5]) < int(b.rank[0, 6])
    assert float(traj.log1m[1, 5]) < -40  # precise where 1 - float16(p) is 0
    assert b.status[0].tolist().count(INACTIVE) == 0


@pytest.mark.parametrize("arch", ["encoder", "factored"])
def test_drafter_checkpoint_metadata_checked(tmp_path, arch, caplog):
    if arch == "factored":
        model = FactoredOrderModel(FactoredConfig())
    else:
        model = OrderModel(OrderModelConfig())
    save_drafter(model, DrafterMeta(feature_version_of(model), 32, (32,), "t", "task", 0.8, 0.3), tmp_path / "d")
    loaded, meta = load_drafter(tmp_path / "d", block_len=32)
    assert type(loaded) is type(model)
    assert meta.heldout_accuracy == 0.8
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k])
    with caplog.at_level(logging.WARNING, logger="lm_eval_spot.drafter.model"):
        load_drafter(tmp_path / "d", block_len=16)  # never trained at 16: runs, with one warning
    assert [r.getMessage() for r in caplog.records if "trained for block length(s) [32], the target runs "
            "block_len=16" in r.getMessage()]
    with pytest.raises(DrafterMismatchError, match="at most 64 slots, the target runs block_len=65"):
        load_drafter(tmp_path / "d", block_len=65)
    doc = json.loads((tmp_path / "d" / "drafter.json").read_text())
    doc["meta"]["feature_version"] = 7
    (tmp_path / "d" / "drafter.json").write_text(json.dumps(doc))
    with pytest.raises(DrafterMismatchError, match="feature version"):
        load_drafter(tmp_path / "d", block_len=32)
    doc["config"]["arch"] = "lstm"
    (tmp_path / "d" / "drafter.json").write_text(json.dumps(doc))
    with pytest.raises(DrafterMismatchError, match="unknown drafter arch 'lstm'"):
        load_drafter(tmp_path / "d", block_len=32)


@pytest.mark.parametrize("arch,version", [("factored", FACTORED_FEATURE_VERSION), ("encoder", FEATURE_VERSION)])
def test_training_command_collect_train_evaluate_resume(tiny_target_dir, tmp_path, arch, version):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Q: {i}+{i}=?\nA:"}) + "\n" for i in range(12)))
    out = tmp_path / "run"
    args = ["all", "--out", str(out), "--target", str(tiny_target_dir), "--prompts-file", str(prompts),
            "--n-prompts", "12", "--max-gen-toks", "20", "--arch", arch, "--steps", "6", "--batch", "16"]
    train_main(args)
    doc = json.loads((out / "drafter" / "drafter.json").read_text())
    assert doc["meta"]["block_lens"] == [8] and doc["meta"]["feature_version"] == version
    assert doc["config"].get("arch", "encoder") == arch
    assert 0.0 <= doc["meta"]["heldout_accuracy"] <= 1.0
    ck = torch.load(out / "train_ckpt.pt", weights_only=True)
    assert ck["step"] == 6
    # resume: more steps continue from the checkpoint; collection is not redone
    shard_mtime = next((out / "trajectories").glob("*.safetensors")).stat().st_mtime
    train_main([*args[:-4], "--steps", "9", "--batch", "16"])
    assert torch.load(out / "train_ckpt.pt", weights_only=True)["step"] == 9
    assert next((out / "trajectories").glob("*.safetensors")).stat().st_mtime == shard_mtime


def test_training_from_a_drafter_starts_at_its_weights(tiny_target_dir, tmp_path):
    """--init: the run takes the given drafter's architecture (over the size flags) and weights; a run resumed
    with another --init is refused."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Q: {i}*2=?\nA:"}) + "\n" for i in range(8)))
    torch.manual_seed(3)
    start = FactoredOrderModel(FactoredConfig(d_model=32, n_heads=4, n_layers=1, d_ff=64, d_pair=8))
    save_drafter(start, DrafterMeta(feature_version_of(start), 32, (4,), "other", "none"), tmp_path / "start")
    out = tmp_path / "ft"
    base = ["--out", str(out), "--target", str(tiny_target_dir), "--prompts-file", str(prompts), "--n-prompts", "8",
            "--max-gen-toks", "12", "--batch", "8"]
    train_main(["collect", *base])
    # lr 0: AdamW moves nothing (its decay is lr-scaled), so the result must be the start's weights exactly.
    train_main(["train", *base, "--init", str(tmp_path / "start"), "--steps", "1", "--lr", "0", "--d-model", "128"])
    got, meta = load_drafter(out / "drafter", block_len=8)
    assert got.cfg == start.cfg
    for k, v in start.state_dict().items():
        assert torch.equal(v, got.state_dict()[k]), k
    assert meta.extra["train"]["init"] == str((tmp_path / "start").resolve())
    # With a learning rate, the weights move from there (the same trajectories, another run folder).
    moving = [*base[2:], "--out", str(tmp_path / "ft2"), "--data", str(out), "--lr", "0.01"]
    train_main(["train", *moving, "--init", str(tmp_path / "start"), "--steps", "3"])
    moved, _ = load_drafter(tmp_path / "ft2" / "drafter", block_len=8)
    assert any(not torch.equal(v, moved.state_dict()[k]) for k, v in start.state_dict().items())
    other = FactoredOrderModel(FactoredConfig(d_model=32, n_heads=4, n_layers=1, d_ff=64, d_pair=8))
    save_drafter(other, DrafterMeta(feature_version_of(other), 32, (4,), "other", "none"), tmp_path / "other")
    with pytest.raises(ValueError, match="init"):
        train_main(["train", *moving, "--init", str(tmp_path / "other"), "--steps", "4"])


@pytest.fixture(scope="module", params=["factored", "encoder"])
def random_drafter_dir(tmp_path_factory, request):
    d = tmp_path_factory.mktemp("drafter")
    torch.manual_seed(0)
    model = FactoredOrderModel(FactoredConfig()) if request.param == "factored" else OrderModel(OrderModelConfig())
    save_drafter(model, DrafterMeta(feature_version_of(model), 32, (8,), "tiny", "none"), d)
    return d


@pytest.mark.parametrize(
    "mode,budget",
    [("spot", 4), ("spot-gamma", 4), ("spot-chain", 4), ("free-chain", 4), ("conf-tree", 4), ("graph", 4),
     ("oracle", 4), ("spot", "auto")],
)
def test_spot_modes_paired_with_control_are_exact(tiny_target_dir, random_drafter_dir, mode, budget):
    lm = SpotDLM(pretrained=str(tiny_target_dir), drafter=str(random_drafter_dir), mode=mode, budget=budget,
                 control="paired", seed=1)
    reqs = [Instance("generate_until", {}, (c, {"until": ["\n\n"], "max_gen_toks": 14, **kw}), i)
            for i, (c, kw) in enumerate([("Hi", {}), ("Q: 3+4", {"do_sample": True, "temperature": 1.0})])]
    lm.generate_until(reqs)
    info = lm.get_model_info()["spot"]
    assert info["exact_match_to_control"] == 1.0
    for key in ("control_nfe_per_sample", "nfe_reduction", "throughput_ratio", "mean_accepted_per_round", "budget"):
        assert key in info
    assert info["budget"] == budget
    if mode == "oracle":
        assert info["mean_accepted_per_round"] > 0
        # Each request drafts its own control decode's commits 4 at a time, so every request takes at most half
        # its control run's forwards (also the first chunk's, whose control decode must therefore run first).
        assert all(2 * m <= c for m, c in lm.generation.paired.nfe), lm.generation.paired.nfe


def test_rejection_verifier_through_the_model_class(tiny_target_dir, random_drafter_dir):
    lm = SpotDLM(pretrained=str(tiny_target_dir), drafter=str(random_drafter_dir), mode="spot-chain", budget=3,
                 verify="rejection", seed=1)
    out = lm.generate_until([Instance("generate_until", {}, ("Hi", {"until": ["\n\n"], "max_gen_toks": 10,
                                                                     "do_sample": True, "temperature": 1.0}), 0)])
    assert len(out) == 1 and lm.get_model_info()["spot_args"]["verify"] == "rejection"
    with pytest.raises(SpotArgError, match="verify=rejection needs a chain"):
        SpotDLM(pretrained=str(tiny_target_dir), mode="spot", verify="rejection")
    with pytest.raises(SpotArgError, match="budget=auto is not accepted with mode=oracle"):
        SpotDLM(pretrained=str(tiny_target_dir), mode="oracle", budget="auto")


def test_drafter_arg_errors(tiny_target_dir, tmp_path):
    with pytest.raises(SpotArgError, match="drafter=.*not a drafter folder"):
        SpotDLM(pretrained=str(tiny_target_dir), drafter=str(tmp_path), mode="spot")
    with pytest.raises(SpotArgError, match="gamma"):
        SpotDLM(pretrained=str(tiny_target_dir), mode="control", gamma=2)
    with pytest.raises(SpotArgError, match="control='maybe'"):
        SpotDLM(pretrained=str(tiny_target_dir), mode="control", control="maybe")


def test_drafter_at_an_untrained_block_length_runs_with_a_warning(tiny_target_dir, random_drafter_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="lm_eval_spot.drafter.model"):
        lm = SpotDLM(pretrained=str(tiny_target_dir), drafter=str(random_drafter_dir), block_len=16)
    assert lm.proposer is not None
    assert sum("the target runs block_len=16" in r.getMessage() for r in caplog.records) == 1


def test_factored_host_path_equals_torch_path():
    """On the CPU node probabilities come from numpy copies of the round's tables; same numbers as torch's."""
    from dataclasses import replace

    torch.manual_seed(2)
    L = 16
    model = FactoredOrderModel(FactoredConfig(max_block_len=L)).eval()
    committed = torch.zeros(L, dtype=torch.bool)
    committed[:4] = True
    eligible = ~committed
    eligible[-2:] = False
    prep = model.prepare(view(torch.randn(L, 50) * 3), committed, eligible)
    assert prep.host is not None
    maps = torch.zeros(5, L, dtype=torch.long)
    maps[1, 6] = 1
    maps[2, [6, 9]] = torch.tensor([1, 2])
    maps[3, [5, 6, 7, 8]] = torch.tensor([4, 3, 2, 1])
    maps[4, 4:14] = torch.arange(1, 11)  # every candidate on the path: an all-zero row
    fast = model.node_probs(prep, maps)
    slow = model.node_probs(replace(prep, host=None), maps)
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-5)
    assert fast[4].sum() == 0 and torch.allclose(fast[:4].sum(-1), torch.ones(4))
    assert (fast[:, ~eligible] == 0).all() and (fast[3, 5:9] == 0).all()


def test_factored_without_slot_embedding_is_permutation_equivariant():
    """--no-slot-embedding (the transfer ablation): the model can tell slots apart only through their inputs, so
    permuting the slots permutes its scores (with the slot embedding on, it does not)."""
    torch.manual_seed(4)
    L = 12
    perm = torch.randperm(L)
    feat, rank = torch.rand(1, L, 65), torch.randint(0, L, (1, L))
    status = torch.full((1, L), MASKED)
    on = torch.zeros(1, 2, L, dtype=torch.bool)
    on[0, 1, 3] = True
    last = torch.tensor([[-1, 3]])
    inv = torch.argsort(perm)
    for slot_embedding in (False, True):
        model = FactoredOrderModel(FactoredConfig(max_block_len=L, slot_embedding=slot_embedding)).eval()
        with torch.no_grad():
            a = model.node_logits(model.tables(feat, rank, status), on, last)
            b = model.node_logits(model.tables(feat[:, perm], rank[:, perm], status[:, perm]), on[..., perm],
                                  inv[last.clamp_min(0)].masked_fill(last < 0, -1))
        same = torch.allclose(a[..., perm], b, atol=1e-5)
        assert same is not slot_embedding


@pytest.mark.parametrize("heads,layers", [(4, 1), (8, 3)])
def test_functional_encoder_pass_equals_the_module(heads, layers):
    """Inference runs the order model's encoder as functional ops; it must equal nn.TransformerEncoder's eval."""
    from torch import nn

    from lm_eval_spot.drafter.encoder import encode

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, heads, 96, 0.0, batch_first=True, norm_first=True)
    enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()
    for p in enc.parameters():  # away from the init, so a wrong weight or transpose shows
        p.data.add_(0.1 * torch.randn_like(p))
    x = torch.randn(3, 16, 64)
    with torch.no_grad():
        assert torch.allclose(encode(enc, x), enc(x), atol=1e-5)


def test_training_a_narrower_factored_drafter_that_reads_fewer_stale_inputs(tiny_target_dir, tmp_path):
    """--top-k / --d-pair (the capacity sweep of issue 16): the model is built, trained and saved at that size,
    reads only the top-k it was trained on, and drafts exactly (paired control) through the plugin."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Q: {i}+{i}=?\nA:"}) + "\n" for i in range(8)))
    out = tmp_path / "run"
    base = ["all", "--out", str(out), "--target", str(tiny_target_dir), "--prompts-file", str(prompts),
            "--n-prompts", "8", "--max-gen-toks", "16", "--steps", "4", "--batch", "8", "--d-model", "16",
            "--heads", "2", "--layers", "1", "--d-ff", "24"]
    with pytest.raises(SystemExit):
        train_main([*base, "--top-k", "33"])
    train_main([*base, "--top-k", "4", "--d-pair", "8"])
    doc = json.loads((out / "drafter" / "drafter.json").read_text())
    assert doc["config"]["top_k"] == 4 and doc["config"]["d_pair"] == 8 and doc["meta"]["top_k"] == 4
    model, _ = load_drafter(out / "drafter", block_len=8)
    assert model.inp.weight.shape == (16, 2 * 4 + 1)
    assert model.pairs.weight.shape[0] == 4 * 8
    lm = SpotDLM(pretrained=str(tiny_target_dir), drafter=str(out / "drafter"), mode="spot", budget=4,
                 control="paired", seed=1)
    lm.generate_until([Instance("generate_until", {}, ("Q: 2+5", {"until": ["\n\n"], "max_gen_toks": 14}), 0)])
    assert lm.get_model_info()["spot"]["exact_match_to_control"] == 1.0
