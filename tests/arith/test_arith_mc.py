"""spot_arith_mc: wrong worked solutions, the multiple-choice docs and the lm-eval task (CPU, a few seconds)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from lm_eval_spot.arith import generator as gen
from lm_eval_spot.arith.choices import MAX_RESULT, mc_doc, parse_answer, wrong_solutions

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = ROOT / "tasks" / "spot_arith"
ASSET_DIR = ROOT / "lm_eval_spot" / "assets" / "spot-arith-target"
STEP = re.compile(r"Step (\d+): (\d+) ([+-]) (\d+) = (\d+)")
N_CHOICES = 4


def _task_utils():
    spec = importlib.util.spec_from_file_location("spot_arith_task_utils", TASK_DIR / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def problems() -> list[dict]:
    return [json.loads(x) for x in (TASK_DIR / "spot_arith_test.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return _task_utils().mc_docs()


def _steps(solution: str) -> list[tuple[int, str, int, int]]:
    return [(int(a), op, int(b), int(c)) for _, a, op, b, c in STEP.findall(solution)]


def _final(solution: str) -> int:
    return int(gen.final_from_answer(solution))


def _check_wrong(correct: str, wrong: str) -> None:
    """Same scaffold; exactly one step's result is off (by 1..3); every other line is right given the totals."""
    good, bad = _steps(correct), _steps(wrong)
    assert len(bad) == len(good) and re.sub(r"\d+", "N", wrong) == re.sub(r"\d+", "N", correct)
    slips = [i for i, (a, op, b, c) in enumerate(bad) if c != (a + b if op == "+" else a - b)]
    assert len(slips) == 1, wrong
    k = slips[0]
    assert bad[:k] == good[:k]
    assert 1 <= abs(bad[k][3] - good[k][3]) <= 3 and bad[k][:3] == good[k][:3]
    for prev, cur in zip(bad, bad[1:]):
        assert cur[0] == prev[3]  # each line starts from the previous (wrong) total
    assert [(op, b) for _, op, b, _ in bad] == [(op, b) for _, op, b, _ in good]  # the question's operations
    assert all(0 <= c <= MAX_RESULT for *_, c in bad)
    assert _final(wrong) == bad[-1][3] != _final(correct)


# ------------------------------------------------------------------------------------------------ wrong_solutions


def test_wrong_solutions_are_consistent_slips(problems):
    for i, p in enumerate(problems):
        wrongs = wrong_solutions(p["answer"], random.Random(i))
        assert len(wrongs) == 3
        for w in wrongs:
            _check_wrong(p["answer"], w)
        finals = {_final(w) for w in wrongs}
        assert len(finals) == 3 and _final(p["answer"]) not in finals


def test_wrong_solutions_is_deterministic_and_respects_range():
    answer = gen.make_problem(random.Random(3))["answer"]
    assert wrong_solutions(answer, random.Random(1)) == wrong_solutions(answer, random.Random(1))
    # A chain ending at 0 cannot slip downwards anywhere (the slip carries to the final; "-1" is two tokens).
    zero = " Step 1: 2 + 1 = 3\nStep 2: 3 - 1 = 2\nStep 3: 2 + 1 = 3\nStep 4: 3 - 3 = 0\n#### 0"
    slipped_steps = set()
    for seed in range(50):
        wrongs = wrong_solutions(zero, random.Random(seed))
        for w in wrongs:
            _check_wrong(zero, w)
            slipped_steps.add(next(i for i, (x, y) in enumerate(zip(_steps(zero), _steps(w))) if x != y))
        assert sorted(_final(w) for w in wrongs) == [1, 2, 3]
    assert slipped_steps == {0, 1, 2, 3}  # the slip lands on every step across seeds
    with pytest.raises(ValueError, match="reachable"):
        wrong_solutions(zero, random.Random(0), n=2, max_offset=1)
    with pytest.raises(ValueError, match="reachable"):
        wrong_solutions(zero, random.Random(0), n=7)
    with pytest.raises(ValueError, match="not a"):
        parse_answer(zero.replace("= 0", "= 1"))


# ------------------------------------------------------------------------------------------------ docs


def test_mc_docs_gold_is_the_problems_answer(problems, docs):
    assert len(docs) == gen.TEST_SIZE
    for p, d in zip(problems, docs):
        assert d["question"] == p["question"] and len(d["choices"]) == N_CHOICES
        assert len(set(d["choices"])) == N_CHOICES
        assert d["choices"][d["gold"]] == p["answer"]
        assert len({_final(c) for c in d["choices"]}) == N_CHOICES
        for j, c in enumerate(d["choices"]):
            if j != d["gold"]:
                _check_wrong(p["answer"], c)
    golds = Counter(d["gold"] for d in docs)
    assert set(golds) == set(range(N_CHOICES)) and max(golds.values()) < 0.4 * len(docs), golds


def test_mc_docs_are_pinned(docs):
    """The task is the same on every machine; a change here changes the task (bump its metadata version)."""
    utils = _task_utils()
    assert utils.mc_docs(utils.MINI_SIZE) == docs[: utils.MINI_SIZE]
    assert docs[0] == mc_doc({"question": docs[0]["question"], "answer": docs[0]["choices"][docs[0]["gold"]]},
                             random.Random("spot_arith_mc:0"))
    digest = hashlib.sha256(json.dumps(docs, sort_keys=True).encode()).hexdigest()
    assert digest[:16] == PINNED_DIGEST, digest


PINNED_DIGEST = "ee84705c258e8d0e"


def test_choices_tokenize_like_the_correct_solution(docs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ASSET_DIR))
    for d in docs:
        lengths = set()
        for c in d["choices"]:
            ids = tok.encode(c, add_special_tokens=False)
            assert tok.unk_token_id not in ids
            assert tok.decode(ids) == c
            lengths.add(len(ids))
        assert lengths == {len(tok.encode(d["choices"][d["gold"]], add_special_tokens=False))}
    assert all(len(tok.encode(str(n), add_special_tokens=False)) == 1 for n in range(MAX_RESULT + 1))


# ------------------------------------------------------------------------------------------------ lm-eval task


def test_lm_eval_builds_loglikelihood_requests(problems):
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_defaults=False, include_path=str(ROOT / "tasks"))
    assert {"spot_arith_mc", "spot_arith_mc_mini"} <= set(tm.all_tasks)
    task = tm.load(["spot_arith_mc_mini"])["tasks"]["spot_arith_mc_mini"]
    assert task.OUTPUT_TYPE == "multiple_choice" and task.config.num_fewshot == 0
    assert [m["metric"] for m in task.config.metric_list] == ["acc"]
    docs = list(task.test_docs())
    assert len(docs) == 50
    for p, doc in zip(problems, docs):
        choices = task.doc_to_choice(doc)
        assert len(choices) == N_CHOICES and choices[task.doc_to_target(doc)] == p["answer"]

    task.build_all_requests(rank=0, world_size=1)
    instances = task.instances
    assert len(instances) == 50 * N_CHOICES
    assert {inst.request_type for inst in instances} == {"loglikelihood"}
    by_doc: dict[int, list] = {}
    for inst in instances:
        by_doc.setdefault(inst.doc_id, []).append(inst)
    assert sorted(by_doc) == list(range(50))
    for doc_id, insts in by_doc.items():
        p = problems[doc_id]
        ctx = gen.make_prompt(p["question"])
        insts.sort(key=lambda inst: inst.idx)
        assert [inst.args for inst in insts] == [(ctx, c) for c in docs[doc_id]["choices"]]
        assert p["answer"] in [inst.args[1] for inst in insts]
