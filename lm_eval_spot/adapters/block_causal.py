"""Block-causal targets (SDAR-style) on a native transformers causal-LM class with an exact prefix KV cache.

Blocks are aligned to absolute position 0 (grid origin zero): complete prompt blocks are prefilled, the prompt's
tail shares the first active block. R replica states of the active block are R rows of ONE batched forward that
all read the same stored prefix KV (`prefix_attention`: no per-row copies), so each replica sees exactly the
prefix and its own state. Only the active block's positions reach the LM head (`logits_to_keep`), and the
logits stay on the model's device.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lm_eval_spot.adapters.base import ForwardTally, NFECounter, RowsCall, TargetInfo
from lm_eval_spot.adapters.prefix_attention import KV, PrefixPass, StackedPass, use_prefix_attention
from lm_eval_spot.transfer import upload
from lm_eval_spot.adapters.attention_masks import allowed_to_additive, block_causal_allowed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """One request's part of a forward, before it runs: host ids and positions [B, W], its attention, and where its
    rows sit among them (`head` leading rows of pending block, `rows` states, then the lookahead row if `ahead`)."""

    session: BlockCausalSession
    ids: torch.Tensor
    pos: torch.Tensor
    pp: PrefixPass
    rows: int
    ahead: bool
    head: int


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
        # The last forward's state rows [R, L] as uploaded (on the device): the loop derives its eligibility
        # masks from them instead of uploading its own.
        self.device_states: torch.Tensor | None = None

    @property
    def block_start(self) -> int:
        return self._len + len(self._pending)

    @property
    def pending_blocks(self) -> int:
        """How many complete blocks ride along with the next forward."""
        return len(self._pending) // self._adapter.info.block_len

    @property
    def has_pending(self) -> bool:
        """Complete blocks wait to ride along with the next forward (a block's first round)."""
        return bool(self._pending)

    @property
    def prefix_kv(self) -> KV | None:
        """The cached prefix (complete blocks already forwarded); pending blocks are not in it yet."""
        return self._kv

    def block_logits(self, states: torch.Tensor) -> torch.Tensor:
        return self._adapter.forward_many([RowsCall(self, states)])[0][0]

    def block_logits_ahead(self, states: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`block_logits(states)` plus, in the SAME forward (one NFE), the next block's logits [L, V] at its
        all-mask state given that `states[row]` (a full block) is committed: one more batch row, whose block
        positions attend the prefix, the pending blocks, row `row`'s keys and themselves (block-causal attention
        makes that exactly the next block's first forward, up to float rounding). The other rows' logits are those
        of `block_logits(states)`. The completion's KV is not stored: the prefix changes only through commit_block.
        """
        logits, ahead = self._adapter.forward_many([RowsCall(self, states, row)])[0]
        assert ahead is not None
        return logits, ahead

    def plan(self, states: torch.Tensor, ahead: int | None) -> Plan:
        """This request's part of a forward: its batch rows (ids and positions on the host) and its attention."""
        R, L = states.shape
        if L != self._adapter.info.block_len:
            raise ValueError(f"states must have block length {self._adapter.info.block_len}, got {L}")
        if ahead is not None and not 0 <= ahead < R:
            raise ValueError(f"lookahead row {ahead} is not one of the {R} states")
        P = len(self._pending)
        if P == L:
            return self._plan_pending_row(states, ahead)
        pend_pos = torch.arange(self._len, self._len + P)
        pos = torch.cat([pend_pos, self.block_start + torch.arange(L)]).unsqueeze(0).expand(R, -1)
        pending = torch.tensor(self._pending, dtype=torch.long)
        # One batch row per replica: [pending blocks ; replica state]. Rows share the prefix KV (read once per
        # layer for all rows), so cost grows linearly with R (one packed sequence would grow it quadratically).
        ids = torch.cat([pending.expand(R, P), states.long()], dim=1)
        if ahead is not None:
            nxt = torch.full((1, L), self._adapter.info.mask_id, dtype=torch.long)
            ids = torch.cat([ids, torch.cat([pending[None], nxt], 1)])
            pos = torch.cat([pos, torch.cat([pend_pos, self.block_start + L + torch.arange(L)])[None]])
        # The mask is built where it is used (from sizes alone: nothing to upload).
        dev = self._adapter.device
        allowed_new = torch.ones(P + L, P + L, dtype=torch.bool, device=dev)
        pend_dev = torch.arange(self._len, self._len + P, device=dev)
        allowed_new[:P, :P] = block_causal_allowed(pend_dev, pend_dev, L)
        allowed_new[:P, P:] = False
        mask = allowed_to_additive(allowed_new, self._adapter.dtype)[0]
        pp = PrefixPass([(0, ids.shape[0], self._kv)], mask, record=P, ahead=None if ahead is None else (ahead, L),
                        kernel=self._adapter.kernel, dense=P == 0)
        return Plan(self, ids, pos.contiguous(), pp, R, ahead is not None, head=0)

    def _plan_pending_row(self, states: torch.Tensor, ahead: int | None) -> Plan:
        """`plan` when exactly one block is pending (a later block's first round): that block rides as batch row
        0, computed once, and the replica rows read its keys after the prefix (`PrefixPass.pending_row`)."""
        R, L = states.shape
        info, dev = self._adapter.info, self._adapter.device
        start = self.block_start
        ids = torch.cat([torch.tensor(self._pending, dtype=torch.long)[None], states.long()])
        pos = torch.cat([torch.arange(self._len, self._len + L)[None], (start + torch.arange(L)).expand(R, -1)])
        if ahead is not None:
            ids = torch.cat([ids, torch.full((1, L), info.mask_id, dtype=torch.long)])
            pos = torch.cat([pos, (start + L + torch.arange(L))[None]])
        mask = torch.zeros(L, L, dtype=self._adapter.dtype, device=dev)  # bidirectional inside a block
        pp = PrefixPass([(0, ids.shape[0], self._kv)], mask, pending_row=True,
                        ahead=None if ahead is None else (ahead + 1, L), kernel=self._adapter.kernel, dense=True)
        return Plan(self, ids, pos, pp, R, ahead is not None, head=1)

    def finish(self, plan: Plan, logits: torch.Tensor, ids_dev: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Take this request's rows of the forward: store the pending blocks it carried, count the NFE, and
        return (the states' logits [R, L, V], the lookahead row's [L, V] or None)."""
        R, h = plan.rows, plan.head
        self.device_states = ids_dev[h : h + R, -self._adapter.info.block_len :]
        if self._pending:
            self._store(plan.pp)
        self.nfe.rounds += 1
        return logits[h : h + R], (logits[h + R] if plan.ahead else None)

    def _store(self, pp: PrefixPass) -> None:
        """Append the pending blocks' keys and values, recorded by the forward just run, to the prefix cache."""
        if len(pp.recorded) != len(self._adapter.layers):
            raise RuntimeError("the model did not route attention through the shared-prefix function")
        if len(pp.extended) == len(self._adapter.layers):  # the forward already built the extended prefix
            self._kv = [pp.extended[i] for i in self._adapter.layers]
        else:
            new = [pp.recorded[i] for i in self._adapter.layers]
            self._kv = [(torch.cat([k0, k1], -2), torch.cat([v0, v1], -2)) for (k0, v0), (k1, v1) in
                        zip(self._kv, new, strict=True)] if self._kv else [(k.clone(), v.clone()) for k, v in new]
        self._len, self._pending = self._len + len(self._pending), []

    def fork(self) -> BlockCausalSession:
        """An independent session on the same prefix, with its own NFE count: the stored KV is shared (never
        written in place: storing a block makes new tensors), the pending blocks copied. Several continuations of
        one context (a question's choices) branch from one prefilled prefix."""
        other = copy.copy(self)
        other._pending = list(self._pending)
        other.nfe = NFECounter()
        other.device_states = None
        return other

    def commit_block(self, block: torch.Tensor) -> None:
        """Queue a finished block; its KV is written by the next forward (no forward of its own, no NFE)."""
        if block.shape[0] != self._adapter.info.block_len:
            raise ValueError("commit_block takes one complete block")
        self._pending.extend(block.tolist())


class BlockCausalAdapter:
    """Adapter for a transformers causal-LM class whose attention goes through transformers' attention-function
    registry (Qwen3, Llama, Qwen2, ...) and that takes position ids and `logits_to_keep`."""

    def __init__(self, model: torch.nn.Module, info: TargetInfo, attention: str = "fused") -> None:
        """attention: "fused" (cascade pieces through the device's fused kernels) or "reference" (the plain matmul
        path, kept to check and time the fused one against)."""
        if info.grid_origin != "zero":
            raise ValueError("block-causal targets use grid origin 'zero'")
        self.model = model.eval()
        self.info = info
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kernel = use_prefix_attention(self.model, attention)
        self.layers = [m.layer_idx for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
        self.tally = ForwardTally()

    def block_logits_many(self, items: Sequence[tuple[BlockCausalSession, torch.Tensor]]) -> list[torch.Tensor]:
        """`block_logits` for several requests' states, in as few forwards as `forward_many` runs."""
        return [lg for lg, _ in self.forward_many([RowsCall(s, st) for s, st in items])]

    def forward_many(self, calls: Sequence[RowsCall]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Several requests' rounds in ONE forward per row width: each request's rows (its pending block, states
        and lookahead row; its own prefix) are stacked with the others' and attend only their own keys
        (`StackedPass`), so every request's logits equal its own forward's (bit for bit where the matmul is
        row-count invariant: docs/families.md) and each is charged one NFE. Rows of width L (every round but a request's first, whose prompt blocks
        ride along) share one forward; a first round with several prompt blocks runs with those of its width."""
        plans = [c.session.plan(c.states, c.ahead) for c in calls]
        out: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * len(calls)
        by_width: dict[int, list[int]] = {}
        for i, p in enumerate(plans):
            by_width.setdefault(p.ids.shape[1], []).append(i)
        L = self.info.block_len
        for idx in by_width.values():
            group = [plans[i] for i in idx]
            if len(group) == 1:
                pp: PrefixPass | StackedPass = group[0].pp
                ids, pos = group[0].ids, group[0].pos
            else:
                bounds, a = [], 0
                for p in group:
                    bounds.append((a, a + p.ids.shape[0]))
                    a += p.ids.shape[0]
                pp = StackedPass([(a, b, p.pp) for (a, b), p in zip(bounds, group, strict=True)])
                ids, pos = torch.cat([p.ids for p in group]), torch.cat([p.pos for p in group])
            logits, ids_dev = self._run(ids, pos, pp, L)
            a = 0
            for i, p in zip(idx, group, strict=True):
                b = a + p.ids.shape[0]
                out[i] = p.session.finish(p, logits[a:b], ids_dev[a:b])
                a = b
        return [o for o in out if o is not None]

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, pp: PrefixPass | StackedPass, keep: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of host ids [B, N] at positions [B, N] with prefix attention (both uploaded in one copy)
        -> (logits [B, keep, V] float32, the ids on the device)."""
        ids_dev, pos_dev = upload(ids.long(), positions.long(), device=self.device)
        self.tally.forwards += 1
        with torch.no_grad():
            out = self.model(
                input_ids=ids_dev,
                position_ids=pos_dev,
                # A per-layer-type mapping skips transformers' mask construction: masking is PrefixPass's job.
                attention_mask={"full_attention": None, "sliding_attention": None},
                use_cache=False,
                logits_to_keep=keep,
                spot_prefix=pp,
            )
        return out.logits.float(), ids_dev

    def full_logits(self, prefix_ids: list[int], states: torch.Tensor) -> torch.Tensor:
        """Reference: the active block's logits from ONE cache-free forward over [prefix ; state] per row with an
        additive block-causal mask through the model's stock SDPA path (what `block_logits` must equal).
        prefix_ids: whole blocks before the active block."""
        R, L = states.shape
        n = len(prefix_ids) + L
        ids = torch.cat([torch.tensor(prefix_ids, dtype=torch.long).expand(R, -1), states.long()], 1)
        p = torch.arange(n)
        mask = allowed_to_additive(block_causal_allowed(p, p, L), self.dtype).unsqueeze(0).expand(R, -1, -1, -1)
        with torch.no_grad():
            out = self.model(input_ids=ids.to(self.device), position_ids=p.expand(R, -1).to(self.device),
                             attention_mask=mask.to(self.device), use_cache=False, logits_to_keep=L)
        return out.logits.float()

    def open(self, prompt_ids: list[int], gen_length: int | None = None) -> tuple[BlockCausalSession, list[int]]:
        """gen_length is not needed by a block-causal target (later blocks never influence earlier ones)."""
        L = self.info.block_len
        n_full = len(prompt_ids) // L * L
        return BlockCausalSession(self, list(prompt_ids[:n_full])), list(prompt_ids[n_full:])
