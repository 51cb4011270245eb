"""Batching on every family: at batch size 4 and 8 each request's ids and NFE equal its decode alone (control and
SPOT, T = 0 and 1), and every step runs the forwards the adapter's batching promises, counted twice: by the
adapter's own tally and by a hook on the model's final norm (which runs once per model forward).

- LLaDA / Dream native (exact and cache=approx): ONE forward per step for every live request whatever its canvas
  length (approx: one for the blocks' cache builds, one for the cached rows);
- LLaDA / Dream remote: one per canvas length among the live requests (the official forward cannot hide padding);
- SDAR / LLaDA2.0-mini remote: one per forward shape (cached length, pending blocks).
Tiny random-weight models built from the official code in ../shared (fixture tweaks as in test_bidirectional)."""

from __future__ import annotations

import pytest
import torch

from lm_eval_spot.settings.args import parse_args
from lm_eval_spot.decoding.batch import DecodeRequest, StepTally, decode_many
from lm_eval_spot.decoding.loop import DecodeConfig, decode
from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
from lm_eval_spot.drafter.spot_proposer import LearnedOrder, TreeConfig, TreeProposer
from lm_eval_spot.families import load_target

from helpers.remote_fixtures import build_remote, needs_remote, save_checkpoint, tokenizer_mask_id
from helpers.targets import build as build_bidirectional

pytestmark = needs_remote

CONFIGS = [("llada", "native", "none"), ("llada", "native", "approx"), ("llada", "remote", "none"),
           ("dream", "native", "none"), ("dream", "native", "approx"), ("dream", "remote", "none"),
           ("sdar", "remote", "none"), ("llada2_moe", "remote", "none")]


def build(fam: str, mask: int):
    """test_bidirectional's fixtures for LLaDA and Dream; plain random models for the block-causal families."""
    if fam in ("llada", "dream"):
        return build_bidirectional(fam, mask)
    return build_remote(fam, seed=1) if fam == "llada2_moe" else build_remote(fam, seed=0, scale=4.0, mask_token_id=mask)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    mask = tokenizer_mask_id()
    return {fam: save_checkpoint(build(fam, mask), tmp_path_factory.mktemp(fam))
            for fam in ("llada", "dream", "sdar", "llada2_moe")}


@pytest.fixture(scope="module")
def loaded(checkpoints):
    cache = {}

    def get(fam: str, impl: str, mode: str):
        if (fam, impl, mode) not in cache:
            raw = {"pretrained": str(checkpoints[fam]), "impl": impl, "cache": mode, "mode": "control",
                   "block_len": 4, "trust_remote_code": "true"}
            cache[fam, impl, mode] = load_target(parse_args(raw)).adapter
        return cache[fam, impl, mode]
    return get


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    inner = model.model
    return inner.transformer.ln_f if hasattr(inner, "transformer") else inner.norm


def expected_forwards(adapter, calls) -> int:
    """What the family's batching promises for one step's calls, from the requests' own state."""
    name = type(adapter).__name__
    if name == "BidirectionalAdapter" and adapter.cache == "approx":
        mask = adapter.info.mask_id
        builds = any(c.session.kv is None for c in calls)
        cached = any(bool((c.states != mask).any(dim=1).any()) for c in calls)
        return int(builds) + int(cached)
    if name == "BidirectionalAdapter":
        return 1 if adapter.protocol.ragged else len({c.session.canvas_len for c in calls})
    return len({(c.session._len, len(c.session._pending)) for c in calls})  # remote block-causal


class Counted:
    """Counts model forwards per `forward_many` call (hook on the final norm) and checks each step's count."""

    def __init__(self, adapter) -> None:
        self.adapter, self.hooked, self.steps, self.shared = adapter, 0, [], 0
        self.inner = adapter.forward_many

    def __enter__(self):
        self.handle = final_norm(self.adapter.model).register_forward_hook(lambda *a: setattr(self, "hooked",
                                                                                               self.hooked + 1))

        def spy(calls):
            want = expected_forwards(self.adapter, calls)
            h0, t0 = self.hooked, self.adapter.tally.forwards
            out = self.inner(calls)
            self.steps.append((len(calls), want, self.hooked - h0, self.adapter.tally.forwards - t0))
            if want < sum(expected_forwards(self.adapter, [c]) for c in calls):
                self.shared += 1
            return out

        self.adapter.forward_many = spy
        return self

    def __exit__(self, *exc):
        self.handle.remove()
        del self.adapter.forward_many


def jobs_for(adapter, T: float, proposer) -> list[DecodeRequest]:
    """Nine requests: ragged prompts (1 to 13 tokens) and generation lengths; requests 0 and 1 (and 2 and 3) have
    the same prompt and generation lengths, so their forwards can share a shape."""
    gen = torch.Generator().manual_seed(4)
    lengths = [(5, 8), (5, 8), (9, 12), (9, 12), (1, 4), (13, 7), (3, 11), (7, 5), (11, 9)]
    jobs = []
    for i, (plen, glen) in enumerate(lengths):
        prompt = torch.randint(5, 290, (plen,), generator=gen).tolist()
        cfg = DecodeConfig(max_gen_toks=glen, temperature=T, lookahead=True)
        jobs.append(DecodeRequest(prompt, cfg, seed=20 + i, proposer=proposer))
    return jobs


@pytest.mark.parametrize("method", ["control", "spot"])
@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("fam,impl,mode", CONFIGS)
def test_batch_sizes_4_and_8_equal_one_at_a_time_with_the_promised_forwards(loaded, fam, impl, mode, T, method):
    ad = loaded(fam, impl, mode)
    torch.manual_seed(0)
    prop = TreeProposer(LearnedOrder(FactoredOrderModel(FactoredConfig())), TreeConfig(budget=4)) if method == "spot" else None
    jobs = jobs_for(ad, T, prop)
    alone = [decode(ad, j.prompt_ids, j.cfg, j.seed, proposer=j.proposer) for j in jobs]
    for bs in (4, 8):
        tally = StepTally()
        with Counted(ad) as counted:
            together = decode_many(ad, jobs, batch_size=bs, tally=tally)
        assert [r.token_ids for r in together] == [r.token_ids for r in alone]
        assert [r.nfe.total for r in together] == [r.nfe.total for r in alone]
        assert [r.nfe.store for r in together] == [r.nfe.store for r in alone]
        for n_calls, want, hooked, tallied in counted.steps:
            assert hooked == tallied == want, counted.steps
        assert tally.steps == len(counted.steps) and tally.forwards == sum(s[2] for s in counted.steps)
        if impl == "native":  # every step with several requests shares its forwards
            assert counted.shared > 0
            assert tally.forwards_per_step <= (2 if mode == "approx" else 1)
        else:  # requests 0 and 1 start in lockstep: at least their first steps share
            assert counted.shared > 0


@pytest.mark.parametrize("fam,mode", [("llada", "none"), ("dream", "none"), ("llada", "approx"), ("dream", "approx")])
def test_ragged_canvases_in_one_forward_equal_each_alone_bit_for_bit(loaded, fam, mode):
    """forward_many over canvases of five lengths, blocks at different offsets, 1 to 3 rows each: every request's
    logits are its own forward's exactly, in one model forward (approx: a block's first call then a later one)."""
    ad = loaded(fam, "native", mode)
    mask = ad.info.mask_id
    gen = torch.Generator().manual_seed(1)
    specs = [(2, 8, 3), (7, 4, 1), (1, 12, 2), (11, 8, 2), (4, 16, 3)]  # (prompt, generation, rows)
    pairs = []
    for plen, glen, R in specs:
        prompt = torch.randint(5, 290, (plen,), generator=gen).tolist()
        st = torch.full((R, 4), mask)
        st[1:, 1] = 40
        st[2:, 3] = 41
        pairs.append([ad.open(prompt, glen)[0] for _ in range(2)] + [st])
    for k in range(2):
        before = ad.tally.forwards
        together = ad.block_logits_many([(a, st) for a, _, st in pairs])
        assert ad.tally.forwards - before == (2 if mode == "approx" and k == 0 else 1)
        for (a, b, st), got in zip(pairs, together, strict=True):
            assert torch.equal(got, b.block_logits(st))
            assert a.nfe.total == b.nfe.total
        for p in pairs:
            p[2] = p[2].clone()
            p[2][:, 0] = 42


def test_padding_the_official_forwards_would_not_be_exact(loaded):
    """Why the remote paths only group forwards of one shape: run a shorter request padded to a longer one's
    length, with every means its official forward has to hide the padding, and its logits move.
    LLaDA: it ignores masks (the padded row sees its pads). Dream: a 4D bool mask hiding the pads and explicit
    positions (its own left-padding protocol) changes the last bits once the padded length crosses the attention
    kernel's key tiling (on an AVX-512 CPU, 9 tokens padded by 3 or 7 came out equal, by 16 differed: padding is
    exact only by accident of shape). SDAR: a cache row padded with masked-out
    keys leaves the all-True flash path for masked SDPA. LLaDA2.0-mini: the same padded cache row under its
    masked SDPA (a longer reduction)."""
    gen = torch.Generator().manual_seed(3)
    llada = loaded("llada", "remote", "none").model
    short = torch.randint(5, 290, (1, 9), generator=gen)
    padded = torch.cat([short, torch.full((1, 16), 7)], 1)
    with torch.no_grad():
        assert not torch.equal(llada(short).logits[:, :9], llada(padded).logits[:, :9])
    dream = loaded("dream", "remote", "none").model
    keys = torch.tensor([[True] * 9 + [False] * 16])
    am = (keys[:, None, None, :] & keys[:, None, :, None])
    with torch.no_grad():
        alone = dream(short, "full").logits
        hid = dream(padded, am, torch.arange(25)[None]).logits[:, :9]
    assert not torch.equal(alone, hid) and torch.allclose(alone, hid, atol=1e-4)
    from lm_eval_spot.adapters.remote_block_causal import make_cache_rows

    for fam in ("sdar", "llada2_moe"):
        ad = loaded(fam, "remote", "none")
        sa, _ = ad.open(torch.randint(5, 290, (8,), generator=gen).tolist())
        sb, _ = ad.open(torch.randint(5, 290, (4,), generator=gen).tolist())
        st = torch.full((1, 4), ad.info.mask_id)
        sa.block_logits(st)
        want = sb.block_logits(st)  # one cached block (SDAR: the flash path, its mask all True)
        P = 60  # the padding's length, past the attention kernel's key tiling (up to 16 came out equal on a CPU)
        pad = [(torch.cat([k.new_zeros(*k.shape[:-2], P, k.shape[-1]), k], -2),
                torch.cat([v.new_zeros(*v.shape[:-2], P, v.shape[-1]), v], -2)) for k, v in sb._kv]
        allowed = torch.ones(1, 4, P + 8, dtype=torch.bool)
        allowed[..., :P] = False  # the padding's keys hidden
        with torch.no_grad():
            got = ad.protocol.forward(ad.model, st, torch.arange(4, 8)[None], allowed, make_cache_rows([(pad, 1)]),
                                      store=False, keep=4).float()
        assert not torch.equal(got, want) and torch.allclose(got, want, atol=1e-4), fam


def test_the_run_summary_reports_forwards_per_step(checkpoints):
    """Through the lm-eval model class at batch size 4 on LLaDA native: four requests of different prompt lengths
    share one forward per step, and the summary says so."""
    from lm_eval.api.instance import Instance

    from lm_eval_spot.harness.model import SpotDLM
    from lm_eval_spot.reports.run_stats import format_summary

    lm = SpotDLM(pretrained=str(checkpoints["llada"]), mode="control", device="cpu", batch_size="4", seed=1,
                 block_len=4)
    reqs = [Instance("generate_until", {}, ("ab" * k, {"until": ["\n\n"], "max_gen_toks": 4 + 2 * k}), 0)
            for k in range(1, 5)]
    lm.generate_until(reqs)
    info = lm.get_model_info()["spot"]
    assert info["steps_total"] > 0 and info["forwards_per_step"] == 1.0
    assert info["forwards_total"] == info["steps_total"] < info["nfe_total"]
    import re

    assert re.search(r"\| target forwards / step \(requests sharing them\) +\| 1\.00 +\|", format_summary(info))
