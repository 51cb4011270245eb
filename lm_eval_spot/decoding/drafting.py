"""The drafting phase of a round: what the proposer reads (`RoundContext`), the tree it proposes, and the
verdict it learns from next round.

The stale conditionals are the deepest accepted node's logits of the previous round (or, in a block's first round,
the lookahead's): their summary comes to the host once per round. When they are the root's OWN logits (a
lookahead's, up to float rounding), the target's transition at the root is known before the forward: it is
drafted as the tree's leading edge and the proposer's tree grows below it (`lead`, `under_lead`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lm_eval_spot.decoding.block import BlockCursor
from lm_eval_spot.decoding.proposer import Budgeted, DrafterOptions, LearnsFromVerdicts, Proposer, RoundContext
from lm_eval_spot.decoding.sampling import Truncation
from lm_eval_spot.decoding.stale import Stale, summarize
from lm_eval_spot.transfer import HostLink
from lm_eval_spot.decoding.tree import DraftTree


def under_lead(tree: DraftTree, lead: tuple[int, int], budget: int | None) -> DraftTree:
    """`tree` re-rooted under one leading edge, within the proposer's budget (its size when it has none): the
    last nodes go, which are leaves (tree order puts parents first, so the rest stays a tree)."""
    keep = max(1, min(tree.size + 1, budget if budget is not None else tree.size))
    parent = ((0,) + tuple(p + 1 for p in tree.parent))[:keep]
    rank = (1,) + tuple(r + 1 for r in tree.ranks())
    if keep < len(rank):  # the kept nodes renumbered 1 .. keep in their rank order
        dense = [0] * keep
        for r, j in enumerate(sorted(range(keep), key=lambda j: rank[j]), start=1):
            dense[j] = r
        rank = tuple(dense)
    return DraftTree(parent, ((lead[0],) + tree.pos)[:keep], ((lead[1],) + tree.tok)[:keep], rank[:keep])


def lead(stale: Stale, eligible: torch.Tensor, temp: float) -> tuple[int, int] | None:
    """The target's own transition at the root, read off the summary of lookahead logits (the root's own, up to
    float rounding). The proposer then sees what it sees in every other round: a state one commit past the state
    its stale conditionals are of. The summary holds what the transition reads (each slot's clean confidence, its
    argmax and at T > 0 its coupled draw, in the same arithmetic), so the lead costs no device read of its own."""
    if not bool(eligible.any()):
        return None
    conf = stale.confidence.masked_fill(~eligible, -1.0)
    pos = int(conf.argmax())  # the first maximum: the lowest-index tie-break, as `transition`
    tok = stale.draw_tok if temp > 0 and stale.draw_tok is not None else stale.top_ids[:, 0]
    return pos, int(tok[pos])


class DraftingPhase:
    """One request's proposer across its rounds. Under rejection verification, positions come from the proposer
    at T = 0 (they never depend on sampled tokens; the verifier draws the tokens) and a block's first round drafts
    nothing (its proposal q needs stale conditionals). Given `DrafterOptions`, each round drafts with the option
    `begin` names (the first unless told)."""

    def __init__(self, proposer: Proposer | None, temperature: float, truncation: Truncation | None,
                 rejection: bool, link: HostLink) -> None:
        self.options: tuple[Proposer, ...] = (
            proposer.options if isinstance(proposer, DrafterOptions) else (proposer,) if proposer is not None else ())
        self.proposer = self.options[0] if self.options else None  # the round's
        self.rejection, self.link = rejection, link
        self.temperature, self.truncation = (0.0, None) if rejection else (temperature, truncation)
        self.ctx: RoundContext | None = None  # the round's context until its tree is proposed
        self._proposed: RoundContext | None = None  # the context of the tree the proposer made this round
        self.stale: Stale | None = None  # the round's stale summary (None when it drafts nothing)
        self._lead: tuple[int, int] | None = None
        self._budget: int | None = None
        self.asked = self.led = False

    def begin(self, blocks: BlockCursor, stale_src: torch.Tensor | None, fresh: bool, budget: int | None = None,
              option: int = 0) -> None:
        """Set `ctx` for this round, or None when it drafts nothing. budget: the most nodes this round drafts
        (a per-step policy's choice; None: the proposer's own; 0: none, and no drafter work at all); option: which
        of the `DrafterOptions` drafts it."""
        if self.options:
            self.proposer = self.options[option]
        self.asked = self.proposer is not None and (not self.rejection or stale_src is not None) and budget != 0
        self.stale, self._lead, self.ctx, self._budget = None, None, None, budget
        if not self.asked:
            return
        noise = None if self.rejection else blocks.gumbel
        stale = (summarize(stale_src[None], self.link, self.temperature, noise, trunc=self.truncation)[0]
                 if stale_src is not None else None)
        edge = lead(stale, blocks.open_slots(blocks.state), self.temperature) if (
            fresh and not self.rejection and stale is not None) else None
        base = blocks.state.clone()
        if edge is not None:
            base[edge[0]] = edge[1]
        mask_id = blocks.info.mask_id
        self.stale, self._lead = stale, edge
        # Under a lead edge the proposer's tree grows below it: one node of the round's budget is the lead's.
        below = None if budget is None else budget - (edge is not None)
        self.ctx = RoundContext(base, blocks.open_slots(base), base != mask_id, stale, self.temperature, noise,
                                mask_id, blocks.block, budget=below)

    def propose(self, prepared: object = None) -> DraftTree:
        """The round's tree (empty when it drafts nothing); `prepared`: the order source's per-round work for
        `ctx` when the caller computed it for a batch."""
        tree = DraftTree.empty()
        if self.ctx is not None:
            assert self.proposer is not None
            ctx = self.ctx if prepared is None else replace(self.ctx, prepared=prepared)
            self._proposed = None
            if ctx.budget != 0:  # 0: the lead edge is the whole tree
                tree = self.proposer.propose(ctx)
                self._proposed = ctx
            if self._lead is not None:
                budget = self._budget if self._budget is not None else (
                    self.proposer.budget if isinstance(self.proposer, Budgeted) else None)
                tree = under_lead(tree, self._lead, budget)
        self.ctx = None
        self.led = self._lead is not None
        return tree

    def learn(self, path: list[int]) -> None:
        """The verdict, to a proposer that learns from it: only on a tree it made, in its own node numbering
        (under a lead edge: shifted by one, the lead's node dropped)."""
        ctx, self._proposed = self._proposed, None
        if ctx is None or not isinstance(self.proposer, LearnsFromVerdicts):
            return
        accepted = tuple(n - 1 for n in path[1:]) if self.led else tuple(path)
        self.proposer.on_verdict(ctx, accepted)
