"""The decoding loop's vocabulary: its configuration, its result, the observer protocol and its one error.

Kept apart from the loop so that what the loop calls (observers, verifiers, the batch step) depends on these
definitions, never on the loop itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from lm_eval_spot.adapters.base import NFECounter
from lm_eval_spot.decoding.sampling import Truncation
from lm_eval_spot.decoding.stale import Stale
from lm_eval_spot.decoding.tree import DraftTree

# ids generated so far -> how many of them to keep if they contain a stop string, else None.
StopCheck = Callable[[list[int]], "int | None"]


class NonFiniteLogitsError(RuntimeError):
    """The target returned NaN or inf logits on a slot the round decides: any commit from them would be garbage."""

    def __init__(self, block: int, round_: int, request: int | None = None) -> None:
        self.block, self.round, self.request = block, round_, request
        where = f"request {request}, " if request is not None else ""
        super().__init__(f"the target returned non-finite logits (NaN or inf) in {where}block {block}, round "
                         f"{round_}: a broken checkpoint, or an overflow in half precision (try dtype=float32 or "
                         "bfloat16)")

    def with_message(self, message: str) -> NonFiniteLogitsError:
        """The same error, worded for the caller who knows which request it was."""
        self.args = (message,)
        return self


@dataclass(frozen=True)
class DecodeConfig:
    max_gen_toks: int
    temperature: float = 0.0
    # Top-k / top-p truncation of the T > 0 draw (transformers' warpers; 0 and 1.0 are off; `sampling.py`).
    top_k: int = 0
    top_p: float = 1.0
    # Batch invariance: pad every forward (control's included) to this many replica rows with copies of the
    # root, so a state's logits never depend on how many other states shared its forward (0: no padding).
    pad_rows: int = 0
    # Cross-block lookahead: when a round's tree reaches a completion of the active block, the same forward also
    # scores the next block's all-mask state after that completion (an adapter with `block_logits_ahead`); those
    # logits are the next block's stale conditionals, so its first round drafts too. Never changes the output.
    lookahead: bool = False

    def __post_init__(self) -> None:
        if self.max_gen_toks <= 0:
            raise ValueError(f"max_gen_toks must be a positive integer, got {self.max_gen_toks}")
        if self.pad_rows < 0:
            raise ValueError(f"pad_rows must be >= 0, got {self.pad_rows}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        Truncation(self.top_k, self.top_p)  # validates both

    @property
    def truncation(self) -> Truncation | None:
        """The draw's truncation, None when it changes nothing (off, or greedy decoding)."""
        t = Truncation(self.top_k, self.top_p)
        return t if t.active and self.temperature > 0 else None


class RoundObserver(Protocol):
    """Sees every commit with a summary of the target logits it was decided from (analysis, drafter data)."""

    def on_commit(
        self, block: int, state: torch.Tensor, eligible: torch.Tensor, stale: Stale, pos: int, tok: int
    ) -> None:
        """state/eligible [L] before the commit; `stale` summarises the target logits computed at that state."""
        ...



@runtime_checkable
class ObservesCommitBatches(Protocol):
    """An observer that takes the commits of several rounds at once (in order, no per-commit work): its
    `on_commits` replaces `on_commit`."""

    def on_commits(self, batch: Any) -> None:
        """batch: an `observe.CommitBatch`."""
        ...


@runtime_checkable
class ObservesVerdicts(Protocol):
    """An observer that also sees each round's verdict: the drafted tree, the accepted nodes and the target's own
    transition at every node (position and token)."""

    def on_verify(self, block: int, tree: DraftTree, path: list[int], target_pos: torch.Tensor,
                  target_tok: torch.Tensor) -> None: ...


@dataclass
class RoundTiming:
    """Seconds spent per part of the rounds: drafting (summaries and the proposer), the target forward, and the
    rest (transitions, verification, transfers, stop checks)."""

    draft: float = 0.0
    forward: float = 0.0
    rest: float = 0.0

    def add(self, draft: float, forward: float, rest: float) -> None:
        self.draft += draft
        self.forward += forward
        self.rest += rest


@dataclass
class LookaheadCount:
    """Cross-block lookahead of one request: forwards that carried a lookahead row, blocks finished in such a
    forward exactly as the row's completion said (usable as the next block's true first-forward logits), and
    blocks whose first round drafted from lookahead logits."""

    rows: int = 0
    exact: int = 0
    used: int = 0
    later_blocks: int = 0  # blocks begun after the first (the ones a lookahead can serve)


@dataclass
class DecodeResult:
    token_ids: list[int]  # generated ids, cut before the first stop id / after the token completing a stop string
    stop_reason: str  # "eos" | "until" | "length"
    nfe: NFECounter
    committed: int  # tokens committed by the decoder (may exceed len(token_ids) past a stop)
    rounds: int
    drafted: list[int] = field(default_factory=list)  # per round: drafted states verified
    accepted: list[int] = field(default_factory=list)  # per round: drafted edges accepted
    wall_s: float = 0.0
    host_bytes: int = 0  # bytes read back from the target's device (what a GPU run transfers)
    timing: RoundTiming = field(default_factory=lambda: RoundTiming())
    lookahead: LookaheadCount = field(default_factory=lambda: LookaheadCount())
    observe_s: float = 0.0  # of wall_s: holding and summarising the commits for an observer (recording's own work)
