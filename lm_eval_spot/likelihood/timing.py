"""Time scoring a question's choices grouped (the context prefilled once, the choices' first blocks in shared
forwards) against one choice at a time, on the embedded target with random token contexts.

    python -m lm_eval_spot.likelihood.timing --threads 2
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from lm_eval_spot.settings.args import parse_args
from lm_eval_spot.families import load_target
from lm_eval_spot.likelihood.scorer import LikelihoodConfig, Pair, score_pairs

SHAPES = ((256, 1), (256, 10), (448, 1))  # (context tokens, continuation tokens): MMLU-like and ARC-like


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    loaded = load_target(parse_args({"mode": "control"}))
    rng = random.Random(0)
    V = loaded.adapter.info.vocab_size
    print("| context | continuation | one choice at a time (s) | grouped (s) | speed-up |")  # noqa: T201
    print("|---|---|---|---|---|")  # noqa: T201
    for ctx_len, cont_len in SHAPES:
        pairs = []
        for q in range(a.questions):
            ctx = tuple(rng.randrange(3, V) for _ in range(ctx_len))
            pairs += [Pair(ctx, tuple(rng.randrange(3, V) for _ in range(cont_len)), q) for _ in range(a.choices)]
        best = {}
        for name, groups in (("alone", [[i] for i in range(len(pairs))]), ("grouped", None)):
            times = []
            for _ in range(a.repeats):
                t = time.perf_counter()
                score_pairs(loaded.adapter, pairs, LikelihoodConfig(), batch_size=a.batch_size, groups=groups)
                times.append(time.perf_counter() - t)
            best[name] = min(times)
        print(f"| {ctx_len} | {cont_len} | {best['alone']:.2f} | {best['grouped']:.2f} | "  # noqa: T201
              f"{best['alone'] / best['grouped']:.2f}x |")


if __name__ == "__main__":
    main()
