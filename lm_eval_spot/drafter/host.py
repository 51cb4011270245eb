"""The factored order model's per-round pass in numpy, for drafting on the CPU.

A round encodes one 32-slot state with a 2-3 layer transformer of width 64-128: a few dozen tiny ops whose cost on
the CPU is torch's per-op dispatch, not arithmetic (about 1.4 ms a round for the small drafter, a sixth of its
forward's time). numpy's per-op cost is several times lower. Same weights and maths as
`FactoredOrderModel.tables` (float32; sums may round differently in the last bits, which can only change what is
drafted, never what is decoded: the verifier decides every commit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from threadpoolctl import ThreadpoolController

from lm_eval_spot.decoding.stale import Stale
from lm_eval_spot.drafter.factored import LOG1M_SCALE, FactoredOrderModel, HostTables, relative_slot_features
from lm_eval_spot.drafter.features import COMMITTED, INACTIVE, MASKED


def _blas_libraries() -> tuple[Any, ...]:
    """numpy's loaded BLAS libraries (threadpoolctl's controllers: set_num_threads / get_num_threads)."""
    return tuple(lib for lib in ThreadpoolController().lib_controllers if lib.user_api == "blas")


def _np(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().to("cpu", torch.float32).numpy())


def _normalize(x: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm without its affine part (folded into the next linear map). np.add.reduce, not np.mean: the
    latter's Python wrapper costs more than the sum at this size."""
    inv_d = np.float32(1.0 / x.shape[-1])
    xc = x - np.add.reduce(x, axis=-1, keepdims=True) * inv_d
    return xc / np.sqrt(np.add.reduce(xc * xc, axis=-1, keepdims=True) * inv_d + np.float32(eps))


def _fold(norm: torch.nn.LayerNorm, weight: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor | None = None
          ) -> tuple[np.ndarray, np.ndarray]:
    """(x_hat * g + b) @ W.T + c == x_hat @ (g[:, None] * W.T) + (b @ W.T + c): the norm's affine folded into the
    linear map, returned as (matrix [in, out], bias [out]); `scale` [out] multiplies the outputs (attention's
    1/sqrt(head_dim) on the queries)."""
    w = weight.detach().double()
    m = norm.weight.detach().double()[:, None] * w.T
    c = norm.bias.detach().double() @ w.T + bias.detach().double()
    if scale is not None:
        m, c = m * scale, c * scale
    return _np(m), _np(c)


@dataclass(frozen=True)
class _Layer:
    """One pre-norm encoder layer (ReLU), norms folded into the maps after them (matrices [in, out])."""

    qkv: tuple[np.ndarray, np.ndarray]  # norm1 folded in; query columns pre-scaled by 1/sqrt(head_dim)
    eps1: float
    out: tuple[np.ndarray, np.ndarray]
    ff1: tuple[np.ndarray, np.ndarray]  # norm2 folded in
    eps2: float
    ff2: tuple[np.ndarray, np.ndarray]
    heads: int

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x [B, L, d]: B independent states (stacked matmuls run one product per state)."""
        B, L, d = x.shape
        h = self.heads
        qkv = (_normalize(x, self.eps1) @ self.qkv[0] + self.qkv[1]).reshape(B, L, 3, h, d // h)
        qkv = qkv.transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # [B, h, L, dh]
        s = q @ k.transpose(0, 1, 3, 2)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= np.add.reduce(s, axis=-1, keepdims=True)
        a = (s @ v).transpose(0, 2, 1, 3).reshape(B, L, d)
        x = x + (a @ self.out[0] + self.out[1])
        y = np.maximum(_normalize(x, self.eps2) @ self.ff1[0] + self.ff1[1], np.float32(0.0))
        return x + (y @ self.ff2[0] + self.ff2[1])


@dataclass(frozen=True)
class HostEncoder:
    """A snapshot of a factored model's weights (taken at construction: later training does not reach it)."""

    inp: tuple[np.ndarray, np.ndarray]
    status: np.ndarray  # [4, d]
    slot: np.ndarray | None  # [max_block_len, d]; None when the model has no slot embedding
    rank: np.ndarray  # [max_block_len + 1, d]
    rel: tuple[np.ndarray, np.ndarray] | None  # relative slot features' map ([2, d], [d]); None without them
    layers: tuple[_Layer, ...]
    norm_eps: float
    # The three heads after the final norm (folded in) as one map: columns [base | q1 k1 q2 k2 | by_length],
    # the pair tables' 1/sqrt(d_pair) folded into the k columns.
    heads: tuple[np.ndarray, np.ndarray]
    d_pair: int
    top_k: int
    rank_pad: int
    # numpy's BLAS runs these matmuls on one thread: its own thread pool, woken beside torch's, spins on the cores
    # the target's forward needs (measured: the next forward 3.5x slower on 2 cores).
    blas: tuple[Any, ...] = field(default_factory=lambda: _blas_libraries(), compare=False, repr=False)
    # The relative slot features' contribution per block length ([L, d]), computed once per length, not per round.
    rel_by_len: dict[int, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def of(model: FactoredOrderModel) -> HostEncoder:
        """The snapshot, checked against the torch model (the one definition of the arithmetic) on a probe round."""
        host = HostEncoder._fold_weights(model)
        host.check_against(model)
        return host

    def check_against(self, model: FactoredOrderModel, L: int = 16) -> None:
        """Raise RuntimeError unless this pass computes the torch model's tables on a random round: a model
        option the numpy copy does not know of fails here, at snapshot time, not as quietly worse drafts."""
        L = min(L, model.cfg.max_block_len)
        g = torch.Generator().manual_seed(0)
        probs = torch.softmax(4.0 * torch.randn(L, max(self.top_k, 2), generator=g), dim=-1)
        topk = probs.sort(dim=-1, descending=True).values
        stale = Stale(topk, torch.zeros(L, 2, dtype=torch.long), torch.log1p(-topk[:, 0].clamp_max(1 - 1e-6)))
        committed = torch.rand(L, generator=g) < 0.3
        eligible = ~committed
        want = model.prepare(stale, committed, eligible).host
        got = self.prepare(stale, committed, eligible)
        assert want is not None
        for name in ("base", "pair_t", "last_t", "length_t"):
            a, b = getattr(got, name), getattr(want, name)
            if a.shape != b.shape or not np.allclose(a, b, rtol=1e-3, atol=1e-3):
                err = float(np.abs(a - b).max()) if a.shape == b.shape else f"shape {a.shape} vs {b.shape}"
                raise RuntimeError(f"the drafter's numpy pass differs from its torch model in {name} ({err}): "
                                   "a model option it does not handle (a bug: please report it)")

    @staticmethod
    def _fold_weights(model: FactoredOrderModel) -> HostEncoder:
        layers = []
        for layer in model.encoder.layers:
            att = layer.self_attn
            d = att.embed_dim
            q_scale = torch.ones(3 * d, dtype=torch.float64)
            q_scale[:d] = (d // att.num_heads) ** -0.5
            layers.append(_Layer(
                _fold(layer.norm1, att.in_proj_weight, att.in_proj_bias, q_scale), float(layer.norm1.eps),
                (_np(att.out_proj.weight.T), _np(att.out_proj.bias)),
                _fold(layer.norm2, layer.linear1.weight, layer.linear1.bias), float(layer.norm2.eps),
                (_np(layer.linear2.weight.T), _np(layer.linear2.bias)),
                att.num_heads,
            ))
        cfg = model.cfg
        head_scale = torch.ones(1 + 4 * cfg.d_pair + cfg.max_path + 1, dtype=torch.float64)
        for part in (2, 4):  # k1, k2
            head_scale[1 + (part - 1) * cfg.d_pair: 1 + part * cfg.d_pair] = cfg.d_pair**-0.5
        return HostEncoder(
            inp=(_np(model.inp.weight.T), _np(model.inp.bias)),
            status=_np(model.status.weight),
            slot=_np(model.slot.weight) if cfg.slot_embedding else None,
            rank=_np(model.rank.weight),
            rel=(_np(model.rel.weight.T), _np(model.rel.bias)) if cfg.relative_slots else None,
            layers=tuple(layers),
            norm_eps=float(model.norm.eps),
            heads=_fold(model.norm, torch.cat([model.base.weight, model.pairs.weight, model.by_length.weight]),
                        torch.cat([model.base.bias, model.pairs.bias, model.by_length.bias]), head_scale),
            d_pair=cfg.d_pair,
            top_k=cfg.top_k,
            rank_pad=cfg.max_block_len,
        )

    def prepare(self, stale: Stale, committed: torch.Tensor, eligible: torch.Tensor) -> HostTables:
        """As `FactoredOrderModel.prepare` on the CPU: the stale summary and the root's [L] masks -> the tables."""
        return self.prepare_many([(stale, committed, eligible)])[0]

    def prepare_many(self, items: Sequence[tuple[Stale, torch.Tensor, torch.Tensor]]) -> list[HostTables]:
        """`prepare` for several requests' rounds (one block length) in one stacked pass: numpy's per-op cost is
        paid once for all of them, and each request's tables are the ones it gets alone (tests check it)."""
        # Set and restored directly: threadpoolctl's `limit` re-reads every library's info on each call (~0.1 ms).
        before = [(lib, lib.get_num_threads()) for lib in self.blas]
        for lib, _ in before:
            lib.set_num_threads(1)
        try:
            return self._prepare(items)
        finally:
            for lib, n in before:
                if n is not None:
                    lib.set_num_threads(n)

    def _prepare(self, items: Sequence[tuple[Stale, torch.Tensor, torch.Tensor]]) -> list[HostTables]:
        # Top-k rounded to float16, as trajectories store it (the model's training inputs). torch rounds the same
        # way (IEEE, to nearest even) ~8x faster: numpy's float16 cast is slow on subnormals, common here.
        stales = [st for st, _, _ in items]
        p = torch.stack([st.topk[:, : self.top_k] for st in stales]).half().float().numpy()
        conf = torch.stack([st.confidence for st in stales]).numpy()
        log1m = torch.stack([st.log1m for st in stales]).numpy()
        comm = torch.stack([c for _, c, _ in items]).numpy()
        elig = torch.stack([e for _, _, e in items]).numpy()
        B, L = conf.shape
        neg = np.clip(-log1m, 0.0, 30.0) / np.float32(LOG1M_SCALE)
        feat = np.concatenate([p, np.log(np.maximum(p, np.float32(1e-9))), neg[..., None]], axis=-1)
        # The target commits the most confident eligible slot, lowest slot on ties: rank exactly as it would.
        key = np.where(elig, conf, np.float32(-1.0))
        order = np.argsort(-key, axis=-1, kind="stable")
        rank = np.empty((B, L), dtype=np.int64)
        np.put_along_axis(rank, order, np.broadcast_to(np.arange(L), (B, L)), axis=-1)
        rank[~elig] = self.rank_pad
        status = np.full((B, L), INACTIVE, dtype=np.int64)
        status[elig] = MASKED
        status[comm] = COMMITTED
        x = feat @ self.inp[0] + self.inp[1] + self.status[status] + self.rank[rank]
        if self.slot is not None:
            x = x + self.slot[:L]
        if self.rel is not None:
            if L not in self.rel_by_len:
                self.rel_by_len[L] = relative_slot_features(L).numpy() @ self.rel[0] + self.rel[1]
            x = x + self.rel_by_len[L]
        for layer in self.layers:
            x = layer(x)
        out = _normalize(x, self.norm_eps) @ self.heads[0] + self.heads[1]
        dp = self.d_pair
        q1, k1, q2, k2 = (out[..., 1 + i * dp: 1 + (i + 1) * dp] for i in range(4))
        pair_t = k1 @ q1.transpose(0, 2, 1)  # [B, j, i]: slot j on the path moves slot i
        last_t = k2 @ q2.transpose(0, 2, 1)
        return [HostTables(
            base=np.ascontiguousarray(out[b, :, 0]),
            pair_t=pair_t[b],
            last_t=last_t[b],
            length_t=np.ascontiguousarray(out[b, :, 1 + 4 * dp:].T),
            candidate=status[b] == MASKED,
        ) for b in range(B)]
