"""Wrong worked solutions for spot_arith, for the multiple-choice (likelihood) version of the task.

A wrong solution makes exactly one arithmetic slip: one step's result is off by a small nonzero offset, and every
later step is computed correctly from that wrong running total (same operators and operands as the question), so
the slip carries through to the final ``#### N``. The steps are linear, so the wrong final is always the correct
final plus the offset: distinct offsets give distinct finals. Every number stays in 0..MAX_TOTAL, where the
number-aware tokenizer has it as one token, so every choice has the same token layout (and length) as the correct
solution and only the numbers differ.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import TypedDict

from lm_eval_spot.arith.generator import MAX_TOTAL
from lm_eval_spot.arith.tokenizer import MAX_NUMBER_TOKEN

MAX_OFFSET = 3  # a slip changes one result by +-1..+-MAX_OFFSET
# Results a wrong step may show: non-negative (no "-" token) and one token in the number-aware vocabulary.
MAX_RESULT = min(MAX_TOTAL, MAX_NUMBER_TOKEN)

STEP_RE = re.compile(r"Step (\d+): (\d+) ([+-]) (\d+) = (\d+)\n")
FINAL_RE = re.compile(r"#### (\d+)$")

Step = tuple[str, int]  # (operator, operand)


class MCDoc(TypedDict):
    question: str
    choices: list[str]
    gold: int


def parse_answer(answer: str) -> tuple[int, list[Step], int]:
    """(first operand, [(op, operand), ...], final) of a correct solution; ValueError if it is not one."""
    steps = STEP_RE.findall(answer)
    final = FINAL_RE.search(answer)
    if not steps or final is None:
        raise ValueError(f"not a spot_arith solution: {answer!r}")
    start = int(steps[0][1])
    ops = [(op, int(b)) for _, _, op, b, _ in steps]
    if render(start, ops) != answer:
        raise ValueError(f"not a consistent spot_arith solution: {answer!r}")
    return start, ops, int(final.group(1))


def _apply(total: int, op: str, b: int) -> int:
    return total + b if op == "+" else total - b


def render(start: int, ops: list[Step], slip_step: int | None = None, offset: int = 0) -> str:
    """The worked solution from `start`; with `slip_step` (0-based) that step's result is shifted by `offset`
    and the later steps continue from the shifted total."""
    total, lines = start, []
    for i, (op, b) in enumerate(ops):
        new = _apply(total, op, b) + (offset if i == slip_step else 0)
        lines.append(f"Step {i + 1}: {total} {op} {b} = {new}\n")
        total = new
    return " " + "".join(lines) + f"#### {total}"


def _slip_fits(start: int, ops: list[Step], slip_step: int, offset: int) -> bool:
    """Every result of the slipped solution (from the slip on) lies in 0..MAX_RESULT."""
    total = start
    for i, (op, b) in enumerate(ops):
        total = _apply(total, op, b) + (offset if i == slip_step else 0)
        if i >= slip_step and not 0 <= total <= MAX_RESULT:
            return False
    return True


def wrong_solutions(answer: str, rng: random.Random, n: int = 3, *, max_offset: int = MAX_OFFSET) -> list[str]:
    """`n` distinct wrong worked solutions for the correct solution `answer`, each with its own final answer
    (different from the correct one). Which step slips and by how much is drawn from `rng`; ValueError when
    fewer than `n` distinct finals are reachable with offsets up to `max_offset`."""
    start, ops, _ = parse_answer(answer)
    candidates = [
        (step, off)
        for step in range(len(ops))
        for off in range(-max_offset, max_offset + 1)
        if off and _slip_fits(start, ops, step, off)
    ]
    rng.shuffle(candidates)
    out: list[str] = []
    used_offsets: set[int] = set()
    for step, off in candidates:
        if len(out) == n:
            break
        if off not in used_offsets:  # the wrong final is correct final + off
            used_offsets.add(off)
            out.append(render(start, ops, step, off))
    if len(out) < n:
        raise ValueError(f"only {len(out)} wrong finals reachable for {answer!r} (asked for {n})")
    return out


def mc_doc(problem: Mapping[str, str], rng: random.Random, n_wrong: int = 3) -> MCDoc:
    """The multiple-choice doc of a problem ({"question", "answer", ...}): the correct solution and `n_wrong`
    wrong ones in an `rng`-shuffled order, and `gold`, the index of the correct one."""
    answer = problem["answer"]
    choices = [answer, *wrong_solutions(answer, rng, n_wrong)]
    rng.shuffle(choices)
    return MCDoc(question=problem["question"], choices=choices, gold=choices.index(answer))
