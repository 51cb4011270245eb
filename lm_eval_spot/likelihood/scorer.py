"""The target forwards that score (context, continuation) pairs by the masked-diffusion bound.

- Block-causal targets (grid origin zero: SDAR, LLaDA2.0-mini, the embedded target): the bound is a sum over the
  continuation's blocks. Each block is one unit (its continuation tokens, one noise level), scored against the
  clean prefix through the adapter's exact prefix cache; the clean block is then committed, as decoding does. The
  continuation's last block is completed with masks (the marginal of the continuation's tokens; decoding's
  layout). Context tokens that share a block with the continuation are never masked.
- Fully bidirectional targets (grid origin at the prompt's end: LLaDA-8B, Dream-7B): the whole continuation is
  one unit over exactly [context ; continuation] (the references' layout; shifted logits realigned).

Each request is a generator that yields the forwards it needs and receives their logits, so a driver can run
many requests' forwards together: block forwards through `block_logits_many` where the adapter shares forwards,
whole sequences of one length stacked into one batch. A request's rows and noise never depend on the others.
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
from lm_eval_spot.likelihood.masks import MaskPlan, combine, plan_for


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
Request = Generator[Call, torch.Tensor, Estimate]


@runtime_checkable
class SharesBlockForwards(Protocol):
    """An adapter that runs several requests' block states in one forward (each request's logits equal its own
    `block_logits`)."""

    def block_logits_many(self, items: list[tuple[Any, torch.Tensor]]) -> list[torch.Tensor]: ...


@runtime_checkable
class ScoresSequences(Protocol):
    """A fully bidirectional adapter's cache-free whole-sequence forward."""

    def sequence_logits(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor: ...


def unit_generator(seed: int, unit: int) -> torch.Generator:
    """The noise of one unit of a request (block-causal: the block's absolute index; bidirectional: 0)."""
    return torch.Generator().manual_seed(mix_seed("likelihood", seed, unit))


def _masked_logp_sums(logits: torch.Tensor, targets: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """logits [R, k, V], targets [k], masked [R, k] -> per row, the sum of log p(target) over its masked slots [R]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, targets.to(logp.device)[None, :, None].expand(logp.shape[0], -1, 1)).squeeze(-1)
    return (picked * masked.to(logp.device)).sum(dim=1)


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


def blockwise_request(adapter: TargetAdapter, pair: Pair, cfg: LikelihoodConfig) -> Request:
    """A block-causal target's bound, block by block (see the module docstring)."""
    info = adapter.info
    L, mask_id = info.block_len, info.mask_id
    ctx, cont = list(pair.context), list(pair.continuation)
    session, tail = adapter.open(ctx)
    uncond = adapter.open([mask_id] * len(ctx))[0] if cfg.cfg > 0 else None
    first = (len(ctx) - len(tail)) // L  # absolute index of the first block holding continuation tokens
    full = tail + cont
    total, var, forwards, rows, exact, units = 0.0, 0.0, 0, 0, True, []
    for n, b0 in enumerate(range(0, len(full), L)):
        blk = full[b0 : b0 + L]
        lo = max(0, len(tail) - b0)  # the block's first continuation slot
        k = len(blk) - lo
        plan = plan_for(k, cfg.mc_num, unit_generator(pair.seed, first + n))
        states = _noised(blk + [mask_id] * (L - len(blk)), lo, plan, mask_id)
        targets = torch.tensor(blk[lo:], dtype=torch.long)
        sums = []
        for a in range(0, plan.rows, cfg.mc_batch):
            chunk = states[a : a + cfg.mc_batch]
            logits = yield BlockCall(session, chunk)
            forwards += 1
            if uncond is not None:
                u = chunk.clone()
                u[:, :lo] = mask_id
                logits = _guided(logits, (yield BlockCall(uncond, u)), cfg.cfg)
                forwards += 1
            sums.append(_masked_logp_sums(logits[:, lo : lo + k], targets, plan.masked[a : a + cfg.mc_batch]))
        est, v, vals = combine(plan, torch.cat(sums))
        total, var, rows, exact = total + est, var + v, rows + plan.rows, exact and plan.exact
        units.append(vals)
        if b0 + L < len(full):  # the clean block becomes the next block's prefix
            session.commit_block(torch.tensor(blk, dtype=torch.long))
            if uncond is not None:
                uncond.commit_block(torch.tensor([mask_id] * lo + blk[lo:], dtype=torch.long))
    return Estimate(total, var, exact, forwards, rows, units)


def sequence_request(adapter: TargetAdapter, pair: Pair, cfg: LikelihoodConfig) -> Request:
    """A fully bidirectional target's bound over [context ; continuation] (one unit)."""
    info = adapter.info
    mask_id = info.mask_id
    ctx, cont = list(pair.context), list(pair.continuation)
    n, k = len(ctx), len(cont)
    plan = plan_for(k, cfg.mc_num, unit_generator(pair.seed, 0))
    ids = _noised(ctx + cont, n, plan, mask_id)
    shifted = bool(getattr(getattr(adapter, "protocol", None), "shifted", False))
    keep = tuple(raw_positions(n, k, shifted).tolist())
    targets = torch.tensor(cont, dtype=torch.long)
    sums, forwards = [], 0
    for a in range(0, plan.rows, cfg.mc_batch):
        chunk = ids[a : a + cfg.mc_batch]
        if cfg.cfg > 0:
            u = chunk.clone()
            u[:, :n] = mask_id
            both = yield SequenceCall(torch.cat([chunk, u]), keep)
            logits = _guided(both[: chunk.shape[0]], both[chunk.shape[0] :], cfg.cfg)
        else:
            logits = yield SequenceCall(chunk, keep)
        forwards += 1
        sums.append(_masked_logp_sums(logits, targets, plan.masked[a : a + cfg.mc_batch]))
    est, var, vals = combine(plan, torch.cat(sums))
    return Estimate(est, var, plan.exact, forwards, plan.rows, [vals])


def make_request(adapter: TargetAdapter, pair: Pair, cfg: LikelihoodConfig) -> Request:
    if not pair.context or not pair.continuation:
        raise ValueError("a likelihood pair needs at least one context and one continuation token")
    if adapter.info.grid_origin == "zero":
        return blockwise_request(adapter, pair, cfg)
    if not isinstance(adapter, ScoresSequences):
        raise TypeError(f"{type(adapter).__name__} has no whole-sequence forward (sequence_logits)")
    return sequence_request(adapter, pair, cfg)


def _run_calls(adapter: TargetAdapter, calls: list[Call]) -> list[torch.Tensor]:
    """Run the live requests' pending forwards, sharing forwards where the adapter can."""
    out: list[torch.Tensor | None] = [None] * len(calls)
    blocks = [i for i, c in enumerate(calls) if isinstance(c, BlockCall)]
    if len(blocks) > 1 and isinstance(adapter, SharesBlockForwards):
        got = adapter.block_logits_many([(calls[i].session, calls[i].states) for i in blocks])  # type: ignore[union-attr]
        for i, g in zip(blocks, got, strict=True):
            out[i] = g
    else:
        for i in blocks:
            c = calls[i]
            assert isinstance(c, BlockCall)
            out[i] = c.session.block_logits(c.states)
    groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for i, c in enumerate(calls):
        if isinstance(c, SequenceCall):
            groups.setdefault((c.ids.shape[1], c.keep), []).append(i)
    for (_, keep), idx in groups.items():
        assert isinstance(adapter, ScoresSequences)
        ids = torch.cat([calls[i].ids for i in idx])  # type: ignore[union-attr]
        logits = adapter.sequence_logits(ids, torch.tensor(keep, dtype=torch.long))
        a = 0
        for i in idx:
            r = calls[i].ids.shape[0]  # type: ignore[union-attr]
            out[i] = logits[a : a + r]
            a += r
    return [o for o in out if o is not None]


def score_pairs(adapter: TargetAdapter, pairs: Sequence[Pair], cfg: LikelihoodConfig, batch_size: int = 1,
                on_done: Callable[[int, Estimate], None] | None = None) -> list[Estimate]:
    """Every pair's estimate, in order; up to `batch_size` requests share each round of forwards."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    results: list[Estimate | None] = [None] * len(pairs)
    queue = list(range(len(pairs)))[::-1]
    live: list[tuple[int, Request, Call]] = []

    def start() -> None:
        while queue and len(live) < batch_size:
            i = queue.pop()
            req = make_request(adapter, pairs[i], cfg)
            live.append((i, req, next(req)))

    start()
    while live:
        logits = _run_calls(adapter, [c for _, _, c in live])
        nxt: list[tuple[int, Request, Call]] = []
        for (i, req, _), lg in zip(live, logits, strict=True):
            try:
                nxt.append((i, req, req.send(lg)))
            except StopIteration as done:
                results[i] = done.value
                if on_done is not None:
                    on_done(i, done.value)
        live = nxt
        start()
    return [r for r in results if r is not None]
