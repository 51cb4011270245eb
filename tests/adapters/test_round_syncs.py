"""Host-device crossings per round, counted on an emulated device (`device_emulation`): every upload and every
read of a device value (explicit copies, `int(t)`, indexing with host tensors, ...) counts. A control round may
cross twice (its inputs up, its transitions down), a SPOT round three times (plus the stale summary down), on
every adapter; the drafter runs on the host. Crossings inside a family's official remote code are its own (SDAR's
forward tests `torch.all(mask)` in every layer): they are counted apart and reported, not bounded."""

from __future__ import annotations

import pytest
import torch

from lm_eval_spot.adapters.base import RowsCall, TargetInfo
from lm_eval_spot.adapters.block_causal import BlockCausalAdapter
from lm_eval_spot.settings.args import parse_args
from lm_eval_spot.decoding.loop import DecodeConfig, RequestDecoder
from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
from lm_eval_spot.drafter.spot_proposer import LearnedOrder, TreeConfig, TreeProposer
from lm_eval_spot.families import load_target

from helpers.device_emulation import DeviceEmulation, place
from helpers.remote_fixtures import build_remote, needs_remote, save_checkpoint, tokenizer_mask_id
from helpers.tiny import build_model

BOUND = {"control": 2, "spot": 3}


def per_round(adapter, prompt, T: float, spot: bool, lookahead: bool = True, gen: int = 24, official: list | None = None
              ) -> list[tuple[int, int]]:
    """(uploads, downloads) of every round of one decode; `official` collects the official code's own per round."""
    place(adapter.model)
    torch.manual_seed(0)
    proposer = TreeProposer(LearnedOrder(FactoredOrderModel(FactoredConfig())), TreeConfig(budget=8)) if spot else None
    counts = []
    with DeviceEmulation(keep_stacks=True) as emu:
        req = RequestDecoder(adapter, prompt, DecodeConfig(max_gen_toks=gen, temperature=T, lookahead=lookahead), 3,
                            proposer=proposer)
        emu.reset()
        while (states := req.next_states()) is not None:
            req.advance(*adapter.forward_many([RowsCall(req.session, states, req.ahead_row)])[0])
            counts.append(emu.reset())
            if official is not None:
                official.append(emu.official_crossings)
            emu.official_crossings = 0
    assert req.result is not None and req.rounds == len(counts)
    if max(u + d for u, d in counts) > BOUND["spot" if spot else "control"]:
        print(emu.where.most_common(10))
    return counts


def check(counts: list[tuple[int, int]], spot: bool) -> None:
    worst = max(u + d for u, d in counts)
    assert worst <= BOUND["spot" if spot else "control"], counts
    assert all(u == 1 for u, _ in counts), "inputs go up in one copy per round"


@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("spot", [False, True])
def test_native_block_causal_rounds(T, spot):
    ad = load_target(parse_args({"mode": "control"})).adapter  # the embedded target
    counts = per_round(ad, list(range(10, 40)), T, spot, gen=48)
    check(counts, spot)
    print(f"embedded, {'spot' if spot else 'control'} T={T}: {len(counts)} rounds, at most "
          f"{max(u + d for u, d in counts)} crossings per round")


def test_tiny_block_causal_with_ahead_rows_and_block_4():
    model = build_model(40, block_length=4)
    ad = BlockCausalAdapter(model, TargetInfo(2, frozenset({1}), 4, "zero", True, 40))
    check(per_round(ad, list(range(5, 16)), 1.0, True), True)


def test_the_emulation_sees_a_hidden_read():
    """The counter is not blind: a device value read with int() inside the round is a crossing."""
    model = build_model(40, block_length=4)
    ad = BlockCausalAdapter(model, TargetInfo(2, frozenset({1}), 4, "zero", True, 40))
    place(ad.model)
    with DeviceEmulation() as emu:
        session, _ = ad.open([5, 6, 7], 8)
        logits = session.block_logits(torch.full((1, 4), 2))
        emu.reset()
        int(logits[0, 0].argmax())
        torch.zeros(3)[torch.tensor([0, 1])] = logits[0, 0, :2]
        logits[0, torch.tensor([1, 2])].sum()
    assert (emu.uploads, emu.downloads) == (1, 2)


@needs_remote
@pytest.mark.parametrize("spot", [False, True])
@pytest.mark.parametrize("fam,impl,cache", [("sdar", "remote", "none"), ("llada2_moe", "remote", "none"), ("llada", "native", "none"),
                                            ("llada", "native", "approx"), ("llada", "remote", "none"),
                                            ("dream", "native", "approx"), ("dream", "remote", "none")])
def test_fixture_family_rounds(fam, impl, cache, spot, tmp_path):
    mask = tokenizer_mask_id()
    extra = {} if fam == "llada2_moe" else {"scale": 4.0, "mask_token_id": mask}
    model = build_remote(fam, seed=0, **extra)
    raw = {"pretrained": str(save_checkpoint(model, tmp_path)), "impl": impl, "mode": "control", "block_len": 4,
           "trust_remote_code": "true", "cache": cache}
    ad = load_target(parse_args(raw)).adapter
    official: list[int] = []
    counts = per_round(ad, list(range(10, 23)), 1.0, spot, gen=12, official=official)
    check(counts, spot)
    print(f"{fam} {impl} cache={cache} {'spot' if spot else 'control'}: at most "
          f"{max(u + d for u, d in counts)} crossings per round, plus {max(official)} in the official code")


def test_round_time_parts_add_up_to_the_rounds():
    """Drafting, forward (between device marks) and the rest split each round's wall time: they are positive and
    their sum is within the request's wall time."""
    from lm_eval_spot.decoding.loop import decode

    ad = load_target(parse_args({"mode": "control"})).adapter
    torch.manual_seed(0)
    spot = TreeProposer(LearnedOrder(FactoredOrderModel(FactoredConfig())), TreeConfig(budget=8))
    res = decode(ad, list(range(10, 40)), DecodeConfig(max_gen_toks=32, lookahead=True), 0, proposer=spot)
    t = res.timing
    assert t.forward > 0 and t.draft > 0 and t.rest >= 0
    assert t.forward + t.draft + t.rest <= res.wall_s


def test_rejection_verifier_rounds():
    """verify=rejection (chains, T > 0) draws its chain's tokens from q on the host's uniforms: two more copies
    (uniforms up, tokens down) and the verifier's own pair, so at most 6 a round."""
    ad = load_target(parse_args({"mode": "control"})).adapter
    place(ad.model)
    torch.manual_seed(0)
    chain = TreeProposer(LearnedOrder(FactoredOrderModel(FactoredConfig())), TreeConfig(budget=8, chain=True))
    counts = []
    with DeviceEmulation() as emu:
        req = RequestDecoder(ad, list(range(10, 40)), DecodeConfig(max_gen_toks=32, temperature=1.0), 3,
                            proposer=chain, verify="rejection")
        emu.reset()
        while (states := req.next_states()) is not None:
            req.advance(*ad.forward_many([RowsCall(req.session, states, req.ahead_row)])[0])
            counts.append(sum(emu.reset()))
    assert max(counts) <= 6, counts
