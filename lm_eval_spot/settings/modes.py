"""The decoding modes: ONE table, read by the model arguments (`settings.args`), the proposer factory
(`settings.proposers`), the model class, the benchmark and the docs. Pure data: importing it loads nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    name: str
    drafts: bool  # proposes drafted states (everything but control)
    learned: bool  # reads a drafter (the SPOT modes)
    graph: bool  # reads a calibrated draft graph
    chain: bool  # proposes one sequential path (the rejection verifier's precondition)
    baseline: bool  # a training-free comparison method (benchmark plots)
    doc: str


MODE_TABLE: tuple[Mode, ...] = (
    Mode("spot", True, True, False, False, False, "SPOT draft tree from the learned order model, padded to the budget"),
    Mode("spot-gamma", True, True, False, False, False, "SPOT with the mass floor gamma (the realised budget adapts)"),
    Mode("spot-chain", True, True, False, True, False, "the tree ablation: the learned order's single path"),
    Mode("conf-tree", True, False, False, False, True, "the stale-confidence ranking grown best-first as a tree"),
    Mode("free-chain", True, False, False, True, True, "stale top-confidence order with stale argmax tokens, one path"),
    Mode("graph", True, False, True, False, True, "a calibrated draft graph over stale-confidence ranks (Spiffy-style)"),
    Mode("oracle", True, False, False, False, False, "the true next commits from a control run of the same request"),
    Mode("control", False, False, False, False, False, "draft-free exact decoding, one commit per target forward"),
)
MODES = {m.name: m for m in MODE_TABLE}
MODE_NAMES = tuple(MODES)
LEARNED_MODES = tuple(m.name for m in MODE_TABLE if m.learned)
CHAIN_MODES = tuple(m.name for m in MODE_TABLE if m.chain)
BASELINE_MODES = tuple(m.name for m in MODE_TABLE if m.baseline)
