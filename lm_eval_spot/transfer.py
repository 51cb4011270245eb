"""The ways data crosses between the host and the target's device: each crossing is ONE copy, whatever it carries.

On an accelerator every copy to the host waits for the device's queued work (a synchronisation), so a round's
crossings are what bounds how far the host and the device overlap. Several tensors crossing together are packed
into one byte buffer (any dtypes; bit for bit) and cross as one copy; `HostLink` counts what a request pulls.
Timing device work without extra synchronisations: `DeviceClock` (CUDA events, read after a copy has waited).
"""

from __future__ import annotations

import time

import torch

_ALIGN = 8  # bytes: each packed tensor starts at a multiple of the widest element size


def sync(device: torch.device) -> None:
    """Wait for queued kernels on an accelerator (for timing measurements only); no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pack(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, list[tuple[torch.dtype, torch.Size, int, int]]]:
    parts, layout, off = [], [], 0
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        n = raw.numel()
        pad = -n % _ALIGN
        parts.append(raw if not pad else torch.cat([raw, raw.new_zeros(pad)]))
        layout.append((t.dtype, t.shape, off, n))
        off += n + pad
    return (torch.cat(parts) if len(parts) > 1 else parts[0]), layout


def _unpack(buf: torch.Tensor, layout: list[tuple[torch.dtype, torch.Size, int, int]]) -> tuple[torch.Tensor, ...]:
    return tuple(buf[off : off + n].view(dtype).reshape(shape) for dtype, shape, off, n in layout)


def upload(*tensors: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Host tensors to the device in one copy (packed when there are several)."""
    if len(tensors) == 1:
        return (tensors[0].to(device),)
    buf, layout = _pack(tensors)
    return _unpack(buf.to(device), layout)


class HostLink:
    """Moves tensors to the host, one copy per call, and counts the calls and their bytes (on a CPU target the
    same tensors are counted, so the figures are what a GPU run would transfer)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.pulls = 0

    def pull(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.pulls += 1
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        if len(tensors) == 1:
            return (tensors[0].cpu(),)
        buf, layout = _pack(tensors)
        return _unpack(buf.cpu(), layout)


class DeviceClock:
    """Marks points in a device's work without waiting for it: CUDA events on a GPU (their elapsed time is read
    after a later copy has synchronised, so reading costs nothing), the host's clock elsewhere (where the work is
    done when the call returns)."""

    def __init__(self, device: torch.device) -> None:
        self.events = device.type == "cuda"

    def mark(self) -> object:
        if self.events:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def seconds(self, start: object, end: object) -> float:
        """Seconds between two marks; on a GPU only once both are done (after a synchronising copy)."""
        if self.events:
            return float(start.elapsed_time(end)) / 1000.0  # type: ignore[attr-defined]
        return float(end) - float(start)  # type: ignore[arg-type]
