"""A request's round times, split as the benchmark reports them: drafting (the round's start to its forward), the
target forward (between device marks: on a GPU its kernels, read once a later copy has waited for them), and the
rest of the round (transitions, verification, transfers, stop checks)."""

from __future__ import annotations

import time

import torch

from lm_eval_spot.transfer import DeviceClock
from lm_eval_spot.decoding.types import RoundTiming


class RoundClock:
    def __init__(self, device: torch.device) -> None:
        self.device = DeviceClock(device)
        self.timing = RoundTiming()
        self._start = self._forward = 0.0
        self._mark: object = None

    def start(self) -> None:
        self._start = time.perf_counter()

    def forward_begins(self) -> None:
        self._forward = time.perf_counter()
        self._mark = self.device.mark()

    def forward_ended(self) -> object:
        """A device mark after the forward (its time is read at `end`, after a copy has waited for it)."""
        return self.device.mark()

    def end(self, forward_end: object) -> float:
        """Close the round's times; returns its wall time in ms (start to end of verification)."""
        t_end = time.perf_counter()
        forward = self.device.seconds(self._mark, forward_end)
        draft = self._forward - self._start
        self.timing.add(draft=draft, forward=forward, rest=max(0.0, t_end - self._start - draft - forward))
        return 1000 * (t_end - self._start)
