"""The proposer role: turn the stale target conditionals of the active block into a draft tree.

Control decoding is the proposer that drafts nothing; every drafting method shares the loop and verifier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from lm_eval_spot.decoding.tree import DraftTree


@dataclass(frozen=True)
class RoundContext:
    """What a proposer may read at the start of a round (never the target's hidden states)."""

    state: torch.Tensor  # [L] current block state (mask id where masked)
    eligible: torch.Tensor  # [L] bool: masked slots inside the generation window
    committed_before: torch.Tensor  # [L] bool: slots that hold a token at the start of this round
    stale_logits: torch.Tensor  # [L, V] the most recent target logits of this block (one commit stale)
    temperature: float
    gumbel: torch.Tensor | None  # [L, V] the block's shared noise rows (T > 0), else None
    mask_id: int


class Proposer(Protocol):
    def propose(self, ctx: RoundContext) -> DraftTree: ...
