"""Decoding-dynamics report of a target on a task: what a drafter could learn (paper section 3.1).

    python -m lm_eval_spot.analysis [--target PATH] [--n 500] [--out report.json]

Runs control decoding at T=0 on the spot_arith test split (or --prompts-file) and reports, over all rounds:
how often the next commit is the leftmost masked slot, how often the previous forward's most confident
remaining slot is committed next, how often the stale argmax token is the committed one, the stale top-8
coverage of the next commit, and the generated length.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from lm_eval_spot.drafter.data import Trajectories, TrajectoryRecorder


def dynamics(traj: Trajectories) -> dict[str, float]:
    """Rates over rounds; 'stale' statistics use rounds with a previous round in the same block."""
    R = traj.pos.shape[0]
    elig = traj.eligible
    leftmost = torch.where(elig, torch.arange(elig.shape[1]).expand_as(elig), elig.shape[1]).min(-1).values
    has_prev = torch.zeros(R, dtype=torch.bool)
    has_prev[1:] = traj.block_id[1:] == traj.block_id[:-1]
    r = torch.arange(R)[has_prev]
    stale_conf = traj.topk[r - 1, :, 0].float().masked_fill(~elig[r], -1.0)
    prev_top = stale_conf.argmax(-1)
    top8 = stale_conf.topk(min(8, stale_conf.shape[1]), -1).indices
    stale_tok = traj.top1[r - 1, traj.pos[r]].long()
    return {
        "rounds": R,
        "leftmost_next_rate": float((traj.pos == leftmost).float().mean()),
        "prev_top_conf_next_rate": float((prev_top == traj.pos[r]).float().mean()),
        "prev_top8_conf_covers_next_rate": float((top8 == traj.pos[r, None]).any(-1).float().mean()),
        "stale_argmax_token_rate": float((stale_tok == traj.tok[r]).float().mean()),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lm_eval_spot.analysis", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target checkpoint folder (default: the embedded target)")
    ap.add_argument("--prompts-file", default=None, help="JSONL with a 'prompt' field (default: spot_arith test)")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--block-len", type=int, default=None)
    ap.add_argument("--max-gen-toks", type=int, default=256)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from lm_eval_spot.config import parse_args
    from lm_eval_spot.decoding.loop import DecodeConfig, decode
    from lm_eval_spot.loading import load_target

    if args.prompts_file:
        prompts = [json.loads(x)["prompt"] for x in Path(args.prompts_file).read_text().splitlines() if x.strip()]
    else:
        from lm_eval_spot.arith.generator import make_prompt, make_split

        prompts = [make_prompt(p["question"]) for p in make_split("test", args.n)]
    prompts = prompts[: args.n]
    raw = {"mode": "control", **({"pretrained": args.target} if args.target else {}),
           **({"block_len": args.block_len} if args.block_len else {})}
    loaded = load_target(parse_args(raw))
    cfg = DecodeConfig(max_gen_toks=args.max_gen_toks)
    parts, lengths, nfe = [], [], []
    for i, prompt in enumerate(tqdm(prompts, desc="control decoding (T=0)")):
        rec = TrajectoryRecorder(i, block_offset=i * 1000)
        ids = loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        res = decode(loaded.adapter, ids, cfg, seed=0, observer=rec)
        lengths.append(len(res.token_ids))
        nfe.append(res.nfe.total)
        t = rec.result(loaded.adapter.info.mask_id)
        if t is not None:
            parts.append(t)
    report = {
        "target": args.target or "embedded",
        "block_len": loaded.adapter.info.block_len,
        "samples": len(prompts),
        "median_generated_tokens": statistics.median(lengths),
        "mean_nfe_control": statistics.mean(nfe),
        **dynamics(Trajectories.concat(parts)),
    }
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
