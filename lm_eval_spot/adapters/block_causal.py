"""Block-causal targets (SDAR-style) on a native transformers causal-LM class with an exact prefix KV cache.

Blocks are aligned to absolute position 0 (grid origin zero): complete prompt blocks are prefilled, the prompt's
tail shares the first active block. R replica states of the active block are R rows of ONE batched forward against
the shared prefix (expanded, not copied, across rows), so each replica sees exactly the prefix and its own state.
"""

from __future__ import annotations

import logging

import torch

from lm_eval_spot.adapters.base import NFECounter, TargetInfo
from lm_eval_spot.adapters.kv import KV, make_cache, read_cache
from lm_eval_spot.masks import allowed_to_additive, block_causal_allowed

log = logging.getLogger(__name__)


class BlockCausalSession:
    """One request: the prefix cache and the NFE counter.

    Finished blocks (and the prompt's complete blocks) are not stored by a forward of their own: they wait as
    pending ids and ride along with the next forward on the active block, which writes their KV into the cache.
    That saves one target forward per block, for every method alike; the generation's last block is never stored.
    """

    def __init__(self, adapter: BlockCausalAdapter, pending: list[int]) -> None:
        self._adapter = adapter
        self._kv: KV | None = None
        self._len = 0  # cached positions
        self._pending = list(pending)  # complete blocks after the cache, not yet forwarded
        self.nfe = NFECounter()

    @property
    def block_start(self) -> int:
        return self._len + len(self._pending)

    @property
    def prefix_kv(self) -> KV | None:
        """The cached prefix (complete blocks already forwarded); pending blocks are not in it yet."""
        return self._kv

    def block_logits(self, states: torch.Tensor) -> torch.Tensor:
        R, L = states.shape
        if L != self._adapter.info.block_len:
            raise ValueError(f"states must have block length {self._adapter.info.block_len}, got {L}")
        P = len(self._pending)
        pend_pos = torch.arange(self._len, self._len + P)
        pos = torch.cat([pend_pos, self.block_start + torch.arange(L)])
        pending = torch.tensor(self._pending, dtype=torch.long)
        # One batch row per replica: [pending blocks ; replica state]. Rows share the prefix cache, so attention
        # cost grows linearly with R (one packed sequence would grow it quadratically).
        ids = torch.cat([pending.expand(R, P), states.long()], dim=1)
        allowed_new = torch.ones(P + L, P + L, dtype=torch.bool)
        allowed_new[:P, :P] = block_causal_allowed(pend_pos, pend_pos, L)
        allowed_new[:P, P:] = False
        logits, kv = self._forward(ids, pos, allowed_new, store=P > 0)
        if kv is not None:
            keep = self._len + P
            self._kv = [(k[:1, :, :keep, :].clone(), v[:1, :, :keep, :].clone()) for k, v in kv]
            self._len, self._pending = keep, []
        self.nfe.rounds += 1
        return logits[:, P:]

    def commit_block(self, block: torch.Tensor) -> None:
        """Queue a finished block; its KV is written by the next forward (no forward of its own, no NFE)."""
        if block.shape[0] != self._adapter.info.block_len:
            raise ValueError("commit_block takes one complete block")
        self._pending.extend(block.tolist())

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, allowed_new: torch.Tensor, store: bool):
        """Run the model on `ids` [R, N] at `positions` [N] (same for every row); the cached prefix is visible
        to every query.

        allowed_new [N, N]: which new tokens each new token may attend. Returns (logits [R, N, V], kv or None).
        """
        model = self._adapter.model
        dev = self._adapter.device
        R, n = ids.shape
        allowed = torch.cat([torch.ones(n, self._len, dtype=torch.bool), allowed_new], dim=1)
        mask = allowed_to_additive(allowed, self._adapter.dtype).unsqueeze(0).to(dev).expand(R, -1, -1, -1)
        cache = make_cache(self._kv, batch=R)
        with torch.no_grad():
            out = model(
                input_ids=ids.to(dev),
                attention_mask=mask,
                position_ids=positions.unsqueeze(0).expand(R, -1).to(dev),
                past_key_values=cache,
                use_cache=True,
            )
        # The decoding loop (transition, verification, drafting) runs on the CPU: logits come back there.
        logits = out.logits.float().cpu()
        return logits, (read_cache(out.past_key_values) if store else None)


class BlockCausalAdapter:
    """Adapter for a causal-LM class that accepts 4D additive masks, position ids and a DynamicCache."""

    def __init__(self, model: torch.nn.Module, info: TargetInfo) -> None:
        if info.grid_origin != "zero":
            raise ValueError("block-causal targets use grid origin 'zero'")
        self.model = model.eval()
        self.info = info
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype

    def open(self, prompt_ids: list[int]) -> tuple[BlockCausalSession, list[int]]:
        L = self.info.block_len
        n_full = len(prompt_ids) // L * L
        return BlockCausalSession(self, list(prompt_ids[:n_full])), list(prompt_ids[n_full:])
