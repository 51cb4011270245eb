"""The calibrated draft graph (Spiffy-style): a fixed graph over stale-confidence RANKS, pruned at run time.

A node is a rank sequence (r1, ..., rk): "commit the r1-th most confident masked slot (by the stale conditionals),
then the r2-th of those left, ...", with the stale top token at each slot (the coupled stale draw at T > 0).
The graph is calibrated offline on control trajectories of the target on held-out prompts: it keeps the rank
sequences that were most often the true next commits. At run time the first D nodes that exist in the current
block (rank within the slots left, parent kept) are drafted.

The calibration command is `lm_eval_spot.baselines.graph`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lm_eval_spot.decoding.proposer import RoundContext, token_hypotheses
from lm_eval_spot.decoding.tree import DraftTree

log = logging.getLogger(__name__)

GRAPH_VERSION = 1
MAX_DEPTH = 24


@dataclass(frozen=True)
class RankGraph:
    nodes: tuple[tuple[int, ...], ...]  # rank sequences, most frequent first; prefix-closed
    counts: tuple[int, ...]
    rounds: int  # calibration rounds the counts come from
    target: str = ""

    def save(self, path: Path) -> None:
        doc = {"version": GRAPH_VERSION, "target": self.target, "rounds": self.rounds,
               "nodes": [list(n) for n in self.nodes], "counts": list(self.counts)}
        tmp = Path(str(path) + ".tmp")
        tmp.write_text(json.dumps(doc) + "\n")
        os.replace(tmp, path)

    @staticmethod
    def load(path: Path) -> RankGraph:
        doc = json.loads(Path(path).read_text())
        if doc.get("version") != GRAPH_VERSION:
            raise ValueError(f"draft graph {str(path)!r} has version {doc.get('version')}, this code reads {GRAPH_VERSION}")
        return RankGraph(tuple(tuple(n) for n in doc["nodes"]), tuple(doc["counts"]), doc["rounds"], doc["target"])


def confidence_ranking(conf: torch.Tensor, eligible: torch.Tensor) -> list[int]:
    """Eligible slots, most stale-confident first (lowest index on ties). conf [L]: stale clean confidence."""
    slots = eligible.nonzero().flatten().tolist()
    return sorted(slots, key=lambda i: (-float(conf[i]), i))


def rank_sequence(ranking: list[int], commits: list[int]) -> list[int]:
    """Ranks of successive commits, each among the slots still left: the graph's coordinates of a true path."""
    left = list(ranking)
    out = []
    for p in commits:
        if p not in left:
            break
        r = left.index(p)
        out.append(r)
        left.pop(r)
    return out


class GraphProposer:
    def __init__(self, graph: RankGraph, budget: int) -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        self.graph, self.budget = graph, budget

    def propose(self, ctx: RoundContext) -> DraftTree:
        if ctx.stale is None:
            return DraftTree.empty()
        ranking = confidence_ranking(ctx.stale.confidence, ctx.eligible)
        tok = token_hypotheses(ctx, hedge_below=0.0)[0][:, 0].tolist()
        index: dict[tuple[int, ...], int] = {(): 0}
        left_of: dict[tuple[int, ...], list[int]] = {(): ranking}
        parent, pos, toks = [], [], []
        budget = self.budget if ctx.budget is None else min(self.budget, ctx.budget)
        for node in self.graph.nodes:
            if len(parent) >= budget:
                break
            up = node[:-1]
            if up not in index or node[-1] >= len(left_of[up]):
                continue  # pruned: its parent was pruned, or fewer slots are left than its rank
            left = list(left_of[up])
            p = left.pop(node[-1])
            index[node] = len(parent) + 1
            left_of[node] = left
            parent.append(index[up])
            pos.append(p)
            toks.append(tok[p])
        return DraftTree(tuple(parent), tuple(pos), tuple(toks))
