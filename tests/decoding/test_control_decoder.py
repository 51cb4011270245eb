"""The draft-free (control) decoder: exact definition, stops, determinism and the T>0 sampler's law."""

from __future__ import annotations

import pytest
import torch

from lm_eval_spot.adapters.base import TargetInfo
from lm_eval_spot.adapters.block_causal import BlockCausalAdapter
from lm_eval_spot.decoding.loop import DecodeConfig, decode
from lm_eval_spot.decoding.tree import DraftTree
from lm_eval_spot.harness.until import make_stop_check

from helpers.fakes import ScriptedAdapter
from helpers.reference import reference_decode
from helpers.tiny import build_model
from helpers.stats import chi_square_p

V, MASK, EOS = 40, 2, 1


def tiny_adapter(L: int = 8, seed: int = 0) -> BlockCausalAdapter:
    return BlockCausalAdapter(build_model(V, seed=seed, block_length=L),
                              TargetInfo(MASK, frozenset({EOS}), L, "zero", True, V))


@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("prompt_len,L", [(5, 8), (16, 8), (0, 8), (11, 4)])
def test_control_equals_naive_full_recompute(prompt_len, L, T):
    adapter = tiny_adapter(L, seed=prompt_len)
    prompt = torch.randint(5, V, (prompt_len,), generator=torch.Generator().manual_seed(3)).tolist()
    res = decode(adapter, prompt, DecodeConfig(max_gen_toks=21, temperature=T), seed=11)
    assert res.token_ids == reference_decode(adapter.model, prompt, L, MASK, {EOS}, 21, T, seed=11)[0]
    assert res.committed == res.rounds  # one commit per forward
    assert res.nfe.rounds == res.rounds


def test_same_seed_same_output_and_seed_matters():
    adapter = tiny_adapter()
    prompt = list(range(5, 14))
    cfg = DecodeConfig(max_gen_toks=24, temperature=1.0)
    a = decode(adapter, prompt, cfg, seed=5).token_ids
    assert a == decode(adapter, prompt, cfg, seed=5).token_ids
    assert any(decode(adapter, prompt, cfg, seed=s).token_ids != a for s in range(6, 10))


def test_commit_order_is_by_confidence_not_left_to_right():
    script = {p: 10 + p % 20 for p in range(64)}
    adapter = ScriptedAdapter(script, vocab=V, block_len=8)
    order: list[int] = []

    class Obs:
        def on_commit(self, block, state, eligible, stale, pos, tok):
            order.append(pos)

    res = decode(adapter, [5, 6, 7], DecodeConfig(max_gen_toks=13), seed=0, observer=Obs())
    assert res.token_ids == [script[p] for p in range(3, 16)]
    margins = adapter._margin
    first_block = [p for p in order[:5]]
    expected = sorted(range(3, 8), key=lambda s: (-float(torch.softmax(adapter.logits_at(0, 8)[s], -1).max()), s))
    assert first_block == expected
    assert first_block != sorted(first_block)
    assert res.stop_reason == "length" and len(res.token_ids) == 13
    assert res.nfe.prefill == 0 and res.nfe.rounds == 13 and res.nfe.store == 1  # 2nd block ends at the limit


def test_eos_stops_and_is_cut():
    script = {p: 10 + p for p in range(64)}
    script[12] = EOS
    adapter = ScriptedAdapter(script, vocab=V, block_len=8)
    res = decode(adapter, [5, 6, 7], DecodeConfig(max_gen_toks=50), seed=0)
    assert res.token_ids == [10 + p for p in range(3, 12)]
    assert res.stop_reason == "eos"


def test_until_string_spanning_two_blocks():
    # Tokens are characters 'a'.. ; the stop string "hi" straddles the block boundary at absolute position 8.
    chars = {i: chr(ord("a") + i - 10) for i in range(10, 36)}
    script = {p: 10 + p for p in range(26)}
    adapter = ScriptedAdapter(script, vocab=V, block_len=8)

    def detok(ids):
        return "".join(chars.get(i, "?") for i in ids)

    res = decode(adapter, [5, 6, 7], DecodeConfig(max_gen_toks=50), seed=0,
                 stop_check=make_stop_check(detok, ["hi"]))
    text = detok(res.token_ids)
    assert res.stop_reason == "until"
    assert text == "defghi"  # ids kept up to the token completing the stop string
    assert res.nfe.store == 1  # the string was only seen after the second block began


class WholeBlockDrafter:
    """Drafts every eligible slot but one, in the scripted target's own commit order (descending margin, lowest
    slot on ties), so one round commits the whole block: the committed prefix jumps past everything at once."""

    def __init__(self, adapter: ScriptedAdapter) -> None:
        self.adapter = adapter

    def propose(self, ctx):
        start = self.adapter.info.block_len * ctx.block  # the prompt below fills no whole block
        slots = [int(s) for s in ctx.eligible.nonzero().flatten()]
        order = sorted(slots, key=lambda s: (-float(self.adapter._margin[start + s]), s))[:-1]
        toks = [self.adapter.script.get(start + s, 2) for s in order]
        return DraftTree(tuple(range(len(order))), tuple(order), tuple(toks))


@pytest.mark.parametrize("drafted", [False, True])
def test_the_first_stop_in_the_stream_wins_however_far_a_round_moves(drafted):
    # A stop string completing at position 9 and a stop id at 12, both in the second block. A round that commits
    # the whole block passes both at once; control (one commit a round) may see them in either round. Both must
    # report what the stream says first: the string, with ids kept up to the token completing it.
    chars = {i: chr(ord("a") + i - 10) for i in range(10, 36)}
    script = {p: 10 + p for p in range(26)}
    script[12] = EOS
    adapter = ScriptedAdapter(script, vocab=V, block_len=8)

    def detok(ids):
        return "".join(chars.get(i, "?") for i in ids)

    res = decode(adapter, [5, 6, 7], DecodeConfig(max_gen_toks=50), seed=0,
                 stop_check=make_stop_check(detok, ["ij"]), proposer=WholeBlockDrafter(adapter) if drafted else None)
    if drafted:
        assert res.rounds == 2  # each block in one round: the prefix jumped from 8 to 16 past both stops
    assert res.stop_reason == "until"
    assert detok(res.token_ids) == "defghij"


def test_empty_prompt_decodes_from_empty_prefix():
    adapter = tiny_adapter()
    res = decode(adapter, [], DecodeConfig(max_gen_toks=10), seed=0)
    assert res.nfe.prefill == 0
    assert 0 < len(res.token_ids) <= 10 or res.stop_reason == "eos"


def test_bad_config_rejected():
    with pytest.raises(ValueError, match="max_gen_toks"):
        DecodeConfig(max_gen_toks=0)
    with pytest.raises(ValueError, match="temperature"):
        DecodeConfig(max_gen_toks=3, temperature=-1)


# ---- the law of the T > 0 sampler -----------------------------------------------------------------------


def sample_counts(T: float, n_seeds: int, rows: torch.Tensor, L: int = 4):
    adapter = ScriptedAdapter(None, vocab=rows.shape[1], block_len=L, rows=rows, stop_ids=frozenset())
    counts = torch.zeros(L, rows.shape[1])
    for s in range(n_seeds):
        ids = decode(adapter, [], DecodeConfig(max_gen_toks=L, temperature=T), seed=s).token_ids
        counts[torch.arange(L), torch.tensor(ids)] += 1
    return counts


def test_gumbel_sampler_follows_softmax_over_T():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 12, generator=gen) * 1.5
    rows[:, 0] = -30.0  # never sample the mask id
    T = 1.5
    counts = sample_counts(T, 2000, rows)
    for i in range(4):
        p_true = chi_square_p(counts[i], torch.softmax(rows[i] / T, -1))
        assert p_true > 1e-4, f"slot {i}: sampler disagrees with softmax(l/T) (p={p_true:.2e})"
    # The same test must reject a sampler whose law ignores T (softmax(l)), else it proves nothing.
    p_wrong = min(chi_square_p(counts[i], torch.softmax(rows[i], -1)) for i in range(4))
    assert p_wrong < 1e-6
