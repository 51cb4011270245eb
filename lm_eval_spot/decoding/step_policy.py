"""budget=auto, the default: each batch step chooses every live request's drafted rows (0 included) to maximise
the step's expected committed tokens per second of wall time.

A step costs ONE target forward at the step's total rows (its price is the measured curve `RowCosts`, so a row is
priced at its marginal cost as the batch sees it, never at an average share), plus the host work of the drafting
it implies (`LinearCost`: a fixed part per drafting request, its stale summary and the order model's encoder, and
a part per drafted node), plus the rest of the step's host work, which does not depend on the choice but sets how
much a committed token is worth. A request that drafts nothing does no drafter work: its round is control's round.

The expected gain of drafting d nodes for a request is 1 + s_i x (a_1 + ... + a_d): a_k the run's acceptance rate
of the k-th best node of a tree (best first by prefix mass, so the accepted nodes among the best k are a prefix of
the accepted path), learned from the verifier's verdicts with forgetting (`AcceptanceRecord`), and s_i the
request's own acceptances over what the record predicted for it. A rank left untried drifts back to an optimistic
prior, so a drafter that improves (online adaptation) gets tried again. Any tree is verified exactly: the choice
changes NFE and speed, never an output.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

log = logging.getLogger("lm_eval.spot")

# An untried rank k's acceptance: PRIOR_ACCEPT ** k (the embedded target's own drafter measured 0.91, 0.83, 0.72,
# 0.61, 0.51 for k = 1..5): hopeful enough that ranks get tried where drafting could pay, and no flat 0.9 for rank
# 16, which once made every request of a 32-request batch draft 16 nodes in the first step (845 ms, 18x a step).
PRIOR_ACCEPT = 0.9
PRIOR_WEIGHT = 2.0  # pseudo-rounds behind that prior
FORGET = 0.995  # per step, for the acceptance record: a rank left untried for ~200 steps leans back to the prior
REQUEST_PRIOR = 4.0  # pseudo-acceptances that hold a request's own scale near 1 early on
# Per round a request does not draft, its own record fades by this factor (its scale leans back to 1): a request
# whose scale fell so low that it stopped drafting would otherwise never draft again, with nothing new to learn
# from (embedded target, batch size 1: one request ran ~70 control rounds at scale 0.46 where D = 5 paid).
PACE_FORGET = 0.85
COST_DECAY = 0.98  # per observation, for the learned costs: about 50 observations of memory
# Drafting must promise at least this much more than a control step's rate: the costs are estimates (the rows a
# lookahead adds, a drafting round's verification, another process's load), and a choice that the estimates put
# a few percent ahead measured a few percent behind (embedded target, batch size 8: +4% estimated, -6% measured).
MIN_GAIN = 0.10
DEPTH_TOLERANCE = 0.02  # see `allocate`: a deeper tree is taken when its estimate is within 2% of the best one
# While nothing pays, the full choice backs off: after the m-th choice in a row that drafted nothing, the next
# min(2^(m-1), IDLE_EVERY) - 1 steps skip it (its inputs move slowly; at batch size 8 on this CPU a step costs ~11 ms
# and the choice ~0.15 ms). One zero choice costs no skipped step: at batch size 1 on the embedded target a choice
# that drafted nothing once (a costly step measured, a low-acceptance stretch) then skipped 7 steps, and those
# skipped steps were 10% of the run's rounds. Where nothing ever pays, drafting resumes at most IDLE_EVERY - 1 late.
IDLE_EVERY = 8


@dataclass(frozen=True)
class StartupCosts:
    """What the start-up measurement found (milliseconds): the forward by total rows, and the drafting's host work."""

    rows: tuple[int, ...]  # total rows of a step's forward, ascending
    forward_ms: tuple[float, ...]
    draft_fixed_ms: float  # per drafting request and round: stale summary, the order model's encoder pass
    draft_node_ms: float  # per drafted node
    seconds: float = 0.0  # the measurement's own wall time
    # (per request and round, per node) ms of each further drafter the policy may choose instead (`DrafterOptions`)
    other_drafters: tuple[tuple[float, float], ...] = ()
    canvas: int = 0  # positions of the request it was measured on (prompt + generation; 0: not recorded)

    def curve(self, size: int) -> np.ndarray:
        """forward ms at 0 .. size - 1 rows: interpolated, and beyond the last point the last segment extended."""
        xs, ys = np.asarray(self.rows, float), np.asarray(self.forward_ms, float)
        r = np.arange(size, dtype=float)
        out = np.interp(r, xs, ys)
        if len(xs) > 1 and size - 1 > xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            beyond = r > xs[-1]
            out[beyond] = ys[-1] + slope * (r[beyond] - xs[-1])
        return np.maximum.accumulate(out)  # more rows never cost less


class RowCosts:
    """The forward's cost by total rows, as the steps really run: ms(R) = a + s x t0(R), t0 the start-up curve (its
    shape kept: a GPU's flat stretch and its knee stay), (a, s) fit by least squares with forgetting. Two
    pseudo-observations on t0 (at the smallest and the largest measured row counts) hold the fit near it until
    steps at several row counts have been seen; a step stalled by another process is capped at 3x the estimate."""

    def __init__(self, startup: StartupCosts, size: int, decay: float = COST_DECAY, prior: float = 1.0) -> None:
        self.t0 = startup.curve(max(size, 2))
        self.decay, self.prior = decay, prior
        self._ends = (float(self.t0[1]), float(self.t0[min(len(self.t0) - 1, startup.rows[-1])]))
        self._t0 = self.t0.tolist()  # read per step: Python floats, no numpy call per step
        self._sums = [0.0] * 5  # w, sx, sy, sxx, sxy (Python floats: this runs every step)
        self.fitted = (0.0, 1.0)
        self._table: np.ndarray | None = self.t0.copy()

    @property
    def table(self) -> np.ndarray:
        """ms at 0 .. size - 1 rows, rebuilt only when a choice reads it after a refit."""
        if self._table is None:
            a, s = self.fitted
            self._table = np.maximum(a + s * self.t0, 0.0)
        return self._table

    def __call__(self, rows: int) -> float:
        t0, (a, s) = self._t0, self.fitted
        if rows < len(t0):
            return max(a + s * t0[rows], 0.0)
        return max(a + s * (t0[-1] + (t0[-1] - t0[-2]) * (rows - len(t0) + 1)), 0.0)

    def observe(self, rows: int, ms: float) -> None:
        x = self._t0[min(rows, len(self._t0) - 1)]
        a, s = self.fitted
        y = min(ms, 3.0 * (a + s * x))
        d = self.decay
        self._sums = [d * v + o for v, o in zip(self._sums, (1.0, x, y, x * x, x * y), strict=True)]
        w, sx, sy, sxx, sxy = self._sums
        p, (e1, e2) = self.prior, self._ends
        n = w + 2 * p
        mx, my = (sx + p * (e1 + e2)) / n, (sy + p * (e1 + e2)) / n
        ee = p * (e1 * e1 + e2 * e2)
        var, cov = (sxx + ee) / n - mx * mx, (sxy + ee) / n - mx * my
        s = min(max(cov / var, 0.25), 4.0) if var > 1e-12 else 1.0
        a = my - s * mx
        self.fitted = (a, s)
        self._table = None


class LinearCost:
    """ms = a + b x, fit online by least squares with forgetting, held near a prior (a0, b0) by a pseudo-weight."""

    def __init__(self, a0: float, b0: float, x0: float = 4.0, decay: float = COST_DECAY, prior: float = 2.0) -> None:
        self.decay = decay
        # The prior as two pseudo-observations, at x = 0 and at x = x0: a line through them is (a0, b0).
        self._prior = (2 * prior, prior * x0, prior * (2 * a0 + b0 * x0), prior * x0 * x0,
                       prior * x0 * (a0 + b0 * x0))
        self._sums = [0.0] * 5  # Python floats: this runs every step
        self.a, self.b = a0, b0

    def __call__(self, x: float) -> float:
        return self.a + self.b * x

    def observe(self, x: float, ms: float) -> None:
        y = min(ms, 3.0 * max(self(x), 1e-3))
        d = self.decay
        self._sums = [d * v + o for v, o in zip(self._sums, (1.0, x, y, x * x, x * y), strict=True)]
        w, sx, sy, sxx, sxy = (v + p for v, p in zip(self._sums, self._prior, strict=True))
        var = sxx / w - (sx / w) ** 2
        b = ((sxy / w - sx * sy / w / w) / var) if var > 1e-12 else self.b
        self.b = max(b, 0.0)
        self.a = max(sy / w - self.b * sx / w, 0.0)


class AcceptanceRecord:
    """The run's acceptance rate of the k-th best drafted node, k = 1 .. depth, learned from verdicts with
    forgetting; rounds that lead with the target's own transition at the root (a block's first round after an
    exact lookahead) are kept apart, since their first node is all but sure."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._acc = np.zeros((2, depth))
        self._n = np.zeros((2, depth))
        self._prior = PRIOR_ACCEPT ** np.arange(1, depth + 1)
        self._unforgotten = 0  # forget() calls not yet applied (applied on the next read or write, not per step)

    def _settle(self) -> None:
        if self._unforgotten:
            f = FORGET ** self._unforgotten
            self._acc *= f
            self._n *= f
            self._unforgotten = 0

    def rates(self, led: bool) -> np.ndarray:
        """a_1 .. a_depth, made non-increasing (a deeper rank is never worth more: its tree holds the shallower)."""
        self._settle()
        k = int(led)
        a = (self._acc[k] + PRIOR_WEIGHT * self._prior) / (self._n[k] + PRIOR_WEIGHT)
        return np.minimum.accumulate(a)

    def add(self, led: bool, drafted: int, accepted_ranks: Sequence[int]) -> None:
        """A verdict: `drafted` nodes (ranks 1 .. drafted), the accepted ones among them by rank."""
        self._settle()
        k, d = int(led), min(drafted, self.depth)
        self._n[k, :d] += 1.0
        for r in accepted_ranks:
            if r <= d:
                self._acc[k, r - 1] += 1.0

    def forget(self) -> None:
        self._unforgotten += 1


@dataclass
class RequestPace:
    """One request's part in the policy: its own acceptances against the record's predictions."""

    predicted: float = 0.0
    accepted: float = 0.0

    @property
    def scale(self) -> float:
        return (self.accepted + REQUEST_PRIOR) / (self.predicted + REQUEST_PRIOR)


@dataclass(frozen=True)
class StepView:
    """What the policy reads of a live request at the start of a step."""

    can_draft: bool  # it has stale conditionals to draft from (a block's first round without lookahead has none)
    led: bool  # its tree leads with the target's own transition at the root
    scale: float  # RequestPace.scale
    rows: int = 1  # rows its round carries without drafting (the root, and finished blocks riding along)
    # Masked slots left in its block when a drafting round that reaches the block's end adds a lookahead row
    # (the next block's); -1: it never does (no lookahead, or the last block)
    ahead_at: int = -1

    def extra_rows(self, depth: int) -> np.ndarray:
        """Rows beyond its drafted nodes when drafting d = 1 .. depth: the lookahead row, once a tree of d nodes
        can reach a state with at most one masked slot."""
        d = np.arange(1, depth + 1)
        return ((self.ahead_at >= 0) & (d + 1 >= self.ahead_at)).astype(np.int64)


def allocate(gains: np.ndarray, base_rows: int, forward: RowCosts | Sequence[float], host_ms: float,
             draft: LinearCost | tuple[float, float], min_gain: float = MIN_GAIN,
             extra: np.ndarray | None = None, scale: float = 1.0) -> list[int]:
    """`best_allocation`'s drafted nodes per request."""
    return best_allocation(gains, base_rows, forward, host_ms, draft, min_gain, extra, scale)[0]


def best_allocation(gains: np.ndarray, base_rows: int, forward: RowCosts | Sequence[float], host_ms: float,
                    draft: LinearCost | tuple[float, float], min_gain: float = MIN_GAIN,
                    extra: np.ndarray | None = None, scale: float = 1.0) -> tuple[list[int], float]:
    """Drafted nodes per request maximising (n + sum of the chosen gains) / (forward(base_rows + drafted rows) +
    host_ms + drafting), where a request drafting d > 0 nodes costs draft_fixed + d x draft_node of host work;
    nothing is drafted unless the best choice's rate beats a control step's by the factor 1 + min_gain.

    gains [n, D]: row i the expected accepted nodes of request i's best 1 .. D nodes, each a non-increasing step
    (0 where it cannot draft); extra [n, D]: rows request i's round adds beyond its d nodes (a lookahead row);
    scale: what drafting really costs against these estimates (`DraftingCheck`), applied to its added cost. The candidates are "the k requests with the largest gain at depth d each draft d",
    for every k and d, the forward priced at the step's TOTAL rows (a row's marginal cost, as the batch sees it).
    Also returns the chosen allocation's estimated rate (committed tokens per ms; a control step's when it drafts
    nothing)."""
    n, depth = gains.shape
    fixed, node = (draft.a, draft.b) if isinstance(draft, LinearCost) else draft
    price = forward if callable(forward) else (lambda r: float(forward[min(r, len(forward) - 1)]))
    best_rate = n / (price(base_rows) + host_ms)
    if n == 0 or depth == 0 or not gains.any():
        return [0] * n, best_rate
    if n == 1:
        return _allocate_one(gains[0].tolist(), base_rows, price, host_ms, fixed, node, min_gain,
                             extra[0].tolist() if extra is not None else [0] * depth, scale, best_rate)
    cum = np.cumsum(gains, axis=1)  # [n, D]: gain of drafting d = 1 .. D nodes
    order = np.argsort(-cum, axis=0, kind="stable")  # per depth, requests by gain (lowest index on ties)
    top = np.cumsum(np.take_along_axis(cum, order, axis=0), axis=0)  # [k - 1, d - 1]: the k best requests' gain
    ks = np.arange(1, n + 1)[:, None]
    ds = np.arange(1, depth + 1)[None, :]
    rows = base_rows + ks * ds
    if extra is not None:
        rows = rows + np.cumsum(np.take_along_axis(extra, order, axis=0), axis=0)
    fwd = np.vectorize(price, otypes=[float])(rows) if not isinstance(forward, RowCosts) else _table(forward, rows)
    base = price(base_rows)
    rate = (n + top) / (base + host_ms + scale * (fwd - base + ks * fixed + ks * ds * node))
    k, d = np.unravel_index(int(np.argmax(rate)), rate.shape)
    if rate[k, d] <= best_rate * (1.0 + min_gain) or top[k, d] <= 0:
        return [0] * n, best_rate
    # Near its best the rate is flat in the depth (batch size 1, embedded target: D = 6..10 within 3%), and the
    # deep ranks' acceptances are the least known (rarely tried, capped by the shallower ones): among the choices
    # within DEPTH_TOLERANCE of the best, the deepest trees (same number of drafting requests) are taken.
    near = np.nonzero((rate[k] >= rate[k, d] * (1.0 - DEPTH_TOLERANCE)) & (rate[k] > best_rate * (1.0 + min_gain)))[0]
    d = int(near.max())
    if top[k, d] <= 0:
        return [0] * n, best_rate
    out = [0] * n
    for i in order[: k + 1, d]:
        out[int(i)] = int(d) + 1 if cum[int(i), d] > 0 else 0
    return out, float(rate[k, d])


def _allocate_one(gains: list[float], base_rows: int, price: Callable[[int], float], host_ms: float, fixed: float,
                  node: float, min_gain: float, extra: list[int], scale: float,
                  best_rate: float) -> tuple[list[int], float]:
    """`best_allocation` for one request, in plain Python: at batch size 1 it runs every step, and the grid's
    numpy calls (~0.15 ms) were 4-5% of a 3 ms step on a small target (e8c). The same choice, rule for rule."""
    base = price(base_rows)
    bar = best_rate * (1.0 + min_gain)
    cums, rates = [], []
    cum, ex = 0.0, 0
    for d, (g, e) in enumerate(zip(gains, extra, strict=True)):
        cum += g
        ex += e
        cums.append(cum)
        rates.append((1 + cum) / (base + host_ms + scale * (price(base_rows + d + 1 + ex) - base + fixed
                                                             + (d + 1) * node)))
    best = max(rates)
    d = rates.index(best)
    if best <= bar or cums[d] <= 0:
        return [0], best_rate
    d = max(j for j, r in enumerate(rates) if r >= best * (1.0 - DEPTH_TOLERANCE) and r > bar)
    if cums[d] <= 0:
        return [0], best_rate
    return [d + 1], rates[d]


def _table(costs: RowCosts, rows: np.ndarray) -> np.ndarray:
    t = costs.table
    inside = np.minimum(rows, len(t) - 1)
    return np.where(rows < len(t), t[inside], t[-1] + (t[-1] - t[-2]) * (rows - len(t) + 1))


class DraftingCheck:
    """How far off the estimates are where it matters: a step's measured time against its prediction, for steps
    that drafted nothing (ratio r0) and for the part drafting added (scale = (measured - r0 x predicted base) /
    predicted addition, over drafting steps, with forgetting). Near break-even the estimates' errors decide: on the
    embedded target at batch size 8, drafting predicted +7% measured +4% in one run and -11% in another. The scale
    (clipped to 0.5 .. 4) multiplies drafting's added cost in `allocate`, so drafting that costs more than its
    estimate is cut back from the measurements themselves."""

    def __init__(self, decay: float = COST_DECAY) -> None:
        self.decay = decay
        self._r0 = [0.0, 0.0]  # sum of measured / predicted, weight (steps without drafting)
        self._extra = [0.0, 0.0]  # sum of (measured - r0 x base), sum of predicted additions (drafting steps)
        self.drafting_steps = 0

    @property
    def r0(self) -> float:
        return self._r0[0] / self._r0[1] if self._r0[1] > 0 else 1.0

    @property
    def scale(self) -> float:
        if self.drafting_steps < 3 or self._extra[1] <= 0:  # a step or two cannot swing it
            return 1.0
        return min(max(self._extra[0] / self._extra[1], 0.5), 4.0)

    def observe(self, measured: float, base: float, added: float) -> None:
        if base <= 0:
            return
        if added <= 0:
            self._r0 = [self.decay * self._r0[0] + min(measured / base, 3.0), self.decay * self._r0[1] + 1.0]
            return
        spent = min(measured - self.r0 * base, 4.0 * added)  # a step stalled by another process says little
        self._extra = [self.decay * self._extra[0] + spent, self.decay * self._extra[1] + added]
        self.drafting_steps += 1


@dataclass
class PolicyReport:
    """What the run summary shows of the policy."""

    drafted_rows: Counter[int] = field(default_factory=Counter)  # rounds by drafted-row count (0 included)
    by_drafter: Counter[str] = field(default_factory=Counter)  # drafting rounds by the drafter that drafted them

    def shares(self) -> dict[str, float]:
        total = sum(self.drafted_rows.values())
        return {str(d): round(c / total, 4) for d, c in sorted(self.drafted_rows.items())} if total else {}

    def drafter_shares(self) -> dict[str, float]:
        total = sum(self.by_drafter.values())
        return {k: round(c / total, 4) for k, c in sorted(self.by_drafter.items())} if total else {}


class DrafterTrack:
    """What the policy knows of one drafter it may choose: its host cost per round and node, its acceptance by
    rank, and how far drafting's measured cost runs from its estimate (one check for every drafter: most of that
    error is the forward's, at rows any drafter adds, and a drafter tried now and then would learn it too late)."""

    def __init__(self, name: str, fixed_ms: float, node_ms: float, max_depth: int, check: DraftingCheck) -> None:
        self.name = name
        self.draft = LinearCost(fixed_ms, node_ms)
        self.record = AcceptanceRecord(max_depth)
        self.check = check


class StepPolicy:
    """budget=auto: the per-step choice of drafted rows (see the module docstring). One per run; decode_many asks
    `plan_step` at each step and reports what the step cost (`observe_step`) and what the verifier accepted
    (`verdict`). With several drafters (`names`, their start-up costs in `StartupCosts.other_drafters`) each step
    also chooses which one drafts: the one whose best allocation promises the most committed tokens per second,
    each priced at its own host cost and its own acceptance record (an untried drafter's record leans back to the
    prior, so each is tried again now and then)."""

    def __init__(self, startup: StartupCosts, max_depth: int, max_rows: int, names: Sequence[str] = ("drafter",)
                 ) -> None:
        self.max_depth, self.max_rows, self.names = max_depth, max_rows, tuple(names)
        self.restart(startup)

    def restart(self, startup: StartupCosts) -> None:
        """Start over from a start-up measurement (taken again before the first step at the requests' own canvas:
        `budget.costs.CanvasCheck`); nothing learned before is kept, the measurement times add up."""
        costs = ((startup.draft_fixed_ms, startup.draft_node_ms), *startup.other_drafters)
        names, max_depth = self.names, self.max_depth
        if len(names) != len(costs):
            raise ValueError(f"{len(names)} drafter names for {len(costs)} measured drafters")
        spent = getattr(self, "startup", None)
        self.startup = replace(startup, seconds=startup.seconds + (spent.seconds if spent is not None else 0.0))
        self.forward = RowCosts(startup, self.max_rows + 1)
        check = DraftingCheck()
        self.tracks = [DrafterTrack(n, a, b, max_depth, check) for n, (a, b) in zip(names, costs, strict=True)]
        # The first drafter's, by their old names (one-drafter runs and their tests read these).
        self.draft, self.record, self.check = self.tracks[0].draft, self.tracks[0].record, self.tracks[0].check
        # The step's other host work (x: drafted nodes): its level sets what a committed token is worth, its slope
        # is verification's extra work per drafted row.
        self.rest = LinearCost(0.0, 0.0, prior=0.5)
        self.report = PolicyReport()
        self._base_rows = 0  # the last plan's rows without drafting
        self._zeros = 0  # consecutive full choices that drafted nothing
        self._skip = 0  # steps left before the next full choice

    def pace(self) -> RequestPace:
        return RequestPace()

    def plan(self, views: Sequence[StepView]) -> list[int]:
        """Drafted nodes for each live request this step (0: a control round, no drafter work)."""
        return self.plan_step(views)[0]

    def plan_step(self, views: Sequence[StepView]) -> tuple[list[int], int]:
        """Drafted nodes for each live request this step (0: a control round, no drafter work), and the index of
        the drafter that drafts them."""
        n = len(views)
        self._base_rows = sum(v.rows for v in views)
        if self._skip > 0:
            self._skip -= 1
            return [0] * n, 0
        if not any(v.can_draft for v in views):
            return [0] * n, 0
        zero = np.zeros(self.max_depth)
        extra = np.array([v.extra_rows(self.max_depth) if v.ahead_at >= 0 else zero for v in views], dtype=np.int64)
        best: tuple[list[int], float, int] = ([0] * n, -1.0, 0)
        for k, track in enumerate(self.tracks):
            rates = (track.record.rates(False), track.record.rates(True))
            gains = np.array([v.scale * rates[v.led] if v.can_draft else zero for v in views])
            out, rate = best_allocation(gains, self._base_rows, self.forward, self.rest.a,
                                        (track.draft.a, track.draft.b + self.rest.b), extra=extra,
                                        scale=track.check.scale)
            if any(out) and rate > best[1]:
                best = (out, rate, k)
        out, _, option = best
        self._zeros = 0 if any(out) else self._zeros + 1
        self._skip = min(2 ** (self._zeros - 1), IDLE_EVERY) - 1 if self._zeros else 0
        return out, option

    def observe_step(self, rows: int, forward_ms: float, rest_ms: float,
                     drafting: Sequence[tuple[int, float]], option: int = 0) -> None:
        """A step as it ran: its forward (total rows, ms), its other host work, and per drafting request (nodes
        drafted, ms of its drafting work) with drafter `option`."""
        track = self.tracks[option]
        nodes = sum(d for d, _ in drafting)
        base_rows = min(self._base_rows or rows, rows)
        base = self.forward(base_rows) + self.rest.a
        added = (self.forward(rows) - self.forward(base_rows) + len(drafting) * track.draft.a
                 + nodes * (track.draft.b + self.rest.b)) if drafting else 0.0
        self.check.observe(forward_ms + rest_ms + sum(ms for _, ms in drafting), base, added)
        self.forward.observe(rows, forward_ms)
        self.rest.observe(sum(nodes for nodes, _ in drafting), rest_ms)
        for nodes, ms in drafting:
            track.draft.observe(nodes, ms)
        for t in self.tracks:
            t.record.forget()

    def verdict(self, pace: RequestPace, led: bool, drafted: int, accepted_ranks: Sequence[int],
                option: int = 0) -> None:
        """The verifier's verdict on a request's round: `drafted` nodes by drafter `option`, the accepted ones by
        rank."""
        self.report.drafted_rows[drafted] += 1
        if drafted == 0:
            pace.predicted *= PACE_FORGET
            pace.accepted *= PACE_FORGET
            return
        track = self.tracks[option]
        self.report.by_drafter[track.name] += 1
        rates = track.record.rates(led)
        pace.predicted += float(rates[:drafted].sum())
        pace.accepted += len([r for r in accepted_ranks if r <= drafted])
        track.record.add(led, drafted, accepted_ranks)

    def summary(self) -> dict[str, object]:
        s = self.startup
        out: dict[str, object] = {
            "policy": "auto (per step: drafted rows chosen by measured forward cost at the step's rows and the "
                      "verifier's acceptance record)",
            "drafted_rows_share": self.report.shares(),
            "cost_curve_ms": {str(r): round(ms, 3) for r, ms in zip(s.rows, s.forward_ms, strict=True)},
            "cost_curve_fit": {"offset_ms": round(self.forward.fitted[0], 3), "scale": round(self.forward.fitted[1], 3)},
            "draft_ms": {"per_request": round(self.draft.a, 3), "per_node": round(self.draft.b, 3)},
            "drafting_cost_vs_estimate": round(self.check.scale, 3),
            "acceptance_by_rank": [round(float(a), 3) for a in self.record.rates(False)],
            "startup_s": round(s.seconds, 3),
        }
        if len(self.tracks) > 1:
            out["drafters"] = {
                t.name: {"share_of_drafting_rounds": self.report.drafter_shares().get(t.name, 0.0),
                         "draft_ms": {"per_request": round(t.draft.a, 3), "per_node": round(t.draft.b, 3)},
                         "drafting_cost_vs_estimate": round(t.check.scale, 3),
                         "acceptance_by_rank": [round(float(a), 3) for a in t.record.rates(False)]}
                for t in self.tracks}
        return out
