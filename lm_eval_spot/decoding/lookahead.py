"""Cross-block lookahead: a round that can finish the active block also scores, in the same forward, the next
block's all-mask state after that completion. When the block then finishes exactly so, those logits are the next
block's true first-forward logits: its first round drafts from them (and leads with the root's own transition).
Never changes the output: a lookahead row only feeds the drafter."""

from __future__ import annotations

import torch

from lm_eval_spot.decoding.block import BlockCursor
from lm_eval_spot.decoding.stale import Stale
from lm_eval_spot.decoding.types import LookaheadCount


class Lookahead:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.count = LookaheadCount()
        self.row: int | None = None  # the forward row holding this round's completion (None: no lookahead)
        self._completion: torch.Tensor | None = None
        self._carry: torch.Tensor | None = None  # the next block's logits, once its block finished as the row said

    def begin_block(self, block: int) -> torch.Tensor | None:
        """A block begins: the logits a lookahead row gave it (its stale conditionals), or None."""
        carry, self._carry = self._carry, None
        self.count.used += int(carry is not None)
        self.count.later_blocks += int(block > 0)
        return carry

    def plan(self, states: torch.Tensor, stale: Stale | None, blocks: BlockCursor) -> torch.Tensor:
        """Pick this round's completion of the active block, if the round can finish it: the first state with the
        fewest masked slots, when at most one is left (the round's own transition commits one more), that last
        slot filled with the stale guess the drafters use. Returns the forward's rows (the completion appended
        when it is not a drafted state already)."""
        self.row, self._completion = None, None
        if not self.enabled or blocks.is_last():
            return states  # off, or no next block inside the generation
        open_ = blocks.open_slots(states)
        left = open_.sum(dim=1)
        row = int(left.argmin())
        if int(left[row]) > 1:
            return states
        completion = states[row].clone()
        if int(left[row]) == 1:
            if stale is None:
                return states
            slot = int(open_[row].nonzero()[0])
            guess = stale.draw_tok if stale.draw_tok is not None else stale.top_ids[:, 0]
            completion[slot] = int(guess[slot])
            row = states.shape[0]
        if any(int(t) in blocks.info.stop_ids for t in completion[blocks.window].tolist()):
            return states  # the generation ends in this block: nothing to look ahead to
        self.row, self._completion = row, completion
        return torch.cat([states, completion[None]]) if row == states.shape[0] else states

    def settle(self, blocks: BlockCursor, ahead: torch.Tensor | None) -> None:
        """After the round's commit: keep the lookahead logits when the block finished as the row's completion."""
        if self.row is None:
            return
        if ahead is None:
            raise ValueError("the round asked for lookahead logits and got none")
        self.count.rows += 1
        if not bool(blocks.open_slots(blocks.state).any()):
            if torch.equal(blocks.state, self._completion):  # else they are conditioned on another block
                self.count.exact += 1
                ahead[..., blocks.info.mask_id] = float("-inf")  # as every round's logits (never a commit candidate)
                self._carry = ahead
        self.row = self._completion = None
