"""The joint oracle: the true next commits (order AND tokens) read off a control run of the same request and seed.

It bounds what any drafter can reach with a chain of D states: every drafted state is accepted until the block
ends, so its NFE and wall clock are the ceilings the paper reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lm_eval_spot.decoding.proposer import Proposer, RoundContext
from lm_eval_spot.decoding.stale import Stale
from lm_eval_spot.decoding.tree import DraftTree


class CommitLog:
    """Decoder observer: the commits of one run, in order, per block."""

    def __init__(self) -> None:
        self.blocks: dict[int, list[tuple[int, int]]] = {}

    def on_commit(
        self, block: int, state: torch.Tensor, eligible: torch.Tensor, stale: Stale, pos: int, tok: int
    ) -> None:
        self.blocks.setdefault(block, []).append((pos, tok))


class OracleProposer:
    """Drafts the next `budget` commits of a logged control run as a chain (valid from a block's first round on)."""

    def __init__(self, log: CommitLog, budget: int, stale_only: bool = False) -> None:
        """stale_only: stay silent in a block's first round, as every drafter reading stale conditionals must
        (none exist yet); its NFE is then the floor for all of them, SPOT and the baselines alike."""
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        self.log, self.budget, self.stale_only = log, budget, stale_only

    def propose(self, ctx: RoundContext) -> DraftTree:
        if self.stale_only and ctx.stale is None:
            return DraftTree.empty()
        commits = self.log.blocks.get(ctx.block, [])
        # The decoder follows the control trajectory exactly, so the committed slots are a prefix of the log.
        k = next((i for i, (p, _) in enumerate(commits) if int(ctx.state[p]) == ctx.mask_id), len(commits))
        nxt = commits[k + 0 : k + self.budget]
        return DraftTree(tuple(range(len(nxt))), tuple(p for p, _ in nxt), tuple(t for _, t in nxt))


@dataclass(frozen=True)
class OracleProposers:
    """`mode=oracle` as a run's proposers (`decoding.proposer.RequestProposers`): each request of a chunk drafts
    the commits its own paired control decode made, `budget` at a time."""

    budget: int

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")

    @property
    def reads_control(self) -> bool:
        return True

    def watch_control(self, n: int) -> list[Any] | None:
        return [CommitLog() for _ in range(n)]

    def for_chunk(self, n: int, control: list[Any] | None) -> list[Proposer | None]:
        if control is None or len(control) != n or not all(isinstance(c, CommitLog) for c in control):
            raise ValueError("the oracle drafts from its requests' paired control decodes: pass the CommitLogs "
                             "watch_control gave, one per request")
        return [OracleProposer(c, self.budget) for c in control]
