"""What every family's loader shares: the checkpoint's raw config, tokenizer, interface ids, version gates."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lm_eval_spot.adapters.base import TargetAdapter
from lm_eval_spot.adapters.ragged import head_sees_only  # noqa: F401  (the families' official forwards use it)
from lm_eval_spot.settings.args import SpotArgError, SpotArgs

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


def resolve_dtype(requested: str, device_type: str, cfg: dict[str, Any]) -> tuple[str, str]:
    """The concrete dtype a run uses, and why. An explicit dtype wins. `auto`: on CUDA the dtype the checkpoint
    states (config.json `torch_dtype`, or `dtype` as transformers 5 writes it); float32 on any other device (CPU
    matmuls in half precision are slow or emulated) and wherever the checkpoint states no dtype it knows."""
    if requested != "auto":
        return requested, "given"
    if device_type != "cuda":
        return "float32", f"dtype=auto on {device_type}"
    stated = cfg.get("torch_dtype") or cfg.get("dtype")
    name = str(stated).replace("torch.", "") if stated is not None else None
    if name in DTYPES:
        return name, f"dtype=auto on cuda: the checkpoint's config.json states {name}"
    return "float32", f"dtype=auto on cuda: the checkpoint's config.json states {stated!r}, not a dtype it can run in"


def with_concrete_dtype(args: SpotArgs, cfg: dict[str, Any] | None = None) -> SpotArgs:
    """`args` with dtype=auto resolved for its device (`resolve_dtype`), logged once; unchanged otherwise."""
    if args.dtype != "auto":
        return args
    name, why = resolve_dtype(args.dtype, resolve_device(args.device).type,
                              cfg if cfg is not None else read_config(args.pretrained))
    log.info("spot-dlm: dtype %s (%s)", name, why)
    return replace(args, dtype=name)


def torch_dtype(args: SpotArgs) -> torch.dtype:
    """The loaded weights' dtype: concrete by now (`with_concrete_dtype` runs before any family loads)."""
    if args.dtype not in DTYPES:
        raise ValueError(f"dtype={args.dtype!r} reached a loader unresolved; resolve it with with_concrete_dtype")
    return DTYPES[args.dtype]


# Files one of which every tokenizer folder has (fast tokenizers, their config, BPE and sentencepiece vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")


def declared_tokenizer_class(source: str) -> str | None:
    """The `tokenizer_class` a local tokenizer folder's tokenizer_config.json names (None: not said / not local)."""
    path = Path(source).expanduser() / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text()).get("tokenizer_class")
    except (ValueError, OSError):
        return None
    return str(value) if value else None


def load_tokenizer(args: SpotArgs, stand_ins: dict[str, str] | None = None) -> Any:
    """The checkpoint's tokenizer as the hub declares it. `stand_ins` maps a tokenizer class that exists only as
    the checkpoint's remote code to the transformers class that reads the same files (Dream's DreamTokenizer is a
    Qwen2 byte-level BPE over its vocab.json / merges.txt): used when trust_remote_code is off, so the card's
    default command needs no remote code; with trust_remote_code=true the checkpoint's own class loads."""
    import transformers
    from transformers import AutoTokenizer

    source = args.tokenizer or args.pretrained
    folder = Path(source).expanduser()
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise SpotArgError(
            f"spot-dlm: no tokenizer could be loaded from {source!r} (none of {', '.join(TOKENIZER_FILES)} is there); "
            "accepted: a folder with tokenizer files, or tokenizer=<such a folder>"
        )
    declared = declared_tokenizer_class(source)
    stand_in = (stand_ins or {}).get(declared or "")
    try:
        if stand_in is not None and not args.trust_remote_code:
            log.info("spot-dlm: the checkpoint's tokenizer class %s is remote code; reading its files with "
                     "transformers' %s instead (the same tokenizer; trust_remote_code=true loads the checkpoint's "
                     "own class)", declared, stand_in)
            return getattr(transformers, stand_in).from_pretrained(source)
        # An explicit False: a checkpoint with custom code must not make transformers ask on stdin.
        return AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError, TypeError, ImportError) as err:
        if not args.trust_remote_code and "trust_remote_code" in str(err):
            raise SpotArgError(
                f"spot-dlm: the tokenizer of {source!r} ({declared or 'its tokenizer_config.json'}) is remote code "
                "shipped with the checkpoint; pass trust_remote_code=true to run it, or tokenizer=<a folder with a "
                "tokenizer transformers loads natively>"
            ) from None
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
    """stop_ids= (or a card's) wins; else every id the checkpoint declares as ending a generation: the tokenizer's
    and config's eos, generation_config's eos list, and the token its chat template closes a reply with (LLaDA and
    Dream declare only their eos, while a chat turn ends with <|eot_id|> / <|im_end|>). The log names each."""
    from lm_eval_spot.tokens import end_of_turn_ids

    if args.stop_ids is not None:
        log.info("spot-dlm: stop ids %s from %s", sorted(args.stop_ids),
                 f"card {args.card}" if args.card else "stop_ids=")
        return frozenset(args.stop_ids)
    sources: dict[int, list[str]] = {}
    for where, ids in (("tokenizer eos", _ids(tokenizer.eos_token_id)), ("config eos", _ids(cfg.get("eos_token_id"))),
                       ("generation_config eos", _ids(getattr(gen_cfg, "eos_token_id", None)) if gen_cfg else set()),
                       ("chat template end of turn", set(end_of_turn_ids(tokenizer)))):
        for i in ids:
            sources.setdefault(int(i), []).append(where)
    names = tokenizer.convert_ids_to_tokens(sorted(sources)) if sources else []
    log.info("spot-dlm: stop ids: %s", "; ".join(f"{i} {n!r} ({', '.join(sources[i])})"
                                                  for i, n in zip(sorted(sources), names, strict=True)) or "none")
    return frozenset(sources)


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
    log.debug("%s: config fields the native forward never reads, ignored: %s", family,
              ", ".join(sorted(k for k in cfg if k in ignored)))
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


