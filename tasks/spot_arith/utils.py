"""Loaders for the spot_arith lm-eval tasks (data file next to this module; no hub download)."""

from __future__ import annotations

import json
from pathlib import Path

TEST_FILE = Path(__file__).parent / "spot_arith_test.jsonl"
MINI_SIZE = 50


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
