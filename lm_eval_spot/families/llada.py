"""Family `llada`: GSAI-ML's LLaDA-8B(-Instruct), fully bidirectional (model_type `llada`, `LLaDAModelLM`).

- `native` (default): the weights in transformers' Llama classes (config and weight names mapped one to one; an
  unmapped field or weight is an error), run bidirectionally; transformers 4.57 and 5.x; the base of `cache=approx`.
- `remote`: the official code (trust_remote_code). Its forward ignores any mask, takes no position ids and refuses
  any cache (measured), so it runs the whole canvas as is; exact mode only.
"""

from __future__ import annotations

from typing import Any

import torch

from lm_eval_spot.adapters.bidirectional import BidirectionalAdapter, NativeCanvas
from lm_eval_spot.settings.args import SpotArgError, SpotArgs
from lm_eval_spot.families import common

NAME = "llada"
IMPLS = ("native", "remote")
DEFAULT_BLOCK_LEN = 32
APPROX_CACHE = True  # cache=approx (Fast-dLLM prefix cache) on the native path

RENAMED = {"d_model": "hidden_size", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
           "n_layers": "num_hidden_layers", "mlp_hidden_size": "intermediate_size", "rms_norm_eps": "rms_norm_eps",
           "rope_theta": "rope_theta", "max_sequence_length": "max_position_embeddings",
           "weight_tying": "tie_word_embeddings", "activation_type": "hidden_act", "vocab_size": "vocab_size",
           "embedding_size": "vocab_size", "pad_token_id": "pad_token_id", "eos_token_id": "eos_token_id",
           "bos_token_id": "bos_token_id"}
# What the Llama classes compute; a LLaDA config with another value has a different forward.
REQUIRED = {"block_type": "llama", "layer_norm_type": "rms", "rope": True, "alibi": False, "include_bias": False,
            "include_qkv_bias": False, "attention_layer_norm": False, "input_emb_norm": False, "scale_logits": False,
            "activation_type": "silu", "layer_norm_with_affine": True, "bias_for_layer_norm": False,
            "multi_query_attention": (None, False), "block_group_size": 1}
IGNORED = ("architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
           "mask_token_id", "use_cache", "flash_attention", "init_device", "init_fn", "init_std", "init_cutoff_factor",
           "precision", "attention_dropout", "embedding_dropout", "residual_dropout", "mlp_ratio",
           "alibi_bias_max", "rope_full_precision", "attention_layer_norm_with_affine", "clip_qkv",
           "block_length")  # the project's own LLaDA-layout targets name their block length (the default block_len)
# LLaDA weight name -> Llama weight name (regex, applied by transformers while loading)
KEY_MAPPING = {
    r"^model\.transformer\.wte\.": "model.embed_tokens.",
    r"^model\.transformer\.ln_f\.": "model.norm.",
    r"^model\.transformer\.ff_out\.": "lm_head.",
    # One capture group per pattern: transformers 5.x substitutes only the first.
    r"^model\.transformer\.blocks\.(\d+)\.q_proj\.": r"model.layers.\1.self_attn.q_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.k_proj\.": r"model.layers.\1.self_attn.k_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.v_proj\.": r"model.layers.\1.self_attn.v_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.attn_out\.": r"model.layers.\1.self_attn.o_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.ff_proj\.": r"model.layers.\1.mlp.gate_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.up_proj\.": r"model.layers.\1.mlp.up_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.ff_out\.": r"model.layers.\1.mlp.down_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.attn_norm\.": r"model.layers.\1.input_layernorm.",
    r"^model\.transformer\.blocks\.(\d+)\.ff_norm\.": r"model.layers.\1.post_attention_layernorm.",
}


def matches(cfg: dict[str, Any]) -> bool:
    return cfg.get("model_type") == "llada" or "LLaDAModelLM" in (cfg.get("architectures") or [])


def logits_width(cfg: dict[str, Any]) -> int:
    """LLaDA's output head has `embedding_size` rows (the vocabulary padded), when the config sets it."""
    return int(cfg.get("embedding_size") or cfg["vocab_size"])


def llama_config(cfg: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    kw = common.map_fields("LLaDA", cfg, RENAMED, REQUIRED, IGNORED)
    kw["vocab_size"] = logits_width(cfg)
    kw["num_key_value_heads"] = cfg.get("n_kv_heads") or cfg["n_heads"]
    out = LlamaConfig(**kw, attention_bias=False, mlp_bias=False)
    out.architectures = ["LlamaForCausalLM"]
    return out


class LLaDARemote:
    """The official forward: the whole canvas, no mask (it is ignored anyway), no positions, no cache. Only the kept
    positions reach the head: it takes no logits_to_keep, and its head (`ff_out`, or the tied `wte`, then
    `scale_logits`) runs inside `LLaDAModel.forward` right after the final norm `transformer.ln_f`."""

    shifted = False
    ragged = False  # it takes no mask that could hide padding: canvases of one length share a forward

    def forward(self, model: torch.nn.Module, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        with common.head_sees_only(model.model.transformer.ln_f, keep):
            return model(ids).logits


def load(args: SpotArgs, cfg: dict[str, Any], impl: str) -> common.LoadedTarget:
    from transformers import AutoModel, LlamaForCausalLM

    if impl == "remote" and args.cache == "approx":
        raise SpotArgError("spot-dlm: cache=approx needs impl=native: LLaDA's remote code refuses any cache")
    if impl == "remote":
        common.require_remote(args, NAME)
    tokenizer = common.load_tokenizer(args)
    device = common.resolve_device(args.device)
    if impl == "native":
        model = common.load_native_weights(LlamaForCausalLM, args, llama_config(cfg),
                                           "LLaDA", KEY_MAPPING)
        protocol: Any = NativeCanvas(shifted=False)
    else:
        model = AutoModel.from_pretrained(args.pretrained, dtype=common.torch_dtype(args), trust_remote_code=True)
        protocol = LLaDARemote()
    info = common.target_info(args, cfg, tokenizer, default_block=DEFAULT_BLOCK_LEN, grid_origin="prompt_end",
                              exact=args.cache == "none", vocab_size=logits_width(cfg))
    adapter = BidirectionalAdapter(model.to(device).eval(), info, protocol, cache=args.cache)
    return common.LoadedTarget(adapter, tokenizer, NAME, impl)


def official_control(loaded: common.LoadedTarget, prompts: list[list[int]]) -> str:
    return ("not in the checkpoint: LLaDA's official generate() lives in the ML-GSAI/LLaDA repository (the family "
            "tests compare our control with it token for token)")
