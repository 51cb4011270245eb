"""An independent, naive reference decoder written from docs/definitions.md and the noise definition
in docs/decoding.md. It imports nothing from lm_eval_spot: its own mask, confidence, tie-break, Gumbel noise
(pure-Python SplitMix64 and float64 math) and stop rule, and it recomputes the WHOLE sequence at every commit
(no cache, no replicas). Tests compare the package's decoders against it token for token.
"""

from __future__ import annotations

import hashlib
import math

import torch

_M64 = (1 << 64) - 1


def _key(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest(), "little") & (
        (1 << 63) - 1)


def gumbel(seed: int, block: int, slot: int, token: int) -> float:
    """G for (request seed, block index, in-block slot, token id), as docs/decoding.md defines it."""
    z = (_key("gumbel", seed, block) + ((slot << 32) + token) * 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z ^= z >> 31
    u = ((z >> 11) + 0.5) * 2.0**-53
    return -math.log(-math.log(u))


def _forward(model, ids: list[int], L: int) -> torch.Tensor:
    n = len(ids)
    blk = torch.arange(n) // L
    mask = torch.zeros(n, n)
    mask[blk[None, :] > blk[:, None]] = torch.finfo(torch.float32).min  # key's block after the query's: blocked
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), attention_mask=mask[None, None],
                    position_ids=torch.arange(n)[None])
    return out.logits[0].float()


def _first_max(values: list[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:  # strictly greater: the lowest index wins a tie
            best = i
    return best


def reference_decode(model, prompt: list[int], L: int, mask_id: int, stop_ids: set[int], max_toks: int,
                     T: float, seed: int, forward=None, warp=None) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Generated ids (cut before the first stop id), and every commit as (block, slot, token). `forward(ids, L)`
    -> logits [n, V] of the whole sequence (default: a native causal LM with an additive block-causal mask; the
    family tests pass the official forward of a remote-code model, called in its own protocol). `warp(scores)`
    (T > 0): a truncation of the tempered float64 row [1, V] before the Gumbel draw, e.g. transformers' top-k /
    top-p warpers; positions never read it."""
    forward = forward or (lambda ids, L_: _forward(model, ids, L_))
    seq = list(prompt)
    gen_start = len(prompt)
    out: list[int] = []
    commits: list[tuple[int, int, int]] = []
    block = 0
    while True:
        start = len(seq) // L * L
        cur = seq[start:] + [mask_id] * (L - (len(seq) - start))
        while True:
            elig = [cur[i] == mask_id and gen_start <= start + i < gen_start + max_toks for i in range(L)]
            if not any(elig):
                break
            logits = forward(seq[:start] + cur, L)[start:].float()
            logits[:, mask_id] = float("-inf")
            probs = torch.softmax(logits, dim=-1)
            conf = [float(probs[i].max()) if elig[i] else -1.0 for i in range(L)]
            i = _first_max(conf)
            row = logits[i].tolist()
            if T == 0:
                tok = _first_max(row)
            else:
                scaled = [x / T for x in row]
                if warp is not None:
                    scaled = warp(torch.tensor([scaled], dtype=torch.float64))[0].tolist()
                tok = _first_max([(x + gumbel(seed, block, i, v)) if x != float("-inf") else -math.inf
                                  for v, x in enumerate(scaled)])
            cur[i] = tok
            commits.append((block, i, tok))
        out += [c for j, c in enumerate(cur) if gen_start <= start + j < gen_start + max_toks]
        stop = next((j for j, t in enumerate(out) if t in stop_ids), None)
        if stop is not None:
            return out[:stop], commits
        if len(out) >= max_toks:
            return out[:max_toks], commits
        seq = seq[:start] + cur
        block += 1
