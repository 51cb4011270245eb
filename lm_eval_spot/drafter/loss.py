"""The factored drafter's training loss: one definition, read by the trainer (`training.fit`) and by online
adaptation (`drafter.online`), which fine-tunes the runtime drafter between chunks of a run."""

from __future__ import annotations

import torch

from lm_eval_spot.drafter.data import Trajectories, make_round_batch
from lm_eval_spot.drafter.factored import FactoredOrderModel


def factored_loss(model: FactoredOrderModel, traj: Trajectories, rounds: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Cross-entropy of the next true commit over every replay depth < max_depth of each root in `rounds`."""
    b = make_round_batch(traj, rounds, max_depth, model.cfg.max_block_len, model.cfg.top_k)
    dev = model.device
    logits = model.node_logits(model.tables(b.feat.to(dev), b.rank.to(dev), b.status.to(dev)), b.on_path.to(dev),
                               b.last.to(dev))
    valid = b.valid.to(dev)
    return torch.nn.functional.cross_entropy(logits[valid], b.label.to(dev)[valid])
