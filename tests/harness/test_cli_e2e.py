"""The real `lm_eval` CLI in a subprocess, on a plugin task, with no wrapper and no --include_path."""

from __future__ import annotations

import json
from helpers.cli import run_cli


def test_lm_eval_cli_runs_spot_dlm_on_plugin_task(tiny_target_dir, tmp_path):
    out = run_cli(
        ["--model", "spot-dlm", "--model_args", f"pretrained={tiny_target_dir},mode=control",
         "--tasks", "spot_arith_mini", "--limit", "3", "--device", "cpu", "--batch_size", "2",
         "--gen_kwargs", "max_gen_toks=24", "--output_path", str(tmp_path / "out"), "--log_samples"],
        cwd=tmp_path,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "spot_arith_mini" in log and "exact_match" in log
    assert "spot-dlm run summary" in log and "NFE / sample" in log  # summary printed next to accuracy
    results = next((tmp_path / "out").rglob("results_*.json"))
    data = json.loads(results.read_text())
    spot = data["config"]["spot"]
    assert spot["mode"] == "control" and spot["samples"] == 3
    assert spot["nfe_total"] > 0 and 0 < spot["gen_tokens_total"] <= 3 * 24
    assert "exact_match,strict-match" in data["results"]["spot_arith_mini"]
    assert list((tmp_path / "out").rglob("samples_spot_arith_mini_*.jsonl"))


def test_lm_eval_cli_rejects_bad_mode_with_one_line(tiny_target_dir, tmp_path):
    out = run_cli(["--model", "spot-dlm", "--model_args", f"pretrained={tiny_target_dir},mode=bogus",
                   "--tasks", "spot_arith_mini", "--limit", "1", "--device", "cpu"], cwd=tmp_path)
    assert out.returncode != 0
    assert "mode='bogus' is not known; accepted: spot, spot-gamma, spot-chain, conf-tree, free-chain, graph, oracle, control" in out.stderr
