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

Shifted targets (Dream: the prediction for position i is the raw output at i - 1) are realigned here: the
decoder always sees position-aligned logits.
"""

from __future__ import annotations

from typing import Protocol

import torch

from lm_eval_spot.adapters.base import NFECounter, TargetInfo
from lm_eval_spot.adapters.prefix_attention import KV, PrefixPass, use_prefix_attention
from lm_eval_spot.decoding.transfer import upload


class CanvasProtocol(Protocol):
    """How one family's forward runs a whole bidirectional canvas."""

    shifted: bool  # raw output i predicts position i + 1 (Dream)

    def forward(self, model: torch.nn.Module, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """ids [R, N] (positions 0..N-1, every position sees every other) -> raw logits at positions `keep`
        [R, len(keep), V]."""
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
        self._kv: KV | None = None  # approx mode: the active block's cached prefix
        self.device_states: torch.Tensor | None = None  # the last forward's state rows [R, L], on the device
        self._mask_logits: torch.Tensor | None = None  # approx mode: the all-mask state's logits (full forward)

    @property
    def block_start(self) -> int:
        return len(self._prefix)

    def _canvas(self, states: torch.Tensor) -> torch.Tensor:
        R, L = states.shape
        tail = self.canvas_len - self.block_start - L
        if tail < 0:
            raise ValueError(f"the canvas ({self.canvas_len} positions) has no room for another block")
        mask = self._adapter.info.mask_id
        pre = torch.tensor(self._prefix, dtype=torch.long).expand(R, -1)
        return torch.cat([pre, states.long(), torch.full((R, tail), mask, dtype=torch.long)], dim=1)

    def block_logits(self, states: torch.Tensor) -> torch.Tensor:
        ad = self._adapter
        R, L = states.shape
        if L != ad.info.block_len:
            raise ValueError(f"states must have block length {ad.info.block_len}, got {L}")
        # Kept positions are made on the device (from sizes: nothing to upload); the canvas goes up in one copy.
        keep = raw_positions(self.block_start, L, ad.protocol.shifted, ad.device)
        canvas = upload(self._canvas(states), device=ad.device)[0]
        self.device_states = canvas[:, self.block_start : self.block_start + L]
        if ad.cache == "none":
            with torch.no_grad():
                out = ad.protocol.forward(ad.model, canvas, keep)
            self.nfe.rounds += 1
            return out.float()
        return self._approx(states, canvas, keep)

    def _approx(self, states: torch.Tensor, canvas: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        ad = self._adapter
        all_mask = (states == ad.info.mask_id).all(dim=1).tolist()  # host states: no device read
        built_now = self._kv is None
        if built_now:
            self._build_cache(canvas)
        rest = [i for i, m in enumerate(all_mask) if not m]
        # Rows picked by host ints (views), not by an index tensor that would have to go up.
        rest_out = iter(ad.cached_forward(torch.stack([canvas[i] for i in rest]), self._kv, keep) if rest else [])
        assert self._mask_logits is not None
        out = torch.stack([self._mask_logits[0] if m else next(rest_out) for m in all_mask])
        # One NFE per call; a cache build that needed a forward of its own on top is a `store` forward.
        self.nfe.rounds += 1
        if built_now and len(rest):
            self.nfe.store += 1
        return out

    def _build_cache(self, canvas: torch.Tensor) -> None:
        """canvas: the round's canvases on the device; the block's all-mask canvas is row 0's with the block
        masked (made there, not uploaded)."""
        ad = self._adapter
        L = ad.info.block_len
        masks = canvas[:1].clone()
        masks[:, self.block_start : self.block_start + L] = ad.info.mask_id
        keep = raw_positions(self.block_start, L, ad.protocol.shifted, ad.device)
        self._kv, self._mask_logits = ad.full_forward_with_cache(masks, ad.cached_len(self.block_start), keep)

    def full_logits(self, states: torch.Tensor) -> torch.Tensor:
        """Reference: the whole canvas recomputed (what exact mode's `block_logits` is; what `cache=approx`
        approximates). Counts no NFE: it is for checks, not decoding."""
        ad = self._adapter
        keep = raw_positions(self.block_start, ad.info.block_len, ad.protocol.shifted, ad.device)
        return ad.sequence_logits(self._canvas(states), keep)

    def commit_block(self, block: torch.Tensor) -> None:
        if block.shape[0] != self._adapter.info.block_len:
            raise ValueError("commit_block takes one complete block")
        self._prefix.extend(block.tolist())
        self._kv = self._mask_logits = None  # the next block builds its own prefix cache


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
        self.model = model.eval()
        self.info = info
        self.protocol = protocol
        self.cache = cache
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kernel = use_prefix_attention(self.model, attention) if cache == "approx" else None

    def open(self, prompt_ids: list[int], gen_length: int | None = None) -> tuple[BidirectionalSession, list[int]]:
        if gen_length is None:
            raise ValueError("a bidirectional target lays out its whole canvas: open() needs gen_length")
        return BidirectionalSession(self, prompt_ids, gen_length), []

    def sequence_logits(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Whole sequences [R, N] (every position sees every other, no cache) -> raw logits at positions `keep`
        [R, len(keep), V] float32 (shifted targets: the caller picks raw positions, `raw_positions`). The
        self-check's reference and the likelihood bound's forward; counts no NFE."""
        keep = keep.to(self.device)
        if self.cache == "approx":  # the project's attention function serves whole canvases too (no PrefixPass)
            R, N = ids.shape
            zeros = torch.zeros(N, N, dtype=self.dtype, device=self.device)
            return self._run(ids, torch.arange(N).expand(R, -1),
                             PrefixPass([(0, R, None)], zeros, kernel=self.kernel, dense=True), keep)
        with torch.no_grad():
            return self.protocol.forward(self.model, ids.to(self.device), keep).float()

    # ---- approx mode (native transformers classes through the project's prefix attention) --------------------
    def cached_len(self, block_start: int) -> int:
        """Prefix positions kept in the cache: a shifted target re-feeds the last prefix token, whose output is
        the prediction for the block's first slot."""
        return block_start - 1 if self.protocol.shifted and block_start > 0 else block_start

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, pp: PrefixPass, keep: torch.Tensor) -> torch.Tensor:
        """ids/positions/keep: on the device (or host tensors, moved: reference paths only)."""
        with torch.no_grad():
            out = self.model(input_ids=ids.to(self.device), position_ids=positions.to(self.device),
                             attention_mask={"full_attention": None, "sliding_attention": None}, use_cache=False,
                             logits_to_keep=keep.to(self.device), spot_prefix=pp)
        return out.logits.float()

    def full_forward_with_cache(self, canvas: torch.Tensor, n_cache: int, keep: torch.Tensor) -> tuple[KV, torch.Tensor]:
        """One whole-canvas forward (row 0) that also records the first n_cache positions' keys/values."""
        N = canvas.shape[1]
        zeros = torch.zeros(N, N, dtype=self.dtype, device=self.device)  # every position sees every other
        pp = PrefixPass([(0, 1, None)], zeros, record=n_cache, kernel=self.kernel, dense=True)
        logits = self._run(canvas, torch.arange(N, device=self.device)[None], pp, keep)
        kv = [(pp.recorded[i][0].clone(), pp.recorded[i][1].clone()) for i in sorted(pp.recorded)]
        return kv, logits  # kv == [] when nothing precedes the block

    def cached_forward(self, canvas: torch.Tensor, kv: KV, keep: torch.Tensor) -> torch.Tensor:
        """Rows [R, N] of whole canvases, run from the cached prefix on: only positions >= the cached length."""
        c = kv[0][0].shape[-2] if kv else 0
        R, N = canvas.shape
        zeros = torch.zeros(N - c, N - c, dtype=self.dtype, device=self.device)
        pp = PrefixPass([(0, R, kv or None)], zeros, kernel=self.kernel, dense=True)
        return self._run(canvas[:, c:], torch.arange(c, N, device=self.device).expand(R, -1), pp, keep - c)



class NativeCanvas:
    """A transformers causal-LM class (Llama, Qwen2, ...) run bidirectionally: an all-zero additive 4D mask
    (every position attends every other), explicit positions, only the kept positions reach the LM head."""

    def __init__(self, shifted: bool) -> None:
        self.shifted = shifted

    def forward(self, model: torch.nn.Module, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        R, N = ids.shape
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(R, 1, N, N, dtype=dtype, device=ids.device)
        pos = torch.arange(N, device=ids.device).expand(R, -1)
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=keep).logits
