"""A second device emulated on the CPU, for counting host-device crossings in tests.

On a CPU run every tensor lives in the same memory, so a decoding loop that reads a device value back with
`int(t)` or indexes a device tensor with a host one costs nothing and goes unnoticed; on a GPU each is a
synchronisation (or an error). `DeviceEmulation` is a torch function mode that marks tensors as "on the device":
the model's parameters and buffers, tensors created with an explicit `device=`, tensors moved with `.to(...)`,
and every result of an op that reads a marked tensor. It counts:
- downloads: a marked tensor read by the host (`.cpu()`, `.item()`, `.tolist()`, `.numpy()`, `bool()`, `int()`,
  `float()`, a marked value stored into a host tensor);
- uploads: an unmarked tensor moved with `.to(...)` or created from host data with `device=`, and implicit ones
  (a host tensor with elements mixed into an op on marked tensors, as indexing does).
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

MARK = "_emulated_device"
READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__bool__,
         torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
FROM_DATA = {torch.tensor, torch.as_tensor}


def marked(t: object) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, MARK, False)


def mark(obj: object) -> None:
    for t in tree_flatten(obj)[0]:
        if isinstance(t, torch.Tensor):
            try:
                setattr(t, MARK, True)
            except (AttributeError, RuntimeError):  # some results (e.g. sizes) take no attributes
                pass


def place(module: torch.nn.Module) -> None:
    """Put a model "on the device": its parameters and buffers are marked."""
    for t in list(module.parameters()) + list(module.buffers()):
        setattr(t, MARK, True)


class DeviceEmulation(TorchFunctionMode):
    def __init__(self, keep_stacks: bool = False, official: tuple[str, ...] = ("transformers_modules",)) -> None:
        """official: path parts of code that is not the project's (a family's remote code): crossings made there
        are counted apart, in `official_crossings`."""
        super().__init__()
        self.uploads = self.downloads = self.official_crossings = 0
        self.where: Counter[str] = Counter()
        self.keep_stacks = keep_stacks
        self.official = official

    def _count(self, kind: str) -> None:
        stack = traceback.extract_stack()[:-2]
        if any(part in f.filename for f in stack for part in self.official):
            self.official_crossings += 1
            return
        if kind == "down":
            self.downloads += 1
        else:
            self.uploads += 1
        if self.keep_stacks:
            frames = [f for f in traceback.extract_stack()[:-2] if "lm_eval_spot" in f.filename]
            if frames:
                f = frames[-1]
                self.where[f"{kind} {f.filename.split('lm_eval_spot/')[-1]}:{f.lineno} {f.line}"] += 1

    def reset(self) -> tuple[int, int]:
        out = (self.uploads, self.downloads)
        self.uploads = self.downloads = 0
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        dev = [t for t in flat if marked(t)]
        if func in READS:
            if dev:
                self._count("down")
            out = func(*args, **kwargs)  # a host value (on the CPU `.cpu()` returns the tensor itself: copy it)
            return out.clone() if out is args[0] else out
        if func is torch.Tensor.to:
            moves = any(isinstance(a, (torch.device, str)) for a in args[1:]) or "device" in kwargs
            out = func(*args, **kwargs)
            if out is args[0] and moves and not marked(out):
                out = out.clone()  # the host tensor stays a host tensor
            if moves and not marked(args[0]):
                self._count("up")
            if moves or marked(args[0]):
                mark(out)
            return out
        if func is torch.Tensor.__setitem__ and args and not marked(args[0]) and dev:
            self._count("down")  # a device value written into host memory
            return func(*args, **kwargs)
        if kwargs.get("device") is not None:
            out = func(*args, **kwargs)
            if func in FROM_DATA and out.numel():
                self._count("up")
            mark(out)
            return out
        if dev and any(not marked(t) and t.dim() > 0 for t in flat):
            self._count("up")  # a host tensor mixed into device work: copied up implicitly
        out = func(*args, **kwargs)
        if dev:
            mark(out)
        return out
