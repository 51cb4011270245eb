"""Issue 40: online adaptation of the drafter from the run's own verified commits. It never changes an output,
learns only from verified commits, moves weights only between chunks (never inside a round), is deterministic
given seed / batch size / process count, recovers a bad starting drafter's NFE, and is kept and reported."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance

from lm_eval_spot.arith.generator import make_prompt, make_split
from lm_eval_spot.settings.args import SpotArgError, parse_args
from lm_eval_spot.drafter.data import TrajectoryRecorder
from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
from lm_eval_spot.drafter.model import DrafterMeta, load_drafter, save_drafter
from lm_eval_spot.drafter.spot_proposer import LearnedOrder
from lm_eval_spot.harness.generation import GenerationRunner
from lm_eval_spot.harness.model import SpotDLM
from lm_eval_spot.reports.run_stats import format_summary, nfe_by_tenth


def _arith(n: int, T: float = 0.0, max_toks: int = 96) -> list[Instance]:
    kw = {"do_sample": True, "temperature": T} if T else {}
    return [Instance("generate_until", {}, (make_prompt(p["question"]), {"until": ["Q:"], "max_gen_toks": max_toks,
                                                                          **kw}), i)
            for i, p in enumerate(make_split("test", n))]


def _short(n: int, T: float = 0.0) -> list[Instance]:
    kw = {"do_sample": True, "temperature": T} if T else {}
    return [Instance("generate_until", {}, (f"Q: {i}+{3 * i}=", {"until": ["\n\n"], "max_gen_toks": 20, **kw}), i)
            for i in range(n)]


@pytest.fixture(scope="module")
def random_drafter(tmp_path_factory) -> Path:
    """A deliberately bad starting drafter: random weights."""
    folder = tmp_path_factory.mktemp("random_drafter")
    torch.manual_seed(0)
    save_drafter(FactoredOrderModel(FactoredConfig()), DrafterMeta(2, 32, (32,), "none", "none"), folder)
    return folder


def _weights_digest(folder: Path) -> str:
    return hashlib.sha256((folder / "drafter.safetensors").read_bytes()).hexdigest()


# ---- the arguments --------------------------------------------------------------------------------------------
def test_adapt_arguments_are_validated():
    assert parse_args({}).adapt == "auto"
    with pytest.raises(SpotArgError, match="adapt='sometimes' is not known; accepted: auto, online, off"):
        parse_args({"adapt": "sometimes"})
    with pytest.raises(SpotArgError, match="adapt=online trains the learned drafter"):
        parse_args({"adapt": "online", "mode": "conf-tree"})
    with pytest.raises(SpotArgError, match="drafter_out=.* accepted with mode in"):
        parse_args({"drafter_out": "x", "adapt": "off"})


def test_adaptation_is_on_by_default_for_the_transfer_drafter_only(tiny_target_dir):
    assert SpotDLM(pretrained=str(tiny_target_dir)).generation.online is not None  # the transfer drafter: not its own
    assert SpotDLM().generation.online is None  # the embedded target with its own drafter
    assert SpotDLM(adapt="online").generation.online is not None  # asked for
    assert SpotDLM(pretrained=str(tiny_target_dir), adapt="off").generation.online is None
    assert SpotDLM(pretrained=str(tiny_target_dir), mode="conf-tree").generation.online is None


# ---- the bar's behaviours -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recovered(random_drafter, tmp_path_factory):
    """The embedded target drafted by a random-weight drafter: adapting (paired with control) and not."""
    out = tmp_path_factory.mktemp("adapted")
    reqs = _arith(40)
    on = SpotDLM(budget=8, drafter=str(random_drafter), adapt="online", control="paired", seed=0, drafter_out=str(out),
                 adapt_roots=32)
    on.generate_until(reqs)
    off = SpotDLM(budget=8, drafter=str(random_drafter), adapt="off", seed=0)
    off.generate_until(reqs)
    return on, off, out


def test_adaptation_recovers_a_random_drafters_nfe_and_never_changes_an_output(recovered):
    on, off, _ = recovered
    assert on.generation.paired.same and all(on.generation.paired.same)  # every output equal to control's
    tenths_on = nfe_by_tenth([s.nfe for s in on.generation.stats.samples])
    tenths_off = nfe_by_tenth([s.nfe for s in off.generation.stats.samples])
    # the first tenth drafted with (nearly) the random weights: alike; by the last, adaptation is far ahead
    assert abs(tenths_on[0] - tenths_off[0]) < 0.15 * tenths_off[0]
    assert sum(tenths_on[-3:]) < 0.9 * sum(tenths_off[-3:]), (tenths_on, tenths_off)  # measured: about 0.82
    spot = on.get_model_info()["spot"]
    a = spot["adapt"]
    sched = a["schedule"]
    assert a["requests"] == 40 and a["examples"] > 40 * 50
    assert a["update_steps"] == 40 * sched["roots_per_request"] // sched["batch"]
    assert a["updates"] == 40 // sched["every"]
    assert a["nfe_by_tenth"] == pytest.approx(tenths_on) and 0 < a["share_of_wall"] < 1
    text = format_summary(spot)
    assert "online adaptation" in text and "NFE / sample by tenth" in text


def test_the_adapted_drafter_is_kept_and_loads(recovered, random_drafter):
    on, _, out = recovered
    model, meta = load_drafter(out, 32)
    assert meta.extra["adapted"]["from"] == str(random_drafter)
    assert meta.extra["adapted"]["examples"] == on.generation.online.examples and meta.extra["adapted"]["requests"] == 40
    assert meta.target == on.args.pretrained
    assert _weights_digest(out) != _weights_digest(random_drafter)
    for a, b in zip(model.state_dict().values(), on.generation.online.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # what was saved is what the run ended with
    # the next run drafts with it: fewer NFE than the random start, outputs as exact
    nxt = SpotDLM(budget=8, drafter=str(out), adapt="off", seed=0)
    nxt.generate_until(_arith(8))
    first = [s.nfe for s in on.generation.stats.samples[:8]]
    assert sum(s.nfe for s in nxt.generation.stats.samples) < 0.8 * sum(first)


@pytest.mark.parametrize("T,batch_size", [(0.0, 1), (1.0, 3)])
def test_two_runs_with_one_seed_give_the_same_nfe_per_sample(tiny_target_dir, T, batch_size):
    runs = []
    for _ in range(2):
        lm = SpotDLM(budget=8, pretrained=str(tiny_target_dir), adapt="online", seed=5, batch_size=batch_size)
        lm.generate_until(_short(12, T))
        runs.append(([s.nfe for s in lm.generation.stats.samples], [p.detach().clone() for p in lm.generation.online.model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_adapting_at_batch_size_n_stays_exact(tiny_target_dir, T):
    lm = SpotDLM(budget=8, pretrained=str(tiny_target_dir), adapt="online", control="paired", seed=2, batch_size=4)
    lm.generate_until(_short(12, T))
    assert len(lm.generation.paired.same) == 12 and all(lm.generation.paired.same)
    assert lm.generation.online.updates == 3  # one update per chunk of 4


def test_weights_move_only_between_steps_as_requests_finish(tiny_target_dir, monkeypatch):
    """Every round of a step drafts with one weight version; the drafter trains only between steps, as requests
    finish in the continuous batch (every 4 new ones), so the version steps several times within one batch of 8."""
    lm = SpotDLM(budget=8, pretrained=str(tiny_target_dir), adapt="online", seed=1, batch_size=8)
    online = lm.generation.online
    step = [0]
    seen: list[tuple[int, int]] = []  # (step, version) per round that drafted
    moved_after: list[int] = []  # per update that moved weights: the steps run before it
    adapter = lm.generation.setup.adapter
    forward, prepare, update = adapter.forward_many, LearnedOrder.prepare, online.update

    def spy_forward(calls):
        out = forward(calls)
        step[0] += 1
        return out

    def spy_prepare(self, ctx):
        seen.append((step[0], online.version))
        return prepare(self, ctx)

    def spy_prepare_many(self, ctxs):
        seen.extend((step[0], online.version) for _ in ctxs)
        return [prepare(self, c) for c in ctxs]

    def spy_update():
        moved = update()
        if moved:
            moved_after.append(step[0])
        return moved

    monkeypatch.setattr(adapter, "forward_many", spy_forward)
    monkeypatch.setattr(LearnedOrder, "prepare", spy_prepare)
    monkeypatch.setattr(LearnedOrder, "prepare_many", spy_prepare_many)
    monkeypatch.setattr(online, "update", spy_update)
    lm.generate_until(_short(24))
    by_step: dict[int, set[int]] = {}
    for s, v in seen:
        by_step.setdefault(s, set()).add(v)
    assert all(len(v) == 1 for v in by_step.values())  # never inside a step
    versions = [next(iter(by_step[s])) for s in sorted(by_step)]
    assert versions == sorted(versions)
    assert len(moved_after) == online.updates == online.version >= 4  # 24 requests, an update owed every 4
    for k, s in enumerate(moved_after):  # each update is read from the next step on (rounds of step t: t steps before)
        assert all(v >= k + 1 for t, v in seen if t >= s) and all(v <= k for t, v in seen if t < s)
    assert len(set(versions)) >= 4  # updates land while the batch runs, not only where a batch of 8 would end


@pytest.mark.parametrize("T,batch_size", [(0.0, 1), (1.0, 2)])
def test_the_buffer_holds_exactly_the_commits_control_makes(tiny_target_dir, random_drafter, T, batch_size):
    """Adaptation learns from verified commits only: per request, the (slot, token) sequence control commits,
    never a drafted state the target did not visit nor a rejected draft's token."""
    from lm_eval_spot.decoding.loop import DecodeConfig, decode
    from lm_eval_spot.families import load_target

    lm = SpotDLM(pretrained=str(tiny_target_dir), adapt="online", seed=4, batch_size=batch_size, budget=4)
    kept = []
    add = lm.generation.online.add
    lm.generation.online.add = lambda t: (kept.append(t), add(t))  # type: ignore[method-assign]
    reqs = _short(6, T)
    lm.generate_until(reqs)
    assert any(s.accepted_per_round > 0 for s in lm.generation.stats.samples)  # drafts were accepted
    ad = load_target(parse_args({"pretrained": str(tiny_target_dir), "mode": "control"})).adapter
    for job, t in zip(lm._plan(reqs), kept, strict=True):
        rec = TrajectoryRecorder(0, 0)
        decode(ad, list(job.prompt_ids), DecodeConfig(max_gen_toks=20, temperature=T), seed=job.seed, observer=rec)
        ref = rec.result(ad.info.mask_id)
        assert list(zip(t.pos.tolist(), t.tok.tolist())) == list(zip(ref.pos.tolist(), ref.tok.tolist()))
        assert torch.equal(t.committed, ref.committed)


def test_data_parallel_ranks_adapt_independently_and_report_each():
    from lm_eval_spot.drafter.online import adapt_across_ranks

    a = {"requests": 3, "examples": 60, "update_steps": 6, "updates": 3, "seconds": 0.5, "recording_s": 0.1,
         "rank": 0, "nfe_by_tenth": [5.0], "share_of_wall": 0.05}
    b = {**a, "rank": 1, "requests": 2, "examples": 40, "update_steps": 4, "updates": 2, "seconds": 0.9}
    merged = adapt_across_ranks([a, b])
    assert merged["ranks"] == "independent" and merged["requests"] == 5 and merged["examples"] == 100
    assert merged["per_rank"] == [a, b] and merged["seconds"] == 1.0
    assert adapt_across_ranks([a]) is a and adapt_across_ranks([]) is None
    text = format_summary({"mode": "spot", "samples": 5, "temperature": 0.0, "nfe_per_sample": 5.0,
                           "gen_tokens_per_sample": 1.0, "tokens_per_forward": 1.0, "mean_accepted_per_round": 0.0,
                           "gen_tokens_per_s": 1.0, "wall_s": 1.0, "adapt": merged})
    assert "online adaptation (rank 0)" in text and "online adaptation (rank 1)" in text
    assert json.dumps(merged)  # JSON-ready for config.spot
