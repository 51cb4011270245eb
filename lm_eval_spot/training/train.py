"""Train a SPOT drafter for a target: collect control trajectories, train the order model, evaluate it.

    python -m lm_eval_spot.training all --out runs/drafter [--target PATH] [--n-prompts 1200]

Sub-steps `collect`, `train`, `evaluate` can be run alone; each resumes from what it already wrote (trajectory
shards and training checkpoints are written atomically). The result is `OUT/drafter/` (safetensors + JSON).
`train --init DRAFTER` starts from a drafter's weights and architecture (fine-tuning, e.g. the shipped transfer
drafter on new targets' trajectories, usually with a lower --lr).

Resuming: `train` checkpoints to OUT/train_ckpt.pt every --ckpt-every steps (and at the end or the --minutes
limit) with everything the loop consumes: weights, optimizer, the data-sampling generator and torch's global RNG
(dropout). A killed run rerun with the same command ends with the same weights, bit for bit, as one never stopped
(on the same machine and thread count). The checkpoint records the settings that shape the weights (model, seed,
batch, lr, schedule, data split, number of training units) and a rerun with other settings is refused. The one
exception is --steps, which a rerun may raise to train further: the cosine schedule then stretches to the new
total from the checkpoint's step on, so that is a continuation, not the run a fresh --steps N would give; lowering
--steps below the checkpoint's is refused. --minutes and --ckpt-every only decide when to stop and save.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from lm_eval_spot.drafter.data import Trajectories, TrajectoryRecorder, save_tensors_atomic
from lm_eval_spot.drafter.factored import FactoredConfig
from lm_eval_spot.drafter.features import TOP_K
from lm_eval_spot.training.fit import TrainConfig, evaluate_groups, load_groups, load_trajectories, train
from lm_eval_spot.drafter.model import (DrafterMeta, OrderModelConfig, build_model, feature_version_of, n_params,
                                        read_drafter, save_drafter)

__all__ = ["TrainConfig", "collect", "load_trajectories", "main", "train", "training_prompts"]

log = logging.getLogger(__name__)


SHARD = 100  # prompts per trajectory shard


def training_prompts(task: str, n: int, prompts_file: str | None) -> list[str]:
    if prompts_file:
        rows = [json.loads(x) for x in Path(prompts_file).read_text().splitlines() if x.strip()]
        return [r["prompt"] for r in rows][:n]
    if task != "spot_arith":
        from lm_eval_spot.training.prompts import task_prompts

        return task_prompts(task, "train", n)  # any lm-eval task with a training split
    from lm_eval_spot.arith.generator import make_prompt, make_split

    return [make_prompt(p["question"]) for p in make_split("train", n)]


def collect(out: Path, target: str | None, prompts: list[str], block_len: int | None, max_gen_toks: int,
            model_args: dict | None = None, chat: bool = False, temperature: float = 0.0) -> None:
    """Control decoding at T=0 over the prompts; one trajectory shard per SHARD prompts (skipped if present).
    model_args: spot-dlm model args for the target (card=, trust_remote_code=, device=, dtype=, ...); chat: wrap
    each prompt in the tokenizer's chat template as a user turn (as `lm_eval --apply_chat_template` does)."""
    from lm_eval_spot.settings.cards import parse_model_args
    from lm_eval_spot.decoding.loop import DecodeConfig, decode
    from lm_eval_spot.families import load_target

    raw = {**(model_args or {}), "mode": "control", **({"pretrained": target} if target else {}),
           **({"block_len": block_len} if block_len else {})}
    loaded = load_target(parse_model_args(raw))
    target = target or (model_args or {}).get("pretrained") or (model_args or {}).get("card")
    adapter, tok = loaded.adapter, loaded.tokenizer
    shard_dir = out / "trajectories"
    shard_dir.mkdir(parents=True, exist_ok=True)
    cfg = DecodeConfig(max_gen_toks=max_gen_toks, temperature=temperature)
    n_shards = math.ceil(len(prompts) / SHARD)
    bar = tqdm(total=len(prompts), desc=f"collect (control, T={temperature:g})")
    for s in range(n_shards):
        path = shard_dir / f"shard_{s:04d}.safetensors"
        chunk = prompts[s * SHARD : (s + 1) * SHARD]
        if path.exists():
            bar.update(len(chunk))
            continue
        parts = []
        for i, prompt in enumerate(chunk):
            sid = s * SHARD + i
            rec = TrajectoryRecorder(sid, block_offset=sid * 1000)
            if chat:
                prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            decode(adapter, ids, cfg, seed=0 if temperature == 0 else sid, observer=rec)
            t = rec.result(adapter.info.mask_id)
            if t is not None:
                parts.append(t)
            bar.update(1)
        save_tensors_atomic(Trajectories.concat(parts).to_dict(), path)
    bar.close()
    meta = {"target": target or "embedded", "block_len": adapter.info.block_len, "prompts": len(prompts),
            "temperature": temperature}
    tmp = out / "collect.json.tmp"  # atomic like the shards: a kill mid-write must not leave half a file
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / "collect.json")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lm_eval_spot.training", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["collect", "train", "evaluate", "all"])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--data", type=Path, nargs="+", default=None,
                    help="train/evaluate: trajectory folders to read (default: OUT): collect's, or recorded by "
                    "spot-dlm runs with drafter_data=FOLDER; folders at several block lengths train one model")
    ap.add_argument("--target", default=None, help="target checkpoint folder (default: the embedded target)")
    ap.add_argument("--model_args", default="", help="spot-dlm model args of the target, as for lm_eval "
                    "(e.g. card=sdar-4b-chat,device=cuda,dtype=bfloat16)")
    ap.add_argument("--apply-chat-template", action="store_true", help="prompts as chat user turns")
    ap.add_argument("--task", default="spot_arith")
    ap.add_argument("--prompts-file", default=None, help="JSONL with a 'prompt' field (instead of --task)")
    ap.add_argument("--n-prompts", type=int, default=1200)
    ap.add_argument("--block-len", type=int, default=None)
    ap.add_argument("--max-gen-toks", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="collect: decoding temperature of the control trajectories (T>0 samples, seed = prompt index)")
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--batch", type=int, default=None,
                    help="examples per step (encoder, default 256) or roots per step (factored, default 48)")
    ap.add_argument("--arch", choices=["factored", "encoder"], default="factored",
                    help="factored: one encoder pass per round (default); encoder: one pass per tree node (v1)")
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--ckpt-every", type=int, default=TrainConfig.ckpt_every, help="steps between checkpoints")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--d-model", type=int, default=128, help="order model width")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--d-ff", type=int, default=None, help="feed-forward width (default 448 factored, 512 encoder)")
    ap.add_argument("--d-pair", type=int, default=FactoredConfig.d_pair, help="factored only: width of the pair tables")
    ap.add_argument("--top-k", type=int, default=TOP_K,
                    help=f"factored only: stale top-k probabilities read per slot (at most {TOP_K}, what trajectories store)")
    ap.add_argument("--no-slot-embedding", action="store_true",
                    help="factored only: no slot-index embedding (the model sees where slots are only through the data)")
    ap.add_argument("--relative-slots", action="store_true",
                    help="factored only: slot place as a fraction of the block (with --no-slot-embedding: a drafter "
                    "for every block length)")
    ap.add_argument("--init", type=Path, default=None,
                    help="train: start from this drafter folder's weights (its architecture replaces the size "
                    "flags): fine-tune a drafter on new targets' trajectories")
    ap.add_argument("--lr", type=float, default=TrainConfig.lr, help="peak learning rate (cosine to 0)")
    ap.add_argument("--dropout", type=float, default=0.0, help="order model dropout while training (default none)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads (use 1 when another job shares the cores: OpenMP spin-waits collapse)")
    args = ap.parse_args(argv)
    if args.ckpt_every < 1:
        ap.error("--ckpt-every must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(max(1, args.threads))
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    size = {"d_model": args.d_model, "n_heads": args.heads, "n_layers": args.layers}
    model_cfg: OrderModelConfig | FactoredConfig
    if args.init is not None:
        model_cfg = read_drafter(args.init)[0].cfg  # the size flags give way to the drafter's own
    elif args.arch == "factored":
        if not 1 <= args.top_k <= TOP_K:
            ap.error(f"--top-k must be in 1..{TOP_K} (trajectories store the top {TOP_K}), got {args.top_k}")
        model_cfg = FactoredConfig(**size, d_ff=args.d_ff or FactoredConfig.d_ff, dropout=args.dropout,
                                   slot_embedding=not args.no_slot_embedding, d_pair=args.d_pair, top_k=args.top_k,
                                   relative_slots=args.relative_slots)
    else:
        model_cfg = OrderModelConfig(**size, d_ff=args.d_ff or OrderModelConfig.d_ff, dropout=args.dropout)
    factored = isinstance(model_cfg, FactoredConfig)
    batch = args.batch or (48 if factored else 256)
    cfg = TrainConfig(steps=args.steps, batch=batch, minutes=args.minutes, seed=args.seed, lr=args.lr,
                      ckpt_every=args.ckpt_every, model=model_cfg,
                      init=str(args.init.resolve()) if args.init is not None else None)
    t0 = time.time()
    if args.step in ("collect", "all"):
        from lm_eval.utils import simple_parse_args_string

        collect(out, args.target, training_prompts(args.task, args.n_prompts, args.prompts_file), args.block_len,
                args.max_gen_toks, simple_parse_args_string(args.model_args) if args.model_args else {},
                args.apply_chat_template, args.temperature)
    data = args.data or [out]
    if args.step in ("train", "all"):
        train(out, cfg, data)
    if args.step in ("evaluate", "all", "train"):
        groups = load_groups(data)
        model = build_model(asdict(cfg.model))
        model.load_state_dict(torch.load(out / "train_ckpt.pt", weights_only=True)["model"])
        model.eval()
        scores = evaluate_groups(model, groups, cfg)
        infos = [json.loads((d / "collect.json").read_text()) for d in data]
        targets = sorted({str(i["target"]) for i in infos})
        # Recorded folders do not know their prompt count in advance: count the requests that left records.
        prompts = (sum(int(i["prompts"]) for i in infos) if all(i.get("prompts") is not None for i in infos)
                   else sum(int(g.sample_id.max()) + 1 for g in groups))
        meta = DrafterMeta(
            feature_version=feature_version_of(model), top_k=model.cfg.top_k,
            block_lens=tuple(sorted({int(i["block_len"]) for i in infos})),
            target=targets[0] if len(targets) == 1 else "+".join(targets),
            task=args.task if not args.prompts_file else args.prompts_file,
            heldout_accuracy=scores["accuracy"], heldout_stale_conf_accuracy=scores["stale_conf_accuracy"],
            extra={"scores": scores, "train": asdict(cfg), "params": n_params(model),
                   "prompts": prompts, "data": [str(d) for d in data], "wall_s_this_run": round(time.time() - t0, 1)},
        )
        save_drafter(model, meta, out / "drafter")
        print(json.dumps(scores, indent=2, default=str))


if __name__ == "__main__":
    main()
