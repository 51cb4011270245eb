"""The target adapter contract on a tiny random Qwen3 block-causal model (no download)."""

from __future__ import annotations

import torch

from lm_eval_spot.adapters.base import TargetInfo
from lm_eval_spot.adapters.block_causal import BlockCausalAdapter
from lm_eval_spot.adapters.attention_masks import block_causal_mask

from helpers.tiny import build_model

L = 8
V = 60
MASK = 2


def make_adapter(seed: int = 0) -> BlockCausalAdapter:
    model = build_model(V, seed=seed, block_length=L)
    info = TargetInfo(MASK, frozenset({1}), L, "zero", True, V)
    return BlockCausalAdapter(model, info)


def full_logits(adapter: BlockCausalAdapter, ids: list[int]) -> torch.Tensor:
    """Reference: the whole sequence recomputed with the block-causal mask and no cache."""
    pos = torch.arange(len(ids))
    mask = block_causal_mask(pos, pos, L, torch.float32)
    with torch.no_grad():
        out = adapter.model(input_ids=torch.tensor([ids]), attention_mask=mask, position_ids=pos[None])
    return out.logits[0]


def random_state(gen: torch.Generator, n_masked: int) -> torch.Tensor:
    state = torch.randint(5, V, (L,), generator=gen)
    state[torch.randperm(L, generator=gen)[:n_masked]] = MASK
    return state


def test_cached_logits_equal_full_recomputation():
    adapter = make_adapter()
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(5, V, (2 * L + 3,), generator=gen).tolist()
    session, tail = adapter.open(prompt)
    assert tail == prompt[2 * L :] and session.block_start == 2 * L
    block = torch.cat([torch.tensor(tail), torch.full((L - 3,), MASK)])
    got = session.block_logits(block[None])[0]
    ref = full_logits(adapter, prompt[: 2 * L] + block.tolist())[2 * L :]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
    # After committing a block the next block still matches a full recomputation.
    finished = random_state(gen, 0)
    session.commit_block(finished)
    nxt = random_state(gen, 5)
    got2 = session.block_logits(nxt[None])[0]
    ref2 = full_logits(adapter, prompt[: 2 * L] + finished.tolist() + nxt.tolist())[3 * L :]
    torch.testing.assert_close(got2, ref2, rtol=0, atol=1e-4)
    # The prompt blocks and the finished block rode along with the two block forwards: 2 NFE in all.
    assert session.nfe.prefill == 0 and session.nfe.rounds == 2 and session.nfe.store == 0
    assert session.nfe.total == 2
    assert session.prefix_kv[0][0].shape[-2] == 3 * L  # both were stored


def test_replica_logits_equal_each_state_alone_and_cache_unchanged():
    adapter = make_adapter(seed=3)
    gen = torch.Generator().manual_seed(7)
    session, _ = adapter.open(torch.randint(5, V, (3 * L,), generator=gen).tolist())
    session.block_logits(random_state(gen, 8)[None])  # stores the prompt blocks
    before = [(k.clone(), v.clone()) for k, v in session.prefix_kv]
    states = torch.stack([random_state(gen, n) for n in (8, 5, 3, 1, 0)])
    batched = session.block_logits(states)
    assert batched.shape == (5, L, V)
    for r in range(states.shape[0]):
        alone = session.block_logits(states[r : r + 1])[0]
        # Bit for bit on the CPU (float32): each row's arithmetic does not depend on how many rows share it.
        assert torch.equal(batched[r], alone)
    after = session.prefix_kv
    assert len(after) == len(before)
    for (k0, v0), (k1, v1) in zip(before, after, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert session.block_start == 3 * L
    assert session.nfe.rounds == 2 + states.shape[0]


def test_replica_states_really_differ():
    """Guards the test above: distinct states must give distinct logits (the mask isolates replicas)."""
    adapter = make_adapter(seed=5)
    session, _ = adapter.open(list(range(5, 5 + L)))
    a = torch.full((L,), MASK)
    b = a.clone()
    b[0] = 9
    out = session.block_logits(torch.stack([a, b]))
    assert not torch.allclose(out[0, 1:], out[1, 1:])
    torch.testing.assert_close(out[0], session.block_logits(a[None])[0], rtol=0, atol=1e-4)


def test_pending_prompt_rides_with_replicas():
    """A first forward with several replicas stores the prompt blocks exactly once and still isolates replicas."""
    adapter = make_adapter(seed=2)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(5, V, (2 * L,), generator=gen).tolist()
    states = torch.stack([random_state(gen, n) for n in (8, 4, 2)])
    s1, _ = adapter.open(prompt)
    batched = s1.block_logits(states)
    for r in range(3):
        ref = full_logits(adapter, prompt + states[r].tolist())[2 * L :]
        torch.testing.assert_close(batched[r], ref, rtol=0, atol=1e-4)
    assert s1.prefix_kv[0][0].shape[-2] == 2 * L and s1.nfe.total == 1


def test_empty_prompt_opens_without_prefill():
    adapter = make_adapter()
    session, tail = adapter.open([])
    assert tail == [] and session.block_start == 0 and session.nfe.total == 0
    out = session.block_logits(torch.full((1, L), MASK))
    assert out.shape == (1, L, V) and torch.isfinite(out).all()


def test_one_pending_block_is_computed_once_and_every_replica_row_equals_its_state_alone():
    """A later block's first forward carries the finished block as a batch row of its own (not once per replica).
    Each replica's logits equal that state's alone in the same situation bit for bit (control and SPOT rows take
    the same arithmetic), match a cache-free recomputation, and the block is stored once: the next forward, from
    the cache, matches the recomputation too. Also where the one pending block is the prompt's."""
    adapter = make_adapter(seed=4)
    gen = torch.Generator().manual_seed(11)
    for prompt_len in (L + 3, 2 * L + 5):
        prompt = torch.randint(5, V, (prompt_len,), generator=gen).tolist()
        done = (prompt_len // L) * L
        finished = random_state(gen, 0)
        states = torch.stack([random_state(gen, n) for n in (7, 4, 2, 0)])

        def session_at_pending():
            s, _ = adapter.open(prompt)
            if done > L:  # several prompt blocks: they go first, then one finished block is pending
                s.block_logits(random_state(torch.Generator().manual_seed(0), 3)[None])
                s.commit_block(finished)
            return s

        s = session_at_pending()
        assert len(s._pending) == L
        batched = s.block_logits(states)
        context = prompt[:done] + (finished.tolist() if done > L else [])
        for r in range(states.shape[0]):
            alone = session_at_pending().block_logits(states[r : r + 1])[0]
            assert torch.equal(batched[r], alone)
            ref = full_logits(adapter, context + states[r].tolist())[len(context):]
            torch.testing.assert_close(batched[r], ref, rtol=0, atol=1e-4)
        assert s.prefix_kv[0][0].shape[-2] == len(context) and not s.has_pending
        nxt = random_state(gen, 5)
        ref = full_logits(adapter, context + nxt.tolist())[len(context):]
        torch.testing.assert_close(s.block_logits(nxt[None])[0], ref, rtol=0, atol=1e-4)
