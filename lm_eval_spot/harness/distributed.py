"""Data parallelism under `accelerate launch` / `torchrun`: which process this is, and the collectives lm-eval calls.

lm-eval splits the documents across ranks (`rank`, `world_size`), pads every rank to the same request count with
copies of its last request, and gathers samples and metrics itself. The plugin adds what lm-eval cannot know: a
device per local rank, and its own run statistics summed over ranks (padding copies excluded).
"""

from __future__ import annotations

import atexit
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

log = logging.getLogger("lm_eval.spot")


@dataclass(frozen=True)
class Ranks:
    rank: int = 0  # global process index: lm-eval shards documents by it (so multi-node splits too)
    world_size: int = 1
    local_rank: int = 0  # index on this node: picks the accelerator
    accelerator: Any = None  # accelerate.Accelerator when world_size > 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.gather(tensor) if self.distributed else tensor

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj=obj, object_gather_list=out, dst=dst)
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.distributed:
            self.accelerator.wait_for_everyone()


def launched_world_size() -> int:
    """The process count a launcher (torchrun, accelerate launch, SLURM through accelerate) announced."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def detect_ranks(device: str) -> Ranks:
    """One process unless a launcher started several; then join (or create) accelerate's process group.

    Accelerate picks gloo on the CPU and NCCL on CUDA; `ACCELERATE_USE_CPU=1` forces the CPU group on a machine
    that has GPUs. The group's timeout is long, as lm-eval's HF model sets it: ranks wait for each other at the
    end of every request type, and one slow rank must not kill the run.
    """
    if launched_world_size() <= 1:
        return Ranks()
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    if device.startswith("cpu"):
        os.environ.setdefault("ACCELERATE_USE_CPU", "1")  # a CPU run on a GPU machine: a gloo group, no NCCL
    acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(weeks=52))])
    if acc.num_processes <= 1:
        return Ranks()
    # The group is left for the interpreter's teardown otherwise, where gloo's threads can abort the process after
    # a finished run ("terminate called without an active exception", seen on a 2-rank CPU run): close it first.
    atexit.register(_close_group)
    ranks = Ranks(rank=acc.process_index, world_size=acc.num_processes, local_rank=acc.local_process_index,
                  accelerator=acc)
    log.info("spot-dlm: data parallel, rank %d of %d (local rank %d, %s)", ranks.rank, ranks.world_size,
             ranks.local_rank, acc.device)
    return ranks


# How long a finished rank waits at exit for the others (rank 0 still writes results) before closing anyway.
EXIT_WAIT = timedelta(minutes=10)


def _close_group() -> None:
    """Close the group with every rank at once. A rank that closed its gloo connections while a peer still held
    them open (rank 0 writing results) aborted in the C++ teardown, once in a CI run after the atexit close alone:
    the ranks first meet at a bounded barrier, then close."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    # gloo only (the abort was seen there; its monitored barrier has a timeout of its own, NCCL's would wait for
    # the group's year-long one if a peer died).
    if torch.distributed.get_backend() == "gloo":
        try:
            torch.distributed.monitored_barrier(timeout=EXIT_WAIT)
        except Exception as exc:  # noqa: BLE001 (a peer that died must not hide this rank's own exit status)
            log.warning("spot-dlm: ranks did not meet at exit (%s); closing the process group anyway", exc)
    torch.distributed.destroy_process_group()


def rank_device(requested: str, ranks: Ranks) -> str:
    """`cuda` / `cuda:N` become this process's GPU (`cuda:LOCAL_RANK`) in a multi-process run; cpu stays cpu."""
    if ranks.distributed and requested.startswith("cuda"):
        return f"cuda:{ranks.local_rank}"
    return requested


def padding_count(requests: list[Any]) -> int:
    """How many trailing requests are lm-eval's padding copies (they exist only to even out the ranks).

    lm-eval appends `req.repeats` copies of a rank's last request per missing request, as the same object: the
    tail run of that object is `repeats * (1 + padding)` long, of which `repeats` are real.
    """
    if not requests:
        return 0
    last = requests[-1]
    run = 0
    for req in reversed(requests):
        if req is not last:
            break
        run += 1
    repeats = max(1, int(getattr(last, "repeats", 1) or 1))
    return max(0, run - repeats)
