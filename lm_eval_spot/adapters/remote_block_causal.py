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

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from lm_eval_spot.adapters.base import ForwardTally, RowsCall, TargetInfo
from lm_eval_spot.adapters.block_causal import BlockCausalSession
from lm_eval_spot.adapters.prefix_attention import KV
from lm_eval_spot.transfer import upload
from lm_eval_spot.adapters.attention_masks import block_causal_allowed


class CacheProtocol(Protocol):
    """How one family's official forward takes a mask, positions and a cache."""

    def forward(self, model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                cache: Any, store: bool, keep: int) -> torch.Tensor:
        """ids/positions [B, N]; allowed: bool [B, N, K] (True = may attend; K = cached + N keys); cache: a
        transformers DynamicCache holding the prefix (or None for a cache-free full forward); store: the caller
        wants the new keys appended to `cache`. Returns logits [B, keep, V] of the LAST `keep` positions (any float
        dtype): only those reach the LM head."""
        ...


def make_cache_rows(prefixes: Sequence[tuple[KV | None, int]]) -> Any:
    """A DynamicCache holding each (prefix, rows) expanded to its rows, stacked in order (one prefix: without
    copies). The prefixes have one length (or are all None)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    if prefixes[0][0] is None:
        return cache
    for layer in range(len(prefixes[0][0])):
        ks = [kv[layer][0].expand(r, -1, -1, -1) for kv, r in prefixes if kv is not None]
        vs = [kv[layer][1].expand(r, -1, -1, -1) for kv, r in prefixes if kv is not None]
        cache.update(ks[0] if len(ks) == 1 else torch.cat(ks), vs[0] if len(vs) == 1 else torch.cat(vs), layer)
    return cache


def cache_kv(cache: Any, length: int, row: int = 0) -> KV:
    """One row of a DynamicCache's first `length` positions, as stored prefix KV (copies: the cache is dropped)."""
    if hasattr(cache, "layers"):
        pairs = [(layer.keys, layer.values) for layer in cache.layers]
    else:  # older DynamicCache layout
        pairs = list(zip(cache.key_cache, cache.value_cache, strict=True))
    return [(k[row : row + 1, :, :length].clone(), v[row : row + 1, :, :length].clone()) for k, v in pairs]


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
        return self._adapter.forward_many([RowsCall(self, states)])[0][0]


class RemoteBlockCausalAdapter:
    """Adapter over an official remote-code block-causal model (grid origin zero, exact prefix cache). Requests
    decoded together share a forward when their forwards have one shape (the same cached length and pending
    blocks): the official attention takes one mask for every row, and a mask hiding a shorter prefix's padding
    changes the arithmetic (SDAR leaves its unmasked flash path; tests show both), so ragged prefixes run apart."""

    copies_prefix_per_row = True  # each forward materialises the prefix KV once per row (memory estimate)

    def __init__(self, model: torch.nn.Module, info: TargetInfo, protocol: CacheProtocol) -> None:
        if info.grid_origin != "zero":
            raise ValueError("block-causal targets use grid origin 'zero'")
        self.model = model.eval()
        self.info = info
        self.protocol = protocol
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.tally = ForwardTally()

    def block_logits_many(self, items: Sequence[tuple[RemoteBlockCausalSession, torch.Tensor]]) -> list[torch.Tensor]:
        return [lg for lg, _ in self.forward_many([RowsCall(s, st) for s, st in items])]

    def forward_many(self, calls: Sequence[RowsCall]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Several requests' rounds, each charged one NFE and given its own forward's logits: one forward per
        shape (cached length, pending length) among them."""
        if any(c.ahead is not None for c in calls):
            raise ValueError("the official remote code takes no lookahead row")
        L = self.info.block_len
        for c in calls:
            if c.states.shape[1] != L:
                raise ValueError(f"states must have block length {L}, got {c.states.shape[1]}")
        out: list[torch.Tensor | None] = [None] * len(calls)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, c in enumerate(calls):
            groups.setdefault((c.session._len, len(c.session._pending)), []).append(i)
        for (cached, P), idx in groups.items():
            sessions = [calls[i].session for i in idx]
            rows = [calls[i].states.shape[0] for i in idx]
            ids = upload(torch.cat([torch.cat([torch.tensor(s._pending, dtype=torch.long).expand(r, P),
                                               calls[i].states.long()], dim=1)
                                    for i, s, r in zip(idx, sessions, rows, strict=True)]), device=self.device)[0]
            B = ids.shape[0]
            pos = torch.arange(cached, cached + P + L, device=self.device).expand(B, -1)
            allowed = sessions[0].allowed(P, L, self.device).expand(B, -1, -1)
            cache = make_cache_rows([(s._kv, r) for s, r in zip(sessions, rows, strict=True)])
            with torch.no_grad():
                logits = self.protocol.forward(self.model, ids, pos, allowed, cache, store=P > 0, keep=L).float()
            self.tally.forwards += 1
            a = 0
            for i, s, r in zip(idx, sessions, rows, strict=True):
                s.device_states = ids[a : a + r, P:]
                if P:
                    s._kv = cache_kv(cache, cached + P, row=a)
                    s._len, s._pending = cached + P, []
                s.nfe.rounds += 1
                out[i] = logits[a : a + r]
                a += r
        return [(o, None) for o in out if o is not None]

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
