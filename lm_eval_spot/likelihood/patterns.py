"""Mask patterns of the masked-diffusion bound for one unit of k continuation tokens.

A unit is what one noise level covers: the whole continuation on a fully bidirectional target, one block's
continuation tokens on a block-causal one (the clean prefix visible). With l ~ Uniform{1..k} masked tokens chosen
uniformly, the bound is

    B = E_l E_{S, |S| = l} [ (k / l) * sum_{i in S} log p(x_i | x with S masked) ],

which is log p(x) exactly when k = 1. Two ways to compute it:
- exact: every non-empty pattern S once, weighted 1 / (|S| * C(k, |S|)) (2^k - 1 rows);
- sampled: R rows with stratified counts l_r = floor(((u0 + r / R) mod 1) * k) + 1 (each marginally uniform,
  together spread over 1..k) and S_r the l_r positions with the smallest of R x k uniform keys; the estimate is the
  mean of the rows' (k / l_r)-weighted sums, its standard error the rows' standard deviation over sqrt(R) (an upper
  bound under stratification).

The keys are drawn position-major, so position i's keys are the same for every k > i: two continuations of
different lengths scored from one generator share their noise as far as their lengths allow (common random masks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import torch


@dataclass(frozen=True)
class MaskPlan:
    masked: torch.Tensor  # [R, k] bool: the positions each row masks
    weights: torch.Tensor  # [R] float64: row r contributes weights[r] * (sum of log p over its masked positions)
    exact: bool  # True: the bound is the weighted SUM over the rows; False: the MEAN of the weighted rows

    @property
    def rows(self) -> int:
        return int(self.masked.shape[0])


def exact_rows(k: int) -> int:
    """Rows the exact enumeration of a k-token unit needs."""
    return (1 << k) - 1


def exact_plan(k: int) -> MaskPlan:
    """Every non-empty mask pattern of k positions, weighted so the weighted sum is the bound."""
    if k < 1:
        raise ValueError(f"a unit has at least one token, got k={k}")
    pats, weights = [], []
    for l in range(1, k + 1):
        w = 1.0 / (l * math.comb(k, l))
        for S in combinations(range(k), l):
            row = [False] * k
            for i in S:
                row[i] = True
            pats.append(row)
            weights.append(w)
    return MaskPlan(torch.tensor(pats, dtype=torch.bool), torch.tensor(weights, dtype=torch.float64), True)


def sampled_plan(k: int, rows: int, gen: torch.Generator) -> MaskPlan:
    """`rows` stratified Monte Carlo rows (see the module docstring)."""
    if k < 1 or rows < 1:
        raise ValueError(f"need k >= 1 and rows >= 1, got k={k}, rows={rows}")
    u0 = torch.rand(1, generator=gen, dtype=torch.float64)
    u = torch.remainder(u0 + torch.arange(rows, dtype=torch.float64) / rows, 1.0)
    counts = (u * k).floor().long().clamp(max=k - 1) + 1
    keys = torch.rand(k, rows, generator=gen, dtype=torch.float64).T  # position-major: shared across lengths
    rank = keys.argsort(dim=1).argsort(dim=1)
    masked = rank < counts[:, None]
    return MaskPlan(masked, k / counts.double(), False)


def plan_for(k: int, mc_num: int, gen: torch.Generator) -> MaskPlan:
    """Exact when the patterns fit in mc_num rows (k = 1 always: one row, the exact log-probability), else
    mc_num sampled rows."""
    if exact_rows(k) <= mc_num:
        return exact_plan(k)
    return sampled_plan(k, mc_num, gen)


def combine(plan: MaskPlan, row_sums: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """The unit's bound and its variance from each row's summed masked log-probabilities [R] ->
    (estimate, variance of the estimate, the rows' weighted values [R] float64)."""
    vals = plan.weights * row_sums.double().cpu()
    if plan.exact:
        return float(vals.sum()), 0.0, vals
    R = vals.numel()
    var = float(vals.var(unbiased=True)) / R if R > 1 else math.nan
    return float(vals.mean()), var, vals
