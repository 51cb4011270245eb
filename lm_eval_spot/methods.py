"""Mode name -> proposer. Every mode shares the decoder and verifier; only the proposer differs."""

from __future__ import annotations

from pathlib import Path

from lm_eval_spot.config import SpotArgs, default_drafter_path
from lm_eval_spot.decoding.proposer import Proposer
from lm_eval_spot.drafter.model import load_drafter
from lm_eval_spot.drafter.proposer import SpotProposer, TreeConfig


def build_proposer(args: SpotArgs, block_len: int) -> Proposer | None:
    if args.mode == "control":
        return None
    model, _meta = load_drafter(Path(args.drafter or default_drafter_path()), block_len)
    gamma = args.gamma if args.mode == "spot-gamma" else 0.0
    return SpotProposer(model, TreeConfig(budget=args.budget, gamma=gamma, chain=args.mode == "spot-chain"))
