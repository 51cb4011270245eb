"""Observers see every commit, in order, with the summary of the logits it was decided from, whether the rows are
summarised one buffer at a time (several flushes per request) and handed over as batches or commit by commit."""

from __future__ import annotations

import pytest
import torch

from lm_eval_spot.decoding import observe
from lm_eval_spot.transfer import HostLink


class OneByOne:
    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def on_commit(self, block, state, eligible, stale, pos, tok) -> None:
        self.seen.append((block, state.clone(), eligible.clone(), stale.topk, stale.top_ids, stale.log1m, pos, tok))


class Batched(OneByOne):
    def on_commits(self, batch) -> None:
        for i in range(len(batch)):
            s = batch.stale(i)
            self.seen.append((batch.block[i], batch.state[i], batch.eligible[i], s.topk, s.top_ids, s.log1m,
                              batch.pos[i], batch.tok[i]))


def _reference(row: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per slot: the k largest probabilities (a full descending sort), the two best tokens, log of the rest's mass."""
    p = torch.softmax(row.double(), dim=-1)
    vals, ids = p.sort(dim=-1, descending=True)
    return vals[:, :k], ids[:, :2], torch.log(vals[:, 1:].sum(dim=-1))


@pytest.mark.parametrize("observer_cls", [OneByOne, Batched])
@pytest.mark.parametrize("rows_held", [1, 3, 100])
def test_every_commit_reaches_the_observer_with_its_own_summary(monkeypatch, observer_cls, rows_held):
    L, V, n = 6, 50, 11
    monkeypatch.setattr(observe, "MAX_BYTES", rows_held * L * V * 4)
    g = torch.Generator().manual_seed(rows_held)
    obs = observer_cls()
    pending = observe.PendingCommits(obs, HostLink())
    given = []
    for i in range(n):
        logits = torch.randn(2, L, V, generator=g) * 3  # a round's two replicas: the observed one is row 1
        state = torch.randint(0, V, (L,), generator=g)
        eligible = torch.rand(L, generator=g) > 0.5
        pending.add(i // 4, state, eligible, logits[1], i % L, 7 * i)
        given.append((i // 4, state.clone(), eligible.clone(), logits[1].clone(), i % L, 7 * i))
        state.fill_(-1)  # the decoder's later changes to its own tensors reach no observer
        logits.fill_(0.0)
    pending.flush()
    assert len(obs.seen) == n
    for (block, state, eligible, row, pos, tok), (b, s, e, topk, ids, log1m, p, t) in zip(given, obs.seen,
                                                                                          strict=True):
        assert (b, p, t) == (block, pos, tok)
        assert torch.equal(s, state) and torch.equal(e, eligible)
        ref_vals, ref_ids, ref_log1m = _reference(row, 32)
        torch.testing.assert_close(topk.double(), ref_vals, rtol=1e-6, atol=1e-7)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(log1m.double(), ref_log1m, rtol=1e-5, atol=1e-6)
    assert pending.seconds > 0
