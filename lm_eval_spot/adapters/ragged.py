"""Rows of different lengths in ONE forward, each attending only its own positions.

A forward over several requests' canvases (fully bidirectional targets: each request's canvas has its own length)
pads every row to the longest. Padding with a key mask would still change a row's attention arithmetic (a longer
reduction, other kernel tiles: not bit for bit), so the padding never reaches attention at all: each layer runs
each request's part on its own unpadded slice [rows, :length], exactly the call that request's forward alone makes,
and writes zeros at the padded positions. Only the position-wise layers (projections, MLP, norms) see the stacked
batch, where a row's arithmetic does not depend on the others (bit for bit on a CPU whose matmul is row-count
invariant, e.g. MKL under MKL_CBWR=AVX2,STRICT, as the tests run: docs/families.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F


class Attends(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """q [R, H, N, d], k/v [R, kv, N, d] (after RoPE) -> attention output [R, N, H, d]."""
        ...


@dataclass(frozen=True)
class FullAttention:
    """Every position attends every other (a whole bidirectional canvas, no cache): one SDPA call, as transformers'
    SDPA path makes it for an unmasked forward (grouped KV heads through `enable_gqa`)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
        out = F.scaled_dot_product_attention(q, k, v, scale=scaling, **gqa)
        return out.transpose(1, 2).contiguous()


@dataclass(frozen=True)
class RaggedPass:
    """parts: (first row, end row, length, that part's attention): rows [first, end) hold a sequence of `length`
    positions, padded after it up to the forward's width."""

    parts: list[tuple[int, int, int, Attends]]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        B, H, N, d = q.shape
        if len(self.parts) == 1 and self.parts[0][:3] == (0, B, N):
            return self.parts[0][3].attend(layer, q, k, v, scaling)
        out = q.new_zeros(B, N, H, d)
        for a, b, n, inner in self.parts:
            out[a:b, :n] = inner.attend(layer, q[a:b, :, :n], k[a:b, :, :n], v[a:b, :, :n], scaling)
        return out


def stack_rows(rows: list[torch.Tensor], fill: int) -> torch.Tensor:
    """Host rows [r_i, n_i] -> [sum r_i, max n_i], each padded after its end with `fill`."""
    width = max(r.shape[1] for r in rows)
    return torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1]), value=fill) for r in rows])


@contextmanager
def head_sees_only(final_norm: torch.nn.Module, keep: torch.Tensor | slice) -> Iterator[None]:
    """While open, `final_norm` (the last module before an official forward's LM head, run once per forward) hands
    on only the positions `keep` (dim 1), so the head computes [B, len(keep), V] logits, not the whole canvas's:
    for official forwards that take no index of positions to keep. The norm is per position, so nothing else
    changes. keep: positions [K] for every row (or a slice), or [B, K] per row."""
    def pick(_module: Any, _args: Any, out: torch.Tensor) -> torch.Tensor:
        if isinstance(keep, torch.Tensor) and keep.dim() == 2:
            return out[torch.arange(out.shape[0], device=out.device)[:, None], keep]
        return out[:, keep]

    handle = final_norm.register_forward_hook(pick)
    try:
        yield
    finally:
        handle.remove()
