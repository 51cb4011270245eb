from __future__ import annotations

import torch

from lm_eval_spot.analysis import dynamics
from lm_eval_spot.drafter.data import Trajectories


def test_dynamics_rates_on_a_hand_made_trajectory():
    # one block of 3 slots, commits 2, 0, 1; stale top-1 confidences favour slot 0 then slot 1
    L = 3
    committed = torch.tensor([[0, 0, 0], [0, 0, 1], [1, 0, 1]], dtype=torch.bool)
    topk = torch.zeros(3, L, 32)
    topk[0, :, 0] = torch.tensor([0.9, 0.5, 0.8])  # round 0 stale: best remaining after slot 2 -> slot 0 (hit)
    topk[1, :, 0] = torch.tensor([0.1, 0.2, 0.3])  # round 1 stale: best remaining after slot 0 -> slot 1 (hit)
    top1 = torch.tensor([[5, 6, 7], [5, 9, 7], [5, 6, 7]], dtype=torch.int32)
    traj = Trajectories(topk.half(), top1, committed, ~committed, torch.tensor([2, 0, 1]), torch.tensor([7, 5, 6]),
                        torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    d = dynamics(traj)
    assert d["rounds"] == 3
    assert abs(d["leftmost_next_rate"] - 2 / 3) < 1e-6  # commits 0 and 1 were leftmost, 2 was not
    assert d["prev_top_conf_next_rate"] == 1.0
    assert d["stale_argmax_token_rate"] == 0.5  # slot 0 token 5 right; slot 1 stale said 9, got 6
