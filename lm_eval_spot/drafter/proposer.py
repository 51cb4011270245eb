"""SPOT's proposer: grow a draft tree best-first by prefix mass from the order model and stale conditionals.

Prefix mass of a node = product along its path of (order-model probability of the slot) x (stale probability of
the token). A child's mass never exceeds its parent's, so expanding level by level -- each level one batched
order-model call over every newly selected node -- reaches the same top-D set as sequential best-first search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lm_eval_spot.decoding.proposer import RoundContext
from lm_eval_spot.decoding.tree import DraftTree
from lm_eval_spot.drafter.features import node_status, prob_features, stale_topk
from lm_eval_spot.drafter.model import OrderModel


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


def token_hypotheses(ctx: RoundContext, hedge_below: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slot up to two (token, stale probability) hypotheses: [L, 2] tokens and probs (prob 0 = none).

    T=0: stale top-1, plus the runner-up when top-1 < hedge_below. T>0: the coupled stale draw
    argmax(stale/T + G) with the same Gumbel rows the target uses, and its stale probability at T.
    """
    logits = ctx.stale_logits.float()
    if ctx.temperature > 0:
        assert ctx.gumbel is not None
        scaled = logits / ctx.temperature
        tok = (scaled + ctx.gumbel).argmax(dim=-1)
        p = torch.softmax(scaled, dim=-1).gather(-1, tok[:, None]).squeeze(-1)
        return torch.stack([tok, tok], -1), torch.stack([p, torch.zeros_like(p)], -1)
    probs = torch.softmax(logits, dim=-1)
    top = probs.topk(2, dim=-1)
    p2 = torch.where(top.values[:, 0] < hedge_below, top.values[:, 1], torch.zeros_like(top.values[:, 1]))
    return top.indices, torch.stack([top.values[:, 0], p2], -1)


class SpotProposer:
    def __init__(self, model: OrderModel, cfg: TreeConfig) -> None:
        self.model = model.eval()
        self.cfg = cfg

    def order_probs(self, feat: torch.Tensor, ctx: RoundContext, depth_maps: torch.Tensor) -> torch.Tensor:
        """[N, L] next-commit distribution over still-masked slots of N hypothetical states."""
        status = node_status(ctx.committed_before, ctx.eligible, depth_maps)
        with torch.no_grad():
            logits = self.model(feat, status, depth_maps)
        return torch.softmax(logits, dim=-1).nan_to_num(0.0)

    def propose(self, ctx: RoundContext) -> DraftTree:
        D, gamma = self.cfg.budget, self.cfg.gamma
        L = ctx.state.shape[0]
        feat = prob_features(stale_topk(ctx.stale_logits, self.model.cfg.top_k))
        hyp_tok, hyp_p = token_hypotheses(ctx, self.cfg.hedge_below)
        hyp_tok, hyp_p = hyp_tok.tolist(), hyp_p.tolist()
        n_elig = int(ctx.eligible.sum())
        # Candidates: parallel lists; parent -1 is the root.
        c_parent: list[int] = []
        c_pos: list[int] = []
        c_tok: list[int] = []
        c_mass: list[float] = []
        c_depth: list[int] = []
        depth_of: dict[int, torch.Tensor] = {-1: torch.zeros(L, dtype=torch.long)}
        mass_of = {-1: 1.0}
        level_of = {-1: 0}
        frontier = [-1]
        selected: list[int] = []
        children: dict[int, list[int]] = {}
        while frontier:
            maps = torch.stack([depth_of[n] for n in frontier])
            q = self.order_probs(feat, ctx, maps)
            k = min(D, n_elig)
            qv, qi = q.topk(k, dim=-1)
            for row, node in enumerate(frontier):
                base = mass_of[node]
                for qq, pos in zip(qv[row].tolist(), qi[row].tolist(), strict=True):
                    if qq <= 0.0:
                        break
                    for h in (0, 1):
                        m = base * qq * hyp_p[pos][h]
                        if m <= 0.0 or m < gamma:
                            continue
                        children.setdefault(node, []).append(len(c_parent))
                        c_parent.append(node)
                        c_pos.append(pos)
                        c_tok.append(hyp_tok[pos][h])
                        c_mass.append(m)
                        c_depth.append(level_of[node] + 1)
            selected = self._select(children, c_mass, c_depth, D)
            frontier = []
            for c in selected:
                if c in depth_of or c_depth[c] >= n_elig:
                    continue
                dm = depth_of[c_parent[c]].clone()
                dm[c_pos[c]] = c_depth[c]
                depth_of[c], mass_of[c], level_of[c] = dm, c_mass[c], c_depth[c]
                frontier.append(c)
        return self._as_tree(selected, c_parent, c_pos, c_tok, c_depth)

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
    def _as_tree(selected: list[int], parent: list[int], pos: list[int], tok: list[int], depth: list[int]) -> DraftTree:
        keep = set(selected)
        ordered = sorted((c for c in selected if parent[c] == -1 or parent[c] in keep), key=lambda c: (depth[c], c))
        index = {-1: 0}
        out_parent, out_pos, out_tok = [], [], []
        for c in ordered:
            if parent[c] not in index:
                continue  # its parent fell out of the budget (only possible on exact mass ties)
            index[c] = len(out_parent) + 1
            out_parent.append(index[parent[c]])
            out_pos.append(pos[c])
            out_tok.append(tok[c])
        return DraftTree(tuple(out_parent), tuple(out_pos), tuple(out_tok))
