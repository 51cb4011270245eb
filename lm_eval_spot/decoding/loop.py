"""The block-decoding loop shared by draft-free (control) and speculative decoding.

Each round runs ONE target forward over the root state plus any drafted states, accepts the drafted path that
matches the target's own transitions, and applies one more transition from the deepest accepted node. With no
proposer this is exactly the draft-free decoder: one commit per forward. A round, step by step:

1. start the block    `BlockCursor.roll` finishes full blocks; a new block takes the lookahead's logits, if any;
2. plan the rows      `DraftingPhase` asks the proposer for a tree, the verifier fixes its tokens, `Lookahead`
                      appends the next block's row, padding keeps the forward's shape (batch invariance);
3. one forward        the caller's: alone (`decode`) or shared with other requests (`batch.decode_many`);
4. verify             the `Verifier` (coupled or rejection) accepts a drafted path against the logits;
5. commit             the deepest accepted node plus the target's own transition there;
6. observe            observers see every commit, the proposer its verdict, the stop rule the prefix.
"""

from __future__ import annotations

import time

import torch

from lm_eval_spot.adapters.base import LooksAhead, RowsCall, TargetAdapter
from lm_eval_spot.decoding.block import BlockCursor
from lm_eval_spot.decoding.clock import RoundClock
from lm_eval_spot.decoding.coupled import CoupledVerifier
from lm_eval_spot.decoding.drafting import DraftingPhase
from lm_eval_spot.decoding.lookahead import Lookahead
from lm_eval_spot.decoding.observe import PendingCommits
from lm_eval_spot.decoding.proposer import Proposer, RoundContext
from lm_eval_spot.decoding.rejection import RejectionVerifier
from lm_eval_spot.decoding.stops import StopWatch
from lm_eval_spot.transfer import HostLink
from lm_eval_spot.decoding.tree import DraftTree, compile_states
from lm_eval_spot.decoding.types import (DecodeConfig, DecodeResult, LookaheadCount, NonFiniteLogitsError,
                                         ObservesVerdicts, RoundObserver, RoundTiming, StopCheck)
from lm_eval_spot.decoding.verifier import RoundAt, Verdict, Verifier

# The loop's vocabulary is imported from here by most callers.
__all__ = ["DecodeConfig", "DecodeResult", "LookaheadCount", "NonFiniteLogitsError", "RequestDecoder", "RoundObserver",
           "RoundTiming", "StopCheck", "decode"]


def decode(
    adapter: TargetAdapter,
    prompt_ids: list[int],
    cfg: DecodeConfig,
    seed: int,
    stop_check: StopCheck | None = None,
    proposer: Proposer | None = None,
    observer: RoundObserver | None = None,
    verify: str = "coupled",
) -> DecodeResult:
    """Decode one request. Deterministic given (prompt, cfg, seed): noise rows come from `seed` alone.

    verify="coupled" (state equality under shared noise): output ids equal control's for any proposer.
    verify="rejection" (chains, T > 0): accept-residual sampling; output is distributed as control's.
    """
    req = RequestDecoder(adapter, prompt_ids, cfg, seed, stop_check, proposer, observer, verify)
    while (states := req.next_states()) is not None:
        req.advance(*adapter.forward_many([RowsCall(req.session, states, req.ahead_row)])[0])
    assert req.result is not None
    return req.result


def make_verifier(rejection: bool, seed: int, cfg: DecodeConfig, link: HostLink) -> Verifier:
    if rejection:
        return RejectionVerifier(seed, cfg.temperature, cfg.truncation, link)
    return CoupledVerifier(cfg.temperature, cfg.truncation, link)


class RequestDecoder:
    """One request's decoding as a step function: `next_states()` gives the replica states of its next round
    (None once finished), `advance(logits)` takes the target's logits of those states and applies the round.
    The caller runs the forward in between, alone (`decode`) or batched with other requests (`batch.decode_many`).

    The round's arithmetic over the vocabulary runs on the target's device; the host receives per round the
    transitions and, when something drafts or observes, one state's per-slot summary (`HostLink` counts bytes).
    """

    def __init__(self, adapter: TargetAdapter, prompt_ids: list[int], cfg: DecodeConfig, seed: int,
                 stop_check: StopCheck | None = None, proposer: Proposer | None = None,
                 observer: RoundObserver | None = None, verify: str = "coupled") -> None:
        if verify not in ("coupled", "rejection"):
            raise ValueError(f"verify must be 'coupled' or 'rejection', got {verify!r}")
        self.t0 = time.perf_counter()
        self.adapter, self.cfg, self.proposer = adapter, cfg, proposer
        self.info, self.link = adapter.info, HostLink()
        self.session, tail = adapter.open(prompt_ids, cfg.max_gen_toks)
        self.blocks = BlockCursor(self.info, self.session, len(prompt_ids), cfg.max_gen_toks, tail, seed,
                                  cfg.temperature, adapter.device)
        self.stops = StopWatch(self.info.stop_ids, stop_check, cfg.max_gen_toks)
        rejection = verify == "rejection" and cfg.temperature > 0  # at T=0 both are the same greedy check
        self.verifier = make_verifier(rejection, seed, cfg, self.link)
        self.drafting = DraftingPhase(proposer, cfg.temperature, cfg.truncation, rejection, self.link)
        self.look = Lookahead(proposer is not None and cfg.lookahead and not cfg.pad_rows
                              and isinstance(self.session, LooksAhead))
        self.clock = RoundClock(adapter.device)
        # Commits for the observer, summarised in batches (observe.PendingCommits).
        self.observed = PendingCommits(observer, self.link) if observer is not None else None
        self.on_verify = observer.on_verify if isinstance(observer, ObservesVerdicts) else None
        self.committed = self.rounds = self._rows = self.pending_rows = 0
        self.drafted: list[int] = []
        self.accepted: list[int] = []
        self.last_accepted_ranks: tuple[int, ...] = ()
        self.result: DecodeResult | None = None
        self._tree, self._states = DraftTree.empty(), None  # the round in flight (next_states -> advance)
        self._block_begun()

    def _block_begun(self) -> None:
        # [L, V] device logits of the deepest accepted node; in a block's first round the lookahead's, if any,
        # which are the root's OWN logits (up to float rounding), not a parent's: `drafting.lead`.
        self.stale_src = self.look.begin_block(self.blocks.block)
        self._fresh = self.stale_src is not None

    @property
    def draft_ctx(self) -> RoundContext | None:  # what the proposer reads, from start_round to plan_round
        return self.drafting.ctx

    @property
    def ahead_row(self) -> int | None:  # the forward row holding this round's lookahead completion
        return self.look.row

    @property
    def rows(self) -> int:  # rows of the round in flight's forward (padding included)
        return self._rows

    def next_states(self) -> torch.Tensor | None:
        """The replica states [1 + D, L] of the next round (root first), or None when the request is done."""
        if not self.start_round():
            return None
        self.begin_drafting()
        return self.plan_round()

    def start_round(self) -> bool:
        """Step 1: start the block. False once finished. Then `begin_drafting` (a per-step policy may first read
        `can_draft` and `leads` to choose the round's budget)."""
        if self.result is not None:
            return False
        for _ in range(self.blocks.roll()):
            self._block_begun()
        self.clock.start()
        # Finished blocks that ride along with this forward (block-causal: one row each), read before it runs.
        self.pending_rows = self.session.pending_blocks
        return True

    @property
    def masked_left(self) -> int:
        """Masked slots of the active block inside the generation window."""
        return self.blocks.masked_left()

    @property
    def may_look_ahead(self) -> bool:
        """A drafting round that can finish the block would add a lookahead row (the next block's)."""
        return self.look.enabled and not self.blocks.is_last()

    @property
    def forward_rows(self) -> int:
        """Rows the round's forward really carries: its states (padding and a lookahead completion included), the
        finished blocks riding along, and the lookahead's next-block row (the adapter adds it)."""
        return self._rows + self.pending_rows + (self.look.row is not None)

    @property
    def can_draft(self) -> bool:
        """This round has stale conditionals to draft from (a block's first round without lookahead has none)."""
        return self.proposer is not None and self.stale_src is not None

    @property
    def leads(self) -> bool:
        """This round's stale conditionals are the root's own (an exact lookahead's): its tree leads with the
        target's own transition, a node all but sure to be accepted."""
        return self._fresh and not self.drafting.rejection

    def begin_drafting(self, budget: int | None = None, option: int = 0) -> None:
        """The proposer's context for this round (`draft_ctx`). budget: the most nodes it drafts (None: the
        proposer's own; 0: none, and no drafter work); option: which of a `DrafterOptions` drafts. A batch's caller
        may then compute the drafter's per-round work for all requests at once (`plan_round`)."""
        self.drafting.begin(self.blocks, self.stale_src, self._fresh, budget, option)

    @property
    def round_proposer(self) -> Proposer | None:  # the proposer drafting this round (one of a DrafterOptions)
        return self.drafting.proposer

    def plan_round(self, prepared: object = None) -> torch.Tensor:
        """Step 2: the round's forward rows: the proposer's tree (`prepared`: its order source's work for
        `draft_ctx`, when the caller computed it), its tokens as the verifier needs them, compiled, with the
        lookahead row and padding."""
        drafts = self.drafting.ctx is not None
        tree = self.drafting.propose(prepared)
        if drafts:
            tree = self.verifier.draft(tree, self.stale_src, self._at())
        self._fresh = False
        self._tree, self._states = tree, compile_states(self.blocks.state, tree)
        rows = self.look.plan(self._states, self.drafting.stale, self.blocks)
        self._rows = max(rows.shape[0], self.cfg.pad_rows)  # the forward's rows, padding included
        self.clock.forward_begins()
        pad = self.cfg.pad_rows - self._states.shape[0]
        if self.cfg.pad_rows and pad < 0:
            raise ValueError(f"a round drafted {tree.size} states: more than pad_rows={self.cfg.pad_rows} allows")
        return torch.cat([self._states, self._states[:1].expand(pad, -1)]) if pad > 0 else rows

    def advance(self, logits: torch.Tensor, ahead: torch.Tensor | None = None) -> None:
        """Steps 4-6 on the forward's logits [1 + D, L, V] of `next_states()`'s states (target's device), and the
        next block's lookahead logits [L, V] when the round asked for them (`ahead_row`)."""
        assert self._states is not None, "advance() without next_states()"
        tree, states = self._tree, self._states
        logits = logits[: states.shape[0]]  # padding rows (batch invariance) carry nothing
        # The mask token is never a commit candidate: confidence and tokens are over real tokens only.
        logits[..., self.info.mask_id] = float("-inf")
        fwd_end = self.clock.forward_ended()  # read after the verifier's copy has waited for the forward
        node_open = self.blocks.open_slots(states)
        open_dev = self.blocks.device_open(states, node_open)
        # NaN / inf anywhere in an eligible slot's row would pick its position and token silently: flag the rows.
        bad_rows = (~torch.isfinite(logits.amax(dim=-1)) & open_dev).any(dim=-1)
        verdict = self.verifier.verify(tree, logits, open_dev, bad_rows, self._at())
        self._observe(verdict, states, node_open, logits)
        last = ([0, *verdict.path])[-1]
        self.committed += self.blocks.commit(states[last], int(verdict.pos[last]), int(verdict.tok[last]),
                                             self.rounds) + len(verdict.path)
        self.rounds += 1
        self.drafted.append(tree.size)
        self.accepted.append(len(verdict.path))
        ranks = tree.ranks()
        self.last_accepted_ranks = tuple(ranks[n - 1] for n in verdict.path)  # for a per-step policy's record
        self.stale_src = logits[last]
        self._states = None
        self.look.settle(self.blocks, ahead)
        self.clock.end(fwd_end)
        if (stop := self.stops.check(self.blocks.prefix())) is not None:
            self._finish(*stop)

    def _at(self) -> RoundAt:
        return RoundAt(self.blocks.block, self.rounds, self.blocks.gumbel)

    def _observe(self, verdict: Verdict, states: torch.Tensor, node_open: torch.Tensor, logits: torch.Tensor) -> None:
        """The proposer learns the verdict; observers see each commit the round made, with its logits."""
        self.drafting.learn(verdict.path)
        if self.on_verify is not None:
            self.on_verify(self.blocks.block, self._tree, verdict.path, verdict.pos, verdict.tok)
        if self.observed is not None:
            self.observed.add_round(self.blocks.block, [0, *verdict.path], verdict.pos, verdict.tok, states,
                                    node_open, logits)

    def _finish(self, ids: list[int], reason: str) -> None:
        if self.observed is not None:
            self.observed.flush()  # before the clock stops: the observers' work is part of the request's time
        self.result = DecodeResult(ids, reason, self.session.nfe, self.committed, self.rounds, self.drafted,
                                   self.accepted, time.perf_counter() - self.t0, self.link.bytes, self.clock.timing,
                                   self.look.count, self.observed.seconds if self.observed is not None else 0.0)
