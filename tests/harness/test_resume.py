"""Real interruptions: a training run SIGKILLed mid-way and rerun with the same command ends with the same weights,
bit for bit, as an uninterrupted run with the same seed (the drafter's collect and train steps, the target trainer).

Each run is a subprocess; a run is killed as soon as a polled condition shows it is past a checkpoint and not done
(no sleeps that assume a speed), and the test asserts that the kill really landed mid-run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lm_eval_spot.drafter.factored import FactoredConfig
from lm_eval_spot.training.train import TrainConfig, train

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180.0  # per subprocess; a hang fails the test instead of blocking the suite
POLL_S = 0.005

# The drafter collect step with 2 prompts per shard (instead of 100), so a tiny run spans many shards.
COLLECT = [sys.executable, "-c",
           "import sys, lm_eval_spot.training.train as t; t.SHARD = 2; t.main(sys.argv[1:])", "collect"]
N_PROMPTS = 24
DRAFTER_STEPS = 200
DRAFTER_MODEL = ["--d-model", "32", "--heads", "2", "--layers", "1", "--d-ff", "64", "--dropout", "0.1"]
TARGET_STEPS = 100


# ------------------------------------------------------------------------------------------------ helpers


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def _tail(log: Path, n: int = 3000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no output)"


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with log.open("ab") as f:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, log: Path) -> None:
    try:
        rc = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"{proc.args} did not finish in {TIMEOUT_S} s:\n{_tail(log)}")
    assert rc == 0, f"{proc.args} exited {rc}:\n{_tail(log)}"


def _run(cmd: list[str], log: Path) -> None:
    _finish(_start(cmd, log), log)


def _kill_when(cmd: list[str], log: Path, ready: Callable[[], bool]) -> None:
    """Start cmd, SIGKILL it once ready() holds, and assert it was still running (killed, not finished)."""
    proc = _start(cmd, log)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ready():
            if proc.poll() is not None:
                pytest.fail(f"{cmd} exited {proc.returncode} before it could be interrupted:\n{_tail(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"{cmd} never reached the interruption point in {TIMEOUT_S} s:\n{_tail(log)}")
            time.sleep(POLL_S)
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:  # a failure above: do not leave it running
            proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the run ended on its own (rc {proc.returncode}), not killed"


def _checkpoint_step(path: Path) -> int:
    """Step of a checkpoint that is written by atomic replace (so never read half-written); -1 if none yet."""
    return int(torch.load(path, weights_only=True)["step"]) if path.exists() else -1


def _leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _leaves(obj[k], f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{prefix}/{i}")
    else:
        yield prefix, obj


def assert_identical(a: Any, b: Any) -> None:
    """Same structure and every leaf equal: tensors by torch.equal (same dtype, shape and bits), others by ==."""
    la, lb = dict(_leaves(a)), dict(_leaves(b))
    assert la.keys() == lb.keys()
    differ = [k for k in la if not (torch.equal(la[k], lb[k]) if isinstance(la[k], torch.Tensor) else la[k] == lb[k])]
    assert not differ, f"{len(differ)} of {len(la)} entries differ, e.g. {differ[:5]}"


def _tensors_of(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no safetensors under {folder}"
    return {p.name: load_file(str(p)) for p in files}


# ------------------------------------------------------------------------------------------------ drafter


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q: {i}+{i}=?\nA:"}) + "\n" for i in range(N_PROMPTS)))
    return path


def _collect_cmd(out: Path, target: Path, prompts: Path) -> list[str]:
    return [*COLLECT, "--out", str(out), "--target", str(target), "--prompts-file", str(prompts),
            "--n-prompts", str(N_PROMPTS), "--max-gen-toks", "20", "--threads", "1"]


@pytest.fixture(scope="module")
def collected(tmp_path_factory, tiny_target_dir, prompts_file) -> Path:
    """An uninterrupted collection: the reference for the collect test, the data for the train tests."""
    out = tmp_path_factory.mktemp("collected")
    _run(_collect_cmd(out, tiny_target_dir, prompts_file), out / "log.txt")
    return out


def _with_trajectories(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    shutil.copytree(src / "trajectories", dst / "trajectories")
    shutil.copy(src / "collect.json", dst / "collect.json")
    return dst


def _shards(out: Path) -> list[Path]:
    return sorted((out / "trajectories").glob("shard_*.safetensors"))


@pytest.mark.slow  # real subprocesses killed mid-run (~30 s each); CI runs -m slow
def test_drafter_collection_killed_mid_way_resumes_to_the_same_trajectories(
        collected, tiny_target_dir, prompts_file, tmp_path):
    out = tmp_path / "run"
    cmd = _collect_cmd(out, tiny_target_dir, prompts_file)
    _kill_when(cmd, tmp_path / "log.txt", lambda: len(_shards(out)) >= 1)
    assert 1 <= len(_shards(out)) < len(_shards(collected)) and not (out / "collect.json").exists()  # mid-way
    _run(cmd, tmp_path / "log.txt")
    assert_identical(_tensors_of(out / "trajectories"), _tensors_of(collected / "trajectories"))
    assert json.loads((out / "collect.json").read_text()) == json.loads((collected / "collect.json").read_text())


def _train_cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "lm_eval_spot.training.train", "train", "--out", str(out),
            *DRAFTER_MODEL, "--steps", str(DRAFTER_STEPS), "--batch", "16",
            "--ckpt-every", "10", "--seed", "3", "--threads", "1"]


@pytest.mark.slow  # real subprocesses killed mid-run (~30 s each); CI runs -m slow
def test_drafter_training_killed_mid_run_resumes_to_the_same_weights(collected, tmp_path):
    ref = _with_trajectories(collected, tmp_path / "ref")
    run = _with_trajectories(collected, tmp_path / "run")
    straight = _start(_train_cmd(ref), tmp_path / "ref.log")  # concurrently: determinism must not care
    ckpt = run / "train_ckpt.pt"
    _kill_when(_train_cmd(run), tmp_path / "run.log", lambda: _checkpoint_step(ckpt) >= 50)
    killed_at = _checkpoint_step(ckpt)
    assert 50 <= killed_at < DRAFTER_STEPS and not (run / "drafter").exists()  # killed mid-training
    _run(_train_cmd(run), tmp_path / "run.log")
    assert f"resumed drafter training at step {killed_at}" in (tmp_path / "run.log").read_text()
    _finish(straight, tmp_path / "ref.log")

    a, b = (torch.load(d / "train_ckpt.pt", weights_only=True) for d in (ref, run))
    assert a["step"] == b["step"] == DRAFTER_STEPS
    assert_identical(a, b)  # weights, optimizer moments, data generator, global RNG (dropout), settings
    assert_identical(_tensors_of(ref / "drafter"), _tensors_of(run / "drafter"))


def _tiny_drafter_cfg(**kw: Any) -> TrainConfig:
    model = FactoredConfig(d_model=32, n_heads=2, n_layers=1, d_ff=64)
    return replace(TrainConfig(steps=4, batch=8, ckpt_every=2, model=model), **kw)


def test_drafter_resume_refuses_other_settings(collected, tmp_path):
    out = _with_trajectories(collected, tmp_path / "run")
    cfg = _tiny_drafter_cfg()
    with torch.random.fork_rng():  # train() seeds torch's global generator; keep other tests' draws as they were
        train(out, cfg)
        for other, msg in [(replace(cfg, batch=16), "batch=8 (now 16)"), (replace(cfg, seed=1), "seed=0 (now 1)"),
                           (replace(cfg, lr=0.1), "lr=0.001 (now 0.1)"),
                           (replace(cfg, model=replace(cfg.model, d_model=64)), "model.d_model=32 (now 64)"),
                           (replace(cfg, steps=3), "--steps may only grow")]:
            with pytest.raises(ValueError, match=re.escape(msg)) as err:
                train(out, other)
            assert "\n" not in str(err.value)
        train(out, replace(cfg, steps=6, ckpt_every=5, minutes=10.0))  # more steps, other save/stop settings: fine
    assert _checkpoint_step(out / "train_ckpt.pt") == 6


# ------------------------------------------------------------------------------------------------ target


def _target_cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "research.train_target", "--out", str(out), "--hidden", "32", "--layers", "1",
            "--heads", "2", "--kv-heads", "2", "--max-positions", "256", "--steps", str(TARGET_STEPS), "--batch", "4",
            "--warmup", "2", "--ckpt-every", "10", "--log-every", "1", "--val-every", "0", "--eval-n", "0",
            "--seed", "3", "--threads", "1"]


def _last_logged_step(log: Path) -> int:
    steps = re.findall(r" step (\d+)/\d+ loss", log.read_text(errors="replace")) if log.exists() else []
    return int(steps[-1]) if steps else -1


@pytest.mark.slow  # real subprocesses killed mid-run (~30 s each); CI runs -m slow
def test_target_training_killed_mid_run_resumes_to_the_same_weights(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    straight = _start(_target_cmd(ref), tmp_path / "ref.log")  # concurrently: determinism must not care
    ckpt = run / "checkpoint.pt"

    seen: list[int] = []

    def past_a_checkpoint() -> bool:  # logged a step the checkpoint does not hold: that work will be lost
        step = _checkpoint_step(ckpt)
        seen[:] = [step, _last_logged_step(run / "train.log")]
        return step >= 20 and seen[1] > step

    _kill_when(_target_cmd(run), tmp_path / "run.log", past_a_checkpoint)
    killed_at = _checkpoint_step(ckpt)
    assert 20 <= seen[0] < seen[1] and killed_at < TARGET_STEPS and not (run / "final").exists()
    _run(_target_cmd(run), tmp_path / "run.log")
    assert f"resumed from {ckpt} at step {killed_at} / {TARGET_STEPS}" in (run / "train.log").read_text()
    _finish(straight, tmp_path / "ref.log")

    a, b = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (ref, run))
    assert a["step"] == b["step"] == TARGET_STEPS
    a.pop("train_s"), b.pop("train_s")  # wall-clock seconds
    assert_identical(a, b)  # weights, optimizer moments, data and mask generators
    assert_identical(_tensors_of(ref / "final"), _tensors_of(run / "final"))


def test_target_resume_refuses_other_settings(tmp_path):
    from research.train_target import ModelConfig
    from research.train_target import TrainConfig as TargetConfig
    from research.train_target import train as train_target

    def cfg(**kw: Any) -> TargetConfig:
        base = dict(out=str(tmp_path / "t"), model=ModelConfig(hidden=32, layers=1, heads=2, kv_heads=2,
                                                                  max_positions=256),
                    steps=4, batch=2, warmup=1, ckpt_every=2, val_every=0, val_n=0, eval_n=0, threads=1, seed=3)
        return TargetConfig(**{**base, **kw})

    assert train_target(cfg(stop_after=2)) == tmp_path / "t"
    for change in ({"seed": 4}, {"lr": 1e-3}, {"batch": 3}, {"loss_weight": "inv_t"}):
        with pytest.raises(ValueError, match=f"from another training run: {next(iter(change))}="):
            train_target(cfg(**change))
    # Reporting and stopping settings do not shape the weights: the run resumes.
    assert train_target(cfg(log_every=1, ckpt_every=3)) == tmp_path / "t" / "final"
