"""The target forwards that score (context, continuation) pairs by the masked-diffusion bound.

- Block-causal targets (grid origin zero: SDAR, LLaDA2.0-mini, the embedded target): the bound is a sum over the
  continuation's blocks. Each block is one unit (its continuation tokens, one noise level), scored against the
  clean prefix through the adapter's exact prefix cache; the clean block is then committed, as decoding does. The
  continuation's last block is completed with masks (the marginal of the continuation's tokens; decoding's
  layout). Context tokens that share a block with the continuation are never masked.
- Fully bidirectional targets (grid origin at the prompt's end: LLaDA-8B, Dream-7B): the whole continuation is
  one unit over exactly [context ; continuation] (the references' layout; shifted logits realigned).

The continuations of one context (a question's choices) form a group. On block-causal targets the group's context
is prefilled ONCE: every choice's first block is scored in shared forwards on one session, which then forks per
choice (the stored prefix shared, never copied) for the choices' later blocks. Each group is a generator that
yields the forwards it needs and receives their logits, so a driver runs many groups' forwards together: block
forwards through `block_logits_many` where the adapter shares forwards, whole sequences stacked
into one batch (every length in one forward on the native classes, one per length through official code). A
pair's rows and noise never depend on the other pairs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from lm_eval_spot.adapters.base import TargetAdapter
from lm_eval_spot.adapters.bidirectional import raw_positions
from lm_eval_spot.decoding.noise import mix_seed
from lm_eval_spot.likelihood.patterns import MaskPlan, combine, plan_for


@dataclass(frozen=True)
class LikelihoodConfig:
    mc_num: int = 128  # rows per unit: exact enumeration when 2^k - 1 fit, else this many Monte Carlo rows
    mc_batch: int = 32  # rows per forward (a request's rows are split into forwards of at most this many)
    cfg: float = 0.0  # classifier-free guidance scale (0: off); the context masked is the unconditional branch

    def __post_init__(self) -> None:
        if self.mc_num < 1 or self.mc_batch < 1:
            raise ValueError(f"mc_num and mc_batch must be >= 1, got {self.mc_num}, {self.mc_batch}")
        if self.cfg < 0:
            raise ValueError(f"cfg must be >= 0, got {self.cfg}")


@dataclass(frozen=True)
class Pair:
    context: tuple[int, ...]  # at least one token
    continuation: tuple[int, ...]  # at least one token
    seed: int  # the request's noise: pairs with one seed share their mask draws (common random masks)


@dataclass
class Estimate:
    logprob: float  # the bound (exact log-probability for a single-token unit)
    variance: float  # of the Monte Carlo estimate (0 when every unit was enumerated exactly)
    exact: bool  # every unit enumerated: the number is the bound itself, not an estimate of it
    forwards: int  # target forwards this request took part in (a forward shared with others counts for each)
    rows: int  # scored rows (with cfg: conditional ones)
    # per unit: the rows' weighted values (paired differences between two requests with one seed and layout)
    unit_values: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def se(self) -> float:
        return math.sqrt(self.variance) if not math.isnan(self.variance) else math.nan


@dataclass(frozen=True)
class BlockCall:
    """`session.block_logits(states)`: [R, L] host states -> [R, L, V] on the device."""

    session: Any
    states: torch.Tensor


@dataclass(frozen=True)
class SequenceCall:
    """Whole bidirectional sequences [R, N] on the host -> raw logits at positions `keep` [R, len(keep), V]."""

    ids: torch.Tensor
    keep: tuple[int, ...]


Call = BlockCall | SequenceCall
# A request group (the pairs of one context) is a generator: it yields the forwards it needs next (a list: several
# of its pairs step together) and receives their logits in the same order; it returns its pairs' estimates.
Request = Generator[list[Call], list[torch.Tensor], list[Estimate]]
Steps = Generator[list[Call], list[torch.Tensor], None]


@runtime_checkable
class ScoresSequences(Protocol):
    """A fully bidirectional adapter's cache-free whole-sequence forwards (several sequences of any lengths in as
    few forwards as its protocol allows: one when it takes ragged rows, else one per length)."""

    def sequence_logits(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor: ...

    def sequence_logits_many(self, items: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]: ...


def unit_generator(seed: int, unit: int) -> torch.Generator:
    """The noise of one unit of a request (block-causal: the block's absolute index; bidirectional: 0)."""
    return torch.Generator().manual_seed(mix_seed("likelihood", seed, unit))


def _masked_logp_sums(logits: torch.Tensor, targets: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """logits [R, k, V], targets [R, k], masked [R, k] -> per row, the sum of log p(target) over its masked
    slots [R] (on the logits' device)."""
    # Only the slots some row scores go through the softmax (a block's context tail and trailing masks do not).
    cols = masked.any(dim=0).nonzero().flatten().tolist()  # host mask: no device read
    logp = torch.log_softmax(logits[:, cols].float(), dim=-1)
    picked = logp.gather(-1, targets[:, cols].to(logp.device).unsqueeze(-1)).squeeze(-1)
    return (picked * masked[:, cols].to(logp.device)).sum(dim=1)


def _guided(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    return uncond + (scale + 1.0) * (cond - uncond)


def _noised(base: list[int], lo: int, plan: MaskPlan, mask_id: int) -> torch.Tensor:
    """[R, len(base)] rows of `base` with row r's plan positions (offset by lo) masked."""
    rows = torch.tensor(base, dtype=torch.long).expand(plan.rows, -1).clone()
    k = plan.masked.shape[1]
    part = rows[:, lo : lo + k]
    part[plan.masked] = mask_id
    rows[:, lo : lo + k] = part
    return rows


@dataclass
class _Tally:
    """One pair's running sums over its units."""

    logprob: float = 0.0
    variance: float = 0.0
    forwards: int = 0
    rows: int = 0
    exact: bool = True
    units: list[torch.Tensor] = field(default_factory=list)

    def add(self, plan: MaskPlan, sums: torch.Tensor, forwards: int) -> None:
        est, var, vals = combine(plan, sums)
        self.logprob += est
        self.variance += var
        self.forwards += forwards
        self.rows += plan.rows
        self.exact = self.exact and plan.exact
        self.units.append(vals)

    def estimate(self) -> Estimate:
        return Estimate(self.logprob, self.variance, self.exact, self.forwards, self.rows, self.units)


@dataclass(frozen=True)
class _Unit:
    """One block of a pair on a block-causal target: its plan and rows, in block coordinates."""

    plan: MaskPlan
    states: torch.Tensor  # [R, L] noised rows
    targets: torch.Tensor  # [R, L] the clean block (completed with masks)
    masked: torch.Tensor  # [R, L] bool: the slots each row scores
    lo: int  # the block's first continuation slot (context tokens before it are never masked)
    commit: bool  # a later block follows: the clean block becomes its prefix


def _units(pair: Pair, tail: list[int], first: int, L: int, mask_id: int, mc_num: int) -> list[_Unit]:
    full = tail + list(pair.continuation)
    out = []
    for n, b0 in enumerate(range(0, len(full), L)):
        blk = full[b0 : b0 + L]
        lo = max(0, len(tail) - b0)
        k = len(blk) - lo
        plan = plan_for(k, mc_num, unit_generator(pair.seed, first + n))
        clean = blk + [mask_id] * (L - len(blk))
        masked = torch.zeros(plan.rows, L, dtype=torch.bool)
        masked[:, lo : lo + k] = plan.masked
        out.append(_Unit(plan, _noised(clean, lo, plan, mask_id), torch.tensor(clean).expand(plan.rows, -1),
                          masked, lo, b0 + L < len(full)))
    return out


def _lockstep(steps: list[Steps]) -> Steps:
    """Run several step generators side by side: each step yields all their pending forwards together."""
    live = []
    for g in steps:
        try:
            live.append((g, next(g)))
        except StopIteration:
            pass
    while live:
        results = yield [c for _, calls in live for c in calls]
        nxt, a = [], 0
        for g, calls in live:
            part, a = results[a : a + len(calls)], a + len(calls)
            try:
                nxt.append((g, g.send(part)))
            except StopIteration:
                pass
        live = nxt


def _pair_blocks(session: Any, uncond: Any, units: list[_Unit], cfg: LikelihoodConfig, mask_id: int,
                 tally: _Tally) -> Steps:
    """A pair's blocks in order on its own session (and its unconditional twin with guidance)."""
    for unit in units:
        sums, forwards = [], 0
        for a in range(0, unit.plan.rows, cfg.mc_batch):
            chunk = unit.states[a : a + cfg.mc_batch]
            if uncond is None:
                [logits] = yield [BlockCall(session, chunk)]
                forwards += 1
            else:
                u = chunk.clone()
                u[:, : unit.lo] = mask_id
                cond, free = yield [BlockCall(session, chunk), BlockCall(uncond, u)]
                logits = _guided(cond, free, cfg.cfg)
                forwards += 2
            sums.append(_masked_logp_sums(logits, unit.targets[a : a + cfg.mc_batch], unit.masked[a : a + cfg.mc_batch]))
        tally.add(unit.plan, torch.cat(sums), forwards)
        if unit.commit:  # the clean block becomes the next block's prefix
            session.commit_block(unit.targets[0])
            if uncond is not None:
                uncond.commit_block(torch.cat([torch.full((unit.lo,), mask_id), unit.targets[0, unit.lo :]]))


def blockwise_group(adapter: TargetAdapter, pairs: Sequence[Pair], cfg: LikelihoodConfig) -> Request:
    """Block-causal targets: the pairs of one context, block by block (see the module docstring)."""
    info = adapter.info
    L, mask_id = info.block_len, info.mask_id
    ctx = list(pairs[0].context)
    if any(list(p.context) != ctx for p in pairs):
        raise ValueError("a group's pairs share one context")
    session, tail = adapter.open(ctx)
    first = (len(ctx) - len(tail)) // L  # absolute index of the first block holding continuation tokens
    units = [_units(p, tail, first, L, mask_id, cfg.mc_num) for p in pairs]
    tallies = [_Tally() for _ in pairs]
    if cfg.cfg > 0 or len(pairs) == 1:  # every pair on a session of its own (guidance: and its twin)
        steps = []
        for i, (u, t) in enumerate(zip(units, tallies, strict=True)):
            own = session if i == 0 else adapter.open(ctx)[0]
            twin = adapter.open([mask_id] * len(ctx))[0] if cfg.cfg > 0 else None
            steps.append(_pair_blocks(own, twin, u, cfg, mask_id, t))
        yield from _lockstep(steps)
        return [t.estimate() for t in tallies]
    # The first block of every pair in shared forwards on one session: the context is prefilled once.
    bounds = [0]
    for u in units:
        bounds.append(bounds[-1] + u[0].plan.rows)
    states = torch.cat([u[0].states for u in units])
    targets = torch.cat([u[0].targets for u in units])
    masked = torch.cat([u[0].masked for u in units])
    sums, forwards = [], [0] * len(pairs)
    for a in range(0, bounds[-1], cfg.mc_batch):
        b = min(a + cfg.mc_batch, bounds[-1])
        [logits] = yield [BlockCall(session, states[a:b])]
        sums.append(_masked_logp_sums(logits, targets[a:b], masked[a:b]))
        for i in range(len(pairs)):
            forwards[i] += bounds[i] < b and bounds[i + 1] > a  # the forward scored rows of pair i
    all_sums = torch.cat(sums)
    steps = []
    for i, (u, t) in enumerate(zip(units, tallies, strict=True)):
        t.add(u[0].plan, all_sums[bounds[i] : bounds[i + 1]], forwards[i])
        if len(u) > 1:  # its later blocks on a fork of the shared prefix
            own = session.fork()
            own.commit_block(u[0].targets[0])
            steps.append(_pair_blocks(own, None, u[1:], cfg, mask_id, t))
    yield from _lockstep(steps)
    return [t.estimate() for t in tallies]


def _sequence_pair(adapter: TargetAdapter, pair: Pair, cfg: LikelihoodConfig, tally: _Tally) -> Steps:
    mask_id = adapter.info.mask_id
    ctx, cont = list(pair.context), list(pair.continuation)
    n, k = len(ctx), len(cont)
    plan = plan_for(k, cfg.mc_num, unit_generator(pair.seed, 0))
    ids = _noised(ctx + cont, n, plan, mask_id)
    shifted = bool(getattr(getattr(adapter, "protocol", None), "shifted", False))
    keep = tuple(raw_positions(n, k, shifted).tolist())
    targets = torch.tensor(cont, dtype=torch.long).expand(plan.rows, -1)
    sums, forwards = [], 0
    for a in range(0, plan.rows, cfg.mc_batch):
        chunk = ids[a : a + cfg.mc_batch]
        if cfg.cfg > 0:
            u = chunk.clone()
            u[:, :n] = mask_id
            [both] = yield [SequenceCall(torch.cat([chunk, u]), keep)]
            logits = _guided(both[: chunk.shape[0]], both[chunk.shape[0] :], cfg.cfg)
        else:
            [logits] = yield [SequenceCall(chunk, keep)]
        forwards += 1
        sums.append(_masked_logp_sums(logits, targets[a : a + cfg.mc_batch], plan.masked[a : a + cfg.mc_batch]))
    tally.add(plan, torch.cat(sums), forwards)


def sequence_group(adapter: TargetAdapter, pairs: Sequence[Pair], cfg: LikelihoodConfig) -> Request:
    """Fully bidirectional targets: each pair's bound over [context ; continuation] (one unit); the group's pairs
    step together (the driver stacks their sequences, with the other live groups', into shared forwards)."""
    tallies = [_Tally() for _ in pairs]
    yield from _lockstep([_sequence_pair(adapter, p, cfg, t) for p, t in zip(pairs, tallies, strict=True)])
    return [t.estimate() for t in tallies]


def make_request(adapter: TargetAdapter, pairs: Sequence[Pair], cfg: LikelihoodConfig) -> Request:
    if not pairs:
        raise ValueError("a request group has at least one pair")
    for p in pairs:
        if not p.context or not p.continuation:
            raise ValueError("a likelihood pair needs at least one context and one continuation token")
    if adapter.info.grid_origin == "zero":
        return blockwise_group(adapter, pairs, cfg)
    if not isinstance(adapter, ScoresSequences):
        raise TypeError(f"{type(adapter).__name__} has no whole-sequence forward (sequence_logits)")
    return sequence_group(adapter, pairs, cfg)


def _run_calls(adapter: TargetAdapter, calls: list[Call]) -> list[torch.Tensor]:
    """Run the live requests' pending forwards, sharing forwards where the adapter can."""
    out: list[torch.Tensor | None] = [None] * len(calls)
    blocks = [i for i, c in enumerate(calls) if isinstance(c, BlockCall)]
    if len(blocks) > 1:
        got = adapter.block_logits_many([(calls[i].session, calls[i].states) for i in blocks])  # type: ignore[union-attr]
        for i, g in zip(blocks, got, strict=True):
            out[i] = g
    else:
        for i in blocks:
            c = calls[i]
            assert isinstance(c, BlockCall)
            out[i] = c.session.block_logits(c.states)
    seqs = [i for i, c in enumerate(calls) if isinstance(c, SequenceCall)]
    if seqs:
        assert isinstance(adapter, ScoresSequences)
        got = adapter.sequence_logits_many([(calls[i].ids, torch.tensor(calls[i].keep, dtype=torch.long))  # type: ignore[union-attr]
                                            for i in seqs])
        for i, g in zip(seqs, got, strict=True):
            out[i] = g
    return [o for o in out if o is not None]


def context_groups(pairs: Sequence[Pair], keys: Sequence[Any] | None = None) -> list[list[int]]:
    """Pairs grouped by (key, context), in first-seen order (keys: e.g. each request's document, so a group never
    spans documents and so never spans processes)."""
    groups: dict[tuple[Any, tuple[int, ...]], list[int]] = {}
    for i, p in enumerate(pairs):
        groups.setdefault((None if keys is None else keys[i], p.context), []).append(i)
    return list(groups.values())


def score_pairs(adapter: TargetAdapter, pairs: Sequence[Pair], cfg: LikelihoodConfig, batch_size: int = 1,
                on_done: Callable[[int, Estimate], None] | None = None,
                groups: Sequence[Sequence[int]] | None = None) -> list[Estimate]:
    """Every pair's estimate, in order. `groups` (default: by context) are scored together, sharing their
    context's prefix; up to `batch_size` groups share each step's forwards."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    groups = [list(g) for g in (groups if groups is not None else context_groups(pairs))]
    if sorted(i for g in groups for i in g) != list(range(len(pairs))):
        raise ValueError("groups must cover every pair exactly once")
    results: list[Estimate | None] = [None] * len(pairs)
    queue = list(range(len(groups)))[::-1]
    live: list[tuple[list[int], Request, list[Call]]] = []

    def finish(members: list[int], ests: list[Estimate]) -> None:
        for i, e in zip(members, ests, strict=True):
            results[i] = e
            if on_done is not None:
                on_done(i, e)

    def start() -> None:
        while queue and len(live) < batch_size:
            members = groups[queue.pop()]
            req = make_request(adapter, [pairs[i] for i in members], cfg)
            try:
                live.append((members, req, next(req)))
            except StopIteration as done:
                finish(members, done.value)

    start()
    while live:
        logits = _run_calls(adapter, [c for _, _, calls in live for c in calls])
        nxt, a = [], 0
        for members, req, calls in live:
            part, a = logits[a : a + len(calls)], a + len(calls)
            try:
                nxt.append((members, req, req.send(part)))
            except StopIteration as done:
                finish(members, done.value)
        live = nxt
        start()
    return [r for r in results if r is not None]
