"""Time a later block's first forward (one finished block rides along) against a plain round, by replica rows.

    .venv/bin/python scripts/time_first_round.py [--threads 2] [--repeats 12]

Embedded target; prints, per row count R, the median ms of (first round, plain round). Run it alone: two jobs on
2 cores distort each other's timings.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lm_eval_spot.settings.args import parse_args
from lm_eval_spot.families import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    adapter = load_target(parse_args({"mode": "control", "device": "cpu"})).adapter
    info, L = adapter.info, adapter.info.block_len
    filler = next(t for t in range(info.vocab_size) if t != info.mask_id and t not in info.stop_ids)
    block = torch.full((L,), info.mask_id)
    block[: L // 3] = filler
    with torch.no_grad():
        for R in (1, 5, 9, 13, 21):
            first, plain = [], []
            for _ in range(args.repeats):
                session, _ = adapter.open([filler] * (2 * L + 3), 256)
                session.block_logits(block[None])
                session.commit_block(torch.full((L,), filler))
                for out in (first, plain):
                    t0 = time.perf_counter()
                    session.block_logits(block[None].repeat(R, 1))
                    out.append(1000 * (time.perf_counter() - t0))
            print(f"R={R}: first round {statistics.median(first):.2f} ms, plain round {statistics.median(plain):.2f} ms")


if __name__ == "__main__":
    main()
