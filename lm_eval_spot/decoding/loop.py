"""The block-decoding loop shared by draft-free (control) and speculative decoding.

Each round runs ONE target forward over the root state plus any drafted states, accepts the drafted path that
matches the target's own transitions, and applies one more transition from the deepest accepted node. With no
proposer this is exactly the draft-free decoder: one commit per forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from lm_eval_spot.adapters.base import LooksAhead, NFECounter, TargetAdapter
from lm_eval_spot.decoding.observe import PendingCommits
from lm_eval_spot.decoding.noise import gumbel_rows, mix_seed
from lm_eval_spot.decoding.sampling import Truncation
from lm_eval_spot.decoding.proposer import Proposer, RoundContext, RoundRun
from lm_eval_spot.decoding.stale import Stale, summarize
from lm_eval_spot.decoding.transfer import DeviceClock, HostLink, upload
from lm_eval_spot.decoding.rejection import proposal_probs, rejection_verify, sample_chain_tokens
from lm_eval_spot.decoding.transition import transition
from lm_eval_spot.decoding.tree import DraftTree, accepted_path, compile_states

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

    # Optional: on_commits(batch: observe.CommitBatch) replaces on_commit when defined (the commits of several
    # rounds at once, in order, with no per-commit work); on_verify(block, tree, path, target_pos, target_tok) is
    # called once per round when defined
    # (the drafted tree, the accepted nodes and the target's own transition at every node).


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


def _first_stop(ids: list[int], stop_ids: frozenset[int]) -> int | None:
    return next((i for i, t in enumerate(ids) if t in stop_ids), None)


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
    req = RequestDecode(adapter, prompt_ids, cfg, seed, stop_check, proposer, observer, verify)
    while (states := req.next_states()) is not None:
        req.advance(*run_round(req, states))
    assert req.result is not None
    return req.result


def _under_lead(tree: DraftTree, lead: tuple[int, int], budget: int | None) -> DraftTree:
    """`tree` re-rooted under one leading edge, within the proposer's budget (its size when it has none): the
    last nodes go, which are leaves (tree order puts parents first, so the rest stays a tree)."""
    keep = max(1, min(tree.size + 1, budget if budget is not None else tree.size))
    parent = ((0,) + tuple(p + 1 for p in tree.parent))[:keep]
    return DraftTree(parent, ((lead[0],) + tree.pos)[:keep], ((lead[1],) + tree.tok)[:keep])


def _lead(stale: Stale, eligible: torch.Tensor, temp: float) -> tuple[int, int] | None:
    """The target's own transition at the root, read off the summary of lookahead logits (the root's own, up to
    float rounding): drafted as the tree's first edge, with the proposer's tree grown below it. The proposer then
    sees what it sees in every other round: a state one commit past the state its stale conditionals are of.
    The summary holds what the transition reads (each slot's clean confidence, its argmax and at T > 0 its coupled
    draw, in the same arithmetic), so the lead costs no device read of its own."""
    if not bool(eligible.any()):
        return None
    conf = stale.confidence.masked_fill(~eligible, -1.0)
    pos = int(conf.argmax())  # the first maximum: the lowest-index tie-break, as `transition`
    tok = stale.draw_tok if temp > 0 and stale.draw_tok is not None else stale.top_ids[:, 0]
    return pos, int(tok[pos])


def run_round(req: RequestDecode, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target forward of one request's round: logits of `states`, and the lookahead logits when it asked."""
    if req.ahead_row is None:
        return req.session.block_logits(states), None
    assert isinstance(req.session, LooksAhead)
    return req.session.block_logits_ahead(states, req.ahead_row)


class RequestDecode:
    """One request's decoding as a step function: `next_states()` gives the replica states of its next round
    (None once finished), `advance(logits)` takes the target's logits of those states and applies the round.
    The caller runs the forward in between, alone (`decode`) or batched with other requests (`batch.decode_many`).

    The round's arithmetic over the vocabulary (confidence, positions, tokens, the drafter's stale summaries)
    runs on the target's device; the host receives per round the R transitions and, when something drafts or
    observes, one state's per-slot summary (`HostLink` counts the bytes).
    """

    def __init__(
        self,
        adapter: TargetAdapter,
        prompt_ids: list[int],
        cfg: DecodeConfig,
        seed: int,
        stop_check: StopCheck | None = None,
        proposer: Proposer | None = None,
        observer: RoundObserver | None = None,
        verify: str = "coupled",
        timed: bool = True,
    ) -> None:
        """timed: report each round's rows and wall time to the proposer (`RoundContext.prev_round`); False when
        the request shares its forwards with others."""
        if verify not in ("coupled", "rejection"):
            raise ValueError(f"verify must be 'coupled' or 'rejection', got {verify!r}")
        self.t0 = time.perf_counter()
        self.adapter, self.cfg, self.seed = adapter, cfg, seed
        self.stop_check, self.proposer = stop_check, proposer
        self.rejection = verify == "rejection" and cfg.temperature > 0  # at T=0 both are the same greedy check
        self.dev = adapter.device
        self.session, self.tail = adapter.open(prompt_ids, cfg.max_gen_toks)
        self.link = HostLink()
        self.clock = DeviceClock(self.dev)
        # Commits for the observer, summarised in batches (observe.PendingCommits).
        self.observed = PendingCommits(observer, self.link) if observer is not None else None
        self.timing = RoundTiming()
        self.gen_start = len(prompt_ids)
        self.gen_end = self.gen_start + cfg.max_gen_toks
        self.done_ids: list[int] = []  # generated ids of finished blocks
        self.committed = self.rounds = 0
        self.drafted: list[int] = []
        self.accepted: list[int] = []
        self.block = 0
        self.checked_len = 0
        self.prev_path: tuple[int, ...] | None = None
        self.timed = timed
        self.prev_round: RoundRun | None = None
        self._pending = 0  # finished blocks this round's forward carries (`RoundContext.pending`)
        self._rows = 0
        self.on_verify = getattr(observer, "on_verify", None) if observer is not None else None
        self.result: DecodeResult | None = None
        self.ahead = LookaheadCount()
        self._carry: torch.Tensor | None = None  # the next block's logits from a lookahead row
        self._can_look = (proposer is not None and cfg.lookahead and not cfg.pad_rows
                          and isinstance(self.session, LooksAhead))
        # The round in flight (set by next_states, read by advance).
        self._tree = DraftTree.empty()
        self._states: torch.Tensor | None = None
        self._q: torch.Tensor | None = None
        self._asked = False
        self._led = False  # this round's tree starts with the lead edge (see `_lead`)
        self._fresh = False
        self.ahead_row: int | None = None  # the forward row holding this round's lookahead completion
        self._completion: torch.Tensor | None = None
        self._t_round = self._t_forward = 0.0
        self._fwd_mark: object = None
        self._stale: Stale | None = None
        self._lead_edge: tuple[int, int] | None = None
        self.draft_ctx: RoundContext | None = None  # set by start_round when the round drafts
        self._round_ahead = False
        self._start_block()

    def _start_block(self) -> None:
        L, mask_id = self.adapter.info.block_len, self.adapter.info.mask_id
        abs_pos = self.session.block_start + torch.arange(L)
        self.window = (abs_pos >= self.gen_start) & (abs_pos < self.gen_end)
        on_dev = self.session.block_start + torch.arange(L, device=self.dev)  # made there: nothing to upload
        self.window_dev = (on_dev >= self.gen_start) & (on_dev < self.gen_end)
        self.state = torch.full((L,), mask_id, dtype=torch.long)
        if self.block == 0 and self.tail:
            self.state[: len(self.tail)] = torch.tensor(self.tail, dtype=torch.long)
        # Drawn once per block, on the device (a pure function of (seed, block, position, token): no transfer).
        V = self.adapter.info.vocab_size
        self.gumbel = gumbel_rows(self.seed, self.block, L, V, self.dev) if self.cfg.temperature > 0 else None
        # [L, V] device logits of the deepest accepted node; in a block's first round the lookahead's, if any.
        self.stale_src: torch.Tensor | None = self._carry
        # Lookahead logits are the root's OWN logits (up to float rounding), not a parent's: see `_lead`.
        self._fresh = self._carry is not None
        self.ahead.used += int(self._fresh)
        self.ahead.later_blocks += int(self.block > 0)
        self._carry = None

    def next_states(self) -> torch.Tensor | None:
        """The replica states [1 + D, L] of the next round (root first), or None when the request is done."""
        return self.plan_round() if self.start_round() else None

    def start_round(self) -> bool:
        """Begin the next round up to the proposer's call: finish full blocks, summarise the stale logits, and set
        `draft_ctx` (what the proposer will read; None when this round drafts nothing). False once finished.
        A batch's caller may then compute the drafter's per-round work for all requests at once (`plan_round`)."""
        if self.result is not None:
            return False
        mask_id = self.adapter.info.mask_id
        while not bool(((self.state == mask_id) & self.window).any()):
            self.done_ids.extend(self.state[self.window].tolist())
            self.session.commit_block(self.state)
            self.block += 1
            self._start_block()
        self._t_round = time.perf_counter()
        self._pending = int(getattr(self.session, "pending_blocks", 0))
        eligible = (self.state == mask_id) & self.window
        # Rejection sampling drafts nothing in a block's first round (its proposal q needs stale conditionals).
        self._asked = self.proposer is not None and (not self.rejection or self.stale_src is not None)
        self._stale, self._lead_edge, self.draft_ctx = None, None, None
        if self.proposer is not None and self._asked:
            # Under rejection, positions come from the proposer at T=0 (they never depend on sampled tokens)
            # and tokens are drawn from q.
            temp, noise = (0.0, None) if self.rejection else (self.cfg.temperature, self.gumbel)
            src = self.stale_src
            trunc = None if self.rejection else self.cfg.truncation
            stale = summarize(src[None], self.link, temp, noise, trunc=trunc)[0] if src is not None else None
            lead = _lead(stale, eligible, temp) if self._fresh and not self.rejection and stale is not None else None
            base = self.state.clone()
            if lead is not None:
                base[lead[0]] = lead[1]
            self._stale, self._lead_edge = stale, lead
            self.draft_ctx = RoundContext(base, (base == mask_id) & self.window, base != mask_id, stale, temp, noise,
                                          mask_id, self.block, self.prev_path, self.prev_round, self._pending)
        return True

    def plan_round(self, prepared: object = None) -> torch.Tensor:
        """The round's replica states after `start_round`: the proposer's tree (from `prepared`, the order
        source's per-round work for `draft_ctx` when the caller computed it, else its own), compiled, with the
        lookahead row and padding."""
        tree = DraftTree.empty()
        self._q = None
        stale, lead = self._stale, self._lead_edge
        if self.draft_ctx is not None:
            assert self.proposer is not None
            ctx = self.draft_ctx if prepared is None else replace(self.draft_ctx, prepared=prepared)
            tree = self.proposer.propose(ctx)
            if lead is not None:
                tree = _under_lead(tree, lead, getattr(self.proposer, "budget", None))
            if self.rejection:
                src = self.stale_src
                assert src is not None
                self._q = proposal_probs(src, list(tree.pos), self.cfg.temperature, self.cfg.truncation)
                rng = torch.Generator().manual_seed(mix_seed("draft", self.seed, self.block, self.rounds))
                tree = sample_chain_tokens(tree, self._q, rng)
        self.draft_ctx = None
        self._fresh = False
        self._led = lead is not None
        self._tree = tree
        self._states = compile_states(self.state, tree)
        rows = self._plan_lookahead(self._states, stale) if self._can_look else self._states
        self._rows = max(rows.shape[0], self.cfg.pad_rows)  # the forward's rows, padding included
        self._t_forward = time.perf_counter()
        self._fwd_mark = self.clock.mark()
        pad = self.cfg.pad_rows - self._states.shape[0]
        if self.cfg.pad_rows and pad < 0:
            raise ValueError(f"a round drafted {tree.size} states: more than pad_rows={self.cfg.pad_rows} allows")
        return torch.cat([self._states, self._states[:1].expand(pad, -1)]) if pad > 0 else rows

    def _plan_lookahead(self, states: torch.Tensor, stale: Stale | None) -> torch.Tensor:
        """Pick this round's completion of the active block, if the round can finish it: the first state with the
        fewest masked slots, when at most one is left (the round's own transition commits one more), that last
        slot filled with the stale guess the drafters use. Returns the forward's rows (the completion appended
        when it is not a drafted state already)."""
        self.ahead_row, self._completion = None, None
        info = self.adapter.info
        if self.session.block_start + info.block_len >= self.gen_end:
            return states  # no next block inside the generation
        open_ = (states == info.mask_id) & self.window
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
        if any(int(t) in info.stop_ids for t in completion[self.window].tolist()):
            return states  # the generation ends in this block: nothing to look ahead to
        self.ahead_row, self._completion = row, completion
        return torch.cat([states, completion[None]]) if row == states.shape[0] else states

    def advance(self, logits: torch.Tensor, ahead: torch.Tensor | None = None) -> None:
        """Apply the round: logits [1 + D, L, V] of `next_states()`'s states, on the target's device, and the
        next block's lookahead logits [L, V] when the round asked for them (`ahead_row`)."""
        assert self._states is not None, "advance() without next_states()"
        info, cfg, dev = self.adapter.info, self.cfg, self.dev
        mask_id, tree, states = info.mask_id, self._tree, self._states
        logits = logits[: states.shape[0]]  # padding rows (batch invariance) carry nothing
        # The mask token is never a commit candidate: confidence and tokens are over real tokens only.
        logits[..., mask_id] = float("-inf")
        fwd_end = self.clock.mark()  # the forward's device time is read after the transitions' copy below
        node_eligible = (states == mask_id) & self.window
        # The eligibility on the device, from the state rows the adapter uploaded (no copy of its own).
        dstates = getattr(self.session, "device_states", None)
        if dstates is not None and dstates.shape[0] >= states.shape[0]:
            elig_dev = (dstates[: states.shape[0]] == mask_id) & self.window_dev
        else:
            elig_dev = upload(node_eligible, device=dev)[0]
        # NaN / inf anywhere in an eligible slot's row would pick its position and token silently: flag the rows.
        bad_rows = (~torch.isfinite(logits.amax(dim=-1)) & elig_dev).any(dim=-1)
        if self.rejection:
            rng = torch.Generator().manual_seed(mix_seed("verify", self.seed, self.block, self.rounds))
            q_rows = self._q if self._q is not None else logits.new_zeros(0, logits.shape[-1])
            path, fpos, ftok, bad = rejection_verify(tree, q_rows, logits, elig_dev, cfg.temperature, rng, self.link,
                                                     bad_rows, cfg.truncation)
            if bad:  # read in the verifier's one copy
                raise NonFiniteLogitsError(self.block, self.rounds)
            tpos = torch.full((1 + tree.size,), -1, dtype=torch.long)
            ttok = tpos.clone()
            for a, b in zip([0, *path], path, strict=False):
                tpos[a], ttok[a] = tree.pos[b - 1], tree.tok[b - 1]
            tpos[([0, *path])[-1]], ttok[([0, *path])[-1]] = fpos, ftok
        else:
            pos_d, tok_d = transition(logits, elig_dev, cfg.temperature, self.gumbel, cfg.truncation)
            # The flag rides in the positions (-2 marks a bad row); positions and tokens come back in one copy.
            tpos, ttok = self.link.pull(torch.where(bad_rows, torch.full_like(pos_d, -2), pos_d), tok_d)
            if bool((tpos == -2).any()):
                raise NonFiniteLogitsError(self.block, self.rounds)
            path = accepted_path(tree, tpos, ttok)
        nodes = [0, *path]
        # Feedback only on a tree the proposer made, in its own node numbering (under a lead edge: shifted by one).
        if self._led:
            self.prev_path = tuple(n - 1 for n in path[1:]) if path else ()
        else:
            self.prev_path = tuple(path) if self._asked else None
        if self.on_verify is not None:
            self.on_verify(self.block, tree, path, tpos, ttok)
        if self.observed is not None:
            for n in nodes:
                if int(tpos[n]) >= 0:
                    self.observed.add(self.block, states[n], node_eligible[n], logits[n], int(tpos[n]), int(ttok[n]))
        last = nodes[-1]
        ahead_row = self.ahead_row is not None
        left = int(((self.state == mask_id) & self.window).sum())
        self.state = states[last].clone()
        if int(tpos[last]) >= 0:
            self.state[int(tpos[last])] = int(ttok[last])
            self.committed += 1
        if int(((self.state == mask_id) & self.window).sum()) >= left:
            raise RuntimeError(f"decoding made no progress in block {self.block} (round {self.rounds}): the round "
                               f"left {left} masked slots masked (a target transition that commits nothing)")
        self.committed += len(path)
        self.rounds += 1
        self.drafted.append(tree.size)
        self.accepted.append(len(path))
        self.stale_src = logits[last]
        self._states = None
        if self.ahead_row is not None:
            if ahead is None:
                raise ValueError("the round asked for lookahead logits and got none")
            self.ahead.rows += 1
            if not bool(((self.state == mask_id) & self.window).any()):
                if torch.equal(self.state, self._completion):  # else they are conditioned on another block
                    self.ahead.exact += 1
                    ahead[..., mask_id] = float("-inf")  # as every round's logits (never a commit candidate)
                    self._carry = ahead
            self.ahead_row = self._completion = None
        t_end = time.perf_counter()
        # The forward's time between device marks (on a GPU: its kernels, read now that a copy has waited for
        # them); the rest of the round's wall time is the host's work around it.
        forward = self.clock.seconds(self._fwd_mark, fwd_end)
        draft = self._t_forward - self._t_round
        self.timing.add(draft=draft, forward=forward, rest=max(0.0, t_end - self._t_round - draft - forward))
        self._round_ahead = ahead_row
        if self.timed:
            self.prev_round = RoundRun(self._rows, 1000 * (t_end - self._t_round), ahead_row, self._pending)
        self._check_stop()

    def shared_round_ran(self, ms: float) -> None:
        """The round just applied ran in a forward shared with other requests: report it to the proposer as
        costing `ms` (the caller's measure: this request's own host work plus its rows' share of the forward),
        so a proposer that prices rows learns what a row costs in the batch's forward, not alone."""
        self.prev_round = RoundRun(self._rows, ms, self._round_ahead, self._pending)

    @property
    def rows(self) -> int:
        """Rows of the round in flight's forward (padding included)."""
        return self._rows

    def _check_stop(self) -> None:
        """Stops are read from the contiguous committed prefix: it is final, whatever the commit order."""
        mask_id = self.adapter.info.mask_id
        gen_slots = self.state[self.window]
        masked = gen_slots == mask_id
        first_mask = int(masked.nonzero()[0]) if bool(masked.any()) else None
        prefix = self.done_ids + gen_slots[:first_mask].tolist()
        if len(prefix) <= self.checked_len:
            return
        self.checked_len = len(prefix)
        # Whichever stop comes first in the id stream wins, however far this round moved the prefix: a speculative
        # round can pass a stop string and a later stop id at once, where control saw the string first.
        cut = _first_stop(prefix, self.adapter.info.stop_ids)
        head = prefix if cut is None else prefix[:cut]
        keep = self.stop_check(head) if self.stop_check is not None and head else None
        if keep is not None:
            self._finish(head[:keep], "until")
        elif cut is not None:
            self._finish(head, "eos")
        elif len(prefix) >= self.cfg.max_gen_toks:
            self._finish(prefix, "length")

    def _finish(self, ids: list[int], reason: str) -> None:
        if self.observed is not None:
            self.observed.flush()  # before the clock stops: the observers' work is part of the request's time
        self.result = DecodeResult(ids, reason, self.session.nfe, self.committed, self.rounds, self.drafted,
                                   self.accepted, time.perf_counter() - self.t0, self.link.bytes, self.timing,
                                   self.ahead, self.observed.seconds if self.observed is not None else 0.0)

