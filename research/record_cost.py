"""What recording drafter training data (`drafter_data=`) costs a control run: wall time and disk.

    python -m research.record_cost --n 200 --repeats 3 --threads 1 --out docs/results/record_cost

Every prompt is decoded by control without and with recording, `repeats` times each, the two alternating (which
goes first alternates too), so the machine's drift hits both alike. Recording is timed as a run pays it: the decode
with its observer (the batched summaries at the request's end), handing the request to the data writer, and the
shard writes. Per prompt the fastest decode of each kind is kept (outputs are deterministic; the minimum is the
least disturbed). Reports the added time as a share of control's (sum over prompts, and the median of per-prompt
ratios), recording's own work timed inside the run (the observer's share of the decode, the hand-over and the
shard writes; the paired difference carries this machine's 10-40% run-to-run spread, this does not), the shards'
bytes and the commits per 1,000 generated tokens, and checks that recording changed no id.
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from research.report import report

log = logging.getLogger("research.record_cost")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from lm_eval_spot.settings.args import parse_args
    from lm_eval_spot.decoding.loop import DecodeConfig, decode
    from lm_eval_spot.drafter.recording import DrafterDataWriter
    from lm_eval_spot.families import load_target
    from lm_eval_spot.harness.until import make_stop_check
    from lm_eval_spot.training.prompts import TaskSource

    torch.set_num_threads(args.threads)
    loaded = load_target(parse_args({"pretrained": args.target, "device": "cpu", "mode": "control"}))
    adapter, tok = loaded.adapter, loaded.tokenizer
    info = adapter.info
    docs = TaskSource(args.tasks, args.n, None, eos=tok.eos_token).prompts
    decode_ids = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        # One writer per repeat, so every timed decode pays the hand-over and, every FLUSH_EVERY requests, the
        # shard write, as a run does; the first writer's folder is the run's records.
        root = Path(args.data or tmp)
        writers = [DrafterDataWriter(root / ("records" if r == 0 else f"repeat{r}"), args.target, info.block_len,
                                     info.mask_id, rank=0) for r in range(args.repeats)]
        off_s, on_s, own_s, tokens, same = [], [], [], 0, 0
        bar = tqdm(total=len(docs) * args.repeats * 2, desc="record_cost", unit="decode")
        for i, doc in enumerate(docs):
            ids = tok(doc.context, add_special_tokens=False)["input_ids"]
            cfg = DecodeConfig(max_gen_toks=args.max_gen_toks or doc.max_gen_toks, temperature=args.temperature)
            stop = make_stop_check(decode_ids, list(doc.until))
            best = {False: float("inf"), True: float("inf")}
            outs: dict[bool, list[int]] = {}
            own = []
            for r in range(args.repeats):
                for recording in ((False, True) if (i + r) % 2 == 0 else (True, False)):
                    t0 = time.perf_counter()
                    if recording:
                        rec = writers[r].recorder()
                        res = decode(adapter, ids, cfg, args.seed + i, stop_check=stop, observer=rec)
                        t1 = time.perf_counter()
                        writers[r].add(rec)
                        own.append(res.observe_s + time.perf_counter() - t1)
                    else:
                        res = decode(adapter, ids, cfg, args.seed + i, stop_check=stop)
                    best[recording] = min(best[recording], time.perf_counter() - t0)
                    outs[recording] = res.token_ids
                    bar.update()
            off_s.append(best[False])
            on_s.append(best[True])
            own_s.append(statistics.median(own))
            tokens += len(outs[False])
            same += outs[False] == outs[True]
        flushes = []
        for w in writers:
            t0 = time.perf_counter()
            w.flush()
            flushes.append(time.perf_counter() - t0)
        flush_s = min(flushes)
        bar.close()
        summary = writers[0].summary()
    on_total = sum(on_s) + flush_s
    ratios = [b / a for a, b in zip(off_s, on_s, strict=True)]
    return {
        "command": "python -m research.record_cost " + " ".join(args.argv),
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": args.threads},
        "target": args.target, "block_len": info.block_len, "vocab": info.vocab_size, "prompts": len(docs),
        "repeats": args.repeats, "temperature": args.temperature,
        "ids_unchanged": f"{same}/{len(docs)}",
        "control_s": sum(off_s), "recording_s": on_total, "last_flush_s": flush_s,
        "added_pct_total": 100 * (on_total / sum(off_s) - 1),
        "added_pct_median": 100 * (statistics.median(ratios) - 1),
        # Timed inside the run (the decoder's observer work plus the hand-over and shard writes), free of the
        # machine's run-to-run spread that the paired difference above carries; it misses only what recording
        # does to the caches the next forward finds.
        "own_s": sum(own_s) + flush_s, "own_pct": 100 * (sum(own_s) + flush_s) / sum(off_s),
        "generated_tokens": tokens, "commits": summary["commits"], "shards": summary["shards"],
        "bytes": summary["bytes"], "bytes_per_1k_tokens": 1000 * summary["bytes"] / max(1, tokens),
        "commits_per_1k_tokens": 1000 * summary["commits"] / max(1, tokens),
        "per_prompt_ms": {"control": [round(1000 * x, 3) for x in off_s], "recording": [round(1000 * x, 3) for x in on_s]},
    }


def table(res: dict[str, Any]) -> str:
    return "\n".join([
        f"`{res['command']}`",
        "",
        "| prompts | control s | with recording s | added (sum) | added (median per prompt) | recording's own work | "
        "ids unchanged | commits / 1k tokens | MB / 1k tokens |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {res['prompts']} | {res['control_s']:.2f} | {res['recording_s']:.2f} | {res['added_pct_total']:+.1f}% | "
        f"{res['added_pct_median']:+.1f}% | {res['own_pct']:.1f}% | {res['ids_unchanged']} | "
        f"{res['commits_per_1k_tokens']:.0f} | {res['bytes_per_1k_tokens'] / 1e6:.2f} |",
    ])


def main(argv: list[str] | None = None) -> None:
    from lm_eval_spot.settings.args import default_target_path

    raw = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m research.record_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(default_target_path()), help="checkpoint folder (= pretrained=)")
    ap.add_argument("--tasks", default="spot_arith", help="one lm-eval generation task (its prompts)")
    ap.add_argument("--n", type=int, default=100, help="the task's first n requests")
    ap.add_argument("--repeats", type=int, default=3, help="decodes of each kind per prompt (the fastest is kept)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-gen-toks", type=int, default=0, help="generation cap (0: the task's max_gen_toks)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=None,
                    help="keep the recorded shards in DATA/records (and each repeat's in DATA/repeatR; default: a temp "
                         "folder)")
    ap.add_argument("--out", default=None, help="folder for results.json and table.md")
    a = ap.parse_args(raw)
    if a.n < 1 or a.repeats < 1 or a.threads < 1 or a.temperature < 0:
        ap.error("--n, --repeats and --threads must be >= 1, --temperature >= 0")
    a.argv = raw
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    res = run(a)
    report(log, res, table(res), Path(a.out) if a.out else None)


if __name__ == "__main__":
    main()
