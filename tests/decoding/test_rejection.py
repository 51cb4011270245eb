"""verify=rejection (accept-residual for chains) keeps the target distribution at T = 1, even with a bad proposal."""

from __future__ import annotations

import pytest
import torch

from lm_eval_spot.adapters.base import TargetInfo
from lm_eval_spot.adapters.block_causal import BlockCausalAdapter
from lm_eval_spot.decoding.loop import DecodeConfig, decode
from lm_eval_spot.decoding.rejection import rejection_verify
from lm_eval_spot.decoding.tree import DraftTree
from lm_eval_spot.drafter.model import OrderModel, OrderModelConfig
from lm_eval_spot.drafter.spot_proposer import LearnedOrder, TreeConfig, TreeProposer

from helpers.stats import chi_square_p
from helpers.tiny import build_model

V, MASK, EOS = 12, 2, 1


@pytest.mark.parametrize("q_kind", ["calibrated", "flat", "inverted", "wrong-position"])
def test_first_commit_follows_target_whatever_the_proposal(q_kind):
    """One root state: the committed (position, token) must be distributed as the target's transition."""
    L = 3
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, L, V, generator=gen) * 2
    logits[0, 1] += 3.0  # the target's position at the root: slot 1 (highest confidence)
    logits[..., MASK] = float("-inf")
    eligible = torch.ones(2, L, dtype=torch.bool)
    p = torch.softmax(logits[0, 1], -1)
    q = {"calibrated": p, "flat": torch.full((V,), 1.0 / V), "inverted": torch.softmax(-logits[0, 1].clamp(-20), -1),
         "wrong-position": p}[q_kind]
    pos = 0 if q_kind == "wrong-position" else 1
    counts = torch.zeros(V)
    n = 4000
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=gen))
        tree = DraftTree((0,), (pos,), (x,))
        path, fpos, ftok, _ = rejection_verify(tree, q[None], logits, eligible, 1.0, gen)
        committed = x if path else ftok
        assert (fpos == 1) if not path else True
        counts[committed] += 1
    assert chi_square_p(counts, p) > 1e-3


def test_decode_with_rejection_matches_control_distribution():
    """End to end at T = 1 with a random-weight (miscalibrated) chain drafter: the first generated token has
    the same distribution under verify=rejection as under control (chi-square homogeneity)."""
    L = 8
    ad = BlockCausalAdapter(build_model(V, seed=5, block_length=L), TargetInfo(MASK, frozenset(), L, "zero", True, V))
    torch.manual_seed(0)
    drafter = OrderModel(OrderModelConfig(d_model=16, n_heads=2, n_layers=1, d_ff=32, top_k=V, max_block_len=L))
    prop = TreeProposer(LearnedOrder(drafter), TreeConfig(budget=4, chain=True))
    cfg = DecodeConfig(max_gen_toks=6, temperature=1.0)
    n = 300
    a = torch.zeros(V)
    b = torch.zeros(V)
    accepted = 0
    for s in range(n):
        c = decode(ad, [3, 4, 5], cfg, seed=s)
        r = decode(ad, [3, 4, 5], cfg, seed=10_000 + s, proposer=prop, verify="rejection")
        a[c.token_ids[0]] += 1
        b[r.token_ids[0]] += 1
        accepted += sum(r.accepted)
    assert accepted > 0  # drafts were accepted, so the acceptance path is exercised
    # Two-sample homogeneity: compare b against the pooled estimate.
    pooled = (a + b) / (2 * n)
    assert chi_square_p(b, pooled) > 1e-3 and chi_square_p(a, pooled) > 1e-3


def test_rejection_at_T0_is_the_exact_greedy_check():
    L = 8
    ad = BlockCausalAdapter(build_model(V, seed=6, block_length=L), TargetInfo(MASK, frozenset(), L, "zero", True, V))
    drafter = OrderModel(OrderModelConfig(d_model=16, n_heads=2, n_layers=1, d_ff=32, top_k=V, max_block_len=L))
    prop = TreeProposer(LearnedOrder(drafter), TreeConfig(budget=3, chain=True))
    cfg = DecodeConfig(max_gen_toks=12, temperature=0.0)
    assert decode(ad, [3], cfg, 1, proposer=prop, verify="rejection").token_ids == decode(ad, [3], cfg, 1).token_ids


def test_rejection_refuses_trees():
    logits = torch.zeros(3, 4, V)
    with pytest.raises(ValueError, match="chain"):
        rejection_verify(DraftTree((0, 0), (1, 2), (3, 3)), torch.ones(2, V) / V, logits,
                         torch.ones(3, 4, dtype=torch.bool), 1.0, torch.Generator())
