"""Likelihood tasks through the real `lm_eval` CLI: stock tasks offline from ../shared/data (arc_easy, arc_challenge,
lambada_openai, an mmlu subject) on the embedded target and on a fixture of every family, the plugin's
multiple-choice task, a mixed generation + likelihood suite, --use_cache, and two ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.remote_fixtures import SHARED, build_remote, needs_remote, save_checkpoint, tokenizer_mask_id
from helpers.cli import run_cli

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
needs_data = pytest.mark.skipif(not (DATA / "allenai" / "ai2_arc").is_dir(),
                                reason="../shared/data is absent (it is in CI)")
STOCK = "arc_easy,arc_challenge,lambada_openai,mmlu_abstract_algebra"


def results_of(out: Path) -> dict:
    return json.loads(next(out.rglob("results_*.json")).read_text())


def check_stock(data: dict, log: str, limit: int) -> None:
    for task in STOCK.split(","):
        assert task in data["results"], task
    lik = data["config"]["spot"]["likelihood"]
    tasks = lik["tasks"]
    # arc: 3-5 choices per question; mmlu: 4; lambada: one request per document, its greedy flag computed
    assert tasks["mmlu_abstract_algebra"]["requests"] == 4 * limit and tasks["mmlu_abstract_algebra"]["mc_docs"] == limit
    assert tasks["lambada_openai"]["requests"] == limit and tasks["lambada_openai"]["greedy_computed"] == limit
    assert tasks["arc_easy"]["greedy_computed"] == 0 and tasks["arc_easy"]["mc_docs"] == limit
    assert lik["forwards"] > 0 and lik["greedy_forwards"] > 0
    for t in tasks.values():
        assert t["se_rms"] >= 0 and t["requests"] > 0
    assert "spot-dlm likelihood" in log and "MC s.e." in log
    assert len(data["config"]["spot_likelihood_samples"]) == sum(t["requests"] for t in tasks.values())


@needs_data
def test_stock_likelihood_tasks_run_on_the_embedded_target(tmp_path):
    out = run_cli(["--model", "spot-dlm", "--model_args", "mode=control,mc_num=8", "--tasks", STOCK, "--limit", "2",
                   "--device", "cpu", "--batch_size", "4", "--output_path", str(tmp_path / "out")], cwd=DATA)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    check_stock(results_of(tmp_path / "out"), log, 2)


FAMILY_RUNS = [("sdar", "native"), ("sdar", "remote"), ("llada2_moe", "remote"), ("llada", "remote"),
               ("dream", "native")]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    mask = tokenizer_mask_id()
    out = {}
    for fam in sorted({f for f, _ in FAMILY_RUNS}):
        # the stock prompts are long for the test tokenizer (about a token per character): a longer context
        key = "max_sequence_length" if fam == "llada" else "max_position_embeddings"
        model = build_remote(fam, seed=0, scale=4.0, mask_token_id=mask, **{key: 2048})
        out[fam] = save_checkpoint(model, tmp_path_factory.mktemp(fam))
    return out


@pytest.mark.slow
@needs_data
@needs_remote
@pytest.mark.parametrize("fam,impl", FAMILY_RUNS)
def test_stock_likelihood_tasks_run_on_every_family(family_dirs, tmp_path, fam, impl, monkeypatch):
    if fam == "sdar" and impl == "remote":  # TEST-ONLY: the pure-torch flash_attn stand-in
        monkeypatch.setenv("PYTHONPATH", str(SHARED / "_test_stubs") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = f"pretrained={family_dirs[fam]},impl={impl},trust_remote_code=true,mode=control,block_len=4,mc_num=4,mc_batch=4"
    out = run_cli(["--model", "spot-dlm", "--model_args", args, "--tasks", STOCK, "--limit", "1", "--device", "cpu",
                   "--batch_size", "2", "--output_path", str(tmp_path / "out")], cwd=DATA)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    data = results_of(tmp_path / "out")
    assert data["config"]["spot"]["family"] == fam.replace("_", "-") and data["config"]["spot"]["impl"] == impl
    check_stock(data, log, 1)


@pytest.mark.slow
def test_a_mixed_suite_runs_in_one_command(tmp_path):
    out = run_cli(["--model", "spot-dlm", "--model_args", "mode=spot,budget=4,mc_num=16",
                   "--tasks", "spot_arith_mini,spot_arith_mc_mini", "--limit", "4", "--device", "cpu",
                   "--batch_size", "8", "--gen_kwargs", "max_gen_toks=40", "--output_path", str(tmp_path / "out")],
                  cwd=tmp_path)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    data = results_of(tmp_path / "out")
    assert "acc,none" in data["results"]["spot_arith_mc_mini"]
    assert "exact_match,strict-match" in data["results"]["spot_arith_mini"]
    spot = data["config"]["spot"]
    assert spot["samples"] == 4 and spot["nfe_total"] > 0  # the generation side's statistics
    assert spot["likelihood"]["tasks"]["spot_arith_mc_mini"]["requests"] == 16
    assert "spot-dlm run summary" in log and "spot-dlm likelihood" in log


@pytest.mark.slow
def test_use_cache_serves_likelihood_answers_and_refuses_other_settings(tmp_path):
    base = ["--model", "spot-dlm", "--tasks", "spot_arith_mc_mini", "--limit", "2", "--device", "cpu",
            "--use_cache", str(tmp_path / "cache")]
    first = run_cli([*base, "--model_args", "mode=control,mc_num=8", "--output_path", str(tmp_path / "a")], cwd=tmp_path)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    again = run_cli([*base, "--model_args", "mode=control,mc_num=8", "--output_path", str(tmp_path / "b")], cwd=tmp_path)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    a, b = results_of(tmp_path / "a"), results_of(tmp_path / "b")
    assert a["results"]["spot_arith_mc_mini"]["acc,none"] == b["results"]["spot_arith_mc_mini"]["acc,none"]
    assert b["config"]["spot"]["served_from_cache"] == 8 and "likelihood" not in b["config"]["spot"]
    other = run_cli([*base, "--model_args", "mode=control,mc_num=16", "--output_path", str(tmp_path / "c")], cwd=tmp_path)
    assert other.returncode != 0 and "mc_num" in other.stdout + other.stderr


@pytest.mark.slow
def test_two_ranks_give_the_single_process_likelihoods(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1", TOKENIZERS_PARALLELISM="false")
    env.pop("WORLD_SIZE", None)
    # 3 documents x 4 choices = 12 requests; lambada: 3 single requests (2 + 1 over two ranks: one padding copy)
    args = ["--model", "spot-dlm", "--model_args", "mode=control,mc_num=8,seed=5", "--tasks",
            "spot_arith_mc_mini,lambada_openai", "--limit", "3", "--log_samples"]

    def run(cmd: list[str], out: Path, *extra: str) -> dict:
        proc = subprocess.run([*cmd, *args, *extra, "--output_path", str(out)], env=env, capture_output=True,
                              text=True, timeout=600, cwd=DATA if DATA.is_dir() else tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return results_of(out)

    if not DATA.is_dir():
        pytest.skip("../shared/data is absent (it is in CI)")
    one = run([sys.executable, "-m", "lm_eval"], tmp_path / "one")
    two = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "lm_eval"],
              tmp_path / "two", "--batch_size", "2")
    for task in ("spot_arith_mc_mini", "lambada_openai"):
        # (perplexity's stderr is bootstrapped over the samples in their gathered order: not compared)
        same = {k: v for k, v in one["results"][task].items() if k != "perplexity_stderr,none"}
        assert {k: two["results"][task][k] for k in same} == same
    l1, l2 = one["config"]["spot"]["likelihood"], two["config"]["spot"]["likelihood"]
    assert l2["forwards"] == l1["forwards"] and l2["rows"] == l1["rows"] and set(l2["tasks"]) == set(l1["tasks"])
    for task, t1 in l1["tasks"].items():  # sums in another order: equal up to rounding
        assert l2["tasks"][task] == pytest.approx(t1, rel=1e-9), task
    key = lambda s: (s["task"], s["doc_id"], s["logprob"])  # noqa: E731
    assert sorted(map(key, two["config"]["spot_likelihood_samples"])) == sorted(
        map(key, one["config"]["spot_likelihood_samples"]))
