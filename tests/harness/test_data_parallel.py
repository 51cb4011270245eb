"""Data parallelism: a real 2-rank gloo run (torchrun + accelerate on the CPU) equals the single-process run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lm_eval_spot.harness.distributed import padding_count

# spot_arith: 5 documents over 2 ranks gives 3 + 2, so lm-eval pads rank 1 with one copy (the case to get right).
LIMIT = 5
# A fixed budget: equal NFE across process counts is a fixed-budget guarantee (budget=auto follows measured costs).
ARGS = ["--model", "spot-dlm", "--model_args", "seed=3,control=paired,budget=8", "--tasks", "spot_arith",
        "--limit", str(LIMIT), "--log_samples", "--gen_kwargs", "temperature=1,do_sample=true,max_gen_toks=64"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1", TOKENIZERS_PARALLELISM="false")
    env.pop("WORLD_SIZE", None)
    return env


def _run(cmd: list[str], out: Path, *extra: str, record: Path | None = None) -> tuple[dict, dict]:
    args = list(ARGS)
    if record is not None:  # drafter_data: each rank appends its own shards to the folder
        args[args.index("--model_args") + 1] += f",drafter_data={record}"
    proc = subprocess.run([*cmd, *args, *extra, "--output_path", str(out)], env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = {row["doc_id"]: row for row in map(json.loads, next(out.rglob("samples_*.jsonl")).open())}
    return results, samples


@pytest.mark.slow
def test_two_ranks_give_the_single_process_generations_and_summed_totals(tmp_path):
    # Also across batch sizes: one process at batch size 1, two at batch size 2.
    one, one_samples = _run([sys.executable, "-m", "lm_eval"], tmp_path / "one", record=tmp_path / "rec1")
    two, two_samples = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "-m", "lm_eval"], tmp_path / "two", "--batch_size", "2", record=tmp_path / "rec2")
    assert sorted(one_samples) == sorted(two_samples) == list(range(LIMIT))
    for doc_id, row in one_samples.items():
        # lm-eval appends its padding copy's answer to the padded rank's last document: the first is the real one.
        assert two_samples[doc_id]["resps"][0][0] == row["resps"][0][0]
        assert two_samples[doc_id]["filtered_resps"] == row["filtered_resps"]
    assert two["results"]["spot_arith"] == one["results"]["spot_arith"]
    s1, s2 = one["config"]["spot"], two["config"]["spot"]
    assert (s1["world_size"], s2["world_size"]) == (1, 2)
    for key in ("samples", "nfe_total", "gen_tokens_total", "committed_tokens_total", "rounds_total",
                "control_nfe_per_sample", "nfe_reduction", "exact_match_to_control", "stop_reasons"):
        assert s2[key] == s1[key], key
    assert s2["samples"] == LIMIT  # the padding copy was neither decoded nor counted

    def per_sample(info: dict) -> list[tuple]:
        return sorted((e["prompt_hash"], e["nfe"], e["gen_tokens"], e["rounds"]) for e in info["config"]["spot_samples"])

    assert per_sample(two) == per_sample(one)
    # drafter_data: both ranks recorded (the padding copy was not), the same commits as the single process's run.
    ranks = {re.search(r"_r(\d+)_[0-9a-f]{8}_\d+\.safetensors$", p.name).group(1)
             for p in (tmp_path / "rec2").glob("rec_*.safetensors")}
    assert ranks == {"0", "1"}
    assert _recorded(tmp_path / "rec2") == _recorded(tmp_path / "rec1")


def _recorded(folder: Path) -> list[tuple]:
    """Each recorded request's (slot, token) commits, as a sorted list (ranks record in their own order)."""
    from safetensors.torch import load_file

    per: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for path in folder.glob("rec_*.safetensors"):
        d = load_file(str(path))
        for sid, pos, tok in zip(d["sample_id"].tolist(), d["pos"].tolist(), d["tok"].tolist(), strict=True):
            per.setdefault((path.name, sid), []).append((pos, tok))
    return sorted(tuple(v) for v in per.values())


class _Req:
    def __init__(self, repeats: int = 1) -> None:
        self.repeats = repeats


def test_padding_count_reads_lm_evals_tail_copies():
    a, b, c = _Req(), _Req(), _Req(repeats=3)
    assert padding_count([]) == 0
    assert padding_count([a, b]) == 0
    assert padding_count([a, b, b, b]) == 2
    assert padding_count([a, c, c, c]) == 0  # one request with repeats=3
    assert padding_count([a, c, c, c, c, c, c]) == 3  # ...and one padding copy of it (3 rows)


@pytest.mark.slow
def test_two_ranks_adapt_independently_exactly_and_report_each_rank(tmp_path):
    """adapt=online under data parallel: each rank adapts its own copy on its own requests; outputs equal the
    single process's (and control's), and config.spot.adapt reports both ranks."""
    extra = ("--model_args", "seed=3,control=paired,adapt=online,budget=8")
    one, one_samples = _run([sys.executable, "-m", "lm_eval"], tmp_path / "one", *extra)
    two, two_samples = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "-m", "lm_eval"], tmp_path / "two", *extra)
    for doc_id, row in one_samples.items():
        assert two_samples[doc_id]["resps"][0][0] == row["resps"][0][0]
    s1, s2 = one["config"]["spot"], two["config"]["spot"]
    assert s1["exact_match_to_control"] == s2["exact_match_to_control"] == 1.0
    assert s1["adapt"]["requests"] == LIMIT and "per_rank" not in s1["adapt"]
    a = s2["adapt"]
    assert a["ranks"] == "independent" and [r["rank"] for r in a["per_rank"]] == [0, 1]
    assert [r["requests"] for r in a["per_rank"]] == [3, 2] and a["requests"] == LIMIT


_EXIT_CHILD = r"""
import atexit, sys, time
import torch.distributed as dist
from lm_eval_spot.harness.distributed import _close_group

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
atexit.register(lambda: open(f"{out}/closed_{rank}", "w").write(repr(time.time())))  # runs after the close
atexit.register(_close_group)
if rank == 0:
    time.sleep(2.0)  # rank 0 still writes results while rank 1 is done
open(f"{out}/done_{rank}", "w").write(repr(time.time()))
"""


def test_a_finished_rank_closes_the_group_only_with_the_others(tmp_path):
    """At exit the ranks meet before closing gloo's connections (a rank that closed them while rank 0 still held
    them open aborted in the C++ teardown once in CI): rank 1, done 2 s early, closes after rank 0 is done too."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", _EXIT_CHILD, str(r), str(port), str(tmp_path)], env=_env(),
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    stamp = {f.name: float(f.read_text()) for f in tmp_path.iterdir()}
    assert stamp["done_1"] < stamp["done_0"] - 1.0  # rank 1 really was done first
    assert stamp["closed_1"] >= stamp["done_0"]  # and waited for rank 0 before closing
