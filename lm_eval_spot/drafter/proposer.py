"""Best-first draft trees by prefix mass, over any order source: SPOT's learned order model or stale confidence.

Prefix mass of a node = product along its path of (order probability of the slot) x (stale probability of the
token). A child's mass never exceeds its parent's, so expanding level by level -- each level one batched
order-source call over every newly selected node -- reaches the same top-D set as sequential best-first search.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from lm_eval_spot.decoding.proposer import RoundContext, token_hypotheses
from lm_eval_spot.decoding.tree import DraftTree
from lm_eval_spot.decoding.stale import Stale
from lm_eval_spot.drafter.best_first import More, grow_best_first
from lm_eval_spot.drafter.factored import FactoredOrderModel, HostTables
from lm_eval_spot.drafter.features import MASKED, node_status
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

    def begin(self, ctx: RoundContext) -> Any:
        """Per-round work shared by every node of the round."""
        ...

    def probs(self, prep: Any, ctx: RoundContext, depth_maps: torch.Tensor) -> torch.Tensor:
        """depth_maps [N, L] (0 = not on the path, d = committed at path depth d) -> [N, L] probabilities."""
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

    def begin(self, ctx: RoundContext) -> Any:
        assert ctx.stale is not None
        return self.prepare(ctx.stale, ctx.committed_before, ctx.eligible)

    def probs(self, prep: Any, ctx: RoundContext, depth_maps: torch.Tensor) -> torch.Tensor:
        return self.node_probs(prep, depth_maps)

    def prepare(self, stale: Stale, committed: torch.Tensor, eligible: torch.Tensor) -> Any:
        """The round's once-per-round work (what `budget=auto` times as the drafter's fixed cost)."""
        if self.host is not None:
            return self.host.prepare(stale, committed, eligible)
        # The model may sit on an accelerator (next to the target); the tree logic stays on the CPU.
        return self.model.prepare(stale, committed, eligible)

    def prepare_many(self, ctxs: Sequence[RoundContext]) -> list[Any]:
        """`begin` for several requests' rounds: one stacked numpy pass on the CPU path."""
        if self.host is not None and len({int(c.state.shape[0]) for c in ctxs}) == 1:
            return list(self.host.prepare_many([(c.stale, c.committed_before, c.eligible) for c in ctxs]))
        return [self.begin(c) for c in ctxs]

    def node_probs(self, prep: Any, depth_maps: torch.Tensor) -> torch.Tensor:
        if isinstance(prep, HostTables):
            return torch.from_numpy(prep.node_probs(depth_maps.numpy()))
        return self.model.node_probs(prep, depth_maps)


@runtime_checkable
class PreparesMany(Protocol):
    """An order source whose per-round work runs for several requests' rounds at once."""

    def prepare_many(self, ctxs: Sequence[RoundContext]) -> list[Any]: ...


class StaleConfidenceOrder:
    """Training-free: slots ranked by stale clean confidence max_v p(v), renormalised over what is left."""

    def begin(self, ctx: RoundContext) -> torch.Tensor:
        assert ctx.stale is not None
        return ctx.stale.confidence

    def probs(self, prep: torch.Tensor, ctx: RoundContext, depth_maps: torch.Tensor) -> torch.Tensor:
        status = node_status(ctx.committed_before, ctx.eligible, depth_maps)
        w = prep.unsqueeze(0) * (status == MASKED)
        return w / w.sum(dim=-1, keepdim=True).clamp_min(1e-30)


@dataclass(frozen=True)
class GrownTree:
    """A proposed tree with each node's prefix mass and depth (tree order, root excluded)."""

    tree: DraftTree
    mass: tuple[float, ...] = ()
    depth: tuple[int, ...] = ()


class TreeProposer:
    # With host tables (a factored order model on the CPU) the tree grows node by node (`best_first`): the same
    # tree as the level-wise search, at a fraction of its host work. Other order sources grow level by level.
    levelwise = False

    def __init__(self, order: OrderSource, cfg: TreeConfig) -> None:
        self.order = order
        self.cfg = cfg

    @property
    def budget(self) -> int:
        return self.cfg.budget

    def prepare_many(self, ctxs: Sequence[RoundContext]) -> list[Any]:
        """The order source's per-round work for several requests' rounds (`RoundContext.prepared`)."""
        if isinstance(self.order, PreparesMany):
            return self.order.prepare_many(ctxs)
        return [self.order.begin(c) for c in ctxs]

    def propose(self, ctx: RoundContext) -> DraftTree:
        return self.grow(ctx).tree

    def grow(self, ctx: RoundContext) -> GrownTree:
        if ctx.stale is None:
            return GrownTree(DraftTree.empty())  # a block's first round: no stale conditionals to draft from
        D = self.cfg.budget
        L = ctx.state.shape[0]
        prep = ctx.prepared if ctx.prepared is not None else self.order.begin(ctx)
        hyp_tok_t, hyp_p_t = token_hypotheses(ctx, self.cfg.hedge_below)
        n_elig = int(ctx.eligible.sum())
        if isinstance(prep, HostTables) and not self.levelwise:
            chosen, cand = grow_best_first(prep, hyp_tok_t.numpy(), hyp_p_t.double().numpy(), n_elig, D,
                                           self.cfg.gamma, self.cfg.chain, self._size())
            chosen = self._finish(chosen, cand.mass, cand.depth)
            tree, nodes = self._as_tree(chosen, cand.parent, cand.pos, cand.tok, cand.depth, cand.order)
            return GrownTree(tree, tuple(cand.mass[c] for c in nodes), tuple(cand.depth[c] for c in nodes))
        hyp_tok, hyp_p = hyp_tok_t.tolist(), hyp_p_t.tolist()
        # Candidates: parallel lists; parent -1 is the root.
        c_parent: list[int] = []
        c_pos: list[int] = []
        c_tok: list[int] = []
        c_mass: list[float] = []
        c_depth: list[int] = []
        # Host bookkeeping in numpy: per level it is a handful of tiny ops, where torch's per-call cost dominates.
        depth_of: dict[int, np.ndarray] = {-1: np.zeros(L, dtype=np.int64)}
        mass_of = {-1: 1.0}
        frontier = [-1]
        selected: list[int] = []
        children: dict[int, list[int]] = {}
        # A candidate lighter than the D-th heaviest so far can never be selected (that bound only rises), and a
        # chain only ever takes a parent's heaviest child: skipping the rest saves most of the bookkeeping while
        # the selection stays the exact top D by mass over ALL slots (a slot's q alone does not rank its mass).
        best: list[float] = []  # min-heap of the D largest masses so far (trees)
        chain = self.cfg.chain
        while frontier := self._expand(frontier, mass_of, selected, c_mass, c_depth):
            min_mass = self._mass_floor()
            maps = torch.from_numpy(np.stack([depth_of[n] for n in frontier]))
            q = self.order.probs(prep, ctx, maps)
            # A stable sort: equal probabilities (saturated confidences are common) go lowest slot first, as the
            # target's own tie-break does (topk would pick among ties arbitrarily); candidate order is the
            # tie-break of every later selection.
            qn = q.numpy()
            qi = np.argsort(-qn, axis=-1, kind="stable")  # descending, equal values in slot order
            qv = np.take_along_axis(qn, qi, axis=-1)
            for row, node in enumerate(frontier):
                base = mass_of[node]
                node_best = 0.0
                for qq, pos in zip(qv[row].tolist(), qi[row].tolist(), strict=True):
                    floor = node_best if chain else (best[0] if len(best) == D else 0.0)
                    if qq <= 0.0 or base * qq < max(floor, min_mass):
                        break  # sorted: every later slot is lighter still (token probabilities are <= 1)
                    for h in (0, 1):
                        m = base * qq * hyp_p[pos][h]
                        if m <= 0.0 or m < min_mass or m < floor:
                            continue
                        node_best = max(node_best, m)
                        if not chain:
                            if len(best) < D:
                                heapq.heappush(best, m)
                            elif m > best[0]:
                                heapq.heapreplace(best, m)
                            floor = best[0] if len(best) == D else 0.0
                        children.setdefault(node, []).append(len(c_parent))
                        c_parent.append(node)
                        c_pos.append(pos)
                        c_tok.append(hyp_tok[pos][h])
                        c_mass.append(m)
                        c_depth.append(c_depth[node] + 1 if node >= 0 else 1)
            selected = self._select(children, c_mass, c_depth, D)
            frontier = []
            for c in selected:
                if c in depth_of or c_depth[c] >= n_elig:
                    continue
                dm = depth_of[c_parent[c]].copy()
                dm[c_pos[c]] = c_depth[c]
                depth_of[c], mass_of[c] = dm, c_mass[c]
                frontier.append(c)
        selected = self._finish(selected, c_mass, c_depth)
        tree, nodes = self._as_tree(selected, c_parent, c_pos, c_tok, c_depth, range(len(c_parent)))
        return GrownTree(tree, tuple(c_mass[c] for c in nodes), tuple(c_depth[c] for c in nodes))

    # Hooks for a proposer that sizes the tree per round (budget=auto); fixed budgets expand fully.
    def _size(self) -> More | None:
        """The node-by-node search's stopping rule for this round (None: grow to the budget)."""
        return None

    def _expand(
        self, frontier: list[int], mass_of: dict[int, float], selected: list[int], mass: list[float], depth: list[int]
    ) -> list[int]:
        """The nodes to expand next (an empty list stops growing). Candidates are indices into mass/depth."""
        return frontier

    def _finish(self, selected: list[int], mass: list[float], depth: list[int]) -> list[int]:
        """The final cut of `selected` (mass order, parents before children: every prefix is a tree)."""
        return selected

    def _mass_floor(self) -> float:
        """Candidates lighter than this are dropped: SPOT-gamma's fixed floor (budget=auto sets one per level)."""
        return self.cfg.gamma

    def _select(self, children: dict[int, list[int]], mass: list[float], depth: list[int], D: int) -> list[int]:
        if not self.cfg.chain:
            # Ties: shallower first, then older, so a parent always ranks before its children.
            order = sorted(range(len(mass)), key=lambda c: (-mass[c], depth[c], c))
            return order[:D]
        chain: list[int] = []
        node = -1
        while len(chain) < D:
            kids = children.get(node)
            if not kids:
                break
            node = max(kids, key=lambda c: (mass[c], -c))
            chain.append(node)
        return chain

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
        for c in ordered:
            if parent[c] not in index:
                continue  # its parent fell out of the budget (only possible on exact mass ties)
            index[c] = len(out_parent) + 1
            out_parent.append(index[parent[c]])
            out_pos.append(pos[c])
            out_tok.append(tok[c])
            nodes.append(c)
        return DraftTree(tuple(out_parent), tuple(out_pos), tuple(out_tok)), nodes


def SpotProposer(model: DrafterModel, cfg: TreeConfig) -> TreeProposer:  # noqa: N802 (a constructor by role)
    """SPOT: the best-first tree over the learned order model."""
    return TreeProposer(LearnedOrder(model), cfg)
