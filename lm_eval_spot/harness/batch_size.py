"""batch_size=auto: how many requests to decode together, from the memory free on the target's device."""

from __future__ import annotations

import logging

import torch

from lm_eval_spot.adapters.base import TargetAdapter

log = logging.getLogger("lm_eval.spot")

MAX_AUTO = 64  # beyond this, per-request host work dominates any forward saving (and lm-eval's lists are short)


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30  # unknown: assume a modest 4 GiB


def bytes_per_request(adapter: TargetAdapter, rows: int) -> int:
    """A request's peak working set in one round: its rows' logits and round arithmetic (float32, about three
    [rows, L, V] tensors at once), one layer's activations for its rows, and a prefix KV of the model's context."""
    info = adapter.info
    cfg = getattr(getattr(adapter, "model", None), "config", None)
    hidden = int(getattr(cfg, "hidden_size", 1024))
    inter = int(getattr(cfg, "intermediate_size", 4 * hidden))
    layers = int(getattr(cfg, "num_hidden_layers", 1))
    kv_dim = int(getattr(cfg, "num_key_value_heads", 1)) * int(getattr(cfg, "head_dim", hidden // 8) or hidden // 8)
    ctx = min(int(getattr(cfg, "max_position_embeddings", 4096)), 4096)
    elt = torch.finfo(getattr(adapter, "dtype", torch.float32)).bits // 8
    L, V = info.block_len, info.vocab_size
    logits = 3 * rows * L * V * 4
    acts = rows * L * (3 * inter + 6 * hidden) * elt
    kv = 2 * layers * ctx * kv_dim * elt
    if getattr(adapter, "copies_prefix_per_row", False):  # the remote-code path concatenates the prefix per row
        kv *= rows + 1
    return logits + acts + kv


def auto_batch_size(adapter: TargetAdapter, rows: int, cap: int | None = None) -> int:
    """The largest batch whose estimated working set fits in half the free memory, between 1 and the cap."""
    free = free_bytes(adapter.device)
    per = bytes_per_request(adapter, rows)
    n = max(1, min(cap or MAX_AUTO, int(0.5 * free // per)))
    log.info("batch_size=auto: %d (%.1f GiB free on %s, ~%.0f MiB per request of %d rows)", n, free / 2**30,
             adapter.device, per / 2**20, rows)
    return n


class BatchSizes:
    """How many requests a run decodes or scores together: batch_size=N, or `auto` sized once per kind from the
    memory free on the device; batch_invariant=true decodes one at a time (other requests' rows would change the
    forward's shape again) and pads every forward to `pad_rows`."""

    def __init__(self, adapter: TargetAdapter, batch_size: int | str, batch_invariant: bool, drafting: bool,
                 budget: int | str, max_budget: int, mc_batch: int, cap: int | None) -> None:
        self.adapter, self.batch_size, self.invariant = adapter, batch_size, batch_invariant
        self.rows = 1 + (budget if isinstance(budget, int) else max_budget) if drafting else 1
        self.mc_batch, self.cap = mc_batch, cap
        self._gen: int | None = None
        self._lik: int | None = None
        # batch_invariant: every forward carries 1 + the largest budget rows (budget=auto's: max_budget)
        self.pad_rows = 1 + (budget if isinstance(budget, int) else max_budget) if batch_invariant else 0

    def generation(self) -> int:
        if self.invariant:
            return 1
        if self.batch_size != "auto":
            return int(self.batch_size)
        if self._gen is None:
            self._gen = auto_batch_size(self.adapter, self.rows, self.cap)
        return self._gen

    def likelihood(self) -> int:
        """Likelihood requests scored together (each forward carries up to mc_batch rows per request)."""
        if self.invariant:
            return 1
        if self.batch_size != "auto":
            return int(self.batch_size)
        if self._lik is None:
            self._lik = auto_batch_size(self.adapter, self.mc_batch, self.cap)
        return self._lik
