"""Attention of R replica rows against ONE shared prefix KV, without R copies of it.

transformers' caches concatenate the prefix with each forward's new keys, which materialises the prefix once per
batch row: R replicas of the active block would cost R copies of the whole prefix KV per forward (about 3 GB for
SDAR-8B with a 1k-token prefix at R = 21). This module registers an attention function (under `NAME`) that the
block-causal adapter selects on its model: when a forward carries a `PrefixPass`, each layer attends the stored
prefix [1, kv, P, d] once for all rows (replicas folded into the query axis of one matmul per KV head) and each
row's own new keys separately, with one softmax over both. Without a `PrefixPass` (any other caller of the model)
it is transformers' own SDPA attention.

Three paths, chosen only by the forward's pending blocks (the same for every method in a given round, so control
and SPOT rows always take the same arithmetic):
- no pending tokens (every round but a block's first): the shared-prefix path above;
- exactly one pending block (a later block's first round): that block is a batch row of its own (`pending_row`,
  row 0), attending the prefix and itself; every other row reads its keys as one more prefix block. The block
  is computed once, not once per replica (R replicas of [pending ; state] cost about 2R rows);
- several pending blocks (the prompt's, in the first round): SDPA over the concatenated keys, which can be long
  (a 1k-token prompt) and is then better served by a fused kernel.

Cross-block lookahead (`PrefixPass.ahead`): the forward's LAST row holds the next block's state, and its block
positions also attend the active-block keys of an earlier row (a drafted completion of the active block), as the
next block's first forward would once that completion is committed. Every other row's arithmetic is unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lm_eval_spot.adapters.cascade import LseKernel, merge, pick_kernel

log = logging.getLogger(__name__)

NAME = "spot_prefix"
ATTENTIONS = ("fused", "reference")  # fused: cascade pieces through fused kernels; reference: the matmul path

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, kv_heads, P, head_dim]


@dataclass
class PrefixPass:
    """One forward's view of the prefixes: which batch rows belong to which request's stored KV (per layer), the
    new tokens' additive mask [N, N], and how many leading new tokens (pending blocks, batch row 0) to record for
    the cache. Several requests share a forward as consecutive row ranges, each reading only its own prefix."""

    segments: list[tuple[int, int, KV | None]]  # (first row, end row, that request's prefix KV)
    new_mask: torch.Tensor  # [N, N] additive (0 = attend), in the model's dtype, on its device
    record: int = 0
    recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # pending_row, fused path: per layer the prefix extended by the pending block (the session's next cache).
    extended: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # (row holding a completion of the active block, its block length): the last row is the next block, which
    # also attends that row's last `block` keys. Only in a one-request forward.
    ahead: tuple[int, int] | None = None
    # Row 0 is the one pending block (its keys recorded for the cache); the other rows read it after the prefix.
    # Only in a one-request forward; new_mask is then the block's own [L, L].
    pending_row: bool = False
    # The fused path's kernel (`cascade.pick_kernel`); None runs the reference path (plain matmuls, one softmax).
    kernel: LseKernel | None = None
    dense: bool = False  # new_mask lets every new token see every other of its row (the kernels skip it)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """q [R, H, N, d], k/v [R, kv, N, d] (after RoPE) -> attention output [R, N, H, d]."""
        if self.kernel is not None:
            return self._fused(layer, q, k, v, scaling)
        if self.pending_row:
            return self._with_pending_row(layer, q, k, v, scaling)
        if self.ahead is not None:
            return self._with_ahead(layer, q, k, v, scaling)
        return self._attend(layer, q, k, v, scaling)

    def _fused(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """Every layout through `_cascade`: which rows read which keys besides the stored prefix and their own."""
        if len(self.segments) != 1 and (self.record or self.pending_row or self.ahead is not None):
            raise ValueError("pending blocks and lookahead rows ride along with one request's forward at a time")
        if self.record:
            self.recorded[layer] = (k[:1, :, : self.record], v[:1, :, : self.record])
        if len(self.segments) > 1:
            # Each request's rows exactly as if it were alone in the forward (its arithmetic does not see the others).
            return torch.cat([self._cascade(pre[layer] if pre else None, q[a:b], k[a:b], v[a:b], scaling, [])
                              for a, b, pre in self.segments], dim=0)
        pre = self.segments[0][2]
        kv = pre[layer] if pre else None
        R, N = q.shape[0], q.shape[2]
        extra: list[tuple[int, int, int, torch.Tensor, torch.Tensor]] = []
        if self.pending_row:
            # Row 0 is the pending block. Every later row reads [prefix ; pending block] as ONE key set: the keys,
            # and the call, that the block's later rounds read from the stored prefix, so a state scored here (a
            # drafted state) gets the logits control gets for it in a later round, bit for bit. The extended
            # prefix is the new cache (`extended`): it is built once either way.
            self.recorded[layer] = (k[:1], v[:1])
            ext = ((torch.cat([kv[0], k[:1]], -2), torch.cat([kv[1], v[:1]], -2)) if kv is not None
                   else (k[:1].clone(), v[:1].clone()))
            self.extended[layer] = ext
            head = self._cascade(kv, q[:1], k[:1], v[:1], scaling, [])
            if self.ahead is not None:
                a, L = self.ahead
                extra.append((R - 2, R - 1, N - L, k[a : a + 1, :, -L:], v[a : a + 1, :, -L:]))
            return torch.cat([head, self._cascade(ext, q[1:], k[1:], v[1:], scaling, extra)], dim=0)
        if self.ahead is not None:
            # The last row (the next block) also reads a completion's active-block keys, at its block positions.
            a, L = self.ahead
            extra.append((R - 1, R, N - L, k[a : a + 1, :, -L:], v[a : a + 1, :, -L:]))
        return self._cascade(kv, q, k, v, scaling, extra)

    def _cascade(self, pre: tuple[torch.Tensor, torch.Tensor] | None, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, scaling: float, extra: list[tuple[int, int, int, torch.Tensor, torch.Tensor]]
                 ) -> torch.Tensor:
        """Rows attend [stored prefix ; extra keys ; own keys under new_mask], as merged pieces: one kernel call
        for all rows over the prefix (replicas folded into the query axis), one over each row's own keys, one
        per extra key set (rows r0:r1 from position n0 on)."""
        kernel = self.kernel
        assert kernel is not None
        R, H, N, d = q.shape
        kvh = k.shape[1]
        g = H // kvh
        qg = q.reshape(R, kvh, g, N, d)
        mask = None if self.dense else self.new_mask.repeat(g, 1)  # GQA groups folded into the query axis
        out, lse = kernel(qg.reshape(R, kvh, g * N, d), k, v, scaling, mask)
        piece = (out.reshape(R, kvh, g, N, d), lse.reshape(R, kvh, g, N))
        if pre is not None and pre[0].shape[-2]:
            piece = merge(piece, _shared_piece(kernel, qg, pre[0], pre[1], scaling))
        for r0, r1, n0, ke, ve in extra:
            part = _shared_piece(kernel, qg[r0:r1, :, :, n0:], ke, ve, scaling)
            sub = merge((piece[0][r0:r1, :, :, n0:], piece[1][r0:r1, :, :, n0:]), part)
            o, l = piece[0].float(), piece[1].clone()
            o[r0:r1, :, :, n0:], l[r0:r1, :, :, n0:] = sub
            piece = (o, l)
        return piece[0].to(q.dtype).reshape(R, H, N, d).transpose(1, 2).contiguous()

    def _with_pending_row(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
                          ) -> torch.Tensor:
        if len(self.segments) != 1:
            raise ValueError("a pending block rides along with one request's forward at a time")
        pre = self.segments[0][2]
        kv = pre[layer] if pre else None
        self.recorded[layer] = (k[:1], v[:1])
        head = self._shared(kv, q[:1], k[:1], v[:1], scaling)  # the pending block: the prefix and itself
        # Every later row: the prefix extended by the pending block, exactly as once it is stored.
        ext = (torch.cat([kv[0], k[:1]], -2), torch.cat([kv[1], v[:1]], -2)) if kv is not None else (k[:1], v[:1])
        if self.ahead is None:
            return torch.cat([head, self._shared(ext, q[1:], k[1:], v[1:], scaling)], dim=0)
        a, L = self.ahead
        end = q.shape[0] - 1
        body = self._shared(ext, q[1:end], k[1:end], v[1:end], scaling)
        ext_a = (torch.cat([ext[0], k[a : a + 1, :, -L:]], -2), torch.cat([ext[1], v[a : a + 1, :, -L:]], -2))
        last = self._shared(ext_a, q[end:], k[end:], v[end:], scaling)
        return torch.cat([head, body, last], dim=0)

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        if self.record:
            if len(self.segments) != 1:
                raise ValueError("pending blocks ride along with one request's forward at a time")
            self.recorded[layer] = (k[:1, :, : self.record], v[:1, :, : self.record])
            pre = self.segments[0][2]
            return self._wide(pre[layer] if pre else None, q, k, v, scaling)
        # Each request's rows exactly as if it were alone in the forward (its arithmetic does not see the others).
        outs = [self._shared(pre[layer] if pre else None, q[a:b], k[a:b], v[a:b], scaling)
                for a, b, pre in self.segments]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def _with_ahead(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """Rows but the last as usual; the last (the next block) also reads row `a`'s active-block keys."""
        assert self.ahead is not None
        if len(self.segments) != 1:
            raise ValueError("a lookahead row rides along with one request's forward at a time")
        a, L = self.ahead
        R = q.shape[0] - 1
        body = PrefixPass([(0, R, self.segments[0][2])], self.new_mask, self.record, self.recorded)
        out = body._attend(layer, q[:R], k[:R], v[:R], scaling)
        pre = self.segments[0][2]
        kp, vp = pre[layer] if pre else (None, None)
        ka, va = k[a : a + 1, :, -L:], v[a : a + 1, :, -L:]
        N = q.shape[2]
        if self.record:
            # Keys: [stored prefix ; completion ; own (pending blocks ; next block)]; the pending blocks come
            # before the active block, so only the next block's positions read the completion.
            cols = self.new_mask.new_zeros(N, L)
            cols[: N - L] = float("-inf")
            parts_k = ([kp] if kp is not None else []) + [ka, k[R:]]
            parts_v = ([vp] if vp is not None else []) + [va, v[R:]]
            pre_cols = [self.new_mask.new_zeros(N, kp.shape[-2])] if kp is not None else []
            mask = torch.cat(pre_cols + [cols, self.new_mask], -1)
            g = q.shape[1] // k.shape[1]
            kk = torch.cat(parts_k, -2).repeat_interleave(g, dim=1)
            vv = torch.cat(parts_v, -2).repeat_interleave(g, dim=1)
            last = F.scaled_dot_product_attention(q[R:], kk, vv, attn_mask=mask, scale=scaling).transpose(1, 2)
        else:
            ext = (torch.cat([kp, ka], -2), torch.cat([vp, va], -2)) if kp is not None else (ka, va)
            last = self._shared(ext, q[R:], k[R:], v[R:], scaling)
        return torch.cat([out, last.contiguous()], dim=0)

    def _shared(self, pre, q, k, v, scaling):
        R, H, N, d = q.shape
        kvh = k.shape[1]
        g = H // kvh
        qg = q.view(R, kvh, g, N, d)
        own = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scaling + self.new_mask  # [R, kv, g, N, N]
        P = 0 if pre is None else pre[0].shape[-2]
        if P:
            kp, vp = pre
            # Replicas folded into the query axis: one [R*g*N, d] x [d, P] matmul per KV head reads the prefix once.
            qf = qg.permute(1, 0, 2, 3, 4).reshape(kvh, R * g * N, d)
            sp = (torch.matmul(qf, kp[0].transpose(-1, -2)) * scaling).view(kvh, R, g, N, P).permute(1, 0, 2, 3, 4)
            scores = torch.cat([sp, own], dim=-1)
        else:
            scores = own
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs[..., P:], v.unsqueeze(2))  # [R, kv, g, N, d]
        if P:
            pp = probs[..., :P].permute(1, 0, 2, 3, 4).reshape(kvh, R * g * N, P)
            out = out + torch.matmul(pp, vp[0]).view(kvh, R, g, N, d).permute(1, 0, 2, 3, 4)
        return out.reshape(R, H, N, d).transpose(1, 2).contiguous()

    def _wide(self, pre, q, k, v, scaling):
        R, H, N, d = q.shape
        g = H // k.shape[1]
        mask = self.new_mask
        if pre is not None and pre[0].shape[-2]:
            kp, vp = pre
            k = torch.cat([kp.expand(R, -1, -1, -1), k], dim=-2)
            v = torch.cat([vp.expand(R, -1, -1, -1), v], dim=-2)
            mask = torch.cat([mask.new_zeros(N, kp.shape[-2]), mask], dim=-1)
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous()


@dataclass(frozen=True)
class StackedPass:
    """Several requests' passes in ONE forward: request i owns batch rows [first_i, end_i) and its own `PrefixPass`
    (prefix, pending block, lookahead row), built exactly as for its forward alone. Each layer runs every pass on
    its own rows, so a request's attention arithmetic is the one it gets alone; only the dense layers see the
    stacked batch."""

    parts: list[tuple[int, int, PrefixPass]]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        return torch.cat([pp.attend(layer, q[a:b], k[a:b], v[a:b], scaling) for a, b, pp in self.parts], dim=0)


def _shared_piece(kernel: LseKernel, qg: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, scaling: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """qg [R, kv, g, N, d] against ONE key set kp/vp [1, kv, P, d] read by all rows: rows and groups folded into
    the query axis of one kernel call (the keys are neither copied nor expanded) -> out [R, kv, g, N, d], lse."""
    R, kvh, g, N, d = qg.shape
    qf = qg.permute(1, 0, 2, 3, 4).reshape(1, kvh, R * g * N, d)
    out, lse = kernel(qf, kp, vp, scaling, None)
    return (out.reshape(kvh, R, g, N, d).permute(1, 0, 2, 3, 4), lse.reshape(kvh, R, g, N).permute(1, 0, 2, 3))


def prefix_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, spot_prefix=None, **kw):
    """transformers' attention-function signature (query [B, H, N, d]; returns ([B, N, H, d], None))."""
    if spot_prefix is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return spot_prefix.attend(module.layer_idx, query, key, value, scale), None


def use_prefix_attention(model: torch.nn.Module, attention: str = "fused") -> LseKernel | None:
    """Select the shared-prefix attention on `model` (registered with transformers once; idempotent). Returns the
    kernel its `PrefixPass`es carry: the fused one for the model's device and dtype, or None for `reference`."""
    from transformers import AttentionInterface

    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    AttentionInterface.register(NAME, prefix_attention)
    model.config._attn_implementation = NAME
    if attention == "reference":
        return None
    param = next(model.parameters())
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kernel, name = pick_kernel(param.device, param.dtype, head_dim)
    log.debug("shared-prefix attention: %s kernel on %s/%s", name, param.device, param.dtype)
    return kernel
