"""Observers' view of the commits, summarised in batches rather than one commit at a time.

Summarising one commit's [L, V] logits costs a dozen tiny ops; on a small target that was a quarter of a control
round (measured: +14% to +30% of control's wall time with drafter_data). The rows wait here (copied: a round's
logits tensor holds every replica, and an adapter may reuse it) in one buffer allocated per request, and are
summarised together when the buffer is full and at the request's end. Observers see the same summaries, in the
same order, only later: as one `CommitBatch` when they define `on_commits`, else commit by commit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from lm_eval_spot.decoding.stale import Stale, summarize
from lm_eval_spot.transfer import HostLink
from lm_eval_spot.decoding.types import ObservesCommitBatches, RoundObserver

# Rows held before a summary: about 28 commits at L = 32, V = 293. Fewer rows pay the per-call overhead again; a
# whole request's rows at once (3 MB here) come from fresh pages every request, and their page faults made the
# observer's time vary from 5 to 76 ms a request (median 8.5 ms against 4.8 ms at 1 MB, measured).
MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class CommitBatch:
    """N commits in decode order, each with the summary of the target logits it was decided from (host tensors)."""

    block: list[int]
    state: torch.Tensor  # [N, L] the state before each commit
    eligible: torch.Tensor  # [N, L] bool
    topk: torch.Tensor  # [N, L, k] float32, sorted descending (`Stale.topk` per commit)
    top_ids: torch.Tensor  # [N, L, 2] long
    log1m: torch.Tensor  # [N, L] float32
    pos: list[int]
    tok: list[int]

    def __len__(self) -> int:
        return len(self.pos)

    def stale(self, i: int) -> Stale:
        return Stale(self.topk[i], self.top_ids[i], self.log1m[i])


class PendingCommits:
    def __init__(self, observer: RoundObserver, link: HostLink) -> None:
        self.observer, self.link = observer, link
        self.logits: torch.Tensor | None = None  # [cap, L, V] rows waiting, allocated at the first commit
        self.states: torch.Tensor | None = None  # [cap, L]
        self.eligible: torch.Tensor | None = None  # [cap, L]
        self.meta: list[tuple[int, int, int]] = []  # (block, pos, tok) of each waiting row
        self.seconds = 0.0  # spent in add and flush: what observing costs the request, measured directly

    def add(self, block: int, state: torch.Tensor, eligible: torch.Tensor, logits: torch.Tensor, pos: int,
            tok: int) -> None:
        """One commit: the state and eligibility before it, its [L, V] logits row (mask token at -inf)."""
        t0 = time.perf_counter()
        if self.logits is None:
            # Copies into buffers allocated once: a clone per commit and a stack per summary were a fifth of
            # recording's cost (allocation and cold pages), measured on the embedded target.
            cap = max(1, MAX_BYTES // (logits.numel() * logits.element_size()))
            self.logits = logits.new_empty((cap, *logits.shape))
            self.states = state.new_empty((cap, *state.shape))
            self.eligible = eligible.new_empty((cap, *eligible.shape))
        assert self.states is not None and self.eligible is not None
        n = len(self.meta)
        self.logits[n].copy_(logits)
        self.states[n].copy_(state)
        self.eligible[n].copy_(eligible)
        self.meta.append((block, pos, tok))
        self.seconds += time.perf_counter() - t0
        if len(self.meta) == self.logits.shape[0]:
            self.flush()

    def add_round(self, block: int, nodes: list[int], pos: torch.Tensor, tok: torch.Tensor, states: torch.Tensor,
                  eligible: torch.Tensor, logits: torch.Tensor) -> None:
        """A round's commits: at each of `nodes` (root, then the accepted path) the target's transition, if any."""
        for n in nodes:
            if int(pos[n]) >= 0:
                self.add(block, states[n], eligible[n], logits[n], int(pos[n]), int(tok[n]))

    def flush(self) -> None:
        if not self.meta:
            return
        assert self.logits is not None and self.states is not None and self.eligible is not None
        t0 = time.perf_counter()
        N, (_, L, V) = len(self.meta), self.logits.shape
        # One summary over every row (row-wise ops: the same values as one commit at a time). No coupled draws:
        # observers read probabilities, tokens and log(1 - p1) only.
        s = summarize(self.logits[:N].view(1, N * L, V), self.link)[0]
        block, pos, tok = (list(c) for c in zip(*self.meta, strict=True))
        # The buffers are refilled next: the batch gets its own copies.
        batch = CommitBatch(block, self.states[:N].clone(), self.eligible[:N].clone(), s.topk.view(N, L, -1),
                            s.top_ids.view(N, L, -1), s.log1m.view(N, L), pos, tok)
        self.meta = []
        if isinstance(self.observer, ObservesCommitBatches):
            self.observer.on_commits(batch)
        else:
            for i in range(N):
                self.observer.on_commit(block[i], batch.state[i], batch.eligible[i], batch.stale(i), pos[i], tok[i])
        self.seconds += time.perf_counter() - t0
