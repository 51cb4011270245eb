"""Load a target checkpoint and its tokenizer into an adapter (through its family; see `lm_eval_spot.families`)."""

from __future__ import annotations

from lm_eval_spot.families import load_target
from lm_eval_spot.families.common import LoadedTarget, resolve_device, with_concrete_dtype

__all__ = ["LoadedTarget", "load_target", "resolve_device", "with_concrete_dtype"]
