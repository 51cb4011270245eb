"""The fused shared-prefix attention (cascade pieces through fused kernels) against attention written here from its
definition, in every layout a forward uses, and against the reference (matmul) path on every family that runs the
project's attention: the largest logit difference is printed and no transition may flip."""

from __future__ import annotations

import pytest
import torch

from lm_eval_spot.adapters.bidirectional import BidirectionalAdapter
from lm_eval_spot.adapters.block_causal import BlockCausalAdapter
from lm_eval_spot.adapters.cascade import math_lse, pick_kernel
from lm_eval_spot.adapters.prefix_attention import PrefixPass

from helpers.remote_fixtures import build_remote, needs_remote, save_checkpoint, tokenizer_mask_id

H, KVH, D = 4, 2, 8
SCALE = D**-0.5


def definition(q_row, keys, vals, mask):
    """One row: q [H, N, d] over keys/values [KVH, T, d] with an additive mask [N, T] -> [N, H, d] (float64)."""
    k = keys.double().repeat_interleave(H // KVH, dim=0)
    v = vals.double().repeat_interleave(H // KVH, dim=0)
    s = q_row.double() @ k.transpose(-1, -2) * SCALE + mask.double()
    return (torch.softmax(s, dim=-1) @ v).transpose(0, 1)


def rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def block_causal(n: int, L: int) -> torch.Tensor:
    b = torch.arange(n) // L
    return torch.where(b[:, None] >= b[None, :], 0.0, float("-inf"))


KERNELS = {"fused": lambda: pick_kernel(torch.device("cpu"), torch.float32, D)[0], "math": lambda: math_lse}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("layout", ["shared", "segments", "wide", "wide_ahead", "pending", "pending_ahead", "ahead"])
@pytest.mark.parametrize("P", [0, 37])
def test_every_layout_equals_the_definition(kernel, layout, P):
    gen = torch.Generator().manual_seed(P + len(layout))
    L, R = 4, 5
    pre = [(rand(gen, 1, KVH, P, D), rand(gen, 1, KVH, P, D))] if P else None
    pk, pv = (pre[0][0][0], pre[0][1][0]) if P else (torch.zeros(KVH, 0, D), torch.zeros(KVH, 0, D))
    wide = layout.startswith("wide")
    N = 3 * L if wide else L
    q, k, v = rand(gen, R, H, N, D), rand(gen, R, KVH, N, D), rand(gen, R, KVH, N, D)
    new_mask = block_causal(N, L) if wide else torch.zeros(N, N)
    if wide:
        new_mask[: N - L, N - L :] = float("-inf")  # the pending blocks do not read the state after them
        new_mask[N - L :, :] = 0.0
    kw = dict(kernel=KERNELS[kernel](), dense=not wide)
    a = 2  # the completion's row
    ahead = layout.endswith("ahead")
    if layout == "segments":
        pre2 = [(rand(gen, 1, KVH, 11, D), rand(gen, 1, KVH, 11, D))]
        pp = PrefixPass([(0, 2, pre), (2, R, pre2)], new_mask, **kw)
    elif wide:
        pp = PrefixPass([(0, R, pre)], new_mask, record=N - L, ahead=(a, L) if ahead else None, **kw)
    elif layout.startswith("pending"):
        pp = PrefixPass([(0, R, pre)], new_mask, pending_row=True, ahead=(a, L) if ahead else None, **kw)
    else:
        pp = PrefixPass([(0, R, pre)], new_mask, ahead=(a, L) if layout == "ahead" else None, **kw)
    out = pp.attend(0, q, k, v, SCALE)
    ref_pp = PrefixPass(pp.segments, new_mask, record=pp.record, ahead=pp.ahead, pending_row=pp.pending_row)
    ref_path = ref_pp.attend(0, q, k, v, SCALE)
    for r in range(R):
        keys, vals = [pk], [pv]
        cols = [torch.zeros(N, pk.shape[1])]
        if layout == "segments" and r >= 2:
            keys, vals, cols = [pre2[0][0][0]], [pre2[0][1][0]], [torch.zeros(N, 11)]
        if layout.startswith("pending") and r > 0:
            keys.append(k[0]), vals.append(v[0]), cols.append(torch.zeros(N, N))
        if (ahead or layout == "ahead") and r == R - 1:
            c = torch.zeros(N, L)
            c[: N - L] = float("-inf")  # only the next block's positions read the completion
            keys.append(k[a, :, -L:]), vals.append(v[a, :, -L:]), cols.append(c)
        keys.append(k[r]), vals.append(v[r]), cols.append(new_mask)
        want = definition(q[r], torch.cat(keys, 1), torch.cat(vals, 1), torch.cat(cols, 1))
        assert (out[r].double() - want).abs().max() < 2e-6, (layout, r)
        assert (ref_path[r].double() - want).abs().max() < 2e-6, (layout, r)
    if wide:
        assert torch.equal(pp.recorded[0][0], k[:1, :, : N - L])
    if layout.startswith("pending"):
        assert torch.equal(pp.recorded[0][0], k[:1])


def test_bfloat16_close_to_the_definition():
    gen = torch.Generator().manual_seed(3)
    R, L, P = 3, 8, 200
    kernel = pick_kernel(torch.device("cpu"), torch.bfloat16, D)[0]
    pre = [(rand(gen, 1, KVH, P, D, dtype=torch.bfloat16), rand(gen, 1, KVH, P, D, dtype=torch.bfloat16))]
    q, k, v = (rand(gen, R, n, L, D, dtype=torch.bfloat16) for n in (H, KVH, KVH))
    out = PrefixPass([(0, R, pre)], torch.zeros(L, L, dtype=torch.bfloat16), kernel=kernel, dense=True).attend(
        0, q, k, v, SCALE)
    for r in range(R):
        want = definition(q[r], torch.cat([pre[0][0][0], k[r]], 1), torch.cat([pre[0][1][0], v[r]], 1),
                          torch.zeros(L, P + L))
        assert (out[r].double() - want).abs().max() < 3e-2


# ---- on the models: fused against the reference path, every family that runs the project's attention -------------

def drive(adapter, prompt: list[int], blocks: int, seed: int, ahead: bool) -> list[torch.Tensor]:
    """A fixed sequence of rounds (the prompt's, a block's first with a pending block, later ones; lookahead rows
    where the session has them) -> the logits of every round."""
    gen = torch.Generator().manual_seed(seed)
    info = adapter.info
    L, V = info.block_len, info.vocab_size
    session, tail = adapter.open(prompt, blocks * L)
    out = []
    for b in range(blocks):
        for step in range(3):
            states = torch.randint(0, V, (4, L), generator=gen)
            states[torch.rand(4, L, generator=gen) < 0.6] = info.mask_id
            if b == 0 and tail:
                states[:, : len(tail)] = torch.tensor(tail)
            if ahead and step < 2:
                states[0, (states[0] == info.mask_id)] = 5  # a full completion for the lookahead row
                logits, nxt = session.block_logits_ahead(states, 0)
                out += [logits, nxt[None]]
            else:
                out.append(session.block_logits(states))
        session.commit_block(torch.randint(0, V, (L,), generator=gen))
    return out


def flips(a: torch.Tensor, b: torch.Tensor) -> int:
    """States whose transition (most confident slot, its argmax token) differs between two logit tensors."""
    def f(x):
        conf = torch.softmax(x.double(), -1).amax(-1)
        pos = conf.argmax(-1)
        return pos, x.gather(-1, pos[..., None, None].expand(*pos.shape, 1, x.shape[-1])).squeeze(-2).argmax(-1)
    (pa, ta), (pb, tb) = f(a), f(b)
    return int(((pa != pb) | (ta != tb)).sum())


def compare(fused, reference, prompt, blocks, ahead):
    worst, n_flips = 0.0, 0
    for x, y in zip(drive(fused, prompt, blocks, 0, ahead), drive(reference, prompt, blocks, 0, ahead), strict=True):
        worst = max(worst, float((x - y).abs().max()))
        n_flips += flips(x, y)
    return worst, n_flips


def test_embedded_target_fused_equals_reference():
    from lm_eval_spot.settings.args import parse_args
    from lm_eval_spot.families import load_target

    ad = load_target(parse_args({"mode": "control"})).adapter
    ref = BlockCausalAdapter(ad.model, ad.info, attention="reference")
    prompt = list(range(10, 10 + 2 * ad.info.block_len + 5))
    worst, n = compare(ad, ref, prompt, 3, ahead=True)
    print(f"embedded target: largest logit difference {worst:.2e}, transition flips {n}")
    assert n == 0 and worst < 1e-3


def test_tiny_block_causal_fused_equals_reference():
    from lm_eval_spot.adapters.base import TargetInfo

    from helpers.tiny import build_model

    model = build_model(vocab_size=80, block_length=4, layers=2)
    info = TargetInfo(mask_id=2, stop_ids=frozenset({1}), block_len=4, grid_origin="zero", exact_prefix_cache=True,
                      vocab_size=80)
    worst, n = compare(BlockCausalAdapter(model, info), BlockCausalAdapter(model, info, attention="reference"),
                       list(range(10, 21)), 4, ahead=True)
    print(f"tiny Qwen3 (block 4): largest logit difference {worst:.2e}, transition flips {n}")
    assert n == 0 and worst < 1e-3


@needs_remote
@pytest.mark.parametrize("fam", ["llada", "dream", "sdar"])
def test_fixture_families_fused_equal_reference(fam, tmp_path):
    from lm_eval_spot.settings.args import parse_args
    from lm_eval_spot.families import load_target

    mask = tokenizer_mask_id()
    model = build_remote(fam, seed=0, scale=4.0, mask_token_id=mask)
    raw = {"pretrained": str(save_checkpoint(model, tmp_path)), "impl": "native", "mode": "control", "block_len": 4,
           "trust_remote_code": "true"}
    if fam != "sdar":
        raw["cache"] = "approx"
    ad = load_target(parse_args(raw)).adapter
    if fam == "sdar":
        ref = BlockCausalAdapter(ad.model, ad.info, attention="reference")
    else:
        ref = BidirectionalAdapter(ad.model, ad.info, ad.protocol, cache="approx", attention="reference")
    worst, n = compare(ad, ref, list(range(10, 23)), 3, ahead=fam == "sdar")
    print(f"{fam} native: largest logit difference {worst:.2e}, transition flips {n}")
    assert n == 0 and worst < 1e-3


@pytest.mark.parametrize("attention", ["fused", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_state_scored_in_a_blocks_first_round_equals_it_scored_later(attention, dtype):
    """SPOT scores drafted states in a block's first round (the finished block riding along as a pending row);
    control scores the same states in later rounds (the block stored). Exactness needs the two bit for bit."""
    from lm_eval_spot.adapters.base import TargetInfo

    from helpers.tiny import build_model

    model = build_model(300, block_length=4, hidden=64).to(dtype)
    ad = BlockCausalAdapter(model, TargetInfo(2, frozenset({1}), 4, "zero", True, 300), attention=attention)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 300, (10,), generator=gen).tolist()
    done = torch.randint(5, 300, (4,), generator=gen)
    states = torch.full((5, 4), 2)
    states[1:, 0] = torch.randint(5, 300, (4,), generator=gen)
    states[2:, 1] = torch.randint(5, 300, (3,), generator=gen)
    for with_ahead in (False, True):
        first, tail = ad.open(prompt, 16)
        later, _ = ad.open(prompt, 16)
        for s in (first, later):
            root = torch.full((1, 4), 2)
            root[0, : len(tail)] = torch.tensor(tail)
            s.block_logits(root)
            s.commit_block(done)
        ahead_states = states.clone()
        ahead_states[4] = 7
        got = first.block_logits_ahead(ahead_states, 4)[0][:4] if with_ahead else first.block_logits(states)
        later.block_logits(states[:1])  # the block's first round with the root alone: the block is now stored
        want = later.block_logits(states[1:])
        assert torch.equal(got[1:4], want[:3]), (attention, dtype, with_ahead, float((got[1:4] - want[:3]).abs().max()))
