"""Family `dream`: Dream-org's Dream-v0(-Instruct)-7B, fully bidirectional (model_type `Dream`, `DreamModel`).

Its logits are SHIFTED: the prediction for position i is the raw output at i - 1; the adapter realigns them.
- `native` (default): the weights in transformers' Qwen2 classes (same weight names; config mapped field by
  field), run bidirectionally; transformers 4.57 and 5.x; the base of `cache=approx`.
- `remote`: the official code (trust_remote_code), called as its generation does (`attention_mask="full"`, no
  position ids, no cache); exact mode only.
"""

from __future__ import annotations

from typing import Any

import torch

from lm_eval_spot.adapters.bidirectional import BidirectionalAdapter, NativeCanvas
from lm_eval_spot.settings.args import SpotArgError, SpotArgs
from lm_eval_spot.families import common

NAME = "dream"
IMPLS = ("native", "remote")
DEFAULT_BLOCK_LEN = 32
APPROX_CACHE = True  # cache=approx (Fast-dLLM prefix cache) on the native path

SAME = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
        "attention_dropout", "tie_word_embeddings", "initializer_range", "bos_token_id", "eos_token_id",
        "pad_token_id")
REQUIRED = {"use_sliding_window": False}
# The hub's tokenizer class is remote code (tokenization_dream.py): a Qwen2 byte-level BPE over the same files.
TOKENIZER_STAND_INS = {"DreamTokenizer": "Qwen2TokenizerFast"}
IGNORED = ("architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
           "mask_token_id", "use_cache", "sliding_window", "max_window_layers",
           "use_mrope")  # in the hub config, read nowhere in Dream's official modeling code


def matches(cfg: dict[str, Any]) -> bool:
    return str(cfg.get("model_type", "")).lower() == "dream" or "DreamModel" in (cfg.get("architectures") or [])


def qwen2_config(cfg: dict[str, Any]) -> Any:
    from transformers import Qwen2Config

    kw = common.map_fields("Dream", cfg, {k: k for k in SAME}, REQUIRED, IGNORED)
    out = Qwen2Config(**kw, use_sliding_window=False)
    out.architectures = ["Qwen2ForCausalLM"]
    return out


class DreamRemote:
    """The official forward as `diffusion_generate` calls it: the whole canvas, `attention_mask="full"`. Only the
    kept positions reach `lm_head`: its `num_logits_to_keep` keeps a suffix only (the block has masks after it), so
    the backbone's final norm `model.norm` hands on the kept positions instead."""

    shifted = True
    ragged = False  # it takes no mask that could hide padding: canvases of one length share a forward

    def forward(self, model: torch.nn.Module, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        with common.head_sees_only(model.model.norm, keep):
            return model(ids, attention_mask="full").logits


def load(args: SpotArgs, cfg: dict[str, Any], impl: str) -> common.LoadedTarget:
    from transformers import AutoModel, Qwen2ForCausalLM

    if impl == "remote" and args.cache == "approx":
        raise SpotArgError("spot-dlm: cache=approx needs impl=native (the project's prefix attention)")
    if impl == "remote":
        common.require_remote(args, NAME)
    tokenizer = common.load_tokenizer(args, TOKENIZER_STAND_INS)
    device = common.resolve_device(args.device)
    if impl == "native":
        model = common.load_native_weights(Qwen2ForCausalLM, args, qwen2_config(cfg),
                                           "Dream")
        protocol: Any = NativeCanvas(shifted=True)
    else:
        model = AutoModel.from_pretrained(args.pretrained, dtype=common.torch_dtype(args), trust_remote_code=True)
        protocol = DreamRemote()
    info = common.target_info(args, cfg, tokenizer, default_block=DEFAULT_BLOCK_LEN, grid_origin="prompt_end",
                              exact=args.cache == "none", vocab_size=cfg["vocab_size"])
    adapter = BidirectionalAdapter(model.to(device).eval(), info, protocol, cache=args.cache)
    return common.LoadedTarget(adapter, tokenizer, NAME, impl)


def official_control(loaded: common.LoadedTarget, prompts: list[list[int]]) -> tuple[int, int] | str:
    """Self-check row: our control against the checkpoint's own `diffusion_generate` at T=0 (alg='maskgit_plus',
    steps = generation length, our block = the whole canvas). Two arguments make its schedule one commit per
    step (eps=-1e-6: the default rounds every step's count to 0 but the last; top_k=None: its config otherwise
    inherits transformers' top_k=50), and the mask token's logit is set to -inf during the call, as the decoder
    never commits it; its sampler gets the logits in float32 (in bf16 its confidences tie). Needs impl=remote (diffusion_generate ships with the remote code)."""
    from dataclasses import replace

    from lm_eval_spot.decoding.loop import DecodeConfig, decode

    ad = loaded.adapter
    if not hasattr(ad.model, "diffusion_generate"):
        return "needs impl=remote (diffusion_generate ships with the checkpoint's remote code)"
    if ad.cache != "none":
        return "defined for the exact mode only (cache=none)"
    n, mask = 2 * ad.info.block_len, ad.info.mask_id
    one_block = BidirectionalAdapter(ad.model, replace(ad.info, block_len=n), ad.protocol)
    def to_sampler(module: Any, inputs: Any, out: Any) -> Any:
        # The official sampler gets the logits in float32, as our decoder reads them: in bf16 its softmax
        # confidences tie often (8 bits of mantissa) and its topk then breaks ties by position, not by the rule.
        out.logits = out.logits.float()
        out.logits[..., mask] = float("-inf")
        return out

    hook = ad.model.register_forward_hook(to_sampler)
    same = 0
    try:
        for prompt in prompts:
            out = ad.model.diffusion_generate(torch.tensor([prompt], device=ad.device), max_new_tokens=n, steps=n,
                                              alg="maskgit_plus", temperature=0.0, top_k=None, top_p=None,
                                              eps=-1e-6, mask_token_id=mask)
            seq = out.sequences if hasattr(out, "sequences") else out
            off = seq[0, len(prompt):].tolist()
            ours = decode(one_block, prompt, DecodeConfig(max_gen_toks=n, temperature=0.0), seed=0).token_ids
            same += ours == off[: len(ours)]
    finally:
        hook.remove()
    return same, len(prompts)
