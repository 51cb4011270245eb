"""Drafter inputs: stale top-k probabilities and path features, per position of the active block.

Vocabulary-agnostic by construction: no token ids, no hidden states, no text; only sorted probabilities and
where each slot stands on the hypothetical path.
"""

from __future__ import annotations

import torch

from lm_eval_spot.decoding.stale import TOP_K  # noqa: F401 (the drafter reads what the summary holds)

FEATURE_VERSION = 1
MAX_DEPTH = 64  # path depths beyond this share one embedding

# Slot status on a hypothetical state.
COMMITTED = 0  # held a token when the round began (prompt tail, earlier commits)
ON_PATH = 1  # committed along the hypothetical path (its depth is a separate feature)
MASKED = 2  # still masked and eligible: a candidate for the next commit
INACTIVE = 3  # masked but outside the generation window: never committed


def prob_features(topk_probs: torch.Tensor) -> torch.Tensor:
    """[..., L, k] probabilities -> [..., L, 2k] model inputs (p and log p; log keeps tails distinguishable)."""
    p = topk_probs.float()
    return torch.cat([p, torch.log(p.clamp_min(1e-9))], dim=-1)


def node_status(committed: torch.Tensor, eligible: torch.Tensor, path_depth: torch.Tensor) -> torch.Tensor:
    """Status per slot of N hypothetical states.

    committed, eligible: [L] or [N, L] bool (at round start); path_depth [N, L] long (0 = not on the path,
    d >= 1 = committed at path depth d) -> [N, L] long status codes.
    """
    status = torch.full_like(path_depth, INACTIVE)
    status[eligible.expand_as(path_depth)] = MASKED
    status[committed.expand_as(path_depth)] = COMMITTED
    status[path_depth > 0] = ON_PATH
    return status
