"""The README's main command on a shared machine: its decoding wall time idle and with 1 and 2 busy competitors.

    python scripts/contention_bench.py --limit 200 --out docs/results/contention
    python scripts/contention_bench.py --limit 200 --model_args threads=2   # torch's default on 2 cores, forced

Each condition runs `lm_eval --model spot-dlm --tasks spot_arith --device cpu --limit N` in a fresh process with
OMP_NUM_THREADS / MKL_NUM_THREADS / OMP_WAIT_POLICY removed from its environment (as a new user runs it), while
K competitor processes keep the cores busy. A competitor is another torch job (`--competitor torch`: matmuls of
256x256 with torch's default threads, the kind of neighbour a shared machine has) or a pure spin loop (`spin`).
Reported: the decoding wall time (the run summary's `wall_s`: the sum over requests), the process wall time, and
each as a ratio to the idle condition.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMPETITORS = {
    "torch": "import torch\nx = torch.randn(256, 256)\nwhile True:\n    x = torch.tanh(x @ x)\n",
    "spin": "while True:\n    pass\n",
}
USER_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")


def run_condition(n_competitors: int, competitor: str, limit: int, model_args: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in USER_VARS}
    procs = [subprocess.Popen([sys.executable, "-c", COMPETITORS[competitor]], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n_competitors)]
    try:
        time.sleep(2 if procs else 0)  # competitors warmed up (torch imported, threads spinning)
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "lm_eval", "--model", "spot-dlm", "--tasks", "spot_arith", "--device", "cpu",
                   "--limit", str(limit), "--output_path", out]
            if model_args:
                cmd += ["--model_args", model_args]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                raise SystemExit(f"lm_eval failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            res = json.loads(next(Path(out).rglob("results_*.json")).read_text())
    finally:
        for p in procs:
            p.kill()
            p.wait()
    spot = res["config"]["spot"]
    acc = res["results"]["spot_arith"]["exact_match,strict-match"]
    return {"competitors": n_competitors, "decode_wall_s": spot["wall_s"], "process_wall_s": wall,
            "nfe_per_sample": spot["nfe_per_sample"], "exact_match": acc}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--competitor", choices=sorted(COMPETITORS), default="torch")
    ap.add_argument("--max-competitors", type=int, default=2)
    ap.add_argument("--model_args", default=None, help="extra spot-dlm model args, e.g. threads=2")
    ap.add_argument("--out", default=None, help="folder for contention.json and contention.md")
    a = ap.parse_args(argv)
    rows = [run_condition(k, a.competitor, a.limit, a.model_args) for k in range(a.max_competitors + 1)]
    idle = rows[0]
    lines = [f"`python scripts/contention_bench.py --limit {a.limit} --competitor {a.competitor}"
             + (f" --model_args {a.model_args}" if a.model_args else "") + "`", "",
             "| busy competitors | decode wall s | x idle | process wall s | x idle | NFE/sample | exact_match |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        r["decode_ratio"] = r["decode_wall_s"] / idle["decode_wall_s"]
        r["process_ratio"] = r["process_wall_s"] / idle["process_wall_s"]
        lines.append(f"| {r['competitors']} | {r['decode_wall_s']:.1f} | {r['decode_ratio']:.2f} | "
                     f"{r['process_wall_s']:.1f} | {r['process_ratio']:.2f} | {r['nfe_per_sample']:.2f} | "
                     f"{r['exact_match']:.3f} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "contention.json").write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))
        (out / "contention.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
