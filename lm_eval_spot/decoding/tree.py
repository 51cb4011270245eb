"""Draft trees as data, their compilation into replica states, and state-equality verification.

Node 0 is the root (the current block state); drafted nodes are 1..D, each one commit (pos, tok) applied to
its parent's state. Parents precede children, so one pass in index order builds every state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class DraftTree:
    """D drafted states. All tuples have length D; entry j describes node j + 1."""

    parent: tuple[int, ...]  # node index of the parent (0 = root), always < j + 1
    pos: tuple[int, ...]  # slot committed on the edge parent -> node
    tok: tuple[int, ...]  # token committed there
    # Each node's best-first rank (1 = the first the search selected), where the proposer ranks its nodes: the
    # accepted nodes among the best k are then a prefix of the accepted path. () = unranked (tree order stands in).
    rank: tuple[int, ...] = field(default=(), compare=False)  # metadata: two trees are equal by their states

    def __post_init__(self) -> None:
        if not (len(self.parent) == len(self.pos) == len(self.tok)):
            raise ValueError("DraftTree fields must have equal length")
        if self.rank and sorted(self.rank) != list(range(1, len(self.parent) + 1)):
            raise ValueError(f"rank must number the nodes 1 .. {len(self.parent)}, got {self.rank}")
        for j, p in enumerate(self.parent):
            if not 0 <= p <= j:
                raise ValueError(f"node {j + 1} has parent {p}: parents must precede children")

    @property
    def size(self) -> int:
        return len(self.parent)

    def ranks(self) -> tuple[int, ...]:
        """Each node's rank (tree order where the proposer gave none)."""
        return self.rank or tuple(range(1, self.size + 1))

    @staticmethod
    def empty() -> DraftTree:
        return DraftTree((), (), ())



def compile_states(root: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """Replica states [1 + D, L] (on the host): row 0 the root, row n node n's hypothetical state."""
    # Built in numpy from every node's path commits in one scatter: on the CPU, per-node tensor indexing (and
    # torch's per-op cost at all) is more than the whole tree's arithmetic.
    states = np.repeat(root.cpu().numpy()[None], 1 + tree.size, axis=0)
    if tree.size:
        rows: list[int] = []
        cols: list[int] = []
        vals: list[int] = []
        paths: list[list[int]] = [[]]  # per node: the edges (node indices) from the root to it
        for j, p in enumerate(tree.parent):
            path = paths[p] + [j]
            paths.append(path)
            rows.extend([j + 1] * len(path))
            cols.extend(tree.pos[e] for e in path)
            vals.extend(tree.tok[e] for e in path)
        states[rows, cols] = vals
    return torch.from_numpy(states)


def accepted_path(tree: DraftTree, target_pos: torch.Tensor, target_tok: torch.Tensor) -> list[int]:
    """Walk from the root along edges that equal the target's own transition (state equality).

    target_pos/target_tok [1 + D]: f(node) for every node, computed in the verification forward. Returns the
    accepted drafted nodes in order (empty if the first step is rejected). Any drafter gives the same final
    state as draft-free decoding, because every accepted edge IS the target's transition.
    """
    tp = target_pos.tolist()
    tt = target_tok.tolist()
    children: dict[int, list[int]] = {}
    for j, p in enumerate(tree.parent):
        children.setdefault(p, []).append(j + 1)
    path: list[int] = []
    node = 0
    while True:
        nxt = next(
            (c for c in children.get(node, ()) if tree.pos[c - 1] == tp[node] and tree.tok[c - 1] == tt[node]),
            None,
        )
        if nxt is None:
            return path
        path.append(nxt)
        node = nxt
