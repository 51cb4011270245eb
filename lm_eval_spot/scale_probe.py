"""Per-round cost at real vocabulary width: a random-init target with a real family's shape, through the whole loop.

    python -m lm_eval_spot.scale_probe                       # Qwen3-shaped, vocab 151,936, hidden 1,024, 2 layers
    python -m lm_eval_spot.scale_probe --shape sdar-1.7b --device cuda --dtype bfloat16 --curve

Acceptance does not matter for what this measures (a random-weight drafter proposes the trees), only the cost
of a round: for control and SPOT (D = 8 by default) at T = 0 and T = 1 it reports the bytes read back from the
target's device per round (`HostLink`: on the CPU the same tensors a GPU run would move), and the share of the
decode's wall time spent outside the target forwards (drafting, transitions, verification, noise, transfers).
`--curve` adds the forward-time curve t(R) for R = 1..21 replicas. Writes JSON (--out) and logs a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from lm_eval_spot.adapters.base import TargetInfo
from lm_eval_spot.adapters.block_causal import BlockCausalAdapter
from lm_eval_spot.decoding.loop import DecodeConfig, decode
from lm_eval_spot.decoding.transfer import sync
from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
from lm_eval_spot.drafter.proposer import SpotProposer, TreeConfig

log = logging.getLogger("lm_eval_spot.scale_probe")

# Public shapes (config.json fields of the released checkpoints); weights are random.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-small": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128),
    "sdar-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128),
}
VOCAB = 151_936


def build_target(shape: str, layers: int | None, device: str, dtype: torch.dtype, block_len: int) -> BlockCausalAdapter:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = dict(SHAPES[shape])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    cfg = Qwen3Config(vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=True,
                      attn_implementation="sdpa", **fields)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    info = TargetInfo(mask_id=VOCAB - 1, stop_ids=frozenset(), block_len=block_len, grid_origin="zero",
                      exact_prefix_cache=True, vocab_size=VOCAB)
    return BlockCausalAdapter(model, info)


def forward_curve(adapter: BlockCausalAdapter, prompt: list[int], max_r: int, repeats: int) -> dict[int, float]:
    """Median seconds of one forward of R replicas of a half-committed block after the prompt's prefix."""
    L = adapter.info.block_len
    session, tail = adapter.open(prompt)
    block = torch.full((L,), adapter.info.mask_id, dtype=torch.long)
    block[: L // 2] = 7
    session.block_logits(block[None])  # stores the prefix
    out: dict[int, float] = {}
    for r in range(1, max_r + 1):
        times = []
        for _ in range(repeats):
            sync(adapter.device)
            t0 = time.perf_counter()
            session.block_logits(block[None].repeat(r, 1))
            sync(adapter.device)
            times.append(time.perf_counter() - t0)
        out[r] = statistics.median(times)
    return out


def batch_invariance(adapter: BlockCausalAdapter, prompt: list[int], max_r: int, trials: int) -> dict[int, dict]:
    """For R = 1..max_r: a state's logits as row r of R replicas (the others random states) against the same state
    alone: the largest absolute difference, and how often the target's transition (position, token) differs."""
    from lm_eval_spot.decoding.transition import transition

    info = adapter.info
    L, mask = info.block_len, info.mask_id
    session, _ = adapter.open(prompt)
    gen = torch.Generator().manual_seed(5)
    warm = torch.full((1, L), mask, dtype=torch.long)
    session.block_logits(warm)  # stores the prefix
    out: dict[int, dict] = {}
    for R in range(1, max_r + 1):
        worst, flips, rows = 0.0, 0, 0
        for _ in range(trials):
            states = torch.full((R, L), mask, dtype=torch.long)
            keep = torch.rand(R, L, generator=gen) < 0.5
            states[keep] = torch.randint(0, info.vocab_size - 1, (int(keep.sum()),), generator=gen)
            together = session.block_logits(states)
            for r in range(R):
                alone = session.block_logits(states[r : r + 1])[0]
                worst = max(worst, float((together[r] - alone).abs().max()))
                elig = (states[r] == mask)[None].to(adapter.device)
                if bool(elig.any()):
                    a = transition(alone[None].clone(), elig, 0.0, None)
                    b = transition(together[r : r + 1].clone(), elig, 0.0, None)
                    flips += int(not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])))
                    rows += 1
        out[R] = {"max_abs_logit_diff": worst, "transition_flips": flips, "rows": rows}
    return out


def probe(args: argparse.Namespace) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    adapter = build_target(args.shape, args.layers, args.device, dtype, args.block_len)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB - 1, (args.prompt_len,), generator=gen).tolist()
    torch.manual_seed(2)
    drafter = FactoredOrderModel(FactoredConfig(max_block_len=max(64, args.block_len))).to(args.device).eval()
    runs = []
    decode(adapter, prompt, DecodeConfig(max_gen_toks=4), seed=0)  # warm-up (allocator, kernels)
    for T in [] if args.skip_decode else args.temps:
        for mode in ("control", "spot"):
            prop = SpotProposer(drafter, TreeConfig(budget=args.budget)) if mode == "spot" else None
            res = decode(adapter, prompt, DecodeConfig(max_gen_toks=args.gen, temperature=T), seed=3, proposer=prop)
            outside = res.wall_s - res.timing.forward
            runs.append({
                "mode": mode, "temperature": T, "budget": args.budget if mode == "spot" else 0,
                "rounds": res.rounds, "nfe": res.nfe.total,
                "replicas_per_round": (sum(res.drafted) + res.rounds) / res.rounds,
                "host_bytes_per_round": res.host_bytes / res.rounds,
                "wall_s": res.wall_s, "forward_s": res.timing.forward, "draft_s": res.timing.draft,
                "rest_s": res.timing.rest, "outside_share": outside / res.wall_s,
            })
            log.info("%s T=%g: %d rounds, %.0f B/round to host, %.1f%% of %.1f s outside the forward", mode, T,
                     res.rounds, res.host_bytes / res.rounds, 100 * outside / res.wall_s, res.wall_s)
    out: dict[str, Any] = {
        "shape": args.shape, "layers": args.layers or SHAPES[args.shape]["num_hidden_layers"], "vocab": VOCAB,
        "dtype": args.dtype, "device": args.device, "block_len": args.block_len, "prompt_len": args.prompt_len,
        "gen": args.gen, "threads": torch.get_num_threads(), "runs": runs,
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "command": args.command,
    }
    if args.curve:
        out["forward_curve_s"] = forward_curve(adapter, prompt, 21, args.repeats)
    if args.invariance:
        out["batch_invariance"] = batch_invariance(adapter, prompt, args.invariance, args.trials)
    return out


def markdown(res: dict[str, Any]) -> str:
    lines = ["| mode | T | replicas/round | rounds | bytes to host / round | wall s | forward s | drafting s | "
             "rest s | outside the forward |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        lines.append(f"| {r['mode']} | {r['temperature']:g} | {r['replicas_per_round']:.1f} | {r['rounds']} | "
                     f"{r['host_bytes_per_round']:,.0f} | {r['wall_s']:.2f} | {r['forward_s']:.2f} | "
                     f"{r['draft_s']:.2f} | {r['rest_s']:.2f} | {100 * r['outside_share']:.1f}% |")
    if "batch_invariance" in res:
        inv = res["batch_invariance"]
        lines += ["", "| R | " + " | ".join(str(k) for k in inv) + " |", "|---|" + "---|" * len(inv),
                  "| max abs logit diff | " + " | ".join(f"{v['max_abs_logit_diff']:.2g}" for v in inv.values()) + " |",
                  "| transition flips / rows | " + " | ".join(f"{v['transition_flips']}/{v['rows']}"
                                                            for v in inv.values()) + " |"]
    if "forward_curve_s" in res:
        lines += ["", "| R | " + " | ".join(str(k) for k in res["forward_curve_s"]) + " |",
                  "|---|" + "---|" * len(res["forward_curve_s"]),
                  "| t(R) ms | " + " | ".join(f"{1e3 * v:.1f}" for v in res["forward_curve_s"].values()) + " |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import sys

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-small")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--block-len", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--gen", type=int, default=32, help="generated tokens per decode")
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--temps", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--curve", action="store_true", help="also time t(R) for R = 1..21")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--invariance", type=int, default=0, metavar="MAX_R",
                    help="also measure batch-shape invariance for R = 1..MAX_R replicas")
    ap.add_argument("--trials", type=int, default=2, help="random replica sets per R (--invariance)")
    ap.add_argument("--skip-decode", action="store_true", help="only the curve / invariance measurements")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.command = "python -m lm_eval_spot.scale_probe " + " ".join(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    res = probe(args)
    table = markdown(res)
    log.info("\n%s", table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "scale_probe.json").write_text(json.dumps(res, indent=2))
        (args.out / "scale_probe.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
