"""The verifier's side of a round, behind one Protocol: how drafted tokens are fixed before the forward, and
which drafted nodes the target's logits accept after it. `coupled.CoupledVerifier` (state equality under shared
noise: the output is control's, id for id) and `rejection.RejectionVerifier` (accept-residual sampling on chains:
the output is distributed as control's) implement it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from lm_eval_spot.decoding.tree import DraftTree


@dataclass(frozen=True)
class RoundAt:
    """Where a round is: its block, its number in the request, and the block's coupled noise (None at T = 0)."""

    block: int
    round: int
    gumbel: torch.Tensor | None


@dataclass(frozen=True)
class Verdict:
    """The accepted drafted nodes (tree order, root excluded) and the target's own transition (position, token)
    at every node, on the host (-1 where the verifier did not compute one)."""

    path: list[int]
    pos: torch.Tensor
    tok: torch.Tensor


class Verifier(Protocol):
    def draft(self, tree: DraftTree, stale_src: torch.Tensor | None, at: RoundAt) -> DraftTree:
        """The tree the forward scores: the proposer's, with its drafted tokens as this verifier needs them."""
        ...

    def verify(self, tree: DraftTree, logits: torch.Tensor, eligible: torch.Tensor, bad_rows: torch.Tensor,
               at: RoundAt) -> Verdict:
        """Accept against the target's logits [1 + D, L, V] (mask token at -inf) of the tree's states, whose
        eligible slots are `eligible` [1 + D, L] (device); raises NonFiniteLogitsError where `bad_rows` flags a
        row the verdict reads."""
        ...
