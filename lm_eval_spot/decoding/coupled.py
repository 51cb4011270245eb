"""The coupled verifier: every node's target transition under the block's shared noise, and the drafted path that
matches them. A drafted state is accepted only if it IS the state control would reach, so the output equals
control's id for id, at any temperature, whatever the proposer drafts."""

from __future__ import annotations

import torch

from lm_eval_spot.decoding.sampling import Truncation
from lm_eval_spot.transfer import HostLink
from lm_eval_spot.decoding.transition import transition
from lm_eval_spot.decoding.tree import DraftTree, accepted_path
from lm_eval_spot.decoding.types import NonFiniteLogitsError
from lm_eval_spot.decoding.verifier import RoundAt, Verdict


class CoupledVerifier:
    def __init__(self, temperature: float, truncation: Truncation | None, link: HostLink) -> None:
        self.temperature, self.truncation, self.link = temperature, truncation, link

    def draft(self, tree: DraftTree, stale_src: torch.Tensor | None, at: RoundAt) -> DraftTree:
        return tree  # the proposer's tokens are the hypotheses themselves

    def verify(self, tree: DraftTree, logits: torch.Tensor, eligible: torch.Tensor, bad_rows: torch.Tensor,
               at: RoundAt) -> Verdict:
        pos_d, tok_d = transition(logits, eligible, self.temperature, at.gumbel, self.truncation)
        # The flag rides in the positions (-2 marks a bad row); positions and tokens come back in one copy.
        tpos, ttok = self.link.pull(torch.where(bad_rows, torch.full_like(pos_d, -2), pos_d), tok_d)
        if bool((tpos == -2).any()):
            raise NonFiniteLogitsError(at.block, at.round)
        return Verdict(accepted_path(tree, tpos, ttok), tpos, ttok)
