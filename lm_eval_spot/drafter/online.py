"""Online adaptation: the run fine-tunes its drafter on the target's own verified commits as it decodes.

Every finished request hands over what its rounds verified (the same records `drafter_data=` writes: each
commit of an accepted path with the target summary it was decided under, so never a rejected draft) into a
bounded replay buffer; between decoding steps, once at least `every` requests are new (points fixed by the
order in which requests finish) the adapter trains on `roots_per_request` roots per new request (in steps of
`batch` roots) drawn from the buffer by its own seeded generator, then refreshes the drafter's host tables. So:

- weights change only between steps, never inside a round (every round of a step reads one version);
- with a fixed seed, batch size and process count the updates, hence the NFE per sample, are the same in every
  run (no wall-clock decides anything);
- the verifier decides every commit, so outputs equal control's whatever the drafter learns.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from lm_eval_spot.settings.args import SpotArgError, SpotArgs, shipped_drafter_path
from lm_eval_spot.drafter.data import Trajectories, TrajectoryRecorder, draftable_rounds
from lm_eval_spot.drafter.loss import factored_loss
from lm_eval_spot.drafter.factored import FactoredOrderModel

log = logging.getLogger("lm_eval.spot.adapt")  # a child of lm-eval's logger: its CLI shows these lines

PARAM_GROUPS = ("all", "heads")
# The factored model's per-round read-out on top of the encoder: slot scores, pair and length tables.
HEAD_PREFIXES = ("norm.", "base.", "pairs.", "by_length.")


@dataclass(frozen=True)
class AdaptConfig:
    """The update schedule (`docs/benchmarks.md`, "Online adaptation", says how it was chosen)."""

    roots_per_request: int = 8  # training roots owed per finished request (each with every replay depth)
    batch: int = 32  # roots per optimizer step: small steps are overhead-bound on the CPU (1.9 ms a root at 8,
    # 0.7 at 48, b8's drafter)
    every: int = 4  # update once this many new requests have finished (between steps): the host snapshot's
    # refresh (about 5 ms) is paid once per update
    lr: float = 3e-4  # 1e-3 disturbed a drafter trained on its target (embedded: 1.026x its NFE); 3e-4 did not
    weight_decay: float = 0.0
    max_depth: int = 24
    buffer_rounds: int = 8192  # replay buffer bound, in recorded rounds (the oldest requests go first)
    params: str = "all"  # "all", or "heads": the encoder frozen, only the read-out tables move
    seed: int = 0

    def __post_init__(self) -> None:
        if self.params not in PARAM_GROUPS:
            raise ValueError(f"params must be one of {PARAM_GROUPS}, got {self.params!r}")
        if self.roots_per_request < 0 or min(self.batch, self.max_depth, self.buffer_rounds, self.every) < 1:
            raise ValueError("batch, max_depth, buffer_rounds and every must be >= 1, roots_per_request >= 0")


class ReplayBuffer:
    """The most recent requests' recorded rounds, at most `capacity` of them (whole requests are dropped, oldest
    first; the newest request always stays)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._parts: deque[Trajectories] = deque()
        self.rounds = 0  # rounds held now
        self._data: Trajectories | None = None
        self._units = torch.zeros(0, dtype=torch.long)
        self._stale = False

    def add(self, t: Trajectories) -> None:
        self._parts.append(t)
        self.rounds += len(t.pos)
        while len(self._parts) > 1 and self.rounds > self.capacity:
            self.rounds -= len(self._parts.popleft().pos)
        self._stale = True

    def materialise(self) -> tuple[Trajectories | None, torch.Tensor]:
        """(the buffer as one Trajectories, its draftable rounds), rebuilt only when something was added."""
        if self._stale:
            self._data = Trajectories.concat(list(self._parts))
            self._units = draftable_rounds(self._data)
            self._stale = False
        return self._data, self._units


class OnlineAdapter:
    """Fine-tunes a factored drafter in place from the requests a run decodes. `refresh` is called after each
    update (the proposer's host snapshot of the weights is rebuilt there)."""

    def __init__(self, model: FactoredOrderModel, refresh: Callable[[], None], cfg: AdaptConfig,
                 origin: dict[str, Any]) -> None:
        self.model, self.refresh, self.cfg, self.origin = model, refresh, cfg, origin
        params = [p for n, p in model.named_parameters() if cfg.params == "all" or n.startswith(HEAD_PREFIXES)]
        if cfg.params != "all":  # no gradient through the encoder: its backward is most of a step's cost
            keep = {id(p) for p in params}
            for p in model.parameters():
                if id(p) not in keep:
                    p.requires_grad_(False)
        # foreach: one fused update over all tensors (the per-tensor loop was a fifth of a small step's time).
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True)
        self._roots_owed = 0  # roots owed to training, carried over between updates (whole steps only)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.buffer = ReplayBuffer(cfg.buffer_rounds)
        self._next = 0
        self._owed = 0  # requests finished since the last update
        self.requests = self.examples = self.steps = self.updates = 0
        self.seconds = 0.0  # adaptation's own work: turning records into examples, training, refreshing tables
        self.losses: deque[float] = deque(maxlen=50)  # the most recent steps' losses (the summary's loss_recent)

    @property
    def version(self) -> int:
        """The weights' version: every update moves them once."""
        return self.updates

    def recorder(self) -> TrajectoryRecorder:
        self._next += 1
        return TrajectoryRecorder(self._next - 1, block_offset=(self._next - 1) * 100_000)

    def add(self, t: Trajectories | None) -> None:
        """One finished request's verified commits, as its recorder returned them."""
        t0 = time.perf_counter()
        self.requests += 1
        self._owed += 1
        if t is not None and len(t.pos):
            self.buffer.add(t)
            self.examples += len(t.pos)
        self.seconds += time.perf_counter() - t0

    def update(self) -> bool:
        """Train on the buffer if enough requests are new (call between steps only). True if weights moved."""
        if self._owed < self.cfg.every:
            return False
        t0 = time.perf_counter()
        self._roots_owed += self._owed * self.cfg.roots_per_request
        self._owed = 0
        n_steps = self._roots_owed // self.cfg.batch
        self._roots_owed -= n_steps * self.cfg.batch
        data, units = self.buffer.materialise()
        moved = False
        if data is not None and len(units) and n_steps:
            was_training = self.model.training
            self.model.train()
            for _ in range(n_steps):
                idx = units[torch.randint(len(units), (self.cfg.batch,), generator=self.gen)]
                self.losses.append(self._step(data, idx))
            self.model.train(was_training)
            self.steps += n_steps
            self.updates += 1
            self.refresh()
            moved = True
        self.seconds += time.perf_counter() - t0
        return moved

    def _step(self, data: Trajectories, idx: torch.Tensor) -> float:

        loss = factored_loss(self.model, data, idx, self.cfg.max_depth)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in self.opt.param_groups for p in g["params"]], 1.0)
        self.opt.step()
        return float(loss.detach())

    def summary(self) -> dict[str, Any]:
        recent = list(self.losses)
        return {"mode": "online", "requests": self.requests, "examples": self.examples,
                "buffer_rounds": self.buffer.rounds, "update_steps": self.steps, "updates": self.updates,
                "seconds": round(self.seconds, 3), "loss_recent": sum(recent) / len(recent) if recent else None,
                "schedule": asdict(self.cfg), "adapted_from": self.origin.get("drafter")}

    def save(self, folder: Path, target: str, block_len: int) -> None:
        """The adapted drafter as a normal drafter folder (`drafter=FOLDER` loads it)."""
        from lm_eval_spot.drafter.model import DrafterMeta, feature_version_of, save_drafter

        base = self.origin.get("meta") or {}
        lens = tuple(sorted({*base.get("block_lens", ()), block_len}))
        extra = {**(base.get("extra") or {}), "adapted": {
            "from": self.origin.get("drafter"), "target": target, "block_len": block_len,
            "requests": self.requests, "examples": self.examples, "update_steps": self.steps,
            "schedule": asdict(self.cfg)}}
        meta = DrafterMeta(feature_version_of(self.model), self.model.cfg.top_k, lens, target,
                           str(base.get("task", "online")), None, None, extra)
        save_drafter(self.model, meta, Path(folder).expanduser())


def adapt_across_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One summary for the run: a single rank's as it is; with several, each rank adapts its own copy on its own
    requests (no averaging), so the totals are sums and `per_rank` keeps each rank's figures and curve."""
    if not per_rank:
        return None
    if len(per_rank) == 1:
        return per_rank[0]
    total = {k: sum(r[k] for r in per_rank) for k in ("requests", "examples", "update_steps", "updates")}
    return {"mode": "online", "ranks": "independent", **total,
            "seconds": round(max(r["seconds"] + r["recording_s"] for r in per_rank), 3), "per_rank": per_rank}


def online_adapter_for(args: SpotArgs, proposer: Any, drafter_path: Path | None, seed: int) -> OnlineAdapter | None:
    """The run's adapter: on when asked (adapt=online, drafter_out=) or, under adapt=auto, when the run drafts with a
    drafter not trained on this target (the shipped transfer drafter); None otherwise."""
    from lm_eval_spot.drafter.spot_proposer import LearnedOrder, TreeProposer

    transfer = drafter_path is not None and drafter_path.resolve() == shipped_drafter_path("transfer").resolve()
    asked = args.adapt == "online" or (args.adapt == "auto" and args.drafter_out is not None)
    if not (asked or (args.adapt == "auto" and transfer)):
        return None
    order = proposer.order if isinstance(proposer, TreeProposer) else None
    if not isinstance(order, LearnedOrder) or not isinstance(order.model, FactoredOrderModel):
        why = ("the run drafts without a learned drafter" if drafter_path is None
               else f"drafter {drafter_path.name} is not a factored order model")
        if asked:
            raise SpotArgError(f"spot-dlm: adapt=online / drafter_out= need a factored learned drafter; {why}")
        log.info("spot-dlm: online adaptation off: %s", why)
        return None
    assert drafter_path is not None
    try:
        meta = json.loads((drafter_path / "drafter.json").read_text()).get("meta", {})
    except (OSError, ValueError):
        meta = {}
    cfg = AdaptConfig(roots_per_request=args.adapt_roots, seed=seed)
    log.info("spot-dlm: online adaptation on: the drafter (%s) fine-tunes on this run's verified commits, %d roots "
             "per finished request in steps of %d, between steps only (outputs stay exact)", drafter_path.name,
             cfg.roots_per_request, cfg.batch)
    return OnlineAdapter(order.model, order.refresh, cfg, {"drafter": str(drafter_path), "meta": meta})
