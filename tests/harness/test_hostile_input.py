"""Hostile and odd input: each case is a clear one-line error raised before anything is decoded, or a defined
behaviour (README, "Odd input"). Nothing partial is ever returned as if complete."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance

from lm_eval_spot.settings.args import SpotArgError, default_drafter_path, default_target_path
from lm_eval_spot.decoding.loop import NonFiniteLogitsError
from lm_eval_spot.drafter.model import DrafterMismatchError, load_drafter
from lm_eval_spot.harness.model import RequestError, SpotDLM


def _req(context: str, **kw) -> Instance:
    return Instance("generate_until", {}, (context, {"until": ["\n\n"], "max_gen_toks": 16, **kw}), 0)


@pytest.fixture(scope="module")
def lm(tiny_target_dir) -> SpotDLM:
    return SpotDLM(pretrained=str(tiny_target_dir), mode="free-chain", budget=4, control="paired", seed=1)


# ---- prompts ------------------------------------------------------------------------------------------------
def test_a_prompt_longer_than_the_context_is_refused_before_any_request_is_decoded(lm):
    context = lm.adapter.info.max_positions
    assert context == 1024
    before = len(lm.generation.sample_log)
    with pytest.raises(RequestError, match=r"request 1 .* needs 1040 positions .* context of 1024; nothing was decoded"):
        lm.generate_until([_req("Q: 1+1"), _req("x" * 1020)])  # the first is fine, and is not decoded either
    assert len(lm.generation.sample_log) == before


def test_a_prompt_that_just_fits_is_decoded(lm):
    out = lm.generate_until([_req("x" * 1000, max_gen_toks=24)])  # 1000 + 24 = 1024 positions, whole blocks
    assert isinstance(out[0], str)


@pytest.mark.parametrize("context", ["", " ", "   \n\t "])
def test_empty_and_whitespace_prompts_decode_unconditionally_and_exactly(lm, context):
    n = len(lm.generation.paired.same)
    out = lm.generate_until([_req(context), _req(context, do_sample=True, temperature=1.0)])
    assert len(out) == 2 and all(isinstance(o, str) for o in out)
    assert all(lm.generation.paired.same[n:])  # SPOT's ids equal control's on them too
    assert all(e["stop_reason"] in ("eos", "until", "length") for e in lm.generation.sample_log[-2:])


def test_unknown_characters_become_the_unknown_token_with_one_warning(lm, caplog):
    with caplog.at_level(logging.WARNING, logger="lm_eval.spot"):
        out = lm.generate_until([_req("Q: é + 你 = ?"), _req("Q: ü")])
    assert len(out) == 2
    warnings = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert len(warnings) == 1
    assert "2 prompt(s)" in warnings[0] and "'é'" in warnings[0] and "'你'" in warnings[0] and "<unk>" in warnings[0]


# ---- stop strings and lengths -----------------------------------------------------------------------------
def _control_text(lm, context: str, n: int) -> str:
    return lm.generate_until([Instance("generate_until", {}, (context, {"until": [], "max_gen_toks": n}), 0)])[0]


def test_a_stop_string_that_occurs_in_the_prompt_only_cuts_the_continuation(lm):
    context = "Q: ab;ab;"
    free = _control_text(lm, context, 16)
    marker = "ab;"
    out = lm.generate_until([Instance("generate_until", {}, (context, {"until": [marker], "max_gen_toks": 16}), 0)])[0]
    assert out == free.split(marker)[0]  # the prompt's occurrences are not the continuation's


def test_a_stop_string_spanning_two_blocks_cuts_at_its_first_occurrence(lm):
    context = "Q: 12"  # 5 prompt tokens; block 8 from position 0: generated chars 3..4 straddle positions 7|8
    free = _control_text(lm, context, 20)
    stop = free[2:5]  # generated positions 7, 8, 9: across the first block boundary
    assert len(stop) == 3
    out = lm.generate_until([Instance("generate_until", {}, (context, {"until": [stop], "max_gen_toks": 20}), 0)])[0]
    assert out == free[: free.index(stop)]
    assert lm.generation.sample_log[-1]["stop_reason"] == "until"


def test_max_gen_toks_below_one_block(lm):
    out = lm.generate_until([_req("Q: 1+1", max_gen_toks=3, until=[])])[0]
    assert len(lm.encode(out)) <= 3
    assert lm.generation.sample_log[-1]["gen_tokens"] <= 3 and lm.generation.sample_log[-1]["stop_reason"] in ("length", "eos")


def test_temperature_and_do_sample_that_disagree_decode_greedily(lm):
    greedy = lm.generate_until([_req("Q: 7")])[0]
    # lm-eval's own rule (normalize_gen_kwargs): do_sample without a temperature, or a temperature without
    # do_sample, is greedy decoding.
    assert lm.generate_until([_req("Q: 7", do_sample=True, temperature=0.0)])[0] == greedy
    assert lm.generate_until([_req("Q: 7", do_sample=False, temperature=0.9)])[0] == greedy
    assert lm.generation.stats.temperatures[-2:] == [0.0, 0.0]


# ---- the target's own output -----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logits_stop_the_run_naming_the_request(tiny_target_dir, bad):
    lm = SpotDLM(pretrained=str(tiny_target_dir), mode="free-chain", budget=4, seed=1)
    first, second = _req("Hi"), _req("a long question first; Q: 3+4", max_gen_toks=24)
    calls = {"n": 0, "from": None}

    def poison(module, args, out):
        calls["n"] += 1
        if calls["from"] is None or calls["n"] < calls["from"]:
            return out
        out = out.clone()
        if bad == float("-inf"):
            out[...] = bad  # every logit -inf: the softmax is undefined
        else:
            out[..., 5:9] = bad  # a few vocabulary entries of every slot
        return out

    hook = lm.adapter.model.lm_head.register_forward_hook(poison)
    try:
        lm.generate_until([first])  # healthy: count the LM-head calls the first request takes
        calls["from"], calls["n"] = calls["n"] + 2, 0  # poison the second request, two rounds in
        with pytest.raises(NonFiniteLogitsError, match=r"non-finite logits .* prompt ends '.*Q: 3\+4' "
                                                       r"\(prompt_hash [0-9a-f]{64}\)"):
            lm.generate_until([first, second])
    finally:
        hook.remove()


# ---- checkpoints -------------------------------------------------------------------------------------------
@pytest.fixture()
def drafter_copy(tmp_path) -> Path:
    d = tmp_path / "drafter"
    shutil.copytree(default_drafter_path(), d)
    return d


def test_a_truncated_drafter_is_refused(drafter_copy):
    w = drafter_copy / "drafter.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(DrafterMismatchError, match="sha256"):
        load_drafter(drafter_copy, 32)
    doc = json.loads((drafter_copy / "drafter.json").read_text())
    del doc["weights_sha256"]  # without the digest, safetensors' own header check catches it
    (drafter_copy / "drafter.json").write_text(json.dumps(doc))
    with pytest.raises(DrafterMismatchError, match="not a readable safetensors file"):
        load_drafter(drafter_copy, 32)


def test_a_drafter_with_altered_weights_is_refused(drafter_copy):
    w = drafter_copy / "drafter.safetensors"
    data = bytearray(w.read_bytes())
    data[-100] ^= 0x01  # one bit of one weight: still a valid safetensors file
    w.write_bytes(bytes(data))
    with pytest.raises(DrafterMismatchError, match="does not have the sha256"):
        load_drafter(drafter_copy, 32)


def test_a_drafter_whose_weights_do_not_fit_its_description_is_refused(drafter_copy):
    from safetensors.torch import load_file, save_file

    state = load_file(str(drafter_copy / "drafter.safetensors"))
    key = next(iter(state))
    state[key] = torch.zeros(3, 3)
    save_file(state, str(drafter_copy / "drafter.safetensors"))
    doc = json.loads((drafter_copy / "drafter.json").read_text())
    doc["weights_sha256"] = hashlib.sha256((drafter_copy / "drafter.safetensors").read_bytes()).hexdigest()
    (drafter_copy / "drafter.json").write_text(json.dumps(doc))
    with pytest.raises(DrafterMismatchError, match="does not match drafter.json's config"):
        load_drafter(drafter_copy, 32)


@pytest.mark.parametrize("text", ["{not json", json.dumps({"config": {}}), json.dumps({"meta": {"block_lens": 3}})])
def test_a_damaged_drafter_description_is_refused(drafter_copy, text):
    (drafter_copy / "drafter.json").write_text(text)
    with pytest.raises(DrafterMismatchError, match="drafter.json is not a drafter description"):
        load_drafter(drafter_copy, 32)


def test_a_drafter_for_blocks_longer_than_its_slot_tables_is_refused_at_start_up(drafter_copy):
    with pytest.raises(DrafterMismatchError, match=r"reads blocks of at most 64 slots, the target runs block_len=128"):
        load_drafter(drafter_copy, 128)


class _Payload:
    """Unpickling this would create a file: the proof that something ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_offered_as_a_drafter_is_refused_and_nothing_in_it_runs(drafter_copy, tmp_path):
    marker = tmp_path / "executed"
    for writer in (lambda f: torch.save({"w": _Payload(marker)}, f), lambda f: pickle.dump(_Payload(marker), f)):
        with open(drafter_copy / "drafter.safetensors", "wb") as f:
            writer(f)
        doc = json.loads((drafter_copy / "drafter.json").read_text())
        doc.pop("weights_sha256", None)
        (drafter_copy / "drafter.json").write_text(json.dumps(doc))
        with pytest.raises(DrafterMismatchError, match="is a pickle .* refused, nothing in it was run"):
            load_drafter(drafter_copy, 32)
        assert not marker.exists()


@pytest.fixture()
def target_copy(tiny_target_dir, tmp_path) -> Path:
    d = tmp_path / "target"
    shutil.copytree(tiny_target_dir, d)
    return d


def test_a_target_folder_without_a_tokenizer_is_refused(target_copy):
    for f in target_copy.glob("*token*"):
        f.unlink()
    with pytest.raises(SpotArgError, match="no tokenizer could be loaded"):
        SpotDLM(pretrained=str(target_copy), mode="control")


def test_a_target_folder_without_weights_is_refused(target_copy):
    (target_copy / "model.safetensors").unlink()
    with pytest.raises(SpotArgError, match="the weights of pretrained=.* could not be loaded"):
        SpotDLM(pretrained=str(target_copy), mode="control")


def test_truncated_target_weights_are_refused(target_copy):
    w = target_copy / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 3])
    with pytest.raises(SpotArgError, match="could not be loaded .*SafetensorError"):
        SpotDLM(pretrained=str(target_copy), mode="control")


def test_a_pickled_target_checkpoint_is_refused_and_nothing_in_it_runs(target_copy, tmp_path):
    marker = tmp_path / "executed"
    (target_copy / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": _Payload(marker)}, target_copy / "pytorch_model.bin")
    with pytest.raises(SpotArgError, match="could not be loaded"):
        SpotDLM(pretrained=str(target_copy), mode="control")
    assert not marker.exists()
