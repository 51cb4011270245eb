"""What drafters may read of the target's logits: small per-slot summaries computed on the target's device.

A drafter reads the stale conditionals of the active block only through `Stale`: per slot the top-k
probabilities, the two most probable tokens, log(1 - top-1 probability) and, at T > 0, the coupled stale draw.
These are L x (k + a few) numbers, so a round moves kilobytes to the host whatever the vocabulary width; the
[L, V] logits stay on the device (the loop keeps the row for the accept-residual verifier, which reads it there).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lm_eval_spot.decoding.sampling import Truncation
from lm_eval_spot.transfer import HostLink
from lm_eval_spot.decoding.transition import row_chunks

TOP_K = 32  # the paper's drafter reads the stale top-32 probabilities
# `top_k_probs` partitions on the CPU for at least this many rows of at most this many tokens (measured there).
PARTITION_MIN_ROWS, PARTITION_MAX_V = 256, 4096
SORT_MAX_V = 512  # up to this many tokens a full sort of each row beats partitioning it (measured there)


@dataclass(frozen=True)
class Stale:
    """One state's target logits of the active block, summarised per slot (host tensors unless noted)."""

    topk: torch.Tensor  # [L, k] float32 probabilities, sorted descending (k = min(TOP_K, V))
    top_ids: torch.Tensor  # [L, 2] long: the tokens of the two largest probabilities
    log1m: torch.Tensor  # [L] float32 log(1 - top-1 probability), from the logits (precise when p ~ 1)
    draw_tok: torch.Tensor | None = None  # [L] long, T > 0: the coupled stale draw argmax(l / T + G)
    draw_p: torch.Tensor | None = None  # [L] float32, T > 0: softmax(l / T) at draw_tok

    @property
    def confidence(self) -> torch.Tensor:
        """[L] clean confidence max_v softmax(l)_v (the same float32 softmax the target's transition uses)."""
        return self.topk[:, 0]


def top_k_probs(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, V] probabilities -> the k largest of each row, descending [R, k] (torch.topk's values exactly), and the
    tokens of the two largest [R, 2] (the same token twice in a one-token vocabulary).

    Many rows of a small vocabulary on the CPU (a recording run's batched summaries) take a partition and a sort of
    the k survivors: on fresh rows at V = 293 that is 0.5-0.7 us a row against topk's 3 us (1.1 against 8.4 at
    V = 1,024), and topk was most of what recording (drafter_data) added to a small target's control run. A round's
    few rows, real vocabularies and accelerators keep topk (as fast or faster there, and fewer ops). The two paths
    may order exactly tied tokens differently; only drafts read these ids, never the verifier."""
    R, V = probs.shape
    if (probs.device.type == "cpu" and probs.dtype == torch.float32 and R >= PARTITION_MIN_ROWS
            and k < V <= PARTITION_MAX_V):
        a = probs.detach().numpy()
        if V <= SORT_MAX_V:  # a whole-row sort is the faster selection there (0.47 us a row against 0.65 at V = 293)
            part = np.sort(a, axis=-1)[:, V - k :]
        else:
            part = np.partition(a, V - k, axis=-1)[:, V - k :]
            part.sort(axis=-1)
        # numpy's argmax (the first maximal index, like torch's) is several times faster here than torch's
        top1 = np.argmax(a, axis=-1)
        others = a.copy()
        others[np.arange(R), top1] = -1.0
        ids = np.stack([top1, np.argmax(others, axis=-1)], axis=-1)
        return torch.from_numpy(np.ascontiguousarray(part[:, ::-1])), torch.from_numpy(ids).long()
    top = probs.topk(k, dim=-1)
    ids = top.indices[:, :2]
    return top.values, ids if k > 1 else torch.cat([ids, ids], dim=-1)


def summarize(
    logits: torch.Tensor, link: HostLink, temperature: float = 0.0, gumbel: torch.Tensor | None = None,
    top_k: int = TOP_K, trunc: Truncation | None = None,
) -> list[Stale]:
    """logits [N, L, V] (on any device, mask token already at -inf) -> N summaries on the host.

    gumbel [L, V] (float64, the block's rows, on the logits' device) is needed at T > 0 for the coupled draw;
    `trunc` (top-k / top-p) applies to that draw and its probability as the target's transition applies it.
    The top-k probabilities and confidences stay those of the clean distribution (what positions are read from).
    """
    N, L, V = logits.shape
    if temperature > 0 and gumbel is None:
        raise ValueError("temperature > 0 needs the block's Gumbel rows")
    k = min(top_k, V)
    parts: list[tuple[torch.Tensor, ...]] = []
    step = min(L, row_chunks(logits))
    for n in range(N):
        for i in range(0, L, step):  # in slot chunks: see row_chunks (same values, a fraction of the time on CPU)
            lf = logits[n, i : i + step].float()
            probs = torch.softmax(lf, dim=-1)
            part: tuple[torch.Tensor, ...] = top_k_probs(probs, k)
            if temperature > 0:
                # The draw in float64, exactly as the target's transition draws (so they agree); its probability
                # is only a mass for ranking drafts: float32 is plenty (and at T = 1 it is the softmax above).
                if trunc is not None and trunc.active:
                    scores = trunc.apply(lf.double().div_(temperature))
                    tok = (scores + gumbel[i : i + step]).argmax(dim=-1)
                    at_t = torch.softmax(scores, dim=-1).float()
                else:
                    tok = lf.double().div_(temperature).add_(gumbel[i : i + step]).argmax(dim=-1)
                    at_t = probs if temperature == 1.0 else torch.softmax(lf / temperature, dim=-1)
                part += (tok, at_t.gather(-1, tok[:, None]).squeeze(-1))
            # log(1 - p1) as the log of the other probabilities' sum: each keeps its relative precision, so this
            # stays exact where 1 - p1 would round to 0 (all others underflowing gives -inf: "certain").
            probs.scatter_(-1, part[1][:, :1], 0.0)
            part = part[:2] + (torch.log(probs.sum(dim=-1)),) + part[2:]
            parts.append(part)
    cols = [torch.cat(c).view(N, L, *c[0].shape[1:]) for c in zip(*parts, strict=True)]
    top_values, top_indices, log1m = cols[:3]
    draw_tok, draw_p = (cols[3], cols[4]) if temperature > 0 else (None, None)
    pulled = link.pull(top_values, top_indices, log1m, *((draw_tok, draw_p) if draw_tok is not None else ()))
    vals, ids, l1m = pulled[:3]
    out = []
    for n in range(N):
        dt = pulled[3][n] if draw_tok is not None else None
        dp = pulled[4][n] if draw_tok is not None else None
        out.append(Stale(vals[n], ids[n], l1m[n], dt, dp))
    return out
