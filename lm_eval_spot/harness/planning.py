"""generate_until's requests as decode jobs: every request validated and planned before the first is decoded.

A job holds a request's prompt ids, its decode settings (lm-eval's gen_kwargs parsed, the model args' limits
applied), its stop strings and its seed. The seed depends only on the run's base seed, the context and which of
lm-eval's `repeats` copies it is, so any process count and batch size decode the same ids.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lm_eval_spot.adapters.base import TargetInfo, positions_needed
from lm_eval_spot.settings.args import SpotArgs, SpotUserError
from lm_eval_spot.decoding.noise import mix_seed
from lm_eval_spot.decoding.types import DecodeConfig
from lm_eval_spot.errors import preview
from lm_eval_spot.harness.gen_kwargs import GenKwargsError, parse_gen_kwargs

log = logging.getLogger("lm_eval.spot")

DEFAULT_MAX_GEN_TOKS = 256


class RequestError(SpotUserError):
    """A request the target cannot decode as asked (e.g. longer than its context); raised before any decoding."""


@dataclass(frozen=True)
class PlannedRequest:
    """An lm-eval generate_until request, validated and planned (ids, decoding settings, stop strings, seed): the
    harness's side of a request. The decoder receives it as a `decoding.batch.DecodeRequest`."""

    context: str
    prompt_ids: tuple[int, ...]
    raw_kwargs: dict[str, Any]
    cfg: DecodeConfig
    until: list[str]
    seed: int


def request_name(req: Any) -> str:
    """'task gsm8k, doc 3' from lm-eval's Instance (its fields may be unset outside the harness)."""
    task, doc = getattr(req, "task_name", None), getattr(req, "doc_id", None)
    return f"task {task}, doc {doc}" if task is not None else f"prompt ending {preview(req.args[0])}"


def plan_requests(requests: Sequence[Any], encode: Callable[[str], list[int]], tokenizer: Any, info: TargetInfo,
                  args: SpotArgs, base_seed: int, pad_rows: int) -> list[PlannedRequest]:
    """Every request planned, or the first bad one's error (nothing decoded)."""
    from lm_eval.models.utils import handle_stop_sequences

    jobs: list[PlannedRequest] = []
    prev, k = None, 0
    ignored_truncation = 0
    for req in requests:
        context, raw_kwargs = req.args[0], req.args[1]
        try:
            gen = parse_gen_kwargs(dict(raw_kwargs or {}), DEFAULT_MAX_GEN_TOKS)
        except GenKwargsError as err:
            raise GenKwargsError(f"spot-dlm: request {len(jobs)} ({request_name(req)}; set by --gen_kwargs or "
                                 f"the task's generation_kwargs): {err}; nothing was decoded") from None
        until = handle_stop_sequences(list(gen.until), eos=tokenizer.eos_token)
        max_toks = gen.max_gen_toks
        if args.gen_length is not None:
            max_toks = min(max_toks, args.gen_length)
        ignored_truncation += int(gen.temperature == 0 and (gen.top_k > 0 or gen.top_p < 1.0))
        # Greedy decoding ignores top_k / top_p (transformers' greedy search does too): off in its config.
        top_k, top_p = (gen.top_k, gen.top_p) if gen.temperature > 0 else (0, 1.0)
        cfg = DecodeConfig(max_gen_toks=max_toks, temperature=gen.temperature, top_k=top_k, top_p=top_p,
                           pad_rows=pad_rows, lookahead=args.lookahead)
        # lm-eval passes a request's `repeats` as the same object, consecutively: the k-th copy gets seed k.
        k = k + 1 if req is prev else 1
        prev = req
        ids = tuple(encode(context))
        check_fits(info, len(jobs), context, len(ids), max_toks)
        jobs.append(PlannedRequest(context, ids, raw_kwargs, cfg, until, mix_seed(base_seed, context, k)))
    if ignored_truncation:
        log.warning("spot-dlm: %d request(s) set top_k / top_p with greedy decoding (do_sample false or "
                    "temperature 0): greedy decoding ignores them, as transformers' does", ignored_truncation)
    warn_unknown_chars(tokenizer, encode, jobs)
    return jobs


def check_fits(info: TargetInfo, index: int, context: str, prompt_len: int, gen_len: int) -> None:
    """A request past the model's context would run on positions it was never trained on: refuse it."""
    need = positions_needed(info, prompt_len, gen_len)
    if info.max_positions is not None and need > info.max_positions:
        raise RequestError(
            f"spot-dlm: request {index} (prompt ending {preview(context)}) needs {need} positions (a prompt of "
            f"{prompt_len} tokens and up to {gen_len} generated, to the end of its last block of "
            f"{info.block_len}), more than the target's context of {info.max_positions}; nothing was decoded. "
            "Shorten the prompts (e.g. --num_fewshot), lower max_gen_toks / gen_length, or run a target with a "
            "longer context (the shipped pretrained=spot-gsm8k has 2048 positions: lm-eval's 5-shot gsm8k fits)"
        )


def warn_unknown_chars(tokenizer: Any, encode: Callable[[str], list[int]], jobs: list[PlannedRequest]) -> None:
    """Characters the tokenizer cannot encode become its unknown token: said once per call, with examples."""
    unk = getattr(tokenizer, "unk_token_id", None)
    hit = [j for j in jobs if unk is not None and unk in j.prompt_ids]
    if not hit:
        return
    chars = sorted({c for j in hit[:20] for c in set(j.context) if unk in encode(c)})
    log.warning("spot-dlm: %d prompt(s) contain characters the tokenizer does not know (%s); they are encoded "
                "as its unknown token %r", len(hit), ", ".join(repr(c) for c in chars[:10]) or "?",
                tokenizer.unk_token)
