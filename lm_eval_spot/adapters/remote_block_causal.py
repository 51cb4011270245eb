"""Block-causal targets driven through their OFFICIAL remote code and its own cache protocol.

The official forwards (SDAR, LLaDA2.0-mini) differ in how they read a mask and a cache, not in what a decoder
needs from them; a family supplies a `CacheProtocol` that speaks its dialect, and this module holds everything
else: grid origin zero, the stored prefix KV, pending blocks riding along with a block's first round (as on the
native path, so NFE counts agree), replicas as batch rows.

Each forward gets a FRESH cache object holding the stored prefix expanded to the forward's R rows, so whatever
the official code does to the cache (SDAR appends only with `store_kv=True`; LLaDA2.0-mini appends on every
call) the stored prefix is never touched; the new pending blocks' KV is read back from row 0 and the rest is
dropped. The official attention concatenates the prefix per row, so unlike the native path each forward
materialises R copies of the prefix KV: a memory cost of the reference path, not of the decoder.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from lm_eval_spot.adapters.base import TargetInfo
from lm_eval_spot.adapters.block_causal import BlockCausalSession
from lm_eval_spot.adapters.prefix_attention import KV
from lm_eval_spot.decoding.transfer import upload
from lm_eval_spot.masks import block_causal_allowed


class CacheProtocol(Protocol):
    """How one family's official forward takes a mask, positions and a cache."""

    def forward(self, model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                cache: Any, store: bool, keep: int) -> torch.Tensor:
        """ids/positions [B, N]; allowed: bool [B, N, K] (True = may attend; K = cached + N keys); cache: a
        transformers DynamicCache holding the prefix (or None for a cache-free full forward); store: the caller
        wants the new keys appended to `cache`. Returns logits [B, keep, V] of the LAST `keep` positions (any float
        dtype): only those reach the LM head."""
        ...


def make_cache(prefix: KV | None, rows: int) -> Any:
    """A DynamicCache holding `prefix` expanded (without copies) to `rows` batch rows."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (k, v) in enumerate(prefix or []):
        cache.update(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1), layer)
    return cache


def cache_kv(cache: Any, length: int) -> KV:
    """Row 0 of a DynamicCache's first `length` positions, as stored prefix KV (copies: the cache is dropped)."""
    if hasattr(cache, "layers"):
        pairs = [(layer.keys, layer.values) for layer in cache.layers]
    else:  # older DynamicCache layout
        pairs = list(zip(cache.key_cache, cache.value_cache, strict=True))
    return [(k[:1, :, :length].clone(), v[:1, :, :length].clone()) for k, v in pairs]


class RemoteBlockCausalSession(BlockCausalSession):
    """One request: stored prefix KV, pending complete blocks, NFE counter (`BlockCausalSession`'s bookkeeping;
    only the forward differs)."""

    # The official attention code takes no extra keys for a row, so there is no lookahead row here.
    block_logits_ahead = None

    def allowed(self, P: int, L: int, device: torch.device | None = None) -> torch.Tensor:
        """Bool [P + L, cached + P + L]: every new token sees the whole cached prefix; pending blocks see each
        other block-causally and not the active block; the active block sees everything (itself bidirectionally).
        Made on `device` from sizes alone (nothing to upload)."""
        new_pos = torch.arange(self._len, self._len + P + L, device=device)
        new = torch.ones(P + L, P + L, dtype=torch.bool, device=device)
        new[:P, :P] = block_causal_allowed(new_pos[:P], new_pos[:P], L)
        new[:P, P:] = False
        return torch.cat([torch.ones(P + L, self._len, dtype=torch.bool, device=device), new], dim=1)

    def block_logits(self, states: torch.Tensor) -> torch.Tensor:
        ad = self._adapter
        R, L = states.shape
        if L != ad.info.block_len:
            raise ValueError(f"states must have block length {ad.info.block_len}, got {L}")
        P = len(self._pending)
        pending = torch.tensor(self._pending, dtype=torch.long)
        ids = upload(torch.cat([pending.expand(R, P), states.long()], dim=1), device=ad.device)[0]
        self.device_states = ids[:, P:]
        pos = torch.arange(self._len, self._len + P + L, device=ad.device).expand(R, -1)
        allowed = self.allowed(P, L, ad.device).expand(R, -1, -1)
        cache = make_cache(self._kv, R)
        with torch.no_grad():
            logits = ad.protocol.forward(ad.model, ids, pos, allowed, cache, store=P > 0, keep=L)
        if P:
            self._kv = cache_kv(cache, self._len + P)
            self._len, self._pending = self._len + P, []
        self.nfe.rounds += 1
        return logits.float()

class RemoteBlockCausalAdapter:
    """Adapter over an official remote-code block-causal model (grid origin zero, exact prefix cache). Requests
    decoded together (batch_size > 1) each run their own forwards here: outputs are the same, with no sharing."""

    copies_prefix_per_row = True  # each forward materialises the prefix KV once per row (memory estimate)

    def __init__(self, model: torch.nn.Module, info: TargetInfo, protocol: CacheProtocol) -> None:
        if info.grid_origin != "zero":
            raise ValueError("block-causal targets use grid origin 'zero'")
        self.model = model.eval()
        self.info = info
        self.protocol = protocol
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype

    def open(self, prompt_ids: list[int], gen_length: int | None = None) -> tuple[RemoteBlockCausalSession, list[int]]:
        L = self.info.block_len
        n_full = len(prompt_ids) // L * L
        return RemoteBlockCausalSession(self, list(prompt_ids[:n_full])), list(prompt_ids[n_full:])

    def full_logits(self, prefix_ids: list[int], states: torch.Tensor) -> torch.Tensor:
        """Reference: the active block's logits from ONE cache-free forward over [prefix ; state] per row with the
        block-causal mask (what `block_logits` must equal). prefix_ids: whole blocks before the active block."""
        R, L = states.shape
        n = len(prefix_ids) + L
        ids = torch.cat([torch.tensor(prefix_ids, dtype=torch.long).expand(R, -1), states.long()], 1).to(self.device)
        pos = torch.arange(n, device=self.device).expand(R, -1)
        p = torch.arange(n)
        allowed = block_causal_allowed(p, p, L).to(self.device).expand(R, -1, -1)
        with torch.no_grad():
            return self.protocol.forward(self.model, ids, pos, allowed, None, store=False, keep=L).float()
