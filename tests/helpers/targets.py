"""Tiny targets and request sets the decoder tests share: random block-causal targets (`make`, `adapter_for`), ragged
request sets (`jobs_for`), commit logs, and bidirectional models built from the official remote code (`build`)."""

from __future__ import annotations

import torch

from lm_eval_spot.adapters.base import TargetInfo
from lm_eval_spot.adapters.block_causal import BlockCausalAdapter
from lm_eval_spot.decoding.batch import DecodeRequest
from lm_eval_spot.decoding.loop import DecodeConfig

from helpers.remote_fixtures import build_remote
from helpers.tiny import build_model

V, MASK, EOS = 40, 2, 1


# (model seed, embedding scale, block length, prompt length, noise seed): unscaled random targets give
# near-uniform but untied confidences; x40 saturates some confidences to exactly 1.0 (ties).
CASES = [(11, 1.0, 8, 5, 3), (12, 1.0, 4, 9, 4), (13, 1.0, 16, 3, 5), (14, 40.0, 8, 11, 6), (15, 40.0, 4, 2, 7)]


def make(seed: int, scale: float, L: int) -> BlockCausalAdapter:
    model = build_model(V, seed=seed, block_length=L, embed_scale=scale)
    return BlockCausalAdapter(model, TargetInfo(MASK, frozenset({EOS}), L, "zero", True, V))


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(5, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Log:
    def __init__(self) -> None:
        self.blocks: dict[int, list[tuple[int, int]]] = {}

    def on_commit(self, block, state, eligible, stale, pos, tok) -> None:
        self.blocks.setdefault(block, []).append((pos, tok))


def block_tokens(log: Log, block: int, prompt: list[int], L: int) -> list[int]:
    """Block `block`'s generated ids from the control log (its slots after the prompt tail)."""
    tail = len(prompt) % L if block == 0 else 0
    toks = dict(log.blocks[block])
    return [toks[i] for i in range(tail, L)]


def adapter_for(L: int, seed: int, scale: float) -> BlockCausalAdapter:
    return BlockCausalAdapter(build_model(V, seed=seed, block_length=L, embed_scale=scale),
                              TargetInfo(MASK, frozenset({EOS}), L, "zero", True, V))


def jobs_for(L: int, T: float, proposer, n: int = 7, lookahead: bool = False) -> list[DecodeRequest]:
    gen = torch.Generator().manual_seed(L)
    jobs = []
    for i in range(n):
        # Ragged prefixes: prompts from empty to three blocks, different generation lengths and seeds.
        plen = int(torch.randint(0, 3 * L + 1, (1,), generator=gen))
        prompt = torch.randint(5, V, (plen,), generator=gen).tolist()
        jobs.append(DecodeRequest(prompt, DecodeConfig(max_gen_toks=L + 3 + 5 * i, temperature=T, lookahead=lookahead),
                              seed=100 + i, proposer=proposer))
    return jobs


def build(fam: str, mask: int, seed: int = 0):
    model = build_remote(fam, seed=seed, scale=4.0, mask_token_id=mask)
    if fam == "llada":
        with torch.no_grad():
            model.model.transformer.wte.weight[mask] = 0.0
    return model

