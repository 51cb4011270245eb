"""What every family's loader shares: the checkpoint's raw config, tokenizer, interface ids, version gates."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lm_eval_spot.adapters.base import TargetAdapter
from lm_eval_spot.config import SpotArgError, SpotArgs

log = logging.getLogger("lm_eval.spot")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REMOTE_TRANSFORMERS = "4.57.*"  # the version the four families' official remote code runs under (measured)


@dataclass(frozen=True)
class LoadedTarget:
    adapter: TargetAdapter
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    family: str
    impl: str  # "native" (transformers' own classes) or "remote" (the official remote code)


def read_config(pretrained: str) -> dict[str, Any]:
    """The checkpoint's config.json as a dict, read without executing anything (local folder or hub id)."""
    local = Path(pretrained).expanduser() / "config.json"
    if local.is_file():
        return json.loads(local.read_text())
    from transformers.utils import cached_file

    try:
        path = cached_file(pretrained, "config.json")
    except OSError as err:
        raise SpotArgError(f"spot-dlm: pretrained={pretrained!r} has no readable config.json ({err})") from None
    return json.loads(Path(path).read_text())


def resolve_device(requested: str) -> torch.device:
    """Like lm-eval's HFLM: an unavailable accelerator falls back to the CPU, with a warning."""
    dev = torch.device(requested)
    if dev.type == "cuda" and not torch.cuda.is_available():
        log.warning("device=%s requested but CUDA is not available: using cpu", requested)
        return torch.device("cpu")
    return dev


def torch_dtype(args: SpotArgs) -> torch.dtype | str:
    return "auto" if args.dtype == "auto" else DTYPES[args.dtype]


# Files one of which every tokenizer folder has (fast tokenizers, their config, BPE and sentencepiece vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")


def load_tokenizer(args: SpotArgs) -> Any:
    from transformers import AutoTokenizer

    source = args.tokenizer or args.pretrained
    folder = Path(source).expanduser()
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise SpotArgError(
            f"spot-dlm: no tokenizer could be loaded from {source!r} (none of {', '.join(TOKENIZER_FILES)} is there); "
            "accepted: a folder with tokenizer files, or tokenizer=<such a folder>"
        )
    try:
        # An explicit False: a checkpoint with custom code must not make transformers ask on stdin.
        return AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError, TypeError, ImportError) as err:
        raise SpotArgError(
            f"spot-dlm: no tokenizer could be loaded from {source!r} ({type(err).__name__}); accepted: a folder with "
            "tokenizer files (tokenizer.json / tokenizer_config.json), or tokenizer=<such a folder>"
        ) from None


def generation_config(pretrained: str) -> Any:
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(pretrained)
    except OSError:
        return None


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def resolve_mask_id(args: SpotArgs, cfg: dict[str, Any], tokenizer: Any) -> int:
    """mask_id= (or a card's) wins; else the config's mask_token_id and the tokenizer's mask token, which must agree."""
    if args.mask_id is not None:
        return args.mask_id
    from_cfg = cfg.get("mask_token_id")
    from_tok = tokenizer.mask_token_id
    if from_cfg is not None and from_tok is not None and int(from_cfg) != int(from_tok):
        raise SpotArgError(
            f"spot-dlm: the checkpoint's config says mask_token_id={from_cfg} but its tokenizer's mask token is id "
            f"{from_tok}; pass mask_id=<id> (or card=<name>) to say which one the model was trained with"
        )
    mask = from_cfg if from_cfg is not None else from_tok
    if mask is None:
        raise SpotArgError(
            f"spot-dlm: pretrained={args.pretrained!r} declares no mask token (neither config.mask_token_id nor the "
            "tokenizer's mask_token); a diffusion target needs one: pass mask_id=<id> or card=<name>"
        )
    return int(mask)


def resolve_stop_ids(args: SpotArgs, cfg: dict[str, Any], tokenizer: Any, gen_cfg: Any) -> frozenset[int]:
    """stop_ids= (or a card's) wins; else eos / end-of-turn ids as the checkpoint declares them."""
    if args.stop_ids is not None:
        return frozenset(args.stop_ids)
    ids = _ids(tokenizer.eos_token_id) | _ids(cfg.get("eos_token_id"))
    if gen_cfg is not None:
        ids |= _ids(getattr(gen_cfg, "eos_token_id", None))
    return frozenset(ids)


def resolve_block_len(args: SpotArgs, cfg: dict[str, Any], default: int | None) -> int:
    block = args.block_len or cfg.get("block_length") or cfg.get("block_size") or default
    if block is None:
        raise SpotArgError(
            f"spot-dlm: pretrained={args.pretrained!r} declares no block length; pass block_len=<L> or card=<name>"
        )
    return int(block)


def require_remote_transformers(family: str) -> None:
    """The official remote code of every family fails to import or build under transformers 5.x (measured)."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    if major >= 5:
        raise SpotArgError(
            f"spot-dlm: impl=remote runs {family}'s official remote code, which does not run under transformers "
            f"{transformers.__version__}; install transformers=={REMOTE_TRANSFORMERS} (pip install "
            f"'transformers=={REMOTE_TRANSFORMERS}'), or use impl=native where the family has it"
        )


def require_remote(args: SpotArgs, family: str) -> None:
    """impl=remote: the user allowed the checkpoint's code, and the installed transformers can run it."""
    require_trust(args, family)
    require_remote_transformers(family)


def target_info(args: SpotArgs, cfg: dict[str, Any], tokenizer: Any, *, default_block: int | None,
                grid_origin: str, exact: bool, vocab_size: int) -> Any:
    """A family's TargetInfo: ids and block length from the model args (or card), else the checkpoint."""
    from lm_eval_spot.adapters.base import TargetInfo

    return TargetInfo(
        mask_id=resolve_mask_id(args, cfg, tokenizer),
        stop_ids=resolve_stop_ids(args, cfg, tokenizer, generation_config(args.pretrained)),
        block_len=resolve_block_len(args, cfg, default_block),
        grid_origin=grid_origin,  # type: ignore[arg-type]
        exact_prefix_cache=exact,
        vocab_size=int(vocab_size),
        max_positions=context_length(cfg),
    )


def context_length(cfg: dict[str, Any]) -> int | None:
    """The model's trained context, under the names the families' configs use."""
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions"):
        if isinstance(cfg.get(key), int) and cfg[key] > 0:
            return int(cfg[key])
    return None


def require_trust(args: SpotArgs, family: str) -> None:
    if not args.trust_remote_code:
        raise SpotArgError(
            f"spot-dlm: impl=remote executes {family}'s official remote code from the checkpoint; pass "
            "trust_remote_code=true to allow it (or impl=native where the family has it)"
        )


def map_fields(family: str, cfg: dict[str, Any], renamed: dict[str, str], required: dict[str, Any],
               ignored: tuple[str, ...]) -> dict[str, Any]:
    """Map a checkpoint config onto a transformers config's kwargs, field by field: `renamed` (source -> target
    name), `required` (fields whose value the native path depends on: any other value is an error), `ignored`
    (fields the forward never reads). Any other field, and any generic one, is an error, never skipped."""
    from transformers import PretrainedConfig

    generic = set(PretrainedConfig().to_dict())
    unknown = sorted(k for k in cfg if k not in renamed and k not in required and k not in ignored and k not in generic)
    if unknown:
        raise SpotArgError(
            f"spot-dlm: impl=native cannot map {family} config field(s) {', '.join(unknown)}; use impl=remote "
            f"(trust_remote_code=true), or extend the map in lm_eval_spot/families/"
        )
    for key, want in required.items():
        got = cfg.get(key, want)
        if got != want and not (isinstance(want, tuple) and got in want):
            raise SpotArgError(
                f"spot-dlm: impl=native supports {family} checkpoints with {key}={want!r}, this one has {got!r}; "
                "use impl=remote (trust_remote_code=true)"
            )
    return {dst: cfg[src] for src, dst in renamed.items() if src in cfg}


def weight_errors() -> tuple[type[BaseException], ...]:
    """What a missing, truncated or refused weights file raises (a pickle that torch's weights_only load refuses
    is an UnpicklingError; a damaged safetensors header a SafetensorError)."""
    import pickle

    from safetensors import SafetensorError

    return (OSError, SafetensorError, pickle.UnpicklingError, EOFError)


def load_native_weights(cls: Any, args: SpotArgs, config: Any, family: str,
                        key_mapping: dict[str, str] | None = None) -> torch.nn.Module:
    """`cls.from_pretrained` with a mapped config (and weight names), refusing any weight that does not map."""
    kw = {"key_mapping": key_mapping} if key_mapping else {}
    try:
        model, info = cls.from_pretrained(args.pretrained, config=config, dtype=torch_dtype(args),
                                          output_loading_info=True, **kw)
    except weight_errors() as err:
        raise SpotArgError(f"spot-dlm: the weights of pretrained={args.pretrained!r} could not be loaded "
                           f"({type(err).__name__}: {str(err)[:300]})") from None
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys",
                                                               "error_msgs")}
    if problems:
        detail = "; ".join(f"{k}: {', '.join(map(str, list(v)[:6]))}{' ...' if len(v) > 6 else ''}"
                           for k, v in problems.items())
        raise SpotArgError(f"spot-dlm: {family} weights do not map onto {cls.__name__} one to one ({detail}); "
                           "use impl=remote")
    return model
