"""budget=auto: the per-round size follows the measured costs, and the output stays exact."""

from __future__ import annotations

import pytest
import torch

from lm_eval_spot.adapters.base import TargetInfo
from lm_eval_spot.adapters.block_causal import BlockCausalAdapter
from lm_eval_spot.budget import PRIOR_MASS, AutoBudgetProposer, CostModel, best_cut, measure_costs
from lm_eval_spot.decoding.loop import DecodeConfig, decode
from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
from lm_eval_spot.drafter.model import DrafterModel, OrderModel, OrderModelConfig
from lm_eval_spot.drafter.proposer import LearnedOrder, TreeConfig

from tiny import build_model

V, MASK, EOS = 40, 2, 1


def linear_costs(base: float, per_replica: float, drafter: float) -> CostModel:
    return CostModel((1, 2, 21), (base, base + per_replica, base + 20 * per_replica), (1, 16), (drafter, drafter), 20)


def test_best_cut_trades_mass_for_replica_cost():
    cheap = linear_costs(10.0, 0.001, 0.0)
    dear = linear_costs(10.0, 10.0, 0.0)
    masses = [0.9, 0.8, 0.5, 0.1, 0.01]
    assert best_cut(masses, cheap, 0.0)[0] == 5  # replicas nearly free: verify everything
    assert best_cut(masses, dear, 0.0)[0] == 0  # a replica costs a whole forward: only sure bets pay... none do
    d, rate = best_cut([0.99, 0.99], linear_costs(10.0, 2.0, 0.0), 0.0)
    assert d == 2 and abs(rate - 2.98 / 14.0) < 1e-9


def test_interpolation_and_extrapolation():
    c = CostModel((1, 3), (2.0, 4.0), (1, 2), (1.0, 1.5))
    assert c.target(2) == 3.0 and c.target(5) == 6.0 and c.drafter(4) == 2.5 and c.target(0) == 2.0


def _adapter() -> BlockCausalAdapter:
    return BlockCausalAdapter(build_model(V, seed=2, block_length=16), TargetInfo(MASK, frozenset({EOS}), 16, "zero", True, V))


def _drafter(arch: str = "encoder") -> DrafterModel:
    torch.manual_seed(1)
    if arch == "factored":
        return FactoredOrderModel(FactoredConfig(d_model=32, n_heads=4, n_layers=1, d_ff=64, max_block_len=16))
    return OrderModel(OrderModelConfig(d_model=32, n_heads=4, n_layers=1, d_ff=64, max_block_len=16))


@pytest.mark.parametrize("arch", ["factored", "encoder"])
def test_auto_is_exact_and_sizes_follow_costs(arch):
    ad, dr = _adapter(), _drafter(arch)
    cfg = DecodeConfig(max_gen_toks=40, temperature=1.0)
    ctrl = decode(ad, [4, 5, 6], cfg, seed=3)
    free = AutoBudgetProposer(LearnedOrder(dr), TreeConfig(budget=20), linear_costs(10.0, 0.01, 0.01))
    dear = AutoBudgetProposer(LearnedOrder(dr), TreeConfig(budget=20), linear_costs(10.0, 50.0, 50.0))
    r_free = decode(ad, [4, 5, 6], cfg, seed=3, proposer=free)
    r_dear = decode(ad, [4, 5, 6], cfg, seed=3, proposer=dear)
    assert r_free.token_ids == ctrl.token_ids == r_dear.token_ids
    assert max(r_free.drafted) > 4  # cheap verification: wide trees
    assert max(r_dear.drafted) == 0  # drafting can never pay: control, exactly
    assert r_dear.nfe.total == ctrl.nfe.total


@pytest.mark.parametrize("arch", ["factored", "encoder"])
def test_measure_costs_gives_a_usable_curve(arch):
    c = measure_costs(_adapter(), _drafter(arch), max_budget=6, repeats=3)
    assert c.replicas[0] == 1 and c.replicas[-1] == 7
    assert all(t > 0 for t in c.target_ms + c.drafter_ms) and c.prepare_ms > 0


def stalled_search(prop: AutoBudgetProposer, seconds: float) -> None:
    """Close a round whose tree search (one node expanded) took `seconds`."""
    prop._size()
    prop._sizer.start -= seconds
    prop._close_round()


def test_one_stalled_round_does_not_stop_drafting():
    """The per-node overhead is a median of recent rounds: one search stalled by another process (1 s here)
    must not price drafting out for good (rounds that draft nothing would never measure it down)."""
    prop = AutoBudgetProposer(LearnedOrder(_drafter()), TreeConfig(budget=20), linear_costs(10.0, 0.5, 0.1))
    # The round costs stay at the given curve: this test is about the per-node overhead alone (the tiny target's
    # real rounds, ~1.5 ms against the curve's 10, would otherwise be learned and decide for it).
    for costs in (prop.round_costs, prop.pending_costs):
        costs.observe = lambda rows, ms: None  # type: ignore[method-assign]
    stalled_search(prop, 1.0)
    assert prop._per_node_ms > 900 and not prop._root_pays()
    # rounds skipped on that estimate alone still re-measure now and then (here: drafting would pay at 0 overhead)
    ad = _adapter()
    r = decode(ad, [4, 5, 6], DecodeConfig(max_gen_toks=40, temperature=0.0), seed=3, proposer=prop)
    assert r.nfe.total > 0 and len(prop._per_node_samples) > 1
    prop._per_node_samples.clear()
    stalled_search(prop, 1.0)
    for _ in range(2):
        stalled_search(prop, 0.0)
    assert prop._per_node_ms < 50 and prop._root_pays()


def test_convex_fit_removes_noise_kinks_and_keeps_a_knee():
    from lm_eval_spot.budget import convex_fit

    line = [2.0 + 0.5 * r for r in range(10)]
    assert all(abs(a - b) < 1e-9 for a, b in zip(convex_fit(line), line, strict=True))
    noisy = [2.0, 2.5, 3.6, 3.1, 4.0, 4.5]  # a timing spike at the third size, then a dip
    fit = convex_fit(noisy)
    steps = [b - a for a, b in zip(fit, fit[1:])]
    assert all(s2 >= s1 - 1e-9 for s1, s2 in zip(steps, steps[1:])) and min(steps) >= 0
    assert abs(sum(fit) - sum(noisy)) < 1e-9
    knee = [5.0, 5.0, 5.1, 5.0, 6.0, 7.0, 8.0]  # a GPU: flat while the batch fits, then linear
    fk = convex_fit(knee)
    assert fk[3] - fk[0] < 0.2 and abs((fk[6] - fk[4]) - 2.0) < 0.1


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_acceptance_calibration_learns_from_every_verdict(T):
    """The verifier's verdict on each round's tree reaches the proposer (RoundContext.prev_path): every accepted
    node but the last round's is counted at its depth, and each depth's factor is its acceptances over its mass."""
    prop = AutoBudgetProposer(LearnedOrder(_drafter("factored")), TreeConfig(budget=20), linear_costs(10.0, 0.01, 0.01))
    ad = _adapter()
    cfg = DecodeConfig(max_gen_toks=40, temperature=T)
    r = decode(ad, [4, 5, 6], cfg, seed=3, proposer=prop)
    assert r.token_ids == decode(ad, [4, 5, 6], cfg, seed=3).token_ids
    assert sum(r.drafted) > 0 and sum(prop._accepted) == sum(r.accepted[:-1])
    assert sum(prop._predicted) > 0
    for pred, acc, f in zip(prop._predicted, prop._accepted, prop._factor, strict=True):
        assert f == pytest.approx((acc + PRIOR_MASS) / (pred + PRIOR_MASS))


class _Recording(AutoBudgetProposer):
    """Records how many nodes the node-by-node search selected before its stopping rule ended it."""

    explored: list[int]

    def _finish(self, selected, mass, depth):
        self.explored.append(len(selected))
        return super()._finish(selected, mass, depth)


@pytest.mark.parametrize("calibrated", [False, True])
@pytest.mark.parametrize("per_replica", [0.02, 0.1, 0.3])
def test_auto_over_the_node_search_cuts_the_full_tree_where_no_longer_prefix_pays(per_replica, calibrated):
    """On the CPU a factored drafter's rounds grow node by node; budget=auto stops that search. Reference, from
    the fixed budget-20 tree alone: prefix j of its nodes by mass, each node valued at its mass times its depth's
    calibration factor, costs target(1 + j) plus one expansion per node (the root's for j = 0). The search must
    stop only where no longer prefix beats the best it saw, and the tree must be the prefix best at the cost
    actually spent. Uneven factors (as learned) make the search look further than it keeps."""
    from lm_eval_spot.drafter.proposer import TreeProposer
    from test_host_drafter import context, random_factored

    model = random_factored(3, d_model=32, n_heads=2, n_layers=1, d_ff=64)
    with torch.no_grad():  # peaked order distributions: deep paths carry mass, as with a trained drafter
        for head in (model.base, model.pairs, model.by_length):
            head.weight.mul_(6.0)
    order = LearnedOrder(model)
    costs = CostModel((1, 2, 21), (10.0, 10.0 + per_replica, 10.0 + 20 * per_replica), (1, 16), (0.2, 0.2), 20,
                      prepare_ms=0.5)
    c = costs.drafter(1)
    sizes = []
    for seed in range(10):
        ctx = context(200 + seed, (16, 32)[seed % 2], 4.0, float(seed % 2), seed % 3)
        full = TreeProposer(order, TreeConfig(budget=20)).grow(ctx)
        by_mass = sorted(zip(full.mass, full.depth), key=lambda md: (-md[0], md[1]))
        masses = [m for m, _ in by_mass]
        auto = _Recording(order, TreeConfig(budget=20), costs)
        factor = [1.0] * len(auto._factor)
        if calibrated:
            factor = [(1.0, 1.6, 0.5, 1.2, 0.3)[d % 5] for d in range(len(factor))]
            auto._factor[:] = factor
        auto.explored = []
        got = auto._propose(ctx)
        (n,) = auto.explored
        assert sorted(got.mass, reverse=True) == masses[: got.tree.size]
        values = [m * factor[d] for m, d in by_mass]
        sums = [1.0 + sum(values[:j]) for j in range(len(values) + 1)]
        rate = [sums[j] / (costs.target(1 + j) + costs.prepare_ms + c * max(j, 1)) for j in range(len(sums))]
        assert max(rate[: n + 1]) >= max(rate) - 1e-12, (seed, n)  # stopped only where nothing longer pays
        spent = costs.prepare_ms + c * n
        cut = [sums[j] / (costs.target(1 + j) + spent) for j in range(n + 1)]
        assert got.tree.size == max(range(n + 1), key=lambda j: (cut[j], -j))
        if got.tree.size == 20:
            assert got.tree == full.tree
        sizes.append((n, got.tree.size))
    assert len({d for _, d in sizes}) > 2  # the sizes follow the round
    assert any(n < 20 for n, _ in sizes)  # the search stopped early: the check above had work to do
    if calibrated and per_replica > 0.02:
        assert any(d < n for n, d in sizes)  # and it looked further than it kept: so did the cut


def test_round_costs_learn_the_rounds_true_curve_and_shrug_off_a_stall():
    """Rounds that cost 2 ms + 1.5x the start-up curve (a longer prefix, verification): the learned table finds
    that within a few dozen rounds; one round stalled by another process moves it by little."""
    import random

    from lm_eval_spot.budget import RoundCosts

    startup = linear_costs(5.0, 0.7, 0.1)
    rc = RoundCosts(startup, 23)
    assert rc.table[9] == pytest.approx(startup.target(9))  # nothing seen: the start-up curve
    rng = random.Random(0)
    truth = lambda r: 2.0 + 1.5 * startup.target(r)  # noqa: E731
    for _ in range(60):
        r = rng.randint(1, 21)
        rc.observe(r, truth(r) * rng.uniform(0.95, 1.05))
    for r in (1, 9, 21):
        assert rc.table[r] == pytest.approx(truth(r), rel=0.08), r
    before = rc.table[9]
    rc.observe(9, 1000.0)
    assert rc.table[9] < 1.15 * before


class _Seen:
    """A proposer that drafts nothing and records what the loop told it about the previous round."""

    budget = 4

    def __init__(self) -> None:
        self.seen: list = []
        self.pending: list[bool] = []

    def propose(self, ctx):
        from lm_eval_spot.decoding.tree import DraftTree

        self.seen.append(ctx.prev_round)
        self.pending.append(ctx.pending)
        return DraftTree.empty()


def test_the_loop_reports_each_rounds_rows_and_time_alone_and_in_a_shared_forward():
    from lm_eval_spot.decoding.batch import DecodeJob, decode_many

    ad = _adapter()
    cfg = DecodeConfig(max_gen_toks=24, temperature=0.0)
    alone = _Seen()
    r = decode(ad, [4, 5, 6], cfg, seed=3, proposer=alone)
    assert alone.seen[0] is None and len(alone.seen) == r.rounds
    # nothing drafted: the root row alone, no lookahead row
    assert all(s.rows == 1 and s.ms > 0 and not s.ahead for s in alone.seen[1:])
    # A finished block rides along with the next block's first forward: the proposer is told so in that round,
    # and the report of that round says so too.
    told = [k for k, p in enumerate(alone.pending) if p]
    reported = [k - 1 for k, s in enumerate(alone.seen) if s is not None and s.pending]
    assert told == reported and len(told) == 1  # 3 prompt tokens + 24 generated in blocks of 16: one new block
    assert alone.pending[told[0]] == 1
    long_prompt = _Seen()  # 2 complete prompt blocks ride along with the first forward
    decode(ad, list(range(4, 4 + 35)), cfg, seed=3, proposer=long_prompt)
    assert long_prompt.pending[0] == 2 and long_prompt.seen[1].pending == 2
    # In a shared forward each request is told its own rows and a cost below the whole round's: its host work
    # plus its rows' share of the forward (here half: both requests run one row).
    together = [_Seen(), _Seen()]
    decode_many(ad, [DecodeJob([4, 5, 6], cfg, 3, proposer=p) for p in together], batch_size=2)
    for p in together:
        assert p.seen[0] is None and len(p.seen) == r.rounds
        assert all(s.rows == 1 and s.ms > 0 and not s.ahead for s in p.seen[1:])
        assert [k - 1 for k, s in enumerate(p.seen) if s is not None and s.pending] == reported


def test_a_requests_own_acceptance_scale_starts_at_one_and_follows_its_verdicts():
    prop = AutoBudgetProposer(LearnedOrder(_drafter("factored")), TreeConfig(budget=20), linear_costs(10.0, 0.01, 0.01))
    ad = _adapter()
    cfg = DecodeConfig(max_gen_toks=40, temperature=1.0)
    fork = prop.for_request()
    decode(ad, [4, 5, 6], cfg, seed=3, proposer=fork)
    assert prop._req_scale == 1.0 and fork.for_request()._req_scale == 1.0
    assert fork._req_predicted > 0
    assert fork._req_scale == pytest.approx((fork._req_accepted + PRIOR_MASS) / (fork._req_predicted + PRIOR_MASS))
    assert abs(fork._req_scale - 1.0) > 0.1  # this request's verdicts moved it (a random drafter's masses are off)


def test_round_costs_take_a_row_counts_own_median_and_forget_it_when_unseen():
    """Where the forward's cost jumps at a batch shape (no curve through the start-up points has the jump), a row
    count seen 3+ times costs its recent median; one not seen for EXPIRE rounds falls back to the estimate from
    its seen neighbours, so a row count once measured dear is tried again."""
    from lm_eval_spot.budget.costs import EXPIRE, RoundCosts

    startup = linear_costs(5.0, 0.7, 0.1)
    rc = RoundCosts(startup, 23)
    for r in (1, 5, 9, 12):
        for _ in range(3):
            rc.observe(r, startup.target(r))
    rc.observe(13, 40.0)
    rc.observe(13, 41.0)
    assert rc.table[13] < 20.0  # two rounds are not enough to believe a jump
    rc.observe(13, 42.0)
    assert rc.table[13] == 41.0 and rc.table[12] == pytest.approx(startup.target(12))
    for _ in range(EXPIRE + 1):
        rc.observe(9, startup.target(9))
    assert rc.table[13] < 20.0  # forgotten: back to the estimate


def test_an_unseen_row_count_is_its_nearest_seen_neighbours_median_plus_the_start_up_increment():
    """Real rounds cost more than the start-up curve's bare forwards. An unseen row count priced by the fit's level
    beside a seen one's real median once made a 2-row round look dearer than its true cost and stopped drafting
    for good; it is priced from the nearest seen row count instead (ties: the smaller)."""
    from lm_eval_spot.budget import RoundCosts

    startup = linear_costs(2.0, 0.5, 0.1)
    rc = RoundCosts(startup, 23)
    for _ in range(5):
        rc.observe(1, 6.0)  # real 1-row rounds: 6 ms against the curve's 2
    a, scale = rc.fitted
    t0 = rc.t0
    assert rc.table[1] == 6.0
    for r in (2, 3, 10):
        assert rc.table[r] == pytest.approx(6.0 + scale * (t0[r] - t0[1]))
    for _ in range(3):
        rc.observe(5, 9.0)
    a, scale = rc.fitted
    assert rc.table[3] == pytest.approx(6.0 + scale * (t0[3] - t0[1]))  # 2 from 1, 2 from 5: the smaller wins
    assert rc.table[4] == pytest.approx(9.0 - scale * (t0[5] - t0[4]))
    assert rc.table[8] == pytest.approx(9.0 + scale * (t0[8] - t0[5]))


def test_drafting_is_skipped_only_where_no_tree_size_could_pay():
    """A round's fixed drafting cost (the features) can pay over several sure nodes and never over one: such a
    round drafts. Where no size up to the budget pays, it is skipped."""
    costs = CostModel((1, 2, 21), (10.0, 10.5, 20.0), (1, 16), (0.1, 0.1), 20, prepare_ms=12.0)
    prop = AutoBudgetProposer(LearnedOrder(_drafter("factored")), TreeConfig(budget=20), costs)
    # one sure node: 2 / (10.5 + 12.1) < 1 / 10 (the old one-node check skipped); ten: 11 / (15 + 13) > 1 / 10
    assert 2 / (costs.target(2) + 12.1) < 1 / costs.target(1) < 11 / (costs.target(11) + 13.0)
    assert prop._root_pays()
    dear = AutoBudgetProposer(LearnedOrder(_drafter("factored")), TreeConfig(budget=20),
                              CostModel((1, 2, 21), (10.0, 20.0, 400.0), (1, 16), (0.1, 0.1), 20, prepare_ms=8.0))
    assert not dear._root_pays()


def test_auto_learns_pending_rounds_costs_apart_skips_lookahead_rounds_and_prices_by_the_round():
    """Lookahead rounds teach no round cost (another path); rounds carrying finished blocks teach their own table,
    and a round the loop says is pending is priced from that table."""
    import dataclasses

    from lm_eval_spot.decoding.proposer import RoundRun
    from test_host_drafter import context, random_factored

    prop = AutoBudgetProposer(LearnedOrder(random_factored(3, d_model=32, n_heads=2, n_layers=1, d_ff=64)),
                              TreeConfig(budget=20), linear_costs(10.0, 0.5, 0.1))
    ctx = context(7, 16, 4.0, 0.0, 2)
    runs = [RoundRun(5, 12.0, False, 0), RoundRun(5, 12.0, True, 0), RoundRun(5, 12.0, True, 1)]
    runs += [RoundRun(5, 40.0, False, 1)] * 3 + [RoundRun(5, 90.0, False, 2)]  # the last: the prompt's blocks
    for run in runs:
        prop.propose(dataclasses.replace(ctx, prev_round=run))
    assert prop.round_costs.seen == 1 and prop.pending_costs.seen == 3
    assert prop.pending_costs.table[5] > 30.0 > prop.round_costs.table[5]
    prop.propose(dataclasses.replace(ctx, pending=1))
    assert prop._table is prop.pending_costs.table
    prop.propose(ctx)
    assert prop._table is prop.round_costs.table


def test_monotone_fit_pools_dips_keeps_jumps_and_weighs_by_rounds():
    from lm_eval_spot.budget import monotone_fit

    line = [1.0, 2.0, 2.0, 5.0, 9.0]
    assert monotone_fit(line, [1.0] * 5) == tuple(line)  # already non-decreasing (a jump at 4): unchanged
    got = monotone_fit([1.0, 3.0, 2.0, 4.0], [1.0, 1.0, 1.0, 1.0])
    assert got == pytest.approx((1.0, 2.5, 2.5, 4.0))  # the dip pooled with its neighbour
    got = monotone_fit([1.0, 3.0, 2.0, 4.0], [1.0, 3.0, 1.0, 1.0])
    assert got == pytest.approx((1.0, 2.75, 2.75, 4.0))  # the better-measured side holds more
    assert all(b >= a for a, b in zip(got, got[1:]))


def test_learned_round_costs_never_fall_with_more_rows():
    """A row count whose few rounds ran fast (noise) must not look cheaper than a smaller one: it would draw every
    round's tree to that size."""
    from lm_eval_spot.budget import RoundCosts

    startup = linear_costs(2.0, 0.5, 0.1)
    rc = RoundCosts(startup, 23)
    for ms in (6.0, 6.1, 6.2):
        rc.observe(8, ms)
    for ms in (5.1, 5.2, 5.3):
        rc.observe(9, ms)
    t = rc.table
    assert all(b >= a - 1e-12 for a, b in zip(t[1:], t[2:]))
    assert t[8] == pytest.approx(t[9]) and t[8] == pytest.approx((6.1 * 3 + 5.2 * 3) / 6)
