"""A scripted target with hand-made logits, for decoder tests that must force exact token sequences."""

from __future__ import annotations

import torch

from lm_eval_spot.adapters.base import ForwardTally, NFECounter, RowsCall, TargetInfo


class ScriptedSession:
    def __init__(self, adapter: ScriptedAdapter, start: int) -> None:
        self._a = adapter
        self._start = start
        self.nfe = NFECounter(prefill=1 if start else 0)
        self.device_states: torch.Tensor | None = None  # never kept: the loop uploads its own masks
        self.pending_blocks = 0  # blocks are stored apart

    @property
    def block_start(self) -> int:
        return self._start

    def block_logits(self, states: torch.Tensor) -> torch.Tensor:
        self.nfe.rounds += 1
        self._a.tally.forwards += 1
        R, L = states.shape
        return self._a.logits_at(self._start, L).unsqueeze(0).expand(R, L, -1).clone()

    def commit_block(self, block: torch.Tensor) -> None:
        self.nfe.store += 1
        self._start += block.shape[0]


class ScriptedAdapter:
    """Slot at absolute position p prefers script[p] with a confidence that varies by position (so the
    commit order is not left to right), or samples from fixed `probs` rows when given."""

    def __init__(self, script: dict[int, int] | None, vocab: int, block_len: int, mask_id: int = 0,
                 stop_ids: frozenset[int] = frozenset({1}), seed: int = 0, rows: torch.Tensor | None = None):
        self.script = script or {}
        self.rows = rows  # [n, V] logits used cyclically by absolute position when given
        self.info = TargetInfo(mask_id, stop_ids, block_len, "zero", True, vocab)
        self._gen = torch.Generator().manual_seed(seed)
        self._margin = torch.rand(4096, generator=self._gen) * 4 + 1
        self.device = torch.device("cpu")
        self.tally = ForwardTally()

    def logits_at(self, start: int, L: int) -> torch.Tensor:
        V = self.info.vocab_size
        out = torch.zeros(L, V)
        for i in range(L):
            p = start + i
            if self.rows is not None:
                out[i] = self.rows[p % self.rows.shape[0]]
            else:
                out[i, self.script.get(p, 2)] = float(self._margin[p])
        return out

    def forward_many(self, calls: list[RowsCall]) -> list[tuple[torch.Tensor, None]]:
        assert all(c.ahead is None for c in calls), "the scripted target has no lookahead row"
        return [(c.session.block_logits(c.states), None) for c in calls]

    def block_logits_many(self, items: list[tuple[ScriptedSession, torch.Tensor]]) -> list[torch.Tensor]:
        return [s.block_logits(st) for s, st in items]

    def open(self, prompt_ids: list[int], gen_length: int | None = None):
        L = self.info.block_len
        n_full = len(prompt_ids) // L * L
        return ScriptedSession(self, n_full), list(prompt_ids[n_full:])
