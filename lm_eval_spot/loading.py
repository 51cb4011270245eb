"""Load a target checkpoint and its tokenizer into an adapter, reading interface facts from the checkpoint."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from lm_eval_spot.adapters.base import TargetInfo
from lm_eval_spot.adapters.block_causal import BlockCausalAdapter
from lm_eval_spot.config import SpotArgError, SpotArgs

# A child of lm-eval's logger: its CLI shows these messages (run summary, load facts) with its own.
log = logging.getLogger("lm_eval.spot")

DEFAULT_BLOCK_LEN = 32
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedTarget:
    adapter: BlockCausalAdapter
    tokenizer: Any  # transformers PreTrainedTokenizerBase


def resolve_device(requested: str) -> torch.device:
    """Like lm-eval's HFLM: an unavailable accelerator falls back to the CPU, with a warning."""
    dev = torch.device(requested)
    if dev.type == "cuda" and not torch.cuda.is_available():
        log.warning("device=%s requested but CUDA is not available: using cpu", requested)
        return torch.device("cpu")
    return dev


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def stop_ids_of(tokenizer: Any, model_config: Any, generation_config: Any) -> frozenset[int]:
    """eos and end-of-turn ids as the checkpoint declares them (tokenizer, config, generation config)."""
    ids = _ids(tokenizer.eos_token_id) | _ids(getattr(model_config, "eos_token_id", None))
    if generation_config is not None:
        ids |= _ids(getattr(generation_config, "eos_token_id", None))
    return frozenset(ids)


def load_target(args: SpotArgs) -> LoadedTarget:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    remote = {"trust_remote_code": True} if args.trust_remote_code else {}
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.pretrained, **remote)
    if tokenizer.mask_token_id is None:
        raise SpotArgError(
            f"spot-dlm: the tokenizer of pretrained={args.pretrained!r} has no mask token; a diffusion target "
            "needs one (accepted: a checkpoint whose tokenizer defines mask_token)"
        )
    device = resolve_device(args.device)
    dtype = "auto" if args.dtype == "auto" else _DTYPES[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=dtype, **remote).to(device)
    try:
        gen_cfg = GenerationConfig.from_pretrained(args.pretrained)
    except OSError:
        gen_cfg = None
    cfg_block = getattr(model.config, "block_length", None) or getattr(model.config, "block_size", None)
    block_len = args.block_len or cfg_block
    if block_len is None:
        log.warning("checkpoint declares no block length: using block_len=%d", DEFAULT_BLOCK_LEN)
        block_len = DEFAULT_BLOCK_LEN
    info = TargetInfo(
        mask_id=int(tokenizer.mask_token_id),
        stop_ids=stop_ids_of(tokenizer, model.config, gen_cfg),
        block_len=int(block_len),
        grid_origin="zero",
        exact_prefix_cache=True,
        vocab_size=int(model.config.vocab_size),
    )
    log.info("loaded target %s: block_len=%d, mask_id=%d, stop_ids=%s, device=%s",
             args.pretrained, info.block_len, info.mask_id, sorted(info.stop_ids), device)
    return LoadedTarget(BlockCausalAdapter(model, info), tokenizer)
