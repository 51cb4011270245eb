from __future__ import annotations

import os
import sys
from pathlib import Path

# MKL's conditional numerical reproducibility, read once when torch loads MKL (so before `import torch`): on AVX-512
# CPUs MKL's default sgemm takes other kernels for few rows (a Linear's row differs in its last bits between M = 4
# and M = 44 rows), so batched and alone forwards differ by float rounding. STRICT makes a row's result independent
# of the row count, the environment in which the tests' bit-for-bit claims about batching are checkable;
# docs/families.md has the measurement.
os.environ.setdefault("MKL_CBWR", "AVX2,STRICT")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tests use tiny tensors: one thread is as fast, and it avoids OpenMP spin-wait collapse when another job
# (a training run, a second test process) shares the two cores. Subprocesses inherit the setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).parent))

from helpers.tiny import save_tiny_target  # noqa: E402


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("tiny_target"), seed=0, block_length=8)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz-examples", type=int, default=None, metavar="N",
                     help="tests/decoding/test_fuzz.py: N random (not derandomized) examples per target kind")
