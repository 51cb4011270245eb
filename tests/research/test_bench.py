"""The benchmark command end to end on the embedded target (one problem, a few methods)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from research.bench import main


def test_bench_writes_results_table_and_plots(tmp_path):
    out = tmp_path / "bench"
    main(["--n", "1", "--methods", "free-chain,graph,spot,oracle", "--budgets", "2,4", "--temps", "0,1",
          "--threads", "1", "--repeats", "2", "--out", str(out)])
    res = json.loads((out / "results.json").read_text())
    rows = res["rows"]
    # 4 methods x 2 budgets x 2 temperatures + spot budget=auto and control per temperature
    assert len(rows) == 4 * 2 * 2 + 2 + 2
    assert all(r["exact_match_to_control"] == 1.0 for r in rows)
    assert all(set(r["round_s_per_sample"]) == {"forward", "drafting", "rest"} for r in rows)
    assert all(r["host_bytes_per_round"] > 0 for r in rows)
    oracle = {(r["budget"], r["temperature"]): r["nfe_per_sample"] for r in rows if r["method"] == "oracle"}
    spot = {(r["budget"], r["temperature"]): r["nfe_per_sample"] for r in rows if r["method"] == "spot"}
    control = [r for r in rows if r["method"] == "control"]
    assert all(oracle[k] <= spot[k] < control[0]["nfe_per_sample"] for k in oracle)
    table = (out / "table.md").read_text()
    assert "| spot | auto |" in table and "python -m research.bench" in table
    assert res["repeats"] == 2
    # budget=auto against the best fixed SPOT budget, per temperature: the bar's ratio and the paired one
    cmp = res["auto_vs_best_fixed"]
    assert [c["temperature"] for c in cmp] == [0.0, 1.0] and all(c["best_fixed"].startswith("spot D=") for c in cmp)
    assert all(c["ratio_of_medians"] > 0 and c["paired_q25"] <= c["paired_median"] <= c["paired_q75"] for c in cmp)
    assert "budget=auto reaches" in table
    for png in ("nfe_vs_budget.png", "throughput_vs_budget.png"):
        assert (out / png).stat().st_size > 5000


SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


@pytest.mark.skipif(not (SHARED_DATA / "openai" / "gsm8k").is_dir(), reason="../shared/data (real GSM8K) absent")
def test_bench_takes_prompts_and_scoring_from_a_stock_lm_eval_task(tmp_path, monkeypatch):
    """--tasks gsm8k: the stock lm-eval task's prompts, stop strings and metric (offline, from ../shared/data)."""
    monkeypatch.chdir(SHARED_DATA)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = tmp_path / "bench"
    main(["--tasks", "gsm8k", "--n", "1", "--methods", "spot", "--budgets", "4", "--temps", "0", "--no-auto",
          "--max-gen-toks", "16", "--threads", "1", "--out", str(out)])
    res = json.loads((out / "results.json").read_text())
    assert res["task"] == "gsm8k"
    assert all(r["n"] == 1 and r["exact_match_to_control"] == 1.0 for r in res["rows"])


def test_bench_runs_other_drafters_and_compares_spot_with_the_baselines(tmp_path):
    """--drafters adds spot@NAME rows in the same paired run; the results say SPOT's NFE against the fewest
    baseline NFE per budget and the best SPOT throughput against the best graph's; lookahead counts per row."""
    from lm_eval_spot.settings.args import default_drafter_path

    out = tmp_path / "bench"
    main(["--n", "1", "--methods", "graph,free-chain,spot", "--budgets", "4,8", "--temps", "0", "--no-auto",
          "--threads", "1", "--drafters", f"again={default_drafter_path()}", "--out", str(out)])
    res = json.loads((out / "results.json").read_text())
    rows = {(r["method"], r["budget"]): r for r in res["rows"]}
    for D in (4, 8):
        # the same drafter under another name: the same trees, so the same NFE
        assert rows[("spot@again", D)]["nfe_per_sample"] == rows[("spot", D)]["nfe_per_sample"]
        assert rows[("spot", D)]["lookahead"]["later_blocks"] >= 1
    assert res["other_drafters"] == {"again": str(default_drafter_path())}
    nfe = {c["budget"]: c for c in res["spot_vs_baselines"]["nfe"]}
    for D in (4, 8):
        fewest = min(rows[(m, D)]["nfe_per_sample"] for m in ("graph", "free-chain"))
        assert nfe[D]["baseline_nfe"] == fewest
        assert nfe[D]["fewer_nfe"] == pytest.approx(1 - nfe[D]["spot_nfe"] / fewest)
    (speed,) = res["spot_vs_baselines"]["throughput"]
    assert speed["best_graph"].startswith("graph D=") and speed["spot_over_graph"] > 0
    table = (out / "table.md").read_text()
    assert "| spot@again | 4 |" in table and "SPOT fewer by" in table and "the graph's throughput" in table


def test_bench_rejects_a_bad_drafters_list(tmp_path):
    with pytest.raises(SystemExit):
        main(["--n", "1", "--drafters", "nameonly", "--out", str(tmp_path)])


def test_batch_bench_reports_every_method_against_control_at_each_batch_size(tmp_path):
    from research import batch_bench

    batch_bench.main(["--n", "3", "--sizes", "1", "2", "--budgets", "4", "--temps", "0", "--max-gen-toks", "24",
                      "--threads", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    names = {(r["mode"], r["budget"], r["batch_size"]) for r in rows}
    assert names == {(m, D, N) for m, D in [("control", None), ("graph", 4), ("spot", 4), ("spot", "auto")]
                     for N in (1, 2)}
    for r in rows:
        assert r["identical_to_bs1"] == 3 and r["gen_tokens_per_s"] > 0
        if r["mode"] == "control":
            assert r["throughput_vs_control"] == 1.0
    assert "throughput vs control at N" in (tmp_path / "table.md").read_text()


def test_batch_bound_charges_spot_the_forwards_it_runs_and_nothing_for_drafting(tmp_path):
    """The bound's arithmetic from its own measured parts: control's per-request cost (its forward share and host
    work) over SPOT's per-commit cost at the same N (its rows' forward share plus control's host work, over the
    commits per round)."""
    from research import batch_bound

    batch_bound.main(["--n", "3", "--sizes", "2", "--budgets", "1", "3", "--max-gen-toks", "24", "--repeats", "3",
                      "--threads", "1", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    s = res["sizes"]["2"]
    f, h = {int(k): v for k, v in s["forward_ms"].items()}, s["control_host_ms_per_request_round"]
    assert set(f) == {1, 2, 4} and h > 0
    for r in s["bounds"]:
        c = res["commits_per_round"][str(r["D"])]
        assert 1.0 <= c <= 1 + r["D"] + 1  # a round commits its own transition, its accepted nodes, a lead edge
        want = (f[1] / 2 + h) / ((f[1 + r["D"]] / 2 + h) / c)
        assert abs(r["bound"] - want) < 1e-9 and abs(r["forward_only"] - f[1] / (f[1 + r["D"]] / c)) < 1e-9
    assert "bound: SPOT / control" in (tmp_path / "table.md").read_text()


def test_record_cost_times_control_with_and_without_recording_and_keeps_the_records(tmp_path):
    """Both arms decode the same ids; the records kept are one copy per request, and the bytes and commits reported
    are the shards' own."""
    from safetensors.torch import load_file

    from research import record_cost

    record_cost.main(["--n", "3", "--repeats", "2", "--max-gen-toks", "24", "--data", str(tmp_path / "data"),
                      "--out", str(tmp_path / "out")])
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["ids_unchanged"] == "3/3" and res["control_s"] > 0 and res["recording_s"] > 0
    assert 0 < res["own_s"] < res["recording_s"] and len(res["per_prompt_ms"]["control"]) == 3
    shards = sorted((tmp_path / "data" / "records").glob("rec_*.safetensors"))
    assert res["shards"] == len(shards) == 1
    assert res["bytes"] == sum(p.stat().st_size for p in shards)
    pos = load_file(str(shards[0]))["pos"]
    assert res["commits"] == len(pos) and res["commits"] >= res["generated_tokens"] > 0
    assert "added (sum)" in (tmp_path / "out" / "table.md").read_text()
