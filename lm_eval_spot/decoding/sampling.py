"""Top-k / top-p truncation of the target's sampling distribution, as transformers' warpers define it.

Applied to the tempered scores l / T (float64) before the Gumbel-max draw, in the order transformers' `generate`
applies its warpers (temperature, then top-k, then top-p), with their tie rules:
- top-k keeps every token whose score is at least the k-th largest (ties at the k-th value all survive);
- top-p sorts ascending, drops the tokens whose cumulative probability is <= 1 - p, and always keeps the last
  (most probable) one. Among exactly tied scores at that boundary the lower token id sorts first, so it is
  dropped first: a stable sort. transformers sorts unstably, so its choice among exact ties is whatever torch's
  sort kernel gives (it differs from the stable order on the CPU, and may with the batch's shape or device);
  exactness needs a rule that never depends on how many rows share a forward, and bf16 logits tie often.
  Without exact ties at the boundary the two agree token for token (tests/decoding/test_sampling.py).
The commit POSITION never reads this: it takes the clean, untruncated confidence (`transition.select_positions`),
so truncation changes only which token is drawn, the same way in control, the verifier and the drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Truncation:
    """top_k: 0 is off; top_p: 1.0 is off."""

    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 1, or 0 for off; got {self.top_k!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    def apply(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [..., V] (tempered logits) -> the same with truncated tokens at -inf (a new tensor)."""
        return truncate(scores, self.top_k, self.top_p)


def truncate(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p over the last dim; at least one token (the most probable) always survives."""
    V = scores.shape[-1]
    out = scores
    if 0 < top_k < V:
        kth = out.topk(top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = out.sort(dim=-1, stable=True)  # ascending: the least probable first
        drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p
        drop[..., -1] = False
        out = out.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return out
