"""Batching, measured as the user waits for it: whole-run wall time and generated tokens per second of every
method at several batch sizes, in one process, with the ratio to control at the SAME batch size.

    python -m research.batch_bench --n 500 --sizes 1 8 32 --threads 2 --out docs/results/batch_cpu

For each temperature and batch size N, every configuration (control, the calibrated graph and SPOT at each
--budgets value, SPOT budget=auto) decodes all problems with batch_size N; the configurations' order is rotated
from one (T, N) to the next. Reported per configuration and N: tokens per second, wall time, NFE per sample,
the throughput ratio to control at that N, and how many generations are identical to the configuration's own
batch_size=1 run (when 1 is among --sizes). Writes results.json and table.md.
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from research.report import report

log = logging.getLogger("research.batch_bench")


def configurations(budgets: list[int], auto: bool, graph: bool, extra: Sequence[str] = ()
                   ) -> list[tuple[str, int | str | None]]:
    """(method label, budget) pairs; `extra` names further drafters, each a SPOT configuration `spot[NAME]`."""
    out: list[tuple[str, int | str | None]] = [("control", None)]
    out += [("graph", D) for D in budgets] if graph else []
    for label in ["spot"] + [f"spot[{name}]" for name in extra]:
        out += [(label, D) for D in budgets]
        out += [(label, "auto")] if auto else []
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lm_eval_spot.budget import MAX_BUDGET, build_policy
    from lm_eval_spot.baselines.rank_graph import RankGraph
    from lm_eval_spot.settings.args import SHIPPED_DRAFTERS, default_graph_path, drafter_for, parse_args, shipped_drafter_path
    from lm_eval_spot.decoding.batch import DecodeRequest, decode_many
    from lm_eval_spot.decoding.loop import DecodeConfig
    from lm_eval_spot.drafter.model import load_drafter
    from lm_eval_spot.families import load_target
    from lm_eval_spot.settings.proposers import MethodSpec, make_proposer
    from lm_eval_spot.harness.until import make_stop_check
    from lm_eval_spot.training.prompts import TaskSource

    torch.set_num_threads(args.threads)
    loaded = load_target(parse_args({"pretrained": args.target, "mode": "control", "device": args.device}))
    adapter, tok = loaded.adapter, loaded.tokenizer
    drafter_path = drafter_for(parse_args({"pretrained": args.target, "mode": "control", "drafter": args.drafter}))
    drafters = {"spot": load_drafter(drafter_path, adapter.info.block_len)[0]}  # on the host, as in a run
    extra = dict(d.split("=", 1) if "=" in d else (d, str(shipped_drafter_path(d)) if d in SHIPPED_DRAFTERS else d)
                 for d in args.drafters)
    for name, path in extra.items():
        drafters[f"spot[{name}]"] = load_drafter(Path(path), adapter.info.block_len)[0]
    graph = RankGraph.load(Path(args.graph or default_graph_path())) if args.graph_mode else None
    docs = TaskSource(args.tasks, args.n, eos=tok.eos_token).prompts
    prompts = [tok(d.context, add_special_tokens=False)["input_ids"] for d in docs]
    detok = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    stops = [make_stop_check(detok, list(d.until)) for d in docs]
    configs = configurations(args.budgets, args.auto, args.graph_mode, list(extra))

    def proposer(label: str, budget: int | str | None) -> Any:
        drafter = drafters.get(label, drafters["spot"])
        D = MAX_BUDGET if budget == "auto" else int(budget or 1)
        return make_proposer(MethodSpec(label.split("[")[0], D), drafter, graph)

    def policy(prop: Any, budget: int | str | None, N: int) -> Any:
        # budget=auto as a run builds it: measured at start-up for this batch size, fresh per run
        return build_policy(adapter, prop, N, args.max_gen_toks) if budget == "auto" else None

    rows, outputs, k = [], {}, 0
    for T in args.temps:
        cfg = DecodeConfig(max_gen_toks=args.max_gen_toks, temperature=T, lookahead=args.lookahead)
        for N in args.sizes:
            order = configs[k % len(configs):] + configs[: k % len(configs)]  # rotated per (T, N)
            k += 1
            for mode, budget in order:
                prop = proposer(mode, budget)  # fresh per run: budget=auto's calibration starts over
                jobs = [DecodeRequest(ids, cfg, args.seed * 1_000_003 + i, stops[i], prop)
                        for i, ids in enumerate(prompts)]
                pol = policy(prop, budget, N)
                t0 = time.perf_counter()
                res = decode_many(adapter, jobs, batch_size=N, policy=pol)
                wall = time.perf_counter() - t0
                outputs[(mode, budget, T, N)] = [r.token_ids for r in res]
                gen = sum(len(r.token_ids) for r in res)
                rows.append({"mode": mode, "budget": budget, "temperature": T, "batch_size": N, "n": len(docs),
                             "wall_s": wall, "gen_tokens": gen, "gen_tokens_per_s": gen / wall,
                             "nfe_per_sample": sum(r.nfe.total for r in res) / len(docs)})
                log.info("T=%g N=%d %s D=%s: %.1f tok/s, %.1f NFE/sample", T, N, mode, budget, gen / wall,
                         rows[-1]["nfe_per_sample"])
        if args.invariant:  # batch_invariant=true: one request at a time, every forward padded to one row count
            pad = 1 + max(args.budgets + ([MAX_BUDGET] if args.auto else []))
            pcfg = DecodeConfig(max_gen_toks=args.max_gen_toks, temperature=T, pad_rows=pad)
            for mode, budget in configs:
                prop = proposer(mode, budget)
                jobs = [DecodeRequest(ids, pcfg, args.seed * 1_000_003 + i, stops[i], prop)
                        for i, ids in enumerate(prompts)]
                t0 = time.perf_counter()
                res = decode_many(adapter, jobs, batch_size=1, policy=policy(prop, budget, 1))
                wall = time.perf_counter() - t0
                outputs[(mode + " (batch_invariant)", budget, T, 0)] = [r.token_ids for r in res]
                gen = sum(len(r.token_ids) for r in res)
                rows.append({"mode": mode + " (batch_invariant)", "budget": budget, "temperature": T,
                             "batch_size": 0, "n": len(docs), "wall_s": wall, "gen_tokens": gen,
                             "gen_tokens_per_s": gen / wall, "nfe_per_sample": sum(r.nfe.total for r in res) / len(docs)})
    for r in rows:
        # batch_size 0: the batch_invariant rows (one at a time, padded), against batch_invariant control
        ctrl = next(c for c in rows if c["mode"].startswith("control") and c["temperature"] == r["temperature"]
                    and c["batch_size"] == r["batch_size"])
        r["throughput_vs_control"] = r["gen_tokens_per_s"] / ctrl["gen_tokens_per_s"]
        one = outputs.get((r["mode"].removesuffix(" (batch_invariant)"), r["budget"], r["temperature"], 1))
        mine = outputs[(r["mode"], r["budget"], r["temperature"], r["batch_size"])]
        r["identical_to_bs1"] = None if one is None else sum(a == b for a, b in zip(one, mine, strict=True))
    return {"command": "python -m research.batch_bench " + " ".join(args.argv), "sizes": args.sizes,
            "lookahead": args.lookahead,
            "machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__,
                        "device": args.device}, "rows": rows}


def markdown(res: dict[str, Any]) -> str:
    lines = ["| T | N | method | tok/s | wall s | NFE/sample | throughput vs control at N | identical to N=1 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(res["rows"], key=lambda r: (r["temperature"], r["batch_size"])):
        name = r["mode"] if r["budget"] is None else f"{r['mode']} D={r['budget']}"
        n_label = "1, padded" if r["batch_size"] == 0 else str(r["batch_size"])
        same = "-" if r["identical_to_bs1"] is None else f"{r['identical_to_bs1']}/{r['n']}"
        lines.append(f"| {r['temperature']:g} | {n_label} | {name} | {r['gen_tokens_per_s']:.1f} | "
                     f"{r['wall_s']:.1f} | {r['nfe_per_sample']:.2f} | {r['throughput_vs_control']:.2f}x | {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from lm_eval_spot.settings.args import default_target_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(default_target_path()))
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--drafters", nargs="*", default=[],
                    help="further drafters run as SPOT configurations spot[NAME]: NAME=PATH, or a shipped name "
                         "(small, transfer)")
    ap.add_argument("--tasks", default="spot_arith", help="lm-eval generation task (its prompts and stops)")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32], help="batch sizes N")
    ap.add_argument("--batch-size", type=int, default=None, help="shorthand for --sizes 1 N (earlier runs' option)")
    ap.add_argument("--invariant", action="store_true",
                    help="also decode each configuration one request at a time with batch_invariant padding "
                         "(1 + the largest budget rows per forward) and compare it with batch_size=1")
    ap.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 20], help="fixed budgets (SPOT and graph)")
    ap.add_argument("--no-auto", dest="auto", action="store_false", help="leave out SPOT budget=auto")
    ap.add_argument("--no-graph", dest="graph_mode", action="store_false", help="leave out the calibrated graph")
    ap.add_argument("--graph", default=None, help="draft graph JSON (default: the shipped one)")
    ap.add_argument("--temps", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--no-lookahead", dest="lookahead", action="store_false",
                    help="decode without cross-block lookahead (the model's default decoder has it)")
    ap.add_argument("--max-gen-toks", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.batch_size is not None:
        args.sizes = [1, args.batch_size]
    args.argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    res = run(args)
    report(log, res, markdown(res), args.out)


if __name__ == "__main__":
    main()
