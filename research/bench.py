"""The benchmark: every drafting method x budget x temperature against control, in ONE process, per sample.

    python -m research.bench --quick                      # < 10 min on 2 cores
    python -m research.bench --n 100 --out docs/results/bench

Each sample is decoded by control, then by every configuration (in an order rotated per sample), then by
control again; a configuration's throughput ratio on that sample is control's mean wall time over its own, so
machine drift cancels. Prompts, stop strings and scoring come from one lm-eval generation task (--tasks, default
spot_arith) through lm-eval's task manager. Reported per configuration: accuracy (the task's metric), NFE per sample, tokens per
forward, accepted length per round, throughput ratio (median of paired ratios, with the 25-75% spread and the lowest),
exact-match-to-control; and budget=auto against the best fixed SPOT budget (ratio of medians, and paired per
problem). `--repeats k` times every decode k times and keeps the fastest, to cut timing noise. Writes
results.json, table.md and PNG plots (NFE and throughput ratio vs budget).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lm_eval_spot.settings.modes import BASELINE_MODES, LEARNED_MODES, MODE_TABLE

log = logging.getLogger("research.bench")

# Baselines first, then SPOT's modes, the oracle last (the table's drafting modes, in plotting order).
METHODS = BASELINE_MODES + LEARNED_MODES + tuple(m.name for m in MODE_TABLE
                                                 if m.drafts and not m.baseline and not m.learned)
BUDGETS = (4, 8, 12, 20)


@dataclass
class Row:
    method: str
    budget: int | str
    temperature: float
    nfe: list[int] = field(default_factory=list)
    control_nfe: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    gen_tokens: list[int] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)  # mean accepted length per round, per sample
    correct: list[float] = field(default_factory=list)  # the task's primary metric per sample
    texts: list[str] = field(default_factory=list)  # generations (cut at `until`), scored by the task at the end
    exact: list[bool] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)  # control wall / method wall, per sample
    wall_s: list[float] = field(default_factory=list)
    timing: list[tuple[float, float, float]] = field(default_factory=list)  # (forward, drafting, rest) s, per sample
    host_bytes: list[float] = field(default_factory=list)  # read back from the target's device per round
    lookahead: list[tuple[int, int, int, int]] = field(default_factory=list)  # (rows, exact, used, later blocks)

    def add_timing(self, r: Any) -> None:
        self.timing.append((r.timing.forward, r.timing.draft, r.timing.rest))
        self.host_bytes.append(r.host_bytes / max(1, r.rounds))
        la = r.lookahead
        self.lookahead.append((la.rows, la.exact, la.used, la.later_blocks))

    def summary(self) -> dict[str, Any]:
        n = len(self.nfe)
        q = statistics.quantiles(self.ratio, n=4) if n >= 2 else [self.ratio[0]] * 3
        nfe = sum(self.nfe) / n
        cnfe = sum(self.control_nfe) / n
        return {
            "method": self.method, "budget": self.budget, "temperature": self.temperature, "n": n,
            "accuracy": sum(self.correct) / n, "nfe_per_sample": nfe, "control_nfe_per_sample": cnfe,
            "nfe_reduction": cnfe / nfe, "tokens_per_forward": sum(self.committed) / sum(self.nfe),
            "accepted_per_round": sum(self.accepted) / n,
            "throughput_ratio": statistics.median(self.ratio), "throughput_ratio_q25": q[0],
            "throughput_ratio_q75": q[2], "throughput_ratio_min": min(self.ratio),
            "throughput_ratios": list(self.ratio), "exact_match_to_control": sum(self.exact) / n,
            "wall_s_per_sample": sum(self.wall_s) / n,
            # Per-round timing breakdown (seconds per sample): target forward, drafting, the rest of the round
            # (transitions, verification, transfers); and bytes read back from the target's device per round.
            "round_s_per_sample": {k: sum(t[j] for t in self.timing) / n
                                   for j, k in enumerate(("forward", "drafting", "rest"))} if self.timing else {},
            "host_bytes_per_round": sum(self.host_bytes) / n if self.host_bytes else 0.0,
            # Cross-block lookahead: rows carried, blocks finished exactly as a row said, later blocks whose first
            # round drafted from one, and blocks begun after the first (summed over samples).
            "lookahead": dict(zip(("rows", "exact", "used", "later_blocks"),
                                  (sum(t[j] for t in self.lookahead) for j in range(4)), strict=True)),
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from lm_eval_spot.budget import MAX_BUDGET, build_policy
    from lm_eval_spot.baselines.oracle import CommitLog, OracleProposer
    from lm_eval_spot.settings.cards import parse_model_args
    from lm_eval_spot.settings.args import drafter_for, default_graph_path
    from lm_eval_spot.decoding.batch import DecodeRequest, decode_many
    from lm_eval_spot.decoding.loop import DecodeConfig, decode
    from lm_eval_spot.drafter.model import load_drafter
    from lm_eval_spot.baselines.rank_graph import RankGraph
    from lm_eval_spot.families import load_target
    from lm_eval_spot.settings.proposers import MethodSpec, make_proposer
    from lm_eval_spot.harness.until import cut_text, make_stop_check
    from lm_eval_spot.training.prompts import TaskSource

    torch.set_num_threads(args.threads)
    model_args = dict(kv.split("=", 1) for kv in args.model_args.split(",") if kv) if args.model_args else {}
    model_args.setdefault("pretrained", args.target)
    model_args.setdefault("device", args.device)
    loaded = load_target(parse_model_args({**model_args, "mode": "control"}))
    adapter, tok = loaded.adapter, loaded.tokenizer
    chat = None
    if args.apply_chat_template:
        def chat(history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
            return tok.apply_chat_template(history, tokenize=False, add_generation_prompt=add_generation_prompt)
    source = TaskSource(args.tasks, args.n, chat, eos=tok.eos_token, include_path=args.include_path)
    L = adapter.info.block_len
    drafter_path = drafter_for(parse_model_args({**model_args, "mode": "control", "drafter": args.drafter}))
    drafter = load_drafter(drafter_path, L)[0]  # on the host, as in a run (drafter_device=cpu)
    graph = RankGraph.load(Path(args.graph or default_graph_path()))
    proposers: dict[tuple[str, int | str], Any] = {}
    for m in args.methods:
        for D in args.budgets:
            if m != "oracle":
                proposers[(m, D)] = make_proposer(MethodSpec(m, D, args.gamma), drafter, graph)
    # Other drafters side by side with the main one (rows "spot@NAME", "spot-gamma@NAME"): paired in one run.
    for name, path in args.drafters:
        other = load_drafter(Path(path), L)[0]
        for m in ("spot", "spot-gamma"):
            if m in args.methods:
                for D in args.budgets:
                    proposers[(f"{m}@{name}", D)] = make_proposer(MethodSpec(m, D, args.gamma), other)
    policies: dict[tuple[str, int | str], Any] = {}
    if args.auto:  # budget=auto at batch size 1, as a run measures it at start-up (on the canvas the run uses)
        proposers[("spot", "auto")] = make_proposer(MethodSpec("spot", MAX_BUDGET), drafter)
        policies[("spot", "auto")] = build_policy(adapter, proposers[("spot", "auto")], 1, args.max_gen_toks or 256)
    keys = list(proposers) + [("oracle", D) for D in args.budgets if "oracle" in args.methods]
    docs = source.prompts
    decode_ids = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    rows = {(k[0], k[1], T): Row(k[0], k[1], T) for T in args.temps for k in keys}
    bar = tqdm(total=len(docs) * len(args.temps) * (len(keys) + 2), desc="bench", unit="decode")
    t_start = time.perf_counter()
    for i, doc in enumerate(docs):
        ids = tok(doc.context, add_special_tokens=False)["input_ids"]
        stop = make_stop_check(decode_ids, list(doc.until))
        for T in args.temps:
            cfg = DecodeConfig(max_gen_toks=args.max_gen_toks or doc.max_gen_toks, temperature=T,
                               lookahead=args.lookahead)
            seed = args.seed * 1_000_003 + i
            commits = CommitLog()

            def run(proposer: Any = None, observer: Any = None, policy: Any = None) -> Any:
                if policy is not None:
                    job = DecodeRequest(ids, cfg, seed, stop, proposer, observer)
                    return decode_many(adapter, [job], 1, policy=policy)[0]
                return decode(adapter, ids, cfg, seed, stop_check=stop, proposer=proposer, observer=observer)

            c1, c1_wall = _timed(run, args.repeats, first=run(observer=commits))
            bar.update()
            order = keys[i % len(keys):] + keys[: i % len(keys)]  # rotate, so no method always runs first
            results = {}
            for m, D in order:
                prop = OracleProposer(commits, int(D)) if m == "oracle" else proposers[(m, D)]
                # A fork per request, as lm-eval runs it (a stateful proposer keeps per-request estimates).
                results[(m, D)] = _timed(lambda p=prop, k=(m, D): run(proposer=p,
                                                                     policy=policies.get(k)), args.repeats)
                bar.update()
            c2, c2_wall = _timed(run, args.repeats)
            bar.update()
            if c1.token_ids != c2.token_ids:
                log.warning("sample %d: two control runs differ (non-deterministic kernels?)", i)
            control_wall = (c1_wall + c2_wall) / 2
            for (m, D), (r, wall) in results.items():
                row = rows[(m, D, T)]
                row.nfe.append(r.nfe.total)
                row.control_nfe.append(c1.nfe.total)
                row.committed.append(r.committed)
                row.gen_tokens.append(len(r.token_ids))
                row.accepted.append(sum(r.accepted) / max(1, len(r.accepted)))
                row.texts.append(cut_text(decode_ids(r.token_ids), list(doc.until)))
                row.exact.append(r.token_ids == c1.token_ids)
                row.ratio.append(control_wall / wall)
                row.wall_s.append(wall)
                row.add_timing(r)
            for T_row in (rows.setdefault(("control", "-", T), Row("control", "-", T)),):
                T_row.nfe.append(c1.nfe.total)
                T_row.control_nfe.append(c1.nfe.total)
                T_row.committed.append(c1.committed)
                T_row.gen_tokens.append(len(c1.token_ids))
                T_row.accepted.append(0.0)
                T_row.texts.append(cut_text(decode_ids(c1.token_ids), list(doc.until)))
                T_row.exact.append(True)
                T_row.ratio.append(control_wall / c1.wall_s)
                T_row.wall_s.append(control_wall)
                T_row.add_timing(c2)  # c1 carried the commit log observer
    bar.close()
    for row in rows.values():  # the task's own filters and metric, as lm-eval scores them
        row.correct = source.score(row.texts)
    return {
        "task": source.name,
        "command": "python -m research.bench " + " ".join(args.argv),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "threads": args.threads,
                    "torch": torch.__version__, "device": args.device,
                    "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() and args.device != "cpu" else None},
        "n": args.n, "max_gen_toks": args.max_gen_toks, "block_len": L, "gamma": args.gamma,
        "lookahead": args.lookahead, "drafter": str(drafter_path),
        "other_drafters": dict(args.drafters),
        "wall_s": time.perf_counter() - t_start,
        "auto_policy": {k[0]: p.summary() for k, p in policies.items()},
        "repeats": args.repeats,
        "rows": [r.summary() for r in rows.values()],
        "auto_vs_best_fixed": auto_vs_best_fixed(rows),
        "spot_vs_baselines": spot_vs_baselines(rows),
    }


def _timed(run: Any, repeats: int, first: Any = None) -> tuple[Any, float]:
    """One decode (`first`, or a call of `run`) and the fastest wall time of it and `repeats - 1` more runs:
    outputs are deterministic, and the minimum is the least disturbed by other work on the machine."""
    result = first if first is not None else run()
    return result, min([result.wall_s] + [run().wall_s for _ in range(repeats - 1)])


def auto_vs_best_fixed(rows: dict[tuple[str, Any, float], Row]) -> list[dict[str, Any]]:
    """Per temperature: budget=auto against the fixed-budget SPOT configuration (spot or spot-gamma) with the
    highest median throughput ratio, both as the ratio of medians (the bar) and paired per sample (auto's
    throughput over the best's on the same problem: the sample-to-sample spread cancels)."""
    out = []
    for (m, D, T), auto in rows.items():
        if D != "auto" or not auto.ratio:
            continue
        fixed = [r for (m2, D2, T2), r in rows.items() if T2 == T and m2 in ("spot", "spot-gamma") and D2 != "auto"]
        if not fixed:
            continue
        best = max(fixed, key=lambda r: statistics.median(r.ratio))
        paired = [a / b for a, b in zip(auto.ratio, best.ratio, strict=True)]
        q = statistics.quantiles(paired, n=4) if len(paired) >= 2 else [paired[0]] * 3
        out.append({
            "temperature": T, "auto": f"{m} budget=auto", "best_fixed": f"{best.method} D={best.budget}",
            "ratio_of_medians": statistics.median(auto.ratio) / statistics.median(best.ratio),
            "paired_median": statistics.median(paired), "paired_q25": q[0], "paired_q75": q[2],
        })
    return out


def spot_vs_baselines(rows: dict[tuple[str, Any, float], Row]) -> dict[str, list[dict[str, Any]]]:
    """Per temperature: at each fixed budget, SPOT's NFE against the fewest of the training-free baselines (free
    chain, confidence tree, graph) at that budget (the fewest of the SPOT modes run); and the best SPOT configuration's median throughput ratio
    (any SPOT mode and budget, auto included) against the best graph configuration's."""
    nfe, speed = [], []
    for T in sorted({k[2] for k in rows}):
        at_t = {(m, D): r for (m, D, T2), r in rows.items() if T2 == T and r.nfe}
        for D in sorted({D for _, D in at_t if isinstance(D, int)}):
            base = [(m, sum(r.nfe) / len(r.nfe)) for (m, D2), r in at_t.items() if D2 == D and m in BASELINE_MODES]
            spots = [(m, sum(r.nfe) / len(r.nfe)) for (m, D2), r in at_t.items() if D2 == D and m.startswith("spot")]
            if base and spots:
                m, b = min(base, key=lambda x: x[1])
                sm, s_nfe = min(spots, key=lambda x: x[1])
                nfe.append({"temperature": T, "budget": D, "spot": sm, "spot_nfe": s_nfe, "best_baseline": m,
                            "baseline_nfe": b, "fewer_nfe": 1.0 - s_nfe / b})
        spots = [(f"{m} D={D}", statistics.median(r.ratio)) for (m, D), r in at_t.items() if m.startswith("spot")]
        graphs = [(f"graph D={D}", statistics.median(r.ratio)) for (m, D), r in at_t.items() if m == "graph"]
        if spots and graphs:
            bs, bg = max(spots, key=lambda x: x[1]), max(graphs, key=lambda x: x[1])
            speed.append({"temperature": T, "best_spot": bs[0], "spot_ratio": bs[1], "best_graph": bg[0],
                          "graph_ratio": bg[1], "spot_over_graph": bs[1] / bg[1]})
    return {"nfe": nfe, "throughput": speed}


def markdown_table(res: dict[str, Any]) -> str:
    head = ("| method | D | T | n | accuracy | NFE/sample | NFE reduction | tokens/forward | accepted/round | "
            "throughput ratio [q25, q75] | lowest | exact-match-to-control |")
    lines = [head, "|" + "---|" * 12]
    for r in sorted(res["rows"], key=lambda r: (r["temperature"], _mkey(r["method"]), r["method"], _bkey(r["budget"]))):
        lines.append(
            f"| {r['method']} | {r['budget']} | {r['temperature']:g} | {r['n']} | {r['accuracy']:.3f} | "
            f"{r['nfe_per_sample']:.1f} | {r['nfe_reduction']:.2f}x | {r['tokens_per_forward']:.2f} | "
            f"{r['accepted_per_round']:.2f} | {r['throughput_ratio']:.2f}x [{r['throughput_ratio_q25']:.2f}, "
            f"{r['throughput_ratio_q75']:.2f}] | {r['throughput_ratio_min']:.2f}x | "
            f"{r['exact_match_to_control']:.3f} |"
        )
    for c in res.get("auto_vs_best_fixed", []):
        lines.append(
            f"\nT={c['temperature']:g}: {c['auto']} reaches {c['ratio_of_medians']:.1%} of the best fixed budget's "
            f"throughput ({c['best_fixed']}); paired per problem, median {c['paired_median']:.3f} "
            f"[{c['paired_q25']:.3f}, {c['paired_q75']:.3f}]"
        )
    vs = res.get("spot_vs_baselines") or {}
    if vs.get("nfe"):
        lines.append("\n| T | D | fewest SPOT NFE | fewest baseline NFE | SPOT fewer by |")
        lines.append("|---|---|---|---|---|")
        for c in vs["nfe"]:
            lines.append(f"| {c['temperature']:g} | {c['budget']} | {c['spot_nfe']:.2f} ({c['spot']}) | {c['baseline_nfe']:.2f} "
                         f"({c['best_baseline']}) | {c['fewer_nfe']:.1%} |")
    for c in vs.get("throughput", []):
        lines.append(f"\nT={c['temperature']:g}: best SPOT configuration {c['best_spot']} at {c['spot_ratio']:.2f}x "
                     f"control, best graph {c['best_graph']} at {c['graph_ratio']:.2f}x: "
                     f"{c['spot_over_graph']:.3f}x the graph's throughput")
    return "\n".join(lines) + "\n"


def _mkey(m: str) -> int:
    order = ("control",) + METHODS
    return order.index(m) if m in order else len(order)


def _bkey(b: int | str) -> float:
    return float(b) if isinstance(b, int) else 1e9


def plot(res: dict[str, Any], out: Path) -> list[Path]:
    """NFE and throughput ratio vs budget, one panel per temperature. Needs matplotlib (the bench extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'lm-eval-spot[bench]'): no plots written")
        return []
    written = []
    temps = sorted({r["temperature"] for r in res["rows"]})
    for key, label, fname in (("nfe_per_sample", "target forwards (NFE) per sample", "nfe_vs_budget.png"),
                              ("throughput_ratio", "throughput ratio vs control (median)", "throughput_vs_budget.png")):
        fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.2), squeeze=False)
        for ax, T in zip(axes[0], temps, strict=True):
            rows = [r for r in res["rows"] if r["temperature"] == T]
            for m in METHODS:
                pts = sorted((r["budget"], r[key]) for r in rows if r["method"] == m and isinstance(r["budget"], int))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m,
                            linestyle="--" if m in BASELINE_MODES or m == "oracle" else "-")
            for r in rows:
                if r["method"] == "control":
                    ax.axhline(r[key], color="black", linewidth=0.8, label="control")
                if r["budget"] == "auto":
                    ax.axhline(r[key], color="tab:red", linestyle=":", label=f"{r['method']} budget=auto")
            ax.set_xlabel("budget D (drafted states per round)")
            ax.set_ylabel(label)
            ax.set_title(f"T = {T:g}, n = {rows[0]['n'] if rows else 0}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    import sys

    from lm_eval_spot.settings.args import default_target_path

    raw = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m research.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(default_target_path()), help="checkpoint folder (= pretrained=)")
    ap.add_argument("--model_args", default="", help="spot-dlm model args for the target: pretrained=...,dtype=...")
    ap.add_argument("--tasks", default="spot_arith", help="one lm-eval generation task (its prompts and metric)")
    ap.add_argument("--include_path", default=None, help="extra lm-eval task folder")
    ap.add_argument("--apply_chat_template", action="store_true", help="prompts through the tokenizer's chat template")
    ap.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    ap.add_argument("--drafters", default="",
                    help="more drafters for spot and spot-gamma rows in the same run: NAME=FOLDER,... (rows spot@NAME)")
    ap.add_argument("--graph", default=None, help="calibrated draft graph (default: the shipped one)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list from {', '.join(METHODS)}")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("--n", "--limit", type=int, default=100, help="the task's first n requests")
    ap.add_argument("--quick", action="store_true", help="12 problems: finishes in under 10 minutes on 2 cores")
    ap.add_argument("--no-auto", dest="auto", action="store_false", help="skip the spot budget=auto rows")
    ap.add_argument("--gamma", type=float, default=0.05)
    ap.add_argument("--no-lookahead", dest="lookahead", action="store_false",
                    help="decode without cross-block lookahead (every method; the default decoder has it)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="time every decode this many times and keep the fastest (less noise, proportionally slower)")
    ap.add_argument("--max-gen-toks", type=int, default=96, help="generation cap (0: the task's max_gen_toks)")
    ap.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_out", help="folder for results.json, table.md and plots")
    a = ap.parse_args(raw)
    a.argv = raw
    if a.quick:
        a.n = min(a.n, 12)
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    try:
        a.drafters = [tuple(x.split("=", 1)) for x in a.drafters.split(",") if x.strip()]
        assert all(len(x) == 2 and x[0] and x[1] for x in a.drafters)
    except AssertionError:
        ap.error("--drafters takes NAME=FOLDER pairs, comma-separated")
    bad = sorted(set(a.methods) - set(METHODS))
    if bad:
        ap.error(f"unknown method(s) {', '.join(bad)}; accepted: {', '.join(METHODS)}")
    try:
        a.budgets = [int(b) for b in a.budgets.split(",")]
        a.temps = [float(t) for t in a.temps.split(",")]
    except ValueError:
        ap.error("--budgets takes integers and --temps numbers, comma-separated")
    if any(b < 1 for b in a.budgets) or any(t < 0 for t in a.temps) or a.n < 1 or a.repeats < 1:
        ap.error("budgets must be >= 1, temperatures >= 0, --n and --repeats >= 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = run(a)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    table = markdown_table(res)
    (out / "table.md").write_text(f"`{res['command']}`\n\n" + table)
    plots = plot(res, out)
    log.info("%s\nwrote %s (%.0f s)", table, ", ".join(str(p) for p in [out / "results.json", out / "table.md", *plots]),
             res["wall_s"])


if __name__ == "__main__":
    main()
