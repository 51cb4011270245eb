"""The likelihood bound against a reference written here from its definition.

The reference imports nothing from lm_eval_spot: for every unit (a block's continuation tokens on a block-causal
target, the whole continuation on a bidirectional one) it enumerates every non-empty mask pattern S, recomputes the
whole sequence with S masked through the model's own forward (no cache), and forms

    B = (1/k) * sum_l (k/l) * mean_{|S|=l} sum_{i in S} log p(x_i | x with S masked).
"""

from __future__ import annotations

import math
from itertools import combinations

import pytest
import torch

from lm_eval_spot.settings.args import parse_args
from lm_eval_spot.families import load_target
from lm_eval_spot.likelihood.scorer import LikelihoodConfig, Pair, score_pairs

from helpers.remote_fixtures import build_remote, needs_remote, save_checkpoint, tokenizer_mask_id


# ---- the reference ----------------------------------------------------------------------------------------------
def block_causal_logits(model, ids: list[int], L: int) -> torch.Tensor:
    """Position-aligned logits [N, V] of one sequence under a block-causal additive mask (native causal-LM classes)."""
    n = len(ids)
    blk = torch.arange(n) // L
    mask = torch.zeros(n, n)
    mask[blk[None, :] > blk[:, None]] = torch.finfo(torch.float32).min
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), attention_mask=mask[None, None],
                     position_ids=torch.arange(n)[None]).logits[0].float()


def unit_bound(logits_of, seq: list[int], positions: list[int], mask: int) -> float:
    """The exact bound of one unit: `logits_of(ids)` gives position-aligned logits of the sequence `ids`."""
    k = len(positions)
    total = 0.0
    for l in range(1, k + 1):
        acc = 0.0
        for S in combinations(positions, l):
            ids = [mask if i in S else t for i, t in enumerate(seq)]
            logp = torch.log_softmax(logits_of(ids).double(), dim=-1)
            acc += sum(float(logp[i, seq[i]]) for i in S)
        total += (k / l) * acc / math.comb(k, l) / k
    return total


def reference_block_causal(model, ctx: list[int], cont: list[int], L: int, mask: int) -> float:
    """Sum over the continuation's blocks; block b sees the clean blocks before it, its own tail padded with masks."""
    seq = ctx + cont
    total = 0.0
    for b in range(len(ctx) // L, -(-len(seq) // L)):
        window = seq[: (b + 1) * L] + [mask] * max(0, (b + 1) * L - len(seq))
        positions = [i for i in range(b * L, min(len(seq), (b + 1) * L)) if i >= len(ctx)]
        total += unit_bound(lambda ids: block_causal_logits(model, ids, L), window, positions, mask)
    return total


def reference_bidirectional(logits_of, ctx: list[int], cont: list[int], mask: int) -> float:
    seq = ctx + cont
    return unit_bound(logits_of, seq, list(range(len(ctx), len(seq))), mask)


# ---- the embedded target ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embedded():
    return load_target(parse_args({"mode": "control"}))


def encode(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text, add_special_tokens=False)["input_ids"]


CTX = "Q: 7+5-3+8+2\nA: Step 1: 7 + 5 = 12\nStep 2: 12"  # 30 tokens: a continuation of 4 spans two blocks of 32
GOOD = " Step 1: 7 + 5 = 12\nStep 2: 12 - 3 = 9\nStep 3: 9 + 8 = 17\nStep 4: 17 + 2 = 19\n#### 19"
BAD = " Step 1: 7 + 5 = 12\nStep 2: 12 - 3 = 8\nStep 3: 8 + 8 = 16\nStep 4: 16 + 2 = 18\n#### 18"


def score(loaded, ctx, cont, mc_num, seed=0, bs=1, **kw):
    return score_pairs(loaded.adapter, [Pair(tuple(ctx), tuple(cont), seed)], LikelihoodConfig(mc_num=mc_num, **kw),
                       batch_size=bs)[0]


@pytest.mark.parametrize("n_ctx,n_cont", [(30, 4), (10, 4), (31, 1)])
def test_exact_mode_equals_the_enumerated_bound_on_the_embedded_target(embedded, n_ctx, n_cont):
    ids = encode(embedded, CTX + " - 3 = 9")
    ctx, cont = ids[:n_ctx], ids[n_ctx : n_ctx + n_cont]
    info = embedded.adapter.info
    ref = reference_block_causal(embedded.adapter.model, ctx, cont, info.block_len, info.mask_id)
    got = score(embedded, ctx, cont, mc_num=15)
    assert got.exact and got.variance == 0.0
    assert got.logprob == pytest.approx(ref, abs=1e-5)


def test_a_contexts_choices_share_its_prefill_and_each_equals_the_enumerated_bound(embedded):
    ids = encode(embedded, CTX + " - 3 = 9")
    info = embedded.adapter.info
    ctx = ids[:30]
    conts = [ids[30:34], ids[30:32], [ids[30], 7, ids[32], 9]]  # 2 + 2 tokens, 2 tokens, another 2 + 2
    pairs = [Pair(tuple(ctx), tuple(c), 0) for c in conts]
    grouped = score_pairs(embedded.adapter, pairs, LikelihoodConfig(mc_num=15), batch_size=2)
    for c, got in zip(conts, grouped, strict=True):
        ref = reference_block_causal(embedded.adapter.model, ctx, c, info.block_len, info.mask_id)
        assert got.exact and got.logprob == pytest.approx(ref, rel=1e-6, abs=1e-5)  # (float32 logits)
    # one shared forward scored all three first blocks; the two longer ones took one more each
    assert [g.forwards for g in grouped] == [2, 1, 2]
    alone = score_pairs(embedded.adapter, pairs, LikelihoodConfig(mc_num=15), groups=[[0], [1], [2]])
    assert [a.forwards for a in alone] == [2, 1, 2]
    for a, g in zip(alone, grouped, strict=True):
        assert a.logprob == pytest.approx(g.logprob, abs=1e-5)


def test_monte_carlo_mean_matches_the_enumerated_bound(embedded):
    ids = encode(embedded, CTX + " - 3 = 9")
    ctx, cont = ids[:10], ids[10:16]  # k = 6 in one block: 63 patterns, sampled with 16 rows
    info = embedded.adapter.info
    ref = reference_block_causal(embedded.adapter.model, ctx, cont, info.block_len, info.mask_id)
    one = score(embedded, ctx, cont, mc_num=16, seed=1)
    assert not one.exact and one.se > 0
    assert abs(one.logprob - ref) <= 3 * one.se
    many = [score(embedded, ctx, cont, mc_num=16, seed=s) for s in range(20)]
    mean = sum(e.logprob for e in many) / len(many)
    se = math.sqrt(sum(e.variance for e in many)) / len(many)
    assert abs(mean - ref) <= 3 * se, (mean, ref, se)


def test_guidance_zero_is_the_plain_bound_and_guidance_changes_it(embedded):
    ids = encode(embedded, CTX + " - 3 = 9")
    plain = score(embedded, ids[:10], ids[10:13], mc_num=7)
    guided = score(embedded, ids[:10], ids[10:13], mc_num=7, cfg=1.0)
    assert guided.exact and guided.forwards == 2 * plain.forwards
    assert guided.logprob != pytest.approx(plain.logprob, abs=1e-4)


def test_batch_size_and_minibatch_do_not_change_the_numbers(embedded):
    ids = encode(embedded, "Q: 7+5-3+8+2\nA:")
    pairs = [Pair(tuple(ids), tuple(encode(embedded, a)), 3) for a in (GOOD, BAD, GOOD[:30])]
    cfg = LikelihoodConfig(mc_num=24, mc_batch=8)
    one = score_pairs(embedded.adapter, pairs, cfg, batch_size=1)
    three = score_pairs(embedded.adapter, pairs, cfg, batch_size=3)
    assert [(e.logprob, e.variance) for e in one] == [(e.logprob, e.variance) for e in three]
    big = score_pairs(embedded.adapter, pairs, LikelihoodConfig(mc_num=24, mc_batch=24), batch_size=2)
    for a, b in zip(one, big, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_the_trained_target_prefers_the_right_solution(embedded):
    ctx = encode(embedded, "Q: 7+5-3+8+2\nA:")
    good, bad = (score(embedded, ctx, encode(embedded, a), mc_num=32, seed=5) for a in (GOOD, BAD))
    assert good.logprob > bad.logprob + 3 * math.sqrt(good.variance + bad.variance)
    assert good.forwards == 3 and good.rows == 3 * 32  # 15 + 79 tokens: three blocks of 32, one forward each


def diff_variance(loaded, ctx: list[int], a: list[int], b: list[int], sharing: str, seeds: int = 30) -> float:
    """Variance over seeds of score(a) - score(b), the quantity a multiple-choice decision reads."""
    from lm_eval_spot.likelihood.harness import pair_seed

    diffs = []
    for s in range(seeds):
        pa = Pair(tuple(ctx), tuple(a), pair_seed(s, ctx, a, sharing))
        pb = Pair(tuple(ctx), tuple(b), pair_seed(s, ctx, b, sharing))
        ea, eb = score_pairs(loaded.adapter, [pa, pb], LikelihoodConfig(mc_num=8), batch_size=2)
        diffs.append(ea.logprob - eb.logprob)
    return float(torch.tensor(diffs, dtype=torch.float64).var())


def test_common_random_masks_lower_the_variance_of_a_choice_difference(tiny_target_dir):
    # A random-weight target is uncertain everywhere, so two choices share most of their Monte Carlo noise (on a
    # trained target the right choice's own estimate barely varies and the wrong one's error terms are its own:
    # docs/benchmarks.md, "Likelihood"). Choices differing in one token of a sampled 8-token block:
    loaded = load_target(parse_args({"pretrained": str(tiny_target_dir), "mode": "control"}))
    ctx, a = [5, 9, 17, 23, 40], [30 + i for i in range(12)]
    b = list(a)
    b[6] = 77
    common = diff_variance(loaded, ctx, a, b, "common")
    independent = diff_variance(loaded, ctx, a, b, "independent")
    assert common < 0.1 * independent, (common, independent)


# ---- the real families' forwards (tiny random-weight models from the official code) ------------------------------
def sdar_logits(model, ids: list[int], L: int) -> torch.Tensor:
    n = len(ids)
    blk = torch.arange(n) // L
    allowed = blk[None, :] <= blk[:, None]  # SDAR's remote forward: boolean, True = attend
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), attention_mask=allowed[None],
                     position_ids=torch.arange(n)[None]).logits[0].float()


def llada2_logits(model, ids: list[int], L: int) -> torch.Tensor:
    n = len(ids)
    blk = torch.arange(n) // L
    add = torch.zeros(n, n)
    add[blk[None, :] > blk[:, None]] = torch.finfo(torch.float32).min  # additive 4D mask (its SDPA path)
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), attention_mask=add[None, None],
                     position_ids=torch.arange(n)[None]).logits[0].float()


def whole_logits(model, fam: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        if fam == "llada":
            return model(torch.tensor([ids])).logits[0].float()
        raw = model(torch.tensor([ids]), "full", None).logits[0].float()
    return torch.cat([raw[:1], raw[:-1]])  # Dream: the prediction for i is raw output i - 1


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    mask = tokenizer_mask_id()
    out = {}
    for fam in ("sdar", "llada2_moe", "llada", "dream"):
        model = build_remote(fam, seed=1, scale=4.0, mask_token_id=mask)
        out[fam] = (model, save_checkpoint(model, tmp_path_factory.mktemp(fam)))
    return out


def load(families, fam: str, impl: str, L: int = 4):
    raw = {"pretrained": str(families[fam][1]), "impl": impl, "mode": "control", "block_len": L,
           "trust_remote_code": "true"}
    return load_target(parse_args(raw))


CASES = [("sdar", "native"), ("sdar", "remote"), ("llada2_moe", "remote"), ("llada", "native"), ("llada", "remote"),
         ("dream", "native"), ("dream", "remote")]


@needs_remote
@pytest.mark.parametrize("fam,impl", CASES)
def test_every_family_exact_mode_equals_the_enumerated_bound(families, fam, impl):
    model, _ = families[fam]
    loaded = load(families, fam, impl)
    mask, L = loaded.adapter.info.mask_id, 4
    ctx, cont = [5, 9, 17, 23, 40, 41], [60, 61, 62, 63, 70]  # block-causal: units of 2 and 3 tokens
    if fam in ("llada", "dream"):
        cont = cont[:4]
        ref = reference_bidirectional(lambda ids: whole_logits(model, fam, ids), ctx, cont, mask)
    else:
        fwd = sdar_logits if fam == "sdar" else llada2_logits
        ref = sum(
            unit_bound(lambda ids: fwd(model, ids, L), (ctx + cont)[: (b + 1) * L] + [mask] * max(0, (b + 1) * L - 11),
                       [i for i in range(b * L, min(11, (b + 1) * L)) if i >= 6], mask)
            for b in (1, 2))
    got = score(loaded, ctx, cont, mc_num=15)
    assert got.exact and got.logprob == pytest.approx(ref, abs=1e-4)
    # the same pair next to another choice of its context (block-causal: one prefill, then forked sessions)
    other = [61, 60] + cont[2:]
    both = score_pairs(loaded.adapter, [Pair(tuple(ctx), tuple(cont), 0), Pair(tuple(ctx), tuple(other), 0)],
                       LikelihoodConfig(mc_num=15), batch_size=2)
    assert both[0].logprob == pytest.approx(ref, abs=1e-4)
    assert both[1].logprob != pytest.approx(ref, abs=1e-4)
    mc = score(loaded, ctx, cont, mc_num=6, seed=2)
    if fam in ("llada", "dream"):  # 15 patterns, 6 rows: sampled
        assert not mc.exact and abs(mc.logprob - ref) <= 3 * mc.se


@needs_remote
@pytest.mark.parametrize("fam,impl", [("llada", "native"), ("dream", "native"), ("llada", "remote"), ("dream", "remote")])
def test_bidirectional_batches_do_not_change_the_numbers(families, fam, impl):
    """Batch size 3 gives every pair's numbers bit for bit; its sequences of different lengths share ONE forward
    per step on the native classes, one per length through the official code (the first context's two pairs: three
    Monte Carlo chunks in lockstep; the second's pair: its 7 masking patterns enumerated, two chunks)."""
    loaded = load(families, fam, impl)
    pairs = [Pair((5, 9, 17), (60, 61, 62, 63, 64, 65), 4), Pair((5, 9, 17), (70, 71, 72, 73, 74, 75), 4),
             Pair((5, 9), (60, 61, 62), 4)]
    cfg = LikelihoodConfig(mc_num=12, mc_batch=5)
    tally = loaded.adapter.tally
    t0 = tally.forwards
    one = score_pairs(loaded.adapter, pairs, cfg, batch_size=1)
    t1 = tally.forwards
    three = score_pairs(loaded.adapter, pairs, cfg, batch_size=3)
    for a, b in zip(one, three, strict=True):
        assert a.logprob == b.logprob and a.se == b.se
    assert t1 - t0 == 3 + 2
    assert tally.forwards - t1 == (3 if impl == "native" else 3 + 2)


class _Req:
    def __init__(self, context: str, continuation: str, doc_id: int, task: str = "t") -> None:
        self.args, self.doc_id, self.task_name = (context, continuation), doc_id, task


def test_the_greedy_flag_is_exact_greedy_decoding():
    from helpers.reference import reference_decode

    from lm_eval_spot.harness.model import SpotDLM

    lm = SpotDLM(mode="control", mc_num=4)
    context = "Q: 7+5-3+8+2\nA:"
    ctx = lm.encode(context)
    info = lm.adapter.info
    ids, _ = reference_decode(lm.adapter.model, ctx, info.block_len, info.mask_id, set(info.stop_ids), 12, 0.0, 0)
    good = lm.tokenizer.decode(ids)
    assert lm.encode(context + good)[len(ctx):] == ids  # the text round-trips to the decoded ids
    bad = good[:-1] + ("1" if good[-1] != "1" else "2")
    reqs = [_Req(context, good, 0), _Req(context, bad, 1)]
    assert [g for _, g in lm.loglikelihood(reqs)] == [True, False]
    # one document with two choices: a multiple-choice question, whose flags auto leaves False ...
    mc = [_Req(context, good, 7), _Req(context, bad, 7)]
    assert [g for _, g in lm.loglikelihood(mc)] == [False, False]
    # ... and greedy=always computes
    lm_always = SpotDLM(mode="control", mc_num=4, greedy="always")
    assert [g for _, g in lm_always.loglikelihood(mc)] == [True, False]
    tasks = lm.get_model_info()["spot"]["likelihood"]["tasks"]
    assert tasks["t"]["greedy_computed"] == 2 and tasks["t"]["greedy_true"] == 1 and tasks["t"]["mc_docs"] == 1


def test_rolling_windows_sum_to_the_documents_bound():
    from lm_eval_spot.harness.model import SpotDLM

    lm = SpotDLM(mode="control", mc_num=8)
    text = "Q: 7+5-3+8+2\nA: Step 1: 7 + 5 = 12\nStep 2: 12 - 3 = 9"
    [total] = lm.loglikelihood_rolling([_Req(text, "", 0, "ppl")][:1])
    # one window (the document fits the context): the same as the pair (prefix token, document)
    [(single, _)] = lm.loglikelihood([_Req("", text, 0, "pair")])
    assert total == pytest.approx(single, abs=1e-9)
    lm_short = SpotDLM(mode="control", mc_num=8)
    windows = lm_short.likelihood.window_len()
    assert windows == 511  # the embedded target's 512 positions, whole blocks of 32
