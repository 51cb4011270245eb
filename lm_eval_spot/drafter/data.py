"""Drafter training data: control trajectories (T=0) stored compactly, and prefix-replay examples built from them.

A trajectory round j of a block holds the state s_j's status, the target's top-k probabilities l_j at s_j and
the commit c_j. At inference the drafter at root s_r reads l_{r-1} (one commit stale) and drafts c_r, c_r+1, ...
so an example (r, k) replays c_r..c_{r+k-1} as a hypothetical path over l_{r-1} held fixed, labelled pos_{r+k}.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lm_eval_spot.decoding.observe import CommitBatch
from lm_eval_spot.drafter.features import TOP_K, node_status, prob_features


@dataclass
class Trajectories:
    """Rounds of many blocks, concatenated. R rounds, L slots, k = top-k."""

    topk: torch.Tensor  # [R, L, k] float16: target probabilities at the round's state, sorted
    conf: torch.Tensor  # [R, L] float32: clean confidence exactly as the transition computes it (ranks and ties)
    log1m: torch.Tensor  # [R, L] float32: log(1 - top-1 probability), precise where float16 p rounds to 1
    top1: torch.Tensor  # [R, L] int32: the target's argmax token per slot at that state
    committed: torch.Tensor  # [R, L] bool: slots holding a token at the round's state
    eligible: torch.Tensor  # [R, L] bool: masked slots inside the generation window
    pos: torch.Tensor  # [R] int64: slot committed this round
    tok: torch.Tensor  # [R] int64: token committed
    block_id: torch.Tensor  # [R] int64: a running id per (sample, block); rounds of one block are contiguous
    sample_id: torch.Tensor  # [R] int64

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.contiguous() for k, v in vars(self).items()}

    @staticmethod
    def from_dict(d: dict[str, torch.Tensor]) -> Trajectories:
        missing = [k for k in Trajectories.__dataclass_fields__ if k not in d]
        if missing:
            raise ValueError(f"trajectory shard lacks {missing} (written by an older version): collect again")
        return Trajectories(**{k: d[k] for k in Trajectories.__dataclass_fields__})

    @staticmethod
    def concat(parts: list[Trajectories]) -> Trajectories:
        return Trajectories(**{k: torch.cat([getattr(p, k) for p in parts]) for k in Trajectories.__dataclass_fields__})


def save_tensors_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors, written to a temporary name and renamed: a kill mid-write never leaves half a shard."""
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


class TrajectoryRecorder:
    """Decoder observer that records one request's rounds (every commit with the logits it came from)."""

    def __init__(self, sample_id: int, block_offset: int, top_k: int = TOP_K) -> None:
        self.sample_id, self.block_offset, self.top_k = sample_id, block_offset, top_k
        self.batches: list[CommitBatch] = []

    def on_commits(self, batch: CommitBatch) -> None:
        # Kept as given (no per-commit ops: on small targets they cost as much as a forward's share); the batch's
        # tensors are its own. Converted once, in `result`.
        self.batches.append(batch)

    def on_commit(self, block, state, eligible, stale, pos, tok) -> None:
        self.on_commits(CommitBatch([block], state[None], eligible[None], stale.topk[None], stale.top_ids[None],
                                    stale.log1m[None], [pos], [tok]))

    def result(self, mask_id: int) -> Trajectories | None:
        bs = [b for b in self.batches if len(b)]
        if not bs:
            return None
        topk = torch.cat([b.topk[..., : self.top_k] for b in bs])
        block = [x for b in bs for x in b.block]
        return Trajectories(
            topk=topk.half(),
            conf=topk[..., 0].float(),
            log1m=torch.cat([b.log1m for b in bs]).float(),
            top1=torch.cat([b.top_ids[..., 0] for b in bs]).int(),
            committed=torch.cat([b.state for b in bs]) != mask_id,
            eligible=torch.cat([b.eligible for b in bs]),
            pos=torch.tensor([x for b in bs for x in b.pos], dtype=torch.long),
            tok=torch.tensor([x for b in bs for x in b.tok], dtype=torch.long),
            block_id=torch.tensor(block, dtype=torch.long) + self.block_offset,
            sample_id=torch.full((len(block),), self.sample_id, dtype=torch.long),
        )


def block_bounds(traj: Trajectories) -> tuple[torch.Tensor, torch.Tensor]:
    """Per round: index of its block's first and last round. [R], [R]."""
    blk = traj.block_id
    R = blk.shape[0]
    idx = torch.arange(R)
    starts = torch.ones(R, dtype=torch.bool)
    starts[1:] = blk[1:] != blk[:-1]
    ends = torch.ones(R, dtype=torch.bool)
    ends[:-1] = blk[1:] != blk[:-1]
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), 0).values
    last = torch.flip(torch.cummin(torch.flip(torch.where(ends, idx, torch.full_like(idx, R)), [0]), 0).values, [0])
    return first, last


def replay_examples(traj: Trajectories, max_depth: int) -> torch.Tensor:
    """All (r, k) pairs: [E, 2] long. r >= 1 within its block (a stale round exists), r + k < block's end."""
    block_start, block_end = block_bounds(traj)
    idx = torch.arange(len(block_start))
    out = []
    for k in range(max_depth):
        ok = (idx > block_start) & (idx + k <= block_end)
        r = idx[ok]
        out.append(torch.stack([r, torch.full_like(r, k)], 1))
    return torch.cat(out)


@dataclass(frozen=True)
class Batch:
    feat: torch.Tensor  # [B, L, 2k]
    status: torch.Tensor  # [B, L]
    depth: torch.Tensor  # [B, L]
    label: torch.Tensor  # [B]
    stale_conf: torch.Tensor  # [B, L] stale top-1 probability (for the confidence-order baseline)


def make_batch(traj: Trajectories, ex: torch.Tensor) -> Batch:
    """ex [B, 2] (r, k) -> model inputs. Stale = round r-1's probabilities, root = round r's status."""
    r, k = ex[:, 0], ex[:, 1]
    B, L = r.shape[0], traj.committed.shape[1]
    depth = torch.zeros(B, L, dtype=torch.long)
    rows = torch.arange(B)
    for i in range(int(k.max()) + 1 if B else 0):
        on = i < k
        depth[rows[on], traj.pos[r[on] + i]] = i + 1
    status = node_status(traj.committed[r], traj.eligible[r], depth)
    stale = traj.topk[r - 1].float()
    return Batch(prob_features(stale), status, depth, traj.pos[r + k], stale[..., 0])


def draftable_rounds(traj: Trajectories) -> torch.Tensor:
    """Rounds with a stale round before them in the same block (a block's first round drafts nothing)."""
    first, _ = block_bounds(traj)
    return torch.nonzero(torch.arange(len(first)) > first).squeeze(-1)


@dataclass(frozen=True)
class RoundBatch:
    """B roots, each with its K replayed prefixes (k = 0..K-1 true commits): the factored model's batch."""

    feat: torch.Tensor  # [B, L, 2k+1]
    rank: torch.Tensor  # [B, L]
    status: torch.Tensor  # [B, L] root status
    on_path: torch.Tensor  # [B, K, L] bool
    last: torch.Tensor  # [B, K] slot of the last replayed commit, -1 for k = 0
    label: torch.Tensor  # [B, K] the next true commit
    valid: torch.Tensor  # [B, K] bool: r + k inside the block
    stale_conf: torch.Tensor  # [B, L] float32 stale confidence (the confidence-order baseline)
    eligible: torch.Tensor  # [B, L]


def make_round_batch(traj: Trajectories, rounds: torch.Tensor, max_depth: int, rank_pad: int,
                     top_k: int | None = None) -> RoundBatch:
    """rounds [B] (draftable) -> every replay depth k < max_depth of each, stale = round r-1 held fixed."""
    from lm_eval_spot.drafter.factored import round_inputs

    _, block_last = block_bounds(traj)
    r = rounds
    K = max_depth
    steps = r[:, None] + torch.arange(K)[None]  # round of the k-th replayed commit
    valid = steps <= block_last[r][:, None]
    pos = traj.pos[steps.clamp_max(len(traj.pos) - 1)]
    L = traj.committed.shape[1]
    onehot = torch.nn.functional.one_hot(pos, L).bool() & valid[..., None]
    on_path = torch.zeros_like(onehot)
    on_path[:, 1:] = onehot.cumsum(1)[:, :-1] > 0
    last = torch.full_like(pos, -1)
    last[:, 1:] = pos[:, :-1]
    # top_k: the model's own (at most what trajectories store); None reads all of them.
    feat, rank, status = round_inputs(traj.topk[r - 1, :, :top_k], traj.conf[r - 1], traj.log1m[r - 1],
                                      traj.committed[r], traj.eligible[r], rank_pad)
    return RoundBatch(feat, rank, status, on_path, last, pos, valid, traj.conf[r - 1], traj.eligible[r])
