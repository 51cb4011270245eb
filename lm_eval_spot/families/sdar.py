"""Family `sdar`: JetLM's SDAR block-diffusion models (Qwen3 architecture; model_type `sdar`).

Two implementations of the same forward:
- `native` (default): the SDAR weights in transformers' own Qwen3 classes, its config mapped field by field, with
  the project's block-causal prefix attention (`BlockCausalAdapter`). No remote code, no flash-attn; runs under
  transformers 4.57 and 5.x.
- `remote`: the official modeling code (trust_remote_code) driven by its own protocol: a BOOLEAN mask (True =
  attend; it calls `.bool()`, so an additive mask would be silently inverted), absolute position ids, and a
  DynamicCache that `store_kv=True` appends to and `store_kv=False` only reads.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from lm_eval_spot.adapters.block_causal import BlockCausalAdapter
from lm_eval_spot.adapters.remote_block_causal import RemoteBlockCausalAdapter
from lm_eval_spot.settings.args import SpotArgError, SpotArgs
from lm_eval_spot.families import common

NAME = "sdar"
IMPLS = ("native", "remote")
DEFAULT_BLOCK_LEN = 4  # SDAR-*-Chat without a -bN suffix

# config.json -> Qwen3Config, field by field. Anything not listed in one of these tables is an error.
SAME_NAME = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "attention_bias", "attention_dropout", "tie_word_embeddings", "initializer_range",
    "bos_token_id", "eos_token_id", "pad_token_id",
)
DECODER_FIELDS = ("block_size", "mask_token_id")  # read by the project (block length, mask id), not the forward
# Read by SDAR's training code or its loader only; its inference forward never looks at them.
NOT_IN_FORWARD = (
    "fuse_cross_entropy", "micro_forward", "skip_checkpoint", "debug", "ep_size", "use_deepep", "use_cache",
    # SDARAttention has no sliding-window branch: these three never change its output.
    "use_sliding_window", "sliding_window", "max_window_layers",
)
METADATA = ("architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype",
            "_name_or_path", "attn_implementation")


def matches(cfg: dict[str, Any]) -> bool:
    return cfg.get("model_type") == "sdar" or "SDARForCausalLM" in (cfg.get("architectures") or [])


def qwen3_config(cfg: dict[str, Any]) -> Any:
    """SDAR config.json -> transformers Qwen3Config. A field that does not map is an error, never skipped."""
    from transformers import PretrainedConfig, Qwen3Config

    generic = set(PretrainedConfig().to_dict())  # generation defaults and the like: no effect on the forward
    known = set(SAME_NAME) | set(DECODER_FIELDS) | set(NOT_IN_FORWARD) | set(METADATA)
    unknown = sorted(k for k in cfg if k not in known and k not in generic)
    if unknown:
        raise SpotArgError(
            f"spot-dlm: impl=native cannot map SDAR config field(s) {', '.join(unknown)} onto Qwen3; "
            "use impl=remote (trust_remote_code=true), or extend the map in lm_eval_spot/families/sdar.py"
        )
    skipped = sorted(k for k in cfg if k in set(NOT_IN_FORWARD) | set(METADATA) | set(DECODER_FIELDS))
    common.log.debug("sdar: config fields not passed to the forward: %s", ", ".join(skipped))
    out = Qwen3Config(**{k: cfg[k] for k in SAME_NAME if k in cfg}, use_sliding_window=False)
    out.architectures = ["Qwen3ForCausalLM"]
    return out


def _load_native(args: SpotArgs, cfg: dict[str, Any]) -> torch.nn.Module:
    from transformers import Qwen3ForCausalLM

    return common.load_native_weights(Qwen3ForCausalLM, args, qwen3_config(cfg),
                                      "SDAR")


def alias_loss_kwargs() -> None:
    """SDAR's modeling file imports `transformers.utils.LossKwargs` (a TypedDict used only in type hints), which
    transformers removed in 4.54; alias it to its successor so the official file imports under 4.57."""
    import transformers.utils as tu

    if not hasattr(tu, "LossKwargs"):
        from transformers.utils.generic import TransformersKwargs

        tu.LossKwargs = TransformersKwargs
        common.log.info("sdar: aliased transformers.utils.LossKwargs to TransformersKwargs for the remote code")


def _load_remote(args: SpotArgs) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    common.require_remote(args, NAME)
    for module, why in (("flash_attn", "its RMSNorm is flash-attn's triton kernel"), ("einops", "rearrange"),
                        ("triton", "its fused loss module")):
        if importlib.util.find_spec(module) is None:
            raise SpotArgError(
                f"spot-dlm: SDAR's remote code imports {module} at load ({why}): install it "
                f"(pip install {module.replace('_', '-')}), or use impl=native (no remote code, no flash-attn)"
            )
    if common.resolve_device(args.device).type == "cuda" and args.dtype == "float32":
        raise SpotArgError(
            "spot-dlm: SDAR's remote code attends through flash_attn_func on CUDA, which takes float16 / bfloat16 "
            "only; pass dtype=bfloat16 (dtype=auto gives float32 when the checkpoint states no half dtype), or "
            "impl=native, which runs any dtype"
        )
    alias_loss_kwargs()
    return AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=common.torch_dtype(args),
                                                trust_remote_code=True)


class SDARProtocol:
    """SDAR's official forward: bool mask [B, 1, Q, K] (True = attend), absolute positions, store_kv."""

    def forward(self, model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                cache: Any, store: bool, keep: int) -> torch.Tensor:
        kw: dict[str, Any] = {"use_cache": False}
        if cache is not None:
            kw = {"past_key_values": cache, "use_cache": True, "store_kv": store}
        # Its forward takes logits_to_keep (an int keeps the last positions): the head sees only those.
        return model(input_ids=ids, attention_mask=allowed.unsqueeze(1), position_ids=positions, logits_to_keep=keep,
                     **kw).logits


def load(args: SpotArgs, cfg: dict[str, Any], impl: str) -> common.LoadedTarget:
    tokenizer = common.load_tokenizer(args)
    device = common.resolve_device(args.device)
    model = (_load_native(args, cfg) if impl == "native" else _load_remote(args)).to(device).eval()
    info = common.target_info(args, cfg, tokenizer, default_block=DEFAULT_BLOCK_LEN, grid_origin="zero",
                              exact=True, vocab_size=cfg["vocab_size"])
    adapter = BlockCausalAdapter(model, info) if impl == "native" else RemoteBlockCausalAdapter(model, info, SDARProtocol())
    return common.LoadedTarget(adapter, tokenizer, NAME, impl)


def official_control(loaded: common.LoadedTarget, prompts: list[list[int]]) -> str:
    return ("not defined: SDAR's block_diffusion_generate has no greedy mode whose positions follow the paper's rule "
            "(its top_k=1 makes every confidence 1.0); the family tests use it as the reference for the forward "
            "protocol only")
