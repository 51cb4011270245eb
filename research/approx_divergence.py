"""How far `cache=approx` (Fast-dLLM's prefix cache) moves control decoding away from the exact whole-canvas
decoder, on tiny random-weight LLaDA and Dream models built from the official code in ../shared (needs ../shared
and transformers 4.57.x). Prints, per family and temperature: the share of generations that differ and the
first differing position. Usage: python scripts/approx_divergence.py [--n 40] [--gen 32] [--block 8]"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.remote_fixtures import save_checkpoint, tokenizer_mask_id  # noqa: E402
from helpers.targets import build  # noqa: E402

from lm_eval_spot.settings.args import parse_args  # noqa: E402
from lm_eval_spot.decoding.loop import DecodeConfig, decode  # noqa: E402
from lm_eval_spot.families import load_target  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--block", type=int, default=8)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 290, (int(torch.randint(3, 20, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(a.n)]
    print("| family | T | generations differing | first differing position (median, min) | n |")
    print("|---|---|---|---|---|")
    for fam in ("llada", "dream"):
        path = save_checkpoint(build(fam, tokenizer_mask_id()), root / fam)
        exact, approx = (load_target(parse_args({"pretrained": str(path), "mode": "control", "block_len": a.block,
                                                 "cache": c})).adapter for c in ("none", "approx"))
        for T in (0.0, 1.0):
            cfg = DecodeConfig(max_gen_toks=a.gen, temperature=T)
            firsts = []
            for i, p in enumerate(prompts):
                e, x = decode(exact, p, cfg, seed=i).token_ids, decode(approx, p, cfg, seed=i).token_ids
                if e != x:
                    firsts.append(next((j for j, (u, v) in enumerate(zip(e, x)) if u != v), min(len(e), len(x))))
            where = f"{statistics.median(firsts):.0f}, {min(firsts)}" if firsts else "-"
            print(f"| {fam} | {T:g} | {len(firsts)}/{len(prompts)} ({len(firsts) / len(prompts):.0%}) | {where} | {len(prompts)} |")


if __name__ == "__main__":
    main()
