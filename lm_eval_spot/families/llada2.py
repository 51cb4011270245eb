"""Family `llada2-moe`: inclusionAI's LLaDA2.0-mini (BailingMoeV2 block diffusion, model_type `llada2_moe`).

Official remote code only. Its forward takes a 4D mask that only SDPA reads right (the eager path inverts a 4D
mask), so the model is loaded with `attn_implementation="sdpa"` and a bool mask (True = attend); its attention
appends to any cache it is given, so every forward gets a throw-away cache (`RemoteBlockCausalAdapter`).
"""

from __future__ import annotations

from typing import Any

import torch

from lm_eval_spot.adapters.remote_block_causal import RemoteBlockCausalAdapter
from lm_eval_spot.settings.args import SpotArgError, SpotArgs
from lm_eval_spot.families import common

NAME = "llada2-moe"
IMPLS = ("remote",)
DEFAULT_BLOCK_LEN = 32  # the official generate()'s block_length


def matches(cfg: dict[str, Any]) -> bool:
    return cfg.get("model_type") == "llada2_moe" or "LLaDA2MoeModelLM" in (cfg.get("architectures") or [])


class LLaDA2Protocol:
    """LLaDA2.0-mini's forward under SDPA: bool mask [B, 1, Q, K] (True = attend), absolute positions; any cache
    passed is appended to (the caller's cache is a throw-away copy)."""

    def forward(self, model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                cache: Any, store: bool, keep: int) -> torch.Tensor:
        kw: dict[str, Any] = {"use_cache": False}
        if cache is not None:
            kw = {"past_key_values": cache, "use_cache": True}
        # Its forward takes no positions to keep: the final norm hands on only the last `keep` (head_sees_only).
        with common.head_sees_only(model.model.norm, slice(-keep, None)):
            return model(input_ids=ids, attention_mask=allowed.unsqueeze(1), position_ids=positions, **kw).logits


def load(args: SpotArgs, cfg: dict[str, Any], impl: str) -> common.LoadedTarget:
    from transformers import AutoModelForCausalLM

    if args.attn_implementation not in (None, "sdpa"):
        raise SpotArgError(
            f"spot-dlm: attn_implementation={args.attn_implementation!r} is refused for LLaDA2.0-mini: its eager "
            "path inverts 4D masks (measured); accepted: sdpa (the default)"
        )
    common.require_remote(args, NAME)
    tokenizer = common.load_tokenizer(args)
    device = common.resolve_device(args.device)
    model = AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=common.torch_dtype(args),
                                                 trust_remote_code=True, attn_implementation="sdpa")
    if model.config._attn_implementation != "sdpa":
        raise SpotArgError("spot-dlm: LLaDA2.0-mini did not load with SDPA attention; its 4D mask needs it")
    info = common.target_info(args, cfg, tokenizer, default_block=DEFAULT_BLOCK_LEN, grid_origin="zero",
                              exact=True, vocab_size=cfg["vocab_size"])
    adapter = RemoteBlockCausalAdapter(model.to(device).eval(), info, LLaDA2Protocol())
    return common.LoadedTarget(adapter, tokenizer, NAME, "remote")


def official_greedy_generate(model: torch.nn.Module, prompt_ids: list[int], gen_length: int, block_len: int,
                             mask_id: int, eos_id: int) -> list[int] | None:
    """The official `generate()` loop with one commit per step (steps = block length, a threshold no probability
    reaches) and its sampler made greedy: the official sampler draws with multinomial even at temperature 0, so
    its one sampling method is replaced, for this call only, by argmax + that token's softmax probability.
    None where it is not defined: generate() hard-casts its mask to bfloat16, so it runs on bfloat16 models only."""
    if next(model.parameters()).dtype != torch.bfloat16:
        return None

    def greedy(logits: torch.Tensor, temperature: float = 0.0, top_k: Any = None, top_p: Any = None):
        probs = torch.softmax(logits.float(), dim=-1)
        p, tok = probs.max(dim=-1)
        return tok, p

    model._sample_with_temperature_topk_topp = greedy  # instance attribute: shadows the method for this call
    try:
        out = model.generate(inputs=torch.tensor([prompt_ids], device=next(model.parameters()).device),
                             temperature=0.0, block_length=block_len, steps=block_len, gen_length=gen_length,
                             threshold=2.0, eos_id=eos_id, mask_id=mask_id)
    finally:
        del model._sample_with_temperature_topk_topp
    return out[0].tolist()


def official_control(loaded: common.LoadedTarget, prompts: list[list[int]]) -> tuple[int, int] | str:
    """Self-check row: our control against `official_greedy_generate` (see there); (identical, n) or why not."""
    from lm_eval_spot.decoding.loop import DecodeConfig, decode

    ad = loaded.adapter
    info = ad.info
    eos = loaded.tokenizer.eos_token_id
    if eos is None:
        return "the tokenizer declares no eos id for generate()"
    same = 0
    for prompt in prompts:
        L = info.block_len
        n = 3 * L - len(prompt) % L  # end on a block boundary: generate() decodes its last block whole
        off = official_greedy_generate(ad.model, prompt, n, L, info.mask_id, int(eos))
        if off is None:
            return "generate() hard-casts its mask to bfloat16: defined for dtype=bfloat16 only"
        cut = next((i for i, t in enumerate(off) if t in info.stop_ids), len(off))
        ours = decode(ad, prompt, DecodeConfig(max_gen_toks=n, temperature=0.0), seed=0)
        same += ours.token_ids == off[:cut]
    return same, len(prompts)
