"""Compare spot-dlm runs across models, modes, budgets and temperatures:

    python -m lm_eval_spot.tools.compare RESULTS_DIR_OR_JSON [...] [--out DIR]

Reads lm-eval output (`results_*.json`, and the `samples_*.jsonl` beside them when the runs used --log_samples)
and writes one table: target and drafter, task, mode, budget, temperature, n, accuracy with its stderr, NFE per
sample, tokens per forward, batch size, decoding wall time and generated tokens per second, that speed against the
control run of the same target, task, temperature and batch size (what the user waits for), throughput ratio with
its spread (paired runs), exact match to control, and whether the run was exact or approximate. Each drafting run is compared per sample with the control run of the same target,
task, temperature and samples: the share of identical generations, the accuracy difference and McNemar's exact
test, and a verdict ("accuracy preserved" only when every generation is identical, or when the difference is
within noise, saying which). Writes compare.md, compare.csv and accuracy_vs_nfe.png to --out: accuracy against
NFE per sample and, beside it, tokens per second against control's (same target, task, temperature and batch size)
against NFE, one colour and one Pareto front per target (fewer NFE alone is not a win when it is slower).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ALPHA = 0.05  # McNemar's exact test: a difference with p >= ALPHA is "within noise"


class CompareError(ValueError):
    """A folder or file that cannot be compared: the message says which and why."""


@dataclass
class Run:
    path: Path
    target: str
    drafter: str
    task: str
    mode: str
    budget: Any
    temperature: float | None
    n: int
    metric: str
    accuracy: float
    stderr: float | None
    spot: dict[str, Any]
    version: Any
    samples: dict[int, dict[str, Any]] = field(default_factory=dict)  # doc_id -> {correct, resp, nfe, ...}

    @property
    def label(self) -> str:
        b = f" D={self.budget}" if self.mode != "control" else ""
        t = f"T={self.temperature:g}" if self.temperature is not None else "T=?"
        return f"{Path(self.target).name} {self.mode}{b} {t}"


def _primary_metric(task_results: dict[str, Any]) -> tuple[str, float, float | None]:
    """The task's first scored metric (lm-eval writes 'metric,filter' keys, stderr as 'metric_stderr,filter')."""
    for key, value in task_results.items():
        if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
            continue
        name, _, filt = key.partition(",")
        err = task_results.get(f"{name}_stderr,{filt}")
        return key, float(value), float(err) if isinstance(err, (int, float)) else None
    raise CompareError("no numeric metric in the task's results")


def _samples_for(results_file: Path, task: str) -> Path | None:
    stamp = results_file.stem[len("results_"):]
    cand = sorted(results_file.parent.glob(f"samples_{task}_{stamp}.jsonl")) or sorted(
        results_file.parent.glob(f"samples_{task}_*.jsonl"))
    return cand[-1] if cand else None


def _read_samples(path: Path, metric_key: str, per_sample: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    name, _, filt = metric_key.partition(",")
    stats: dict[str, list[dict[str, Any]]] = {}
    for entry in per_sample:
        stats.setdefault(entry["prompt_hash"], []).append(entry)
    out: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if filt and row.get("filter") not in (filt, None):
            continue
        resp = row.get("filtered_resps") or row.get("resps")
        raw = row.get("resps")
        entry = {"correct": float(row.get(name, 0.0)), "resp": json.dumps(raw), "filtered": json.dumps(resp)}
        queue = stats.get(row.get("prompt_hash", ""), [])
        if queue:
            entry.update({k: v for k, v in queue[0].items() if k != "prompt_hash"})
        out[int(row["doc_id"])] = entry
    return out


def load_runs(paths: list[Path]) -> list[Run]:
    files: list[Path] = []
    for p in paths:
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = sorted(p.rglob("results_*.json"))
            if not found:
                raise CompareError(f"{p}: no results_*.json in this folder (is it an lm-eval --output_path?)")
            files += found
        else:
            raise CompareError(f"{p}: no such file or folder")
    runs = []
    for f in files:
        data = json.loads(f.read_text())
        cfg = data.get("config", {})
        if cfg.get("model") != "spot-dlm":
            raise CompareError(f"{f}: a run of --model {cfg.get('model')!r}; compare reads spot-dlm runs only")
        spot = cfg.get("spot") or {}
        args = cfg.get("spot_args") or {}
        for task, res in (data.get("results") or {}).items():
            key, acc, err = _primary_metric(res)
            run = Run(path=f, target=str(args.get("pretrained", "?")), drafter=str(args.get("drafter") or "shipped"),
                      task=task, mode=str(spot.get("mode", args.get("mode", "?"))), budget=spot.get("budget"),
                      temperature=spot.get("temperature"), n=int((data.get("n-samples", {}).get(task) or {}).get(
                          "effective", spot.get("samples", 0))), metric=key, accuracy=acc, stderr=err, spot=spot,
                      version=(data.get("versions") or {}).get(task))
            if run.mode == "control":
                run.drafter = "-"
            sp = _samples_for(f, task)
            if sp is not None:
                run.samples = _read_samples(sp, key, cfg.get("spot_samples") or [])
            runs.append(run)
    versions: dict[str, set] = {}
    for r in runs:
        versions.setdefault(r.task, set()).add(str(r.version))
    mixed = {t: v for t, v in versions.items() if len(v) > 1}
    if mixed:
        t, v = next(iter(mixed.items()))
        raise CompareError(f"task {t} appears in versions {', '.join(sorted(v))}: runs of different task versions "
                           "are not comparable")
    return runs


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for b and c discordant pairs (binomial test of b against n = b + c, p = 1/2)."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def paired_comparison(run: Run, control: Run) -> dict[str, Any]:
    common = sorted(set(run.samples) & set(control.samples))
    if not common:
        return {"verdict": "no shared samples (run with --log_samples on the same task and --limit)"}
    same = sum(run.samples[d]["resp"] == control.samples[d]["resp"] for d in common)
    b = sum(run.samples[d]["correct"] > 0 and control.samples[d]["correct"] == 0 for d in common)
    c = sum(run.samples[d]["correct"] == 0 and control.samples[d]["correct"] > 0 for d in common)
    diff = sum(run.samples[d]["correct"] - control.samples[d]["correct"] for d in common) / len(common)
    p = mcnemar_exact(b, c)
    if same == len(common):
        verdict = "accuracy preserved (every generation identical)"
    elif p >= ALPHA:
        verdict = f"accuracy preserved (difference within noise: McNemar p={p:.3f})"
    else:
        verdict = f"accuracy changed (McNemar p={p:.3g})"
    return {"shared": len(common), "identical": same / len(common), "acc_diff": diff, "mcnemar_p": p,
            "verdict": verdict}


def _control_for(run: Run, runs: list[Run], same_batch: bool = False) -> Run | None:
    """The control run of the same target, task and temperature (and batch size, for speed: a batch's forward
    costs differ), preferring one at the same batch size."""
    def key(r: Run, batch: bool) -> tuple[Any, ...]:
        return (r.target, r.task, r.temperature) + ((str(r.spot.get("batch_size", 1)),) if batch else ())

    for batch in (True,) if same_batch else (True, False):
        for r in runs:
            if r is not run and r.mode == "control" and key(r, batch) == key(run, batch):
                return r
    return None


def speed_vs_control(run: Run, runs: list[Run]) -> tuple[float | None, str]:
    """(run's tokens per second / control's, where the control figure comes from): the control run of the same
    target, task, temperature and batch size, else (control=paired) the run's own paired ratio."""
    if run.mode == "control":
        return 1.0, "control"
    ctrl = _control_for(run, runs, same_batch=True)
    rate = run.spot.get("gen_tokens_per_s")
    if ctrl is not None and rate and ctrl.spot.get("gen_tokens_per_s"):
        return rate / ctrl.spot["gen_tokens_per_s"], "control run"
    if "throughput_ratio" in run.spot:
        return float(run.spot["throughput_ratio"]), "paired"
    return None, ""


COLUMNS = ("target", "drafter", "task", "mode", "budget", "T", "n", "accuracy", "stderr", "NFE/sample",
           "tokens/forward", "batch size", "wall s", "tokens/s", "tokens/s vs control", "throughput ratio (q25-q75)",
           "exact match to control", "prefix cache",
           "identical to control", "accuracy diff", "McNemar p", "verdict")


def tokens_per_s(spot: dict[str, Any]) -> str:
    """The run's generated tokens per second of decoding. Runs written before the summary timed lm-eval's calls
    (no `decode_wall_s`) divided by the SUM of request latencies: at batch size > 1 that under-reports, so say so."""
    rate = spot.get("gen_tokens_per_s")
    if rate is None:
        return ""
    old = "decode_wall_s" not in spot and str(spot.get("batch_size", 1)) != "1"
    return f"{rate:.1f}" + (" (summed request latencies: too low)" if old else "")


def table_rows(runs: list[Run]) -> list[dict[str, Any]]:
    rows = []
    for r in sorted(runs, key=lambda x: (x.target, x.task, x.temperature or 0.0, x.mode != "control", str(x.budget))):
        s = r.spot
        q = s.get("throughput_ratio_q25_q75")
        ratio = f"{s['throughput_ratio']:.2f} ({q[0]:.2f}-{q[1]:.2f})" if "throughput_ratio" in s and q else ""
        pair = paired_comparison(r, c) if r.mode != "control" and (c := _control_for(r, runs)) else {}
        speed, source = speed_vs_control(r, runs)
        rows.append({
            "target": Path(r.target).name, "drafter": Path(r.drafter).name if r.drafter not in ("-", "shipped")
            else r.drafter, "task": r.task, "mode": r.mode, "budget": r.budget if r.mode != "control" else "",
            "T": "" if r.temperature is None else f"{r.temperature:g}", "n": r.n, "accuracy": f"{r.accuracy:.4f}",
            "stderr": "" if r.stderr is None else f"{r.stderr:.4f}",
            "NFE/sample": f"{s.get('nfe_per_sample', float('nan')):.2f}",
            "tokens/forward": f"{s.get('tokens_per_forward', float('nan')):.3f}",
            "batch size": s.get("batch_size", ""), "wall s": f"{s['wall_s']:.1f}" if "wall_s" in s else "",
            "tokens/s": tokens_per_s(s),
            "tokens/s vs control": "" if speed is None else f"{speed:.2f}x" + (" (paired)" if source == "paired" else ""),
            "throughput ratio (q25-q75)": ratio,
            "exact match to control": f"{s['exact_match_to_control']:.3f}" if "exact_match_to_control" in s else "",
            "prefix cache": s.get("prefix_cache", "exact"),
            "identical to control": f"{pair['identical']:.3f}" if "identical" in pair else "",
            "accuracy diff": f"{pair['acc_diff']:+.4f}" if "acc_diff" in pair else "",
            "McNemar p": f"{pair['mcnemar_p']:.3f}" if "mcnemar_p" in pair else "",
            "verdict": pair.get("verdict", "control" if r.mode == "control" else "no control run to compare with"),
        })
    return rows


def to_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(str(row[c]) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of runs no other run beats on both fewer NFE and higher accuracy."""
    front = []
    for i, (x, y) in enumerate(points):
        if not any((x2 <= x and y2 >= y) and (x2 < x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i):
            front.append(i)
    return front


def plot(runs: list[Run], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    nfe = [float(r.spot.get("nfe_per_sample", float("nan"))) for r in runs]
    speed = [speed_vs_control(r, runs)[0] for r in runs]
    targets = sorted({r.target for r in runs})
    for c, t in enumerate(targets):
        colour = f"C{c % 10}"
        idx = [i for i, r in enumerate(runs) if r.target == t]
        # One front per target: runs of different targets are not alternatives to each other.
        for axis, ys in ((ax, [runs[i].accuracy for i in idx]), (ax2, [speed[i] for i in idx])):
            keep = [(i, y) for i, y in zip(idx, ys, strict=True) if y is not None]
            if not keep:
                continue
            pts = [(nfe[i], y) for i, y in keep]
            axis.scatter([p[0] for p in pts], [p[1] for p in pts], color=colour, s=40, label=Path(t).name)
            for (i, _), p in zip(keep, pts, strict=True):
                lab = runs[i].label.split(" ", 1)[1] + f" N={runs[i].spot.get('batch_size', 1)}"
                axis.annotate(lab, p, fontsize=7, xytext=(3, 3), textcoords="offset points")
            front = sorted(pareto(pts), key=lambda k: pts[k][0])
            axis.plot([pts[k][0] for k in front], [pts[k][1] for k in front], "--", color=colour, lw=1)
    ax.set_xlabel("NFE per sample")
    ax.set_ylabel("accuracy")
    ax.set_title("accuracy (dashed: each target's Pareto front)", fontsize=9)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_xlabel("NFE per sample")
    ax2.set_ylabel("tokens/s against control (same target, task, T, batch size)")
    ax2.set_title("what the user waits for: above 1 is faster than control", fontsize=9)
    for axis in (ax, ax2):
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    path = out / "accuracy_vs_nfe.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lm_eval_spot.tools.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path, help="lm-eval output folders or results_*.json files")
    ap.add_argument("--out", type=Path, default=Path("compare_out"))
    a = ap.parse_args(argv)
    try:
        runs = load_runs(a.paths)
    except CompareError as err:
        print(f"compare: {err}", file=sys.stderr)
        return 2
    rows = table_rows(runs)
    md = to_markdown(rows)
    print(md)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "compare.md").write_text(md + "\n")
    with (a.out / "compare.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(COLUMNS))
        w.writeheader()
        w.writerows(rows)
    png = plot(runs, a.out)
    print(f"\nwritten: {a.out / 'compare.md'}, {a.out / 'compare.csv'}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
