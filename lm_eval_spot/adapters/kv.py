"""A read-only prefix KV store handed to transformers as a fresh DynamicCache per call.

transformers' DynamicCache appends on every forward; building a new cache object from the stored prefix for
each call is what keeps the shared prefix unchanged after a replica forward, across transformers 4.57 and 5.x.
"""

from __future__ import annotations

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, kv_heads, P, head_dim]


def make_cache(prefix: KV | None, batch: int = 1):  # -> transformers.DynamicCache
    """A fresh cache holding `prefix` (stored with batch 1), broadcast to `batch` rows without copying."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (k, v) in enumerate(prefix or ()):
        cache.update(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1), layer)
    return cache


def read_cache(cache) -> KV:
    """Per-layer (keys, values) of a DynamicCache, whichever storage layout this transformers uses."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))
