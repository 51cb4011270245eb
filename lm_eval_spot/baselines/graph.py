"""The calibrated draft graph (Spiffy-style): a fixed graph over stale-confidence RANKS, pruned at run time.

A node is a rank sequence (r1, ..., rk): "commit the r1-th most confident masked slot (by the stale conditionals),
then the r2-th of those left, ...", with the stale top token at each slot (the coupled stale draw at T > 0).
The graph is calibrated offline on control trajectories of the target on held-out prompts: it keeps the rank
sequences that were most often the true next commits. At run time the first D nodes that exist in the current
block (rank within the slots left, parent kept) are drafted.

    python -m lm_eval_spot.baselines.graph --target DIR --n-prompts 300 --out graph.json
"""

from __future__ import annotations

import argparse
import logging
from collections import Counter
from pathlib import Path

import torch

from lm_eval_spot.baselines.rank_graph import (MAX_DEPTH, GraphProposer, RankGraph, confidence_ranking,
                                             rank_sequence)

log = logging.getLogger(__name__)


__all__ = ["GraphProposer", "RankGraph", "calibrate", "confidence_ranking", "main", "rank_sequence"]


class _RankCounter:
    """Decoder observer: per block, the stale ranking at every round and the commits that followed."""

    def __init__(self) -> None:
        self.blocks: dict[int, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}

    def on_commit(self, block, state, eligible, stale, pos, tok) -> None:
        # Only what the counts need: the stale confidence [L], not the logits.
        self.blocks.setdefault(block, []).append((eligible.clone(), stale.confidence.clone(), pos))

    def count_into(self, counts: Counter[tuple[int, ...]]) -> int:
        rounds = 0
        for rows in self.blocks.values():
            for t in range(1, len(rows)):
                eligible = rows[t][0]
                ranking = confidence_ranking(rows[t - 1][1], eligible)
                seq = rank_sequence(ranking, [p for _, _, p in rows[t : t + MAX_DEPTH]])
                for j in range(1, len(seq) + 1):
                    counts[tuple(seq[:j])] += 1
                rounds += 1
        return rounds


def calibrate(target_dir: str, n_prompts: int, keep: int = 64, seed: int = 0, task: str = "spot_arith",
              split: str = "validation") -> RankGraph:
    """Control (T=0) trajectories on prompts disjoint from the evaluation split: spot_arith's generator split
    'val', or the given split of any lm-eval task. The graph stores rank-path counts only."""
    from tqdm import tqdm

    from lm_eval_spot.arith.generator import make_prompt, make_split
    from lm_eval_spot.settings.args import parse_args
    from lm_eval_spot.decoding.loop import DecodeConfig, decode
    from lm_eval_spot.families import load_target

    loaded = load_target(parse_args({"pretrained": target_dir, "mode": "control"}))
    counts: Counter[tuple[int, ...]] = Counter()
    rounds = 0
    if task == "spot_arith":
        prompts = [make_prompt(doc["question"]) for doc in make_split("val", n_prompts)]
    else:
        from lm_eval_spot.training.prompts import task_prompts

        prompts = task_prompts(task, split, n_prompts)
    for prompt in tqdm(prompts, desc="calibrating draft graph"):
        ids = loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        obs = _RankCounter()
        decode(loaded.adapter, ids, DecodeConfig(max_gen_toks=96), seed, observer=obs)
        rounds += obs.count_into(counts)
    best = sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))[:keep]
    return RankGraph(tuple(n for n, _ in best), tuple(c for _, c in best), rounds, str(target_dir))


def main(argv: list[str] | None = None) -> None:
    from lm_eval_spot.settings.args import default_target_path

    ap = argparse.ArgumentParser(prog="python -m lm_eval_spot.baselines.graph", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(default_target_path()), help="target checkpoint folder")
    ap.add_argument("--n-prompts", type=int, default=300)
    ap.add_argument("--keep", type=int, default=64, help="graph nodes kept (>= the largest budget used)")
    ap.add_argument("--tasks", default="spot_arith", help="lm-eval task whose prompts calibrate the graph")
    ap.add_argument("--split", default="validation", help="that task's split (not the one you evaluate on)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    g = calibrate(a.target, a.n_prompts, a.keep, task=a.tasks, split=a.split)
    g.save(Path(a.out))
    log.info("wrote %s: %d nodes from %d rounds; top: %s", a.out, len(g.nodes), g.rounds,
             ", ".join(f"{n}:{c}" for n, c in zip(g.nodes[:8], g.counts[:8], strict=False)))


if __name__ == "__main__":
    main()
