"""Tiny random-weight checkpoints of the real families, built from the OFFICIAL remote code in ../shared.

Each checkpoint is saved with `save_pretrained` into a temp folder (weights in safetensors, the official .py
files next to them as transformers writes them) with the embedded target's tokenizer, so the project's loaders
read it exactly as they would a downloaded checkpoint. Nothing from ../shared is copied into the project."""

from __future__ import annotations

import copy
import shutil
import sys
from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[3] / "shared" / "remote_code"
TOKENIZER = Path(__file__).resolve().parents[2] / "lm_eval_spot" / "assets" / "spot-arith-target"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/remote_code is absent (it is in CI)")


def transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


needs_remote = pytest.mark.skipif(
    not SHARED.is_dir() or transformers_major() >= 5,
    reason="the official remote code runs only under transformers 4.x (and ../shared must be present)")


def add_test_stubs() -> None:
    """TEST-ONLY: the pure-torch flash_attn stand-in from ../shared (SDAR's remote code imports flash_attn)."""
    stubs = str(SHARED / "_test_stubs")
    if stubs not in sys.path:
        sys.path.insert(0, stubs)


def tokenizer_mask_id() -> int:
    from transformers import AutoTokenizer

    return int(AutoTokenizer.from_pretrained(TOKENIZER).mask_token_id)


def build_remote(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, scale: float = 1.0, **overrides):
    """The official model class from ../shared/remote_code/<family> with random weights (seeded). `scale` multiplies
    the output head so that random logits are peaked (clear argmax margins, like a trained model's)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    if family == "sdar":
        add_test_stubs()
        from lm_eval_spot.families.sdar import alias_loss_kwargs

        alias_loss_kwargs()
    cfg = AutoConfig.from_pretrained(SHARED / family, trust_remote_code=True)
    cfg = copy.deepcopy(cfg)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    kw = {"attn_implementation": "sdpa"} if family == "llada2_moe" else {}
    auto = AutoModel if family in ("llada", "dream") else AutoModelForCausalLM  # their official entry point
    model = auto.from_config(cfg, trust_remote_code=True, dtype=dtype, **kw).eval()
    if scale != 1.0:
        head = model.model.transformer.ff_out if family == "llada" else model.lm_head
        with torch.no_grad():
            head.weight.mul_(scale)
    return model


def save_checkpoint(model, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER / name, folder / name)
    return folder
