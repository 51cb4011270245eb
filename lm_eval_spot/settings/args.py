"""The `spot-dlm` model arguments: one frozen dataclass, validated once, before anything is loaded."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from lm_eval_spot.errors import SpotArgError, SpotUserError
from lm_eval_spot.settings.modes import CHAIN_MODES, LEARNED_MODES, MODE_NAMES

__all__ = ["SpotArgError", "SpotArgs", "SpotUserError", "parse_args"]  # the errors live in errors.py

VERIFIERS = ("coupled", "rejection")
CONTROL_OPTIONS = ("none", "paired")
DTYPES = ("auto", "float32", "bfloat16", "float16")
IMPLS = ("native", "remote")
CACHES = ("none", "approx")
MASK_SHARING = ("common", "independent")
GREEDY_OPTIONS = ("auto", "always", "never")
ADAPT_OPTIONS = ("auto", "online", "off")
ORACLE_BUDGET = 8  # mode=oracle's budget when none is given (the ceiling is measured at a fixed budget)


# Arguments lm-eval passes on its own (from --device, --batch_size, --max_batch_size) next to --model_args.
HARNESS_ARGS = ("device", "batch_size", "max_batch_size")


def merge_harness_args(model_args: dict[str, Any], harness: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Model args written by the user win over lm-eval's own values for the same argument (its `--device`
    defaults to cuda:0 even when the user never typed it). Returns the merged args and one note per conflict."""
    out, notes = dict(model_args), []
    for key, value in harness.items():
        if value is None:
            continue
        if key not in out:
            out[key] = value
        elif str(out[key]) != str(value):
            notes.append(f"{key}={out[key]!r} from --model_args wins over lm-eval's {key}={value!r}")
    return out, notes


def _asset(folder: str) -> Path:
    return Path(__file__).resolve().parents[1] / "assets" / folder


# Targets shipped inside the package, by name (pretrained=NAME): folder, and the folder of its own drafter (the
# drafter a run on it uses unless told otherwise). "spot-arith" is the embedded default; "spot-gsm8k" writes
# English GSM8K solutions with a context that holds lm-eval's default 5-shot gsm8k prompt (model_cards/).
SHIPPED_TARGETS = {"spot-arith": ("spot-arith-target", "spot-arith-drafter"),
                   "spot-gsm8k": ("spot-gsm8k-target", "spot-gsm8k-drafter")}


def shipped_target_path(name: str) -> Path:
    return _asset(SHIPPED_TARGETS[name][0])


def default_target_path() -> Path:
    """The embedded trained target shipped inside the package."""
    return shipped_target_path("spot-arith")


def default_drafter_path() -> Path:
    """The drafter trained for the embedded target, shipped inside the package."""
    return _asset(SHIPPED_TARGETS["spot-arith"][1])


# Drafters shipped inside the package, by name (drafter=NAME): "paper" (the embedded target's own, its default),
# "small" (a smaller one for it), "transfer" (trained across several tiny targets and block lengths: the default
# for every other target).
SHIPPED_DRAFTERS = {"paper": "spot-arith-drafter", "small": "spot-arith-drafter-small",
                    "transfer": "spot-transfer-drafter"}


def shipped_drafter_path(name: str) -> Path:
    return _asset(SHIPPED_DRAFTERS[name])


def shipped_target_drafter(pretrained: str) -> Path | None:
    """The own drafter of a target shipped inside the package (None: not a shipped target)."""
    where = Path(pretrained).expanduser().resolve()
    for folder, drafter in SHIPPED_TARGETS.values():
        if where == _asset(folder).resolve():
            return _asset(drafter)
    return None


def drafter_for(args: SpotArgs) -> Path:
    """The drafter a drafting run uses: the one named, else a shipped target's own drafter, and the shipped
    transfer drafter for every other target."""
    if args.drafter:
        return Path(args.drafter).expanduser()
    return shipped_target_drafter(args.pretrained) or shipped_drafter_path("transfer")


def default_graph_path() -> Path:
    """The draft graph calibrated on the embedded target (mode=graph), shipped inside the package."""
    return Path(__file__).resolve().parents[1] / "assets" / "spot-arith-graph.json"


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


def _as_ids(name: str, value: Any) -> tuple[int, ...]:
    """A token-id list: a list of ints, or a string "a|b|c" (commas separate model args on the CLI)."""
    items = value if isinstance(value, (list, tuple)) else str(value).replace(";", "|").split("|")
    try:
        out = tuple(int(v) for v in items if str(v).strip() != "")
    except (TypeError, ValueError):
        raise SpotArgError(f"spot-dlm: {name}={value!r} is not a list of token ids; accepted: e.g. 151645|151643") from None
    if not out or min(out) < 0:
        raise SpotArgError(f"spot-dlm: {name}={value!r} is not a list of token ids; accepted: e.g. 151645|151643")
    return out


@dataclass(frozen=True)
class SpotArgs:
    pretrained: str  # local checkpoint folder (or hub id where a hub is reachable)
    tokenizer: str | None = None  # defaults to `pretrained`
    mode: str = "spot"
    block_len: int | None = None  # defaults to the checkpoint config's block length
    gen_length: int | None = None  # upper bound on generated tokens; the task's max_gen_toks applies below it
    device: str = "cpu"
    # "auto": the checkpoint's dtype on CUDA, float32 elsewhere; resolved once the device is known
    # (families.common.resolve_dtype), and the resolved name replaces it in the run's args.
    dtype: str = "auto"
    batch_size: int | str = 1  # requests decoded together; "auto": sized from free memory at the first call
    max_batch_size: int | None = None  # cap for batch_size=auto
    trust_remote_code: bool = False
    seed: int | None = None  # base seed of the noise rows; default: the seed lm-eval gave torch
    drafter: str | None = None  # drafter folder; default: the shipped one (drafting modes only)
    # "auto" (the default): each step chooses every request's drafted states, 0 included, from measured costs
    # (`decoding.step_policy`); D: a fixed number of drafted states verified per round
    budget: int | str = "auto"
    gamma: float = 0.05  # mass floor, used by mode=spot-gamma
    control: str = "none"  # "paired": also run control on every request and report exactness and ratios
    graph: str | None = None  # calibrated draft graph (mode=graph); default: the shipped one
    verify: str = "coupled"  # "rejection": accept-residual sampling, chains only (exact in distribution)
    # Pad every forward to one fixed row count (1 + the largest budget), control's included, so verification
    # compares logits computed at one batch shape (accelerators' kernels are not batch-invariant in low bits).
    batch_invariant: bool = False
    family: str | None = None  # target family; default: detected from the checkpoint's config
    impl: str | None = None  # "native" (transformers' classes) or "remote" (official remote code); family default
    card: str | None = None  # model card whose defaults fill unset args (model_cards/)
    mask_id: int | None = None  # overrides the checkpoint's mask token id
    stop_ids: tuple[int, ...] | None = None  # overrides the checkpoint's eos / end-of-turn ids ("a|b|c")
    attn_implementation: str | None = None  # passed to transformers where a family allows a choice
    # Bidirectional families: "none" recomputes the whole canvas every forward (exact); "approx" is Fast-dLLM's
    # prefix cache (not lossless against full recomputation; SPOT stays exact relative to the cached control).
    cache: str = "none"
    # CPU intra-op threads while decoding; None ("auto"): lm_eval_spot.settings.threads picks (1 for small targets, unless
    # OMP_NUM_THREADS or torch.set_num_threads was set by the user).
    threads: int | None = None
    # Cross-block lookahead (block-causal targets): a round that can finish the block also scores the next block
    # in the same forward, so the next block's first round drafts too. Never changes the output; off under
    # batch_invariant (the extra row would change the forward's shape).
    lookahead: bool = True
    # Folder that collects drafter training data from this run's own decoding (any mode, no extra forward):
    # python -m lm_eval_spot.training train --data FOLDER --out D fits a drafter for this target from it.
    drafter_data: str | None = None
    # Online adaptation of the learned drafter from the run's own verified commits (`drafter/online.py`):
    # "auto" is online when the run drafts with a drafter not trained on this target (the shipped transfer
    # drafter, the default on every target but the embedded one), else off; drafter_out=FOLDER writes the adapted
    # drafter (and turns adaptation on under "auto").
    adapt: str = "auto"
    drafter_out: str | None = None
    adapt_roots: int = 8  # training roots per finished request (the adaptation's rate, and its cost)
    # Where the drafter runs: the host by default on every device (its numpy fast path; its inputs are a few KB of
    # stale summaries that the round brings to the host anyway), or a torch device name ("cuda:0") to override.
    drafter_device: str = "cpu"
    # Likelihood requests (multiple choice, perplexity): the masked-diffusion bound, enumerated exactly where a
    # unit's 2^k - 1 mask patterns fit in mc_num rows, else mc_num stratified Monte Carlo rows (per block on
    # block-causal targets, per continuation on bidirectional ones), mc_batch rows per forward.
    mc_num: int = 128
    mc_batch: int = 32
    cfg: float = 0.0  # classifier-free guidance of the likelihood forwards (0: off)
    mask_sharing: str = "common"  # "common": a context's continuations share mask draws; "independent"
    greedy: str = "auto"  # is_greedy by exact greedy decoding: "auto" (loglikelihood tasks), "always", "never"


def accepted_args() -> list[str]:
    return [f.name for f in fields(SpotArgs)]


def parse_args(raw: dict[str, Any]) -> SpotArgs:
    """Validate the raw model args (strings from the CLI or Python values) into SpotArgs."""
    unknown = sorted(set(raw) - set(accepted_args()))
    if unknown:
        raise SpotArgError(
            f"spot-dlm: unknown model argument(s) {', '.join(unknown)}; accepted: {', '.join(accepted_args())}"
        )
    if raw.get("card") is not None and raw.get("family") is None:
        # A card's defaults are merged by `cards.parse_model_args` (the arguments know nothing of cards): every card
        # names its family, so a card without one here was never merged.
        raise ValueError("card= is read by lm_eval_spot.settings.cards.parse_model_args, not config.parse_args")
    args: dict[str, Any] = {}
    for name in ("family", "card", "attn_implementation"):
        if raw.get(name) is not None:
            args[name] = str(raw[name])
    if raw.get("impl") is not None:
        if str(raw["impl"]) not in IMPLS:
            raise SpotArgError(f"spot-dlm: impl={raw['impl']!r} is not known; accepted: {', '.join(IMPLS)}")
        args["impl"] = str(raw["impl"])
    if raw.get("cache") is not None:
        if str(raw["cache"]) not in CACHES:
            raise SpotArgError(f"spot-dlm: cache={raw['cache']!r} is not known; accepted: {', '.join(CACHES)}")
        args["cache"] = str(raw["cache"])
    if raw.get("threads") is not None and str(raw["threads"]).lower() != "auto":
        args["threads"] = _as_int("threads", raw["threads"], 1)
    if raw.get("mask_id") is not None:
        args["mask_id"] = _as_int("mask_id", raw["mask_id"], 0)
    if raw.get("stop_ids") is not None:
        args["stop_ids"] = _as_ids("stop_ids", raw["stop_ids"])
    pretrained = raw.get("pretrained")
    if pretrained is None or str(pretrained) in ("", "default"):
        pretrained = str(default_target_path())
    elif str(pretrained) in SHIPPED_TARGETS:
        pretrained = str(shipped_target_path(str(pretrained)))
    args["pretrained"] = str(pretrained)
    if raw.get("tokenizer") is not None:
        args["tokenizer"] = str(raw["tokenizer"])
    mode = str(raw.get("mode", "spot"))
    if mode not in MODE_NAMES:
        raise SpotArgError(f"spot-dlm: mode={mode!r} is not known; accepted: {', '.join(MODE_NAMES)}")
    args["mode"] = mode
    if raw.get("block_len") is not None:
        args["block_len"] = _as_int("block_len", raw["block_len"], 1)
    if raw.get("gen_length") is not None:
        args["gen_length"] = _as_int("gen_length", raw["gen_length"], 1)
    if raw.get("device") is not None:
        args["device"] = str(raw["device"])
    dtype = str(raw.get("dtype", "auto")).replace("torch.", "")
    if dtype not in DTYPES:
        raise SpotArgError(f"spot-dlm: dtype={dtype!r} is not known; accepted: {', '.join(DTYPES)}")
    args["dtype"] = dtype
    bs = raw.get("batch_size", 1)
    # lm-eval's "auto:N" (re-probe N times) has no meaning here: the size is chosen once from free memory.
    args["batch_size"] = "auto" if isinstance(bs, str) and bs.startswith("auto") else _as_int("batch_size", bs, 1)
    if raw.get("max_batch_size") is not None:
        args["max_batch_size"] = _as_int("max_batch_size", raw["max_batch_size"], 1)
    if raw.get("trust_remote_code") is not None:
        args["trust_remote_code"] = _as_bool("trust_remote_code", raw["trust_remote_code"])
    if raw.get("batch_invariant") is not None:
        args["batch_invariant"] = _as_bool("batch_invariant", raw["batch_invariant"])
    if raw.get("lookahead") is not None:
        args["lookahead"] = _as_bool("lookahead", raw["lookahead"])
    if raw.get("seed") is not None:
        args["seed"] = _as_int("seed", raw["seed"], 0)
    if raw.get("drafter") is not None:
        name = str(raw["drafter"])
        args["drafter"] = str(shipped_drafter_path(name)) if name in SHIPPED_DRAFTERS else name
    if raw.get("budget") is not None:
        if str(raw["budget"]).lower() == "auto":
            args["budget"] = "auto"
        else:
            args["budget"] = _as_int("budget", raw["budget"], 1)
    if raw.get("graph") is not None:
        args["graph"] = str(raw["graph"])
    if raw.get("drafter_data") not in (None, ""):
        args["drafter_data"] = str(raw["drafter_data"])
    if raw.get("adapt") is not None:
        if str(raw["adapt"]) not in ADAPT_OPTIONS:
            raise SpotArgError(f"spot-dlm: adapt={raw['adapt']!r} is not known; accepted: {', '.join(ADAPT_OPTIONS)}")
        args["adapt"] = str(raw["adapt"])
    if raw.get("adapt_roots") is not None:
        args["adapt_roots"] = _as_int("adapt_roots", raw["adapt_roots"], 1)
    if raw.get("drafter_out") not in (None, ""):
        args["drafter_out"] = str(raw["drafter_out"])
    if raw.get("drafter_device") not in (None, ""):
        name = str(raw["drafter_device"]).strip()
        if not re.fullmatch(r"(cpu|cuda|mps|xpu|meta)(:\d+)?", name):
            raise SpotArgError(f"spot-dlm: drafter_device={name!r} is not a torch device; accepted: cpu (the default), "
                               "cuda, cuda:N, mps, xpu")
        args["drafter_device"] = name
    verify = str(raw.get("verify", "coupled"))
    if verify not in VERIFIERS:
        raise SpotArgError(f"spot-dlm: verify={verify!r} is not known; accepted: {', '.join(VERIFIERS)}")
    args["verify"] = verify
    if raw.get("gamma") is not None:
        try:
            gamma = float(raw["gamma"])
        except (TypeError, ValueError):
            gamma = -1.0
        if not 0.0 <= gamma < 1.0:
            raise SpotArgError(f"spot-dlm: gamma={raw['gamma']!r} is out of range; accepted: a number in [0, 1)")
        args["gamma"] = gamma
    for name in ("mc_num", "mc_batch"):
        if raw.get(name) is not None:
            args[name] = _as_int(name, raw[name], 1)
    if raw.get("cfg") is not None:
        try:
            cfg = float(raw["cfg"])
        except (TypeError, ValueError):
            cfg = -1.0
        if not 0.0 <= cfg < float("inf"):
            raise SpotArgError(f"spot-dlm: cfg={raw['cfg']!r} is out of range; accepted: a number >= 0 (0: off)")
        args["cfg"] = cfg
    for name, options in (("mask_sharing", MASK_SHARING), ("greedy", GREEDY_OPTIONS)):
        if raw.get(name) is not None:
            if str(raw[name]) not in options:
                raise SpotArgError(f"spot-dlm: {name}={raw[name]!r} is not known; accepted: {', '.join(options)}")
            args[name] = str(raw[name])
    control = str(raw.get("control", "none"))
    if control not in CONTROL_OPTIONS:
        raise SpotArgError(f"spot-dlm: control={control!r} is not known; accepted: {', '.join(CONTROL_OPTIONS)}")
    args["control"] = control
    out = SpotArgs(**args)
    _check_pretrained(out.pretrained)
    if out.verify == "rejection" and out.mode not in CHAIN_MODES:
        raise SpotArgError(
            f"spot-dlm: verify=rejection needs a chain (a sequential proposal), not mode={out.mode}; "
            f"accepted: mode in {', '.join(CHAIN_MODES)}, or verify=coupled"
        )
    if out.budget == "auto" and out.mode == "oracle":
        if raw.get("budget") is not None:
            raise SpotArgError("spot-dlm: budget=auto is not accepted with mode=oracle (the ceiling is measured at a "
                               "fixed budget); accepted: an integer budget")
        out = replace(out, budget=ORACLE_BUDGET)
    if out.mode == "graph":
        graph = Path(out.graph or default_graph_path()).expanduser()
        if not graph.is_file():
            raise SpotArgError(
                f"spot-dlm: graph={str(graph)!r} is not a file; accepted: a JSON written by "
                "python -m lm_eval_spot.baselines.graph"
            )
    if out.adapt == "online" and out.mode not in LEARNED_MODES:
        raise SpotArgError(f"spot-dlm: adapt=online trains the learned drafter; accepted with mode in "
                           f"{', '.join(LEARNED_MODES)}, or adapt=off")
    if out.drafter_out is not None and (out.adapt == "off" or out.mode not in LEARNED_MODES):
        raise SpotArgError(f"spot-dlm: drafter_out={out.drafter_out!r} writes the drafter adapted during the run; "
                           f"accepted with mode in {', '.join(LEARNED_MODES)} and adapt=online or auto")
    if out.mode in LEARNED_MODES and out.drafter is not None:  # the default one is resolved at load (fallback)
        drafter = Path(out.drafter).expanduser()
        if not (drafter / "drafter.json").is_file():
            raise SpotArgError(
                f"spot-dlm: drafter={str(drafter)!r} is not a drafter folder (no drafter.json); accepted: a folder "
                "written by python -m lm_eval_spot.training.train, a shipped one by name (paper, small, transfer), or "
                "mode=control"
            )
    return out


def _check_pretrained(path: str) -> None:
    p = Path(path).expanduser()
    looks_local = p.is_absolute() or path.startswith((".", "~")) or p.exists()
    if looks_local and not (p / "config.json").is_file():
        raise SpotArgError(
            f"spot-dlm: pretrained={path!r} is not a checkpoint folder (no config.json there); "
            "accepted: a local folder with config.json and a tokenizer, or omit it for the embedded target"
        )
