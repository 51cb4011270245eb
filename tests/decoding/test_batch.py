"""Several requests in one forward: outputs identical to one request at a time, for control and SPOT, T=0 and T=1."""

from __future__ import annotations

import pytest
import torch

from lm_eval_spot.adapters.base import RowsCall
from lm_eval_spot.decoding.batch import decode_many
from lm_eval_spot.decoding.loop import DecodeConfig, decode
from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
from lm_eval_spot.drafter.spot_proposer import LearnedOrder, TreeConfig, TreeProposer

from helpers.targets import MASK, V, adapter_for, jobs_for


@pytest.mark.parametrize("scale", [1.0, 40.0])
@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("mode", ["control", "spot", "spot-lookahead"])
def test_batched_outputs_equal_one_at_a_time(mode, T, scale):
    """Every request's ids, NFE and accepted counts at batch sizes 3 and 8 equal its decode alone; with lookahead,
    rounds carrying a lookahead row and blocks' first rounds share the forward with the others."""
    L = 8
    adapter = adapter_for(L, seed=3, scale=scale)
    torch.manual_seed(0)
    prop = TreeProposer(LearnedOrder(FactoredOrderModel(FactoredConfig(max_block_len=16))), TreeConfig(budget=5)) \
        if mode.startswith("spot") else None
    jobs = jobs_for(L, T, prop, n=9, lookahead=mode == "spot-lookahead")
    alone = [decode(adapter, j.prompt_ids, j.cfg, j.seed, proposer=j.proposer) for j in jobs]
    if mode == "spot-lookahead":
        assert sum(r.lookahead.rows for r in alone) > 0
    done: list[int] = []
    for bs in (3, 8):
        batched = decode_many(adapter, jobs, batch_size=bs, on_done=lambda i, r: done.append(i))
        for a, b in zip(alone, batched, strict=True):
            assert b.token_ids == a.token_ids and b.stop_reason == a.stop_reason
            assert b.nfe.total == a.nfe.total and b.accepted == a.accepted
    assert sorted(done) == sorted(list(range(len(jobs))) * 2)


def test_shared_forward_rows_equal_each_request_alone():
    """block_logits_many: each request's rows, stacked with other requests' rows (other prefixes and lengths),
    are bit for bit its own block_logits (CPU, float32); every request is charged one NFE."""
    L = 8
    adapter = adapter_for(L, seed=5, scale=1.0)
    gen = torch.Generator().manual_seed(2)
    sessions, states = [], []
    for plen, R in ((2 * L, 3), (3, 1), (L, 4)):
        s, tail = adapter.open(torch.randint(5, V, (plen,), generator=gen).tolist())
        st = torch.full((L,), MASK)
        st[: len(tail)] = torch.tensor(tail, dtype=torch.long)
        s.block_logits(st[None])  # stores the prompt blocks: no pending left
        rows = st.repeat(R, 1)
        rows[1:, -1] = 7
        sessions.append(s)
        states.append(rows)
    together = adapter.block_logits_many(list(zip(sessions, states, strict=True)))
    for s, st, got in zip(sessions, states, together, strict=True):
        assert s.nfe.rounds == 2
        assert torch.equal(got, s.block_logits(st))


def _session(adapter, L, plen, gen, forwarded: bool, commit: bool):
    """A session on a random prompt of `plen` tokens: its first forward run (`forwarded`), then its first block
    committed (`commit`: one pending block rides along with the next forward). Returns (session, a state)."""
    s, tail = adapter.open(torch.randint(5, V, (plen,), generator=gen).tolist())
    st = torch.full((L,), MASK)
    st[: len(tail)] = torch.tensor(tail, dtype=torch.long)
    if forwarded:
        s.block_logits(st[None])
    if commit:
        full = st.clone()
        full[len(tail):] = torch.randint(5, V, (L - len(tail),), generator=gen)
        s.commit_block(full)
        st = torch.full((L,), MASK)
    return s, st


def test_pending_blocks_and_lookahead_rows_share_the_forward():
    """forward_many with every kind of round at once: plain rounds, lookahead rows, a block's first round (one
    pending block riding along, with and without a lookahead row), a prompt's first round with one and with two
    pending prompt blocks. Every request's logits and lookahead logits equal its own forward's bit for bit, its
    cache afterwards equals the one its own forward leaves, and all rows of width L share ONE model forward."""
    L = 8
    adapter = adapter_for(L, seed=6, scale=1.0)
    # (prompt length, forwarded, commit, replica rows, lookahead row)
    kinds = [(2 * L, True, False, 3, None), (3, True, False, 2, 1), (L + 3, True, True, 2, None),
             (5, True, True, 3, 0), (L + 2, False, False, 2, None), (2 * L + 1, False, False, 1, None),
             (L, False, False, 2, 1)]
    calls, twins = [], []
    for k, (plen, fwd, commit, R, ahead) in enumerate(kinds):
        pair = []
        for _ in range(2):  # the same request twice: one shares the forward, one runs alone
            s, st = _session(adapter, L, plen, torch.Generator().manual_seed(k), fwd, commit)
            rows = st.repeat(R, 1)
            open_ = (rows[0] == MASK).nonzero().flatten()
            for r in range(1, R):
                rows[r, open_[: r]] = 9 + r
            if ahead is not None:
                rows[ahead, open_] = 11  # a completion of the block
            pair.append(RowsCall(s, rows, ahead))
        calls.append(pair[0])
        twins.append(pair[1])
    runs = []
    orig_run = adapter._run
    adapter._run = lambda ids, *a, **kw: runs.append(ids.shape) or orig_run(ids, *a, **kw)
    together = adapter.forward_many(calls)
    assert sorted(w for _, w in runs) == [L, 3 * L]  # one forward of width L for six requests; the 2-block prompt
    for c, t, (lg, ahead) in zip(calls, twins, together, strict=True):
        if t.ahead is None:
            want, want_ahead = t.session.block_logits(t.states), None
        else:
            want, want_ahead = t.session.block_logits_ahead(t.states, t.ahead)
        assert torch.equal(lg, want)
        assert (ahead is None) == (want_ahead is None)
        assert ahead is None or torch.equal(ahead, want_ahead)
        assert c.session.nfe.rounds == t.session.nfe.rounds
        assert c.session.block_start == t.session.block_start
        nxt = torch.full((2, L), MASK)
        nxt[1, 0] = 12
        assert torch.equal(c.session.block_logits(nxt), t.session.block_logits(nxt))  # the stored prefixes agree


def test_batch_size_must_be_positive():
    with pytest.raises(ValueError, match="batch_size"):
        decode_many(adapter_for(8, 0, 1.0), [], batch_size=0)


def test_pad_rows_makes_every_forward_one_shape_and_changes_nothing():
    """batch_invariant's padding: every forward, control's included, has exactly pad_rows rows, and the output
    equals the unpadded decode's (on the CPU rows are batch-invariant, so padding must change nothing)."""
    L = 8
    adapter = adapter_for(L, seed=4, scale=1.0)
    shapes: list[int] = []
    inner = adapter.forward_many

    def forward_many(calls):
        shapes.extend(c.states.shape[0] for c in calls)
        return inner(calls)

    adapter.forward_many = forward_many
    torch.manual_seed(1)
    prop = TreeProposer(LearnedOrder(FactoredOrderModel(FactoredConfig(max_block_len=16))), TreeConfig(budget=5))
    for T in (0.0, 1.0):
        for p in (None, prop):
            plain = decode(adapter, [7, 8, 9], DecodeConfig(max_gen_toks=2 * L, temperature=T), 3, proposer=p)
            shapes.clear()
            padded = decode(adapter, [7, 8, 9], DecodeConfig(max_gen_toks=2 * L, temperature=T, pad_rows=6), 3,
                            proposer=p)
            assert set(shapes) == {6}
            assert padded.token_ids == plain.token_ids and padded.nfe.total == plain.nfe.total
    with pytest.raises(ValueError, match="pad_rows"):
        decode(adapter, [7], DecodeConfig(max_gen_toks=L, pad_rows=3), 3,
               proposer=TreeProposer(LearnedOrder(FactoredOrderModel(FactoredConfig(max_block_len=16))),
                                     TreeConfig(budget=5)))


