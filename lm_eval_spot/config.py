"""The `spot-dlm` model arguments: one frozen dataclass, validated once, before anything is loaded."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

MODES = ("control",)
DTYPES = ("auto", "float32", "bfloat16", "float16")


class SpotArgError(ValueError):
    """A bad model argument: the message names the argument and the accepted values."""


def default_target_path() -> Path:
    """The embedded trained target shipped inside the package."""
    return Path(__file__).parent / "assets" / "spot-arith-target"


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise SpotArgError(f"spot-dlm: {name}={value!r} is not a boolean; accepted: true, false")


def _as_int(name: str, value: Any, minimum: int) -> int:
    try:
        out = int(value)
        if isinstance(value, float) and out != value:
            raise ValueError
    except (TypeError, ValueError):
        raise SpotArgError(f"spot-dlm: {name}={value!r} is not an integer; accepted: integers >= {minimum}") from None
    if out < minimum:
        raise SpotArgError(f"spot-dlm: {name}={value!r} is out of range; accepted: integers >= {minimum}")
    return out


@dataclass(frozen=True)
class SpotArgs:
    pretrained: str  # local checkpoint folder (or hub id where a hub is reachable)
    tokenizer: str | None = None  # defaults to `pretrained`
    mode: str = "control"
    block_len: int | None = None  # defaults to the checkpoint config's block length
    gen_length: int | None = None  # upper bound on generated tokens; the task's max_gen_toks applies below it
    device: str = "cpu"
    dtype: str = "float32"
    batch_size: int = 1
    trust_remote_code: bool = False
    seed: int | None = None  # base seed of the noise rows; default: the seed lm-eval gave torch


def accepted_args() -> list[str]:
    return [f.name for f in fields(SpotArgs)] + ["max_batch_size"]


def parse_args(raw: dict[str, Any]) -> SpotArgs:
    """Validate the raw model args (strings from the CLI or Python values) into SpotArgs."""
    unknown = sorted(set(raw) - set(accepted_args()))
    if unknown:
        raise SpotArgError(
            f"spot-dlm: unknown model argument(s) {', '.join(unknown)}; accepted: {', '.join(accepted_args())}"
        )
    args: dict[str, Any] = {}
    pretrained = raw.get("pretrained")
    if pretrained is None or str(pretrained) in ("", "default"):
        pretrained = str(default_target_path())
    args["pretrained"] = str(pretrained)
    if raw.get("tokenizer") is not None:
        args["tokenizer"] = str(raw["tokenizer"])
    mode = str(raw.get("mode", "control"))
    if mode not in MODES:
        raise SpotArgError(f"spot-dlm: mode={mode!r} is not known; accepted: {', '.join(MODES)}")
    args["mode"] = mode
    if raw.get("block_len") is not None:
        args["block_len"] = _as_int("block_len", raw["block_len"], 1)
    if raw.get("gen_length") is not None:
        args["gen_length"] = _as_int("gen_length", raw["gen_length"], 1)
    if raw.get("device") is not None:
        args["device"] = str(raw["device"])
    dtype = str(raw.get("dtype", "float32")).replace("torch.", "")
    if dtype not in DTYPES:
        raise SpotArgError(f"spot-dlm: dtype={dtype!r} is not known; accepted: {', '.join(DTYPES)}")
    args["dtype"] = dtype
    bs = raw.get("batch_size", 1)
    if isinstance(bs, str) and bs.startswith("auto"):
        bs = 1  # decoding is per request (see README); "auto" needs no probing
    args["batch_size"] = _as_int("batch_size", bs, 1)
    if raw.get("max_batch_size") is not None:
        _as_int("max_batch_size", raw["max_batch_size"], 1)
    if raw.get("trust_remote_code") is not None:
        args["trust_remote_code"] = _as_bool("trust_remote_code", raw["trust_remote_code"])
    if raw.get("seed") is not None:
        args["seed"] = _as_int("seed", raw["seed"], 0)
    out = SpotArgs(**args)
    _check_pretrained(out.pretrained)
    return out


def _check_pretrained(path: str) -> None:
    p = Path(path).expanduser()
    looks_local = p.is_absolute() or path.startswith((".", "~")) or p.exists()
    if looks_local and not (p / "config.json").is_file():
        raise SpotArgError(
            f"spot-dlm: pretrained={path!r} is not a checkpoint folder (no config.json there); "
            "accepted: a local folder with config.json and a tokenizer, or omit it for the embedded target"
        )
