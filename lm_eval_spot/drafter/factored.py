"""The factored commit-order model: one encoder pass per round, path effects as cheap additive terms.

The per-node order model (`model.OrderModel`) runs its transformer once per tree node, so a D-node tree costs
about D encoder passes -- as much as the verification forward itself when the target is small. This model
reads the same inputs (stale top-k probabilities, slot status, path, slot index) but splits them:

- per round, once: a transformer encodes every slot of the ROOT state from the stale conditionals, plus two
  precise confidence features float16 storage would lose (log(1 - top-1 probability), and the slot's rank by
  the target's own float32 confidence with its lowest-slot tie-break);
- per node, from the encoding: logit_i = a_i + sum_{j on path} P_ij + Q_i,last + C_i,|path|, where P says how
  committing slot j moves slot i, Q how the most recent commit does, and C how the path's length does
  (stale conditionals age along the path). These are [L, L] and [L, depth] tables, so a node costs a gather
  and a sum instead of an encoder pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from lm_eval_spot.decoding.stale import Stale
from lm_eval_spot.drafter.encoder import encode
from lm_eval_spot.drafter.features import COMMITTED, INACTIVE, MASKED, TOP_K

FACTORED_FEATURE_VERSION = 2
LOG1M_SCALE = 10.0  # -log(1 - p1) spans ~0..30 nats on confident targets; scaled to ~0..3


@dataclass(frozen=True)
class FactoredConfig:
    d_model: int = 128
    n_heads: int = 8
    n_layers: int = 3
    d_ff: int = 448  # with the pair tables this keeps the model at the paper's ~0.62M parameters
    d_pair: int = 64
    max_path: int = 32  # path lengths beyond this share one length bias
    top_k: int = TOP_K
    max_block_len: int = 64
    dropout: float = 0.0
    slot_embedding: bool = True  # False: the model cannot tell slots apart by index (a transfer ablation)
    # Where a slot stands as a fraction of its block (and the block's length), not by index: the same inputs mean
    # the same thing at every block length, so one model serves blocks of 4 to 64 (the transfer drafter).
    relative_slots: bool = False
    arch: str = "factored"


@dataclass(frozen=True)
class RoundTables:
    """The per-round encoding, batched over B rounds (B = 1 at inference)."""

    base: torch.Tensor  # [B, L]
    pair: torch.Tensor  # [B, L, L]: effect on slot i (row) of slot j (column) being on the path
    last: torch.Tensor  # [B, L, L]: effect on slot i of slot j being the most recent path commit
    length: torch.Tensor  # [B, L, max_path + 1]: effect on slot i of the path's length
    candidate: torch.Tensor  # [B, L] bool: masked and eligible at the root
    host: HostTables | None = None  # numpy copies for drafting on the CPU (B = 1)


@dataclass(frozen=True)
class HostTables:
    """One round's tables as numpy arrays, laid out for row gathers: the tree search's `Paths` on the CPU (a
    node's logits are its parent's plus a few [L] rows). Drafting touches a handful of nodes per round; numpy's
    per-call overhead is a fraction of torch's, which dominates there."""

    base: np.ndarray  # [L]
    pair_t: np.ndarray  # [L (j), L (i)]
    last_t: np.ndarray  # [L (j), L (i)]
    length_t: np.ndarray  # [max_path + 1, L]
    candidate: np.ndarray  # [L] bool

    @staticmethod
    def of(t: RoundTables) -> HostTables:
        return HostTables(t.base[0].numpy(), t.pair[0].T.contiguous().numpy(), t.last[0].T.contiguous().numpy(),
                          t.length[0].T.contiguous().numpy(), t.candidate[0].numpy())

    # A node: (base + the path's summed pair rows [L], its candidate slots ascending, its last commit or -1).
    def root(self) -> tuple[np.ndarray, np.ndarray, int]:
        return self.base.astype(np.float32), np.flatnonzero(self.candidate), -1

    def child(self, node: tuple[np.ndarray, np.ndarray, int], slot: int, depth: int) -> tuple[np.ndarray, np.ndarray, int]:
        pair, open_, _ = node
        return pair + self.pair_t[slot], open_[open_ != slot], slot

    def slot_probs(self, node: tuple[np.ndarray, np.ndarray, int], depth: int) -> tuple[np.ndarray, np.ndarray]:
        """The factored model's node distribution (`FactoredOrderModel.node_logits`), over the candidate slots."""
        pair, open_, last = node
        if not open_.size:
            return open_, np.zeros(0, dtype=np.float32)
        logits = (pair[open_] + self.last_t[last, open_]) if last >= 0 else pair[open_]
        logits += self.length_t[min(depth, self.length_t.shape[0] - 1), open_]
        e = np.exp(logits - logits.max())
        return open_, e / e.sum()

    def node_probs(self, depth_maps: np.ndarray) -> np.ndarray:
        """depth_maps [N, L] (d = committed at path depth d) -> [N, L]: each path walked through `child`."""
        out = np.zeros(depth_maps.shape, dtype=np.float32)
        for row, dm in enumerate(depth_maps):
            node = self.root()
            on = np.flatnonzero(dm > 0)
            for d, slot in enumerate(on[np.argsort(dm[on], kind="stable")].tolist(), start=1):
                node = self.child(node, slot, d)
            slots, q = self.slot_probs(node, len(on))
            out[row, slots] = q
        return out


def relative_slot_features(L: int, device: torch.device | None = None) -> torch.Tensor:
    """[L, 2]: the slot's place in its block as a fraction (0 first, 1 last) and log2 of the block length / 6."""
    frac = torch.arange(L, dtype=torch.float32, device=device) / max(1, L - 1)
    return torch.stack([frac, torch.full_like(frac, math.log2(L) / 6.0)], dim=-1)


def round_inputs(
    topk: torch.Tensor, conf: torch.Tensor, log1m: torch.Tensor, committed: torch.Tensor, eligible: torch.Tensor,
    rank_pad: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-slot inputs of the root state. topk [..., L, k] (float16-rounded probabilities), conf/log1m [..., L]
    float32 (the stale forward's), committed/eligible [..., L] -> (features [..., L, 2k+1], rank, status)."""
    p = topk.float()
    feat = torch.cat([p, torch.log(p.clamp_min(1e-9)), (-log1m).clamp(0.0, 30.0).unsqueeze(-1) / LOG1M_SCALE], -1)
    # The target commits the most confident eligible slot, lowest slot on ties: rank exactly as it would.
    key = conf.masked_fill(~eligible, -1.0)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    ar = torch.arange(key.shape[-1], device=key.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, ar).masked_fill(~eligible, rank_pad)
    status = torch.full_like(rank, INACTIVE)
    status[eligible] = MASKED
    status[committed] = COMMITTED
    return feat, rank, status


class FactoredOrderModel(nn.Module):
    def __init__(self, cfg: FactoredConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.inp = nn.Linear(2 * cfg.top_k + 1, d)
        self.status = nn.Embedding(4, d)
        self.slot = nn.Embedding(cfg.max_block_len, d)
        self.rank = nn.Embedding(cfg.max_block_len + 1, d)
        if cfg.relative_slots:  # only then: older checkpoints' state dicts stay loadable as they are
            self.rel = nn.Linear(2, d)
        layer = nn.TransformerEncoderLayer(d, cfg.n_heads, cfg.d_ff, cfg.dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.base = nn.Linear(d, 1)
        self.pairs = nn.Linear(d, 4 * cfg.d_pair)
        self.by_length = nn.Linear(d, cfg.max_path + 1)

    @property
    def device(self) -> torch.device:
        return self.base.weight.device

    def tables(self, feat: torch.Tensor, rank: torch.Tensor, status: torch.Tensor) -> RoundTables:
        """[B, L, 2k+1], [B, L], [B, L] -> the round's tables."""
        L = status.shape[-1]
        x = self.inp(feat) + self.status(status) + self.rank(rank)
        if self.cfg.slot_embedding:
            x = x + self.slot(torch.arange(L, device=status.device))
        if self.cfg.relative_slots:
            x = x + self.rel(relative_slot_features(L, status.device))
        h = self.norm(self.encoder(x) if self.training else encode(self.encoder, x))
        q1, k1, q2, k2 = self.pairs(h).chunk(4, dim=-1)
        scale = self.cfg.d_pair**-0.5
        return RoundTables(
            base=self.base(h).squeeze(-1),
            pair=q1 @ k1.transpose(-1, -2) * scale,
            last=q2 @ k2.transpose(-1, -2) * scale,
            length=self.by_length(h),
            candidate=status == MASKED,
        )

    def node_logits(self, t: RoundTables, on_path: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Logits over slots for K nodes per round: on_path [B, K, L] bool, last [B, K] (slot of the most
        recent path commit, -1 at the root) -> [B, K, L], -inf where the slot is not a candidate."""
        B, K, L = on_path.shape
        logits = t.base.unsqueeze(1) + on_path.to(t.pair.dtype) @ t.pair.transpose(-1, -2)
        has_last = last >= 0
        idx = last.clamp_min(0).unsqueeze(-1).expand(B, K, L)
        logits = logits + torch.gather(t.last.transpose(-1, -2), 1, idx) * has_last.unsqueeze(-1)
        plen = on_path.sum(-1).clamp_max(self.cfg.max_path).unsqueeze(-1).expand(B, K, L)
        logits = logits + torch.gather(t.length.transpose(-1, -2), 1, plen)
        cand = t.candidate.unsqueeze(1) & ~on_path
        return logits.masked_fill(~cand, float("-inf"))

    # The interface the tree proposer and the cost measurement use (shared with model.OrderModel).
    @torch.no_grad()
    def prepare(self, stale: Stale, committed: torch.Tensor, eligible: torch.Tensor) -> RoundTables:
        """The stale summary and the root's [L] masks -> the round's tables (on the model's device)."""
        dev = self.device
        # The same summary the trajectory recorder stores, so inputs match training bit for bit; top-k is rounded
        # to float16 as trajectories store it.
        topk = stale.topk[:, : self.cfg.top_k].to(dev).half().float()
        feat, rank, status = round_inputs(topk, stale.confidence.to(dev), stale.log1m.to(dev), committed.to(dev),
                                          eligible.to(dev), self.cfg.max_block_len)
        t = self.tables(feat[None], rank[None], status[None])
        return replace(t, host=HostTables.of(t)) if dev.type == "cpu" else t

    @torch.no_grad()
    def node_probs(self, prep: RoundTables, depth_maps: torch.Tensor) -> torch.Tensor:
        """depth_maps [N, L] (0 = not on the path, d = committed at path depth d) -> [N, L] probabilities (CPU)."""
        if prep.host is not None:
            return torch.from_numpy(prep.host.node_probs(depth_maps.numpy()))
        dm = depth_maps.to(self.device)
        on = dm > 0
        last = torch.where(on.any(-1), dm.argmax(-1), -1)
        logits = self.node_logits(prep, on[None], last[None])[0]
        return torch.softmax(logits, dim=-1).nan_to_num(0.0).cpu()  # a node with no candidate slot: all zeros
