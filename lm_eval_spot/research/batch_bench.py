"""Batching, measured: every request decoded alone and in batches, compared token for token, timed in one run.

    python -m lm_eval_spot.research.batch_bench --n 500 --batch-size 8 --threads 2 --out docs/results/batch_cpu

For control and SPOT (budget 8) at T = 0 and T = 1 on a task's requests (default: spot_arith), decodes every
problem with batch_size 1 and with --batch-size (which runs first alternates per configuration), and reports how
many generations are identical, NFE per sample in both, and generated tokens per wall second in both (the
throughput ratio of batching). Writes results.json and table.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("lm_eval_spot.research.batch_bench")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lm_eval_spot.config import drafter_for, parse_args
    from lm_eval_spot.decoding.batch import DecodeJob, decode_many, for_request
    from lm_eval_spot.decoding.loop import DecodeConfig
    from lm_eval_spot.drafter.model import load_drafter
    from lm_eval_spot.families import load_target
    from lm_eval_spot.methods import MethodSpec, make_proposer
    from lm_eval_spot.stopping import make_stop_check
    from lm_eval_spot.task_source import TaskSource

    torch.set_num_threads(args.threads)
    loaded = load_target(parse_args({"pretrained": args.target, "mode": "control", "device": args.device}))
    adapter, tok = loaded.adapter, loaded.tokenizer
    drafter_path = drafter_for(parse_args({"pretrained": args.target, "mode": "control", "drafter": args.drafter}))
    drafter = load_drafter(drafter_path, adapter.info.block_len)[0]  # on the host, as in a run
    docs = TaskSource(args.tasks, args.n, eos=tok.eos_token).prompts
    prompts = [tok(d.context, add_special_tokens=False)["input_ids"] for d in docs]
    detok = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    stops = [make_stop_check(detok, list(d.until)) for d in docs]
    rows = []
    for c, (mode, T) in enumerate((m, t) for m in ("control", "spot") for t in args.temps):
        prop = make_proposer(MethodSpec(mode, args.budget), drafter)
        cfg = DecodeConfig(max_gen_toks=args.max_gen_toks, temperature=T)
        timed: dict[int, tuple[list[Any], float]] = {}
        for bs in (1, args.batch_size) if c % 2 == 0 else (args.batch_size, 1):
            jobs = [DecodeJob(ids, cfg, args.seed * 1_000_003 + i, stops[i], for_request(prop))
                    for i, ids in enumerate(prompts)]
            t0 = time.perf_counter()
            timed[bs] = (decode_many(adapter, jobs, batch_size=bs), time.perf_counter() - t0)
        (one, w1), (many, wb) = timed[1], timed[args.batch_size]
        inv: dict[str, Any] = {}
        if args.invariant:  # batch_invariant=true: one request at a time, every forward padded to 1 + budget rows
            pcfg = DecodeConfig(max_gen_toks=args.max_gen_toks, temperature=T, pad_rows=1 + args.budget)
            jobs = [DecodeJob(ids, pcfg, args.seed * 1_000_003 + i, stops[i], for_request(prop))
                    for i, ids in enumerate(prompts)]
            t0 = time.perf_counter()
            padded = decode_many(adapter, jobs, batch_size=1)
            wp = time.perf_counter() - t0
            inv = {"invariant_identical": sum(a.token_ids == b.token_ids for a, b in zip(one, padded, strict=True)),
                   "invariant_throughput_ratio": (sum(len(r.token_ids) for r in padded) / wp) /
                   (sum(len(r.token_ids) for r in one) / w1)}
        diff = [i for i, (a, b) in enumerate(zip(one, many, strict=True)) if a.token_ids != b.token_ids]
        gen1 = sum(len(r.token_ids) for r in one)
        genb = sum(len(r.token_ids) for r in many)
        rows.append({
            "mode": mode, "temperature": T, "budget": args.budget if mode == "spot" else None, "n": len(docs),
            "identical": len(docs) - len(diff), "differing_samples": diff[:20],
            "nfe_per_sample_bs1": sum(r.nfe.total for r in one) / len(docs),
            "nfe_per_sample_bsN": sum(r.nfe.total for r in many) / len(docs),
            "gen_tokens_per_s_bs1": gen1 / w1, "gen_tokens_per_s_bsN": genb / wb,
            "throughput_ratio": (genb / wb) / (gen1 / w1), "wall_s_bs1": w1, "wall_s_bsN": wb, **inv,
        })
        log.info("%s T=%g: %d/%d identical, %.1f -> %.1f tok/s (%.2fx)", mode, T, rows[-1]["identical"], len(docs),
                 gen1 / w1, genb / wb, rows[-1]["throughput_ratio"])
    return {"command": "python -m lm_eval_spot.research.batch_bench " + " ".join(args.argv), "batch_size": args.batch_size,
            "machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__,
                        "device": args.device}, "rows": rows}


def markdown(res: dict[str, Any]) -> str:
    B = res["batch_size"]
    lines = [f"| mode | T | n | identical to batch_size=1 | NFE/sample bs=1 | NFE/sample bs={B} | tok/s bs=1 | "
             f"tok/s bs={B} | throughput ratio |", "|---|---|---|---|---|---|---|---|---|"]
    if any("invariant_identical" in r for r in res["rows"]):
        lines[0] += " batch_invariant: identical | batch_invariant: throughput vs bs=1 |"
        lines[1] += "---|---|"
    for r in res["rows"]:
        extra = (f" {r['invariant_identical']} | {r['invariant_throughput_ratio']:.2f}x |"
                 if "invariant_identical" in r else "")
        lines.append(f"| {r['mode']} | {r['temperature']:g} | {r['n']} | {r['identical']} | "
                     f"{r['nfe_per_sample_bs1']:.2f} | {r['nfe_per_sample_bsN']:.2f} | {r['gen_tokens_per_s_bs1']:.1f} | "
                     f"{r['gen_tokens_per_s_bsN']:.1f} | {r['throughput_ratio']:.2f}x |" + extra)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from lm_eval_spot.config import default_target_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(default_target_path()))
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--tasks", default="spot_arith", help="lm-eval generation task (its prompts and stops)")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--temps", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--max-gen-toks", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--invariant", action="store_true",
                    help="also decode with batch_invariant padding (1 + budget rows per forward) and time it")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    res = run(args)
    table = markdown(res)
    log.info("\n%s", table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(res, indent=2))
        (args.out / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
