"""CPU threading while decoding: a shared machine must not collapse the run, and a user's own setting wins.

Why: a decoding round is a chain of small forwards. With two OpenMP threads, each parallel region ends in a
busy-wait for the other thread; when another process holds one of the cores, that wait spins for a full scheduler
slice and a round slows down 10-60x (docs/benchmarks.md, Shared machine). On a small target one thread is about as
fast as two on idle cores and degrades only by the share of the core it loses. The policy applies to the CPU only,
for the duration of decoding, and is undone afterwards.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

log = logging.getLogger("lm_eval.spot")

# Below this many target parameters one thread decodes about as fast as two on idle cores (measured on the
# embedded 825k-parameter target and a 25M one; docs/benchmarks.md): one thread is then the safe choice.
SMALL_TARGET_PARAMS = 50_000_000
USER_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class ThreadPolicy:
    threads: int | None  # torch intra-op threads while decoding; None leaves torch's setting as it is
    reason: str


def default_thread_counts() -> frozenset[int]:
    """The counts torch may start with when nothing sets them: one per CPU this process may run on, or one per
    physical core (OpenMP and MKL differ); a different count was set by someone."""
    try:
        logical = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        logical = os.cpu_count() or 1
    return frozenset({logical, _physical_cores() or logical})


def _physical_cores() -> int | None:
    try:
        text = open("/proc/cpuinfo", encoding="ascii", errors="replace").read()
    except OSError:
        return None
    cores, phys = set(), "0"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "physical id":
            phys = value.strip()
        elif key.strip() == "core id":
            cores.add((phys, value.strip()))
    return len(cores) or None


def choose_threads(requested: int | None, device_type: str, n_params: int | None, env: Mapping[str, str],
                   current: int, defaults: frozenset[int]) -> ThreadPolicy:
    """Pure: the thread count for decoding, and why (logged once at start-up)."""
    if device_type != "cpu":
        return ThreadPolicy(None, f"device {device_type}: CPU threads left as they are")
    if requested is not None:
        return ThreadPolicy(requested, f"threads={requested} (model argument)")
    for var in USER_THREAD_VARS:
        if env.get(var):
            return ThreadPolicy(None, f"{var}={env[var]} set by the user: torch's {current} thread(s) kept")
    if current not in defaults:
        return ThreadPolicy(None, f"torch.set_num_threads({current}) set by the caller: kept")
    if n_params is None:
        return ThreadPolicy(None, f"target size unknown: torch's {current} thread(s) kept")
    if n_params <= SMALL_TARGET_PARAMS:
        return ThreadPolicy(1, f"small target ({n_params:,} parameters) on the CPU: 1 thread, which is about as fast as "
                               f"{current} on idle cores and does not collapse when other processes share them "
                               "(threads=N overrides)")
    return ThreadPolicy(None, f"target of {n_params:,} parameters on the CPU: torch's {current} thread(s) kept")


@contextmanager
def decoding_threads(policy: ThreadPolicy) -> Iterator[None]:
    """Apply the policy for the block's duration; the process's previous setting comes back afterwards."""
    if policy.threads is None or policy.threads == torch.get_num_threads():
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(policy.threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
