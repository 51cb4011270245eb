"""Attention in mergeable pieces: each piece is one fused-kernel call over one key set, returning its output and
its log-sum-exp; pieces over disjoint key sets of the same queries merge exactly (cascade attention).

This is how R replica rows read ONE stored prefix: the prefix piece runs all rows' queries against the prefix in
one kernel call (no copy of the prefix, no R x L x P score tensor), the own-block piece runs each row against its
own keys, and the two are merged by their log-sum-exps. A kernel is picked once per model (`pick_kernel`): the
fused ops PyTorch ships for the device, checked on a tiny input against the plain math, else the plain math in
query chunks (bounded memory, same results up to float rounding).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

# q [B, H, M, d], k/v [B, H, P, d] (same head count: callers fold GQA groups into M), scale, additive mask [M, P]
# or None -> (out [B, H, M, d] in q's dtype, lse [B, H, M] float32)
LseKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, "torch.Tensor | None"],
                     tuple[torch.Tensor, torch.Tensor]]

_CHUNK = 1 << 22  # scores per chunk of the math kernel (16 MB in float32)


def math_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-math kernel, in float32, a chunk of queries at a time (a fallback, and the probe's reference)."""
    B, H, M, d = q.shape
    step = max(1, _CHUNK // max(1, B * H * k.shape[-2]))
    kt, vf = k.float().transpose(-1, -2), v.float()
    outs, lses = [], []
    for i in range(0, M, step):
        s = torch.matmul(q[:, :, i : i + step].float(), kt) * scale
        if mask is not None:
            s = s + mask[i : i + step].float()
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.matmul(torch.exp(s - lse[..., None]), vf).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _cpu_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
    return out, lse


def _cuda_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    M = q.shape[-2]
    if mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)
        return res[0], res[1][..., :M]
    bias = None
    if mask is not None:
        # The memory-efficient kernel wants the bias's rows 16-aligned: pad the key axis and read a view of it.
        P = mask.shape[-1]
        padded = mask.new_zeros(M, -(-P // 16) * 16)
        padded[:, :P] = mask
        bias = padded[:, :P].expand(q.shape[0], q.shape[1], M, P)
    res = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, scale=scale)
    return res[0], res[1][..., :M]


def _fused_for(device: torch.device) -> LseKernel | None:
    if device.type == "cpu":
        return _cpu_lse
    if device.type == "cuda":
        return _cuda_lse
    return None


def pick_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[LseKernel, str]:
    """The fused kernel for (device, dtype) if it runs and agrees with the math on a tiny input (masked and not),
    else the math kernel; with its name for the logs."""
    fused = _fused_for(device)
    if fused is None:
        return math_lse, "math"
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, head_dim, generator=gen).to(device, dtype) for n in (24, 40, 40))
    mask = torch.zeros(24, 40)
    mask[:, 33:] = float("-inf")
    mask = mask.to(device, dtype)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    try:
        for m in (None, mask):
            out, lse = fused(q, k, v, head_dim**-0.5, m)
            ref_out, ref_lse = math_lse(q, k, v, head_dim**-0.5, m)
            if (out.float() - ref_out.float()).abs().max() > tol or (lse.float() - ref_lse).abs().max() > tol:
                raise RuntimeError("disagrees with the math kernel")
    except RuntimeError as err:  # an op missing on this build, or a dtype it does not take
        log.warning("spot-dlm: no fused attention kernel with log-sum-exp for %s/%s (%s): the shared-prefix "
                    "attention runs as plain math in chunks", device, dtype, str(err).splitlines()[0][:120])
        return math_lse, "math"
    return fused, "fused"


def merge(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two pieces (out [..., M, d], lse [..., M]) of the same queries over disjoint keys -> the attention over their
    union, in float32."""
    (oa, la), (ob, lb) = a, b
    m = torch.maximum(la, lb)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    total = wa + wb
    out = (oa.float() * (wa / total)[..., None]) + (ob.float() * (wb / total)[..., None])
    return out, m + torch.log(total)
