"""Checkpoints built from the REAL hub files in ../shared/real_checkpoints (test data, never copied into the
project): the published config.json with the layer count and the widths reduced, random weights written under the
hub's own weight names (those of `model.safetensors.index.json` for the layers kept), sharded like the hub, and the
real tokenizer files. What is reduced: layers to `layers` (1-2), hidden size to 64, 4 heads (2 KV heads where the
model groups them), MLP 128; the vocabulary, the ids, the chat templates and every other config field stay as
published. LLaDA-8B-Instruct ships no tokenizer vocabulary anywhere public: its folder gets a stand-in
`tokenizer.json` (byte-level, 256 byte tokens, filler up to id 126080) carrying the real added tokens at their
real ids, with the real
tokenizer_config.json (chat template, special tokens) beside it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

REAL = Path(__file__).resolve().parents[3] / "shared" / "real_checkpoints"
needs_real = pytest.mark.skipif(not REAL.is_dir(), reason="../shared/real_checkpoints is absent (it is in CI)")

TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "generation_config.json")
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 64, 4, 2, 16, 128
FAMILY = {"sdar-1.7b-chat": "sdar", "sdar-4b-chat": "sdar", "sdar-8b-chat": "sdar",
          "dream-v0-instruct-7b": "dream", "llada-8b-instruct": "llada"}


def real_config(name: str) -> dict:
    return json.loads((REAL / name / "config.json").read_text())


def reduced_config(name: str, layers: int) -> dict:
    cfg = real_config(name)
    if FAMILY[name] == "llada":
        cfg.update(n_layers=layers, d_model=HIDDEN, n_heads=HEADS, n_kv_heads=HEADS, mlp_hidden_size=MLP)
    else:
        cfg.update(num_hidden_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                   num_key_value_heads=KV_HEADS, intermediate_size=MLP)
        if "head_dim" in cfg:
            cfg["head_dim"] = HEAD_DIM
        if "max_window_layers" in cfg:
            cfg["max_window_layers"] = layers
    return cfg


def weight_shapes(name: str, cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every weight of the reduced model under the hub's names, with its shape (written from the architectures'
    definitions, independently of the project's loaders)."""
    fam = FAMILY[name]
    if fam == "llada":
        d, v, m, n = cfg["d_model"], cfg["embedding_size"], cfg["mlp_hidden_size"], cfg["n_layers"]
        out = {"model.transformer.wte.weight": (v, d), "model.transformer.ff_out.weight": (v, d),
               "model.transformer.ln_f.weight": (d,)}
        for i in range(n):
            p = f"model.transformer.blocks.{i}."
            out.update({p + "q_proj.weight": (d, d), p + "k_proj.weight": (d, d), p + "v_proj.weight": (d, d),
                        p + "attn_out.weight": (d, d), p + "ff_proj.weight": (m, d), p + "up_proj.weight": (m, d),
                        p + "ff_out.weight": (d, m), p + "attn_norm.weight": (d,), p + "ff_norm.weight": (d,)})
        return out
    h, v, m, n = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(n):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (m, h), p + "mlp.up_proj.weight": (m, h),
                    p + "mlp.down_proj.weight": (h, m), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)})
        if fam == "sdar":  # Qwen3: per-head RMS norms on queries and keys
            out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        else:  # Qwen2: biases on q, k, v
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
    return out


def hub_names(name: str, layers: int) -> set[str] | None:
    """The hub index's weight names for the kept layers (None: the checkpoint ships one file, no index)."""
    index = REAL / name / "model.safetensors.index.json"
    if not index.is_file():
        return None
    names = json.loads(index.read_text())["weight_map"]
    keep = set()
    for k in names:
        parts = k.split(".")
        layer = next((int(parts[j + 1]) for j, p in enumerate(parts[:-1]) if p in ("layers", "blocks")), None)
        if layer is None or layer < layers:
            keep.add(k)
    return keep


def _llada_stand_in_tokenizer(folder: Path) -> None:
    """tokenizer.json: byte-level BPE over the 256 byte symbols, padded with unreachable filler entries up to the
    first added id, then the real added tokens at their real (contiguous) ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    added = json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    ids = sorted(int(i) for i in added)
    assert ids == list(range(ids[0], ids[0] + len(ids))), "the added ids are contiguous in the real file"
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    vocab.update({f"<filler_{i}>": i for i in range(len(vocab), ids[0])})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    data = json.loads(tok.to_str())
    data["added_tokens"] = [{"id": i, "content": added[str(i)]["content"], "single_word": added[str(i)]["single_word"],
                             "lstrip": added[str(i)]["lstrip"], "rstrip": added[str(i)]["rstrip"],
                             "normalized": added[str(i)]["normalized"], "special": added[str(i)]["special"]}
                            for i in ids]
    (folder / "tokenizer.json").write_text(json.dumps(data))


def build(name: str, folder: Path, layers: int = 1, seed: int = 0, head_std: float = 0.5) -> Path:
    """A checkpoint of `name` as published (reduced as the module says), random weights, sharded like the hub."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    src = REAL / name
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, folder / f)
    cfg = reduced_config(name, layers)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = torch.Generator().manual_seed(seed)
    heads = ("lm_head.weight", "model.transformer.ff_out.weight")
    tensors = {}
    for k, shape in weight_shapes(name, cfg).items():
        if len(shape) == 1:
            t = torch.ones(shape) if k.endswith("norm.weight") else 0.02 * torch.randn(shape, generator=gen)
        else:
            t = (head_std if k in heads else 0.02) * torch.randn(shape, generator=gen)
        tensors[k] = t.to(torch.bfloat16)
    names = sorted(tensors)
    if hub_names(name, layers) is None:  # published as one model.safetensors, no index
        save_file({k: tensors[k].contiguous() for k in names}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        if FAMILY[name] == "llada":
            _llada_stand_in_tokenizer(folder)
        return folder
    shards = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for j, part in enumerate(shards, 1):
        fname = f"model-{j:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if FAMILY[name] == "llada":
        _llada_stand_in_tokenizer(folder)
    return folder
