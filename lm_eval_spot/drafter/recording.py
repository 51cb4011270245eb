"""Drafter training data recorded from the runs a user already does (`drafter_data=DIR`).

Every commit a run's decoder verifies, with the target summary it was decided under, is what
`lm_eval_spot.training collect` gathers with a separate draft-free decode: a control run records each commit with its
state's logits; a drafting run records each verified commit of its accepted path with that node's logits (the
same pairs control would have produced at those states). No extra target forward is made.

A data folder holds one target at one block length: `collect.json` (written once, checked by every later run)
and `rec_*.safetensors` shards, each written atomically under a name unique to its process, so runs and ranks
append side by side. `python -m lm_eval_spot.training train --data DIR --out D2` reads them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from lm_eval_spot.settings.args import SpotUserError
from lm_eval_spot.drafter.data import Trajectories, TrajectoryRecorder, save_tensors_atomic

log = logging.getLogger(__name__)

FLUSH_EVERY = 100  # requests per shard: a killed run loses at most this many requests' records


class DrafterDataError(SpotUserError):
    """A data folder that holds another target's or another block length's records."""


class DrafterDataWriter:
    """Appends one run's (one rank's) records to a data folder."""

    def __init__(self, folder: Path, target: str, block_len: int, mask_id: int, rank: int) -> None:
        self.folder, self.mask_id = Path(folder).expanduser(), mask_id
        self.folder.mkdir(parents=True, exist_ok=True)
        self._claim(target, block_len)
        # Names sort by the time a run started; host, pid, rank and a random tag keep runs that start in the
        # same second (ranks of one run, two runs in one process) from writing the same file.
        self.prefix = (f"rec_{time.strftime('%Y%m%d-%H%M%S')}_{socket.gethostname()}_{os.getpid()}_r{rank}_"
                       f"{uuid.uuid4().hex[:8]}")
        self.pending: list[Trajectories] = []
        self.n_requests = self.n_shards = self.n_commits = self._next = 0
        self.bytes_written = 0
        self.seconds = 0.0  # recording's own work: observing the commits, handing them over, writing shards

    def _claim(self, target: str, block_len: int) -> None:
        """Write collect.json if the folder is new; else check that it holds this block length."""
        meta = {"target": target, "block_len": block_len, "prompts": None, "source": "drafter_data"}
        path = self.folder / "collect.json"
        if not path.exists():
            tmp = self.folder / f"collect.json.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(meta, indent=2) + "\n")
            try:
                os.link(tmp, path)  # atomic and exclusive: two ranks starting together cannot both write it
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        try:
            have = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise DrafterDataError(f"spot-dlm: drafter_data={str(self.folder)!r}: collect.json is unreadable "
                                   f"({err}); use another folder") from None
        if int(have.get("block_len", -1)) != block_len:
            raise DrafterDataError(
                f"spot-dlm: drafter_data={str(self.folder)!r} holds records at block_len={have.get('block_len')}, "
                f"this run decodes at block_len={block_len}; accepted: a new folder per target and block length")
        if have.get("target") != target:
            log.warning("spot-dlm: drafter_data=%s was started by target %s; this run's target is %s (records of "
                        "both are kept: train on them only if that is what you want)", self.folder,
                        have.get("target"), target)

    def recorder(self) -> TrajectoryRecorder:
        # Ids are local to this writer (the trainer renumbers shards densely on load).
        self._next += 1
        return TrajectoryRecorder(self._next - 1, block_offset=(self._next - 1) * 100_000)

    def add(self, rec: TrajectoryRecorder, observe_s: float = 0.0) -> None:
        """One finished request's records; observe_s: what observing them cost its decode (`DecodeResult`)."""
        t0 = time.perf_counter()
        t = rec.result(self.mask_id)
        self.add_records(t, observe_s + time.perf_counter() - t0)

    def add_records(self, t: Trajectories | None, spent_s: float = 0.0) -> None:
        """One finished request's records as its recorder returned them; spent_s: what producing them cost."""
        t0 = time.perf_counter()
        self.n_requests += 1
        if t is not None:
            self.pending.append(t)
        self.seconds += spent_s + time.perf_counter() - t0
        if len(self.pending) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        t0 = time.perf_counter()
        traj = Trajectories.concat(self.pending)
        path = self.folder / f"{self.prefix}_{self.n_shards:05d}.safetensors"
        save_tensors_atomic(traj.to_dict(), path)
        self.bytes_written += path.stat().st_size
        self.n_commits += len(traj.pos)
        self.n_shards += 1
        self.pending = []
        self.seconds += time.perf_counter() - t0

    def summary(self) -> dict[str, Any]:
        return {"folder": str(self.folder), "requests": self.n_requests, "commits": self.n_commits,
                "shards": self.n_shards, "bytes": self.bytes_written, "seconds": round(self.seconds, 3)}
