"""Fit a drafter's order model to recorded control trajectories: the loss, the resumable training loop, and its
evaluation on held-out rounds (acceptance depth, top-1 order accuracy).

The command around it (collecting trajectories from a target, then `train`, `evaluate`) is
`lm_eval_spot.training.train`; online adaptation (`drafter.online`) fine-tunes with the same loss (`drafter.loss`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from lm_eval_spot.drafter.data import Trajectories, draftable_rounds, make_batch, make_round_batch, replay_examples
from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
from lm_eval_spot.drafter.loss import factored_loss
from lm_eval_spot.drafter.model import DrafterModel, OrderModelConfig, build_model, read_drafter

log = logging.getLogger(__name__)


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
    # A drafter folder whose weights the run starts from (fine-tuning: a shipped drafter on new targets' data);
    # its architecture is the run's (`model` must equal its config).
    init: str | None = None
    # Both are ~0.62M parameters (the paper's size); the factored one runs its encoder once per round.
    model: OrderModelConfig | FactoredConfig = field(default_factory=FactoredConfig)


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
    ckpt = out / "train_ckpt.pt"
    if cfg.init is not None and not ckpt.exists():  # a resumed run's weights come from its checkpoint
        start, _ = read_drafter(Path(cfg.init))
        if asdict(start.cfg) != asdict(cfg.model):
            raise ValueError(f"--init {cfg.init}: its architecture {asdict(start.cfg)} is not the run's "
                             f"{asdict(cfg.model)}")
        model.load_state_dict(start.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
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
