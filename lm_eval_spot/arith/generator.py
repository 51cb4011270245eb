"""Seeded generator of multi-step +/- problems with a long, trivially regular worked solution.

Prompt:  ``Q: 7+5-3+8+2\nA:``
Answer:  `` Step 1: 7 + 5 = 12\nStep 2: 12 - 3 = 9\nStep 3: 9 + 8 = 17\nStep 4: 17 + 2 = 19\n#### 19``

Why this shape: a tiny model trained for an hour on 2 CPU cores must actually learn it. Operands are single
digits (1..9) and every running total stays in 0..45, so with the number-aware tokenizer each step is one lookup
(a, op, b) -> c over ~1k reachable facts (a pilot with operands up to 20, ~4k facts, copied perfectly but was still
off by one or two on the sums after 1000 steps); everything else in a step is copied (the previous total, the next
operand from the prompt) or fixed scaffold. Always 4 operations: every number is one token, so every problem has
the same token layout and each copy is a fixed-offset lookup. The scaffold makes the solution long (79 tokens, so
decoding spans at least two 32-token blocks) while the prompt stays short (15 tokens), so most of the training
signal is on the answer; prompt + answer + eos is 95 tokens, which pads to exactly three blocks.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypedDict

MIN_OPS, MAX_OPS = 4, 4
MIN_OPERAND, MAX_OPERAND = 1, 9
MAX_TOTAL = 99  # running totals stay in 0..MAX_TOTAL (never binding with 4 single-digit steps: at most 45)

TEST_SEED = 20_251_129
TRAIN_SEED = 7_340_011
VAL_SEED = 99_173
SPLIT_SEEDS = {"test": TEST_SEED, "train": TRAIN_SEED, "val": VAL_SEED}
TEST_SIZE = 500


class Problem(TypedDict):
    question: str
    answer: str
    final: int


def make_prompt(question: str) -> str:
    """The model input for a question (also the lm-eval doc_to_text)."""
    return f"Q: {question}\nA:"


def make_problem(rng: random.Random) -> Problem:
    """One problem: a chain of MIN_OPS..MAX_OPS additions/subtractions with its worked solution."""
    n_ops = rng.randint(MIN_OPS, MAX_OPS)
    total = rng.randint(MIN_OPERAND, MAX_OPERAND)
    question = str(total)
    lines = []
    for step in range(1, n_ops + 1):
        op = rng.choice("+-")
        b = rng.randint(MIN_OPERAND, MAX_OPERAND)
        # Flip the operator instead of resampling so the total stays in range; one side always fits (b <= 9).
        if op == "+" and total + b > MAX_TOTAL:
            op = "-"
        elif op == "-" and total - b < 0:
            op = "+"
        new = total + b if op == "+" else total - b
        lines.append(f"Step {step}: {total} {op} {b} = {new}\n")
        question += f"{op}{b}"
        total = new
    answer = " " + "".join(lines) + f"#### {total}"
    return Problem(question=question, answer=answer, final=total)


def iter_problems(rng: random.Random, exclude: Iterable[str] = ()) -> Iterator[Problem]:
    """Endless stream of problems whose question is not in `exclude` (e.g. the test questions)."""
    banned = set(exclude)
    while True:
        p = make_problem(rng)
        if p["question"] not in banned:
            yield p


def make_split(name: str, n: int, seed: int | None = None) -> list[Problem]:
    """`n` distinct problems of split `name`; any split other than 'test' excludes every test question.

    The seed defaults to the split's fixed seed, so make_split('test', TEST_SIZE) is the shipped test set.
    """
    rng = random.Random(SPLIT_SEEDS[name] if seed is None else seed)
    exclude = () if name == "test" else test_questions()
    seen: set[str] = set()
    out: list[Problem] = []
    for p in iter_problems(rng, exclude):
        if len(out) == n:
            break
        if p["question"] not in seen:
            seen.add(p["question"])
            out.append(p)
    return out


def test_questions() -> set[str]:
    return {p["question"] for p in make_split("test", TEST_SIZE)}


def split_jsonl_text(docs: Iterable[Problem]) -> str:
    """The exact bytes (as str) of a split file: one JSON object per line, keys question then answer."""
    return "".join(
        json.dumps({"question": d["question"], "answer": d["answer"]}, ensure_ascii=True) + "\n" for d in docs
    )


def write_split_jsonl(path: str | Path, docs: Iterable[Problem]) -> None:
    Path(path).write_bytes(split_jsonl_text(docs).encode("ascii"))


def final_from_answer(answer: str) -> str | None:
    """The number after the last '#### ' in a solution, or None."""
    if "####" not in answer:
        return None
    return answer.rsplit("####", 1)[1].strip() or None
