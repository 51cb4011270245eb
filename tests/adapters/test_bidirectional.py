"""The fully bidirectional families (LLaDA-8B, Dream-7B) on tiny random-weight models built from their OFFICIAL
remote code in ../shared: exact mode (whole canvas every forward) on the native and remote paths, and the
approximate prefix cache (`cache=approx`, native). References call the official forward / generation directly.

Fixture tweaks, both to make a random model behave like a trained one where it matters: the output head is
scaled x4 (peaked, well-separated confidences), and LLaDA's mask-token INPUT embedding is zeroed (with it, a
canvas that is mostly masks makes every position predict the same token, which would make commit order
invisible in the outputs)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lm_eval_spot.settings.args import SpotArgError, default_drafter_path, parse_args
from lm_eval_spot.decoding.batch import DecodeRequest, decode_many
from lm_eval_spot.decoding.loop import DecodeConfig, decode
from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
from lm_eval_spot.drafter.model import load_drafter
from lm_eval_spot.drafter.spot_proposer import LearnedOrder, TreeConfig, TreeProposer
from lm_eval_spot.families import load_target

from helpers.remote_fixtures import SHARED, needs_remote, save_checkpoint, tokenizer_mask_id
from helpers.targets import build

pytestmark = needs_remote

MODES = [("native", "none"), ("remote", "none"), ("native", "approx")]
FAMS = ["llada", "dream"]


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    mask = tokenizer_mask_id()
    return {fam: (build(fam, mask), save_checkpoint(build(fam, mask), tmp_path_factory.mktemp(fam)))
            for fam in FAMS}


@pytest.fixture(scope="module")
def loaded(official):
    cache = {}

    def get(fam: str, impl: str, mode: str = "none", L: int = 4):
        key = (fam, impl, mode, L)
        if key not in cache:
            raw = {"pretrained": str(official[fam][1]), "impl": impl, "cache": mode, "mode": "control",
                   "block_len": L, "trust_remote_code": "true"}
            cache[key] = load_target(parse_args(raw))
        return cache[key]
    return get


def official_aligned(model, fam: str, canvas: torch.Tensor) -> torch.Tensor:
    """Position-aligned logits [B, N, V] of whole canvases, from the official forward as its generation calls it."""
    with torch.no_grad():
        if fam == "llada":
            return model(canvas).logits.float()
        raw = model(canvas, "full", None).logits.float()
    return torch.cat([raw[:, :1], raw[:, :-1]], dim=1)  # Dream: the prediction for i is raw output i - 1


@pytest.mark.parametrize("fam", FAMS)
@pytest.mark.parametrize("impl", ["native", "remote"])
def test_exact_block_logits_equal_the_official_whole_canvas(official, loaded, fam, impl):
    model, _ = official[fam]
    ad = loaded(fam, impl).adapter
    L, mask = 4, ad.info.mask_id
    gen = torch.Generator().manual_seed(1)
    for prompt in (torch.randint(5, 290, (6,), generator=gen).tolist(), [77]):
        session, tail = ad.open(prompt, 3 * L - 1)  # rounded up to 3 whole blocks
        assert tail == [] and session.block_start == len(prompt)
        done: list[int] = []
        for block in range(3):
            st = torch.randint(5, 290, (3, L), generator=gen)
            st[torch.rand(3, L, generator=gen) < 0.6] = mask
            st[0] = mask
            got = session.block_logits(st)
            canvas = torch.cat([torch.tensor(prompt + done).expand(3, -1), st,
                                torch.full((3, (2 - block) * L), mask)], 1)
            assert canvas.shape[1] == len(prompt) + 3 * L
            ref = official_aligned(model, fam, canvas)[:, len(prompt) + block * L:len(prompt) + (block + 1) * L]
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
            for r in range(3):  # each replica equals its canvas alone
                torch.testing.assert_close(session.block_logits(st[r:r + 1])[0], got[r], rtol=0, atol=1e-5)
            torch.testing.assert_close(session.block_logits(st), got, rtol=0, atol=0)  # pure
            fill = st[1].clone()
            fill[fill == mask] = 9
            session.commit_block(fill)
            done += fill.tolist()
        assert session.nfe.rounds == 3 * 5 and session.nfe.store == 0


@pytest.mark.parametrize("fam", FAMS)
def test_the_official_forward_sees_the_canvas_and_nothing_else(loaded, fam):
    """What reaches the remote model: the whole canvas (prompt, finished blocks, each replica's state, trailing
    masks) as input ids, and for Dream attention_mask="full" with no position ids (as its generation calls it)."""
    ad = loaded(fam, "remote").adapter
    seen = []
    hook = ad.model.register_forward_pre_hook(lambda m, a, kw: seen.append((a, kw)), with_kwargs=True)
    try:
        session, _ = ad.open([20, 21, 22], 8)
        session.commit_block(torch.tensor([30, 31, 32, 33]))
        st = torch.tensor([[1, 1, 40, 1], [41, 1, 1, 1]])
        session.block_logits(st)
    finally:
        hook.remove()
    (args, kwargs), = seen
    ids = args[0]
    assert ids.tolist() == [[20, 21, 22, 30, 31, 32, 33, 1, 1, 40, 1], [20, 21, 22, 30, 31, 32, 33, 41, 1, 1, 1]]
    if fam == "dream":
        assert kwargs == {"attention_mask": "full"}
    else:
        assert kwargs == {}


def random_drafter(seed: int) -> FactoredOrderModel:
    torch.manual_seed(seed)
    return FactoredOrderModel(FactoredConfig())


@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("impl,mode", MODES)
@pytest.mark.parametrize("fam", FAMS)
@pytest.mark.parametrize("drafter", ["random", "shipped"])
def test_spot_equals_control(loaded, fam, impl, mode, T, drafter):
    L = 32 if drafter == "shipped" else 4  # the shipped drafter was trained for block length 32
    ad = loaded(fam, impl, mode, L).adapter
    model = load_drafter(default_drafter_path(), 32)[0] if drafter == "shipped" else random_drafter(3)
    cfg = DecodeConfig(max_gen_toks=L + 6, temperature=T)  # two blocks
    for prompt in ([30, 31, 32], list(range(40, 49))):
        control = decode(ad, prompt, cfg, seed=8)
        spot = decode(ad, prompt, cfg, seed=8, proposer=TreeProposer(LearnedOrder(model), TreeConfig(budget=6)))
        assert spot.token_ids == control.token_ids
        assert spot.nfe.total <= control.nfe.total


@pytest.mark.parametrize("impl,mode", MODES)
@pytest.mark.parametrize("fam", FAMS)
@pytest.mark.parametrize("method", ["control", "spot"])
@pytest.mark.parametrize("T", [0.0, 1.0])
def test_batched_requests_equal_one_at_a_time(loaded, fam, impl, mode, T, method):
    """Control and SPOT at batch size 3: each request's ids and forwards are its own."""
    ad = loaded(fam, impl, mode).adapter
    prompts = [[50, 51], list(range(60, 67)), [70, 71, 72, 73]]
    cfg = DecodeConfig(max_gen_toks=9, temperature=T, lookahead=True)
    prop = TreeProposer(LearnedOrder(random_drafter(5)), TreeConfig(budget=4)) if method == "spot" else None
    alone = [decode(ad, p, cfg, seed=i, proposer=prop) for i, p in enumerate(prompts)]
    jobs = [DecodeRequest(p, cfg, seed=i, proposer=prop) for i, p in enumerate(prompts)]
    together = decode_many(ad, jobs, batch_size=3)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.nfe.total for r in together] == [r.nfe.total for r in alone]


def mask_logit_never_wins(model, mask: int):
    """The decoder never commits the mask token (its logit is -inf for the confidence and the argmax); the
    official loops do not exclude it, so for the comparison the model's own mask logit is made -inf, as a
    trained model's effectively is."""
    return model.register_forward_hook(lambda m, a, out: out.logits.__setitem__((Ellipsis, mask), float("-inf")))


@pytest.mark.parametrize("L,n", [(4, 12), (8, 16)])
def test_control_equals_llada_official_generate(official, loaded, L, n):
    """LLaDA's generate.py at T=0, steps = gen_length (one commit per step), remasking='low_confidence',
    block_length = our block length: token for token over our generated prefix."""
    spec = importlib.util.spec_from_file_location("llada_generate", SHARED / "llada" / "generate.py")
    gen_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_mod)
    model, _ = official["llada"]
    ad = loaded("llada", "remote", "none", L).adapter
    mask = ad.info.mask_id
    hook = mask_logit_never_wins(model, mask)
    hook2 = mask_logit_never_wins(ad.model, mask)
    try:
        for prompt in ([11, 12, 13], list(range(100, 109)), [250, 5, 77, 200]):
            x = gen_mod.generate(model, torch.tensor([prompt]), steps=n, gen_length=n, block_length=L,
                                 temperature=0.0, remasking="low_confidence", mask_id=mask)
            off = x[0, len(prompt):].tolist()
            ours = decode(ad, prompt, DecodeConfig(max_gen_toks=n, temperature=0.0), seed=0)
            assert len(set(off)) > 2  # the outputs depend on the order of commits
            assert ours.token_ids == off[: len(ours.token_ids)]
            if ours.stop_reason != "length":
                assert off[len(ours.token_ids)] in ad.info.stop_ids
    finally:
        hook.remove()
        hook2.remove()


@pytest.mark.parametrize("n", [12, 16])
def test_control_equals_dream_official_diffusion_generate(official, loaded, n):
    """Dream's diffusion_generate at T=0, alg='maskgit_plus', steps = gen_length, our block = the whole canvas:
    token for token. Two arguments make its schedule one commit per step: eps=-1e-6 (with the default 1e-3,
    int(n_masked * (1 - s/t)) rounds to 0 at every step but the last, which then commits everything), and
    top_k=None (its generation config otherwise inherits transformers' top_k=50, which renormalises the
    confidences over 50 tokens)."""
    model, _ = official["dream"]
    ad = loaded("dream", "remote", "none", n).adapter
    mask = ad.info.mask_id
    hook = mask_logit_never_wins(model, mask)
    try:
        for prompt in ([11, 12, 13], list(range(100, 109)), [250, 5, 77, 200]):
            out = model.diffusion_generate(torch.tensor([prompt]), max_new_tokens=n, steps=n, alg="maskgit_plus",
                                           temperature=0.0, top_k=None, top_p=None, eps=-1e-6, mask_token_id=mask)
            off = out[0, len(prompt):].tolist()
            ours = decode(ad, prompt, DecodeConfig(max_gen_toks=n, temperature=0.0), seed=0)
            assert len(set(off)) > 2
            assert ours.token_ids == off[: len(ours.token_ids)]
    finally:
        hook.remove()


@pytest.mark.parametrize("fam", FAMS)
def test_native_and_remote_logits_agree(loaded, fam, capsys):
    native, remote = loaded(fam, "native").adapter, loaded(fam, "remote").adapter
    gen = torch.Generator().manual_seed(5)
    worst = 0.0
    for prompt in ([9, 10, 11, 12, 13], [200]):
        sn, _ = native.open(prompt, 12)
        sr, _ = remote.open(prompt, 12)
        for _ in range(3):
            st = torch.randint(5, 290, (3, 4), generator=gen)
            st[torch.rand(3, 4, generator=gen) < 0.5] = native.info.mask_id
            worst = max(worst, (sn.block_logits(st) - sr.block_logits(st)).abs().max().item())
            sn.commit_block(st[0].clamp(min=5))
            sr.commit_block(st[0].clamp(min=5))
    with capsys.disabled():
        print(f"\n{fam} native vs remote (fp32, tiny random weights): largest logit difference {worst:.3g}")
    assert worst < 1e-4


@pytest.mark.parametrize("fam", FAMS)
def test_approx_cache_is_a_pure_function_within_a_block(loaded, fam):
    exact, approx = loaded(fam, "native").adapter, loaded(fam, "native", "approx").adapter
    assert approx.info.exact_prefix_cache is False and exact.info.exact_prefix_cache is True
    mask = approx.info.mask_id
    prompt = [9, 10, 11, 12, 13]
    se, _ = exact.open(prompt, 12)
    sa, _ = approx.open(prompt, 12)
    masks = torch.full((1, 4), mask)
    st = torch.tensor([[mask, 40, mask, mask], [41, 42, mask, mask]])
    first = sa.block_logits(masks)  # the block's first forward: the whole canvas, which also fills the cache
    assert (sa.nfe.rounds, sa.nfe.store) == (1, 0)
    torch.testing.assert_close(first, se.block_logits(masks), rtol=0, atol=1e-5)  # the all-mask state is exact
    a1 = sa.block_logits(st)
    torch.testing.assert_close(sa.block_logits(st), a1, rtol=0, atol=0)
    torch.testing.assert_close(sa.block_logits(st[1:]), a1[1:], rtol=0, atol=1e-5)
    torch.testing.assert_close(sa.block_logits(torch.cat([masks, st])), torch.cat([first, a1]), rtol=0, atol=1e-5)
    assert (a1 - se.block_logits(st)).abs().max().item() > 1e-4  # approximate: not the full recomputation
    # After a commit the next block builds its own cache; a first call on a non-mask state pays a store forward.
    sa.commit_block(torch.tensor([50, 51, 52, 53]))
    before = (sa.nfe.rounds, sa.nfe.store)
    sa.block_logits(st)
    assert (sa.nfe.rounds, sa.nfe.store) == (before[0] + 1, before[1] + 1)


def test_cache_approx_is_refused_where_it_has_no_meaning(official, tmp_path):
    with pytest.raises(SpotArgError, match="cache=approx needs impl=native"):
        load_target(parse_args({"pretrained": str(official["llada"][1]), "impl": "remote", "cache": "approx",
                                "trust_remote_code": True}))
    with pytest.raises(SpotArgError, match="cache=approx is for fully bidirectional families"):
        load_target(parse_args({"cache": "approx"}))  # the embedded block-causal target
    with pytest.raises(SpotArgError, match="cache='fast' is not known; accepted: none, approx"):
        parse_args({"cache": "fast"})
