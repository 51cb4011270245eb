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

from lm_eval_spot.decoding.sampling import Truncation
from lm_eval_spot.decoding.transfer import HostLink, upload
from lm_eval_spot.decoding.transition import select_positions
from lm_eval_spot.decoding.tree import DraftTree


def is_chain(tree: DraftTree) -> bool:
    return all(p == j for j, p in enumerate(tree.parent))


def tempered_probs(logits: torch.Tensor, temperature: float, trunc: Truncation | None = None) -> torch.Tensor:
    """softmax(trunc(l / T)) per row (float32): the law a sampled commit is drawn from, top-k / top-p included."""
    if trunc is not None and trunc.active:
        return torch.softmax(trunc.apply(logits.double() / temperature), dim=-1).float()
    return torch.softmax(logits.float() / temperature, dim=-1)


def proposal_probs(stale_logits: torch.Tensor, positions: list[int], temperature: float,
                   trunc: Truncation | None = None) -> torch.Tensor:
    """q rows [D, V] for the drafted positions (on the logits' device; rows picked by host ints, so no index
    tensor goes up), truncated as the target's law is (any q keeps the verifier exact; this one is closest)."""
    if not positions:
        return stale_logits.new_zeros(0, stale_logits.shape[-1])
    rows = torch.stack([stale_logits[i] for i in positions])
    return tempered_probs(rows, temperature, trunc)


def draw(probs: torch.Tensor, gen: torch.Generator, u: torch.Tensor | None = None) -> torch.Tensor:
    """One index per row of probs [..., V] (any device) by inverse CDF of host uniforms (float64) -> [...] long.
    u: those uniforms already on the device (drawn from `gen` by the caller, uploaded with other inputs)."""
    cdf = probs.double().cumsum(dim=-1)
    if u is None:
        u = torch.rand(probs.shape[:-1], generator=gen, dtype=torch.float64).to(probs.device)
    # right=True: the first index whose cdf exceeds u * total, so a zero-probability index is never returned.
    idx = torch.searchsorted(cdf, (u * cdf[..., -1]).unsqueeze(-1), right=True).squeeze(-1)
    return idx.clamp_max(probs.shape[-1] - 1)


def sample_chain_tokens(tree: DraftTree, q: torch.Tensor, gen: torch.Generator) -> DraftTree:
    """Replace the chain's tokens by draws from its proposal rows q [D, V]."""
    if not tree.size:
        return tree
    tok = draw(q, gen).cpu().tolist()
    return DraftTree(tree.parent, tree.pos, tuple(tok))


def rejection_verify(
    tree: DraftTree,
    q: torch.Tensor,
    logits: torch.Tensor,
    eligible: torch.Tensor,
    temperature: float,
    gen: torch.Generator,
    link: HostLink | None = None,
    bad_rows: torch.Tensor | None = None,
    trunc: Truncation | None = None,
) -> tuple[list[int], int, int, bool]:
    """Chain nodes 1..D with proposal rows q [D, V]; logits [1 + D, L, V] and eligible [1 + D, L] of the root and
    every drafted state (all on one device). Returns (accepted nodes, position, token) of the final commit from
    the last accepted node (position -1 when that node has nothing left to commit), and whether any of
    `bad_rows` (a device flag per row, e.g. non-finite logits; read in the same copy) was set: then the rest is
    meaningless. One copy up (tokens and uniforms), one down."""
    if not is_chain(tree):
        raise ValueError("rejection verification needs a chain (each drafted node's parent is the one before)")
    link = link or HostLink()
    has = eligible.any(-1)
    pos_star = select_positions(logits, eligible | ~has[:, None])
    rows = torch.arange(logits.shape[0], device=logits.device)
    p = tempered_probs(logits[rows, pos_star], temperature, trunc)  # [1 + D, V]: the target's law
    D = tree.size
    # Everything the walk may need, drawn and reduced on the device; the host walks the chain on scalars. The
    # uniforms are drawn on the host in a fixed order (acceptance, then p's draws, then the residuals').
    u = torch.rand(D, generator=gen, dtype=torch.float64)
    u_p = torch.rand(1 + D, generator=gen, dtype=torch.float64)
    u_r = torch.rand(D, generator=gen, dtype=torch.float64)
    x, u_p, u_r = upload(torch.tensor(tree.tok, dtype=torch.long), u_p, u_r, device=logits.device)
    resid = (p[:D] - q.float()).clamp_min(0.0) if D else p[:0]
    total = resid.sum(-1, keepdim=True)
    resid = torch.where(total > 0, resid, p[:D])  # p == q: the rejection has probability 0; stay defined
    p_x = p[:D].gather(-1, x[:, None]).squeeze(-1) if D else p.new_zeros(0)
    q_x = q.float().gather(-1, x[:, None]).squeeze(-1) if D else p.new_zeros(0)
    from_p = draw(p, gen, u_p)  # [1 + D]: a fresh draw from p at every node (position mismatch, or the final commit)
    from_resid = draw(resid, gen, u_r) if D else from_p[:0]
    bad = bad_rows.any()[None] if bad_rows is not None else has.new_zeros(1)
    pos_h, has_h, px, qx, fp, fr, bad_h = link.pull(pos_star, has, p_x, q_x, from_p, from_resid, bad)
    if bool(bad_h[0]):
        return [], -1, -1, True
    path: list[int] = []
    node = 0
    for j in range(D):
        if not bool(has_h[node]):
            return path, -1, -1, False
        i_star = int(pos_h[node])
        if tree.pos[j] != i_star:
            return path, i_star, int(fp[node]), False
        if float(u[j]) * float(qx[j]) < float(px[j]):  # u < p/q without dividing by a zero q
            path.append(j + 1)
            node = j + 1
            continue
        return path, i_star, int(fr[j]), False
    if not bool(has_h[node]):
        return path, -1, -1, False
    return path, int(pos_h[node]), int(fp[node]), False
