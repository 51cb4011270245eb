"""The default against control as users run it: the lm_eval CLI, one process per run, tokens per second from the
results' `config.spot.gen_tokens_per_s`, at several batch sizes and temperatures, per target.

    python -m research.cli_pairs --limit 120 --sizes 1 8 32 --temps 0 1 \
        --target embedded= --target b8=/work/runs/b8/final --target e8c=/work/runs/e8c/final:80 \
        --out docs/results/never_slower

Each --target is NAME=PATH[:MAX_GEN_TOKS] (an empty PATH: the embedded default). For each (target, T, N) the
configurations (`mode=control`, the default, and each --extra model-args string, e.g. `budget=8`) run one after
another as separate lm_eval processes, their order rotated from one cell to the next and, with --repeats 2, run
again in the reverse order (A B B A), so machine drift spreads over all of them; a configuration's speed is the
mean of its repeats. Every run logs its samples, and each configuration's generations are compared with control's.
Writes results.json and table.md (ratios against control of the same target, T and N).

`--task gsm8k --num-fewshot 0 --data-dir ../shared/data` runs a stock lm-eval task instead of spot_arith, from the
staged datasets (each lm_eval process runs in that folder, offline).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("research.cli_pairs")


def run_one(pretrained: str, model_args: str, T: float, N: int, limit: int, max_gen: int | None, out: Path,
            threads: int | None, task: str = "spot_arith", num_fewshot: int | None = None,
            data_dir: Path | None = None) -> dict[str, Any]:
    """One lm_eval process; returns its `config.spot` block, its generations and its wall time."""
    args = [a for a in (f"pretrained={pretrained}" if pretrained else "", model_args) if a]
    gk = [f"temperature={T:g}", f"do_sample={'true' if T > 0 else 'false'}"] + (
        [f"max_gen_toks={max_gen}"] if max_gen else [])
    out = out.resolve()  # the process may run in data_dir
    cmd = [sys.executable, "-m", "lm_eval", "--model", "spot-dlm", "--tasks", task, "--device", "cpu",
           "--limit", str(limit), "--batch_size", str(N), "--gen_kwargs", ",".join(gk), "--log_samples",
           "--output_path", str(out)] + (["--model_args", ",".join(args)] if args else []) + (
        ["--num_fewshot", str(num_fewshot)] if num_fewshot is not None else [])
    env = dict(os.environ)
    if data_dir is not None:
        env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=data_dir)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"lm_eval failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    res_file = max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    spot = json.loads(res_file.read_text())["config"]["spot"]
    samples_file = max(out.rglob(f"samples_{task}_*.jsonl"), key=lambda p: p.stat().st_mtime)
    gens = {}
    for line in samples_file.read_text().splitlines():
        row = json.loads(line)
        gens[row["doc_id"]] = row["resps"][0][0]
    return {"spot": spot, "gens": gens, "process_s": wall, "command": " ".join(cmd)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", action="append", required=True, help="NAME=PATH[:MAX_GEN_TOKS]")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--temps", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--limit", type=int, default=120)
    ap.add_argument("--extra", action="append", default=[], help="another configuration's model args")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for each run (default: the plugin's)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration and cell (A B B A order)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--task", default="spot_arith", help="an lm-eval generation task (default: spot_arith)")
    ap.add_argument("--num-fewshot", type=int, default=None)
    ap.add_argument("--data-dir", type=Path, default=None, help="run lm_eval offline in this folder (../shared/data)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    configs = ["mode=control", ""] + a.extra
    rows: list[dict[str, Any]] = []
    cell = 0
    for spec in a.target:
        name, _, rest = spec.partition("=")
        path, _, mg = rest.partition(":")
        for T in a.temps:
            for N in a.sizes:
                order = configs[cell % len(configs):] + configs[: cell % len(configs)]
                cell += 1
                runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
                for rep in range(a.repeats):
                    for c in (order if rep % 2 == 0 else order[::-1]):
                        label = c.replace("=", "-").replace(",", "_") or "default"
                        folder = a.out / "runs" / f"{name}_T{T:g}_N{N}_{label}_r{rep}"
                        runs[c].append(run_one(path, c, T, N, a.limit, int(mg) if mg else None, folder, a.threads,
                                               a.task, a.num_fewshot, a.data_dir.resolve() if a.data_dir else None))
                        log.info("%s T=%g N=%d %s: %.1f tok/s, NFE %.2f", name, T, N, c or "default",
                                 runs[c][-1]["spot"]["gen_tokens_per_s"], runs[c][-1]["spot"]["nfe_per_sample"])
                speed = {c: sum(r["spot"]["gen_tokens_per_s"] for r in rs) / len(rs) for c, rs in runs.items()}
                ctrl = runs["mode=control"][0]
                for c in configs:
                    s = runs[c][0]["spot"]
                    same = sum(r["gens"][k] == g for r in runs[c] for k, g in ctrl["gens"].items())
                    rows.append({
                        "target": name, "temperature": T, "batch_size": N, "config": c or "default",
                        "tok_per_s": speed[c], "nfe_per_sample": s["nfe_per_sample"],
                        "ratio": speed[c] / speed["mode=control"],
                        # Each repeat's run against control's run of the same repeat (adjacent in time: the
                        # machine's drift, up to 20% between runs minutes apart, mostly cancels), their median.
                        "paired_ratios": [round(r["spot"]["gen_tokens_per_s"] / k["spot"]["gen_tokens_per_s"], 3)
                                          for r, k in zip(runs[c], runs["mode=control"], strict=True)],
                        "runs_tok_per_s": [round(r["spot"]["gen_tokens_per_s"], 1) for r in runs[c]],
                        "identical_to_control": f"{same}/{len(ctrl['gens']) * len(runs[c])}",
                        "drafted_rows_share": (s.get("budget_policy") or {}).get("drafted_rows_share"),
                        "startup_s": (s.get("budget_policy") or {}).get("startup_s"),
                        "command": runs[c][0]["command"],
                    })
                a.out.mkdir(parents=True, exist_ok=True)
                (a.out / "results.json").write_text(json.dumps(rows, indent=1))
                (a.out / "table.md").write_text(table(rows, argv if argv is not None else sys.argv[1:]))


def paired(ratios: list[float] | None) -> str:
    if not ratios:
        return ""
    return f"{statistics.median(ratios):.2f}x; " + " / ".join(f"{x:.2f}" for x in ratios)


def table(rows: list[dict[str, Any]], argv: list[str]) -> str:
    lines = ["python -m research.cli_pairs " + " ".join(argv), "",
             "| target | T | N | config | tok/s (mean) | runs | vs control | NFE/sample | identical to control "
             "| rounds by drafted rows | start-up s | paired ratios (median; each) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shares = r["drafted_rows_share"] or {}
        top = ", ".join(f"{d}: {100 * s:.0f}%" for d, s in sorted(shares.items(), key=lambda kv: -kv[1])[:3])
        lines.append(f"| {r['target']} | {r['temperature']:g} | {r['batch_size']} | {r['config']} | "
                     f"{r['tok_per_s']:.1f} | {' / '.join(map(str, r['runs_tok_per_s']))} | {r['ratio']:.2f}x | {r['nfe_per_sample']:.2f} | "
                     f"{r['identical_to_control']} | {top} | {r['startup_s'] if r['startup_s'] is not None else ''} | "
                     f"{paired(r.get('paired_ratios'))} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
