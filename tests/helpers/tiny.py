"""Tiny random-init block-causal targets built from a config (no download), for tests."""

from __future__ import annotations

import string
from pathlib import Path

import torch

CHARS = list(string.ascii_letters + string.digits + " \n.,:;?!=+-*#()")
SPECIALS = ["<unk>", "<|endoftext|>", "<|mask|>", "<|im_end|>"]


def build_tokenizer(out_dir: Path, with_mask: bool = True):
    """A character-level PreTrainedTokenizerFast with eos/pad, mask (optional) and an end-of-turn token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIALS if with_mask else [s for s in SPECIALS if s != "<|mask|>"]
    vocab = {tok: i for i, tok in enumerate(specials + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    kwargs = dict(unk_token="<unk>", eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    if with_mask:
        kwargs["mask_token"] = "<|mask|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fast.save_pretrained(out_dir)
    return fast


def build_model(vocab_size: int, seed: int = 0, hidden: int = 32, layers: int = 2, block_length: int = 8,
                embed_scale: float = 40.0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    cfg.block_length = block_length
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).eval()
    # Random init gives near-uniform logits; a larger output scale makes argmax/confidence decisive (and
    # saturates some confidences to exactly 1.0: ties the lowest-index rule must break). 1.0 leaves the init.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(embed_scale)
    return model


def save_tiny_target(out_dir: Path, seed: int = 0, block_length: int = 8, with_mask: bool = True) -> Path:
    tok = build_tokenizer(out_dir, with_mask=with_mask)
    model = build_model(len(tok), seed=seed, block_length=block_length)
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
