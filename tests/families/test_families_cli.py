"""The real `lm_eval` CLI end to end on a tiny SDAR checkpoint (random weights, saved in a temp folder), through
the native Qwen3 path and through the official remote code (block_len=32: the shipped drafter's block length; the block-causal forward
takes any block length, its mask decides)."""

from __future__ import annotations

import json
import os

import pytest

from helpers.remote_fixtures import SHARED, build_remote, needs_remote, save_checkpoint, tokenizer_mask_id
from helpers.cli import run_cli

pytestmark = needs_remote


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory):
    return save_checkpoint(build_remote("sdar", mask_token_id=tokenizer_mask_id()), tmp_path_factory.mktemp("sdar"))


@pytest.mark.parametrize("impl", ["native", "remote"])
def test_lm_eval_cli_runs_an_sdar_checkpoint(sdar_dir, tmp_path, impl, monkeypatch):
    extra = ""
    if impl == "remote":
        extra = ",impl=remote,trust_remote_code=true"
        # TEST-ONLY: the subprocess finds the pure-torch flash_attn stand-in (a GPU user has the real one).
        monkeypatch.setenv("PYTHONPATH", str(SHARED / "_test_stubs") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = run_cli(
        ["--model", "spot-dlm", "--model_args", f"pretrained={sdar_dir},mode=spot,budget=4,block_len=32,control=paired{extra}",
         "--tasks", "spot_arith_mini", "--limit", "2", "--device", "cpu",
         "--gen_kwargs", "max_gen_toks=12", "--output_path", str(tmp_path / "out")],
        cwd=tmp_path,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "spot-dlm run summary" in log
    data = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    spot = data["config"]["spot"]
    assert spot["family"] == "sdar" and spot["impl"] == impl and spot["samples"] == 2
    assert spot["exact_match_to_control"] == 1.0 and spot["prefix_cache"] == "exact"


@pytest.fixture(scope="module")
def bidirectional_dirs(tmp_path_factory):
    from helpers.targets import build

    return {fam: save_checkpoint(build(fam, tokenizer_mask_id()), tmp_path_factory.mktemp(fam))
            for fam in ("llada", "dream")}


@pytest.mark.parametrize("fam,extra,cache", [
    ("llada", "", "exact"), ("dream", ",impl=remote,trust_remote_code=true", "exact"), ("dream", ",cache=approx", "approximate")])
def test_lm_eval_cli_runs_a_bidirectional_checkpoint(bidirectional_dirs, tmp_path, fam, extra, cache):
    out = run_cli(
        ["--model", "spot-dlm", "--model_args",
         f"pretrained={bidirectional_dirs[fam]},mode=spot,budget=4,block_len=32,control=paired{extra}",
         "--tasks", "spot_arith_mini", "--limit", "2", "--device", "cpu",
         "--gen_kwargs", "max_gen_toks=12", "--output_path", str(tmp_path / "out")],
        cwd=tmp_path,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    data = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    spot = data["config"]["spot"]
    assert spot["family"] == fam and spot["prefix_cache"] == cache and spot["exact_match_to_control"] == 1.0
    if cache == "approximate":
        assert "approximate prefix cache: not lossless against full recomputation" in log
