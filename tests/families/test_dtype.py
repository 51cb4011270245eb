"""dtype=auto (the default): the checkpoint's dtype on CUDA, float32 elsewhere, resolved once where the device is
known; an explicit dtype wins; the run's args, results and request-cache fingerprint carry the resolved dtype."""

from __future__ import annotations

import logging

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import CachingLM

from lm_eval_spot.settings.cards import Card, load_card, validate
from lm_eval_spot.settings.args import SpotArgError, parse_args
from lm_eval_spot.families import common
from lm_eval_spot.families.common import resolve_dtype, with_concrete_dtype
from lm_eval_spot.harness.model import SpotDLM
from lm_eval_spot.harness.request_cache import CacheConflictError

BF16 = {"torch_dtype": "bfloat16"}


def test_auto_is_the_default():
    assert parse_args({}).dtype == "auto"


@pytest.mark.parametrize("cfg", [BF16, {"dtype": "float16"}, {}])
def test_auto_on_cpu_is_float32_whatever_the_checkpoint_states(cfg):
    assert resolve_dtype("auto", "cpu", cfg)[0] == "float32"


@pytest.mark.parametrize("cfg,want", [
    (BF16, "bfloat16"),
    ({"dtype": "float16"}, "float16"),  # transformers 5 writes `dtype`
    ({"torch_dtype": "torch.bfloat16"}, "bfloat16"),
    ({"torch_dtype": "float32"}, "float32"),
    ({}, "float32"),  # nothing stated
    ({"torch_dtype": "auto"}, "float32"),  # nothing it can run in
])
def test_auto_on_cuda_is_the_checkpoint_dtype(cfg, want):
    name, why = resolve_dtype("auto", "cuda", cfg)
    assert name == want and "cuda" in why


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("given", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_wins(device, given):
    assert resolve_dtype(given, device, BF16) == (given, "given")


def test_resolution_uses_the_resolved_device_and_logs_one_line(tiny_target_dir, monkeypatch, caplog):
    args = parse_args({"pretrained": str(tiny_target_dir), "device": "cuda"})
    with caplog.at_level(logging.INFO, logger="lm_eval.spot"):
        monkeypatch.setattr(common, "resolve_device", lambda requested: torch.device("cuda"))  # a fake GPU
        assert with_concrete_dtype(args, BF16).dtype == "bfloat16"
        monkeypatch.setattr(common, "resolve_device", lambda requested: torch.device("cpu"))  # CUDA fell back
        assert with_concrete_dtype(args, BF16).dtype == "float32"
    lines = [r.getMessage() for r in caplog.records if "dtype" in r.getMessage()]
    assert lines == ["spot-dlm: dtype bfloat16 (dtype=auto on cuda: the checkpoint's config.json states bfloat16)",
                     "spot-dlm: dtype float32 (dtype=auto on cpu)"]
    explicit = parse_args({"pretrained": str(tiny_target_dir), "dtype": "float16"})
    assert with_concrete_dtype(explicit, BF16) is explicit


def test_a_loader_never_sees_auto():
    with pytest.raises(ValueError, match="unresolved"):
        common.torch_dtype(parse_args({}))


def test_a_card_states_a_concrete_dtype():
    good = dict(load_card("sdar-4b-chat").fields)
    with pytest.raises(SpotArgError, match="dtype must be one of float32, bfloat16, float16"):
        validate(Card("x", {**good, "dtype": "auto"}))


def _reqs() -> list[Instance]:
    return [Instance("generate_until", {}, ("Q: 1+2", {"until": ["\n\n"], "max_gen_toks": 8}), 0)]


def test_the_run_and_its_cache_carry_the_resolved_dtype(tiny_target_dir, tmp_path):
    """dtype=auto on the CPU runs float32: its args, results and cache fingerprint say float32, so its cached
    answers serve a dtype=float32 run and are refused to a bfloat16 one."""
    lm = SpotDLM(pretrained=str(tiny_target_dir), mode="control", seed=1)
    assert lm.args.dtype == "float32" and lm.adapter.dtype == torch.float32
    db = str(tmp_path / "c.db")
    first = CachingLM(lm, db)
    first.generate_until(_reqs())
    info = first.get_model_info()
    assert info["spot_args"]["dtype"] == "float32" and info["spot_target"]["dtype"] == "float32"
    first.dbdict.close()
    again = CachingLM(SpotDLM(pretrained=str(tiny_target_dir), mode="control", seed=1, dtype="float32"), db)
    again.generate_until(_reqs())
    assert again.get_model_info()["spot"]["served_from_cache"] == 1
    again.dbdict.close()
    with pytest.raises(CacheConflictError, match="args.dtype"):
        CachingLM(SpotDLM(pretrained=str(tiny_target_dir), mode="control", seed=1, dtype="bfloat16"), db)
