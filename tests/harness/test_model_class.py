"""The `spot-dlm` lm-eval model class: arguments, generate_until, metrics, clear errors."""

from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance

from lm_eval_spot.settings.args import SpotArgError, parse_args
from lm_eval_spot.harness.model import SpotDLM

from helpers.tiny import save_tiny_target


def req(context: str, **gen) -> Instance:
    gen.setdefault("until", ["\n\n"])
    return Instance("generate_until", {}, (context, gen), 0)


@pytest.fixture(scope="module")
def lm(tiny_target_dir):
    return SpotDLM(pretrained=str(tiny_target_dir), mode="control", device="cpu", batch_size="4", seed=7)


def test_generate_until_counts_and_reports(lm):
    reqs = [req("Hello there", max_gen_toks=12), req("", max_gen_toks=5), req("x" * 20, max_gen_toks=9)]
    out = lm.generate_until(reqs)
    assert len(out) == 3 and all(isinstance(o, str) for o in out)
    info = lm.get_model_info()["spot"]
    for key in ("mode", "samples", "nfe_total", "nfe_per_sample", "gen_tokens_total", "tokens_per_forward",
                "wall_s", "temperature"):
        assert key in info
    assert info["mode"] == "control" and info["samples"] == 3 and info["temperature"] == 0.0
    assert info["nfe_total"] == sum(s.nfe for s in lm.generation.stats.samples) > 0
    assert info["gen_tokens_total"] <= 12 + 5 + 9
    # control commits one token per round, plus prefill/store forwards: tokens per forward <= 1
    assert 0 < info["tokens_per_forward"] <= 1.0
    # three requests, batch size 4: their rounds share forwards (a first round with prompt blocks of another
    # width runs apart), so fewer forwards than requests per step
    assert info["steps_total"] > 0 and 1.0 <= info["forwards_per_step"] < 3


def test_max_gen_toks_and_prompt_tokens_not_counted(lm):
    before = len(lm.generation.stats.samples)
    lm.generate_until([req("a long prompt " * 5, max_gen_toks=4, until=[])])
    s = lm.generation.stats.samples[before]
    assert s.gen_tokens <= 4 and s.committed <= 4


def test_same_seed_same_text_and_temperature(tiny_target_dir):
    a = SpotDLM(pretrained=str(tiny_target_dir), mode="control", seed=3)
    b = SpotDLM(pretrained=str(tiny_target_dir), mode="control", seed=3)
    r = [req("Sample me", max_gen_toks=16, do_sample=True, temperature=1.0, until=[])]
    ta, tb = a.generate_until(r), b.generate_until(r)
    assert ta == tb
    assert a.get_model_info()["spot"]["temperature"] == 1.0
    # repeats of one request get different (but reproducible) noise
    twice = a.generate_until(r + r)
    assert twice[0] == ta[0]


def test_seed_defaults_to_torch_seed(tiny_target_dir):
    torch.manual_seed(1234)
    assert SpotDLM(pretrained=str(tiny_target_dir), mode="control").base_seed == 1234


class _LLReq:
    def __init__(self, *args: str) -> None:
        self.args, self.doc_id, self.task_name = args, 0, "t"


def test_likelihood_requests_empty_and_refused_with_a_clear_error(lm):
    from lm_eval_spot.likelihood.runner import LikelihoodRequestError

    assert lm.loglikelihood([]) == [] and lm.loglikelihood_rolling([]) == []
    with pytest.raises(LikelihoodRequestError, match="encodes to no tokens; nothing was scored"):
        lm.loglikelihood([_LLReq("Q: 1+1\nA:", "")])
    with pytest.raises(LikelihoodRequestError, match="more than the target's context"):
        lm.loglikelihood([_LLReq("1 " * 2000, " 2")])


def test_chat_template(lm):
    text = lm.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert "hi" in text and text.endswith("<|assistant|>")
    assert lm.tokenizer_name


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"mode": "turbo"}, "mode='turbo' is not known; accepted: spot, spot-gamma, spot-chain, conf-tree, free-chain, graph, oracle, control"),
        ({"blocklen": 4}, "unknown model argument.*blocklen.*accepted"),
        ({"block_len": 0}, "block_len=0.*integers >= 1"),
        ({"block_len": "abc"}, "block_len='abc'.*integer"),
        ({"gen_length": -3}, "gen_length"),
        ({"dtype": "float8"}, "dtype='float8'.*accepted"),
        ({"batch_size": "many"}, "batch_size"),
        ({"trust_remote_code": "maybe"}, "trust_remote_code"),
        ({"pretrained": "/does/not/exist"}, "pretrained='/does/not/exist'.*config.json"),
    ],
)
def test_bad_args_one_line_error_before_loading(kwargs, needle):
    with pytest.raises(SpotArgError, match=needle) as exc:
        parse_args(kwargs)
    assert "\n" not in str(exc.value)


def test_model_without_mask_token_rejected(tmp_path):
    d = save_tiny_target(tmp_path / "nomask", with_mask=False)
    with pytest.raises(SpotArgError, match="no mask token"):
        SpotDLM(pretrained=str(d), mode="control")


def test_bad_max_gen_toks_rejected_before_any_decoding(lm):
    before = len(lm.generation.stats.samples)
    with pytest.raises(ValueError, match="max_gen_toks"):
        lm.generate_until([req("hi", max_gen_toks=3), req("hi", max_gen_toks=0)])
    assert len(lm.generation.stats.samples) == before


def test_batch_size_forms(tiny_target_dir):
    assert parse_args({"pretrained": str(tiny_target_dir), "mode": "control", "batch_size": "8"}).batch_size == 8
    assert parse_args({"pretrained": str(tiny_target_dir), "mode": "control", "batch_size": 2}).batch_size == 2
    assert parse_args({"pretrained": str(tiny_target_dir), "mode": "control", "batch_size": "auto"}).batch_size == "auto"


def test_results_report_cache_kind_transfers_and_time_shares(lm):
    lm.generate_until([req("Hello", max_gen_toks=6)])
    info = lm.get_model_info()["spot"]
    assert info["prefix_cache"] == "exact" and info["exact_prefix_cache"] is True
    assert info["batch_size"] == 4
    # control reads back 2 x 8 bytes (position, token) per round: nothing of vocabulary size
    assert info["host_bytes_per_round"] == 16
    shares = info["round_time_shares"]
    assert set(shares) == {"forward", "drafting", "rest"} and abs(sum(shares.values()) - 1) < 1e-9


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_batch_invariant_and_batched_spot_stay_exact(tiny_target_dir, T):
    reqs = [req(c, max_gen_toks=10, temperature=T, do_sample=T > 0) for c in ("ab", "Hello there", "x" * 11, "")]
    outs = []
    for extra in ({"batch_size": "1"}, {"batch_size": "3"}, {"batch_invariant": "true"}):
        m = SpotDLM(pretrained=str(tiny_target_dir), mode="spot", budget="4", control="paired", seed=3,
                    block_len="32", **extra)  # the shipped drafter is for block length 32
        outs.append(m.generate_until(reqs))
        assert m.get_model_info()["spot"]["exact_match_to_control"] == 1.0
    assert outs[0] == outs[1] == outs[2]


def test_a_round_that_commits_nothing_raises(monkeypatch):
    """The loop's progress guard: a transition that only rewrites an already committed slot stops the decode."""
    import lm_eval_spot.decoding.coupled as coupled
    import lm_eval_spot.decoding.loop as loop
    from helpers.fakes import ScriptedAdapter

    def stuck(logits, eligible, temperature, gumbel, trunc=None):
        R = logits.shape[0]
        return torch.zeros(R, dtype=torch.long), torch.full((R,), 9, dtype=torch.long)  # slot 0: the prompt's

    monkeypatch.setattr(coupled, "transition", stuck)  # the verifier's (draft-free: the only one)
    with pytest.raises(RuntimeError, match="no progress"):
        loop.decode(ScriptedAdapter(None, vocab=12, block_len=4), [5], loop.DecodeConfig(max_gen_toks=3), seed=0)
