"""budget=auto, the default: per step, every live request's drafted rows (0 included) chosen from the forward's cost
at the step's TOTAL rows, drafting's host cost and the verifier's acceptance record. Outputs stay control's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lm_eval_spot.decoding.batch import DecodeRequest, decode_many
from lm_eval_spot.decoding.loop import decode
from lm_eval_spot.decoding.step_policy import (PRIOR_ACCEPT, AcceptanceRecord, LinearCost, RowCosts, StartupCosts,
                                               StepPolicy, StepView, allocate, best_allocation)
from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
from lm_eval_spot.drafter.spot_proposer import LearnedOrder, TreeConfig, TreeProposer

from helpers.targets import adapter_for, jobs_for

DEPTH = 8


def startup(cost, max_rows: int = 64, draft: tuple[float, float] = (0.01, 0.001),
            others: tuple[tuple[float, float], ...] = ()) -> StartupCosts:
    rows = tuple(range(1, max_rows + 1))
    return StartupCosts(rows, tuple(float(cost(r)) for r in rows), *draft, other_drafters=others)


class FakeClock:
    """batch.py's clock: it moves only inside the target forward, by cost(total rows) ms. Every step then costs
    what the injected curve says, and host work costs nothing."""

    def __init__(self, cost) -> None:
        self.now, self.cost = 0.0, cost

    def perf_counter(self) -> float:
        return self.now


def with_clock(monkeypatch, adapter, cost) -> FakeClock:
    import lm_eval_spot.decoding.batch as batch_mod

    clock = FakeClock(cost)
    monkeypatch.setattr(batch_mod, "time", clock)
    inner = adapter.forward_many

    def forward(calls):
        # The forward's true rows: states, finished blocks riding along, the lookahead's next-block row.
        clock.now += cost(sum(int(c.states.shape[0]) + c.session.pending_blocks + (c.ahead is not None)
                              for c in calls)) / 1000
        return inner(calls)

    monkeypatch.setattr(adapter, "forward_many", forward)
    return clock


def spot(budget: int = DEPTH, seed: int = 0) -> TreeProposer:
    torch.manual_seed(seed)
    return TreeProposer(LearnedOrder(FactoredOrderModel(FactoredConfig(max_block_len=16))), TreeConfig(budget=budget))


# ---- the allocation ---------------------------------------------------------------------------------------------
def test_a_row_is_priced_at_its_marginal_cost_not_its_average_share():
    """A forward whose cost is mostly fixed (10 ms + 0.1 ms a row): at 8 requests a row's average share is 1.35 ms
    but one more row costs 0.1 ms. Drafting pays at the margin: every request drafts. Priced at the average share
    (a request's rows x C(R) / R) it would not."""
    gains = np.full((8, DEPTH), 0.7)
    d = allocate(gains, 8, [10 + 0.1 * r for r in range(200)], 0.0, (0.0, 0.0))
    assert all(x == DEPTH for x in d)
    # The same gains against a forward that costs 10 ms a row: no drafted row pays, however it is shared.
    assert allocate(gains, 8, [10.0 * r for r in range(200)], 0.0, (0.0, 0.0)) == [0] * 8


def test_the_allocation_drafts_where_the_gain_is_and_never_where_it_cannot_draft():
    """A request that cannot draft (no stale conditionals) gets 0; requests the record trusts more get the rows
    first; a per-request drafting cost concentrates rows on fewer requests."""
    gains = np.array([[0.9] * 4, [0.0] * 4, [0.3] * 4, [0.6] * 4])
    cost = [4.0 + 0.2 * r for r in range(100)]
    d = allocate(gains, 4, cost, 0.0, (0.0, 0.0))
    assert d[1] == 0 and d[0] >= d[3] >= d[2] and d[3] > 0
    # Drafting costs 3 ms of host work per drafting request: fewer requests draft.
    dear = allocate(gains, 4, cost, 0.0, (3.0, 0.0))
    assert sum(x > 0 for x in dear) < sum(x > 0 for x in d)


def test_host_work_outside_the_forward_makes_a_committed_token_worth_more():
    """The step's other host work is paid whatever is drafted: the larger it is, the more a drafted row's gain is
    worth against its forward cost."""
    gains = np.full((4, DEPTH), 0.4)
    cost = [2.0 * r for r in range(100)]  # 2 ms a row: a 0.4 gain per row never pays on its own
    assert allocate(gains, 4, cost, 0.0, (0.0, 0.0)) == [0] * 4
    assert sum(allocate(gains, 4, cost, 40.0, (0.0, 0.0))) > 0


def test_one_requests_allocation_is_the_best_rate_with_the_deepest_near_tie():
    """At batch size 1 (a plain-Python path): against rates written out here for every depth, the choice is the
    deepest depth within DEPTH_TOLERANCE of the best rate, nothing unless that beats control's rate by MIN_GAIN."""
    from lm_eval_spot.decoding.step_policy import DEPTH_TOLERANCE, MIN_GAIN

    rng = np.random.default_rng(0)
    drafted = 0
    for _ in range(300):
        D = int(rng.integers(1, 17))
        g = np.minimum.accumulate(rng.uniform(0, 1, D))[None, :] * rng.uniform(0, 1)
        extra = (rng.uniform(0, 1, D) < 0.2).astype(np.int64)[None, :]
        curve = np.cumsum(rng.uniform(0.05, 3.0, 80)) + rng.uniform(0, 5)
        host, fixed, node, scale, base_rows = (float(x) for x in rng.uniform(0, 2, 5))
        base_rows = int(base_rows * 3) + 1
        got, rate = best_allocation(g, base_rows, curve.tolist(), host, (fixed, node), extra=extra, scale=scale)
        control = 1 / (curve[base_rows] + host)
        rates = []
        for d in range(1, D + 1):
            rows = base_rows + d + int(extra[0, :d].sum())
            added = curve[min(rows, 79)] - curve[base_rows] + fixed + d * node
            rates.append((1 + g[0, :d].sum()) / (curve[base_rows] + host + scale * added))
        best = max(rates)
        if best <= control * (1 + MIN_GAIN):
            assert got == [0] and rate == pytest.approx(control)
            continue
        want = max(d for d, r in enumerate(rates, 1) if r >= best * (1 - DEPTH_TOLERANCE) and r > control * (1 + MIN_GAIN))
        assert got == [want] and rate == pytest.approx(rates[want - 1])
        drafted += 1
    assert 30 < drafted < 270  # both outcomes were exercised


# ---- what the policy learns -------------------------------------------------------------------------------------
def test_the_acceptance_record_follows_verdicts_stays_non_increasing_and_drifts_back_when_untried():
    rec = AcceptanceRecord(4)
    assert rec.rates(False) == pytest.approx([PRIOR_ACCEPT ** k for k in (1, 2, 3, 4)])
    for _ in range(50):
        rec.add(False, 2, [1])  # the best node accepted, the second never
        rec.forget()
    a = rec.rates(False)
    assert a[0] > 0.9 * (50 / 52) and a[1] < 0.1 and list(a) == sorted(a, reverse=True)
    assert rec.rates(True) == pytest.approx([PRIOR_ACCEPT ** k for k in (1, 2, 3, 4)])  # lead rounds: apart
    for _ in range(2000):  # ranks left untried lean back to the optimistic prior: they get tried again
        rec.forget()
    assert rec.rates(False)[1] > 0.75


def test_the_cost_curves_learn_the_steps_real_costs_and_shrug_off_a_stall():
    base = startup(lambda r: 1.0 + r)  # the start-up curve: 1 ms + 1 ms a row
    costs = RowCosts(base, 65)
    for _ in range(200):  # the run's forwards really cost twice that
        for r in (8, 16, 32):
            costs.observe(r, 2 * (1.0 + r))
    assert costs(16) == pytest.approx(34.0, rel=0.05) and costs(100) > costs(64) > costs(32)
    costs.observe(16, 1e6)  # one step stalled by another process
    assert costs(16) == pytest.approx(34.0, rel=0.1)
    line = LinearCost(1.0, 0.0)
    for x in range(200):
        line.observe(x % 9, 0.5 + 0.25 * (x % 9))
    assert line.a == pytest.approx(0.5, abs=0.1) and line.b == pytest.approx(0.25, abs=0.03)


def test_a_request_that_stopped_drafting_is_tried_again_and_one_zero_choice_skips_no_step():
    """Two traps measured at batch size 1: a request whose own acceptances fell far below the record's stopped
    drafting and, learning nothing more, never drafted again; and one choice that drafted nothing made the next 7
    steps skip the choice. A request's own record fades while it does not draft, and the skipping backs off."""
    from lm_eval_spot.decoding.step_policy import StepView

    policy = StepPolicy(startup(lambda r: 4.0 + 0.3 * r), DEPTH, 2 * (DEPTH + 2))
    pace, good = policy.pace(), policy.pace()
    for _ in range(20):  # a request whose drafts were always rejected beside one whose drafts were all accepted:
        policy.verdict(pace, False, 6, [])  # the first's own scale falls far below 1
        for _ in range(3):
            policy.verdict(good, False, 6, [1, 2, 3, 4, 5, 6])
    low = pace.scale
    assert low < 0.3
    view = lambda: [StepView(True, False, pace.scale)]  # noqa: E731
    assert policy.plan(view()) == [0]  # at that scale, nothing pays
    policy.verdict(pace, False, 0, [])
    # One zero choice: the next step chooses again (no skipped step), and each control round lifts the scale.
    plans = []
    for _ in range(30):
        plans.append(policy.plan(view())[0])
        policy.verdict(pace, False, plans[-1], [1, 2, 3, 4, 5, 6][: plans[-1]])
        if plans[-1]:
            break
    assert plans[-1] > 0 and pace.scale > low, (plans, pace.scale)
    # Where nothing ever pays the choice backs off to every IDLE_EVERY-th step: 1, 2, 4, then 8 steps apart.
    from lm_eval_spot.decoding import step_policy as sp

    dear = StepPolicy(startup(lambda r: 100.0 * r), DEPTH, 2 * (DEPTH + 2))
    chosen = []
    for step in range(40):
        calls = []
        original = dear.record.rates
        dear.record.rates = lambda led, _o=original, _c=calls: (_c.append(1), _o(led))[1]  # type: ignore[method-assign]
        assert dear.plan([StepView(True, False, 1.0)]) == [0]
        dear.record.rates = original  # type: ignore[method-assign]
        if calls:
            chosen.append(step)
    assert chosen[:5] == [0, 1, 3, 7, 15] and all(b - a == sp.IDLE_EVERY for a, b in zip(chosen[4:], chosen[5:]))


# ---- end to end through decode_many, with an injected clock ----------------------------------------------------
@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("bs", [1, 4])
def test_a_steep_cost_drafts_nothing_and_a_flat_one_drafts(monkeypatch, T, bs):
    """A forward whose cost grows steeply with its rows (10 ms x rows squared: a drafted row always costs more
    than the tokens it can bring, even beside a finished block riding along): the policy drafts 0 rows in every
    round, the run's NFE and host bytes are control's (no stale summary crossed: no drafter work at all). A forward
    whose cost does not grow with its rows: it drafts, and saves forwards. Every output equals control's."""
    L = 8
    adapter = adapter_for(L, seed=3, scale=1.0)
    control = [decode(adapter, j.prompt_ids, j.cfg, j.seed) for j in jobs_for(L, T, None, n=6, lookahead=True)]
    for cost, drafts in ((lambda r: 10.0 * r * r, False), (lambda r: 10.0, True)):
        with_clock(monkeypatch, adapter, cost)
        prop = spot()
        prop.order.refresh()
        calls = []
        real = prop.order.prepare
        monkeypatch.setattr(prop.order, "prepare", lambda *a: calls.append(1) or real(*a))
        policy = StepPolicy(startup(cost), DEPTH, 64)
        out = decode_many(adapter, jobs_for(L, T, prop, n=6, lookahead=True), bs, policy=policy)
        for c, o in zip(control, out, strict=True):
            assert o.token_ids == c.token_ids and o.stop_reason == c.stop_reason
        nfe, ctrl_nfe = sum(o.nfe.total for o in out), sum(c.nfe.total for c in control)
        shares = policy.report.shares()
        if drafts:
            assert nfe < ctrl_nfe and shares.get("0", 0.0) < 0.5
        else:
            assert nfe == ctrl_nfe and shares == {"0": 1.0} and not calls
            assert [o.host_bytes for o in out] == [c.host_bytes for c in control]


def oracle_case():
    """A saturated target (ties), a forward of 4 ms + 1 ms a row, 6 requests and their control decodes, each with
    the commit log an oracle drafts from."""
    from lm_eval_spot.baselines.oracle import CommitLog

    L = 8
    adapter = adapter_for(L, seed=3, scale=40.0)
    cost = lambda r: 4.0 + 1.0 * r  # noqa: E731
    jobs = jobs_for(L, 0.0, None, n=6)
    logs = [CommitLog() for _ in jobs]
    control = [decode(adapter, j.prompt_ids, j.cfg, j.seed, observer=lg) for j, lg in zip(jobs, logs, strict=True)]
    return adapter, cost, jobs, logs, control


def test_a_drafter_that_is_often_wrong_drafts_less_than_one_that_is_right(monkeypatch):
    """The same target and costs (a forward of 4 ms + 1 ms a row): the oracle's commit order (every node right)
    against a random-weight drafter. The policy's acceptance record makes the first draft far more rows per
    round; both give control's output."""
    from lm_eval_spot.baselines.oracle import OracleProposer

    adapter, cost, jobs, logs, control = oracle_case()
    drafted = {}
    for name in ("random", "right"):
        with_clock(monkeypatch, adapter, cost)
        policy = StepPolicy(startup(cost), DEPTH, 64)
        props = [spot(seed=7) if name == "random" else OracleProposer(lg, DEPTH, stale_only=True) for lg in logs]
        run = [DecodeRequest(j.prompt_ids, j.cfg, j.seed, proposer=p) for j, p in zip(jobs, props, strict=True)]
        out = decode_many(adapter, run, 3, policy=policy)
        assert [o.token_ids for o in out] == [c.token_ids for c in control]
        drafted[name] = sum(sum(o.drafted) for o in out) / sum(o.rounds for o in out)
    assert drafted["right"] > 2 * drafted["random"], drafted


def test_each_step_drafts_with_the_drafter_whose_own_costs_pay_best():
    """Two drafters of like acceptance: the one with the cheaper host pass drafts; made dear, the other does. A
    drafter whose record says it is never right is passed over for one that is."""
    cost = lambda r: 4.0 + 0.5 * r  # noqa: E731
    views = [StepView(True, False, 1.0)] * 2
    for first, second, want in (((3.0, 0.3), (0.05, 0.01), 1), ((0.05, 0.01), (3.0, 0.3), 0)):
        policy = StepPolicy(startup(cost, draft=first, others=(second,)), DEPTH, 64, ("learned", "conf-tree"))
        budgets, option = policy.plan_step(views)
        assert option == want and sum(budgets) > 0
    costs = startup(cost, draft=(0.05, 0.01), others=((0.05, 0.01),))
    policy = StepPolicy(costs, DEPTH, 64, ("learned", "conf-tree"))
    pace = policy.pace()
    for _ in range(30):  # the first drafter's nodes are never accepted, the second's always
        policy.verdict(pace, False, 6, [], option=0)
        policy.verdict(pace, False, 6, [1, 2, 3, 4, 5, 6], option=1)
    assert policy.plan_step(views)[1] == 1
    with pytest.raises(ValueError, match="names"):
        StepPolicy(costs, DEPTH, 64)


def test_the_run_drafts_with_the_drafter_the_policy_chose_and_stays_exact(monkeypatch):
    """Per request a random-weight drafter and its own commit oracle as options: the policy learns that the
    second is right and drafts with it, the rounds really use it (far fewer forwards than the random drafter
    alone), and the outputs are control's."""
    from lm_eval_spot.baselines.oracle import OracleProposer
    from lm_eval_spot.decoding.proposer import DrafterOptions

    adapter, cost, jobs, logs, control = oracle_case()
    nfe = {}
    for name in ("random", "choice"):
        with_clock(monkeypatch, adapter, cost)
        both = name == "choice"
        costs = startup(cost, others=((0.01, 0.001),) if both else ())
        policy = StepPolicy(costs, DEPTH, 64, ("random", "oracle") if both else ("random",))
        props = [DrafterOptions((spot(seed=7), OracleProposer(lg, DEPTH, stale_only=True)), ("random", "oracle"))
                 if both else spot(seed=7) for lg in logs]
        run = [DecodeRequest(j.prompt_ids, j.cfg, j.seed, proposer=p) for j, p in zip(jobs, props, strict=True)]
        out = decode_many(adapter, run, 3, policy=policy)
        assert [o.token_ids for o in out] == [c.token_ids for c in control]
        nfe[name] = sum(o.nfe.total for o in out)
        if both:
            assert policy.report.drafter_shares()["oracle"] > 0.8
            assert set(policy.summary()["drafters"]) == {"random", "oracle"}
    assert nfe["choice"] < 0.8 * nfe["random"], nfe


def test_the_model_class_runs_the_policy_by_default_and_reports_it(tmp_path):
    """No budget given: budget=auto, its start-up curve, the share of rounds at each drafted-row count and its
    start-up time in the results and the run summary; generations equal paired control's."""
    from lm_eval.api.instance import Instance

    from lm_eval_spot.harness.model import SpotDLM
    from lm_eval_spot.reports.run_stats import format_summary

    lm = SpotDLM(control="paired", seed=1, batch_size=2)
    reqs = [Instance("generate_until", {}, (f"Q: {a}+{b}-3=", {"until": ["\n\n"], "max_gen_toks": 40}), i)
            for i, (a, b) in enumerate(((12, 7), (3, 45), (60, 9)))]
    lm.generate_until(reqs)
    spot_block = lm.get_model_info()["spot"]
    assert spot_block["budget"] == "auto" and spot_block["exact_match_to_control"] == 1.0
    pol = spot_block["budget_policy"]
    assert pol["startup_s"] > 0 and pol["cost_curve_ms"]["1"] > 0 and "8" in pol["cost_curve_ms"]
    assert sum(pol["drafted_rows_share"].values()) == pytest.approx(1.0, abs=1e-3)
    text = format_summary(spot_block)
    assert "budget=auto: rounds by drafted rows" in text and "start-up measurement s" in text
    # the embedded drafter and conf-tree, chosen per step; every drafting round counted for one of them
    assert set(pol["drafters"]) == {lm.drafter_path.name, "conf-tree"} and "rounds by drafter" in text
    assert sum(d["share_of_drafting_rounds"] for d in pol["drafters"].values()) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("adapt", ["auto", "online"])
def test_adaptation_under_auto_runs_only_after_chunks_that_drafted(tiny_target_dir, adapt):
    """adapt=auto (the transfer drafter's default) adapts on a chunk only when budget=auto drafted in enough of the
    previous chunk's rounds (never on the first): a policy made to find every drafted row too dear (a steep
    start-up curve) leaves every chunk unadapted, at no recording or training cost. adapt=online always adapts."""
    from dataclasses import replace

    from lm_eval.api.instance import Instance

    from lm_eval_spot.harness.model import SpotDLM

    lm = SpotDLM(pretrained=str(tiny_target_dir), adapt=adapt, seed=3, batch_size=2)
    assert lm.policy is not None and lm.generation.online is not None
    steep = StepPolicy(startup(lambda r: 1000.0 * r), DEPTH, 64)
    lm.policy = steep
    lm.generation.setup = replace(lm.generation.setup, policy=steep)
    reqs = [Instance("generate_until", {}, (f"Hi {i}", {"until": ["\n\n"], "max_gen_toks": 12}), i) for i in range(6)]
    lm.generate_until(reqs)
    summary = lm.get_model_info()["spot"]
    assert summary["budget_policy"]["drafted_rows_share"] == {"0": 1.0}
    if adapt == "auto":
        assert summary["adapt"]["chunks_skipped"] == 3 and summary["adapt"]["examples"] == 0
    else:
        assert summary["adapt"]["chunks_skipped"] == 0 and summary["adapt"]["examples"] > 0


def test_the_start_up_measurement_times_every_row_count_it_will_price():
    """On a tiny target: the forward timed at 1..16 rows and on a grid up to 6 rows per request of the batch
    size, every figure positive, the curve it gives never falling with rows; drafting's costs non-negative."""
    from lm_eval_spot.budget import measure_startup, row_grid

    assert row_grid(8)[:8] == tuple(range(1, 9)) and row_grid(8)[-1] == 8
    grid = row_grid(48)
    assert grid[:16] == tuple(range(1, 17)) and grid[-1] == 48 and list(grid) == sorted(set(grid))
    adapter = adapter_for(8, seed=3, scale=1.0)
    costs = measure_startup(adapter, spot(), batch_size=4, gen_length=24, repeats=2)
    assert costs.rows == row_grid(24) and all(ms > 0 for ms in costs.forward_ms)
    curve = costs.curve(40)
    assert all(b >= a for a, b in zip(curve[1:], curve[2:])) and curve[30] >= curve[24]
    assert costs.draft_fixed_ms >= 0 and costs.draft_node_ms >= 0 and costs.seconds > 0


def test_drafting_that_costs_more_than_estimated_is_scaled_up_from_the_measurements():
    """Steps without drafting run at their estimate; steps that draft take twice the estimated addition: the
    check's scale goes to 2, and `allocate` then weighs drafting's added cost at twice the estimate (a choice
    that paid at the estimate no longer does)."""
    from lm_eval_spot.decoding.step_policy import DraftingCheck

    check = DraftingCheck()
    assert check.scale == 1.0
    for _ in range(30):
        check.observe(measured=20.0, base=20.0, added=0.0)
        check.observe(measured=20.0 + 2 * 8.0, base=20.0, added=8.0)
    assert check.scale == pytest.approx(2.0, rel=0.02)
    gains = np.full((4, DEPTH), 0.5)
    cost = [10.0 + 2.0 * r for r in range(100)]
    assert sum(allocate(gains, 4, cost, 2.0, (0.5, 0.0))) > 0
    assert sum(allocate(gains, 4, cost, 2.0, (0.5, 0.0), scale=check.scale)) == 0


def test_a_bidirectional_target_is_measured_again_at_the_requests_canvas_and_a_block_causal_one_is_not():
    """budget=auto's start-up curve is taken before any request is known (at 256 generated tokens); on a fully
    bidirectional target a row costs its whole canvas, so before the first step it is taken again at the requests'
    canvas (median prompt + their generation length) unless that is within CANVAS_SLACK of the measured one.
    A block-causal target's row is its block: its curve stands."""
    import transformers

    from lm_eval_spot.adapters.base import TargetInfo
    from lm_eval_spot.adapters.bidirectional import BidirectionalAdapter
    from lm_eval_spot.adapters.native_canvas import NativeCanvas
    from lm_eval_spot.budget import CanvasCheck, measure_startup

    L, V = 8, 40
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                                   max_position_embeddings=512, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).eval()
    bidir = BidirectionalAdapter(model, TargetInfo(2, frozenset({1}), L, "prompt_end", True, V),
                                 NativeCanvas(shifted=False))
    for adapter, refits in ((bidir, True), (adapter_for(L, seed=3, scale=1.0), False)):
        prop = spot()
        policy = StepPolicy(measure_startup(adapter, prop, 1, gen_length=256, repeats=1), DEPTH, 64)
        first = policy.startup
        assert first.canvas == 2 * L + 256
        pace = policy.pace()
        policy.verdict(pace, False, 4, [1, 2])  # learned before the check: forgotten when it measures again
        check = CanvasCheck(adapter, prop, 1)
        assert check.fit(policy, [10, 13, 12], 24) is refits
        if refits:
            assert policy.startup.canvas == 12 + 24 and policy.startup.seconds > first.seconds
            assert policy.report.drafted_rows == {} and policy.record.rates(False)[0] == pytest.approx(PRIOR_ACCEPT)
            assert not check.fit(policy, [12, 14], 24)  # within the slack: the curve stands
        else:
            assert policy.startup is first and policy.report.drafted_rows == {4: 1}
    # Where the run knows no generation length, a bidirectional target is measured only once, at the requests'.
    from lm_eval_spot.budget import build_policy

    deferred = build_policy(bidir, spot(), 1, 256, defer=True)
    assert deferred.startup.canvas == 0 and deferred.startup.seconds == 0.0
    assert CanvasCheck(bidir, spot(), 1).fit(deferred, [12], 24) and deferred.startup.canvas == 12 + 24
