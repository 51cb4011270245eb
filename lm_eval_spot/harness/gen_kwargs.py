"""A request's generation kwargs, validated: every knob is honoured or refused by name, never ignored.

lm-eval hands each generate request the task's `generation_kwargs` merged with `--gen_kwargs`. The decoder
implements `until`, the token cap (`max_gen_toks` or lm-eval's aliases), `do_sample`, `temperature`, `top_k` and
`top_p`; a few other transformers knobs are accepted at the value that turns them off (so stock task YAMLs that
spell `num_beams: 1` run); anything else, or a value of the wrong type or range, is a one-line error raised
before any request is decoded. lm-eval's own normalisation then gives the semantics (alias priority, `do_sample`
against `temperature`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lm_eval_spot.settings.args import SpotUserError

MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")  # lm-eval's aliases
ACCEPTED = ("until", *MAX_TOKEN_KEYS, "do_sample", "temperature", "top_k", "top_p")
# Knobs the decoder does not implement, accepted only at the value where they change nothing.
NEUTRAL: dict[str, float] = {"num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0}


class GenKwargsError(SpotUserError):
    """A generation kwarg the decoder does not implement, or a value of the wrong type or range."""


@dataclass(frozen=True)
class GenSettings:
    until: tuple[str, ...]  # as the task gave them (lm-eval adds the tokenizer's eos later)
    max_gen_toks: int
    temperature: float  # 0.0: greedy (do_sample false, or temperature 0)
    top_k: int  # 0: off
    top_p: float  # 1.0: off

    @property
    def truncates(self) -> bool:
        """top_k / top_p asked for with sampling on (greedy decoding ignores them, as transformers' does)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0)


def _accepted_list() -> str:
    off = ", ".join(f"{k}={v:g}" for k, v in NEUTRAL.items())
    return (f"until (a string or a list of strings), max_gen_toks (or {', '.join(MAX_TOKEN_KEYS[1:])}: a positive "
            f"integer), do_sample (true/false), temperature (>= 0), top_k (an integer >= 1, or 0 for off), top_p "
            f"(0 < top_p <= 1); accepted as no-ops: {off}")


def _number(key: str, value: Any, what: str) -> float:
    if isinstance(value, bool) or value is None:
        raise GenKwargsError(f"generation kwarg {key}={value!r} is not {what}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise GenKwargsError(f"generation kwarg {key}={value!r} is not {what}") from None
    if not math.isfinite(x):
        raise GenKwargsError(f"generation kwarg {key}={value!r} is not {what}")
    return x


def _integer(key: str, value: Any, what: str) -> int:
    x = _number(key, value, what)
    if not x.is_integer():
        raise GenKwargsError(f"generation kwarg {key}={value!r} is not {what}")
    return int(x)


def check_gen_kwargs(raw: Mapping[str, Any]) -> None:
    """Raise GenKwargsError for the first key or value the decoder cannot honour as given."""
    for key, value in raw.items():
        if key in NEUTRAL:
            ok = value is None or (not isinstance(value, bool) and isinstance(value, (int, float))
                                   and float(value) == NEUTRAL[key])
            if not ok:
                raise GenKwargsError(f"generation kwarg {key}={value!r} is not supported by spot-dlm's decoder "
                                     f"(only {key}={NEUTRAL[key]:g}, which changes nothing); accepted: "
                                     f"{_accepted_list()}")
        elif key not in ACCEPTED:
            raise GenKwargsError(f"generation kwarg {key}={value!r} is not supported by spot-dlm's decoder; "
                                 f"accepted: {_accepted_list()}")
    until = raw.get("until")
    if until is not None and not isinstance(until, str) and not (
            isinstance(until, (list, tuple)) and all(isinstance(s, str) for s in until)):
        raise GenKwargsError(f"generation kwarg until={until!r} is not a string or a list of strings")
    for key in MAX_TOKEN_KEYS:
        if raw.get(key) is not None and _integer(key, raw[key], "a positive integer") < 1:
            raise GenKwargsError(f"generation kwarg {key}={raw[key]!r} is not a positive integer")
    if raw.get("do_sample") is not None and not isinstance(raw["do_sample"], bool):
        raise GenKwargsError(f"generation kwarg do_sample={raw['do_sample']!r} is not true or false")
    if raw.get("temperature") is not None:
        if _number("temperature", raw["temperature"], "a number >= 0") < 0:
            raise GenKwargsError(f"generation kwarg temperature={raw['temperature']!r} is not a number >= 0")
    if raw.get("top_k") is not None:
        if _integer("top_k", raw["top_k"], "an integer >= 1 (or 0 for off)") < 0:
            raise GenKwargsError(f"generation kwarg top_k={raw['top_k']!r} is not an integer >= 1 (or 0 for off)")
    if raw.get("top_p") is not None:
        p = _number("top_p", raw["top_p"], "a number with 0 < top_p <= 1")
        if not 0.0 < p <= 1.0:
            raise GenKwargsError(f"generation kwarg top_p={raw['top_p']!r} is not a number with 0 < top_p <= 1")


def parse_gen_kwargs(raw: Mapping[str, Any], default_max_gen_toks: int) -> GenSettings:
    """Validate, then read the settings with lm-eval's own normalisation (its alias priority and warnings)."""
    from lm_eval.models.utils import normalize_gen_kwargs

    check_gen_kwargs(raw)
    # Normalise what was validated: None stands for "not given" in lm-eval's own handling.
    kw = normalize_gen_kwargs({k: v for k, v in raw.items() if v is not None},
                              default_max_gen_toks=default_max_gen_toks)
    until = kw.get("until") or []
    temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample") else 0.0
    top_k = int(float(raw["top_k"])) if raw.get("top_k") is not None else 0
    top_p = float(raw["top_p"]) if raw.get("top_p") is not None else 1.0
    return GenSettings(tuple(s for s in until if s is not None), int(kw["max_gen_toks"]), temperature, top_k, top_p)
