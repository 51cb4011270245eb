"""What drafters may read of the target's logits: small per-slot summaries computed on the target's device.

A drafter reads the stale conditionals of the active block only through `Stale`: per slot the top-k
probabilities, the two most probable tokens, log(1 - top-1 probability) and, at T > 0, the coupled stale draw.
These are L x (k + a few) numbers, so a round moves kilobytes to the host whatever the vocabulary width; the
[L, V] logits stay on the device (only the accept-residual verifier reads them, there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lm_eval_spot.decoding.transfer import HostLink

TOP_K = 32  # the paper's drafter reads the stale top-32 probabilities


@dataclass(frozen=True)
class Stale:
    """One state's target logits of the active block, summarised per slot (host tensors unless noted)."""

    topk: torch.Tensor  # [L, k] float32 probabilities, sorted descending (k = min(TOP_K, V))
    top_ids: torch.Tensor  # [L, 2] long: the tokens of the two largest probabilities
    log1m: torch.Tensor  # [L] float32 log(1 - top-1 probability), from the logits (precise when p ~ 1)
    draw_tok: torch.Tensor | None = None  # [L] long, T > 0: the coupled stale draw argmax(l / T + G)
    draw_p: torch.Tensor | None = None  # [L] float32, T > 0: softmax(l / T) at draw_tok
    device_logits: torch.Tensor | None = None  # [L, V] on the target's device; never moved to the host

    @property
    def confidence(self) -> torch.Tensor:
        """[L] clean confidence max_v softmax(l)_v (the same float32 softmax the target's transition uses)."""
        return self.topk[:, 0]


def log1m_top1(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...] log(1 - max_v p_v), computed from the logits so it stays precise when p ~ 1."""
    lf = logits.float()
    top = lf.argmax(dim=-1, keepdim=True)
    rest = lf.scatter(-1, top, float("-inf"))
    return torch.logsumexp(rest, dim=-1) - torch.logsumexp(lf, dim=-1)


def summarize(
    logits: torch.Tensor, link: HostLink, temperature: float = 0.0, gumbel: torch.Tensor | None = None,
    top_k: int = TOP_K,
) -> list[Stale]:
    """logits [N, L, V] (on any device, mask token already at -inf) -> N summaries on the host.

    gumbel [L, V] (float64, the block's rows, on the logits' device) is needed at T > 0 for the coupled draw.
    """
    lf = logits.float()
    probs = torch.softmax(lf, dim=-1)
    top = probs.topk(min(top_k, lf.shape[-1]), dim=-1)
    log1m = log1m_top1(lf)
    draw_tok = draw_p = None
    if temperature > 0:
        if gumbel is None:
            raise ValueError("temperature > 0 needs the block's Gumbel rows")
        scaled = lf.double() / temperature
        draw_tok = (scaled + gumbel).argmax(dim=-1)
        draw_p = torch.softmax(scaled, dim=-1).gather(-1, draw_tok[..., None]).squeeze(-1).float()
    k2 = min(2, top.indices.shape[-1])
    pulled = link.pull(top.values, top.indices[..., :k2], log1m, *((draw_tok, draw_p) if draw_tok is not None else ()))
    vals, ids, l1m = pulled[:3]
    if k2 < 2:  # a one-token vocabulary: no runner-up
        ids = torch.cat([ids, ids], dim=-1)
    out = []
    for n in range(lf.shape[0]):
        dt = pulled[3][n] if draw_tok is not None else None
        dp = pulled[4][n] if draw_tok is not None else None
        out.append(Stale(vals[n], ids[n], l1m[n], dt, dp, logits[n]))
    return out
