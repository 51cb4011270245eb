"""Loaders for the spot_arith lm-eval tasks (data file next to this module; no hub download)."""

from __future__ import annotations

import json
import random
from pathlib import Path

TEST_FILE = Path(__file__).parent / "spot_arith_test.jsonl"
MINI_SIZE = 50
MC_SEED_PREFIX = "spot_arith_mc"  # doc i's wrong choices and order come from random.Random(f"{prefix}:{i}")


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _dataset(docs: list[dict]):
    import datasets

    return {"test": datasets.Dataset.from_list(docs)}


def load_docs(**kwargs):
    """All 500 test problems. lm-eval passes metadata/dataset_kwargs as keywords; none are needed."""
    return _dataset(_read(TEST_FILE))


def load_docs_mini(**kwargs):
    """The first 50 test problems."""
    return _dataset(_read(TEST_FILE)[:MINI_SIZE])


def mc_docs(n: int | None = None) -> list[dict]:
    """The multiple-choice docs of the first `n` test problems (all if None); the same on every machine."""
    from lm_eval_spot.arith.choices import mc_doc

    problems = _read(TEST_FILE)[:n]
    return [dict(mc_doc(p, random.Random(f"{MC_SEED_PREFIX}:{i}"))) for i, p in enumerate(problems)]


def load_mc_docs(**kwargs):
    """spot_arith_mc: all 500 test problems, each with its correct solution and 3 wrong ones."""
    return _dataset(mc_docs())


def load_mc_docs_mini(**kwargs):
    """spot_arith_mc_mini: the first 50."""
    return _dataset(mc_docs(MINI_SIZE))
