"""The drafter-facing summary: a recording run's batched summaries (many rows at once, the CPU's partition path)
equal what a round computes for one state (topk), value for value, so recorded training data matches what the
drafter reads when it drafts."""

from __future__ import annotations

import pytest
import torch

from lm_eval_spot.decoding.stale import summarize, top_k_probs
from lm_eval_spot.transfer import HostLink


def reference_top(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted descending by a full sort per row (distinct values: no ties to order)."""
    vals, ids = [], []
    for row in probs.tolist():
        order = sorted(range(len(row)), key=lambda j: -row[j])
        vals.append([row[j] for j in order[:k]])
        ids.append(order[:2])
    return torch.tensor(vals, dtype=probs.dtype), torch.tensor(ids)


@pytest.mark.parametrize("R,V", [(300, 293), (8, 293), (300, 5000), (260, 40), (300, 33)])
def test_top_k_probs_is_the_sorted_head(R, V):
    g = torch.Generator().manual_seed(R + V)
    probs = torch.softmax(torch.randn(R, V, generator=g) * 3, dim=-1)
    k = min(32, V)
    vals, ids = top_k_probs(probs, k)
    ref_vals, ref_ids = reference_top(probs, k)
    assert torch.equal(vals, ref_vals)
    assert torch.equal(ids, ref_ids)


def test_a_one_token_vocabulary_names_its_token_twice():
    vals, ids = top_k_probs(torch.ones(300, 1), 1)
    assert vals.shape == (300, 1) and torch.equal(ids, torch.zeros(300, 2, dtype=torch.long))


@pytest.mark.parametrize("V", [293, 1024])
def test_many_states_at_once_summarise_as_one_state_at_a_time(V):
    g = torch.Generator().manual_seed(V)
    N, L = 20, 32
    logits = torch.randn(N, L, V, generator=g) * 4
    logits[..., V - 1] = float("-inf")  # the mask token
    batched = summarize(logits.view(1, N * L, V), HostLink())[0]  # as observe.PendingCommits.flush does
    for n in range(N):
        one = summarize(logits[n : n + 1], HostLink())[0]  # as a round does
        rows = slice(n * L, (n + 1) * L)
        assert torch.equal(batched.topk[rows], one.topk)
        assert torch.equal(batched.top_ids[rows], one.top_ids)
        assert torch.equal(batched.log1m[rows], one.log1m)
