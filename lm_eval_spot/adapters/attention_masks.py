"""Block-causal attention masks (causal across blocks, bidirectional inside a block).

Masks are ADDITIVE float tensors (0 = attend, dtype-min = blocked): that form is read the same way by
transformers' eager and SDPA attention paths, whereas a boolean mask is misread by the eager path.
"""

from __future__ import annotations

import torch


def block_ids(positions: torch.Tensor, block_len: int) -> torch.Tensor:
    """Block index of each absolute position (blocks are aligned to absolute position 0)."""
    return torch.div(positions, block_len, rounding_mode="floor")


def allowed_to_additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean 'may attend' [..., Lq, Lk] -> additive [..., 1, Lq, Lk] mask for a 4D attention call."""
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    out.masked_fill_(~allowed, torch.finfo(dtype).min)
    return out.unsqueeze(-3)


def block_causal_allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, block_len: int) -> torch.Tensor:
    """q may attend k iff block(k) <= block(q). Shapes: q_pos [Lq], k_pos [Lk] -> [Lq, Lk]."""
    return block_ids(k_pos, block_len)[None, :] <= block_ids(q_pos, block_len)[:, None]


def block_causal_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, block_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """Additive [1, 1, Lq, Lk] block-causal mask for queries at q_pos over keys at k_pos."""
    return allowed_to_additive(block_causal_allowed(q_pos, k_pos, block_len), dtype).unsqueeze(0)


def dual_stream_allowed(clean_pos: torch.Tensor, noisy_pos: torch.Tensor, block_len: int) -> torch.Tensor:
    """Training mask over [clean stream ; noisy stream] (the SDAR recipe).

    Clean tokens attend clean tokens block-causally. A noisy token in block k attends clean tokens of blocks < k
    and noisy tokens of its own block k (bidirectional) -- exactly what it sees at inference, where earlier
    blocks are clean in the prefix cache and the active block is partly masked.
    Shapes: clean_pos [Lc], noisy_pos [Ln] -> [Lc + Ln, Lc + Ln].
    """
    cb = block_ids(clean_pos, block_len)
    nb = block_ids(noisy_pos, block_len)
    cc = cb[None, :] <= cb[:, None]
    cn = torch.zeros(len(clean_pos), len(noisy_pos), dtype=torch.bool, device=clean_pos.device)
    nc = cb[None, :] < nb[:, None]
    nn = nb[None, :] == nb[:, None]
    return torch.cat([torch.cat([cc, cn], dim=1), torch.cat([nc, nn], dim=1)], dim=0)
