"""Train a SPOT drafter for a target: collect control trajectories, train the order model, evaluate it.

    python -m lm_eval_spot.drafter.train all --out runs/drafter [--target PATH] [--n-prompts 1200]

Sub-steps `collect`, `train`, `evaluate` can be run alone; each resumes from what it already wrote (trajectory
shards and training checkpoints are written atomically). The result is `OUT/drafter/` (safetensors + JSON).

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from lm_eval_spot.drafter.data import (Trajectories, TrajectoryRecorder, draftable_rounds, make_batch,
                                       make_round_batch, replay_examples, save_tensors_atomic)
from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
from lm_eval_spot.drafter.features import TOP_K
from lm_eval_spot.drafter.model import (DrafterMeta, DrafterModel, OrderModel, OrderModelConfig, build_model,
                                        feature_version_of, n_params, save_drafter)

log = logging.getLogger(__name__)

SHARD = 100  # prompts per trajectory shard


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 3000
    batch: int = 256  # examples per step (encoder) or roots per step, each with all its replay depths (factored)
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 100
    max_depth: int = 24  # deepest replayed prefix
    heldout_frac: float = 0.1
    seed: int = 0
    minutes: float | None = None  # stop early (and still save) after this much training time
    ckpt_every: int = 200  # steps between checkpoints
    # Both are ~0.62M parameters (the paper's size); the factored one runs its encoder once per round.
    model: OrderModelConfig | FactoredConfig = field(default_factory=FactoredConfig)


def training_prompts(task: str, n: int, prompts_file: str | None) -> list[str]:
    if prompts_file:
        rows = [json.loads(x) for x in Path(prompts_file).read_text().splitlines() if x.strip()]
        return [r["prompt"] for r in rows][:n]
    if task != "spot_arith":
        from lm_eval_spot.task_source import task_prompts

        return task_prompts(task, "train", n)  # any lm-eval task with a training split
    from lm_eval_spot.arith.generator import make_prompt, make_split

    return [make_prompt(p["question"]) for p in make_split("train", n)]


def collect(out: Path, target: str | None, prompts: list[str], block_len: int | None, max_gen_toks: int,
            model_args: dict | None = None, chat: bool = False, temperature: float = 0.0) -> None:
    """Control decoding at T=0 over the prompts; one trajectory shard per SHARD prompts (skipped if present).
    model_args: spot-dlm model args for the target (card=, trust_remote_code=, device=, dtype=, ...); chat: wrap
    each prompt in the tokenizer's chat template as a user turn (as `lm_eval --apply_chat_template` does)."""
    from lm_eval_spot.cards import parse_model_args
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


def shard_paths(folder: Path) -> list[Path]:
    """A data folder's shards in order: `collect`'s (trajectories/shard_*) then recorded ones (rec_*, by name,
    which starts with the time they were recorded)."""
    return sorted((folder / "trajectories").glob("shard_*.safetensors")) + sorted(folder.glob("rec_*.safetensors"))


def renumber(parts: list[Trajectories]) -> Trajectories:
    """Concatenate shards with sample and block ids made dense and unique across them (in shard order): shards
    recorded by different runs or ranks number their requests from 0 each."""
    out = Trajectories.concat(parts)
    shard = torch.cat([torch.full_like(p.pos, i) for i, p in enumerate(parts)])
    for name in ("sample_id", "block_id"):
        ids = getattr(out, name)
        key = shard * (1 << 40) + ids
        setattr(out, name, torch.unique(key, return_inverse=True)[1])
    return out


def load_trajectories(out: Path) -> Trajectories:
    from safetensors.torch import load_file

    shards = shard_paths(out)
    if not shards:
        raise SystemExit(f"no trajectories under {out} (trajectories/shard_* or rec_*): run the collect step, or a "
                         "spot-dlm run with drafter_data=FOLDER, first")
    return renumber([Trajectories.from_dict(load_file(str(p))) for p in shards])


def load_groups(folders: list[Path]) -> list[Trajectories]:
    """Every folder's trajectories, grouped by block length (one training batch holds one length)."""
    by_len: dict[int, list[Trajectories]] = {}
    for folder in folders:
        t = load_trajectories(folder)
        by_len.setdefault(int(t.committed.shape[1]), []).append(t)
    return [renumber(parts) for _, parts in sorted(by_len.items())]


def split_examples(traj: Trajectories, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Training units, split by prompt (the last heldout_frac of prompts are held out): (r, k) replay examples
    for the per-node encoder, draftable rounds r for the factored model (which replays every k of a round)."""
    n_samples = int(traj.sample_id.max()) + 1
    cut = n_samples - max(1, int(n_samples * cfg.heldout_frac))
    if isinstance(cfg.model, FactoredConfig):
        rounds = draftable_rounds(traj)
        held = traj.sample_id[rounds] >= cut
        return rounds[~held], rounds[held]
    ex = replay_examples(traj, cfg.max_depth)
    held = traj.sample_id[ex[:, 0]] >= cut
    return ex[~held], ex[held]


def factored_loss(model: FactoredOrderModel, traj: Trajectories, rounds: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Cross-entropy of the next true commit over every replay depth < max_depth of each root in `rounds`."""
    b = make_round_batch(traj, rounds, max_depth, model.cfg.max_block_len, model.cfg.top_k)
    dev = model.device
    logits = model.node_logits(model.tables(b.feat.to(dev), b.rank.to(dev), b.status.to(dev)), b.on_path.to(dev),
                               b.last.to(dev))
    valid = b.valid.to(dev)
    return torch.nn.functional.cross_entropy(logits[valid], b.label.to(dev)[valid])


def _loss(model: DrafterModel, traj: Trajectories, units: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    if isinstance(model, FactoredOrderModel):
        return factored_loss(model, traj, units, cfg.max_depth)
    b = make_batch(traj, units)
    return torch.nn.functional.cross_entropy(model(b.feat, b.status, b.depth), b.label)


# Settings that only decide when a run stops or saves, not the weights it has at a given step.
_RESUME_FREE = ("minutes", "ckpt_every")


def run_config(cfg: TrainConfig, n_train_units: int) -> dict[str, Any]:
    """The settings a checkpoint must share with the run resuming it, flat (model.* for the model config)."""
    flat = {k: v for k, v in asdict(cfg).items() if k not in _RESUME_FREE and k != "model"}
    flat.update({f"model.{k}": v for k, v in asdict(cfg.model).items()})
    flat["train_units"] = n_train_units  # other trajectories (re-collected, other prompts) are another run
    return flat


def check_resumable(saved: dict[str, Any], now: dict[str, Any], path: Path) -> None:
    """Raise ValueError (one line) unless `now` continues the run that wrote `saved`; --steps may only grow."""
    # A setting added since the checkpoint was written matches it when it holds its off value.
    diffs = [f"{k}={saved.get(k)!r} (now {now.get(k)!r})" for k in sorted(set(saved) | set(now))
             if k != "steps" and saved.get(k) != now.get(k) and not (k not in saved and now.get(k) in (False, None))]
    if int(now["steps"]) < int(saved["steps"]):
        diffs.append(f"steps={saved['steps']} (now {now['steps']}; --steps may only grow)")
    if diffs:
        raise ValueError(f"{path} is from another training run: {'; '.join(diffs)}; "
                         "rerun with its settings or use another --out")


def _save_checkpoint(path: Path, model: DrafterModel, opt: torch.optim.Optimizer, step: int,
                     gen: torch.Generator, config: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "gen": gen.get_state(),
                "torch_rng": torch.get_rng_state(), "config": config}, tmp)
    os.replace(tmp, path)  # atomic: a kill mid-save leaves the previous checkpoint


def _resume(path: Path, model: DrafterModel, opt: torch.optim.Optimizer, gen: torch.Generator,
            config: dict[str, Any]) -> int:
    """Load the checkpoint at `path` into model/opt/gen and torch's RNG; returns its step."""
    state = torch.load(path, weights_only=True)
    if "config" in state:
        check_resumable(state["config"], config, path)
    else:
        log.warning("%s predates recorded training settings: resuming without checking them", path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    gen.set_state(state["gen"])
    if "torch_rng" in state:  # dropout draws from the global generator
        torch.set_rng_state(state["torch_rng"])
    log.info("resumed drafter training at step %d", int(state["step"]))
    return int(state["step"])


def _lr_at(s: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to 0 at cfg.steps."""
    if s < cfg.warmup:
        return cfg.lr * (s + 1) / cfg.warmup
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - cfg.warmup) / max(1, cfg.steps - cfg.warmup))))


def train(out: Path, cfg: TrainConfig, data: list[Path] | None = None) -> DrafterModel:
    """Fit the order model on the trajectories of `data` (default: OUT's own), checkpointing to OUT.

    Folders at several block lengths train one model across them: each step's batch comes from one length,
    chosen with probability proportional to its share of the training units."""
    groups = load_groups(data or [out])
    splits = [split_examples(g, cfg) for g in groups]
    sizes = torch.tensor([float(len(tr)) for tr, _ in splits])
    log.info("training units: %d train, %d held-out (rounds %d; block lengths %s)", int(sizes.sum()),
             sum(len(h) for _, h in splits), sum(len(g.pos) for g in groups),
             [int(g.committed.shape[1]) for g in groups])
    config = run_config(cfg, int(sizes.sum()))
    if len(groups) > 1:
        config["block_lens"] = [int(g.committed.shape[1]) for g in groups]
    torch.manual_seed(cfg.seed)
    model = build_model(asdict(cfg.model))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    ckpt = out / "train_ckpt.pt"
    gen = torch.Generator().manual_seed(cfg.seed)
    step = _resume(ckpt, model, opt, gen, config) if ckpt.exists() else 0

    t0 = time.time()
    bar = tqdm(total=cfg.steps, initial=step, desc="train drafter")
    model.train()
    while step < cfg.steps:
        # One block length: no draw (a single folder trains exactly as before several were allowed).
        g = 0 if len(groups) == 1 else int(torch.multinomial(sizes, 1, generator=gen))
        train_units = splits[g][0]
        idx = torch.randint(len(train_units), (cfg.batch,), generator=gen)
        loss = _loss(model, groups[g], train_units[idx], cfg)
        for pg in opt.param_groups:
            pg["lr"] = _lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update(1)
        if step % 25 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
        done = cfg.minutes is not None and time.time() - t0 > cfg.minutes * 60
        if step % cfg.ckpt_every == 0 or step == cfg.steps or done:
            _save_checkpoint(ckpt, model, opt, step, gen, config)
        if done:
            log.info("time limit reached at step %d", step)
            break
    bar.close()
    return model.eval()


def evaluate_groups(model: DrafterModel, groups: list[Trajectories], cfg: TrainConfig) -> dict[str, Any]:
    """Held-out scores over every block length (weighted by examples), and per length."""
    per = {}
    for g in groups:
        per[int(g.committed.shape[1])] = evaluate(model, g, split_examples(g, cfg)[1], cfg)
    n = sum(r["examples"] for r in per.values()) or 1
    out: dict[str, Any] = {k: sum(r[k] * r["examples"] for r in per.values()) / n
                           for k in ("accuracy", "stale_conf_accuracy", "accuracy_k0", "stale_conf_accuracy_k0")}
    out["examples"] = sum(r["examples"] for r in per.values())
    if len(per) > 1:
        out["by_block_len"] = per
    return out


@torch.no_grad()
def evaluate(model: DrafterModel, traj: Trajectories, units: torch.Tensor, cfg: TrainConfig) -> dict[str, float]:
    """Held-out next-commit accuracy of the order model vs stale-confidence ordering, on the same examples.

    The baseline ranks by the stale float32 confidence with the target's lowest-slot tie-break (the encoder's
    own evaluation used to read float16-rounded confidences, which invents ties; both are reported there).
    """
    if isinstance(model, FactoredOrderModel):
        return _evaluate_factored(model, traj, units, cfg)
    hits = base = hits0 = base0 = n0 = 0
    for i in range(0, len(units), 1024):
        part = units[i : i + 1024]
        b = make_batch(traj, part)
        pred = model(b.feat, b.status, b.depth).argmax(-1)
        r = part[:, 0]
        conf = traj.conf[r - 1].masked_fill(b.status != 2, -1.0).argmax(-1)
        k0 = part[:, 1] == 0
        hits += int((pred == b.label).sum())
        base += int((conf == b.label).sum())
        hits0 += int((pred == b.label)[k0].sum())
        base0 += int((conf == b.label)[k0].sum())
        n0 += int(k0.sum())
    n = max(1, len(units))
    return {"accuracy": hits / n, "stale_conf_accuracy": base / n, "accuracy_k0": hits0 / max(1, n0),
            "stale_conf_accuracy_k0": base0 / max(1, n0), "examples": len(units)}


def _evaluate_factored(model: FactoredOrderModel, traj: Trajectories, rounds: torch.Tensor,
                       cfg: TrainConfig) -> dict[str, float]:
    hits = base = hits0 = base0 = n = n0 = 0
    for i in range(0, len(rounds), 256):
        b = make_round_batch(traj, rounds[i : i + 256], cfg.max_depth, model.cfg.max_block_len, model.cfg.top_k)
        pred = model.node_logits(model.tables(b.feat, b.rank, b.status), b.on_path, b.last).argmax(-1)
        cand = b.eligible[:, None, :] & ~b.on_path
        conf = b.stale_conf[:, None, :].expand_as(cand).masked_fill(~cand, -1.0).argmax(-1)
        ok, ok_conf = (pred == b.label) & b.valid, (conf == b.label) & b.valid
        hits, base, n = hits + int(ok.sum()), base + int(ok_conf.sum()), n + int(b.valid.sum())
        hits0, base0, n0 = hits0 + int(ok[:, 0].sum()), base0 + int(ok_conf[:, 0].sum()), n0 + int(b.valid[:, 0].sum())
    return {"accuracy": hits / max(1, n), "stale_conf_accuracy": base / max(1, n), "accuracy_k0": hits0 / max(1, n0),
            "stale_conf_accuracy_k0": base0 / max(1, n0), "examples": n}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lm_eval_spot.drafter.train", description=__doc__,
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
    if args.arch == "factored":
        if not 1 <= args.top_k <= TOP_K:
            ap.error(f"--top-k must be in 1..{TOP_K} (trajectories store the top {TOP_K}), got {args.top_k}")
        model_cfg = FactoredConfig(**size, d_ff=args.d_ff or FactoredConfig.d_ff, dropout=args.dropout,
                                   slot_embedding=not args.no_slot_embedding, d_pair=args.d_pair, top_k=args.top_k,
                                   relative_slots=args.relative_slots)
    else:
        model_cfg = OrderModelConfig(**size, d_ff=args.d_ff or OrderModelConfig.d_ff, dropout=args.dropout)
    batch = args.batch or (48 if args.arch == "factored" else 256)
    cfg = TrainConfig(steps=args.steps, batch=batch, minutes=args.minutes, seed=args.seed,
                      ckpt_every=args.ckpt_every, model=model_cfg)
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
