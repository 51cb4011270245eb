"""Decoding-dynamics report of a target on a task: the paper's section 3.1 measures, on any target.

    python -m research.analysis [--target PATH] [--drafter PATH] [--n 200] [--budget 8] [--out report.json]

Runs on the spot_arith test split (or --prompts-file), at T=0:
* control decoding, observed at every commit: by block index, how often the stale argmax token is the committed
  one, how often the previous forward's most confident remaining slot is committed next, how often the stale
  top-8 slots cover the next commit, and how often the next commit is the leftmost masked slot;
* the joint oracle (true order and tokens from that control run) at budgets {4, 8, 12, 20}: the NFE and
  wall-clock ceilings, and the NFE of the same oracle kept silent in each block's first round (the floor of
  any drafter that reads stale conditionals: there are none in that round);
* SPOT at --budget: the accepted length per round and the cause of each round's first rejection (position miss,
  token miss, budget exhausted, block end).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from lm_eval_spot.decoding.tree import DraftTree

log = logging.getLogger(__name__)

CAUSES = ("position_miss", "token_miss", "budget_exhausted", "block_end")


class DynamicsObserver:
    """Control-run observer: per block index, hit counts of the stale-conditional predictors (float32)."""

    def __init__(self) -> None:
        self.counts: dict[int, Counter[str]] = defaultdict(Counter)
        self._prev: tuple[int, torch.Tensor] | None = None

    def on_commit(self, block, state, eligible, stale, pos, tok) -> None:
        c = self.counts[block]
        c["rounds"] += 1
        slots = eligible.nonzero().flatten()
        c["leftmost"] += int(pos == int(slots.min()))
        if self._prev is not None and self._prev[0] == block:
            prev = self._prev[1]
            conf = prev.confidence.masked_fill(~eligible, -1.0)
            c["stale_rounds"] += 1
            c["prev_top_conf_next"] += int(int(conf.argmax()) == pos)  # argmax: lowest slot on ties, as the target
            c["top8_cover"] += int(pos in conf.topk(min(8, int(eligible.sum()))).indices.tolist())
            c["stale_argmax_token"] += int(int(prev.top_ids[pos, 0]) == tok)
        self._prev = (block, stale)


class RejectionObserver:
    """SPOT-run observer: accepted length per round and the cause of the first rejection."""

    def __init__(self) -> None:
        self.accepted: Counter[int] = Counter()
        self.causes: Counter[str] = Counter()

    def on_commit(self, *args: Any) -> None:
        pass

    def on_verify(self, block: int, tree: DraftTree, path: list[int], tpos: torch.Tensor, ttok: torch.Tensor) -> None:
        if not tree.size:
            return  # a round that drafted nothing (a block's first round) has nothing to reject
        self.accepted[len(path)] += 1
        self.causes[rejection_cause(tree, path, tpos)] += 1


def rejection_cause(tree: DraftTree, path: list[int], tpos: torch.Tensor) -> str:
    last = path[-1] if path else 0
    if int(tpos[last]) < 0:
        return "block_end"
    kids = [j + 1 for j, p in enumerate(tree.parent) if p == last]
    if not kids:
        return "budget_exhausted"
    if any(tree.pos[k - 1] == int(tpos[last]) for k in kids):
        return "token_miss"
    return "position_miss"


def _rates(c: Counter[str]) -> dict[str, float]:
    s = max(1, c["stale_rounds"])
    return {
        "rounds": c["rounds"],
        "leftmost_next_rate": c["leftmost"] / max(1, c["rounds"]),
        "stale_argmax_token_rate": c["stale_argmax_token"] / s,
        "prev_top_conf_next_rate": c["prev_top_conf_next"] / s,
        "prev_top8_conf_covers_next_rate": c["top8_cover"] / s,
    }


def analyse(loaded: Any, prompts: list[str], drafter_path: Path, budget: int, oracle_budgets: tuple[int, ...],
            max_gen_toks: int, lookahead: bool = True) -> dict[str, Any]:
    from lm_eval_spot.baselines.oracle import CommitLog, OracleProposer
    from lm_eval_spot.decoding.loop import DecodeConfig, decode
    from lm_eval_spot.drafter.model import load_drafter
    from lm_eval_spot.settings.proposers import MethodSpec, make_proposer

    ad = loaded.adapter
    cfg = DecodeConfig(max_gen_toks=max_gen_toks)
    ahead = DecodeConfig(max_gen_toks=max_gen_toks, lookahead=True)  # the default decoder's cross-block lookahead
    spot = make_proposer(MethodSpec("spot", budget), load_drafter(drafter_path, ad.info.block_len)[0])
    dyn = DynamicsObserver()
    rej = RejectionObserver()
    control_nfe, control_wall, lengths = [], [], []
    oracle_nfe: dict[int, list[int]] = defaultdict(list)
    oracle_ratio: dict[int, list[float]] = defaultdict(list)
    floor_nfe: dict[int, list[int]] = defaultdict(list)
    floor_ahead_nfe: dict[int, list[int]] = defaultdict(list)
    spot_nfe = []
    for i, prompt in enumerate(tqdm(prompts, desc="analysis (control, oracle, SPOT)")):
        ids = loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        dyn._prev = None
        commits = CommitLog()

        class Both:
            def on_commit(self, *a: Any) -> None:
                dyn.on_commit(*a)
                commits.on_commit(*a)

        ctrl = decode(ad, ids, cfg, seed=i, observer=Both())
        control_nfe.append(ctrl.nfe.total)
        lengths.append(len(ctrl.token_ids))
        plain = decode(ad, ids, cfg, seed=i)  # timed without the observer's work
        control_wall.append(plain.wall_s)
        for D in oracle_budgets:
            r = decode(ad, ids, cfg, seed=i, proposer=OracleProposer(commits, D))
            oracle_nfe[D].append(r.nfe.total)
            oracle_ratio[D].append(plain.wall_s / r.wall_s)
            floor_nfe[D].append(decode(ad, ids, cfg, seed=i, proposer=OracleProposer(commits, D, stale_only=True)).nfe.total)
            floor_ahead_nfe[D].append(
                decode(ad, ids, ahead, seed=i, proposer=OracleProposer(commits, D, stale_only=True)).nfe.total)
        spot_nfe.append(decode(ad, ids, ahead if lookahead else cfg, seed=i, proposer=spot, observer=rej).nfe.total)
    total = Counter()
    for c in dyn.counts.values():
        total.update(c)
    cnfe = statistics.mean(control_nfe)
    n_rounds = sum(rej.accepted.values())
    return {
        "samples": len(prompts),
        "block_len": ad.info.block_len,
        "median_generated_tokens": statistics.median(lengths),
        "control_nfe_per_sample": cnfe,
        "dynamics": _rates(total),
        "dynamics_by_block": {str(b): _rates(c) for b, c in sorted(dyn.counts.items())},
        "oracle": {
            str(D): {"nfe_per_sample": statistics.mean(v), "nfe_reduction": cnfe / statistics.mean(v),
                     "throughput_ratio_median": statistics.median(oracle_ratio[D]),
                     # the same oracle silent in each block's first round: the floor of stale-reading drafters
                     "stale_only_nfe_per_sample": statistics.mean(floor_nfe[D]),
                     # ... with cross-block lookahead: silent only in the first block's first round
                     "stale_only_lookahead_nfe_per_sample": statistics.mean(floor_ahead_nfe[D])}
            for D, v in oracle_nfe.items()
        },
        "spot": {
            "budget": budget,
            "lookahead": lookahead,
            "nfe_per_sample": statistics.mean(spot_nfe),
            "nfe_reduction": cnfe / statistics.mean(spot_nfe),
            "drafting_rounds": n_rounds,
            "accepted_length_histogram": {str(k): v for k, v in sorted(rej.accepted.items())},
            "mean_accepted_per_round": sum(k * v for k, v in rej.accepted.items()) / max(1, n_rounds),
            "first_rejection_cause_rate": {c: rej.causes[c] / max(1, n_rounds) for c in CAUSES},
        },
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m research.analysis", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target checkpoint folder (default: the embedded target)")
    ap.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    ap.add_argument("--prompts-file", default=None, help="JSONL with a 'prompt' field (default: --tasks)")
    ap.add_argument("--tasks", default="spot_arith", help="lm-eval generation task whose requests are analysed")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--budget", type=int, default=8, help="SPOT budget for accepted lengths and rejection causes")
    ap.add_argument("--oracle-budgets", default="4,8,12,20")
    ap.add_argument("--block-len", type=int, default=None)
    ap.add_argument("--max-gen-toks", type=int, default=256)
    ap.add_argument("--no-lookahead", dest="lookahead", action="store_false",
                    help="SPOT's rows without cross-block lookahead (the oracle floors are given both ways)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from lm_eval_spot.settings.cards import parse_model_args
    from lm_eval_spot.settings.args import drafter_for
    from lm_eval_spot.families import load_target

    if args.prompts_file:
        prompts = [json.loads(x)["prompt"] for x in Path(args.prompts_file).read_text().splitlines() if x.strip()]
    else:
        from lm_eval_spot.training.prompts import TaskSource

        prompts = [p.context for p in TaskSource(args.tasks, args.n).prompts]
    prompts = prompts[: args.n]
    raw = {"mode": "control", **({"pretrained": args.target} if args.target else {}),
           **({"block_len": args.block_len} if args.block_len else {})}
    loaded = load_target(parse_model_args(raw))
    report = {"target": args.target or "embedded",
              **analyse(loaded, prompts, drafter_for(parse_model_args({**raw, "drafter": args.drafter})), args.budget,
                        tuple(int(b) for b in args.oracle_budgets.split(",")), args.max_gen_toks, args.lookahead)}
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    log.info("analysis report%s\n%s", f" (written to {args.out})" if args.out else "", text)


if __name__ == "__main__":
    main()
