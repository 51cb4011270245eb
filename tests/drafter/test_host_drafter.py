"""The CPU drafting path: the factored model's numpy pass and the node-by-node best-first tree search.

The numpy pass must compute the torch model's tables (its norms folded into the maps after them, so the test
gives every norm a non-trivial affine); the best-first search must select exactly the tree a plain level-wise
search over every candidate selects (written here, apart from the package), node order and tie-breaks included
(saturated logits make exact mass ties), over every order source.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lm_eval_spot.decoding.noise import gumbel_rows
from lm_eval_spot.decoding.proposer import RoundContext
from lm_eval_spot.decoding.tree import DraftTree
from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel, HostTables
from lm_eval_spot.drafter.host import HostEncoder
from lm_eval_spot.drafter.spot_proposer import LearnedOrder, StaleConfidenceOrder, TreeConfig, TreeProposer

from helpers.summaries import view

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
    assert isinstance(LearnedOrder(random_factored(0)).prepare(ctx), HostTables)


def level_wise(order: LearnedOrder | StaleConfidenceOrder, ctx: RoundContext, cfg: TreeConfig) -> tuple[DraftTree, list[float], list[int]]:
    """Reference search, written apart from the package's: level by level, every selected node's children made
    (no pruning), then the top `budget` candidates by (-mass, depth, creation index) -- or, for a chain, each
    node's heaviest child (lowest creation index on ties). Mass = parent mass x order probability x the stale
    probability of the token hypothesis (T=0: top-1, and the runner-up when top-1 < 0.6; T>0: the coupled draw).
    Returns the tree (by depth, then creation), and each node's mass and depth."""
    stale = ctx.stale
    if ctx.temperature > 0:
        hyps = [[(int(stale.draw_tok[i]), float(stale.draw_p[i]))] for i in range(ctx.state.shape[0])]
    else:
        hyps = [[(int(stale.top_ids[i, 0]), float(stale.topk[i, 0]))]
                + ([(int(stale.top_ids[i, 1]), float(stale.topk[i, 1]))] if float(stale.topk[i, 0]) < cfg.hedge_below
                   else []) for i in range(ctx.state.shape[0])]
    if isinstance(order, StaleConfidenceOrder):  # q proportional to stale confidence over the still-open slots
        def q_of(maps):
            w = stale.topk[:, 0][None] * (ctx.eligible & ~ctx.committed_before)[None] * (maps == 0)
            return w / w.sum(-1, keepdim=True).clamp_min(1e-30)
    else:
        prep = order.prepare(ctx)

        def q_of(maps):
            return order.probs(prep, ctx, maps)
    n_elig = int(ctx.eligible.sum())
    L = ctx.state.shape[0]
    parent, pos, tok, mass, depth = [], [], [], [], []
    maps = {-1: torch.zeros(L, dtype=torch.long)}
    node_mass, node_depth = {-1: 1.0}, {-1: 0}
    children: dict[int, list[int]] = {}
    frontier, selected = [-1], []
    while frontier:
        q = q_of(torch.stack([maps[n] for n in frontier]))
        for row, n in enumerate(frontier):
            ranked = sorted(range(L), key=lambda j: (-float(q[row, j]), j))
            for j in ranked:
                for t, pt in hyps[j]:
                    m = node_mass[n] * float(q[row, j]) * pt
                    if m <= 0.0 or m < cfg.gamma:
                        continue
                    children.setdefault(n, []).append(len(parent))
                    parent.append(n), pos.append(j), tok.append(t), mass.append(m), depth.append(node_depth[n] + 1)
        if cfg.chain:
            selected, n = [], -1
            while len(selected) < cfg.budget and children.get(n):
                n = max(children[n], key=lambda c: (mass[c], -c))
                selected.append(n)
        else:
            selected = sorted(range(len(parent)), key=lambda c: (-mass[c], depth[c], c))[: cfg.budget]
        frontier = [c for c in selected if c not in maps and depth[c] < n_elig]
        for c in frontier:
            maps[c] = maps[parent[c]].clone()
            maps[c][pos[c]] = depth[c]
            node_mass[c], node_depth[c] = mass[c], depth[c]
    index, out = {-1: 0}, ([], [], [])
    nodes = []
    for c in sorted(selected, key=lambda c: (depth[c], c)):
        if parent[c] not in index:
            continue  # its parent fell out of the budget (exact mass ties)
        index[c] = len(nodes) + 1
        out[0].append(index[parent[c]]), out[1].append(pos[c]), out[2].append(tok[c])
        nodes.append(c)
    return DraftTree(*map(tuple, out)), [mass[c] for c in nodes], [depth[c] for c in nodes]


class DepthMapOrder(LearnedOrder):
    """The learned order through depth maps (the search's path for order models off the CPU)."""

    def prepare(self, ctx):
        return replace(self.model.prepare(ctx.stale, ctx.committed_before, ctx.eligible), host=None)


@pytest.mark.parametrize("source", ["host", "depth maps", "stale confidence"])
@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("scale", [1.0, 4.0, 40.0])
@pytest.mark.parametrize("T", [0.0, 1.0])
def test_the_search_selects_the_reference_tree(scale, T, flat, source):
    """One search for every order source: the host tables' node-by-node path, the torch model scored through
    depth maps, and stale confidence (the conf-tree / free-chain baselines)."""
    model = random_factored(3, flat, d_model=32, n_heads=2, n_layers=1, d_ff=64)
    order = {"host": LearnedOrder, "depth maps": DepthMapOrder}[source](model) if source != "stale confidence" \
        else StaleConfidenceOrder()
    checked = 0
    for seed in range(12):
        L = (8, 16, 32)[seed % 3]
        ctx = context(100 + seed, L, scale, T, seed % 4, seed % 2)
        for budget in (1, 3, 8, 20):
            for gamma, chain in ((0.0, False), (0.05, False), (0.0, True)):
                cfg = TreeConfig(budget=budget, gamma=gamma, chain=chain)
                fast = TreeProposer(order, cfg).grow(ctx)
                tree, mass, depth = level_wise(order, ctx, cfg)
                assert fast.tree == tree, (seed, budget, gamma, chain)
                assert list(fast.depth) == depth
                assert list(fast.mass) == pytest.approx(mass, rel=1e-5)
                checked += fast.tree.size
    assert checked > 100  # trees really were drafted


def test_flat_saturated_rounds_have_mass_ties_that_the_order_key_breaks():
    """Guard for the test above: with a flat order model and x40 logits most candidates share one mass exactly,
    so equal trees there mean equal tie-breaks, not luck."""
    model = random_factored(3, True, d_model=32, n_heads=2, n_layers=1, d_ff=64)
    ctx = context(101, 16, 40.0, 0.0, 1)
    tree, mass, depth = level_wise(LearnedOrder(model), ctx, TreeConfig(budget=20))
    assert len(set(mass)) <= tree.size - 5 and tree.size == 20
    assert max(depth) >= 2


def test_the_drafter_stays_on_the_host_whatever_the_target_device():
    """build_proposer keeps the order model on the CPU (its numpy path) even when the target is elsewhere;
    drafter_device= moves it."""
    from types import SimpleNamespace

    from lm_eval_spot.settings.args import SpotArgError, parse_args
    from lm_eval_spot.settings.proposers import build_proposer

    target = SimpleNamespace(info=SimpleNamespace(block_len=32), device=torch.device("meta"))
    default = build_proposer(parse_args({"mode": "spot", "budget": 8}), target).proposer
    assert default.order.host is not None and default.order.model.device.type == "cpu"
    moved = build_proposer(parse_args({"mode": "spot", "budget": 8, "drafter_device": "meta"}), target).proposer
    assert moved.order.host is None and moved.order.model.device.type == "meta"
    with pytest.raises(SpotArgError, match="drafter_device"):
        parse_args({"drafter_device": "gpu0"})


@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_host_paths_give_the_torch_models_node_distributions(scale):
    """The search's host arithmetic (`HostTables.root/child/slot_probs`, a node's logits as its parent's plus a
    few rows) against the torch model's own definition (`node_logits` over the round's tables), on random paths."""
    model = random_factored(4, d_model=32, n_heads=2, n_layers=1, d_ff=64)
    g = torch.Generator().manual_seed(0)
    for seed in range(6):
        ctx = context(300 + seed, (8, 16, 32)[seed % 3], scale, 0.0, seed % 3)
        tables = model.prepare(ctx.stale, ctx.committed_before, ctx.eligible)
        host = tables.host
        cand = torch.from_numpy(host.candidate).nonzero().flatten()
        path = cand[torch.randperm(cand.numel(), generator=g)][: min(5, cand.numel() - 1)].tolist()
        node = host.root()
        for d in range(len(path) + 1):
            on = torch.zeros(1, 1, host.candidate.shape[0], dtype=torch.bool)
            on[0, 0, path[:d]] = True
            last = torch.tensor([[path[d - 1] if d else -1]])
            want = torch.softmax(model.node_logits(replace(tables, host=None), on, last)[0, 0], dim=-1)
            slots, q = host.slot_probs(node, d)
            got = torch.zeros_like(want)
            got[torch.from_numpy(slots)] = torch.from_numpy(q)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
            if d < len(path):
                node = host.child(node, path[d], d + 1)
