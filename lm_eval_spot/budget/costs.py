"""budget=auto's prices: the verification cost curve measured at start-up, the round costs learned online by row
count, and the cut of a ranked tree that maximises committed tokens per second (`best_cut`).

The proposer that uses them is `budget.proposer` (the package docstring says how the search runs).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from lm_eval_spot.adapters.base import TargetAdapter
from lm_eval_spot.decoding.stale import summarize
from lm_eval_spot.decoding.transfer import HostLink, sync
from lm_eval_spot.drafter.model import DrafterModel
from lm_eval_spot.drafter.proposer import LearnedOrder

log = logging.getLogger("lm_eval.spot")

MAX_BUDGET = 20
LEARN_DECAY = 0.98  # per observed round, for the learned round costs: about 50 rounds of memory
AT_ROWS = 15  # recent rounds kept per row count: their median is that row count's cost once 3 are seen
EXPIRE = 60  # observed rounds after which an unseen row count's median is forgotten
PRIOR_ROUNDS = 1.0  # weight of each of the two start-up-curve pseudo-rounds in the learned round costs



@dataclass(frozen=True)
class CostModel:
    """Measured milliseconds: target forward by replica count, order-model call by node count (interpolated)."""

    replicas: tuple[int, ...]
    target_ms: tuple[float, ...]
    nodes: tuple[int, ...]
    drafter_ms: tuple[float, ...]
    max_budget: int = MAX_BUDGET
    prepare_ms: float = 0.0  # the order model's once-per-round work (input features, the factored encoder)

    def target(self, r: int) -> float:
        table = self.target_table
        return table[r] if 0 <= r < len(table) else _interp(self.replicas, self.target_ms, r)

    @cached_property
    def target_table(self) -> tuple[float, ...]:
        """target(r) for r = 0 .. max_budget + 1: the per-round search reads it thousands of times."""
        return tuple(_interp(self.replicas, self.target_ms, r) for r in range(self.max_budget + 2))

    def drafter(self, n: int) -> float:
        return _interp(self.nodes, self.drafter_ms, n)


def _interp(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys, strict=True), zip(xs[1:], ys[1:], strict=True), strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    # Beyond the last point: extend the last segment's slope.
    return ys[-1] + (ys[-1] - ys[-2]) * (x - xs[-1]) / (xs[-1] - xs[-2])


def convex_fit(ys: list[float]) -> tuple[float, ...]:
    """A cost curve sampled at consecutive sizes, smoothed to non-decreasing increments (convex, and never
    falling): adjacent increments that decrease are pooled to their mean (pool-adjacent-violators), and the result
    keeps the samples' mean. A line stays a line; a GPU's flat-then-rising curve keeps its knee."""
    blocks: list[tuple[float, int]] = []  # (sum of increments, count), increasing means
    for a, b in zip(ys, ys[1:], strict=False):
        total, count = max(0.0, b - a), 1
        while blocks and blocks[-1][0] / blocks[-1][1] > total / count:
            t, c = blocks.pop()
            total, count = total + t, count + c
        blocks.append((total, count))
    out = [0.0]
    for total, count in blocks:
        for _ in range(count):
            out.append(out[-1] + total / count)
    shift = (sum(ys) - sum(out)) / len(ys)
    return tuple(y + shift for y in out)


def monotone_fit(ys: Sequence[float], weights: Sequence[float]) -> tuple[float, ...]:
    """The weighted least-squares non-decreasing sequence closest to `ys` (pool-adjacent-violators): a dip is
    pooled with its neighbours to their weighted mean, a jump stays a jump."""
    blocks: list[list[float]] = []  # [weighted sum, weight, count], non-decreasing means
    for y, w in zip(ys, weights, strict=True):
        blocks.append([y * w, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, w2, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += w2
            blocks[-1][2] += c
    return tuple(b[0] / b[1] for b in blocks for _ in range(int(b[2])))


def measure_costs(adapter: TargetAdapter, drafter: DrafterModel, max_budget: int = MAX_BUDGET, repeats: int = 9,
                  gen_length: int = 256) -> CostModel:
    """Time the target on R replicas of a block (after a 2-block prefix) and the drafter on N states.

    gen_length: the generation length the run uses. A fully bidirectional target recomputes its whole canvas
    (prompt + gen_length rounded up to blocks) every forward, so its cost curve is measured at that canvas.

    Each size keeps its fastest repeat (after a warm-up): a job sharing the cores inflates some repeats at
    random; the minimum is the machine's cost. Every replica count is timed and the curve is then made convex
    (`convex_fit`): the cut stops where the next replica costs more than it brings, so a kink left by timing
    noise would pin most rounds' trees to one size.
    """
    info = adapter.info
    L = info.block_len
    order = LearnedOrder(drafter)  # the drafter as rounds run it (on the CPU: from its numpy snapshot)
    filler = next(t for t in range(info.vocab_size) if t != info.mask_id and t not in info.stop_ids)
    session, _ = adapter.open([filler] * (2 * L), gen_length)
    block = torch.full((L,), info.mask_id, dtype=torch.long)
    block[: L // 2] = filler
    session.block_logits(block[None])  # stores the prefix
    replicas = tuple(range(1, max_budget + 2))
    nodes = (1, 2, 4, 8, 16)
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(1, L, info.vocab_size, generator=gen) * 4
    stale = summarize(noise.to(adapter.device), HostLink())[0]  # what a round's drafter reads: the summary
    committed = torch.zeros(L, dtype=torch.bool)
    committed[: L // 2] = True
    t_samples: dict[int, list[float]] = {r: [] for r in replicas}
    d_samples: dict[int, list[float]] = {n: [] for n in nodes}
    p_samples: list[float] = []
    with torch.no_grad():
        # On an accelerator calls return before their kernels finish: every timed call starts and ends with a
        # synchronisation, so each figure is that call's own work (not the previous call's queue).
        dev = adapter.device
        for _ in range(repeats):  # interleaved, so drift hits every size alike
            for r in replicas:
                sync(dev)
                t0 = time.perf_counter()
                session.block_logits(block[None].repeat(r, 1))
                sync(dev)
                t_samples[r].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            prep = order.prepare(stale, committed, ~committed)
            sync(dev)
            p_samples.append(time.perf_counter() - t0)
            for n in nodes:
                maps = torch.zeros(n, L, dtype=torch.long)
                maps[:, L // 2] = 1
                t0 = time.perf_counter()
                order.node_probs(prep, maps)
                sync(dev)
                d_samples[n].append(time.perf_counter() - t0)
    costs = CostModel(
        replicas,
        convex_fit([1000 * min(t_samples[r][1:]) for r in replicas]),
        nodes,
        tuple(1000 * min(d_samples[n][1:]) for n in nodes),
        max_budget,
        1000 * min(p_samples[1:]),
    )
    log.info(
        "budget=auto cost curve (ms): target %s; drafter per round %.2f, per level %s",
        ", ".join(f"R={r}: {c:.2f}" for r, c in zip(costs.replicas, costs.target_ms, strict=True)),
        costs.prepare_ms,
        ", ".join(f"N={n}: {c:.2f}" for n, c in zip(costs.nodes, costs.drafter_ms, strict=True)),
    )
    return costs


def best_cut(masses: list[float], costs: CostModel | Sequence[float], spent_ms: float) -> tuple[int, float]:
    """(d, rate): the prefix of `masses` (best-first order) maximising (1 + sum) / (target(1 + d) + spent).
    costs: the cost model, or a table of target(r) long enough for every prefix."""
    table = costs.target_table if isinstance(costs, CostModel) else costs
    best_d, best = 0, 1.0 / (table[1] + spent_ms)
    acc = 1.0
    for d, m in enumerate(masses, start=1):
        acc += m
        rate = acc / ((table[1 + d] if 1 + d < len(table) else costs.target(1 + d)) + spent_ms)  # type: ignore[union-attr]
        if rate > best:
            best_d, best = d, rate
    return best_d, best


class RoundCosts:
    """The target's round cost as the rounds really run, learned online: ms(rows) = a + s * t0(rows), t0 the
    start-up curve (its shape kept: a GPU's knee stays a knee), fit by least squares with forgetting.

    The start-up curve times bare forwards after a short prefix; a real round also verifies, summarises and
    attends to a longer prefix (measured on the embedded target: a 1-row round 6.8 ms against t0's 5.1). Two
    pseudo-rounds on t0 (at 1 row and at the largest tree) hold the fit near it until rounds have been seen.
    `table[r]`: the predicted ms of a round of r rows, r = 0 .. size - 1."""

    def __init__(self, startup: CostModel, size: int, decay: float = LEARN_DECAY, prior: float = PRIOR_ROUNDS
                 ) -> None:
        self.decay, self.prior = decay, prior
        self.t0 = tuple(startup.target(r) for r in range(max(size, 2)))
        self.table = self.t0
        self._ends = (self.t0[1], self.t0[-1])
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self.fitted = (0.0, 1.0)  # (a, s)
        self.seen = 0
        self._at: dict[int, deque[float]] = {}  # recent round times by row count
        self._median: dict[int, float] = {}
        self._last: dict[int, int] = {}  # the round a row count was last seen

    def observe(self, rows: int, ms: float) -> None:
        r = min(rows, len(self.t0) - 1)
        x = self.t0[r]
        a, scale = self.fitted
        # A round stalled by another process would drag the fit for dozens of rounds: cap what one round says.
        y = min(ms, 3.0 * (a + scale * x))
        d = self.decay
        self._w, self._sx, self._sy = d * self._w + 1.0, d * self._sx + x, d * self._sy + y
        self._sxx, self._sxy = d * self._sxx + x * x, d * self._sxy + x * y
        self.seen += 1
        p, (e1, e2) = self.prior, self._ends
        n = self._w + 2 * p
        mx = (self._sx + p * (e1 + e2)) / n
        my = (self._sy + p * (e1 + e2)) / n
        ee = p * (e1 * e1 + e2 * e2)
        var = (self._sxx + ee) / n - mx * mx
        cov = (self._sxy + ee) / n - mx * my
        scale = min(max(cov / var, 0.25), 4.0) if var > 1e-12 else 1.0
        a = my - scale * mx
        self.fitted = (a, scale)
        # Where a row count has been seen often enough, its own recent median: the forward's cost can jump at some
        # batch shapes (one machine state: 12 rows 10.3 ms, 13 rows 13.1), which no curve through t0 has. A row
        # count not seen for EXPIRE rounds falls back to the estimate, so one measured dear gets re-tried.
        seen = self._at.setdefault(r, deque(maxlen=AT_ROWS))
        seen.append(ms)
        self._last[r] = self.seen
        if len(seen) >= 3:
            self._median[r] = statistics.median(seen)
        for old in [i for i, at in self._last.items() if self.seen - at > EXPIRE]:
            del self._last[old], self._at[old]
            self._median.pop(old, None)
        self.table = self._anchored(scale) if self._median else tuple(a + scale * t for t in self.t0)

    def _anchored(self, scale: float) -> tuple[float, ...]:
        # An unseen row count: the nearest seen one's median plus the start-up curve's increment from there. The fit's
        # own level would put a seen 1-row round's real cost beside a fitted 2-row one and price drafting out.
        med, t0 = self._median, self.t0
        out = []
        for r, t in enumerate(t0):
            if r in med:
                out.append(med[r])
                continue
            k = min(med, key=lambda s: (abs(s - r), s))
            out.append(med[k] + scale * (t - t0[k]))
        # More rows never cost less: medians of a few noisy rounds dip below their neighbours (measured: 9 rows
        # 5.2 ms beside 8 rows 6.1), and a dip draws every round's tree to it. Seen row counts weigh by their
        # rounds, estimated ones by one.
        w = [float(len(self._at[r])) if r in med else 1.0 for r in range(1, len(out))]
        return (out[0],) + monotone_fit(out[1:], w)
