"""budget=auto's start-up measurement: the target forward's cost by total rows on the user's device, at the width
the run's rows have (a block-causal row: its block after a prefix; a bidirectional row: its whole canvas), and the
host work of drafting (the stale summary, the order source's per-round pass, the tree search per node).

The step policy that uses them is `decoding.step_policy.StepPolicy`; it keeps them current as the run goes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lm_eval_spot.adapters.base import TargetAdapter, positions_needed
from lm_eval_spot.decoding.proposer import DrafterOptions, Proposer, RoundContext
from lm_eval_spot.decoding.stale import summarize
from lm_eval_spot.decoding.step_policy import StartupCosts, StepPolicy
from lm_eval_spot.transfer import HostLink, sync

log = logging.getLogger("lm_eval.spot")

MAX_BUDGET = 16  # the deepest tree budget=auto drafts for a request in one round
ROWS_PER_REQUEST = 6  # the start-up curve spans batch size x this many rows; beyond, its last slope extends it
DENSE_ROWS = 16  # every row count up to this one is timed; beyond, a geometric grid


def row_grid(max_rows: int) -> tuple[int, ...]:
    """Row counts to time: 1 .. DENSE_ROWS, then about 1.4x apart up to max_rows."""
    grid = list(range(1, min(DENSE_ROWS, max_rows) + 1))
    r = float(grid[-1])
    while grid[-1] < max_rows:
        r *= 1.4
        grid.append(min(max_rows, max(grid[-1] + 1, round(r))))
    return tuple(grid)


def measure_startup(adapter: TargetAdapter, proposer: Proposer, batch_size: int, gen_length: int = 256,
                    repeats: int = 3, temperature: float = 0.0, prompt_len: int = 0) -> StartupCosts:
    """Time the target on R rows of a block (after a 2-block prefix; a bidirectional target recomputes its canvas of
    prompt + gen_length, so its rows are measured at that canvas), R over `row_grid`, and the drafting of one
    round (summary, order pass, a tree of 1 and of MAX_BUDGET nodes), for each of a `DrafterOptions`' drafters. Each size keeps its fastest repeat after a
    warm-up: a job sharing the cores inflates some repeats at random, the minimum is the machine's cost."""
    t_start = time.perf_counter()
    info = adapter.info
    L = info.block_len
    dev = adapter.device
    filler = next(t for t in range(info.vocab_size) if t != info.mask_id and t not in info.stop_ids)
    prompt = prompt_len or 2 * L  # a 2-block prefix unless the requests' own length is known
    session, _ = adapter.open([filler] * prompt, gen_length)
    block = torch.full((L,), info.mask_id, dtype=torch.long)
    block[: L // 2] = filler
    grid = row_grid(max(2, batch_size * ROWS_PER_REQUEST))
    fwd = {r: float("inf") for r in grid}
    with torch.no_grad():
        session.block_logits(block[None])  # stores the prefix; also the warm-up
        for _ in range(repeats):  # interleaved, so drift hits every size alike
            for r in grid:
                sync(dev)
                t0 = time.perf_counter()
                session.block_logits(block[None].repeat(r, 1))
                sync(dev)
                fwd[r] = min(fwd[r], 1000 * (time.perf_counter() - t0))
        options = proposer.options if isinstance(proposer, DrafterOptions) else (proposer,)
        drafting = [_drafting_ms(adapter, p, block, repeats, temperature) for p in options]
    (fixed, node), others = drafting[0], tuple(drafting[1:])
    costs = StartupCosts(grid, tuple(fwd[r] for r in grid), fixed, node, time.perf_counter() - t_start, others,
                         positions_needed(info, prompt, gen_length))
    log.info("spot-dlm: budget=auto measured at start-up in %.1f s: forward %s ms; drafting %.2f ms per request "
             "and round + %.3f ms per node", costs.seconds,
             ", ".join(f"{r} rows {ms:.2f}" for r, ms in zip(grid, costs.forward_ms, strict=True)
                       if r in (1, 2, 4, 8, 16) or r == grid[-1]), fixed, node)
    for name, (a, b) in zip(proposer.names[1:] if isinstance(proposer, DrafterOptions) else (), others, strict=True):
        log.info("spot-dlm: budget=auto may draft with %s instead: %.2f ms per request and round + %.3f ms per node",
                 name, a, b)
    return costs


def _drafting_ms(adapter: TargetAdapter, proposer: Proposer, block: torch.Tensor, repeats: int,
                 temperature: float) -> tuple[float, float]:
    """(per round, per node) ms of a drafting round's host work: the stale summary's copy to the host, the order
    source's per-round pass and the tree search, fitted through a tree of 1 and one of MAX_BUDGET nodes."""
    info = adapter.info
    L = block.shape[0]
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(1, L, info.vocab_size, generator=gen) * 4).to(adapter.device)
    gumbel = None
    if temperature > 0:
        u = torch.rand(L, info.vocab_size, generator=gen).clamp_min(1e-20)
        gumbel = (-torch.log(-torch.log(u))).double().to(adapter.device)
    open_ = block == info.mask_id
    times = {1: float("inf"), MAX_BUDGET: float("inf")}
    for _ in range(repeats + 1):
        for d in times:
            sync(adapter.device)
            t0 = time.perf_counter()
            stale = summarize(logits, HostLink(), temperature, gumbel)[0]
            ctx = RoundContext(block, open_, ~open_, stale, temperature, gumbel, info.mask_id, budget=d)
            proposer.propose(ctx)
            times[d] = min(times[d], 1000 * (time.perf_counter() - t0))
    node = max(0.0, (times[MAX_BUDGET] - times[1]) / (MAX_BUDGET - 1))
    return max(0.0, times[1] - node), node


# A fully bidirectional request's canvas within this factor of the one measured at start-up: the curve stands.
CANVAS_SLACK = 1.25


@dataclass(frozen=True)
class CanvasCheck:
    """The start-up measurement taken again, before the first step, where it was taken on a canvas unlike the
    requests' own. A fully bidirectional target's row costs its whole canvas (prompt + generation), and start-up
    knows neither before lm-eval's requests arrive: measured at 256 generated tokens, e8c's curve (a task of 80)
    ran about 2x the run's forwards for most of a run, and the policy drafted where nothing paid (0.84x control).
    A block-causal row costs its block whatever the canvas (re-measured after a 136-token prefix: the same curve),
    so those targets keep their start-up curve."""

    adapter: TargetAdapter
    proposer: Proposer
    batch_size: int

    def fit(self, policy: StepPolicy, prompt_lens: Sequence[int], gen_length: int) -> bool:
        """Re-measure for requests of these prompt lengths and generation length if their canvas is off the
        measured one by more than CANVAS_SLACK. True if it did."""
        info = self.adapter.info
        if info.grid_origin != "prompt_end" or not prompt_lens:
            return False
        prompt = sorted(prompt_lens)[len(prompt_lens) // 2]
        canvas, measured = positions_needed(info, prompt, gen_length), policy.startup.canvas
        if measured and 1 / CANVAS_SLACK <= canvas / measured <= CANVAS_SLACK:
            return False
        log.info("spot-dlm: budget=auto measures at the requests' canvas (%d positions%s)", canvas,
                 f", not the {measured} measured at start-up" if measured else "")
        policy.restart(measure_startup(self.adapter, self.proposer, self.batch_size, gen_length, prompt_len=prompt))
        return True


def build_policy(adapter: TargetAdapter, proposer: Proposer, batch_size: int, gen_length: int,
                 defer: bool = False) -> StepPolicy:
    """The run's budget=auto policy, measured on this adapter's device; with `defer`, not yet: `CanvasCheck`
    measures it before the first step, at the requests' canvas (a fully bidirectional target's row is its whole
    canvas, which start-up does not know: measuring twice cost e8c 1-5 s at batch size 8-32)."""
    costs = (StartupCosts((1, 2), (1.0, 2.0), 0.0, 0.0, other_drafters=((0.0, 0.0),) * (
        len(proposer.options) - 1 if isinstance(proposer, DrafterOptions) else 0))
             if defer else measure_startup(adapter, proposer, batch_size, gen_length))
    names = proposer.names if isinstance(proposer, DrafterOptions) else ("drafter",)
    return StepPolicy(costs, MAX_BUDGET, batch_size * (MAX_BUDGET + 2), names)
