"""Control and SPOT against an independent naive reference decoder (tests/helpers/reference.py), on fresh random targets
(unscaled and saturated embeddings, several seeds, prompts, block lengths and noise seeds), with drafters that
are random or wrong on purpose. These are the tests that must fail for a wrong decoder: a verifier that accepts
on position alone, confidence taken as the max logit, ties to the highest index, noise redrawn per round, a
replica that sees another's state, stale conditionals taken from the wrong node."""

from __future__ import annotations

import pytest
import torch

from lm_eval_spot.adapters.block_causal import BlockCausalAdapter
from lm_eval_spot.decoding.loop import DecodeConfig, decode
from lm_eval_spot.decoding.proposer import RoundContext
from lm_eval_spot.decoding.tree import DraftTree
from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
from lm_eval_spot.drafter.spot_proposer import LearnedOrder, TreeConfig, TreeProposer

from helpers.reference import reference_decode
from helpers.targets import CASES, EOS, MASK, V, Log, make, prompt_of
from helpers.targets import block_tokens as _block_tokens


class Liar:
    """Drafts the TRUE next positions (from a control log) as a chain, with a WRONG token at every `wrong_every`-th
    depth and the true token elsewhere, plus a wrong-position sibling at the root: a verifier that checks only
    positions, or only tokens, accepts something it must not."""

    def __init__(self, log: Log, budget: int, wrong_every: int) -> None:
        self.log, self.budget, self.wrong_every = log, budget, wrong_every

    def propose(self, ctx: RoundContext) -> DraftTree:
        commits = self.log.blocks.get(ctx.block, [])
        k = next((i for i, (p, _) in enumerate(commits) if int(ctx.state[p]) == MASK), len(commits))
        nxt = commits[k : k + self.budget]
        parent, pos, tok = [], [], []
        for d, (p, t) in enumerate(nxt):
            wrong = (d + k) % self.wrong_every == self.wrong_every - 1
            bad = t + 1 if t + 1 < V and t + 1 != MASK else 5
            parent.append(d)
            pos.append(p)
            tok.append(bad if wrong else t)
            if wrong:
                break  # nothing below a wrong edge can be right
        free = [i for i in range(len(ctx.state)) if bool(ctx.eligible[i]) and i not in pos[:1]]
        if nxt and free:  # a sibling at the right token but the wrong position
            parent.append(0)
            pos.append(free[0])
            tok.append(nxt[0][1])
        return DraftTree(tuple(parent), tuple(pos), tuple(tok))


@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("case", CASES)
def test_control_equals_the_independent_reference(case, T):
    seed, scale, L, plen, noise = case
    adapter = make(seed, scale, L)
    prompt = prompt_of(plen, seed)
    n = 2 * L + 3
    log = Log()
    res = decode(adapter, prompt, DecodeConfig(max_gen_toks=n, temperature=T), seed=noise, observer=log)
    ref, commits = reference_decode(adapter.model, prompt, L, MASK, {EOS}, n, T, noise)
    assert res.token_ids == ref
    # Commit for commit (slot and token), not only the final text: tiny random targets often produce the same
    # tokens in any order, so a wrong order would hide behind equal outputs.
    got = [(b, p, t) for b in sorted(log.blocks) for p, t in log.blocks[b]]
    assert got == commits[: len(got)]


@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("case", CASES)
def test_spot_with_random_and_lying_drafters_equals_the_reference(case, T):
    seed, scale, L, plen, noise = case
    adapter = make(seed, scale, L)
    prompt = prompt_of(plen, seed)
    n = 2 * L + 3
    cfg = DecodeConfig(max_gen_toks=n, temperature=T)
    ref, _ = reference_decode(adapter.model, prompt, L, MASK, {EOS}, n, T, noise)
    log = Log()
    control = decode(adapter, prompt, cfg, seed=noise, observer=log)
    assert control.token_ids == ref
    torch.manual_seed(seed)
    drafter = FactoredOrderModel(FactoredConfig(max_block_len=max(L, 16)))
    for proposer in (TreeProposer(LearnedOrder(drafter), TreeConfig(budget=6)), Liar(log, 6, wrong_every=3),
                     Liar(log, 6, wrong_every=1)):
        spec = decode(adapter, prompt, cfg, seed=noise, proposer=proposer)
        assert spec.token_ids == ref, type(proposer).__name__
    liar = decode(adapter, prompt, cfg, seed=noise, proposer=Liar(log, 6, wrong_every=3))
    assert max(liar.accepted) >= 2 and liar.nfe.total < control.nfe.total  # true edges really were accepted


class StaleSpy:
    """Drafts the true next commits (so deep paths are accepted) and records what every round was given."""

    def __init__(self, log: Log, budget: int) -> None:
        self.log, self.budget = log, budget
        self.seen: list[tuple[int, torch.Tensor, object]] = []

    def propose(self, ctx: RoundContext) -> DraftTree:
        self.seen.append((ctx.block, ctx.state.clone(), ctx.stale))
        commits = self.log.blocks.get(ctx.block, [])
        k = next((i for i, (p, _) in enumerate(commits) if int(ctx.state[p]) == MASK), len(commits))
        nxt = commits[k : k + self.budget]
        return DraftTree(tuple(range(len(nxt))), tuple(p for p, _ in nxt), tuple(t for _, t in nxt))


def test_stale_conditionals_come_from_the_deepest_accepted_node():
    """A round's stale summary is the target's distribution at the state one commit before the round's root (the
    deepest node accepted in the previous round), not at the previous root, recomputed here from scratch."""
    L = 8
    adapter = make(21, 1.0, L)
    prompt = prompt_of(6, 21)
    cfg = DecodeConfig(max_gen_toks=4 * L, temperature=0.0)
    log = Log()
    decode(adapter, prompt, cfg, seed=1, observer=log)
    spy = StaleSpy(log, 2)
    res = decode(adapter, prompt, cfg, seed=1, proposer=spy)
    assert max(res.accepted) >= 2
    checked = 0
    for block, root, stale in spy.seen:
        if stale is None:
            continue
        commits = log.blocks[block]
        k = next((i for i, (p, _) in enumerate(commits) if int(root[p]) == MASK), len(commits))
        before = root.clone()
        before[commits[k - 1][0]] = MASK  # the state whose forward produced the stale logits
        start = (len(prompt) // L + block) * L
        done = [t for b in range(block) for t in _block_tokens(log, b, prompt, L)]
        ids = (prompt + done)[:start] + before.tolist()
        pos = torch.arange(len(ids))
        blk = pos // L
        mask = torch.zeros(len(ids), len(ids))
        mask[blk[None, :] > blk[:, None]] = torch.finfo(torch.float32).min
        with torch.no_grad():
            logits = adapter.model(input_ids=torch.tensor([ids]), attention_mask=mask[None, None],
                                   position_ids=pos[None]).logits[0, start:].float()
        logits[:, MASK] = float("-inf")
        top = torch.softmax(logits, -1).topk(stale.topk.shape[-1], -1).values
        torch.testing.assert_close(stale.topk, top, rtol=0, atol=1e-5)
        checked += 1
    assert checked >= 6


def tied_target(L: int) -> BlockCausalAdapter:
    """A real Qwen3 whose attention is uniform (q and k projections zeroed): every masked slot of a block then has
    bit-identical logits, so the commit order is decided by the lowest-index tie-break alone."""
    adapter = make(31, 1.0, L)
    with torch.no_grad():
        for layer in adapter.model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
            layer.self_attn.k_proj.weight.zero_()
    return adapter


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_exact_confidence_ties_go_to_the_lowest_slot(T):
    L = 8
    adapter = tied_target(L)
    prompt = prompt_of(3, 31)
    n = 2 * L
    log = Log()
    res = decode(adapter, prompt, DecodeConfig(max_gen_toks=n, temperature=T), seed=2, observer=log)
    ref, commits = reference_decode(adapter.model, prompt, L, MASK, {EOS}, n, T, 2)
    got = [(b, p, t) for b in sorted(log.blocks) for p, t in log.blocks[b]]
    assert got == commits[: len(got)] and res.token_ids == ref
    # Guard: the ties are real (all masked slots of the first state share one confidence, bit for bit).
    session, tail = adapter.open(prompt)
    state = torch.full((L,), MASK)
    state[: len(tail)] = torch.tensor(tail)
    logits = session.block_logits(state[None])[0]
    conf = torch.softmax(logits, -1).amax(-1)[state == MASK]
    assert bool((conf == conf[0]).all()) and conf.numel() == L - len(tail)


class VerdictSpy:
    """A proposer that learns from the verifier (LearnsFromVerdicts): a stale-confidence tree whose verdicts it
    keeps; an observer beside it records what the loop verified."""

    def __init__(self, budget: int) -> None:
        from lm_eval_spot.settings.proposers import MethodSpec, make_proposer

        self.inner = make_proposer(MethodSpec("conf-tree", budget))
        self.budget = budget
        self.trees: set[int] = set()
        self.verdicts: list[tuple[int, ...]] = []

    def propose(self, ctx: RoundContext) -> DraftTree:
        tree = self.inner.propose(ctx)
        self.trees.add(id(tree))
        return tree

    def on_verdict(self, ctx: RoundContext, accepted: tuple[int, ...]) -> None:
        self.verdicts.append(accepted)


class VerifyLog:
    def __init__(self) -> None:
        self.rounds: list[tuple[int, tuple[int, ...]]] = []

    def on_commit(self, block, state, eligible, stale, pos, tok) -> None:
        pass

    def on_verify(self, block, tree, path, target_pos, target_tok) -> None:
        self.rounds.append((id(tree), tuple(path)))


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_a_proposer_that_learns_gets_each_verdict_on_its_own_tree(T):
    """The verdict reaches the proposer through its declared method, once per tree it proposed, with the accepted
    nodes the verifier walked (no lookahead here: no lead edge shifts the numbering)."""
    seed, scale, L, plen, nseed = CASES[0]
    spy, seen = VerdictSpy(4), VerifyLog()
    out = decode(make(seed, scale, L), prompt_of(plen, seed), DecodeConfig(max_gen_toks=3 * L, temperature=T,
                                                                          lookahead=False),
                 nseed, proposer=spy, observer=seen)
    expected = [path for tree, path in seen.rounds if tree in spy.trees]
    assert spy.verdicts == expected and any(spy.verdicts) and len(expected) >= 3
    assert out.token_ids == decode(make(seed, scale, L), prompt_of(plen, seed),
                                   DecodeConfig(max_gen_toks=3 * L, temperature=T, lookahead=False), nseed).token_ids
