"""Family `hf-block-causal`: a checkpoint that transformers loads natively as a causal LM (Qwen3, Llama, Qwen2,
...) and that was trained block-causally, such as the embedded target. No remote code."""

from __future__ import annotations

from typing import Any

from lm_eval_spot.adapters.block_causal import BlockCausalAdapter
from lm_eval_spot.settings.args import SpotArgError, SpotArgs
from lm_eval_spot.families import common

NAME = "hf-block-causal"
IMPLS = ("native",)
DEFAULT_BLOCK_LEN = 32


def matches(cfg: dict[str, Any]) -> bool:
    from transformers import CONFIG_MAPPING

    archs = cfg.get("architectures") or []
    return cfg.get("model_type") in CONFIG_MAPPING and any(a.endswith("ForCausalLM") for a in archs)


def load(args: SpotArgs, cfg: dict[str, Any], impl: str) -> common.LoadedTarget:
    from transformers import AutoModelForCausalLM

    tokenizer = common.load_tokenizer(args)
    device = common.resolve_device(args.device)
    remote = {"trust_remote_code": True} if args.trust_remote_code else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=common.torch_dtype(args), **remote)
    except common.weight_errors() as err:
        raise SpotArgError(f"spot-dlm: the weights of pretrained={args.pretrained!r} could not be loaded "
                           f"({type(err).__name__}: {str(err)[:300]})") from None
    model = model.to(device)
    if args.block_len is None and cfg.get("block_length") is None and cfg.get("block_size") is None:
        common.log.warning("checkpoint declares no block length: using block_len=%d", DEFAULT_BLOCK_LEN)
    info = common.target_info(args, cfg, tokenizer, default_block=DEFAULT_BLOCK_LEN, grid_origin="zero",
                              exact=True, vocab_size=model.config.vocab_size)
    return common.LoadedTarget(BlockCausalAdapter(model, info), tokenizer, NAME, "native")
