"""Prompts (and their scoring) from any lm-eval generation task, through lm-eval's own task manager.

The benchmark decodes a task's requests exactly as `lm_eval --tasks NAME` would build them (few-shot setting,
chat template with --apply_chat_template, `until` and `max_gen_toks` from the task's generation kwargs) and scores
each generation with the task's own filters and metric, so nothing task-specific lives in the decoding code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskPrompt:
    context: str
    until: tuple[str, ...]
    max_gen_toks: int


class TaskSource:
    """The first `limit` requests of one generation task, and its scorer."""

    def __init__(self, name: str, limit: int | None, chat_template: Callable[..., str] | None = None,
                 eos: str | None = None, include_path: str | None = None, num_fewshot: int | None = None) -> None:
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
        from lm_eval.tasks import TaskManager, get_task_dict

        tm = TaskManager(include_path=include_path)
        tasks = get_task_dict([name], tm)
        if len(tasks) != 1:
            raise ValueError(f"--tasks {name!r} names a group of {len(tasks)} tasks; give one generation task")
        self.name, self.task = next(iter(tasks.items()))
        if num_fewshot is not None:  # as `lm_eval --num_fewshot` sets it
            self.task.set_config(key="num_fewshot", value=num_fewshot)
        if self.task.OUTPUT_TYPE != "generate_until":
            raise ValueError(f"task {name!r} has output_type {self.task.OUTPUT_TYPE}: only generate_until tasks decode")
        self.task.build_all_requests(limit=limit, apply_chat_template=chat_template is not None,
                                     chat_template=chat_template)
        self.instances = sorted(self.task.instances, key=lambda x: (x.doc_id, x.idx))
        self.prompts: list[TaskPrompt] = []
        for inst in self.instances:
            context, raw = inst.args[0], inst.args[1]
            kw = normalize_gen_kwargs(dict(raw), default_max_gen_toks=256)
            until = handle_stop_sequences(kw.get("until"), eos=eos)
            self.prompts.append(TaskPrompt(context, tuple(until), int(kw["max_gen_toks"])))
        log.info("task %s: %d requests", self.name, len(self.prompts))

    def score(self, texts: list[str]) -> list[float]:
        """The task's primary metric (its first), per request, for generations in request order; through the
        task's first filter, as lm-eval's evaluator applies it."""
        for inst, text in zip(self.instances, texts, strict=True):
            inst.resps = [text]
            inst.filtered_resps = {}
        self.task.apply_filters()
        key = next(iter(self.instances[0].filtered_resps))
        out = []
        for inst in self.instances:
            metrics: dict[str, Any] = self.task.process_results(inst.doc, [inst.filtered_resps[key]])
            out.append(float(next(iter(metrics.values()))))
        return out


def task_prompts(name: str, split: str, n: int, include_path: str | None = None) -> list[str]:
    """Zero-shot prompts (the task's doc_to_text) of the first n docs of one split of an lm-eval task: the
    prompt source for drafter training and graph calibration on any task (use a split the evaluation does not)."""
    from itertools import islice

    from lm_eval.tasks import TaskManager, get_task_dict

    tasks = get_task_dict([name], TaskManager(include_path=include_path))
    if len(tasks) != 1:
        raise ValueError(f"{name!r} names a group of {len(tasks)} tasks; give one task")
    task = next(iter(tasks.values()))
    getter = {"train": task.training_docs, "validation": task.validation_docs, "test": task.test_docs}.get(split)
    if getter is None:
        raise ValueError(f"split {split!r} is not one of train, validation, test")
    has = {"train": task.has_training_docs, "validation": task.has_validation_docs, "test": task.has_test_docs}[split]
    if not has():
        raise ValueError(f"task {name!r} has no {split} split")
    return [str(task.doc_to_text(d)) for d in islice(getter(), n)]
