"""How fast SPOT could be at batch size N on this machine, whatever its implementation: an upper bound from the
target's measured cost curve and SPOT's measured commits per round.

    python -m research.batch_bound --n 100 --sizes 8 32 --budgets 1 2 4 8 --out docs/results/batch_bound_cpu

A round of SPOT at budget D runs 1 + D rows per request and commits c(D) tokens per request on average (measured
here at batch size 1; cross-block lookahead on, its extra rows not charged). Control runs 1 row and commits 1. In
a step with N live requests the forward costs t(rows) (measured: N sessions, k rows each, one shared forward),
and every request-round also costs host work h (measured on control's own run at N: wall time less forward
time, per request-round). Charging SPOT's rounds control's host work and NOTHING for drafting, summaries, trees
or lookahead, SPOT's throughput relative to control at N is at most

    bound(N, D) = (t(N x 1) / N + h) / ((t(N x (1 + D)) / N + h) / c(D))

so no scheduling of the same drafter's trees can do better (a request's rows cost what the forward's rows cost;
drafting only adds work). `forward_only` is the same with h = 0. Writes results.json and table.md.
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from research.report import report

log = logging.getLogger("research.batch_bound")


def forward_curve(adapter: Any, prompts: list[list[int]], N: int, ks: list[int], repeats: int) -> dict[int, float]:
    """ms of one shared forward over N requests x k rows each, after a generated block (a real prefix): the
    fastest of `repeats` (after a warm-up)."""
    from lm_eval_spot.adapters.base import RowsCall

    info = adapter.info
    L, mask = info.block_len, info.mask_id
    calls = []
    for p in prompts[:N]:
        session, tail = adapter.open(p, 4 * L)
        st = torch.full((L,), mask, dtype=torch.long)
        st[: len(tail)] = torch.tensor(tail, dtype=torch.long)
        session.block_logits(st[None])
        full = st.clone()
        full[len(tail):] = p[-1]
        session.commit_block(full)
        session.block_logits(torch.full((1, L), mask, dtype=torch.long))  # stores the block: no pending left
        calls.append(session)
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(repeats):  # interleaved, so drift hits every size alike
        for k in ks:
            batch = [RowsCall(s, torch.full((k, L), mask, dtype=torch.long)) for s in calls]
            t0 = time.perf_counter()
            adapter.forward_many(batch)
            times[k].append(time.perf_counter() - t0)
    # The fastest repeat after a warm-up: another job on the cores inflates some repeats at random (the minimum
    # is the machine's cost, for control's rows and SPOT's alike).
    return {k: 1000 * min(t[1:]) for k, t in times.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lm_eval_spot.settings.args import drafter_for, parse_args
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
    drafter = load_drafter(drafter_for(parse_args({"pretrained": args.target, "mode": "control"})),
                           adapter.info.block_len)[0]
    docs = TaskSource(args.tasks, args.n, eos=tok.eos_token).prompts
    prompts = [tok(d.context, add_special_tokens=False)["input_ids"] for d in docs]
    detok = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    stops = [make_stop_check(detok, list(d.until)) for d in docs]
    cfg = DecodeConfig(max_gen_toks=args.max_gen_toks, temperature=args.temperature, lookahead=True)

    def jobs(prop: Any) -> list[DecodeRequest]:
        return [DecodeRequest(p, cfg, args.seed * 1_000_003 + i, stops[i], prop)
                for i, p in enumerate(prompts)]

    commits_per_round = {}
    for D in args.budgets:
        res = decode_many(adapter, jobs(make_proposer(MethodSpec("spot", D), drafter, None)), batch_size=1)
        commits_per_round[D] = sum(r.committed for r in res) / sum(r.rounds for r in res)
        log.info("spot D=%d: %.2f commits per round", D, commits_per_round[D])
    out: dict[str, Any] = {"commits_per_round": commits_per_round, "sizes": {}}
    forward_many = adapter.forward_many
    for N in args.sizes:
        spent = [0.0]

        def timed(calls: Any, _f: Any = forward_many, _s: list[float] = spent) -> Any:
            t0 = time.perf_counter()
            got = _f(calls)
            _s[0] += time.perf_counter() - t0
            return got

        adapter.forward_many = timed
        t0 = time.perf_counter()
        res = decode_many(adapter, jobs(None), batch_size=N)
        wall = time.perf_counter() - t0
        adapter.forward_many = forward_many
        rounds = sum(r.rounds for r in res)
        host_ms = 1000 * (wall - spent[0]) / rounds
        curve = forward_curve(adapter, prompts, N, sorted({1} | {1 + D for D in args.budgets}), args.repeats)
        per_req = {k: t / N for k, t in curve.items()}
        rows = []
        for D in args.budgets:
            c = commits_per_round[D]
            ctrl = per_req[1] + host_ms
            rows.append({"D": D, "commits_per_round": c,
                         "bound": ctrl / ((per_req[1 + D] + host_ms) / c),
                         "forward_only": per_req[1] / (per_req[1 + D] / c)})
        out["sizes"][N] = {"forward_ms": curve, "control_host_ms_per_request_round": host_ms,
                           "control_wall_s": wall, "bounds": rows}
        log.info("N=%d: forward ms %s; control host %.3f ms per request-round; bounds %s", N,
                 {k: round(v, 2) for k, v in curve.items()}, host_ms,
                 ", ".join(f"D={r['D']}: {r['bound']:.2f}x" for r in rows))
    return {"command": "python -m research.batch_bound " + " ".join(args.argv),
            "machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__},
            "temperature": args.temperature, "n": len(prompts), **out}


def markdown(res: dict[str, Any]) -> str:
    lines = ["| N | D | commits per round c(D) | t(N x (1+D)) / t(N x 1) | control host ms per request-round | "
             "bound: SPOT / control | forward only |", "|---|---|---|---|---|---|---|"]
    for N, s in res["sizes"].items():
        f = s["forward_ms"]
        for r in s["bounds"]:
            lines.append(f"| {N} | {r['D']} | {r['commits_per_round']:.2f} | {f[1 + r['D']] / f[1]:.2f} | "
                         f"{s['control_host_ms_per_request_round']:.3f} | {r['bound']:.2f}x | "
                         f"{r['forward_only']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from lm_eval_spot.settings.args import default_target_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(default_target_path()))
    ap.add_argument("--tasks", default="spot_arith")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--budgets", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-gen-toks", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    res = run(args)
    report(log, res, markdown(res), args.out)


if __name__ == "__main__":
    main()
