"""Sequential best-first tree search over the factored order model's host tables, one node at a time.

The level-wise builder (`TreeProposer.grow`) calls the order source once per tree level, on every node of the
level, through generic depth maps; on the CPU its per-level bookkeeping costs more than the arithmetic. The
factored model's node logits are base + sum of pair rows along the path + the last commit's row + a length row,
so a child's logits are its parent's plus a few [L] rows: this search expands exactly the nodes it selects, in
prefix-mass order, with a heap.

It selects the same tree as the level-wise builder: the top `budget` candidates by (-mass, depth, creation
order), where the level-wise creation order is reproduced as a key (a parent's rank among its depth's nodes, then
the slot's rank by descending order probability, lowest slot on ties, then the token hypothesis). A child never
outweighs its parent and ranks after it on equal mass, so popping candidates in key order is that top set.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import numpy as np

from lm_eval_spot.drafter.factored import HostTables


@dataclass
class Candidates:
    """Drafted candidates as parallel lists (parent -1 = the root), with the key that orders equal-mass ones."""

    parent: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    tok: list[int] = field(default_factory=list)
    mass: list[float] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    order: list[Any] = field(default_factory=list)  # creation-order key (compared only among equal depths)


class _Node:
    """What expanding a node needs: its path's summed pair rows, its candidate slots, last commit, mass, depth."""

    __slots__ = ("pair", "open", "last", "mass", "depth", "order")

    def __init__(self, pair: np.ndarray, open_: np.ndarray, last: int, mass: float, depth: int, order: Any) -> None:
        self.pair, self.open, self.last, self.mass, self.depth, self.order = pair, open_, last, mass, depth, order


def _children(t: HostTables, node: _Node, hyp_p: list[tuple[float, float]], keep: int, floor: float
              ) -> tuple[list[int], list[int], list[float], list[int]]:
    """The node's `keep` heaviest children with mass >= floor, best first: (slot, hypothesis, mass, creation
    index) lists. Creation index = slot rank by descending probability (lowest slot on ties) x 2 + hypothesis:
    equal masses go in that order, as the level-wise builder makes them. hyp_p: per slot its hypotheses'
    stale probabilities."""
    if not node.open.size:
        return [], [], [], []
    # The terms in `HostTables.node_probs`'s order (float sums depend on it), over the candidate slots only.
    logits = (node.pair[node.open] + t.last_t[node.last, node.open]) if node.last >= 0 else node.pair[node.open]
    logits += t.length_t[min(node.depth, t.length_t.shape[0] - 1), node.open]
    e = np.exp(logits - logits.max())
    q = e / e.sum()
    rank = (-q).argsort(kind="stable")  # candidate slots ascend, so ties go lowest slot first
    qs, slots = q[rank].tolist(), node.open[rank].tolist()
    # Slots by descending probability; a child's mass is at most mass x q (token probabilities are <= 1), so
    # the scan stops at the first slot that cannot beat the keep-th child found (a tie would rank after it).
    found: list[tuple[float, int]] = []  # (-mass, creation index)
    kth = 0.0
    for r, qq in enumerate(qs):
        bq = node.mass * qq  # the level-wise products: (mass x q) x p, in float64
        if bq <= 0.0 or bq < floor or (len(found) >= keep and bq <= kth):
            break
        p0, p1 = hyp_p[slots[r]]
        if (m := bq * p0) > 0.0 and m >= floor:
            found.append((-m, 2 * r))
        if (m := bq * p1) > 0.0 and m >= floor:
            found.append((-m, 2 * r + 1))
        if len(found) >= keep:
            found.sort()
            del found[keep:]
            kth = -found[-1][0]
    found.sort()
    del found[keep:]
    return ([slots[k >> 1] for _, k in found], [k & 1 for _, k in found], [-nm for nm, _ in found],
            [k for _, k in found])


# more(mass, depth): called on each selected candidate (mass order); False stops the search there. No later
# candidate is heavier than this one: the heap's rest was not, and its children are not.
More = Callable[[float, int], bool]


def grow_best_first(t: HostTables, hyp_tok: np.ndarray, hyp_p: np.ndarray, n_elig: int, budget: int,
                    min_mass: float, chain: bool, more: More | None = None) -> tuple[list[int], Candidates]:
    """The selected candidates (in key order, so parents come before children) and every candidate made.

    hyp_tok/hyp_p [L, 2]: per slot the token hypotheses and their stale probabilities (float64, 0 = none);
    n_elig: masked eligible slots at the root (no path goes deeper); min_mass: SPOT-gamma's floor; chain: one
    path, each step the heaviest child; more: a per-round size (budget=auto), the budget then an upper bound.
    Stopped early, the selection is a prefix of the full one."""
    c = Candidates()
    hp = list(zip(hyp_p[:, 0].tolist(), hyp_p[:, 1].tolist(), strict=True))
    expanded: dict[int, _Node] = {}  # candidate -> its node, once selected (-1: the root)
    best: list[float] = []  # min-heap of the `budget` largest masses made so far: lighter ones cannot be selected

    def expand(cid: int) -> list[int]:
        node = expanded[cid]
        if node.depth >= n_elig:
            return []
        # A chain takes each node's heaviest child, however light next to earlier levels' candidates.
        floor = max(min_mass, best[0] if len(best) == budget and not chain else 0.0)
        slots, hyps, masses, made_at = _children(t, node, hp, 1 if chain else budget, floor)
        rank = (-node.mass, node.order)  # the parent's rank among its depth's nodes, then the creation index
        out = []
        for s, h, m, k in zip(slots, hyps, masses, made_at, strict=True):
            out.append(len(c.parent))
            c.parent.append(cid)
            c.pos.append(s)
            c.tok.append(int(hyp_tok[s, h]))
            c.mass.append(m)
            c.depth.append(node.depth + 1)
            c.order.append((rank, k))
            if len(best) < budget:
                heapq.heappush(best, m)
            elif m > best[0]:
                heapq.heapreplace(best, m)
        return out

    def select(cid: int) -> None:
        parent, s = expanded[c.parent[cid]], c.pos[cid]
        open_ = parent.open[parent.open != s]
        expanded[cid] = _Node(parent.pair + t.pair_t[s], open_, s, c.mass[cid], c.depth[cid], c.order[cid])
        selected.append(cid)

    expanded[-1] = _Node(t.base.astype(np.float32), np.flatnonzero(t.candidate), -1, 1.0, 0, ())
    selected: list[int] = []
    heap = [(-c.mass[k], c.depth[k], c.order[k], k) for k in expand(-1)]
    heapq.heapify(heap)
    while heap:
        _, _, _, cid = heapq.heappop(heap)
        select(cid)
        if len(selected) == budget:
            break
        if more is not None and not more(c.mass[cid], c.depth[cid]):
            break
        kids = expand(cid)
        if chain:
            heap = [(-c.mass[k], c.depth[k], c.order[k], k) for k in kids]
            continue
        for k in kids:
            heapq.heappush(heap, (-c.mass[k], c.depth[k], c.order[k], k))
    return selected, c
