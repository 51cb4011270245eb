"""`python -m lm_eval_spot.tools.compare` over four real lm_eval runs (control and spot, T=0 and T=1, the embedded
target, spot_arith, --log_samples), and its refusals; the paired test it uses against a direct count."""

from __future__ import annotations

import csv
import json
import math

import pytest

from lm_eval_spot.tools import compare

from helpers.cli import run_cli

LIMIT = 5


@pytest.fixture(scope="module")
def four_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    outs = []
    for mode in ("control", "spot"):
        for T in (0, 1):
            out = root / f"{mode}_T{T}"
            gen = "max_gen_toks=96" + (",temperature=1.0,do_sample=true" if T else "")
            done = run_cli(["--model", "spot-dlm", "--model_args", f"mode={mode},seed=3", "--tasks", "spot_arith",
                            "--limit", str(LIMIT), "--device", "cpu", "--gen_kwargs", gen, "--log_samples",
                            "--output_path", str(out)], cwd=root)
            assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
            outs.append(out)
    return outs


@pytest.mark.slow  # four real lm_eval runs (~100 s); CI runs -m slow
def test_compare_four_runs_says_accuracy_preserved(four_runs, tmp_path, capsys):
    assert compare.main([*map(str, four_runs), "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    rows = list(csv.DictReader((tmp_path / "cmp" / "compare.csv").open()))
    assert len(rows) == 4 and (tmp_path / "cmp" / "compare.md").read_text().startswith("| target")
    spot = [r for r in rows if r["mode"] == "spot"]
    assert {r["T"] for r in spot} == {"0", "1"}
    for r in spot:
        assert r["verdict"] == "accuracy preserved (every generation identical)", r
        assert r["identical to control"] == "1.000" and r["accuracy diff"] == "+0.0000" and r["McNemar p"] == "1.000"
        assert float(r["NFE/sample"]) < float(next(c for c in rows if c["mode"] == "control" and c["T"] == r["T"])
                                               ["NFE/sample"])
        assert r["n"] == str(LIMIT) and r["prefix cache"] == "exact"
    assert all(float(r["accuracy"]) > 0.5 for r in rows)  # the embedded target solves these
    assert "accuracy preserved (every generation identical)" in printed
    assert (tmp_path / "cmp" / "accuracy_vs_nfe.png").stat().st_size > 5000


@pytest.mark.slow  # four real lm_eval runs (~100 s); CI runs -m slow
def test_per_sample_statistics_are_in_the_results_and_join_the_samples_file(four_runs):
    runs = compare.load_runs([four_runs[2]])  # spot, T=0
    (run,) = runs
    assert len(run.samples) == LIMIT
    for s in run.samples.values():
        assert s["nfe"] > 0 and s["gen_tokens"] > 0 and s["rounds"] > 0 and s["latency_s"] > 0


@pytest.mark.slow  # four real lm_eval runs (~100 s); CI runs -m slow
def test_compare_refuses_what_it_cannot_compare(four_runs, tmp_path, capsys):
    assert compare.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    (tmp_path / "empty").mkdir()
    assert compare.main([str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert "no results_*.json in this folder" in capsys.readouterr().err
    src = next(four_runs[0].rglob("results_*.json"))
    data = json.loads(src.read_text())
    other = tmp_path / "hf" / "results_x.json"
    other.parent.mkdir()
    other.write_text(json.dumps({**data, "config": {**data["config"], "model": "hf"}}))
    assert compare.main([str(other), "--out", str(tmp_path / "o")]) == 2
    assert "a run of --model 'hf'; compare reads spot-dlm runs only" in capsys.readouterr().err
    bumped = tmp_path / "v2" / "results_y.json"
    bumped.parent.mkdir()
    bumped.write_text(json.dumps({**data, "versions": {"spot_arith": 9.0}}))
    assert compare.main([str(src), str(bumped), "--out", str(tmp_path / "o")]) == 2
    assert "task spot_arith appears in versions" in capsys.readouterr().err


@pytest.mark.parametrize("b,c", [(0, 0), (3, 0), (5, 2), (10, 10), (1, 12)])
def test_mcnemar_exact_matches_a_direct_binomial_sum(b, c):
    n = b + c
    # Direct: probability under Binomial(n, 1/2) of an outcome at least as extreme (two-sided, by probability).
    probs = [math.comb(n, i) / 2**n for i in range(n + 1)]
    direct = sum(p for p in probs if p <= probs[b] + 1e-12) if n else 1.0
    assert compare.mcnemar_exact(b, c) == pytest.approx(min(1.0, direct), abs=1e-9)


def test_pareto_front():
    pts = [(10.0, 0.9), (20.0, 0.95), (15.0, 0.85), (5.0, 0.5)]
    assert sorted(compare.pareto(pts)) == [0, 1, 3]


def _fake_run(tmp_path, name: str, mode: str, batch: int, tok_s: float, nfe: float, paired_ratio: float | None = None):
    """A results file as lm-eval writes it for spot-dlm (only the fields compare reads)."""
    spot = {"mode": mode, "budget": "auto" if mode != "control" else None, "temperature": 0.0, "samples": 10,
            "batch_size": batch, "gen_tokens_per_s": tok_s, "nfe_per_sample": nfe, "tokens_per_forward": 80 / nfe,
            "wall_s": 1.0}
    if paired_ratio is not None:
        spot.update({"throughput_ratio": paired_ratio, "throughput_ratio_q25_q75": [paired_ratio, paired_ratio]})
    data = {"config": {"model": "spot-dlm", "spot": spot, "spot_args": {"pretrained": "/t/target"}},
            "results": {"spot_arith": {"exact_match,strict-match": 0.5, "exact_match_stderr,strict-match": 0.1}},
            "versions": {"spot_arith": 1}, "n-samples": {"spot_arith": {"effective": 10}}}
    folder = tmp_path / name
    folder.mkdir()
    (folder / "results_x.json").write_text(json.dumps(data))
    return folder


def test_speed_is_against_the_control_run_of_the_same_batch_size_and_a_slower_run_shows_it(tmp_path):
    """A run with 3x fewer NFE that is 1.7x slower than control at its batch size reads 0.59x, not a win; the
    control of another batch size is never its reference; a paired run without one uses its paired ratio."""
    runs = [_fake_run(tmp_path, "c1", "control", 1, 200.0, 81.0), _fake_run(tmp_path, "c8", "control", 8, 600.0, 81.0),
            _fake_run(tmp_path, "s1", "spot", 1, 400.0, 27.0), _fake_run(tmp_path, "s8", "spot", 8, 350.0, 27.0),
            _fake_run(tmp_path, "s32", "spot", 32, 700.0, 27.0, paired_ratio=0.9)]
    assert compare.main([*map(str, runs), "--out", str(tmp_path / "cmp")]) == 0
    rows = {(r["mode"], r["batch size"]): r for r in csv.DictReader((tmp_path / "cmp" / "compare.csv").open())}
    assert rows[("spot", "1")]["tokens/s vs control"] == "2.00x"
    assert rows[("spot", "8")]["tokens/s vs control"] == "0.58x"
    assert rows[("spot", "32")]["tokens/s vs control"] == "0.90x (paired)"
    assert rows[("control", "8")]["tokens/s vs control"] == "1.00x"
    assert (tmp_path / "cmp" / "accuracy_vs_nfe.png").stat().st_size > 5000
