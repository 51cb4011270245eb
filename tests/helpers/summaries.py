"""Test plumbing: the drafter-facing summary of hand-made logits (what the decoder hands proposers/observers)."""

from __future__ import annotations

import torch

from lm_eval_spot.decoding.stale import Stale, summarize
from lm_eval_spot.transfer import HostLink


def view(logits: torch.Tensor, temperature: float = 0.0, gumbel: torch.Tensor | None = None) -> Stale:
    """[L, V] logits -> their Stale summary."""
    return summarize(logits[None], HostLink(), temperature, gumbel)[0]
