"""Gumbel noise rows, one per (request seed, block, position), shared by the target and any drafter.

A block's rows are drawn from a generator seeded by (request seed, block index) alone, so row i of block b is
the same whichever method (control, SPOT, any budget) asks for it: that is what couples drafts to the target.
"""

from __future__ import annotations

import hashlib

import torch

_MASK63 = (1 << 63) - 1


def mix_seed(*parts: object) -> int:
    """Stable 63-bit seed from any printable parts (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK63


def gumbel_rows(seed: int, block_index: int, block_len: int, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [block_len, vocab_size] (float32) for one block of one request."""
    gen = torch.Generator(device="cpu").manual_seed(mix_seed("gumbel", seed, block_index))
    u = torch.rand((block_len, vocab_size), generator=gen, dtype=torch.float64)
    # float64 draws keep u away from 0 and 1, so -log(-log(u)) stays finite.
    u = u.clamp_(min=1e-300, max=1.0 - 1e-16)
    return (-torch.log(-torch.log(u))).to(torch.float32)
