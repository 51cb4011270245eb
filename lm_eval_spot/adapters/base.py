"""The target adapter contract: the one interface every target family implements.

A decoder talks to a target only through `TargetAdapter` (static facts + `open`) and the `TargetSession` it
returns for one request (prefix cache, replica forwards, block commits, NFE counting).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

GridOrigin = Literal["zero", "prompt_end"]


@dataclass(frozen=True)
class TargetInfo:
    """Interface facts of a target, read once when it is loaded."""

    mask_id: int
    stop_ids: frozenset[int]  # eos and end-of-turn ids: committing one ends the generation
    pad_id: int | None
    block_len: int
    grid_origin: GridOrigin  # "zero": blocks aligned to absolute positions (prompt tail shares a block)
    exact_prefix_cache: bool  # True: cached logits equal a full recomputation (exactness guarantees hold)
    vocab_size: int


@dataclass
class NFECounter:
    """Target forward passes of one request, by kind. Every forward counts, whatever its batch shape."""

    prefill: int = 0  # standalone forwards that only fill the prefix cache
    rounds: int = 0  # forwards on active-block states (a batched verification forward is one); an adapter
    # may let pending prompt/finished blocks ride along with one of these to fill its cache
    store: int = 0  # standalone forwards that store a finished block

    @property
    def total(self) -> int:
        return self.prefill + self.rounds + self.store


@runtime_checkable
class TargetSession(Protocol):
    """One request's view of the target: a prefix cache plus the active block's start position."""

    nfe: NFECounter

    @property
    def block_start(self) -> int:
        """Absolute position of the active block's first slot."""
        ...

    def block_logits(self, states: torch.Tensor) -> torch.Tensor:
        """Logits for R hypothetical states of the active block in ONE forward.

        states: [R, L] token ids (mask id where masked). Returns [R, L, V] float32 logits, position-aligned
        (logits[r, i] predicts slot i). The shared prefix cache is not changed. Counts one NFE.
        """
        ...

    def commit_block(self, block: torch.Tensor) -> None:
        """Append a finished block [L] to the prefix and advance to the next block. An adapter either stores it
        with a forward of its own (counted in `store`) or with the next `block_logits` forward."""
        ...


class TargetAdapter(Protocol):
    info: TargetInfo

    def open(self, prompt_ids: list[int]) -> tuple[TargetSession, list[int]]:
        """Start a request on the prompt. Returns the session and the prompt tokens that sit in the first active
        block (with grid origin zero: the prompt's tail after its last complete block; they are never masked)."""
        ...
