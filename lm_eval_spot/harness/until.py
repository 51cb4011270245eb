"""`until` stop strings over generated ids: the cut is found on decoded text, so a string may span blocks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[list[int]], str]


def cut_text(text: str, until: Sequence[str]) -> str:
    """lm-eval's semantics: the continuation ends before the first occurrence of any stop string."""
    hits = [text.find(s) for s in until if s and s in text]
    return text[: min(hits)] if hits else text


def make_stop_check(decode: Decode, until: Sequence[str]) -> Callable[[list[int]], int | None]:
    """ids -> the shortest id prefix whose text contains a stop string (ids kept up to it), else None."""
    stops = [s for s in until if s]

    def contains(ids: list[int]) -> bool:
        text = decode(ids)
        return any(s in text for s in stops)

    def check(ids: list[int]) -> int | None:
        if not stops or not contains(ids):
            return None
        keep = len(ids)
        while keep > 1 and contains(ids[: keep - 1]):
            keep -= 1
        return keep

    return check
