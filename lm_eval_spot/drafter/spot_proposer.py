"""Draft trees by prefix mass over an order source: SPOT's learned order model or stale confidence.

Prefix mass of a node = product along its path of (order probability of the slot) x (stale probability of the
token). The search itself is `best_first.grow_best_first`; this module supplies its order sources and turns the
selected candidates into a `DraftTree`.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from lm_eval_spot.decoding.proposer import RoundContext, token_hypotheses
from lm_eval_spot.decoding.tree import DraftTree
from lm_eval_spot.drafter.best_first import More, Paths, grow_best_first
from lm_eval_spot.drafter.factored import FactoredOrderModel, HostTables
from lm_eval_spot.drafter.host import HostEncoder
from lm_eval_spot.drafter.model import DrafterModel


@dataclass(frozen=True)
class TreeConfig:
    budget: int  # D: drafted states verified per round (at most)
    gamma: float = 0.0  # mass floor: candidates below it are dropped (SPOT-gamma); 0 keeps every candidate
    hedge_below: float = 0.6  # T=0: also draft the stale runner-up token when the top-1 probability is below this
    chain: bool = False  # grow a single path (the tree ablation)

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if not 0.0 <= self.gamma < 1.0:
            raise ValueError(f"gamma must be in [0, 1), got {self.gamma}")


class OrderSource(Protocol):
    """Next-commit distributions over still-masked slots of hypothetical states, from stale conditionals only."""

    def prepare(self, ctx: RoundContext) -> Any:
        """The round's once-per-round work, shared by every node of the round (`RoundContext.prepared`)."""
        ...

    def prepare_many(self, ctxs: Sequence[RoundContext]) -> list[Any]:
        """`prepare` for several requests' rounds at once (one stacked pass where the source has one)."""
        ...

    def paths(self, prepared: Any, ctx: RoundContext) -> Paths:
        """The round's tree as the search walks it (`best_first.Paths`), from `prepare`'s work."""
        ...


class LearnedOrder:
    """SPOT: a trained commit-order model (either architecture: `model.OrderModel` or the factored one).

    A factored model on the CPU runs from a numpy snapshot of its weights (`host.HostEncoder`, taken here and
    retaken by `refresh` after online adaptation moved the weights, between rounds), and its per-round tables
    stay numpy (`HostTables`)."""

    def __init__(self, model: DrafterModel) -> None:
        self.model = model.eval()
        self.host: HostEncoder | None = None
        self.refresh()

    def refresh(self) -> None:
        """Take the host snapshot of the model's current weights (none when the model sits on an accelerator)."""
        on_cpu = isinstance(self.model, FactoredOrderModel) and self.model.device.type == "cpu"
        self.host = HostEncoder.of(self.model) if on_cpu else None

    def prepare(self, ctx: RoundContext) -> Any:
        """The round's once-per-round work (what `budget=auto` times as the drafter's fixed cost)."""
        assert ctx.stale is not None
        if self.host is not None:
            return self.host.prepare(ctx.stale, ctx.committed_before, ctx.eligible)
        # The model may sit on an accelerator (next to the target); the tree logic stays on the CPU.
        return self.model.prepare(ctx.stale, ctx.committed_before, ctx.eligible)

    def prepare_many(self, ctxs: Sequence[RoundContext]) -> list[Any]:
        """`prepare` for several requests' rounds: one stacked numpy pass on the CPU path."""
        if self.host is not None and len({int(c.state.shape[0]) for c in ctxs}) == 1:
            return list(self.host.prepare_many([(c.stale, c.committed_before, c.eligible) for c in ctxs]))
        return [self.prepare(c) for c in ctxs]

    def paths(self, prepared: Any, ctx: RoundContext) -> Paths:
        return prepared if isinstance(prepared, HostTables) else DepthMapPaths(self, prepared, ctx)

    def probs(self, prepared: Any, ctx: RoundContext, depth_maps: torch.Tensor) -> torch.Tensor:
        """depth_maps [N, L] (0 = not on the path, d = committed at path depth d) -> [N, L] probabilities."""
        return self.node_probs(prepared, depth_maps)

    def node_probs(self, prepared: Any, depth_maps: torch.Tensor) -> torch.Tensor:
        if isinstance(prepared, HostTables):
            return torch.from_numpy(prepared.node_probs(depth_maps.numpy()))
        return self.model.node_probs(prepared, depth_maps)



class StaleConfidenceOrder:
    """Training-free: slots ranked by stale clean confidence max_v p(v), renormalised over what is left."""

    def prepare(self, ctx: RoundContext) -> ConfidencePaths:
        assert ctx.stale is not None
        return ConfidencePaths(ctx.stale.confidence, ctx.eligible & ~ctx.committed_before)

    def prepare_many(self, ctxs: Sequence[RoundContext]) -> list[ConfidencePaths]:
        return [self.prepare(c) for c in ctxs]

    def paths(self, prepared: ConfidencePaths, ctx: RoundContext) -> Paths:
        return prepared


class ConfidencePaths:
    """`Paths` for stale confidence: a node is its still-open slots; the next commit goes to one of them with
    probability proportional to its stale confidence. The normaliser is torch's row sum over all L slots (zeros
    where closed), the sum the baselines' trees were defined with, so their masses (and ties) stay bit for bit."""

    def __init__(self, confidence: torch.Tensor, open_: torch.Tensor) -> None:
        self.conf = confidence.float().numpy()
        self.open = np.flatnonzero(open_.numpy())

    def root(self) -> np.ndarray:
        return self.open

    def child(self, node: np.ndarray, slot: int, depth: int) -> np.ndarray:
        return node[node != slot]

    def slot_probs(self, node: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
        w = np.zeros((1, self.conf.shape[0]), dtype=np.float32)
        w[0, node] = self.conf[node]
        wt = torch.from_numpy(w)
        return node, (wt / wt.sum(dim=-1, keepdim=True).clamp_min(1e-30))[0].numpy()[node]


@dataclass(frozen=True)
class GrownTree:
    """A proposed tree with each node's prefix mass and depth (tree order, root excluded)."""

    tree: DraftTree
    mass: tuple[float, ...] = ()
    depth: tuple[int, ...] = ()


class DepthMapPaths:
    """`Paths` over a learned order model that scores depth maps (off the CPU, or the per-node architecture): a
    node is its depth map, each expansion one `LearnedOrder.probs` call on it."""

    def __init__(self, order: LearnedOrder, prepared: Any, ctx: RoundContext) -> None:
        self.order, self.prepared, self.ctx = order, prepared, ctx
        self.slots = np.arange(int(ctx.state.shape[0]))

    def root(self) -> np.ndarray:
        return np.zeros(self.slots.shape[0], dtype=np.int64)

    def child(self, node: np.ndarray, slot: int, depth: int) -> np.ndarray:
        out = node.copy()
        out[slot] = depth
        return out

    def slot_probs(self, node: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
        return self.slots, self.order.probs(self.prepared, self.ctx, torch.from_numpy(node[None]))[0].numpy()


class TreeProposer:
    """The best-first tree (`best_first.grow_best_first`) over an order source's `Paths`."""

    def __init__(self, order: OrderSource, cfg: TreeConfig) -> None:
        self.order = order
        self.cfg = cfg

    @property
    def budget(self) -> int:
        return self.cfg.budget

    def prepare_many(self, ctxs: Sequence[RoundContext]) -> list[Any]:
        """The order source's per-round work for several requests' rounds (`RoundContext.prepared`)."""
        return self.order.prepare_many(ctxs)

    def propose(self, ctx: RoundContext) -> DraftTree:
        return self.grow(ctx).tree

    def grow(self, ctx: RoundContext) -> GrownTree:
        if ctx.stale is None:
            return GrownTree(DraftTree.empty())  # a block's first round: no stale conditionals to draft from
        prepared = ctx.prepared if ctx.prepared is not None else self.order.prepare(ctx)
        paths = self.order.paths(prepared, ctx)
        hyp_tok, hyp_p = token_hypotheses(ctx, self.cfg.hedge_below)
        budget = self.cfg.budget if ctx.budget is None else min(self.cfg.budget, ctx.budget)
        chosen, cand = grow_best_first(paths, hyp_tok.numpy(), hyp_p.double().numpy(), int(ctx.eligible.sum()),
                                       budget, self.cfg.gamma, self.cfg.chain, self._size())
        chosen = self._finish(chosen, cand.mass, cand.depth)
        tree, nodes = self._as_tree(chosen, cand.parent, cand.pos, cand.tok, cand.depth, cand.order)
        return GrownTree(tree, tuple(cand.mass[c] for c in nodes), tuple(cand.depth[c] for c in nodes))

    # Hooks for a proposer that sizes the tree per round (budget=auto); fixed budgets grow to the budget.
    def _size(self) -> More | None:
        """The search's stopping rule for this round (None: grow to the budget)."""
        return None

    def _finish(self, selected: list[int], mass: list[float], depth: list[int]) -> list[int]:
        """The final cut of `selected` (mass order, parents before children: every prefix is a tree)."""
        return selected

    @staticmethod
    def _as_tree(
        selected: list[int], parent: list[int], pos: list[int], tok: list[int], depth: list[int],
        made: Sequence[Any],
    ) -> tuple[DraftTree, list[int]]:
        """The tree, and the candidate behind each of its nodes (in tree order: by depth, then creation order
        `made`, a key per candidate)."""
        keep = set(selected)
        ordered = sorted((c for c in selected if parent[c] == -1 or parent[c] in keep), key=lambda c: (depth[c], made[c]))
        index = {-1: 0}
        out_parent, out_pos, out_tok, nodes = [], [], [], []
        picked = {c: k for k, c in enumerate(selected)}  # selection order: best first
        for c in ordered:
            if parent[c] not in index:
                continue  # its parent fell out of the budget (only possible on exact mass ties)
            index[c] = len(out_parent) + 1
            out_parent.append(index[parent[c]])
            out_pos.append(pos[c])
            out_tok.append(tok[c])
            nodes.append(c)
        by_rank = sorted(range(len(nodes)), key=lambda j: picked[nodes[j]])
        rank = [0] * len(nodes)
        for r, j in enumerate(by_rank, start=1):
            rank[j] = r
        return DraftTree(tuple(out_parent), tuple(out_pos), tuple(out_tok), tuple(rank)), nodes
