"""lm-eval's side of likelihood scoring: tokenised pairs, rolling windows, which requests get a greedy flag, the
noise seeds, and the run's statistics (per task: estimates, their Monte Carlo errors, forwards)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lm_eval_spot.decoding.noise import mix_seed
from lm_eval_spot.likelihood.scorer import Estimate


def encode_pair(encode: Callable[[str], list[int]], context: str, continuation: str,
                prefix_id: int) -> tuple[list[int], list[int]]:
    """Token ids of (context, continuation) as lm-eval's causal models split them: whitespace at the end of the
    context move to the continuation, the whole string is encoded once and the continuation's ids are what
    follows the context's (if the boundary merges into one token, the two are encoded apart). An empty
    context becomes the prefix token (the model conditions on something, as lm-eval's HF model does)."""
    n_space = len(context) - len(context.rstrip())
    if n_space:
        continuation = context[-n_space:] + continuation
        context = context[:-n_space]
    if not context:
        return [prefix_id], encode(continuation)
    whole = encode(context + continuation)
    ctx = encode(context)
    if whole[: len(ctx)] != ctx:  # the boundary merged: keep the context's own ids, the rest as continuation
        return ctx, encode(continuation)
    return ctx, whole[len(ctx) :]


def rolling_windows(tokens: list[int], prefix_id: int, max_len: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's disjoint rolling windows over a document: every token is scored once, each window's context plus
    continuation at most max_len + 1 tokens (context length 1: lm-eval's default for rolling likelihood)."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    return [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, prefix_id, max_len, 1)]


def pair_seed(base_seed: int, context: Sequence[int], continuation: Sequence[int], sharing: str) -> int:
    """The noise of one pair. "common": every continuation of one context shares its mask draws (the choices of a
    multiple-choice question are compared under the same noise); "independent": each pair its own."""
    if sharing == "common":
        return mix_seed(base_seed, "ll", tuple(context))
    return mix_seed(base_seed, "ll", tuple(context), tuple(continuation))


def greedy_wanted(keys: Sequence[tuple[str, Any]], option: str) -> list[bool]:
    """Which requests get a computed greedy flag. keys: each request's (task name, doc id). "auto": requests alone
    in their document (loglikelihood tasks such as lambada read the flag; a multiple-choice document has several
    requests and its tasks read the scores), "always", "never"."""
    if option == "always":
        return [True] * len(keys)
    if option == "never":
        return [False] * len(keys)
    count: dict[tuple[str, Any], int] = {}
    for k in keys:
        count[k] = count.get(k, 0) + 1
    return [count[k] == 1 for k in keys]


@dataclass
class TaskLikelihood:
    """One task's likelihood requests."""

    requests: int = 0
    exact: int = 0
    tokens: int = 0  # continuation tokens scored
    logprob_sum: float = 0.0
    variance_sum: float = 0.0  # of the Monte Carlo estimates (not-estimable ones left out, counted below)
    se_max: float = 0.0
    no_se: int = 0  # estimates with one sampled row: no standard error
    docs: int = 0  # multiple-choice documents (several requests)
    unsettled: int = 0  # documents whose best and second-best choice differ by less than 2 paired standard errors
    greedy: int = 0  # requests whose greedy flag was computed
    greedy_true: int = 0

    def add(self, e: Estimate, n_tokens: int) -> None:
        self.requests += 1
        self.exact += e.exact
        self.tokens += n_tokens
        self.logprob_sum += e.logprob
        if math.isnan(e.variance):
            self.no_se += 1
        else:
            self.variance_sum += e.variance
            self.se_max = max(self.se_max, e.se)

    def merge(self, o: TaskLikelihood) -> None:
        for k in ("requests", "exact", "tokens", "logprob_sum", "variance_sum", "no_se", "docs", "unsettled",
                  "greedy", "greedy_true"):
            setattr(self, k, getattr(self, k) + getattr(o, k))
        self.se_max = max(self.se_max, o.se_max)

    def summary(self) -> dict[str, Any]:
        n = self.requests
        return {"requests": n, "exact": self.exact, "continuation_tokens": self.tokens,
                "mean_logprob": self.logprob_sum / n if n else 0.0,
                # root mean square of the estimates' standard errors, and the largest
                "se_rms": math.sqrt(self.variance_sum / max(n - self.no_se, 1)), "se_max": self.se_max,
                "no_se": self.no_se, "mc_docs": self.docs, "mc_unsettled": self.unsettled,
                "greedy_computed": self.greedy, "greedy_true": self.greedy_true}


def paired_se(a: Estimate, b: Estimate) -> float:
    """Standard error of a.logprob - b.logprob: from the rows' paired differences where both were scored under
    the same noise and layout (common random masks), else from the two errors as if independent."""
    if len(a.unit_values) == len(b.unit_values) and all(
            x.shape == y.shape for x, y in zip(a.unit_values, b.unit_values, strict=True)) and not (a.exact and b.exact):
        var = 0.0
        for x, y in zip(a.unit_values, b.unit_values, strict=True):
            d = x - y
            if d.numel() > 1:
                var += float(d.var(unbiased=True)) / d.numel()
        return math.sqrt(var)
    return math.sqrt((0.0 if math.isnan(a.variance) else a.variance) + (0.0 if math.isnan(b.variance) else b.variance))


@dataclass
class LikelihoodStats:
    """The run's likelihood requests, per task, plus forwards and time."""

    tasks: dict[str, TaskLikelihood] = field(default_factory=dict)
    forwards: int = 0
    rows: int = 0
    greedy_forwards: int = 0  # forwards of the control decodes that computed greedy flags
    wall_s: float = 0.0

    def task(self, name: str) -> TaskLikelihood:
        return self.tasks.setdefault(name, TaskLikelihood())

    def add(self, task: str, e: Estimate, n_tokens: int) -> None:
        self.task(task).add(e, n_tokens)
        self.forwards += e.forwards
        self.rows += e.rows

    def add_docs(self, task: str, groups: Sequence[Sequence[Estimate]]) -> None:
        """Multiple-choice documents: is the decision between the two best choices settled by the estimates?"""
        t = self.task(task)
        for g in groups:
            if len(g) < 2:
                continue
            t.docs += 1
            best, second = sorted(g, key=lambda e: e.logprob, reverse=True)[:2]
            se = paired_se(best, second)
            if best.logprob - second.logprob < 2 * se:
                t.unsettled += 1

    def merge(self, o: LikelihoodStats) -> None:
        for name, t in o.tasks.items():
            self.task(name).merge(t)
        self.forwards += o.forwards
        self.rows += o.rows
        self.greedy_forwards += o.greedy_forwards
        self.wall_s = max(self.wall_s, o.wall_s)  # ranks run side by side

    @property
    def requests(self) -> int:
        return sum(t.requests for t in self.tasks.values())

    def summary(self) -> dict[str, Any]:
        return {"requests": self.requests, "forwards": self.forwards, "rows": self.rows,
                "greedy_forwards": self.greedy_forwards, "wall_s": self.wall_s,
                "tasks": {k: t.summary() for k, t in sorted(self.tasks.items())}}


def format_likelihood(summary: dict[str, Any], settings: str) -> str:
    """A short Markdown table per task for the end of a run."""
    lines = [f"spot-dlm likelihood ({settings}): {summary['requests']} requests, {summary['forwards']} forwards "
             f"({summary['greedy_forwards']} more for greedy flags), {summary['wall_s']:.1f} s",
             "| task | requests | exact | mean log p | MC s.e. (rms / max) | docs unsettled (< 2 s.e.) |",
             "|---|---|---|---|---|---|"]
    for name, t in summary["tasks"].items():
        unsettled = f"{t['mc_unsettled']} of {t['mc_docs']}" if t["mc_docs"] else "-"
        lines.append(f"| {name} | {t['requests']} | {t['exact']} | {t['mean_logprob']:.3f} | "
                     f"{t['se_rms']:.3f} / {t['se_max']:.3f} | {unsettled} |")
    return "\n".join(lines)
