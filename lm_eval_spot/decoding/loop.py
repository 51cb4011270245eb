"""The block-decoding loop shared by draft-free (control) and speculative decoding.

Each round runs ONE target forward over the root state plus any drafted states, accepts the drafted path that
matches the target's own transitions, and applies one more transition from the deepest accepted node. With no
proposer this is exactly the draft-free decoder: one commit per forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from lm_eval_spot.adapters.base import NFECounter, TargetAdapter
from lm_eval_spot.decoding.noise import gumbel_rows, mix_seed
from lm_eval_spot.decoding.proposer import Proposer, RoundContext
from lm_eval_spot.decoding.stale import Stale, summarize
from lm_eval_spot.decoding.transfer import HostLink
from lm_eval_spot.decoding.rejection import proposal_probs, rejection_verify, sample_chain_tokens
from lm_eval_spot.decoding.transition import transition
from lm_eval_spot.decoding.tree import DraftTree, accepted_path, compile_states

# ids generated so far -> how many of them to keep if they contain a stop string, else None.
StopCheck = Callable[[list[int]], "int | None"]


@dataclass(frozen=True)
class DecodeConfig:
    max_gen_toks: int
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.max_gen_toks <= 0:
            raise ValueError(f"max_gen_toks must be a positive integer, got {self.max_gen_toks}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


class RoundObserver(Protocol):
    """Sees every commit with a summary of the target logits it was decided from (analysis, drafter data)."""

    def on_commit(
        self, block: int, state: torch.Tensor, eligible: torch.Tensor, stale: Stale, pos: int, tok: int
    ) -> None:
        """state/eligible [L] before the commit; `stale` summarises the target logits computed at that state."""
        ...

    # Optional: on_verify(block, tree, path, target_pos, target_tok) is called once per round when defined
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

    The round's arithmetic over the vocabulary (confidence, positions, tokens, the drafter's stale summaries)
    runs on the target's device; the host receives per round the R transitions and, when something drafts or
    observes, one state's per-slot summary (`HostLink` counts the bytes).
    """
    if verify not in ("coupled", "rejection"):
        raise ValueError(f"verify must be 'coupled' or 'rejection', got {verify!r}")
    rejection = verify == "rejection" and cfg.temperature > 0  # at T=0 both verifiers are the same greedy check
    t0 = time.perf_counter()
    info = adapter.info
    dev = adapter.device
    L, mask_id = info.block_len, info.mask_id
    session, tail = adapter.open(prompt_ids, cfg.max_gen_toks)
    link = HostLink()
    timing = RoundTiming()
    gen_start = len(prompt_ids)
    gen_end = gen_start + cfg.max_gen_toks
    slots = torch.arange(L)
    done_ids: list[int] = []  # generated ids of finished blocks
    committed = rounds = 0
    drafted: list[int] = []
    accepted: list[int] = []
    block = 0
    checked_len = 0
    prev_path: tuple[int, ...] | None = None
    on_verify = getattr(observer, "on_verify", None) if observer is not None else None

    def finish(ids: list[int], reason: str) -> DecodeResult:
        return DecodeResult(ids, reason, session.nfe, committed, rounds, drafted, accepted,
                            time.perf_counter() - t0, link.bytes, timing)

    while True:
        abs_pos = session.block_start + slots
        window = (abs_pos >= gen_start) & (abs_pos < gen_end)
        state = torch.full((L,), mask_id, dtype=torch.long)
        if block == 0 and tail:
            state[: len(tail)] = torch.tensor(tail, dtype=torch.long)
        # Drawn once per block, on the device (a pure function of (seed, block, position, token): no transfer).
        gumbel = gumbel_rows(seed, block, L, info.vocab_size, dev) if cfg.temperature > 0 else None
        stale_src: torch.Tensor | None = None  # [L, V] device logits of the deepest accepted node, last round
        stale: Stale | None = None
        while True:
            eligible = (state == mask_id) & window
            if not bool(eligible.any()):
                break
            tr = time.perf_counter()
            tree = DraftTree.empty()
            q = None
            # Rejection sampling drafts nothing in a block's first round (its proposal q needs stale conditionals).
            asked = proposer is not None and (not rejection or stale_src is not None)
            if proposer is not None and asked:
                # Under rejection, positions come from the proposer at T=0 (they never depend on sampled tokens)
                # and tokens are drawn from q.
                temp, noise = (0.0, None) if rejection else (cfg.temperature, gumbel)
                stale = summarize(stale_src[None], link, temp, noise)[0] if stale_src is not None else None
                tree = proposer.propose(
                    RoundContext(state, eligible, state != mask_id, stale, temp, noise, mask_id, block, prev_path)
                )
                if rejection:
                    assert stale_src is not None
                    q = proposal_probs(stale_src, list(tree.pos), cfg.temperature)
                    rng = torch.Generator().manual_seed(mix_seed("draft", seed, block, rounds))
                    tree = sample_chain_tokens(tree, q, rng)
            states = compile_states(state, tree)
            tf = time.perf_counter()
            logits = session.block_logits(states)
            # The mask token is never a commit candidate: confidence and tokens are over real tokens only.
            logits[..., mask_id] = float("-inf")
            _sync(dev)
            tv = time.perf_counter()
            node_eligible = (states == mask_id) & window
            if rejection:
                rng = torch.Generator().manual_seed(mix_seed("verify", seed, block, rounds))
                q_rows = q if q is not None else logits.new_zeros(0, logits.shape[-1])
                path, fpos, ftok = rejection_verify(tree, q_rows, logits, node_eligible.to(dev), cfg.temperature,
                                                    rng, link)
                tpos = torch.full((1 + tree.size,), -1, dtype=torch.long)
                ttok = tpos.clone()
                for a, b in zip([0, *path], path, strict=False):
                    tpos[a], ttok[a] = tree.pos[b - 1], tree.tok[b - 1]
                tpos[([0, *path])[-1]], ttok[([0, *path])[-1]] = fpos, ftok
            else:
                tpos, ttok = link.pull(*transition(logits, node_eligible.to(dev), cfg.temperature, gumbel))
                path = accepted_path(tree, tpos, ttok)
            nodes = [0, *path]
            prev_path = tuple(path) if asked else None  # feedback only on a tree the proposer made
            if on_verify is not None:
                on_verify(block, tree, path, tpos, ttok)
            if observer is not None:
                seen = [n for n in nodes if int(tpos[n]) >= 0]
                if seen:
                    views = summarize(logits[seen], link, cfg.temperature, gumbel)
                    for n, view in zip(seen, views, strict=True):
                        observer.on_commit(block, states[n], node_eligible[n], view, int(tpos[n]), int(ttok[n]))
            last = nodes[-1]
            left = int(eligible.sum())
            state = states[last].clone()
            if int(tpos[last]) >= 0:
                state[int(tpos[last])] = int(ttok[last])
                committed += 1
            if int(((state == mask_id) & window).sum()) >= left:
                raise RuntimeError(f"decoding made no progress in block {block} (round {rounds}): the round left "
                                   f"{left} masked slots masked (a target transition that commits nothing)")
            committed += len(path)
            rounds += 1
            drafted.append(tree.size)
            accepted.append(len(path))
            stale_src = logits[last]
            te = time.perf_counter()
            timing.add(draft=tf - tr, forward=tv - tf, rest=te - tv)
            # Stops are read from the contiguous committed prefix: it is final, whatever the commit order.
            gen_slots = state[window]
            first_mask = int((gen_slots == mask_id).nonzero()[0]) if bool((gen_slots == mask_id).any()) else None
            prefix = done_ids + gen_slots[:first_mask].tolist()
            if len(prefix) > checked_len:
                checked_len = len(prefix)
                cut = _first_stop(prefix, info.stop_ids)
                if cut is not None:
                    return finish(prefix[:cut], "eos")
                keep = stop_check(prefix) if stop_check is not None else None
                if keep is not None:
                    return finish(prefix[:keep], "until")
                if len(prefix) >= cfg.max_gen_toks:
                    return finish(prefix, "length")
        done_ids.extend(state[window].tolist())
        session.commit_block(state)
        block += 1


def _sync(device: torch.device) -> None:
    """Wait for queued kernels, so the forward's time is not billed to the verification after it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

