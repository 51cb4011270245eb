"""Several requests through the target together: a step loop over a set of live requests.

Each live request is a `RequestDecoder` with its own state, noise, proposer (a shared proposer keeps no
per-request state: each round's verdict reaches it through `LearnsFromVerdicts.on_verdict`) and stop condition.
Every step asks each for its next round's replica states, runs them through the target in as few forwards as the
adapter can (`TargetAdapter.forward_many`: one shared forward for every live request, their pending blocks and
lookahead rows included), and applies each request's round. Finished requests leave and queued ones join, so the batch
stays full. A request's output never depends on its batch-mates: its rows' arithmetic is its own.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lm_eval_spot.adapters.base import RowsCall, TargetAdapter
from lm_eval_spot.decoding.step_policy import RequestPace, StepPolicy, StepView
from lm_eval_spot.decoding.loop import (DecodeConfig, DecodeResult, NonFiniteLogitsError, RequestDecoder, RoundObserver,
                                        StopCheck)
from lm_eval_spot.decoding.proposer import Proposer, prepare_batch
from lm_eval_spot.transfer import sync


@dataclass
class StepTally:
    """Steps of a batched decode and the model forwards they ran (a step: every live request's round once)."""

    steps: int = 0
    forwards: int = 0

    @property
    def forwards_per_step(self) -> float:
        return self.forwards / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class DecodeRequest:
    """What to decode for one request (the decoder's input); `decode_many` runs each as a `loop.RequestDecoder`."""

    prompt_ids: list[int]
    cfg: DecodeConfig
    seed: int
    stop_check: StopCheck | None = None
    proposer: Proposer | None = None
    observer: RoundObserver | None = None
    verify: str = "coupled"


class Joining(Sequence[DecodeRequest]):
    """`n` requests, request i built by `make(i)` when it joins the batch (`decode_many` reads each job once, as
    it joins): what a request carries (its observer) can then depend on what finished before it."""

    def __init__(self, n: int, make: Callable[[int], DecodeRequest]) -> None:
        self.n, self.make = n, make

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        if isinstance(i, slice):
            return [self.make(k) for k in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.make(i % self.n)


def decode_many(
    adapter: TargetAdapter,
    jobs: Sequence[DecodeRequest],
    batch_size: int,
    on_done: Callable[[int, DecodeResult], None] | None = None,
    tally: StepTally | None = None,
    policy: StepPolicy | None = None,
) -> list[DecodeResult]:
    """Decode `jobs` with up to `batch_size` of them live at once (each job read once, as it joins, in order: a
    finished request's place goes to the next job in the same step); results in job order, each equal to what
    `decode` gives for that job alone. `on_done(index, result)` is called as each finishes (progress, caching);
    `tally` (when given) adds the steps run and the model forwards they made (the adapter's `tally`); `policy`
    (budget=auto) chooses each live request's drafted rows per step, 0 included, and learns from what each step
    cost and what the verifier accepted."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    results: list[DecodeResult | None] = [None] * len(jobs)
    queue = deque(range(len(jobs)))
    live: list[tuple[int, RequestDecoder, RequestPace | None]] = []
    timed = batch_size > 1 or policy is not None  # each step's forward timed on its own (synchronised)
    while queue or live:
        while queue and len(live) < batch_size:
            i = queue.popleft()
            j = jobs[i]
            live.append((i, RequestDecoder(adapter, j.prompt_ids, j.cfg, j.seed, j.stop_check, j.proposer,
                                           j.observer, j.verify),
                         policy.pace() if policy is not None else None))
        step_t0 = time.perf_counter()
        going = [(i, req, pace) for i, req, pace in live if req.start_round()]
        budgets: list[int | None] = [None] * len(going)
        option = 0  # which of a DrafterOptions drafts this step (the policy's choice)
        if policy is not None:
            chosen, option = policy.plan_step([
                StepView(req.can_draft, req.leads, pace.scale if pace else 1.0, 1 + req.pending_rows,
                         req.masked_left if req.may_look_ahead else -1) for _, req, pace in going])
            budgets = list(chosen)
        drafting_s: dict[int, float] = {}
        for (i, req, _), b in zip(going, budgets, strict=True):
            t0 = time.perf_counter()
            req.begin_drafting(b, option)
            drafting_s[i] = time.perf_counter() - t0
        # The drafter's per-round work for every drafting request at once (one stacked pass per order source).
        t0 = time.perf_counter()
        prepared = prepare_batch([(req.round_proposer, req.draft_ctx) for _, req, _ in going])
        each = (time.perf_counter() - t0) / max(1, sum(p is not None for p in prepared))
        step = []
        for (i, req, pace), p in zip(going, prepared, strict=True):
            t0 = time.perf_counter()
            step.append((i, req, req.plan_round(p)))
            drafting_s[i] += time.perf_counter() - t0 + (each if p is not None else 0.0)
        t0 = time.perf_counter()
        before = adapter.tally.forwards
        outs = adapter.forward_many([RowsCall(req.session, st, req.ahead_row) for _, req, st in step])
        if timed:
            sync(adapter.device)  # the forward's own time (on an accelerator the call returns before it runs)
        forward = time.perf_counter() - t0
        if tally is not None and step:
            tally.steps += 1
            tally.forwards += adapter.tally.forwards - before
        total_rows = sum(req.forward_rows for _, req, _ in step)
        for (i, req, _), (lg, ahead) in zip(step, outs, strict=True):
            try:
                req.advance(lg, ahead)
            except NonFiniteLogitsError as err:
                raise NonFiniteLogitsError(err.block, err.round, request=i) from None  # which job, for the caller
        if policy is not None and step:
            drafts = [(req.drafted[-1], 1000 * drafting_s[i]) for i, req, _ in going if req.drafted[-1] > 0]
            rest = time.perf_counter() - step_t0 - forward - sum(ms for _, ms in drafts) / 1000
            policy.observe_step(total_rows, 1000 * forward, 1000 * rest, drafts, option)
            for _, req, pace in going:
                assert pace is not None
                policy.verdict(pace, req.drafting.led, req.drafted[-1], req.last_accepted_ranks, option)
        still = []
        for i, req, pace in live:
            if req.result is None:
                still.append((i, req, pace))
                continue
            results[i] = req.result
            if on_done is not None:
                on_done(i, req.result)
        live = still
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]
