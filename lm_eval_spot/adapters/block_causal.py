"""Block-causal targets (SDAR-style) on a native transformers causal-LM class with an exact prefix KV cache.

Blocks are aligned to absolute position 0 (grid origin zero): complete prompt blocks are prefilled, the prompt's
tail shares the first active block. R replica states of the active block are packed into ONE sequence of R*L
queries against the shared prefix; a block-diagonal mask keeps each replica to the prefix and itself, and the
position ids of every replica restart at the block's start, so each replica sees exactly its own state.
"""

from __future__ import annotations

import logging

import torch

from lm_eval_spot.adapters.base import NFECounter, TargetInfo
from lm_eval_spot.adapters.kv import KV, make_cache, read_cache
from lm_eval_spot.masks import allowed_to_additive, block_causal_allowed

log = logging.getLogger(__name__)


class BlockCausalSession:
    """One request: the prefix cache (complete blocks only) and the NFE counter."""

    def __init__(self, adapter: BlockCausalAdapter) -> None:
        self._adapter = adapter
        self._kv: KV | None = None
        self._len = 0
        self.nfe = NFECounter()

    @property
    def block_start(self) -> int:
        return self._len

    @property
    def prefix_kv(self) -> KV | None:
        return self._kv

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, allowed_new: torch.Tensor, store: bool):
        """Run the model on `ids` [N] at `positions` [N]; the prefix is visible to every query.

        allowed_new [N, N]: which new tokens each new token may attend. Returns (logits [N, V], new kv or None).
        """
        model = self._adapter.model
        dev = self._adapter.device
        n = ids.shape[0]
        allowed = torch.cat([torch.ones(n, self._len, dtype=torch.bool), allowed_new], dim=1)
        mask = allowed_to_additive(allowed, self._adapter.dtype).unsqueeze(0).to(dev)
        cache = make_cache(self._kv)
        with torch.no_grad():
            out = model(
                input_ids=ids.unsqueeze(0).to(dev),
                attention_mask=mask,
                position_ids=positions.unsqueeze(0).to(dev),
                past_key_values=cache,
                use_cache=True,
            )
        logits = out.logits[0].float()
        return logits, (read_cache(out.past_key_values) if store else None)

    def prefill(self, ids: list[int]) -> None:
        """Store complete blocks (len(ids) a multiple of L) block-causally. Counts one NFE."""
        L = self._adapter.info.block_len
        if not ids:
            return
        if len(ids) % L:
            raise ValueError("prefill takes complete blocks only")
        pos = torch.arange(self._len, self._len + len(ids))
        _, kv = self._forward(torch.tensor(ids), pos, block_causal_allowed(pos, pos, L), store=True)
        self._kv, self._len = kv, self._len + len(ids)
        self.nfe.prefill += 1

    def block_logits(self, states: torch.Tensor) -> torch.Tensor:
        R, L = states.shape
        if L != self._adapter.info.block_len:
            raise ValueError(f"states must have block length {self._adapter.info.block_len}, got {L}")
        pos = (self._len + torch.arange(L)).repeat(R)
        rep = torch.arange(R).repeat_interleave(L)
        logits, _ = self._forward(states.reshape(-1), pos, rep[:, None] == rep[None, :], store=False)
        self.nfe.rounds += 1
        return logits.view(R, L, -1)

    def commit_block(self, block: torch.Tensor) -> None:
        L = self._adapter.info.block_len
        pos = self._len + torch.arange(L)
        _, kv = self._forward(block, pos, torch.ones(L, L, dtype=torch.bool), store=True)
        self._kv, self._len = kv, self._len + L
        self.nfe.store += 1


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
        session = BlockCausalSession(self)
        session.prefill(list(prompt_ids[:n_full]))
        return session, list(prompt_ids[n_full:])
