"""Statistics the sampler tests share."""

from __future__ import annotations

import torch


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value; cells with expected count < 5 are pooled."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs_c = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)]).double()
    exp_c = torch.cat([exp[big], exp[~big].sum(0, keepdim=True)]).double()
    keep = exp_c > 0
    stat = ((obs_c[keep] - exp_c[keep]) ** 2 / exp_c[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))

