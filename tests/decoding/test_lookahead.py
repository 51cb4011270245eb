"""Cross-block lookahead: a round that can finish the active block also scores the next block's all-mask state in
the same forward, and the next block's first round drafts from those logits.

Checked against independent recomputations (the reference's cache-free forward with a block-causal mask)
and against the naive reference decoder (tests/helpers/reference.py): the output never changes, whatever the drafter,
the forward still counts one NFE, and the rows the verifier reads are bit-identical to a forward without the
lookahead row.
"""

from __future__ import annotations

import pytest
import torch

from lm_eval_spot.decoding.batch import DecodeRequest, decode_many
from lm_eval_spot.decoding.loop import DecodeConfig, decode
from lm_eval_spot.decoding.proposer import RoundContext
from lm_eval_spot.decoding.tree import DraftTree
from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
from lm_eval_spot.drafter.spot_proposer import LearnedOrder, StaleConfidenceOrder, TreeConfig, TreeProposer

from helpers.reference import _forward as full_forward
from helpers.reference import reference_decode
from helpers.targets import CASES, EOS, MASK, V, Log, block_tokens as _block_tokens, make, prompt_of


def full_block_logits(model, ids: list[int], start: int, L: int) -> torch.Tensor:
    """Logits [L, V] of positions start..start+L of `ids`, by the reference's cache-free block-causal forward."""
    return full_forward(model, ids, L)[start : start + L]


class TrueChain:
    """Drafts the true next commits of a logged control run (so blocks finish inside drafted paths and lookahead
    rows are usable), and records every round's context."""

    def __init__(self, log: Log, budget: int, stale_only: bool = True) -> None:
        """stale_only: silent without stale conditionals, as every drafter that reads them is."""
        self.log, self.budget, self.stale_only = log, budget, stale_only
        self.seen: list[RoundContext] = []

    def propose(self, ctx: RoundContext) -> DraftTree:
        self.seen.append(ctx)
        if self.stale_only and ctx.stale is None:
            return DraftTree.empty()
        commits = self.log.blocks.get(ctx.block, [])
        k = next((i for i, (p, _) in enumerate(commits) if int(ctx.state[p]) == MASK), len(commits))
        nxt = commits[k : k + self.budget]
        return DraftTree(tuple(range(len(nxt))), tuple(p for p, _ in nxt), tuple(t for _, t in nxt))


@pytest.mark.parametrize("plen", [0, 5, 8, 19])
@pytest.mark.parametrize("second_round", [False, True])
def test_lookahead_forward_keeps_the_rows_and_scores_the_next_block(plen, second_round):
    """The verification rows equal `block_logits` bit for bit; the extra row's logits are the next block's at its
    all-mask state after the completion row is committed (a cache-free recomputation); one NFE."""
    L = 8
    adapter = make(41, 1.0, L)
    prompt = prompt_of(plen, 41) if plen else [7]
    gen = torch.Generator().manual_seed(plen)
    s_ahead, tail = adapter.open(prompt)
    s_plain, _ = adapter.open(prompt)
    start = len(prompt) // L * L
    states = torch.full((4, L), MASK)
    states[:, : len(tail)] = torch.tensor(tail, dtype=torch.long)
    full = torch.randint(5, V, (L,), generator=gen)
    full[: len(tail)] = torch.tensor(tail, dtype=torch.long)
    states[2] = full  # a completion of the active block
    states[3, -2:] = torch.tensor([9, 10])
    if second_round:  # the prefix's pending blocks are written by the first forward: test the cached path too
        s_ahead.block_logits(states[:1])
        s_plain.block_logits(states[:1])
    nfe0 = s_ahead.nfe.total
    rows, nxt = s_ahead.block_logits_ahead(states, 2)
    assert s_ahead.nfe.total == nfe0 + 1
    assert torch.equal(rows, s_plain.block_logits(states))
    ids = prompt[:start] + full.tolist() + [MASK] * L
    torch.testing.assert_close(nxt, full_block_logits(adapter.model, ids, start + L, L), rtol=0, atol=1e-4)
    # The completion's KV was not stored: the next plain forward still sees the same prefix.
    assert torch.equal(s_ahead.block_logits(states), s_plain.block_logits(states))


def test_lookahead_row_must_be_a_state():
    adapter = make(41, 1.0, 8)
    session, _ = adapter.open(prompt_of(8, 1))
    with pytest.raises(ValueError, match="lookahead row 3"):
        session.block_logits_ahead(torch.full((3, 8), MASK), 3)


@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("case", CASES)
def test_lookahead_never_changes_the_output(case, T):
    """Random, confidence-ordered and true drafters with lookahead on: the reference decoder's ids, every time;
    and with the true drafter the lookahead really served later blocks and saved forwards."""
    seed, scale, L, plen, noise = case
    adapter = make(seed, scale, L)
    prompt = prompt_of(plen, seed)
    n = 3 * L + 3
    ref, _ = reference_decode(adapter.model, prompt, L, MASK, {EOS}, n, T, noise)
    log = Log()
    control = decode(adapter, prompt, DecodeConfig(max_gen_toks=n, temperature=T), seed=noise, observer=log)
    assert control.token_ids == ref
    assert control.lookahead.rows == 0
    on = DecodeConfig(max_gen_toks=n, temperature=T, lookahead=True)
    off = DecodeConfig(max_gen_toks=n, temperature=T)
    torch.manual_seed(seed)
    drafter = FactoredOrderModel(FactoredConfig(max_block_len=max(L, 16)))
    for make_prop in (lambda: TreeProposer(LearnedOrder(drafter), TreeConfig(budget=6)),
                      lambda: TreeProposer(StaleConfidenceOrder(), TreeConfig(budget=L)),
                      lambda: TrueChain(log, 3), lambda: TrueChain(log, L, stale_only=False)):
        res = decode(adapter, prompt, on, seed=noise, proposer=make_prop())
        assert res.token_ids == ref and res.stop_reason == control.stop_reason
    true_on = decode(adapter, prompt, on, seed=noise, proposer=TrueChain(log, L))
    true_off = decode(adapter, prompt, off, seed=noise, proposer=TrueChain(log, L))
    assert true_on.token_ids == ref == true_off.token_ids
    blocks_after_first = len(log.blocks) - 1
    if blocks_after_first and control.stop_reason == "length":
        # Guard against a vacuous pass: the lookahead served every later block, and each saved a forward (but a
        # last block of one slot, which the first transition fills anyway).
        assert true_on.lookahead.used == true_on.lookahead.exact == blocks_after_first
        one_slot_end = (len(prompt) + n) % L == 1
        assert true_on.nfe.total <= true_off.nfe.total - blocks_after_first + one_slot_end


def test_first_round_drafts_from_the_next_blocks_own_logits():
    """A later block's first round gets the stale summary of that block's all-mask state after the committed block
    (recomputed from scratch), and its tree starts with the target's own first transition there."""
    L = 8
    adapter = make(21, 1.0, L)
    prompt = prompt_of(6, 21)
    n = 4 * L
    log = Log()
    decode(adapter, prompt, DecodeConfig(max_gen_toks=n), seed=1, observer=log)
    spy = TrueChain(log, L)
    res = decode(adapter, prompt, DecodeConfig(max_gen_toks=n, lookahead=True), seed=1, proposer=spy)
    assert res.lookahead.used >= 2
    checked = 0
    for ctx in spy.seen:
        start = (len(prompt) // L + ctx.block) * L
        in_window = int((ctx.state != MASK).sum())
        if ctx.block == 0 or in_window != 1 or ctx.stale is None:
            continue
        # The context's state is one commit past the block's all-mask state: that commit is the block's first.
        first = log.blocks[ctx.block][0]
        assert int(ctx.state[first[0]]) == first[1]
        committed = [t for b in range(ctx.block) for t in _block_tokens(log, b, prompt, L)]
        ids = (prompt + committed)[:start] + [MASK] * L
        logits = full_block_logits(adapter.model, ids, start, L)
        logits[:, MASK] = float("-inf")
        top = torch.softmax(logits, -1).topk(ctx.stale.topk.shape[-1], -1).values
        torch.testing.assert_close(ctx.stale.topk, top, rtol=0, atol=1e-5)
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_batched_decoding_with_lookahead_equals_one_at_a_time(T):
    L = 8
    adapter = make(14, 40.0, L)
    prompts = [prompt_of(k, 50 + k) for k in (3, 8, 11, 0)]
    prompts[-1] = [5]
    cfg = DecodeConfig(max_gen_toks=3 * L, temperature=T, lookahead=True)
    torch.manual_seed(0)
    drafter = FactoredOrderModel(FactoredConfig(max_block_len=16))
    prop = TreeProposer(LearnedOrder(drafter), TreeConfig(budget=L))
    jobs = [DecodeRequest(p, cfg, seed=i, proposer=prop) for i, p in enumerate(prompts)]
    alone = [decode(adapter, j.prompt_ids, j.cfg, j.seed, proposer=prop) for j in jobs]
    together = decode_many(adapter, jobs, batch_size=3)
    for a, b in zip(alone, together, strict=True):
        assert a.token_ids == b.token_ids and a.nfe.total == b.nfe.total
        assert (a.lookahead.rows, a.lookahead.used) == (b.lookahead.rows, b.lookahead.used)


def test_no_lookahead_under_batch_invariance_or_when_off():
    """pad_rows fixes every forward's row count, which an extra row would break; lookahead=False turns it off."""
    L = 8
    adapter = make(21, 1.0, L)
    prompt = prompt_of(6, 21)
    log = Log()
    decode(adapter, prompt, DecodeConfig(max_gen_toks=3 * L), seed=1, observer=log)
    padded = decode(adapter, prompt, DecodeConfig(max_gen_toks=3 * L, pad_rows=1 + L, lookahead=True), seed=1,
                    proposer=TrueChain(log, L))
    off = decode(adapter, prompt, DecodeConfig(max_gen_toks=3 * L), seed=1, proposer=TrueChain(log, L))
    on = decode(adapter, prompt, DecodeConfig(max_gen_toks=3 * L, lookahead=True), seed=1, proposer=TrueChain(log, L))
    assert padded.lookahead.rows == off.lookahead.rows == 0 < on.lookahead.rows
    assert padded.token_ids == off.token_ids == on.token_ids
