"""A request's blocks: the active block's state, its generation window and noise, and the finished blocks' ids.

A block is finished when no slot of its window is masked; it is then committed to the target's session (its keys
become prefix) and the next block starts all masked. The noise rows are drawn once per block, on the device, as a
pure function of (seed, block, position, token), so a block's draws never depend on how its rounds went.
"""

from __future__ import annotations

import torch

from lm_eval_spot.adapters.base import TargetInfo, TargetSession
from lm_eval_spot.decoding.noise import gumbel_rows
from lm_eval_spot.transfer import upload


class BlockCursor:
    def __init__(self, info: TargetInfo, session: TargetSession, prompt_len: int, max_gen_toks: int, tail: list[int],
                 seed: int, temperature: float, device: torch.device) -> None:
        self.info, self.session, self.tail = info, session, tail
        self.seed, self.temperature, self.dev = seed, temperature, device
        self.gen_start, self.gen_end = prompt_len, prompt_len + max_gen_toks
        self.block = 0
        self.done_ids: list[int] = []  # generated ids of finished blocks
        self._start()

    def _start(self) -> None:
        L, mask_id = self.info.block_len, self.info.mask_id
        start = self.session.block_start
        abs_pos = start + torch.arange(L)
        self.window = (abs_pos >= self.gen_start) & (abs_pos < self.gen_end)
        on_dev = start + torch.arange(L, device=self.dev)  # made there: nothing to upload
        self.window_dev = (on_dev >= self.gen_start) & (on_dev < self.gen_end)
        self.state = torch.full((L,), mask_id, dtype=torch.long)
        if self.block == 0 and self.tail:
            self.state[: len(self.tail)] = torch.tensor(self.tail, dtype=torch.long)
        V = self.info.vocab_size
        self.gumbel = gumbel_rows(self.seed, self.block, L, V, self.dev) if self.temperature > 0 else None

    def open_slots(self, states: torch.Tensor) -> torch.Tensor:
        """Masked slots inside the generation window, of a state [L] or of states [R, L]."""
        return (states == self.info.mask_id) & self.window

    def masked_left(self) -> int:
        return int(self.open_slots(self.state).sum())

    def roll(self) -> int:
        """Finish every full block (commit it to the session, start the next); returns how many began."""
        begun = 0
        while not bool(self.open_slots(self.state).any()):
            self.done_ids.extend(self.state[self.window].tolist())
            self.session.commit_block(self.state)
            self.block += 1
            self._start()
            begun += 1
        return begun

    def is_last(self) -> bool:
        """No next block starts inside the generation."""
        return self.session.block_start + self.info.block_len >= self.gen_end

    def device_open(self, states: torch.Tensor, host_open: torch.Tensor) -> torch.Tensor:
        """The open slots of `states` on the device, from the state rows the adapter uploaded (no copy of its
        own) when it keeps them, else `host_open` uploaded."""
        dstates = self.session.device_states
        if dstates is not None and dstates.shape[0] >= states.shape[0]:
            return (dstates[: states.shape[0]] == self.info.mask_id) & self.window_dev
        return upload(host_open, device=self.dev)[0]

    def commit(self, state: torch.Tensor, pos: int, tok: int, round_: int) -> int:
        """Make `state` (the deepest accepted node) the block's state, plus the round's own transition (pos, tok)
        when it has one; returns 1 for that commit, else 0."""
        left = self.masked_left()
        self.state = state.clone()
        own = 0
        if pos >= 0:
            self.state[pos] = tok
            own = 1
        if self.masked_left() >= left:
            raise RuntimeError(f"decoding made no progress in block {self.block} (round {round_}): the round "
                               f"left {left} masked slots masked (a target transition that commits nothing)")
        return own

    def prefix(self) -> list[int]:
        """The contiguous committed prefix of the generation: final, whatever the commit order."""
        gen_slots = self.state[self.window]
        masked = gen_slots == self.info.mask_id
        first_mask = int(masked.nonzero()[0]) if bool(masked.any()) else None
        return self.done_ids + gen_slots[:first_mask].tolist()
