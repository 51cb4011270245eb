"""Issue 30: the run summary's time is the time the user waited, at any batch size (the real CLI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The real `lm_eval` entry point with an independent stopwatch around the model's generate calls: the duration of
# the generate phase, measured outside the plugin's own accounting.
RUNNER = '''
import json, sys, time
from lm_eval.__main__ import cli_evaluate
from lm_eval_spot.harness.model import SpotDLM
orig, spent = SpotDLM.generate_until, []
def timed(self, *a, **k):
    t0 = time.perf_counter()
    try:
        return orig(self, *a, **k)
    finally:
        spent.append(time.perf_counter() - t0)
SpotDLM.generate_until = timed
try:
    cli_evaluate()
finally:
    json.dump(spent, open(sys.argv[sys.argv.index("--output_path") + 1] + ".generate_s.json", "w"))
'''


def _run(tmp: Path, target: Path, bs: int) -> tuple[dict, float, Path]:
    out = tmp / f"bs{bs}"
    script = tmp / "runner.py"
    script.write_text(RUNNER)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(script), "--model", "spot-dlm", "--model_args", f"pretrained={target},mode=control",
         "--tasks", "spot_arith_mini", "--limit", "16", "--device", "cpu", "--batch_size", str(bs),
         "--gen_kwargs", "max_gen_toks=48", "--output_path", str(out), "--log_samples"],
        capture_output=True, text=True, cwd=tmp, env=env, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    spot = json.loads(next(out.rglob("results_*.json")).read_text())["config"]
    measured = sum(json.loads(Path(str(out) + ".generate_s.json").read_text()))
    return spot, measured, out


@pytest.mark.slow
def test_summary_time_is_the_generate_phase_at_batch_1_and_8(tiny_target_dir, tmp_path):
    from lm_eval_spot.tools.compare import load_runs, table_rows

    runs = {bs: _run(tmp_path, tiny_target_dir, bs) for bs in (1, 8)}
    for bs, (cfg, measured, _) in runs.items():
        spot = cfg["spot"]
        assert spot["batch_size"] == bs and spot["samples"] == 16
        assert abs(spot["wall_s"] - measured) <= 0.2 * measured, (bs, spot["wall_s"], measured)
        assert abs(spot["gen_tokens_per_s"] - spot["gen_tokens_total"] / measured) <= \
            0.2 * spot["gen_tokens_total"] / measured
        latencies = [s["latency_s"] for s in cfg["spot_samples"]]
        assert len(latencies) == 16 and all(x > 0 for x in latencies)
    # At batch size 8 the requests overlap: their latencies sum to several times the run's wall, which the old
    # summary reported; the new one stays the wall whatever the batch size.
    cfg8, measured8, _ = runs[8]
    assert sum(s["latency_s"] for s in cfg8["spot_samples"]) > 2.0 * cfg8["spot"]["wall_s"]
    # compare shows tokens per second in the ratio of the two runs' measured durations (same tokens: control).
    rows = table_rows(load_runs([runs[1][2], runs[8][2]]))
    rate = {int(r["batch size"]): float(r["tokens/s"]) for r in rows}
    assert cfg8["spot"]["gen_tokens_total"] == runs[1][0]["spot"]["gen_tokens_total"]
    want = runs[1][1] / measured8  # bs8 rate / bs1 rate = bs1 duration / bs8 duration
    assert abs(rate[8] / rate[1] - want) <= 0.2 * want, (rate, want)
