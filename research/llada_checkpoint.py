"""Write a transformers Llama model as a LLaDA checkpoint: the layout GSAI-ML's LLaDA-8B ships (config fields and
weight names of `model_type: llada`), so the project's own fully bidirectional tiny targets load through the
`llada` family like a real LLaDA checkpoint (`families/llada.py` maps them back onto the Llama classes).

The names below follow the published LLaDA-8B-Instruct config and weight names (its `config.json` and
`model.safetensors.index.json`); `block_length` is this project's addition (the block length the target was trained
for, the family's default when no block_len= is given).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

# Llama weight name -> LLaDA weight name
_LAYER = {"self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
          "self_attn.o_proj": "attn_out", "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj",
          "mlp.down_proj": "ff_out", "input_layernorm": "attn_norm", "post_attention_layernorm": "ff_norm"}
_TOP = {"model.embed_tokens": "model.transformer.wte", "model.norm": "model.transformer.ln_f",
        "lm_head": "model.transformer.ff_out"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def llada_name(name: str) -> str:
    m = _LAYER_RE.match(name)
    if m is not None:
        layer, module, kind = m.groups()
        if module not in _LAYER:
            raise ValueError(f"no LLaDA name for weight {name!r}")
        return f"model.transformer.blocks.{layer}.{_LAYER[module]}.{kind}"
    module, _, kind = name.rpartition(".")
    if module not in _TOP:
        raise ValueError(f"no LLaDA name for weight {name!r}")
    return f"{_TOP[module]}.{kind}"


def rope_theta(cfg: Any) -> float:
    """Plain RoPE's base, where transformers 4.x (`rope_theta`) and 5.x (`rope_parameters`) keep it."""
    theta = getattr(cfg, "rope_theta", None)
    if theta is not None:
        return float(theta)
    params = getattr(cfg, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default" or "rope_theta" not in params:
        raise ValueError(f"LLaDA's layout has plain RoPE; this model's is {params}")
    return float(params["rope_theta"])


def llada_config(cfg: Any, mask_id: int, block_len: int) -> dict[str, Any]:
    """A LlamaConfig as LLaDA's config fields (every field the `llada` family requires, at the Llama value)."""
    return {
        "architectures": ["LLaDAModelLM"], "model_type": "llada",
        "d_model": cfg.hidden_size, "n_heads": cfg.num_attention_heads, "n_kv_heads": cfg.num_key_value_heads,
        "n_layers": cfg.num_hidden_layers, "mlp_hidden_size": cfg.intermediate_size,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": rope_theta(cfg),
        "max_sequence_length": cfg.max_position_embeddings, "weight_tying": bool(cfg.tie_word_embeddings),
        "activation_type": cfg.hidden_act, "vocab_size": cfg.vocab_size, "embedding_size": cfg.vocab_size,
        "pad_token_id": cfg.pad_token_id, "eos_token_id": cfg.eos_token_id, "bos_token_id": cfg.bos_token_id,
        "mask_token_id": mask_id, "block_length": block_len,
        "block_type": "llama", "layer_norm_type": "rms", "rope": True, "alibi": False, "include_bias": False,
        "include_qkv_bias": False, "attention_layer_norm": False, "input_emb_norm": False, "scale_logits": False,
        "layer_norm_with_affine": True, "bias_for_layer_norm": False, "multi_query_attention": None,
        "block_group_size": 1, "use_cache": False,
    }


def save_as_llada(model: torch.nn.Module, folder: Path, mask_id: int, block_len: int) -> None:
    """model: a transformers LlamaForCausalLM. Writes folder/config.json and folder/model.safetensors."""
    from safetensors.torch import save_file

    cfg = model.config
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ValueError("LLaDA's layout has head_dim = hidden / heads")
    tied = bool(cfg.tie_word_embeddings)
    weights = {llada_name(k): v.detach().contiguous() for k, v in model.state_dict().items()
               if not (tied and k == "lm_head.weight")}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(llada_config(cfg, mask_id, block_len), indent=2) + "\n")
