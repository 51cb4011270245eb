"""The target's transition f(s): one commit per forward, as the draft-free decoder defines it.

Position: the eligible masked slot with the highest clean confidence max_v softmax(l[i])_v, lowest index on
ties. Token: argmax at T=0, Gumbel-max argmax(trunc(l/T) + G) at T>0 with the block's shared noise rows
(float64; `trunc` is the optional top-k / top-p truncation, `sampling.py`). The position never depends on the
noise or the truncation, so f is a deterministic function of the state given the noise. Every
function here runs on whatever device its tensors are on (the target's): nothing of size V leaves it.
"""

from __future__ import annotations

import torch

from lm_eval_spot.decoding.sampling import Truncation


def row_chunks(x: torch.Tensor) -> int:
    """Rows of [..., V] to process at once: on the CPU a few MB at a time (softmax over a whole [R, L, V] tensor
    thrashes the caches: 116 ms against 34-39 ms in 2-8-row chunks at R = 9, L = 32, V = 151,936, bit for bit
    the same values since every op is row-wise); on an accelerator everything at once."""
    if x.device.type != "cpu":
        return max(1, x[..., 0].numel())
    return max(1, (1 << 20) // max(1, x.shape[-1]))


def clean_confidence(logits: torch.Tensor) -> torch.Tensor:
    """max_v softmax(logits)_v over the last dim: [..., L, V] -> [..., L] (float32)."""
    flat = logits.reshape(-1, logits.shape[-1])
    step = row_chunks(flat)
    parts = [torch.softmax(flat[i : i + step].float(), dim=-1).amax(dim=-1) for i in range(0, flat.shape[0], step)]
    return torch.cat(parts).view(logits.shape[:-1])


def select_positions(logits: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """Next commit position per state. logits [R, L, V], eligible [R, L] bool (each row has a True) -> [R].

    torch.argmax returns the first maximal index, which is the lowest-index tie-break the definition asks for.
    """
    conf = clean_confidence(logits).masked_fill(~eligible, -1.0)
    return conf.argmax(dim=-1)


def select_tokens(
    logits_at: torch.Tensor, positions: torch.Tensor, temperature: float, gumbel: torch.Tensor | None,
    trunc: Truncation | None = None,
) -> torch.Tensor:
    """Token per state at its chosen position. logits_at [R, V] (logits of the chosen slot), positions [R].
    At T=0 the truncation changes nothing (the argmax always survives it), as in transformers' greedy search."""
    if temperature <= 0.0:
        return logits_at.float().argmax(dim=-1)
    if gumbel is None:
        raise ValueError("temperature > 0 needs the block's Gumbel rows")
    # float64 Gumbel-max: float32 sums of l/T + G tie or round away small probability differences at V ~ 150k.
    scores = logits_at.double() / temperature
    if trunc is not None and trunc.active:
        scores = trunc.apply(scores)
    return (scores + gumbel[positions]).argmax(dim=-1)


def transition(
    logits: torch.Tensor, eligible: torch.Tensor, temperature: float, gumbel: torch.Tensor | None,
    trunc: Truncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """f(s) for R states at once. logits [R, L, V], eligible [R, L] -> (positions [R], tokens [R]).

    Rows with no eligible slot get position -1 and token -1 (nothing to commit).
    """
    has = eligible.any(dim=-1)
    safe = eligible | ~has[:, None]  # keep argmax defined on finished rows
    pos = select_positions(logits, safe)
    rows = torch.arange(logits.shape[0], device=logits.device)
    tok = select_tokens(logits[rows, pos], pos, temperature, gumbel, trunc)
    minus = torch.full_like(pos, -1)
    return torch.where(has, pos, minus), torch.where(has, tok, minus)
