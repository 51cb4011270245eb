"""When a request stops: the first stop id or stop string in its committed prefix, or its length cap."""

from __future__ import annotations

from lm_eval_spot.decoding.types import StopCheck


def first_stop(ids: list[int], stop_ids: frozenset[int]) -> int | None:
    return next((i for i, t in enumerate(ids) if t in stop_ids), None)


class StopWatch:
    def __init__(self, stop_ids: frozenset[int], stop_check: StopCheck | None, max_gen_toks: int) -> None:
        self.stop_ids, self.stop_check, self.max_gen_toks = stop_ids, stop_check, max_gen_toks
        self.checked_len = 0

    def check(self, prefix: list[int]) -> tuple[list[int], str] | None:
        """(the ids to return, the stop reason) once `prefix` ends the request, else None."""
        if len(prefix) <= self.checked_len:
            return None
        self.checked_len = len(prefix)
        # Whichever stop comes first in the id stream wins, however far this round moved the prefix: a speculative
        # round can pass a stop string and a later stop id at once, where control saw the string first.
        cut = first_stop(prefix, self.stop_ids)
        head = prefix if cut is None else prefix[:cut]
        keep = self.stop_check(head) if self.stop_check is not None and head else None
        if keep is not None:
            return head[:keep], "until"
        if cut is not None:
            return head, "eos"
        if len(prefix) >= self.max_gen_toks:
            return prefix, "length"
        return None
