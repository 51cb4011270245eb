"""Baselines share the decoder and verifier: each must reproduce control exactly; the oracle accepts everything."""

from __future__ import annotations

import pytest
import torch

from lm_eval_spot.adapters.base import TargetInfo
from lm_eval_spot.adapters.block_causal import BlockCausalAdapter
from lm_eval_spot.baselines.graph import GraphProposer, RankGraph, confidence_ranking, rank_sequence
from lm_eval_spot.baselines.oracle import CommitLog, OracleProposer, OracleProposers
from lm_eval_spot.decoding.loop import DecodeConfig, decode
from lm_eval_spot.decoding.batch import DecodeRequest, decode_many
from lm_eval_spot.decoding.proposer import RoundContext, SharedProposer
from lm_eval_spot.drafter.spot_proposer import StaleConfidenceOrder, TreeConfig, TreeProposer
from lm_eval_spot.settings.proposers import MethodSpec, make_proposer

from helpers.tiny import build_model
from helpers.summaries import view

V, MASK, EOS = 40, 2, 1
GRAPH = RankGraph(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (2,), (0, 0, 0, 0), (9, 9)), (9, 8, 7, 6, 5, 4, 3, 2, 1), 9)


def adapter_for(L: int, seed: int = 0) -> BlockCausalAdapter:
    return BlockCausalAdapter(build_model(V, seed=seed, block_length=L),
                              TargetInfo(MASK, frozenset({EOS}), L, "zero", True, V))


@pytest.mark.parametrize("mode", ["free-chain", "conf-tree", "graph"])
@pytest.mark.parametrize("budget", [1, 4, 12])
@pytest.mark.parametrize("T", [0.0, 1.0])
def test_baselines_reproduce_control(mode, budget, T):
    ad = adapter_for(16, seed=3)
    prop = make_proposer(MethodSpec(mode, budget), graph=GRAPH)
    cfg = DecodeConfig(max_gen_toks=40, temperature=T)
    for i, prompt in enumerate(([5, 6, 7], list(range(3, 22)), [])):
        ctrl = decode(ad, prompt, cfg, seed=11 + i)
        spec = decode(ad, prompt, cfg, seed=11 + i, proposer=prop)
        assert spec.token_ids == ctrl.token_ids
        assert spec.nfe.total <= ctrl.nfe.total


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_oracle_accepts_every_drafted_state(T):
    ad = adapter_for(16, seed=4)
    cfg = DecodeConfig(max_gen_toks=48, temperature=T)
    log = CommitLog()
    ctrl = decode(ad, [3, 4, 5, 6, 7], cfg, seed=2, observer=log)
    for D in (3, 15):
        spec = decode(ad, [3, 4, 5, 6, 7], cfg, seed=2, proposer=OracleProposer(log, D))
        assert spec.token_ids == ctrl.token_ids
        # Every drafted state is accepted, so each round commits min(D + 1, what is left in the block).
        assert all(a == d for a, d in zip(spec.accepted, spec.drafted, strict=True))
        assert spec.rounds == sum(-(-len(c) // (D + 1)) for c in log.blocks.values())
        # stale_only: a block's first round commits one slot alone, the rest goes as before
        floor = decode(ad, [3, 4, 5, 6, 7], cfg, seed=2, proposer=OracleProposer(log, D, stale_only=True))
        assert floor.token_ids == ctrl.token_ids
        assert floor.rounds == sum(1 + -(-(len(c) - 1) // (D + 1)) for c in log.blocks.values())


def test_free_chain_follows_stale_confidence_with_lowest_slot_on_ties():
    L = 8
    stale = torch.full((L, V), -10.0)
    for i, margin in enumerate([1, 30, 2, 30, 3, 0, 0, 0]):
        stale[i, 7] = margin  # slots 1 and 3 saturate at confidence 1.0: a tie the target breaks by slot index
    state = torch.full((L,), MASK)
    ctx = RoundContext(state, state == MASK, state != MASK, view(stale), 0.0, None, MASK)
    tree = TreeProposer(StaleConfidenceOrder(), TreeConfig(budget=4, hedge_below=0.0, chain=True)).propose(ctx)
    assert tree.parent == (0, 1, 2, 3)
    assert tree.pos == (1, 3, 4, 2) and set(tree.tok) == {7}
    assert confidence_ranking(view(stale).confidence, state == MASK)[:4] == [1, 3, 4, 2]


def test_graph_ranks_and_pruning():
    assert rank_sequence([4, 2, 7, 1], [2, 1, 4]) == [1, 2, 0]
    L = 4
    stale = torch.zeros(L, V)
    stale[:, 9] = torch.tensor([1.0, 4.0, 3.0, 2.0])
    state = torch.tensor([MASK, MASK, 5, MASK])  # slot 2 committed: ranking over slots 1, 3, 0
    ctx = RoundContext(state, state == MASK, state != MASK, view(stale), 0.0, None, MASK)
    tree = GraphProposer(GRAPH, 20).propose(ctx)
    # (9, 9) is pruned (rank beyond the slots left) and so is (0, 0, 0, 0) (depth beyond the masked slots).
    assert tree.size == 7
    assert tree.pos[:3] == (1, 3, 3) and tree.parent[:3] == (0, 0, 1)
    assert GraphProposer(GRAPH, 2).propose(ctx).size == 2


def test_graph_roundtrip(tmp_path):
    GRAPH.save(tmp_path / "g.json")
    assert RankGraph.load(tmp_path / "g.json") == GRAPH


def test_the_oracle_is_a_run_s_per_request_proposers_built_from_each_request_s_control_decode():
    """The oracle enters a run as the other methods do (a `RequestProposers`): the runner decodes the chunk's
    control first with the observers it asks for, then each request drafts its own control commits."""
    ad = adapter_for(8, seed=5)
    cfg = DecodeConfig(max_gen_toks=24, temperature=1.0)
    prompts = [[3, 4, 5], list(range(6, 17)), [7]]
    source = OracleProposers(4)
    assert source.reads_control and not SharedProposer(None).reads_control
    watch = source.watch_control(len(prompts))
    control = decode_many(ad, [DecodeRequest(p, cfg, 30 + i, observer=w) for i, (p, w) in enumerate(zip(prompts, watch))],
                          batch_size=3)
    props = source.for_chunk(len(prompts), watch)
    spec = decode_many(ad, [DecodeRequest(p, cfg, 30 + i, proposer=q) for i, (p, q) in enumerate(zip(prompts, props))],
                       batch_size=3)
    for c, s_ in zip(control, spec, strict=True):
        assert s_.token_ids == c.token_ids
        assert sum(s_.accepted) == sum(s_.drafted) > 0  # its own request's commits: every drafted state accepted
    # Proposers built from another request's control decode are not that request's oracle.
    swapped = source.for_chunk(len(prompts), watch[::-1])
    crossed = decode_many(ad, [DecodeRequest(p, cfg, 30 + i, proposer=q) for i, (p, q) in enumerate(zip(prompts, swapped))],
                          batch_size=3)
    assert any(sum(x.accepted) < sum(x.drafted) for x in crossed)
    with pytest.raises(ValueError, match="paired control decodes"):
        source.for_chunk(len(prompts), None)
    assert SharedProposer(None).for_chunk(2, None) == [None, None] and SharedProposer(None).watch_control(2) is None
