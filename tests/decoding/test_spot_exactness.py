"""The key invariant: speculative output == control output under the same seed, for any drafter."""

from __future__ import annotations

import pytest
import torch

from lm_eval_spot.adapters.base import TargetInfo
from lm_eval_spot.adapters.block_causal import BlockCausalAdapter
from lm_eval_spot.decoding.loop import DecodeConfig, decode
from lm_eval_spot.decoding.proposer import RoundContext
from lm_eval_spot.decoding.tree import DraftTree
from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
from lm_eval_spot.drafter.model import DrafterModel, OrderModel, OrderModelConfig
from lm_eval_spot.drafter.spot_proposer import LearnedOrder, TreeConfig, TreeProposer

from helpers.tiny import build_model
from helpers.summaries import view

V, MASK, EOS = 40, 2, 1


def adapter_for(L: int, seed: int = 0) -> BlockCausalAdapter:
    return BlockCausalAdapter(build_model(V, seed=seed, block_length=L),
                              TargetInfo(MASK, frozenset({EOS}), L, "zero", True, V))


class Recorder:
    def __init__(self) -> None:
        self.commits: dict[int, list[tuple[int, int]]] = {}

    def on_commit(self, block, state, eligible, logits, pos, tok):
        self.commits.setdefault(block, []).append((pos, tok))


class OracleProposer:
    """Drafts the true future commits (from a control run) as a chain, plus a wrong sibling at every depth,
    so that verification must both accept deep paths and reject near-misses."""

    def __init__(self, commits: dict[int, list[tuple[int, int]]], L: int, budget: int, corrupt_at: int | None):
        self.commits, self.L, self.budget, self.corrupt_at = commits, L, budget, corrupt_at
        self.block = -1
        self.last_state: torch.Tensor | None = None

    def propose(self, ctx: RoundContext) -> DraftTree:
        # Find the block by matching the root against the recorded trajectories (its first `done` commits).
        for seq in self.commits.values():
            done = sum(int(ctx.state[p]) == t for p, t in seq)
            fut = seq[done:]
            if fut and all(int(ctx.state[p]) == t for p, t in seq[:done]) and all(
                int(ctx.state[p]) == ctx.mask_id for p, _ in fut
            ):
                break
        else:
            return DraftTree.empty()
        parent, pos, tok = [], [], []
        prev = 0
        for d, (p, t) in enumerate(fut[: self.budget // 2]):
            wrong_tok = (t + 1) % V if (t + 1) % V != MASK else (t + 2) % V
            parent.append(prev); pos.append(p); tok.append(wrong_tok)  # a sibling that must be rejected
            true_t = wrong_tok if d == self.corrupt_at else t
            parent.append(prev); pos.append(p); tok.append(true_t)
            prev = len(parent)
        return DraftTree(tuple(parent), tuple(pos), tuple(tok))


@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("L", [16, 32])
@pytest.mark.parametrize("corrupt_at", [None, 2])
def test_oracle_tree_is_exact_and_saves_forwards(L, T, corrupt_at):
    adapter = adapter_for(L, seed=L)
    prompt = list(range(5, 5 + L + 3))
    cfg = DecodeConfig(max_gen_toks=2 * L + 5, temperature=T)
    rec = Recorder()
    control = decode(adapter, prompt, cfg, seed=4, observer=rec)
    spec = decode(adapter, prompt, cfg, seed=4, proposer=OracleProposer(rec.commits, L, 20, corrupt_at))
    assert spec.token_ids == control.token_ids
    assert spec.nfe.total < control.nfe.total
    if corrupt_at is None:
        assert max(spec.accepted) >= 5  # deep paths really were accepted
    else:
        assert max(spec.accepted) == corrupt_at  # nothing past a wrong edge is ever accepted


def random_drafter(seed: int, arch: str = "encoder") -> DrafterModel:
    torch.manual_seed(seed)
    return FactoredOrderModel(FactoredConfig()) if arch == "factored" else OrderModel(OrderModelConfig())


@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("L", [16, 32])
@pytest.mark.parametrize("gamma,chain", [(0.0, False), (0.05, False), (0.0, True)])
# The tree code is shared; the per-node encoder (v1) keeps two budgets, the default factored model all four.
@pytest.mark.parametrize("arch,budget", [("factored", 1), ("factored", 4), ("factored", 8), ("factored", 20),
                                         ("encoder", 4), ("encoder", 20)])
def test_random_weight_drafter_never_breaks_exactness(L, T, budget, gamma, chain, arch):
    adapter = adapter_for(L, seed=1)
    prompt = list(range(7, 7 + 5))
    cfg = DecodeConfig(max_gen_toks=L // 2 + 12, temperature=T)  # spans two blocks
    control = decode(adapter, prompt, cfg, seed=9)
    prop = TreeProposer(LearnedOrder(random_drafter(budget, arch)), TreeConfig(budget=budget, gamma=gamma, chain=chain))
    spec = decode(adapter, prompt, cfg, seed=9, proposer=prop)
    assert spec.token_ids == control.token_ids
    assert spec.stop_reason == control.stop_reason
    assert all(d <= budget for d in spec.drafted)
    assert spec.committed >= len(spec.token_ids)


@pytest.mark.parametrize("arch", ["factored", "encoder"])
def test_tree_respects_budget_and_gamma(arch):
    L = 16
    torch.manual_seed(0)
    logits = torch.randn(L, V) * 3
    logits[:, MASK] = float("-inf")
    state = torch.full((L,), MASK)
    state[:3] = 9
    ctx = RoundContext(state, state == MASK, state != MASK, view(logits), 0.0, None, MASK)
    model = random_drafter(0, arch)
    full = TreeProposer(LearnedOrder(model), TreeConfig(budget=12)).propose(ctx)
    assert full.size == 12
    floor = TreeProposer(LearnedOrder(model), TreeConfig(budget=12, gamma=0.2)).propose(ctx)
    assert floor.size < 12
    chain = TreeProposer(LearnedOrder(model), TreeConfig(budget=6, chain=True)).propose(ctx)
    assert chain.parent == (0, 1, 2, 3, 4, 5)
    # drafted slots are masked ones, and a path never commits one slot twice
    for tree in (full, floor, chain):
        for j in range(tree.size):
            seen, node = [], j + 1
            while node:
                seen.append(tree.pos[node - 1])
                node = tree.parent[node - 1]
            assert len(seen) == len(set(seen)) and all(p >= 3 for p in seen)


def _paths(tree: DraftTree) -> set[tuple[tuple[int, int], ...]]:
    out = set()
    for j in range(tree.size):
        path, node = [], j + 1
        while node:
            path.append((tree.pos[node - 1], tree.tok[node - 1]))
            node = tree.parent[node - 1]
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("arch", ["factored", "encoder"])
@pytest.mark.parametrize("budget", [3, 7, 12])
def test_tree_is_the_exact_top_budget_by_prefix_mass(arch, budget):
    """The level-wise tree (with its candidate pruning) selects exactly the `budget` heaviest paths that a brute
    force enumeration of every path finds (continuous random inputs: no mass ties)."""
    L = 8
    torch.manual_seed(3)
    logits = torch.randn(L, V)
    logits[:, MASK] = float("-inf")
    state = torch.full((L,), MASK)
    state[[0, 2, 5]] = 9
    ctx = RoundContext(state, state == MASK, state != MASK, view(logits), 0.0, None, MASK)
    prop = TreeProposer(LearnedOrder(random_drafter(1, arch)), TreeConfig(budget=budget))
    tree = prop.propose(ctx)
    probs = torch.softmax(logits, -1)
    top = probs.topk(2, -1)
    hyps = {p: [(int(top.indices[p, 0]), float(top.values[p, 0]))]
            + ([(int(top.indices[p, 1]), float(top.values[p, 1]))] if top.values[p, 0] < 0.6 else [])
            for p in range(L)}
    prep = prop.order.prepare(ctx)
    found: list[tuple[float, tuple]] = []

    def walk(path: tuple, depth_map: torch.Tensor, mass: float) -> None:
        if len(path) == int(ctx.eligible.sum()):
            return
        q = prop.order.probs(prep, ctx, depth_map[None])[0]
        for p in range(L):
            if q[p] <= 0:
                continue
            for tok, pt in hyps[p]:
                m = mass * float(q[p]) * pt
                child = path + ((p, tok),)
                found.append((m, child))
                dm = depth_map.clone()
                dm[p] = len(child)
                walk(child, dm, m)

    walk((), torch.zeros(L, dtype=torch.long), 1.0)
    found.sort(key=lambda x: -x[0])
    assert len(found) > budget
    assert _paths(tree) == {p for _, p in found[:budget]}
