"""Mode name -> proposer. Every mode shares the decoder and verifier; only the proposer differs."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from lm_eval_spot.adapters.base import TargetAdapter
from lm_eval_spot.baselines.oracle import OracleProposers
from lm_eval_spot.baselines.rank_graph import GraphProposer, RankGraph
from lm_eval_spot.settings.args import SpotArgs, default_graph_path, drafter_for
from lm_eval_spot.budget import MAX_BUDGET, CanvasCheck, build_policy
from lm_eval_spot.decoding.proposer import DrafterOptions, Proposer, RequestProposers, SharedProposer
from lm_eval_spot.decoding.step_policy import StepPolicy
from lm_eval_spot.drafter.model import DrafterMismatchError, DrafterModel, load_drafter
from lm_eval_spot.drafter.spot_proposer import LearnedOrder, StaleConfidenceOrder, TreeConfig, TreeProposer
from lm_eval_spot.settings.modes import LEARNED_MODES, MODES


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProposerChoice:
    proposer: Proposer | None  # the run's shared proposer (None: control, or the oracle's per-request ones)
    drafter: Path | None  # the drafter folder drafting reads (None: no learned drafter)
    note: str = ""  # why the run drafts without the drafter it would have used ("" when it does not)
    policy: StepPolicy | None = None  # budget=auto: each step's drafted rows per request (None: a fixed budget)
    per_request: RequestProposers | None = None  # set by the oracle: its proposers are built per request
    # budget=auto with a learned drafter: the proposer every request drafts with, the drafter and conf-tree, the
    # policy choosing between them per step (None: `proposer` alone)
    options: DrafterOptions | None = None
    canvas: CanvasCheck | None = None  # budget=auto: measures again at the first requests' canvas where it differs

    @property
    def requests(self) -> RequestProposers:
        """How each request of a segment gets its proposer."""
        if self.per_request is not None:
            return self.per_request
        return SharedProposer(self.options if self.options is not None else self.proposer)


@dataclass(frozen=True)
class MethodSpec:
    mode: str
    budget: int
    gamma: float = 0.05  # used by spot-gamma only


def make_proposer(spec: MethodSpec, drafter: DrafterModel | None = None, graph: RankGraph | None = None) -> Proposer | None:
    """The proposer of a mode at budget D (None for control; the oracle's are built per request: `OracleProposers`).
    Under budget=auto, D is the deepest tree a round may draft and the step policy chooses below it."""
    m, D = spec.mode, spec.budget
    if m not in MODES:
        raise ValueError(f"unknown mode {m!r}")
    mode = MODES[m]
    if not mode.drafts:
        return None
    if mode.learned:
        if drafter is None:
            raise ValueError(f"mode={m} needs a drafter")
        cfg = TreeConfig(budget=D, gamma=spec.gamma if m == "spot-gamma" else 0.0, chain=mode.chain)
        return TreeProposer(LearnedOrder(drafter), cfg)
    if m == "conf-tree":
        return TreeProposer(StaleConfidenceOrder(), TreeConfig(budget=D))
    if m == "free-chain":
        # Stale top-confidence order with stale argmax tokens: no hedge, one path.
        return TreeProposer(StaleConfidenceOrder(), TreeConfig(budget=D, hedge_below=0.0, chain=True))
    if mode.graph:
        if graph is None:
            raise ValueError("mode=graph needs a calibrated draft graph")
        return GraphProposer(graph, D)
    raise ValueError(f"no fixed proposer for mode={m!r}")


def load_assets(mode: str, drafter_path: Path, graph_path: Path, block_len: int) -> tuple[DrafterModel | None, RankGraph | None]:
    drafter = load_drafter(drafter_path, block_len)[0] if MODES[mode].learned else None
    graph = RankGraph.load(graph_path) if MODES[mode].graph else None
    return drafter, graph


def build_proposer(args: SpotArgs, adapter: TargetAdapter, batch_size: int | None = None) -> ProposerChoice:
    """The run's proposer from the model args (None for control and for the oracle, which is per request), and
    under budget=auto the step policy, measured at start-up on the adapter's device for `batch_size` requests.

    A drafter the user named must load; the default one (`settings.args.drafter_for`) that is missing or does not fit
    the target gives way to conf-tree, the training-free stale-confidence tree, with one warning: the run still
    drafts and stays exact."""
    if args.mode == "control":
        return ProposerChoice(None, None)
    if args.mode == "oracle":
        assert isinstance(args.budget, int)  # settings.args gives the oracle a fixed budget
        return ProposerChoice(None, None, per_request=OracleProposers(args.budget))
    block_len = adapter.info.block_len
    auto = args.budget == "auto"
    budget = MAX_BUDGET if auto else args.budget
    assert isinstance(budget, int)
    path = drafter_for(args) if args.mode in LEARNED_MODES else None
    note = ""
    try:
        drafter, graph = load_assets(args.mode, path or Path(), Path(args.graph or default_graph_path()), block_len)
        mode = args.mode
    except DrafterMismatchError as err:
        if args.drafter is not None:
            raise
        why = str(err).removeprefix("spot-dlm: ")
        note = f"no shipped drafter fits this target ({why}); drafting with conf-tree at budget {args.budget}"
        log.warning("spot-dlm: %s: outputs stay exact, fewer drafts are accepted than with a learned drafter", note)
        drafter, graph, mode, path = None, None, "conf-tree", None
    if drafter is not None and args.drafter_device != "cpu":
        # On the host (the default) the order model runs from its numpy tables, on the summaries the round already
        # brought there: no transfer, no device call per tree level.
        drafter = drafter.to(args.drafter_device)
    proposer = make_proposer(MethodSpec(mode, budget, args.gamma), drafter, graph)
    policy, options = None, None
    if auto:
        n = batch_size or (args.batch_size if isinstance(args.batch_size, int) else args.max_batch_size or 32)
        assert proposer is not None
        if MODES[mode].learned:
            # Where the learned drafter's host pass costs more than its better acceptance saves (a cheap forward, a
            # drafter new to the target), conf-tree drafts: the policy weighs both per step, from their own costs
            # and acceptance records.
            fallback = make_proposer(MethodSpec("conf-tree", budget), None, None)
            assert fallback is not None
            options = DrafterOptions((proposer, fallback), (path.name if path is not None else mode, "conf-tree"))
        # A fully bidirectional row costs its whole canvas: measured at the first requests' own (CanvasCheck).
        defer = adapter.info.grid_origin == "prompt_end" and args.gen_length is None
        policy = build_policy(adapter, options or proposer, n, args.gen_length or 256, defer)  # 256: lm-eval's usual
        return ProposerChoice(proposer, path, note, policy, options=options,
                              canvas=CanvasCheck(adapter, options or proposer, n))
    return ProposerChoice(proposer, path, note, policy)
