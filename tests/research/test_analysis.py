from __future__ import annotations

import torch

from research.analysis import DynamicsObserver, main, rejection_cause
from lm_eval_spot.decoding.tree import DraftTree
from helpers.summaries import view


def test_dynamics_rates_on_hand_made_commits():
    L, V = 3, 10
    elig = torch.ones(L, dtype=torch.bool)
    obs = DynamicsObserver()
    logits0 = torch.zeros(L, V)
    logits0[:, 5] = torch.tensor([4.0, 2.0, 9.0])  # next commit after slot 2: slot 0 (best remaining) token 5
    obs.on_commit(0, None, elig, view(logits0), 2, 5)
    e1 = torch.tensor([True, True, False])
    logits1 = torch.zeros(L, V)
    logits1[1, 6] = 3.0
    obs.on_commit(0, None, e1, view(logits1), 0, 5)  # hit: stale top remaining slot 0, token 5
    obs.on_commit(0, None, torch.tensor([False, True, False]), view(logits1), 1, 7)  # position hit, token miss (6 vs 7)
    c = obs.counts[0]
    assert c["rounds"] == 3 and c["stale_rounds"] == 2
    assert c["prev_top_conf_next"] == 2 and c["stale_argmax_token"] == 1 and c["leftmost"] == 2


def test_rejection_causes():
    tree = DraftTree((0, 0, 1), (3, 4, 5), (9, 9, 9))  # root -> 1 (slot 3), root -> 2 (slot 4), 1 -> 3 (slot 5)
    assert rejection_cause(tree, [], torch.tensor([6, -1, -1, -1])) == "position_miss"
    assert rejection_cause(tree, [], torch.tensor([4, -1, -1, -1])) == "token_miss"  # right slot, wrong token
    assert rejection_cause(tree, [1, 3], torch.tensor([3, 5, 0, 2])) == "budget_exhausted"
    assert rejection_cause(tree, [1, 3], torch.tensor([3, 5, 0, -1])) == "block_end"


def test_analysis_command_on_the_embedded_target(tmp_path):
    out = tmp_path / "report.json"
    main(["--n", "2", "--budget", "4", "--oracle-budgets", "4,20", "--max-gen-toks", "96", "--out", str(out)])
    import json

    rep = json.loads(out.read_text())
    assert rep["samples"] == 2 and set(rep["oracle"]) == {"4", "20"}
    assert rep["oracle"]["20"]["nfe_per_sample"] < rep["spot"]["nfe_per_sample"] < rep["control_nfe_per_sample"]
    # silent in each block's first round: one more forward per block than the oracle, still under SPOT
    floor = rep["oracle"]["20"]["stale_only_nfe_per_sample"]
    assert rep["oracle"]["20"]["nfe_per_sample"] < floor <= rep["spot"]["nfe_per_sample"]
    assert abs(sum(rep["spot"]["first_rejection_cause_rate"].values()) - 1.0) < 1e-9
    assert "0" in rep["dynamics_by_block"] and 0 <= rep["dynamics"]["stale_argmax_token_rate"] <= 1
