"""The proposer role: turn the stale target conditionals of the active block into a draft tree.

Control decoding is the proposer that drafts nothing; every drafting method shares the loop and verifier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from lm_eval_spot.decoding.stale import Stale
from lm_eval_spot.decoding.tree import DraftTree


@dataclass(frozen=True)
class RoundContext:
    """What a proposer may read at the start of a round (never the target's hidden states)."""

    state: torch.Tensor  # [L] current block state (mask id where masked)
    eligible: torch.Tensor  # [L] bool: masked slots inside the generation window
    committed_before: torch.Tensor  # [L] bool: slots that hold a token at the start of this round
    stale: Stale | None  # summary of the most recent target logits of this block; None in its 1st round
    temperature: float
    gumbel: torch.Tensor | None  # [L, V] the block's shared noise rows (T > 0, on the target's device), else None
    mask_id: int
    block: int = 0  # index of the active block within the generation (0 = the block holding the prompt's tail)
    # The order source's once-per-round work for this context, computed by the caller for a whole batch of
    # requests at once (`drafter.proposer.prepare_batch`); None: the proposer computes it.
    prepared: Any = None
    # The most nodes this round may draft, when a per-step policy (budget=auto) chose it; None: the proposer's own
    # budget. Proposers that grow trees (`TreeProposer`) honour it.
    budget: int | None = None


class Proposer(Protocol):
    def propose(self, ctx: RoundContext) -> DraftTree: ...


class RequestProposers(Protocol):
    """How a run gives each request of a chunk its proposer. Most methods share one proposer (`SharedProposer`);
    a method may instead build one per request from what that request's paired control decode commits (the
    oracle): `watch_control` gives the observers of that decode, `for_chunk` the proposers built from them."""

    @property
    def reads_control(self) -> bool:
        """True when the proposers are built from the paired control decode (which must then run, and first)."""
        ...

    def watch_control(self, n: int) -> list[Any] | None:
        """One observer per request for the chunk's paired control decode, or None when nothing reads it (the
        control decode may then run before or after the method's)."""
        ...

    def for_chunk(self, n: int, control: list[Any] | None) -> list[Proposer | None]:
        """The n requests' proposers (None: the request decodes draft-free); `control`: the observers
        `watch_control` gave, after the paired control decode ran."""
        ...


@dataclass(frozen=True)
class SharedProposer:
    """Every request drafts with one proposer (None: control decoding); nothing reads the paired control decode."""

    proposer: Proposer | None

    @property
    def reads_control(self) -> bool:
        return False

    def watch_control(self, n: int) -> list[Any] | None:
        return None

    def for_chunk(self, n: int, control: list[Any] | None) -> list[Proposer | None]:
        return [self.proposer] * n


@dataclass(frozen=True)
class DrafterOptions:
    """Several proposers of which a per-step policy (budget=auto) picks one per round (`names[k]` for
    `options[k]`): the run's drafter and a training-free one, where the second may pay better (a cheaper host pass
    at a similar acceptance). Used as a plain proposer it drafts with the first."""

    options: tuple[Proposer, ...]
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.options or len(self.options) != len(self.names):
            raise ValueError("DrafterOptions needs one name per option, and at least one option")

    def propose(self, ctx: RoundContext) -> DraftTree:
        return self.options[0].propose(ctx)


@runtime_checkable
class LearnsFromVerdicts(Protocol):
    """A proposer that learns from the verifier (as transformers' candidate generators do through
    `update_candidate_strategy`): after each round whose tree it proposed, that round's context and the accepted
    nodes of the tree, 1-based in its own numbering (root excluded; () when none was)."""

    def on_verdict(self, ctx: RoundContext, accepted: tuple[int, ...]) -> None: ...


@runtime_checkable
class Budgeted(Protocol):
    """A proposer with a fixed most-states-per-round (`budget`): the loop keeps a tree it extends (cross-block
    lookahead's leading edge) within it; a proposer without one, within the tree's own size."""

    @property
    def budget(self) -> int: ...


@runtime_checkable
class PreparesInBatches(Protocol):
    """A proposer whose order source's per-round work can run for several requests' rounds at once. Requests
    whose proposers share one `order` (a stateful proposer's per-request forks do) are prepared together."""

    order: Any

    def prepare_many(self, ctxs: Sequence[RoundContext]) -> list[Any]: ...


def prepare_batch(pairs: Sequence[tuple[Any, RoundContext | None]]) -> list[Any]:
    """For each (proposer, its round's context or None): the per-round work computed in one call per shared
    order source, or None where the proposer does its own (a lone request, other proposers, a block's first
    round without stale conditionals)."""
    out: list[Any] = [None] * len(pairs)
    groups: dict[int, tuple[PreparesInBatches, list[int]]] = {}
    for i, (prop, ctx) in enumerate(pairs):
        if isinstance(prop, PreparesInBatches) and ctx is not None and ctx.stale is not None and ctx.budget != 0:
            groups.setdefault(id(prop.order), (prop, []))[1].append(i)
    for prop, idx in groups.values():
        if len(idx) > 1:
            ctxs = [pairs[i][1] for i in idx]
            for i, prepared in zip(idx, prop.prepare_many(ctxs), strict=True):  # type: ignore[arg-type]
                out[i] = prepared
    return out


def token_hypotheses(ctx: RoundContext, hedge_below: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slot up to two (token, stale probability) hypotheses: [L, 2] tokens and probs (prob 0 = none).

    T=0: stale top-1, plus the runner-up when top-1 < hedge_below. T>0: the coupled stale draw
    argmax(stale/T + G) with the same Gumbel rows the target uses, and its stale probability at T.
    """
    stale = ctx.stale
    assert stale is not None
    if ctx.temperature > 0:
        if stale.draw_tok is None or stale.draw_p is None:
            raise ValueError("T > 0 drafting needs the coupled stale draws in the summary")
        tok, p = stale.draw_tok, stale.draw_p
        return torch.stack([tok, tok], -1), torch.stack([p, torch.zeros_like(p)], -1)
    p1 = stale.topk[:, 0]
    p2 = stale.topk[:, 1] if stale.topk.shape[-1] > 1 else torch.zeros_like(p1)
    p2 = torch.where(p1 < hedge_below, p2, torch.zeros_like(p2))
    return stale.top_ids, torch.stack([p1, p2], -1)
