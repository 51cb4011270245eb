"""Mode name -> proposer. Every mode shares the decoder and verifier; only the proposer differs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lm_eval_spot.adapters.base import TargetAdapter
from lm_eval_spot.baselines.graph import GraphProposer, RankGraph
from lm_eval_spot.config import SpotArgs, default_drafter_path, default_graph_path
from lm_eval_spot.decoding.proposer import Proposer
from lm_eval_spot.drafter.model import DrafterModel, load_drafter
from lm_eval_spot.drafter.proposer import LearnedOrder, StaleConfidenceOrder, TreeConfig, TreeProposer

LEARNED_MODES = ("spot", "spot-gamma", "spot-chain")


@dataclass(frozen=True)
class MethodSpec:
    mode: str
    budget: int
    gamma: float = 0.05  # used by spot-gamma only


def make_proposer(spec: MethodSpec, drafter: DrafterModel | None = None, graph: RankGraph | None = None) -> Proposer | None:
    """The proposer of a fixed-budget mode (None for control; the oracle is built per request, see baselines)."""
    m, D = spec.mode, spec.budget
    if m == "control":
        return None
    if m in LEARNED_MODES:
        if drafter is None:
            raise ValueError(f"mode={m} needs a drafter")
        cfg = TreeConfig(budget=D, gamma=spec.gamma if m == "spot-gamma" else 0.0, chain=m == "spot-chain")
        return TreeProposer(LearnedOrder(drafter), cfg)
    if m == "conf-tree":
        return TreeProposer(StaleConfidenceOrder(), TreeConfig(budget=D))
    if m == "free-chain":
        # Stale top-confidence order with stale argmax tokens: no hedge, one path.
        return TreeProposer(StaleConfidenceOrder(), TreeConfig(budget=D, hedge_below=0.0, chain=True))
    if m == "graph":
        if graph is None:
            raise ValueError("mode=graph needs a calibrated draft graph")
        return GraphProposer(graph, D)
    raise ValueError(f"no fixed proposer for mode={m!r}")


def load_assets(mode: str, drafter_path: Path, graph_path: Path, block_len: int) -> tuple[DrafterModel | None, RankGraph | None]:
    drafter = load_drafter(drafter_path, block_len)[0] if mode in LEARNED_MODES else None
    graph = RankGraph.load(graph_path) if mode == "graph" else None
    return drafter, graph


def build_proposer(args: SpotArgs, adapter: TargetAdapter) -> Proposer | None:
    """The run's proposer from the model args (None for control and for the oracle, which is per request)."""
    if args.mode in ("control", "oracle"):
        return None
    block_len = adapter.info.block_len
    drafter, graph = load_assets(
        args.mode, Path(args.drafter or default_drafter_path()), Path(args.graph or default_graph_path()), block_len
    )
    if drafter is not None:
        drafter = drafter.to(adapter.device)  # the order model runs beside the target (its inputs are small)
    if args.budget == "auto":
        from lm_eval_spot.auto_budget import AutoBudgetProposer, measure_costs

        assert drafter is not None
        costs = measure_costs(adapter, drafter, gen_length=args.gen_length or 256)  # lm-eval's usual max_gen_toks
        cfg = TreeConfig(budget=costs.max_budget, chain=args.mode == "spot-chain")
        return AutoBudgetProposer(LearnedOrder(drafter), cfg, costs)
    assert isinstance(args.budget, int)
    return make_proposer(MethodSpec(args.mode, args.budget, args.gamma), drafter, graph)
