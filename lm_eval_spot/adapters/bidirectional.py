"""Fully bidirectional targets (LLaDA-8B, Dream-7B): every position attends every other, so a block's logits
depend on the masks after it and no prefix cache is exact.

Grid origin at the end of the prompt. The canvas is the prompt plus the generation length rounded up to whole
blocks, all masks at the start. Two modes:
- exact (default): every forward recomputes the WHOLE canvas (prompt, finished blocks, the active block's state,
  the trailing masks); R replicas are R canvases that differ only in the active block, in one batched forward.
  Its cost grows with R x canvas length.
- `cache="approx"` (native paths only): Fast-dLLM's prefix cache. At a block's first forward the whole canvas
  runs once with the block all masks; its prefix keys/values are kept for the block, and every later forward in
  the block runs [active block ; trailing masks] against them. Within a block the logits are a pure function of
  (prefix, state): the all-mask state's logits are those of the full forward, every other state's come from the
  cached prefix. SPOT is exact relative to this cached control, NOT to full recomputation.

Several requests share forwards (`forward_many`). The native classes run through the project's attention, so
canvases of any lengths share ONE forward (`ragged`: each request attends only its own positions, padding never
reaches attention); in approx mode a step makes at most two (the blocks' cache builds, then the cached rows). The
official forwards take no mask that could hide padding (LLaDA ignores masks; Dream's mask would change its
attention arithmetic), so there canvases of one length share a forward.

Shifted targets (Dream: the prediction for position i is the raw output at i - 1) are realigned here: the
decoder always sees position-aligned logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from lm_eval_spot.adapters.base import ForwardTally, NFECounter, RowsCall, TargetInfo
from lm_eval_spot.adapters.prefix_attention import KV, PrefixPass, use_prefix_attention
from lm_eval_spot.adapters.native_canvas import NativeCanvas
from lm_eval_spot.adapters.ragged import Attends, FullAttention, RaggedPass, stack_rows
from lm_eval_spot.transfer import upload

__all__ = ["BidirectionalAdapter", "BidirectionalSession", "CanvasProtocol", "NativeCanvas", "raw_positions"]


class CanvasProtocol(Protocol):
    """How one family's forward runs whole bidirectional canvases."""

    shifted: bool  # raw output i predicts position i + 1 (Dream)
    ragged: bool  # rows of different lengths share a forward (`run`); else only canvases of one length

    def forward(self, model: torch.nn.Module, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """ids [B, N] (positions 0..N-1, every position sees every other) -> raw logits at positions `keep`
        ([K] for every row, or [B, K] per row) -> [B, K, V]."""
        ...


def raw_positions(block_start: int, L: int, shifted: bool, device: torch.device | None = None) -> torch.Tensor:
    """Raw output positions holding the predictions for the block's L slots (Dream's first position predicts
    itself from position 0, as its official generation does)."""
    slots = torch.arange(block_start, block_start + L, device=device)
    return (slots - 1).clamp(min=0) if shifted else slots


class BidirectionalSession:
    def __init__(self, adapter: BidirectionalAdapter, prompt: list[int], gen_length: int) -> None:
        L = adapter.info.block_len
        self._adapter = adapter
        self._prefix = list(prompt)  # prompt and finished blocks
        self.canvas_len = len(prompt) + -(-gen_length // L) * L
        self.nfe = NFECounter()
        self.kv: KV | None = None  # approx mode: the active block's cached prefix
        self.mask_logits: torch.Tensor | None = None  # approx mode: the all-mask state's logits (full forward)
        self.device_states: torch.Tensor | None = None  # the last forward's state rows [R, L], on the device

    @property
    def block_start(self) -> int:
        return len(self._prefix)

    @property
    def pending_blocks(self) -> int:
        return 0  # the canvas is recomputed whole: a finished block adds no row

    def canvas(self, states: torch.Tensor) -> torch.Tensor:
        """Host canvases [R, canvas_len]: the prefix, each state, the trailing masks."""
        R, L = states.shape
        if L != self._adapter.info.block_len:
            raise ValueError(f"states must have block length {self._adapter.info.block_len}, got {L}")
        tail = self.canvas_len - self.block_start - L
        if tail < 0:
            raise ValueError(f"the canvas ({self.canvas_len} positions) has no room for another block")
        mask = self._adapter.info.mask_id
        pre = torch.tensor(self._prefix, dtype=torch.long).expand(R, -1)
        return torch.cat([pre, states.long(), torch.full((R, tail), mask, dtype=torch.long)], dim=1)

    def keep(self) -> torch.Tensor:
        """Raw positions of the active block's predictions [L] (host)."""
        return raw_positions(self.block_start, self._adapter.info.block_len, self._adapter.protocol.shifted)

    def block_logits(self, states: torch.Tensor) -> torch.Tensor:
        return self._adapter.forward_many([RowsCall(self, states)])[0][0]

    def full_logits(self, states: torch.Tensor) -> torch.Tensor:
        """Reference: the whole canvas recomputed (what exact mode's `block_logits` is; what `cache=approx`
        approximates). Counts no NFE: it is for checks, not decoding."""
        return self._adapter.sequence_logits(self.canvas(states), self.keep())

    def commit_block(self, block: torch.Tensor) -> None:
        if block.shape[0] != self._adapter.info.block_len:
            raise ValueError("commit_block takes one complete block")
        self._prefix.extend(block.tolist())
        self.kv = self.mask_logits = None  # the next block builds its own prefix cache


class BidirectionalAdapter:
    """Adapter over a fully bidirectional model (grid origin at the prompt's end). cache: "none" (exact, full
    recomputation every forward) or "approx" (Fast-dLLM prefix cache; native transformers classes only)."""

    def __init__(self, model: torch.nn.Module, info: TargetInfo, protocol: CanvasProtocol, cache: str = "none",
                 attention: str = "fused") -> None:
        """attention (cache="approx"): the shared-prefix attention's path, "fused" or "reference" (`prefix_attention`)."""
        if info.grid_origin != "prompt_end":
            raise ValueError("bidirectional targets use grid origin 'prompt_end'")
        if cache not in ("none", "approx"):
            raise ValueError(f"cache must be 'none' or 'approx', got {cache!r}")
        if info.exact_prefix_cache != (cache == "none"):
            raise ValueError("exact_prefix_cache must be True exactly when cache='none'")
        if cache == "approx" and not protocol.ragged:
            raise ValueError("cache='approx' needs a forward through the project's attention (a native class)")
        self.model = model.eval()
        self.info = info
        self.protocol = protocol
        self.cache = cache
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kernel = use_prefix_attention(self.model, attention) if protocol.ragged else None
        self.tally = ForwardTally()

    def open(self, prompt_ids: list[int], gen_length: int | None = None) -> tuple[BidirectionalSession, list[int]]:
        if gen_length is None:
            raise ValueError("a bidirectional target lays out its whole canvas: open() needs gen_length")
        return BidirectionalSession(self, prompt_ids, gen_length), []

    def _whole(self, rows: int, n: int) -> Attends:
        """The attention of a whole canvas (no cache): exact mode's stock SDPA, approx mode's own kernels."""
        if self.cache == "none":
            return FullAttention()
        return self._dense(rows, n, None)

    def _dense(self, rows: int, n: int, kv: KV | None, record: int = 0) -> PrefixPass:
        """Rows of n new positions that all see each other (and `kv`); the fused kernels skip the mask, the
        reference path adds it."""
        mask = torch.zeros(0, 0) if self.kernel is not None else torch.zeros(n, n, dtype=self.dtype, device=self.device)
        return PrefixPass([(0, rows, kv)], mask, record=record, kernel=self.kernel, dense=True)

    # ---- forwards shared by several requests -------------------------------------------------------------------
    def block_logits_many(self, items: Sequence[tuple[BidirectionalSession, torch.Tensor]]) -> list[torch.Tensor]:
        return [lg for lg, _ in self.forward_many([RowsCall(s, st) for s, st in items])]

    def forward_many(self, calls: Sequence[RowsCall]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Several requests' rounds, each charged one NFE and given the logits of its own forward: ONE forward for
        every canvas (ragged protocols; approx mode: one for the blocks' cache builds, one for the cached rows),
        else one per canvas length."""
        if any(c.ahead is not None for c in calls):
            raise ValueError("a bidirectional target has no cross-block lookahead row")
        if self.cache == "approx":
            return [(lg, None) for lg in self._approx_many(calls)]
        out: list[torch.Tensor | None] = [None] * len(calls)
        canvases = [c.session.canvas(c.states) for c in calls]
        for idx in self._groups([cv.shape[1] for cv in canvases]):
            ids = stack_rows([canvases[i] for i in idx], self.info.mask_id)
            keep = torch.cat([calls[i].session.keep().expand(calls[i].states.shape[0], -1) for i in idx])
            parts, a = [], 0
            for i in idx:
                r = canvases[i].shape[0]
                parts.append((a, a + r, canvases[i].shape[1], self._whole(r, canvases[i].shape[1])))
                a += r
            pos = stack_rows([torch.arange(canvases[i].shape[1]).expand(canvases[i].shape[0], -1) for i in idx], 0)
            ids_dev, pos_dev, keep_dev = upload(ids, pos, keep, device=self.device)
            logits = self._forward(ids_dev, pos_dev, parts, keep_dev)
            a = 0
            for i in idx:
                s, r = calls[i].session, canvases[i].shape[0]
                s.device_states = ids_dev[a : a + r, s.block_start : s.block_start + self.info.block_len]
                s.nfe.rounds += 1
                out[i] = logits[a : a + r]
                a += r
        return [(o, None) for o in out if o is not None]

    def _groups(self, lengths: list[int]) -> list[list[int]]:
        if self.protocol.ragged:
            return [list(range(len(lengths)))]
        by: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            by.setdefault(n, []).append(i)
        return list(by.values())

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, parts: list[tuple[int, int, int, Attends]],
                 keep: torch.Tensor) -> torch.Tensor:
        """One forward of device rows [B, N] -> float32 logits [B, K, V] at per-row raw positions keep [B, K]."""
        self.tally.forwards += 1
        with torch.no_grad():
            if self.protocol.ragged:
                return self.protocol.run(self.model, ids, pos, RaggedPass(parts), keep).float()  # type: ignore[attr-defined]
            return self.protocol.forward(self.model, ids, keep).float()

    def _approx_many(self, calls: Sequence[RowsCall]) -> list[torch.Tensor]:
        """Approx mode: the blocks' cache builds (a block's first forward: its all-mask canvas, keys/values of the
        prefix recorded) in one forward, then every not-all-mask row from its own cached prefix in another."""
        L, mask = self.info.block_len, self.info.mask_id
        sessions = [c.session for c in calls]
        build = [i for i, s in enumerate(sessions) if s.kv is None]
        all_mask = [(c.states == mask).all(dim=1).tolist() for c in calls]  # host states: no device read
        rest = [[r for r, m in enumerate(am) if not m] for am in all_mask]
        full = [sessions[i].canvas(torch.full((1, L), mask, dtype=torch.long)) for i in build]
        starts = [self.cached_len(s.block_start) for s in sessions]
        cached = [sessions[i].canvas(calls[i].states[rest[i]])[:, starts[i]:] for i in range(len(calls)) if rest[i]]
        host: list[torch.Tensor] = [torch.cat([c.states.long() for c in calls])]
        if full:
            host += [stack_rows(full, mask), stack_rows([torch.arange(f.shape[1])[None] for f in full], 0),
                     torch.stack([sessions[i].keep() for i in build])]
        if cached:
            with_rest = [i for i in range(len(calls)) if rest[i]]
            host += [stack_rows(cached, mask),
                     stack_rows([torch.arange(starts[i], sessions[i].canvas_len).expand(len(rest[i]), -1)
                                 for i in with_rest], 0),
                     torch.cat([(sessions[i].keep() - starts[i]).expand(len(rest[i]), -1) for i in with_rest])]
        dev = list(upload(*host, device=self.device))
        states_dev = dev.pop(0)
        if full:
            ids, pos, keep = dev[:3]
            dev = dev[3:]
            passes = [self._dense(1, f.shape[1], None, record=starts[i]) for i, f in zip(build, full, strict=True)]
            logits = self._forward(ids, pos, [(j, j + 1, f.shape[1], p) for j, (f, p) in enumerate(zip(full, passes))],
                                   keep)
            for j, (i, pp) in enumerate(zip(build, passes, strict=True)):
                sessions[i].kv = [(pp.recorded[k][0].clone(), pp.recorded[k][1].clone()) for k in sorted(pp.recorded)]
                sessions[i].mask_logits = logits[j : j + 1]
        rest_out: list[torch.Tensor] = []
        if cached:
            ids, pos, keep = dev
            parts, a = [], 0
            for i in with_rest:
                r = len(rest[i])
                n = sessions[i].canvas_len - starts[i]
                parts.append((a, a + r, n, self._dense(r, n, sessions[i].kv or None)))
                a += r
            logits = self._forward(ids, pos, parts, keep)
            a = 0
            for i in with_rest:
                rest_out.append(logits[a : a + len(rest[i])])
                a += len(rest[i])
        outs, it, a = [], iter(rest_out), 0
        for i, (c, s) in enumerate(zip(calls, sessions, strict=True)):
            R = c.states.shape[0]
            s.device_states = states_dev[a : a + R]
            a += R
            got = iter(next(it)) if rest[i] else iter(())
            assert s.mask_logits is not None
            outs.append(torch.stack([s.mask_logits[0] if m else next(got) for m in all_mask[i]]))
            # One NFE per call; a cache build that needed a forward of its own on top is a `store` forward.
            s.nfe.rounds += 1
            if i in build and rest[i]:
                s.nfe.store += 1
        return outs

    def cached_len(self, block_start: int) -> int:
        """Prefix positions kept in the cache: a shifted target re-feeds the last prefix token, whose output is
        the prediction for the block's first slot."""
        return block_start - 1 if self.protocol.shifted and block_start > 0 else block_start

    # ---- whole sequences (the self-check's reference and the likelihood bound; no NFE) --------------------------
    def sequence_logits(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Whole sequences [R, N] (every position sees every other, no cache) -> raw logits at positions `keep`
        [R, len(keep), V] float32 (shifted targets: the caller picks raw positions, `raw_positions`)."""
        return self.sequence_logits_many([(ids, keep)])[0]

    def sequence_logits_many(self, items: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """`sequence_logits` of several (ids [r, n], keep [k]) in as few forwards as the protocol allows (one when
        ragged; else one per length)."""
        out: list[torch.Tensor | None] = [None] * len(items)
        for idx in self._groups([ids.shape[1] for ids, _ in items]):
            k = max(items[i][1].shape[0] for i in idx)
            ids = stack_rows([items[i][0].long() for i in idx], self.info.mask_id)
            pos = stack_rows([torch.arange(items[i][0].shape[1]).expand(items[i][0].shape[0], -1) for i in idx], 0)
            keep = torch.cat([torch.nn.functional.pad(items[i][1].long(), (0, k - items[i][1].shape[0]))
                              .expand(items[i][0].shape[0], -1) for i in idx])
            parts, a = [], 0
            for i in idx:
                r, n = items[i][0].shape
                parts.append((a, a + r, n, self._whole(r, n)))
                a += r
            ids_dev, pos_dev, keep_dev = upload(ids, pos, keep, device=self.device)
            logits = self._forward(ids_dev, pos_dev, parts, keep_dev)
            a = 0
            for i in idx:
                r = items[i][0].shape[0]
                out[i] = logits[a : a + r, : items[i][1].shape[0]]
                a += r
        return [o for o in out if o is not None]
