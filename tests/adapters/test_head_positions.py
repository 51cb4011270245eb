"""The bidirectional remote paths (LLaDA, Dream official code) put only the kept positions through the LM head:
the logits equal the whole canvas's at those positions, and the head's input has len(keep) positions, not the
canvas's. Tiny random-weight models built from the official code in ../shared."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from lm_eval_spot.families.dream import DreamRemote
from lm_eval_spot.families.llada import LLaDARemote

from helpers.remote_fixtures import build_remote, needs_remote

pytestmark = needs_remote
log = logging.getLogger(__name__)

CASES = [("llada", {}), ("llada", {"weight_tying": True, "scale_logits": True}), ("dream", {})]


def whole_canvas(model, fam: str, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits if fam == "llada" else model(ids, attention_mask="full").logits


def head_weight(model, fam: str, tied: bool) -> torch.Tensor:
    """The LM head's weight: Dream's lm_head, LLaDA's ff_out, or (tied) its input embedding's table."""
    if fam == "dream":
        return model.lm_head.weight
    return (model.model.transformer.wte if tied else model.model.transformer.ff_out).weight


@pytest.mark.parametrize("fam,overrides", CASES)
def test_the_head_sees_only_the_kept_positions_and_its_logits_are_the_whole_canvas(fam, overrides, monkeypatch):
    tied = bool(overrides.get("weight_tying"))
    model = build_remote(fam, seed=3, scale=1.0 if tied else 4.0, **overrides)  # build_remote scales ff_out
    protocol = LLaDARemote() if fam == "llada" else DreamRemote()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 500, (3, 21), generator=gen)
    keep = torch.tensor([7, 8, 9, 10, 11])  # a block inside the canvas, masks after it: not a suffix
    # Every head runs as F.linear on its weight (nn.Linear's forward, or LLaDA's tied F.linear): record its input.
    weight, linear, seen = head_weight(model, fam, tied), F.linear, []

    def watched(x, w, *rest, **kw):
        if w is weight:
            seen.append(tuple(x.shape))
        return linear(x, w, *rest, **kw)

    monkeypatch.setattr(F, "linear", watched)
    with torch.no_grad():
        got = protocol.forward(model, ids, keep)
        full = whole_canvas(model, fam, ids)
    # Ours: only the kept positions reach the head; then the official forward alone (no hook left): the whole canvas.
    assert seen == [(3, len(keep), 64), (3, ids.shape[1], 64)]
    assert got.shape == (3, len(keep), full.shape[-1])
    diff = (got - full[:, keep]).abs().max().item()
    log.info("%s %s: largest |sliced - whole canvas| = %.3g", fam, overrides, diff)
    assert diff <= 1e-5
