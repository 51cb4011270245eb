"""lm-eval's `--use_cache` with spot-dlm: a cache file belongs to one decoding configuration, and hits are counted.

lm-eval keys its sqlite cache on the prompt and the generation kwargs only, so a SPOT run and a control run (or two
budgets, drafters, targets, seeds) sharing a path would serve each other's answers. The first spot-dlm run writes a
fingerprint of everything that decides its output ids into the file; a run with another fingerprint, or a file
written by another model, is refused before anything is served. Cached answers never reach the model, so they have
no NFE: the run summary counts them separately.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("lm_eval.spot")

FINGERPRINT_KEY = "__spot_dlm_fingerprint__"  # not a sha256 hex digest: it cannot collide with a request key
# Arguments that change how fast requests are decoded, never which ids come out (tests check batch invariance;
# drafter_data only records what a run decodes; adaptation changes what is drafted, never what is committed).
SPEED_ONLY_ARGS = frozenset({"batch_size", "max_batch_size", "drafter_data", "drafter_device", "adapt",
                             "adapt_roots", "drafter_out"})


class CacheConflictError(RuntimeError):
    """The --use_cache file was written by another model or another spot-dlm configuration."""


def file_digest(path: Path, limit: int = 64 << 20) -> str:
    """sha256 of a small file; large files (target weights) are identified by name and size instead."""
    if not path.is_file():
        return "absent"
    size = path.stat().st_size
    if size > limit:
        return f"size:{size}"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def folder_identity(folder: str | None) -> dict[str, str] | None:
    """A checkpoint folder's identity: its resolved path and each file's digest (or size, when large)."""
    if folder is None:
        return None
    p = Path(folder).expanduser()
    if not p.exists():
        return {"id": folder}  # a hub id: the name is all there is
    if p.is_file():
        return {"path": str(p.resolve()), p.name: file_digest(p)}
    files = sorted(f for f in p.iterdir() if f.is_file())
    return {"path": str(p.resolve()), **{f.name: file_digest(f) for f in files}}


def fingerprint(args: dict[str, Any], base_seed: int, device_type: str, extra: dict[str, Any]) -> str:
    """One string for everything that decides the generated ids."""
    doc = {
        "args": {k: v for k, v in sorted(args.items()) if k not in SPEED_ONLY_ARGS and k != "device"},
        "seed": base_seed,
        "device_type": device_type,  # a GPU's kernels can round differently from the CPU's
        **extra,
    }
    return json.dumps(doc, sort_keys=True, default=str)


def run_fingerprint(args: dict[str, Any], base_seed: int, device_type: str, plugin: str, target: dict[str, Any],
                    drafter: str | None, graph: str | None) -> str:
    """`fingerprint` of a run: its args, seed and device type, the plugin version, the resolved target, and the
    identity of every file it reads (target, tokenizer, drafter, draft graph: any of them None when unused)."""
    extra: dict[str, Any] = {"plugin": plugin, "target": folder_identity(args["pretrained"]),
                             "tokenizer": folder_identity(args["tokenizer"]), "resolved_target": target}
    if drafter is not None:
        extra["drafter"] = folder_identity(drafter)
    if graph is not None:
        extra["graph"] = folder_identity(graph)
    return fingerprint(args, base_seed, device_type, extra)


class RequestCache:
    """The claim on one lm-eval cache file, and the count of requests it served."""

    def __init__(self, db: Any, path: str) -> None:
        self.db = db
        self.path = path
        self.served = 0

    @classmethod
    def claim(cls, db: Any, fp: str) -> RequestCache:
        path = str(getattr(db, "filename", "?"))
        stored = db.get(FINGERPRINT_KEY) if hasattr(db, "get") else None
        if stored is None and len(db) > 0:
            raise CacheConflictError(
                f"spot-dlm: --use_cache file {path} holds answers from another model (or from a spot-dlm older than "
                "its cache fingerprints); its answers would be served as this run's. Use another --use_cache path"
            )
        if stored is not None and stored != fp:
            raise CacheConflictError(
                f"spot-dlm: --use_cache file {path} was written by another spot-dlm configuration "
                f"({_first_difference(stored, fp)}); its answers are not this run's. Use another --use_cache path "
                "per configuration"
            )
        if stored is None:
            db[FINGERPRINT_KEY] = fp
            db.commit()
        cache = cls(db, path)
        cache._count_hits()
        log.info("spot-dlm: request cache %s claimed for this configuration", path)
        return cache

    def _count_hits(self) -> None:
        """CachingLM reads each hit with `db[key]`: count those reads (the fingerprint read excluded).

        The hook is a subclass swapped onto lm-eval's own sqlite dict: its lookups go through unchanged.
        """
        base = type(self.db)
        owner = self

        class _Counting(base):  # type: ignore[misc, valid-type]
            def __getitem__(self, key: Any) -> Any:
                value = base.__getitem__(self, key)
                if key != FINGERPRINT_KEY:
                    owner.served += 1
                return value

        try:
            self.db.__class__ = _Counting
        except TypeError:  # an object whose class cannot be swapped: the count stays unknown
            log.warning("spot-dlm: cannot count request-cache hits on %s", base.__name__)
            self.served = -1


def _first_difference(a: str, b: str) -> str:
    try:
        da, db = json.loads(a), json.loads(b)
    except ValueError:
        return "unreadable fingerprint"
    flat_a, flat_b = _flatten(da), _flatten(db)
    for key in sorted(set(flat_a) | set(flat_b)):
        if flat_a.get(key) != flat_b.get(key):
            return f"{key}: cached {flat_a.get(key)!r}, now {flat_b.get(key)!r}"
    return "no difference found"


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out
