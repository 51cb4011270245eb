"""The device check (`scripts/gpu_check.sh`) runs where only torch and the wheels of `scripts/gpu_wheels.txt` are
installed: the script runs end to end (--device cpu --quick) under an interpreter that sees nothing else of this
environment (no site-packages; a folder of links to torch, its requirements and the listed distributions), and
writes its one JSON with every section."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / "scripts" / "gpu_wheels.txt"


def pins() -> dict[str, str]:
    out = {}
    for line in WHEELS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[name] = version
    return out


def test_every_wheel_is_pinned_exactly() -> None:
    found = pins()
    assert found and all(re.fullmatch(r"[A-Za-z0-9_.\-]+", n) and v for n, v in found.items()), found
    assert "lm_eval" not in found and "lm-eval" not in found and "datasets" not in found
    assert found["transformers"].startswith("4.57."), "the check runs the transformers version CI tests"


def _closure(names: list[str]) -> set[str]:
    """The distributions `names` need at run time (requirements without extras, markers evaluated here)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for spec in distribution(name).requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def bare_site(folder: Path) -> Path:
    """Links to torch, its requirements and the pinned distributions (nothing else), as a fresh venv holds them."""
    folder.mkdir()
    pinned = pins()
    for name in _closure(["torch"]) | set(pinned):
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            pytest.skip(f"{name} is not installed here")
        if name == "transformers" and dist.version.split(".")[0] != pinned[name].split(".")[0]:
            # The transformers 5.x run: its hub client and requirements are not the ones the list pins.
            pytest.skip(f"transformers {dist.version} is installed here, the list pins {pinned[name]}")
        tops = {Path(str(f)).parts[0] for f in dist.files or []} - {".."}
        for top in tops:
            src = Path(str(dist.locate_file(top)))
            if src.exists() and not (folder / top).exists():
                (folder / top).symlink_to(src)
    return folder


def test_gpu_check_runs_with_only_torch_and_the_listed_wheels(tmp_path: Path) -> None:
    site = bare_site(tmp_path / "site")
    python = tmp_path / "python"  # -S: no site-packages, so only the linked folder (and the repo) is importable
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(python), "PYTHONPATH": str(site), "OUT": str(out),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--quick",
                           "--wheels", str(tmp_path / "no-wheels")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["errors"] == {}
    assert set(res["sections_s"]) == {"build", "forward_curve", "decode", "batch_invariance", "embedded_bench"}
    for P in ("256", "1024"):
        for attention in ("fused", "reference"):
            assert list(res["forward_curve_ms"][P][attention]) == [str(r) for r in range(1, 22)]
    assert {(r["mode"], r["prompt_len"]) for r in res["decode"]} == {
        (m, p) for m in ("control", "spot") for p in (256, 1024)}
    assert all(0 <= r["outside_share"] < 1 for r in res["decode"])
    assert set(res["batch_invariance"]) == {"9", "21"}
    rows = {(r["method"], r["budget"], r["temperature"]) for r in res["embedded_bench"]["rows"]}
    assert rows == {(m, D, T) for m, D in (("control", "-"), ("graph", 8), ("spot", 8), ("spot", 20))
                    for T in (0.0, 1.0)}
    assert all(r["exact_match_to_control"] == 1.0 for r in res["embedded_bench"]["rows"])
    assert res["drafter_device"] == "cpu"
