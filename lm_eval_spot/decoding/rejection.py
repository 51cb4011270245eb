"""Accept-residual (rejection-sampling) verification for CHAINS: exact in distribution, not path by path.

The proposal is sequential: the drafter fixes each drafted position from the path's positions alone (never from
sampled tokens), and the token at drafted node j is a sample from q_j = softmax(stale[pos_j] / T). At node j the
target's transition is position i* (deterministic) and a token from p = softmax(l[i*] / T). Accept the drafted
(pos_j, x) with probability min(1, p(x) / q_j(x)) if pos_j == i*, else reject; on rejection commit i* with a
token from the residual max(0, p - q_j) (from p itself when the positions differ, where q puts no mass). So every
commit is distributed exactly as the draft-free decoder's, whatever q is. With a full accept, the deepest node
adds one transition sampled from p. Randomness comes in as torch.Generators: one for drafting, one for verifying.
"""

from __future__ import annotations

import torch

from lm_eval_spot.decoding.transition import select_positions
from lm_eval_spot.decoding.tree import DraftTree


def is_chain(tree: DraftTree) -> bool:
    return all(p == j for j, p in enumerate(tree.parent))


def proposal_probs(stale_logits: torch.Tensor, positions: list[int], temperature: float) -> torch.Tensor:
    """q rows [D, V] for the drafted positions."""
    return torch.softmax(stale_logits[positions].float() / temperature, dim=-1)


def sample_chain_tokens(tree: DraftTree, q: torch.Tensor, gen: torch.Generator) -> DraftTree:
    """Replace the chain's tokens by draws from its proposal rows q [D, V]."""
    if not tree.size:
        return tree
    tok = torch.multinomial(q, 1, generator=gen).flatten().tolist()
    return DraftTree(tree.parent, tree.pos, tuple(tok))


def rejection_verify(
    tree: DraftTree,
    q: torch.Tensor,
    logits: torch.Tensor,
    eligible: torch.Tensor,
    temperature: float,
    gen: torch.Generator,
) -> tuple[list[int], int, int]:
    """Chain nodes 1..D with proposal rows q [D, V]; logits [1 + D, L, V] and eligible [1 + D, L] of the root and
    every drafted state. Returns (accepted nodes, position, token) of the final commit from the last accepted
    node; position -1 when that node has nothing left to commit."""
    if not is_chain(tree):
        raise ValueError("rejection verification needs a chain (each drafted node's parent is the one before)")
    pos_star = select_positions(logits, eligible | ~eligible.any(-1, keepdim=True))
    path: list[int] = []
    node = 0
    for j in range(tree.size):
        if not bool(eligible[node].any()):
            return path, -1, -1
        i_star = int(pos_star[node])
        p = torch.softmax(logits[node, i_star].float() / temperature, dim=-1)
        if tree.pos[j] != i_star:
            return path, i_star, int(torch.multinomial(p, 1, generator=gen))
        x = tree.tok[j]
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        if u * float(q[j, x]) < float(p[x]):  # u < p/q without dividing by a zero q
            path.append(j + 1)
            node = j + 1
            continue
        resid = (p - q[j].float()).clamp_min(0.0)
        total = float(resid.sum())
        draw = resid / total if total > 0 else p  # p == q: the rejection has probability 0; stay defined
        return path, i_star, int(torch.multinomial(draw, 1, generator=gen))
    if not bool(eligible[node].any()):
        return path, -1, -1
    i_star = int(pos_star[node])
    p = torch.softmax(logits[node, i_star].float() / temperature, dim=-1)
    return path, i_star, int(torch.multinomial(p, 1, generator=gen))
