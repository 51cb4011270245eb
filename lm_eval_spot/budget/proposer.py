"""budget=auto's proposer: each round's tree grown best first and stopped, then cut, by the round's expected rate
(`budget.costs` prices it); calibration of predicted masses against what the verifier accepts.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections import deque

from lm_eval_spot.budget.costs import CostModel, RoundCosts, best_cut
from lm_eval_spot.decoding.proposer import RoundContext
from lm_eval_spot.decoding.tree import DraftTree
from lm_eval_spot.drafter.proposer import GrownTree, OrderSource, TreeConfig, TreeProposer

log = logging.getLogger("lm_eval.spot")

RETRY = 16  # see AutoBudgetProposer.propose
PRIOR_MASS = 4.0  # pseudo-count (in predicted acceptances) that holds a depth's calibration factor near 1 early on


class _RoundSize:
    """budget=auto over the node-by-node search: called on each selected node (mass order), it goes on while an
    optimistic bound says more nodes could raise the round's best rate: the next j nodes each as likely as this
    one (calibrated by the largest depth factor), each costing one more expansion."""

    def __init__(self, prop: AutoBudgetProposer, node_ms: float) -> None:
        self.prop = prop
        self.table = prop._table
        self.budget = min(prop.cfg.budget, prop.costs.max_budget)
        self.node_ms = node_ms
        self.top_factor = max(prop._factor) * prop._req_scale
        self.expanded = 1  # the root
        self.spent = prop.costs.prepare_ms + node_ms
        self.acc = 1.0
        self.k = 0
        self.best = 1.0 / (self.table[1] + self.spent)
        self.start = time.perf_counter()

    def __call__(self, mass: float, depth: int) -> bool:
        self.k += 1
        self.acc += self.prop._value(mass, depth)
        t = self.table
        self.best = max(self.best, self.acc / (t[1 + self.k] + self.spent))
        hope = mass * self.top_factor  # no later candidate is heavier
        for j in range(1, self.budget - self.k + 1):
            if (self.acc + j * hope) / (t[1 + self.k + j] + self.spent + j * self.node_ms) > self.best:
                self.expanded += 1
                self.spent += self.node_ms
                return True
        return False


class AutoBudgetProposer(TreeProposer):
    """The best-first tree with a per-round, cost-aware size (at most cfg.budget nodes): the search stops where
    `_RoundSize` says more nodes cannot raise the round's rate, and `_finish` cuts it at the best rate."""

    def __init__(self, order: OrderSource, cfg: TreeConfig, costs: CostModel) -> None:
        super().__init__(order, cfg)
        self.costs = costs  # as measured at start-up
        # The target's round cost as learned from the rounds (shared by reference with the per-request forks),
        # and this request's copy of its table (read by every cut): rows 0 .. budget + 2.
        size = max(cfg.budget, costs.max_budget) + 3
        self.round_costs = RoundCosts(costs, size)
        # Rounds whose forward also writes finished blocks (`RoundContext.pending`) run longer rows (embedded
        # target, 9 rows: 8.6 ms against 5.5 for a plain round). Learned apart: mixed in, they priced large trees
        # out of every round.
        self.pending_costs = RoundCosts(costs, size)
        self._table = self.round_costs.table
        self._propose_ms = 0.0  # this request's previous propose() (what its round time less the rest is)
        # Tree bookkeeping per expanded node (ms), learned online: the start-up curve times the order model alone.
        # The median of recent rounds: a mean let one round stalled by another process inflate the estimate, and
        # rounds that then drafted nothing never measured it down again.
        self._per_node_ms = 0.0
        self._per_node_samples: deque[float] = deque(maxlen=31)
        self._skipped = 0  # consecutive rounds skipped on the learned overhead alone
        self._retry = False
        # Prefix masses are the drafter's acceptance estimates; deep ones run optimistic (a 20-node tree's depth-16+
        # nodes are accepted ~0.7x as often as predicted), and they are the ones a cost-aware cut weighs last. So
        # each depth's masses are scaled by its observed acceptances over predicted ones, from the verifier's
        # verdicts (RoundContext.prev_path).
        self._predicted = [0.0] * (cfg.budget + 2)
        self._accepted = [0.0] * (cfg.budget + 2)
        self._factor = [1.0] * (cfg.budget + 2)
        self._last_tree: GrownTree | None = None
        self._sizer: _RoundSize | None = None  # the running node-by-node search's stopping rule
        # Per request on top of that: its acceptances over its calibrated predictions (a request the drafter reads
        # well or badly shows within a few rounds), held near 1 by PRIOR_MASS.
        self._req_predicted = self._req_accepted = 0.0
        self._req_scale = 1.0

    def for_request(self) -> AutoBudgetProposer:
        """A fork for one request: its own feedback pairing (the tree the verifier's next verdict refers to) and
        scalar estimates, sharing the run's cost curve and per-depth acceptance counts (lists, shared by
        reference), so requests decoded together never read each other's verdicts."""
        fork = copy.copy(self)
        fork._last_tree = None
        fork._sizer = None
        fork._req_predicted = fork._req_accepted = 0.0
        fork._req_scale = 1.0
        return fork

    def propose(self, ctx: RoundContext) -> DraftTree:
        t0 = time.perf_counter()
        self._learn_acceptance(ctx)
        run = ctx.prev_round
        if run is not None:
            # The round's time less this proposer's own (priced per node and per round on its own). A round with
            # a lookahead row runs another, dearer path (the loop adds that row; the tree does not choose it).
            # One with several finished blocks (the prompt's, in the first round, which drafts nothing) costs by
            # the prompt's length: it teaches neither table.
            if not run.ahead and run.pending <= 1:
                costs = self.pending_costs if run.pending else self.round_costs
                costs.observe(run.rows, max(0.0, run.ms - self._propose_ms))
        self._table = (self.pending_costs if ctx.pending else self.round_costs).table
        grown = self._propose(ctx)
        self._last_tree = grown
        self._propose_ms = 1000 * (time.perf_counter() - t0)
        return grown.tree

    def _learn_acceptance(self, ctx: RoundContext) -> None:
        last, self._last_tree = self._last_tree, None
        if last is None or ctx.prev_path is None:
            return
        hits = set(ctx.prev_path)
        factor = self._factor
        self._req_predicted += sum(m * factor[d] for m, d in zip(last.mass, last.depth, strict=True))
        self._req_accepted += len(hits)
        self._req_scale = (self._req_accepted + PRIOR_MASS) / (self._req_predicted + PRIOR_MASS)
        for node, (m, d) in enumerate(zip(last.mass, last.depth, strict=True), start=1):
            self._predicted[d] += m
            self._accepted[d] += node in hits
            factor[d] = (self._accepted[d] + PRIOR_MASS) / (self._predicted[d] + PRIOR_MASS)

    def _value(self, mass: float, depth: int) -> float:
        """A node's calibrated acceptance probability: its depth's factor over all requests, this request's scale."""
        return mass * self._factor[min(depth, len(self._factor) - 1)] * self._req_scale

    def _propose(self, ctx: RoundContext) -> GrownTree:
        self._retry = False
        if not self._root_pays():
            # Skipped rounds measure nothing, so an overhead learned while another process held the cores would
            # stop drafting for good: every RETRY-th such round drafts anyway and measures it again.
            self._skipped += 1
            if self._skipped % RETRY or not self._root_pays(per_node_ms=0.0):
                return GrownTree(DraftTree.empty())  # decided from costs alone: skip even the drafter's features
            self._retry = True  # this round prices levels without the learned overhead, so it measures it
        else:
            self._skipped = 0
        self._sizer = None
        grown = self.grow(ctx)
        self._close_round()
        return grown

    def _size(self) -> _RoundSize:
        # Per expansion: the order model's one-node cost plus the learned search bookkeeping.
        self._sizer = _RoundSize(self, self.costs.drafter(1) + (0.0 if self._retry else self._per_node_ms))
        return self._sizer

    def _root_pays(self, per_node_ms: float | None = None) -> bool:
        """Could even a tree of sure drafted states (any size up to the budget) beat plain decoding, at the measured
        costs? Any size: the round's fixed costs (features, a tree to verify) may pay only over several nodes."""
        node = self.costs.drafter(1) + (self._per_node_ms if per_node_ms is None else per_node_ms)
        t = self._table
        budget = min(self.cfg.budget, self.costs.max_budget, len(t) - 2)
        return any((1.0 + d) / (t[1 + d] + self.costs.prepare_ms + d * node) > 1.0 / t[1] for d in range(1, budget + 1))

    def _close_round(self) -> None:
        """Fold the measured time of the round's search into the per-node overhead (a median of recent rounds)."""
        sizer, self._sizer = self._sizer, None
        if sizer is not None:
            elapsed = 1000 * (time.perf_counter() - sizer.start)
            self._per_node_samples.append(max(0.0, elapsed / sizer.expanded - self.costs.drafter(1)))
            self._per_node_ms = statistics.median(self._per_node_samples)

    def _finish(self, selected: list[int], mass: list[float], depth: list[int]) -> list[int]:
        # `selected` is in raw-mass order, parents before children: every prefix is a tree.
        assert self._sizer is not None  # grow() asked `_size` for this round's stopping rule
        spent = self._sizer.spent  # the round's drafting time: its features and every expansion
        d, _ = best_cut([self._value(mass[c], depth[c]) for c in selected], self._table, spent)
        return selected[:d]
