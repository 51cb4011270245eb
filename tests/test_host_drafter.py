"""The CPU drafting path: the factored model's numpy pass and the node-by-node best-first tree search.

The numpy pass must compute the torch model's tables (its norms folded into the maps after them, so the test
gives every norm a non-trivial affine); the best-first search must select exactly the level-wise search's tree,
node order and tie-breaks included (saturated logits make exact mass ties).
"""

from __future__ import annotations

import pytest
import torch

from lm_eval_spot.decoding.noise import gumbel_rows
from lm_eval_spot.decoding.proposer import RoundContext
from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel, HostTables
from lm_eval_spot.drafter.host import HostEncoder
from lm_eval_spot.drafter.proposer import LearnedOrder, TreeConfig, TreeProposer

from summaries import view

V, MASK = 40, 0


def random_factored(seed: int, flat: bool = False, **cfg) -> FactoredOrderModel:
    """flat: heads zeroed, so every candidate slot gets the same probability (exact mass ties everywhere)."""
    torch.manual_seed(seed)
    model = FactoredOrderModel(FactoredConfig(**cfg)).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):  # the init's (1, 0) would hide a wrong fold
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.3)
        if flat:
            for head in (model.base, model.pairs, model.by_length):
                head.weight.zero_()
                head.bias.zero_()
    return model


def context(seed: int, L: int, scale: float, T: float, n_committed: int, n_outside: int = 0) -> RoundContext:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(L, V, generator=g) * scale
    logits[:, MASK] = float("-inf")
    state = torch.full((L,), MASK)
    done = torch.randperm(L, generator=g)[:n_committed]
    state[done] = 7
    eligible = state == MASK
    if n_outside:
        eligible[L - n_outside:] = False
    noise = gumbel_rows(seed, 0, L, V, torch.device("cpu")) if T > 0 else None
    return RoundContext(state, eligible, state != MASK, view(logits, T, noise), T, noise, MASK)


@pytest.mark.parametrize("cfg", [{}, {"d_model": 64, "n_heads": 4, "n_layers": 2, "d_ff": 192},
                                 {"d_model": 32, "n_heads": 2, "n_layers": 1, "d_ff": 64, "slot_embedding": False},
                                 {"d_model": 32, "n_heads": 2, "n_layers": 1, "d_ff": 64, "slot_embedding": False,
                                  "relative_slots": True}])
@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_numpy_pass_equals_the_torch_model(cfg, scale):
    model = random_factored(1, **cfg)
    host = HostEncoder.of(model)
    for seed, L, n_done, outside in [(0, 32, 5, 0), (1, 16, 0, 3), (2, 8, 6, 1)]:
        ctx = context(seed, L, scale, 0.0, n_done, outside)
        ref = model.prepare(ctx.stale, ctx.committed_before, ctx.eligible).host
        got = host.prepare(ctx.stale, ctx.committed_before, ctx.eligible)
        assert isinstance(got, HostTables)
        for name in ("base", "pair_t", "last_t", "length_t"):
            a, b = torch.from_numpy(getattr(got, name)), torch.from_numpy(getattr(ref, name))
            assert a.shape == b.shape, name
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4, msg=name)
        assert (got.candidate == ref.candidate).all()


@pytest.mark.parametrize("cfg", [{}, {"d_model": 32, "n_heads": 2, "n_layers": 1, "d_ff": 64, "slot_embedding": False,
                                      "relative_slots": True}])
def test_a_batch_of_rounds_gets_each_rounds_own_tables_bit_for_bit(cfg):
    """prepare_many (several requests' rounds in one stacked pass, as the batched decoder drafts) gives every
    round exactly the tables it gets alone, so drafting never depends on the batch a request decodes in."""
    host = HostEncoder.of(random_factored(2, **cfg))
    for L in (8, 32):
        ctxs = [context(10 + i, L, (1.0, 40.0)[i % 2], 0.0, i % 5, i % 3) for i in range(6)]
        many = host.prepare_many([(c.stale, c.committed_before, c.eligible) for c in ctxs])
        for c, got in zip(ctxs, many, strict=True):
            alone = host.prepare(c.stale, c.committed_before, c.eligible)
            for name in ("base", "pair_t", "last_t", "length_t", "candidate"):
                assert (getattr(got, name) == getattr(alone, name)).all(), name


def test_learned_order_uses_the_numpy_pass_on_the_cpu_only_for_factored_models():
    from lm_eval_spot.drafter.model import OrderModel, OrderModelConfig

    assert LearnedOrder(random_factored(0)).host is not None
    assert LearnedOrder(OrderModel(OrderModelConfig())).host is None
    ctx = context(0, 16, 1.0, 0.0, 3)
    assert isinstance(LearnedOrder(random_factored(0)).begin(ctx), HostTables)


class LevelWise(TreeProposer):
    levelwise = True


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("scale", [1.0, 4.0, 40.0])
@pytest.mark.parametrize("T", [0.0, 1.0])
def test_best_first_selects_the_level_wise_tree(scale, T, flat):
    model = random_factored(3, flat, d_model=32, n_heads=2, n_layers=1, d_ff=64)
    order = LearnedOrder(model)
    checked = 0
    for seed in range(12):
        L = (8, 16, 32)[seed % 3]
        ctx = context(100 + seed, L, scale, T, seed % 4, seed % 2)
        for budget in (1, 3, 8, 20):
            for gamma, chain in ((0.0, False), (0.05, False), (0.0, True)):
                cfg = TreeConfig(budget=budget, gamma=gamma, chain=chain)
                fast, slow = TreeProposer(order, cfg).grow(ctx), LevelWise(order, cfg).grow(ctx)
                assert fast.tree == slow.tree, (seed, budget, gamma, chain)
                assert fast.depth == slow.depth
                assert fast.mass == pytest.approx(slow.mass, rel=1e-5)
                checked += fast.tree.size
    assert checked > 100  # trees really were drafted


def test_flat_saturated_rounds_have_mass_ties_that_the_order_key_breaks():
    """Guard for the test above: with a flat order model and x40 logits most candidates share one mass exactly,
    so equal trees there mean equal tie-breaks, not luck."""
    model = random_factored(3, True, d_model=32, n_heads=2, n_layers=1, d_ff=64)
    ctx = context(101, 16, 40.0, 0.0, 1)
    grown = LevelWise(LearnedOrder(model), TreeConfig(budget=20)).grow(ctx)
    assert len(set(grown.mass)) <= grown.tree.size - 5 and grown.tree.size == 20
    assert max(grown.depth) >= 2


def test_the_drafter_stays_on_the_host_whatever_the_target_device():
    """build_proposer keeps the order model on the CPU (its numpy path) even when the target is elsewhere;
    drafter_device= moves it."""
    from types import SimpleNamespace

    from lm_eval_spot.config import SpotArgError, parse_args
    from lm_eval_spot.methods import build_proposer

    target = SimpleNamespace(info=SimpleNamespace(block_len=32), device=torch.device("meta"))
    default = build_proposer(parse_args({"mode": "spot"}), target).proposer
    assert default.order.host is not None and default.order.model.device.type == "cpu"
    moved = build_proposer(parse_args({"mode": "spot", "drafter_device": "meta"}), target).proposer
    assert moved.order.host is None and moved.order.model.device.type == "meta"
    with pytest.raises(SpotArgError, match="drafter_device"):
        parse_args({"drafter_device": "gpu0"})
