"""Helpers of the paper-style plugin tasks (code execution goes through the `code_eval` metric, loaded the
normal `evaluate` way: offline, a local `code_eval` folder in the working directory)."""

from __future__ import annotations

import re

_CODE_EVAL = None


def _code_eval():
    global _CODE_EVAL  # loaded once per process: loading the metric script is slow
    if _CODE_EVAL is None:
        import evaluate

        _CODE_EVAL = evaluate.load("code_eval")
    return _CODE_EVAL


def pass_at_1(references: list[str], predictions: list[list[str]]) -> float:
    result = _code_eval().compute(references=references, predictions=predictions, k=[1])
    return result[0]["pass@1"]


def _cut(text: str) -> str:
    return text if text.find("```") == -1 else text[: text.find("```")]


def build_predictions(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """HumanEval: the generation continues the prompt's function (gen_prefix holds the prompt)."""
    return [[doc["prompt"] + _cut(r) for r in resp] for resp, doc in zip(resps, docs)]


def build_predictions_plain(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    return [[_cut(r) for r in resp] for resp in resps]


def _boxed(text: str) -> str | None:
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, j = 0, i + len("\\boxed{")
    for k in range(j, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            if depth == 0:
                return text[j:k]
            depth -= 1
    return None


def _norm(s: str) -> str:
    s = s.strip().strip("$").replace(" ", "").replace("\\!", "").replace("dfrac", "frac").replace("tfrac", "frac")
    return re.sub(r"\\text\{(.*?)\}", r"\1", s).rstrip(".")


def process_math(doc: dict, results: list[str]) -> dict[str, float]:
    got = _boxed(results[0])
    return {"exact_match": float(got is not None and _norm(got) == _norm(str(doc["answer"])))}
