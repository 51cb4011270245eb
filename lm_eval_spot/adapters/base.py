"""The target adapter contract: the one interface every target family implements.

A decoder talks to a target only through `TargetAdapter` (static facts, its device, `open`) and the
`TargetSession` it returns for one request (prefix cache, replica forwards, block commits, NFE counting).

What the decoder relies on (every family must hold to it):
- `block_logits(states)` is a PURE function of (the committed prefix, the states): calling it twice with the same
  arguments gives the same logits, and it never changes what later calls see. An adapter may not refresh or
  re-compute an approximate cache behind the loop's back; the prefix changes only through `commit_block`.
- Logits stay on `TargetAdapter.device` (float32, position-aligned, only the active block's L positions): the
  decoder reduces them there and moves only per-slot summaries to the host.
- A state's logits must not depend on the other rows of the forward. Where kernels make that impossible in the
  last bits (accelerators at low precision), `batch_invariant=true` pads every forward to one row count.
- `exact_prefix_cache` says whether cached logits equal a full recomputation; it is reported in every run's
  results ("exact" / "approximate") and printed in the run summary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

GridOrigin = Literal["zero", "prompt_end"]


@dataclass(frozen=True)
class TargetInfo:
    """Interface facts of a target, read once when it is loaded."""

    mask_id: int
    stop_ids: frozenset[int]  # eos and end-of-turn ids: committing one ends the generation
    block_len: int
    # "zero": blocks aligned to absolute positions (the prompt's tail shares the first block, block-causal
    # targets); "prompt_end": blocks start where the prompt ends (fully bidirectional targets)
    grid_origin: GridOrigin
    exact_prefix_cache: bool  # True: cached logits equal a full recomputation (exactness guarantees hold)
    vocab_size: int
    max_positions: int | None = None  # the model's context (max_position_embeddings); None: not known


def positions_needed(info: TargetInfo, prompt_len: int, gen_len: int) -> int:
    """Positions a request occupies: the prompt and its generation, out to the last active block's end."""
    L = info.block_len
    if info.grid_origin == "zero":
        return -(-(prompt_len + gen_len) // L) * L
    return prompt_len + -(-gen_len // L) * L


@dataclass
class NFECounter:
    """Target forward passes of one request, by kind. Every forward counts, whatever its batch shape."""

    prefill: int = 0  # standalone forwards that only fill the prefix cache
    rounds: int = 0  # forwards on active-block states (a batched verification forward is one; so is a forward
    # shared with other requests); an adapter may let pending prompt/finished blocks ride along with one of these
    store: int = 0  # standalone forwards that store a finished block

    @property
    def total(self) -> int:
        return self.prefill + self.rounds + self.store


@dataclass
class ForwardTally:
    """Model forwards an adapter has run, whatever their shape or how many requests shared them (the run
    summary's forwards per step; NFE is per request and counts a shared forward once for each)."""

    forwards: int = 0


@runtime_checkable
class TargetSession(Protocol):
    """One request's view of the target: a prefix cache plus the active block's start position."""

    nfe: NFECounter
    # The last forward's state rows [R, L] as the adapter uploaded them (on its device), or None: the loop derives
    # its eligibility masks from them instead of uploading its own.
    device_states: torch.Tensor | None

    @property
    def block_start(self) -> int:
        """Absolute position of the active block's first slot."""
        ...

    @property
    def pending_blocks(self) -> int:
        """Finished blocks that ride along with the next forward, one row each (0 where blocks are stored apart or
        a canvas is recomputed whole)."""
        ...

    def block_logits(self, states: torch.Tensor) -> torch.Tensor:
        """Logits for R hypothetical states of the active block in ONE forward.

        states: [R, L] token ids on the host (mask id where masked). Returns [R, L, V] float32 logits on the
        adapter's device, position-aligned (logits[r, i] predicts slot i). A pure function of (committed prefix,
        states): the shared prefix cache is not changed. Counts one NFE.
        """
        ...

    def commit_block(self, block: torch.Tensor) -> None:
        """Append a finished block [L] to the prefix and advance to the next block. An adapter either stores it
        with a forward of its own (counted in `store`) or with the next `block_logits` forward."""
        ...


class TargetAdapter(Protocol):
    info: TargetInfo
    device: torch.device  # where the model's logits are (and the round's arithmetic runs)
    tally: ForwardTally

    def open(self, prompt_ids: list[int], gen_length: int | None = None) -> tuple[TargetSession, list[int]]:
        """Start a request on the prompt; `gen_length` is the generation's maximum length (a fully bidirectional
        target lays out its whole canvas from it). Returns the session and the prompt tokens that sit in the
        first active block (with grid origin zero: the prompt's tail after its last complete block; they are
        never masked)."""
        ...

    def forward_many(self, calls: Sequence[RowsCall]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """THE route to the target: several requests' rounds (one or more), each charged one NFE and given the
        logits of its own forward, in as few forwards as the adapter can. Per call, in order: (logits [R, L, V]
        of its states, the lookahead row's [L, V] or None). A session's `block_logits` is the one-call case."""
        ...

    def block_logits_many(self, items: Sequence[tuple[Any, torch.Tensor]]) -> list[torch.Tensor]:
        """`block_logits` of several (session, states), without lookahead rows: `forward_many`'s logits."""
        ...

    # Optional: full_logits(prefix_ids, states) -> [R, L, V]: the same logits by a cache-free recomputation of
    # [prefix ; state] (the self-check's reference for the prefix cache).


@dataclass(frozen=True)
class RowsCall:
    """One request's round in a shared forward: its replica states [R, L] and, for a cross-block lookahead, the row
    whose completion of the active block the next block's all-mask state is scored after (None: no lookahead)."""

    session: Any
    states: torch.Tensor
    ahead: int | None = None


@runtime_checkable
class LooksAhead(Protocol):
    """A session that scores the next block's first state in the same forward as the active block's states."""

    def block_logits_ahead(self, states: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor]: ...
