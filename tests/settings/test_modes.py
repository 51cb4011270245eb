"""The one table of modes: every reader (model args, proposer factory, benchmark, README) follows it."""

from __future__ import annotations

from pathlib import Path

import pytest

from lm_eval_spot.settings.args import SpotArgError, parse_args
from lm_eval_spot.settings.proposers import MethodSpec, make_proposer
from lm_eval_spot.settings.modes import MODE_TABLE, MODES

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_model_args_accept_exactly_the_tables_modes():
    for m in MODE_TABLE:
        args = {"mode": m.name} if m.name != "graph" else {"mode": "graph"}
        assert parse_args(args).mode == m.name
    with pytest.raises(SpotArgError, match="accepted: " + ", ".join(m.name for m in MODE_TABLE)):
        parse_args({"mode": "nope"})


def test_the_proposer_factory_follows_the_tables_flags():
    from lm_eval_spot.baselines.graph import RankGraph
    from lm_eval_spot.settings.args import default_drafter_path, default_graph_path
    from lm_eval_spot.drafter.model import load_drafter

    drafter = load_drafter(default_drafter_path(), 32)[0]
    graph = RankGraph.load(default_graph_path())
    for m in MODE_TABLE:
        if m.name == "oracle":  # built per request from a control run (baselines.oracle)
            continue
        prop = make_proposer(MethodSpec(m.name, 4), drafter, graph)
        assert (prop is not None) == m.drafts, m.name
        if m.drafts:
            assert callable(getattr(prop, "propose", None)), m.name
        if m.learned:
            with pytest.raises(ValueError, match="needs a drafter"):
                make_proposer(MethodSpec(m.name, 4), None, graph)


def test_the_benchmark_and_the_readme_list_the_tables_modes():
    from research.bench import METHODS

    assert set(METHODS) == {m.name for m in MODE_TABLE if m.drafts}
    row = next(line for line in README.read_text().splitlines() if line.startswith("| `mode` |"))
    for name in MODES:
        assert f"`{name}`" in row, name
