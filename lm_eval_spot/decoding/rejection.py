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

from lm_eval_spot.decoding.noise import mix_seed
from lm_eval_spot.decoding.sampling import Truncation
from lm_eval_spot.transfer import HostLink, upload
from lm_eval_spot.decoding.transition import select_positions
from lm_eval_spot.decoding.tree import DraftTree
from lm_eval_spot.decoding.types import NonFiniteLogitsError
from lm_eval_spot.decoding.verifier import RoundAt, Verdict


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
    return DraftTree(tree.parent, tree.pos, tuple(tok), tree.rank)


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


class RejectionVerifier:
    """`rejection_verify` as a round's verifier: the chain's tokens drawn from q (the stale rows at the drafted
    positions) before the forward, accepted or resampled after it. Randomness: one generator per round for
    drafting and one for verifying, seeded from (request seed, block, round)."""

    def __init__(self, seed: int, temperature: float, truncation: Truncation | None, link: HostLink) -> None:
        self.seed, self.temperature, self.truncation, self.link = seed, temperature, truncation, link
        self._q: torch.Tensor | None = None  # the drafted round's proposal rows, read by its verify

    def draft(self, tree: DraftTree, stale_src: torch.Tensor | None, at: RoundAt) -> DraftTree:
        assert stale_src is not None  # the loop drafts nothing under rejection without stale conditionals
        self._q = proposal_probs(stale_src, list(tree.pos), self.temperature, self.truncation)
        rng = torch.Generator().manual_seed(mix_seed("draft", self.seed, at.block, at.round))
        return sample_chain_tokens(tree, self._q, rng)

    def verify(self, tree: DraftTree, logits: torch.Tensor, eligible: torch.Tensor, bad_rows: torch.Tensor,
               at: RoundAt) -> Verdict:
        rng = torch.Generator().manual_seed(mix_seed("verify", self.seed, at.block, at.round))
        q_rows, self._q = (self._q if self._q is not None else logits.new_zeros(0, logits.shape[-1])), None
        path, fpos, ftok, bad = rejection_verify(tree, q_rows, logits, eligible, self.temperature, rng, self.link,
                                                 bad_rows, self.truncation)
        if bad:  # read in the verifier's one copy
            raise NonFiniteLogitsError(at.block, at.round)
        # The target's transition at each accepted node is the next drafted edge; at the last, the final commit.
        tpos = torch.full((1 + tree.size,), -1, dtype=torch.long)
        ttok = tpos.clone()
        for a, b in zip([0, *path], path, strict=False):
            tpos[a], ttok[a] = tree.pos[b - 1], tree.tok[b - 1]
        tpos[([0, *path])[-1]], ttok[([0, *path])[-1]] = fpos, ftok
        return Verdict(path, tpos, ttok)
