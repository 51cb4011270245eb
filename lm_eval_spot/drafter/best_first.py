"""The draft tree search: best first by prefix mass, one node at a time, over any order source.

An order source shows the search a round's tree through `Paths`: a node's candidate slots with their order
probabilities, and the node a commit leads to. Expanding a node costs one such call, and the search expands
exactly the nodes it selects, in prefix-mass order, with a heap. Prefix mass of a node = product along its path
of (order probability of the slot) x (stale probability of the token); a child never outweighs its parent.

It selects the top `budget` candidates by (-mass, depth, creation order), where the creation order is a key (the
parent's rank among its depth's nodes, then the slot's rank by descending order probability, lowest slot on
ties, then the token hypothesis): the tree a level-by-level search over every candidate selects, tie-breaks
included (tests/drafter/test_host_drafter.py keeps such a search as the reference). A child ranks after its parent on
equal mass, so popping candidates in key order is that top set.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class Paths(Protocol):
    """One round's tree as an order source sees it (`TreeProposer.grow` builds it from the round's context)."""

    def root(self) -> Any:
        """The root state's node."""
        ...

    def child(self, node: Any, slot: int, depth: int) -> Any:
        """The node reached from `node` by committing `slot` at path depth `depth`."""
        ...

    def slot_probs(self, node: Any, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """(slots in ascending order, their next-commit probabilities) for a node at path depth `depth`: every
        slot the order source may put mass on (a zero probability is allowed and never drafted)."""
        ...


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
    """An expanded node: the order source's state for it, its prefix mass, depth and creation-order key."""

    __slots__ = ("state", "mass", "depth", "order")

    def __init__(self, state: Any, mass: float, depth: int, order: Any) -> None:
        self.state, self.mass, self.depth, self.order = state, mass, depth, order


def _children(paths: Paths, node: _Node, hyp_p: list[tuple[float, float]], keep: int, floor: float
              ) -> tuple[list[int], list[int], list[float], list[int]]:
    """The node's `keep` heaviest children with mass >= floor, best first: (slot, hypothesis, mass, creation
    index) lists. Creation index = slot rank by descending probability (lowest slot on ties) x 2 + hypothesis:
    equal masses go in that order. hyp_p: per slot its hypotheses' stale probabilities."""
    slots_in, q = paths.slot_probs(node.state, node.depth)
    if not slots_in.size:
        return [], [], [], []
    rank = (-q).argsort(kind="stable")  # candidate slots ascend, so ties go lowest slot first
    qs, slots = q[rank].tolist(), slots_in[rank].tolist()
    # Slots by descending probability; a child's mass is at most mass x q (token probabilities are <= 1), so
    # the scan stops at the first slot that cannot beat the keep-th child found (a tie would rank after it).
    found: list[tuple[float, int]] = []  # (-mass, creation index)
    kth = 0.0
    for r, qq in enumerate(qs):
        bq = node.mass * qq  # (mass x q) x p, in float64: the reference search's products
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


def grow_best_first(paths: Paths, hyp_tok: np.ndarray, hyp_p: np.ndarray, n_elig: int, budget: int,
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
        slots, hyps, masses, made_at = _children(paths, node, hp, 1 if chain else budget, floor)
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
        parent = expanded[c.parent[cid]]
        expanded[cid] = _Node(paths.child(parent.state, c.pos[cid], c.depth[cid]), c.mass[cid], c.depth[cid],
                              c.order[cid])
        selected.append(cid)

    expanded[-1] = _Node(paths.root(), 1.0, 0, ())
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
