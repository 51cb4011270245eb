"""Issue 45: top_k / top_p honoured at T > 0 exactly as transformers' warpers define them, the same in control and
in every verifier (SPOT's ids equal control's); every other generation kwarg refused by name; bad values are
one-line errors before anything is decoded."""

from __future__ import annotations

import math

import pytest
import torch
from lm_eval.api.instance import Instance
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from lm_eval_spot.adapters.base import TargetInfo
from lm_eval_spot.adapters.block_causal import BlockCausalAdapter
from lm_eval_spot.decoding.loop import DecodeConfig, decode
from lm_eval_spot.decoding.sampling import Truncation, truncate
from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
from lm_eval_spot.drafter.spot_proposer import LearnedOrder, TreeConfig, TreeProposer
from lm_eval_spot.harness.gen_kwargs import GenKwargsError, check_gen_kwargs, parse_gen_kwargs
from lm_eval_spot.harness.model import SpotDLM

from helpers.reference import reference_decode
from helpers.tiny import build_model

V, MASK, EOS = 40, 2, 1


def hf_warp(top_k: int, top_p: float):
    """transformers' own warpers, in generate()'s order (top-k, then top-p): the reference."""
    def warp(scores: torch.Tensor) -> torch.Tensor:
        if top_k > 0:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1.0:
            scores = TopPLogitsWarper(top_p)(None, scores)
        return scores
    return warp


# ---- the truncation itself ----------------------------------------------------------------------------------
@pytest.mark.parametrize("trial", range(60))
def test_truncation_equals_transformers_warpers_without_ties(trial):
    gen = torch.Generator().manual_seed(trial)
    n_vocab = int(torch.randint(2, 4000, (1,), generator=gen))
    scores = torch.randn(3, n_vocab, generator=gen, dtype=torch.float64) * 3  # continuous: no exact ties
    top_k = [0, 1, 2, 5, n_vocab, n_vocab + 3][trial % 6]
    top_p = [1.0, 0.9, 0.5, 0.05, 0.999][trial % 5]
    ref = hf_warp(top_k, top_p)(scores.clone())
    got = truncate(scores, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert torch.equal(got[~torch.isinf(got)], scores[~torch.isinf(got)])  # survivors keep their scores


def _reference_top_p_with_ties(row: list[float], top_p: float) -> set[int]:
    """Top-p's kept set, ties broken by token id (lower id drops first), written from the definition."""
    order = sorted(range(len(row)), key=lambda i: (row[i], i))  # ascending, stable
    m = max(row)
    w = [math.exp(row[i] - m) for i in order]
    total, cum, kept = sum(w), 0.0, set()
    for j, i in enumerate(order):
        cum += w[j] / total
        if cum > 1.0 - top_p or j == len(order) - 1:
            kept.add(i)
    return kept


@pytest.mark.parametrize("trial", range(20))
def test_top_p_breaks_exact_ties_by_token_id_and_top_k_keeps_every_tie(trial):
    gen = torch.Generator().manual_seed(100 + trial)
    scores = (torch.randn(2, 200, generator=gen, dtype=torch.float64) * 4).round() / 2  # many exact ties
    top_p = [0.3, 0.6, 0.9, 0.97][trial % 4]
    got = truncate(scores, 0, top_p)
    for r in range(2):
        assert set(torch.nonzero(~torch.isinf(got[r])).flatten().tolist()) == \
            _reference_top_p_with_ties(scores[r].tolist(), top_p)
    k = 1 + trial
    assert torch.equal(torch.isinf(truncate(scores, k, 1.0)), torch.isinf(TopKLogitsWarper(k)(None, scores.clone())))


def test_truncation_validates_its_values():
    for bad in ({"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 2.5}):
        with pytest.raises(ValueError):
            Truncation(**bad)
    assert not Truncation().active and Truncation(top_k=3).active and Truncation(top_p=0.9).active
    with pytest.raises(ValueError):
        DecodeConfig(max_gen_toks=4, temperature=1.0, top_p=2.0)


# ---- the decoder ------------------------------------------------------------------------------------------
def tiny_adapter(L: int = 8, seed: int = 0) -> BlockCausalAdapter:
    return BlockCausalAdapter(build_model(V, seed=seed, block_length=L, embed_scale=4.0),
                              TargetInfo(MASK, frozenset({EOS}), L, "zero", True, V))


PROMPTS = [list(range(5, 12)), [20, 21, 22], list(range(9, 25))]


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.9), (5, 0.9), (3, 0.5)])
def test_control_draws_from_the_warped_distribution_as_the_naive_reference(top_k, top_p):
    adapter = tiny_adapter()
    cfg = DecodeConfig(max_gen_toks=20, temperature=1.0, top_k=top_k, top_p=top_p)
    plain = DecodeConfig(max_gen_toks=20, temperature=1.0)
    changed = 0
    for i, prompt in enumerate(PROMPTS):
        got = decode(adapter, prompt, cfg, seed=40 + i)
        ref, _ = reference_decode(adapter.model, prompt, 8, MASK, {EOS}, 20, 1.0, seed=40 + i,
                                  warp=hf_warp(top_k, top_p))
        assert got.token_ids == ref
        changed += got.token_ids != decode(adapter, prompt, plain, seed=40 + i).token_ids
    assert changed  # the truncation is not a no-op on these prompts (a decoder that ignored it would fail above)


def test_top_k_1_is_greedy_whatever_the_seed():
    adapter = tiny_adapter()
    greedy = DecodeConfig(max_gen_toks=20)
    k1 = DecodeConfig(max_gen_toks=20, temperature=1.0, top_k=1)
    t1 = DecodeConfig(max_gen_toks=20, temperature=1.0)
    differ = 0
    for prompt in PROMPTS:
        base = decode(adapter, prompt, greedy, seed=0).token_ids
        assert decode(adapter, prompt, k1, seed=1).token_ids == base == decode(adapter, prompt, k1, seed=2).token_ids
        differ += decode(adapter, prompt, t1, seed=1).token_ids != decode(adapter, prompt, t1, seed=2).token_ids
    assert differ  # plain sampling does depend on the seed here


def random_drafter(seed: int) -> FactoredOrderModel:
    torch.manual_seed(seed)
    return FactoredOrderModel(FactoredConfig())


@pytest.mark.parametrize("top_k,top_p", [(5, 0.9), (0, 0.6), (2, 1.0)])
@pytest.mark.parametrize("chain", [False, True])
def test_spot_equals_control_under_truncation(top_k, top_p, chain):
    adapter = tiny_adapter(L=16, seed=1)
    cfg = DecodeConfig(max_gen_toks=28, temperature=1.0, top_k=top_k, top_p=top_p, lookahead=True)
    prop = TreeProposer(LearnedOrder(random_drafter(3)), TreeConfig(budget=6, chain=chain))
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        control = decode(adapter, prompt, cfg, seed=7 + i)
        spot = decode(adapter, prompt, cfg, seed=7 + i, proposer=prop)
        assert spot.token_ids == control.token_ids
        accepted += sum(spot.accepted)
    assert accepted  # drafts were accepted: the verifier compared drafted tokens, not only the root's


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (0, 1e-9)])
def test_rejection_verifier_samples_the_truncated_law(top_k, top_p):
    """Accept-residual chains at T > 0 are exact in distribution: truncated to one token (top_k=1, or a top_p
    below any top probability) every commit is the greedy one, whatever the draws."""
    adapter = tiny_adapter(L=8, seed=2)
    cfg = DecodeConfig(max_gen_toks=16, temperature=1.0, top_k=top_k, top_p=top_p)
    greedy = DecodeConfig(max_gen_toks=16)
    prop = TreeProposer(LearnedOrder(random_drafter(5)), TreeConfig(budget=4, chain=True))
    for i, prompt in enumerate(PROMPTS):
        base = decode(adapter, prompt, greedy, seed=0).token_ids
        assert decode(adapter, prompt, cfg, seed=i, proposer=prop, verify="rejection").token_ids == base


# ---- generation kwargs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw,match", [
    ({"max_gen_toks": -3}, "max_gen_toks=-3 is not a positive integer"),
    ({"max_gen_toks": 0}, "max_gen_toks=0 is not a positive integer"),
    ({"max_gen_toks": "abc"}, "max_gen_toks='abc' is not a positive integer"),
    ({"max_new_tokens": 2.5}, "max_new_tokens=2.5 is not a positive integer"),
    ({"temperature": -1, "do_sample": True}, "temperature=-1 is not a number >= 0"),
    ({"temperature": float("nan"), "do_sample": True}, "temperature=nan is not a number >= 0"),
    ({"until": 5}, "until=5 is not a string or a list of strings"),
    ({"until": ["a", 3]}, r"until=\['a', 3\] is not a string"),
    ({"top_p": 2.0}, "top_p=2.0 is not a number with 0 < top_p <= 1"),
    ({"top_p": 0}, "top_p=0 is not a number with 0 < top_p <= 1"),
    ({"top_k": -2}, "top_k=-2 is not an integer >= 1"),
    ({"top_k": 1.5}, "top_k=1.5 is not an integer >= 1"),
    ({"do_sample": "yes"}, "do_sample='yes' is not true or false"),
    ({"repetition_penalty": 1.2}, "repetition_penalty=1.2 is not supported .* accepted: until"),
    ({"num_beams": 4}, "num_beams=4 is not supported"),
    ({"min_p": 0.1}, "min_p=0.1 is not supported by spot-dlm's decoder; accepted: until"),
])
def test_bad_generation_kwargs_are_refused_by_name(raw, match):
    with pytest.raises(GenKwargsError, match=match):
        check_gen_kwargs(raw)


def test_good_generation_kwargs_follow_lm_evals_semantics():
    g = parse_gen_kwargs({"until": "Q:", "max_new_tokens": 7, "do_sample": True, "temperature": 0.7, "top_k": 5,
                          "top_p": 0.9, "num_beams": 1}, 256)
    assert (g.until, g.max_gen_toks, g.temperature, g.top_k, g.top_p) == (("Q:",), 7, 0.7, 5, 0.9) and g.truncates
    g = parse_gen_kwargs({"do_sample": False, "temperature": 0.8, "top_k": 3}, 256)  # greedy: lm-eval's rule
    assert (g.max_gen_toks, g.temperature) == (256, 0.0) and not g.truncates
    g = parse_gen_kwargs({"temperature": 0.5}, 256)  # no do_sample: sampling since temperature > 0
    assert g.temperature == 0.5 and g.until == ()


# ---- through the model class ----------------------------------------------------------------------------
def _req(context: str, idx: int = 0, **kw) -> Instance:
    return Instance("generate_until", {}, (context, {"until": ["\n\n"], "max_gen_toks": 16, **kw}), idx,
                    metadata=("spot_arith", idx, 1))


@pytest.fixture(scope="module")
def embedded() -> SpotDLM:
    return SpotDLM(control="paired", seed=1)


CONTEXTS = [f"Q: {a}+{b}=" for a, b in ((12, 7), (3, 45), (60, 9), (8, 8), (71, 20), (5, 33), (40, 2), (19, 19))]
SAMPLE = {"do_sample": True, "temperature": 1.0, "top_k": 5, "top_p": 0.9}


def test_a_bad_kwarg_names_the_request_and_nothing_is_decoded(embedded):
    before = len(embedded.generation.sample_log)
    with pytest.raises(GenKwargsError, match=r"^spot-dlm: request 1 \(task spot_arith, doc 1; set by --gen_kwargs "
                                             r"or the task's generation_kwargs\): generation kwarg top_p=2.0 .* "
                                             r"nothing was decoded$"):
        embedded.generate_until([_req(CONTEXTS[0]), _req(CONTEXTS[1], 1, top_p=2.0)])
    assert len(embedded.generation.sample_log) == before


@pytest.mark.parametrize("bs", [1, 8])
def test_embedded_target_spot_equals_control_with_top_k_and_top_p(embedded, bs):
    embedded.sizes.batch_size = bs  # the chunk size generate_until decodes together
    n = len(embedded.generation.paired.same)
    embedded.generate_until([_req(c, i, **SAMPLE) for i, c in enumerate(CONTEXTS)])
    assert len(embedded.generation.paired.same) == n + len(CONTEXTS) and all(embedded.generation.paired.same[n:])
    spot = embedded.get_model_info()["spot"]
    assert spot["top_k"] == 5 and spot["top_p"] == 0.9 and spot["exact_match_to_control"] == 1.0


def test_top_k_1_gives_the_same_outputs_under_two_seeds_on_the_embedded_target():
    outs = {}
    for seed in (1, 2):
        lm = SpotDLM(seed=seed)
        outs[seed, 1] = lm.generate_until([_req(c, i, do_sample=True, temperature=1.0, top_k=1)
                                           for i, c in enumerate(CONTEXTS)])
        outs[seed, 0] = lm.generate_until([_req(c, i, do_sample=True, temperature=1.0)
                                           for i, c in enumerate(CONTEXTS)])
    assert outs[1, 1] == outs[2, 1]
    assert sum(a != b for a, b in zip(outs[1, 0], outs[2, 0], strict=True)) >= len(CONTEXTS) // 2


# ---- every family ---------------------------------------------------------------------------------------------
FAMILY_RUNS = [("sdar", {}), ("sdar", {"impl": "remote"}), ("llada2_moe", {"impl": "remote"}), ("llada", {}),
               ("llada", {"impl": "remote"}), ("dream", {}), ("dream", {"impl": "remote"}), ("dream", {"cache": "approx"})]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    from helpers.remote_fixtures import SHARED, build_remote, save_checkpoint, tokenizer_mask_id, transformers_major

    if not SHARED.is_dir() or transformers_major() >= 5:
        pytest.skip("the official remote code runs only under transformers 4.x (and ../shared must be present)")
    mask = tokenizer_mask_id()
    out = {}
    for fam in ("sdar", "llada2_moe", "llada", "dream"):
        extra = {} if fam == "llada2_moe" else {"mask_token_id": mask}
        model = build_remote(fam, seed=1, scale=4.0, **extra)
        if fam == "llada":  # as test_bidirectional's fixture: a zero mask embedding keeps commit order visible
            with torch.no_grad():
                model.model.transformer.wte.weight[mask] = 0.0
        out[fam] = save_checkpoint(model, tmp_path_factory.mktemp(fam))
    return out


def _family_lm(family_dirs, fam: str, extra: dict, **kw) -> SpotDLM:
    args = {"pretrained": str(family_dirs[fam]), "block_len": 8, "budget": 4, **extra, **kw}
    if extra.get("impl") == "remote":
        args["trust_remote_code"] = "true"
    return SpotDLM(**args)


@pytest.mark.parametrize("fam,extra", FAMILY_RUNS, ids=[f"{f}-{'-'.join(e.values()) or 'native'}"
                                                        for f, e in FAMILY_RUNS])
def test_every_family_spot_equals_control_with_top_k_and_top_p(family_dirs, fam, extra):
    lm = _family_lm(family_dirs, fam, extra, control="paired", seed=3)
    for bs in (1, 8):
        lm.sizes.batch_size = bs  # the chunk size generate_until decodes together
        n = len(lm.generation.paired.same)
        lm.generate_until([_req(c, i, **{**SAMPLE, "max_gen_toks": 12}) for i, c in enumerate(CONTEXTS)])
        same = lm.generation.paired.same
        assert len(same) == n + len(CONTEXTS) and all(same[n:]), (fam, extra, bs)
    spot = lm.get_model_info()["spot"]
    assert (spot["top_k"], spot["top_p"], spot["exact_match_to_control"]) == (5, 0.9, 1.0)


def test_top_k_1_gives_the_same_outputs_under_two_seeds_on_a_bidirectional_fixture(family_dirs):
    outs = {}
    for seed in (1, 2):
        lm = _family_lm(family_dirs, "llada", {}, mode="control", seed=seed)
        for k in (1, 0):
            kw = {"do_sample": True, "temperature": 1.0, "max_gen_toks": 12, **({"top_k": 1} if k else {})}
            outs[seed, k] = lm.generate_until([_req(c, i, **kw) for i, c in enumerate(CONTEXTS)])
    assert outs[1, 1] == outs[2, 1]
    assert sum(a != b for a, b in zip(outs[1, 0], outs[2, 0], strict=True)) >= len(CONTEXTS) // 2


# ---- the real CLI ---------------------------------------------------------------------------------------------
BAD_CLI = ["max_gen_toks=-3", "max_gen_toks=0", "max_gen_toks=abc", "temperature=-1,do_sample=True", "until=5",
           "top_p=2.0,do_sample=True,temperature=1.0", "top_k=-1", "repetition_penalty=1.3"]


@pytest.mark.parametrize("gen", [pytest.param(g, marks=[] if g in ("max_gen_toks=abc", "repetition_penalty=1.3")
                                              else pytest.mark.slow) for g in BAD_CLI])
def test_a_bad_generation_setting_is_one_line_and_exit_2_through_the_cli(tiny_target_dir, tmp_path, gen):
    from helpers.cli import run_cli

    out = run_cli(["--model", "spot-dlm", "--model_args", f"pretrained={tiny_target_dir}", "--tasks",
                   "spot_arith_mini", "--limit", "2", "--gen_kwargs", gen], cwd=tmp_path)
    assert out.returncode == 2, (out.stdout + out.stderr)[-3000:]
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: spot-dlm: request 0 (task spot_arith_mini, doc 0;"), last
    assert f"generation kwarg {gen.split('=')[0]}=" in last and "nothing was decoded" in last


@pytest.mark.slow
def test_a_use_cache_rerun_reports_that_nothing_was_decoded(tiny_target_dir, tmp_path):
    import json

    from helpers.cli import run_cli

    def run(tag: str) -> tuple[dict, str]:
        out = run_cli(["--model", "spot-dlm", "--model_args", f"pretrained={tiny_target_dir},mode=spot,budget=4",
                       "--tasks", "spot_arith_mini", "--limit", "3", "--gen_kwargs", "max_gen_toks=8",
                       "--use_cache", str(tmp_path / "cache"), "--output_path", str(tmp_path / tag)], cwd=tmp_path)
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        return json.loads(next((tmp_path / tag).rglob("results_*.json")).read_text())["config"]["spot"], out.stderr

    first, _ = run("a")
    assert first["samples"] == 3 and first["nfe_per_sample"] > 0
    again, log = run("b")
    assert again["samples"] == 0 and again["served_from_cache"] == 3 and "nfe_per_sample" not in again
    assert "no request was decoded: all 3 answers came from lm-eval's --use_cache cache" in log
