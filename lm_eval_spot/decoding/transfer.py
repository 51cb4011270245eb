"""The one way results leave the target's device: a per-request link that counts what it moves."""

from __future__ import annotations

import torch


def sync(device: torch.device) -> None:
    """Wait for queued kernels on an accelerator (so a timer stops when the work is done); no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostLink:
    """Moves tensors to the host and counts their bytes (on a CPU target the same tensors are counted, so the
    figure is what a GPU run would transfer)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.pulls = 0

    def pull(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.pulls += 1
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return tuple(t.cpu() for t in tensors)
