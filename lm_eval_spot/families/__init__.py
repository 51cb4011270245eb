"""The target families: each is detected from a checkpoint's config (or forced with `family=`) and loads the
checkpoint into an adapter behind the contract (`lm_eval_spot.adapters.base`). Family ids live only in their
module and their model cards. Adding a family: README, "Adding a target family"."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from lm_eval_spot.settings.args import SpotArgError, SpotArgs
from lm_eval_spot.families import dream, hf_causal, llada, llada2, sdar
from lm_eval_spot.families.common import LoadedTarget, read_config, with_concrete_dtype


@dataclass(frozen=True)
class Family:
    name: str
    impls: tuple[str, ...]  # the first is the default
    module: ModuleType  # matches(cfg) -> bool; load(args, cfg, impl) -> LoadedTarget

    def matches(self, cfg: dict[str, Any]) -> bool:
        return bool(self.module.matches(cfg))


# Most specific first: `hf-block-causal` accepts any natively loadable causal LM, so it is the fallback.
FAMILIES: tuple[Family, ...] = tuple(Family(m.NAME, m.IMPLS, m) for m in (sdar, llada2, llada, dream, hf_causal))
ADD_FAMILY_HINT = "see README.md, 'Adding a target family'"


def names() -> list[str]:
    return [f.name for f in FAMILIES]


def by_name(name: str) -> Family:
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise SpotArgError(f"spot-dlm: family={name!r} is not known; supported: {', '.join(names())} ({ADD_FAMILY_HINT})")


def detect(cfg: dict[str, Any], pretrained: str) -> Family:
    for fam in FAMILIES:
        if fam.matches(cfg):
            return fam
    raise SpotArgError(
        f"spot-dlm: pretrained={pretrained!r} (model_type={cfg.get('model_type')!r}, architectures="
        f"{cfg.get('architectures')}) is not a supported family; supported: {', '.join(names())} "
        f"(force one with family=NAME; {ADD_FAMILY_HINT})"
    )


def resolve(args: SpotArgs, cfg: dict[str, Any]) -> tuple[Family, str]:
    fam = by_name(args.family) if args.family else detect(cfg, args.pretrained)
    impl = args.impl or fam.impls[0]
    if impl not in fam.impls:
        raise SpotArgError(f"spot-dlm: impl={impl!r} is not available for family {fam.name}; accepted: "
                           f"{', '.join(fam.impls)}")
    if args.cache == "approx" and not getattr(fam.module, "APPROX_CACHE", False):
        raise SpotArgError(f"spot-dlm: cache=approx is for fully bidirectional families (llada, dream); family "
                           f"{fam.name} is block-causal and its prefix cache is already exact: drop cache=approx")
    return fam, impl


def load_target(args: SpotArgs) -> LoadedTarget:
    """Load `args.pretrained` through its family; every interface fact comes from the checkpoint, its card or
    the model args."""
    cfg = read_config(args.pretrained)
    args = with_concrete_dtype(args, cfg)
    fam, impl = resolve(args, cfg)
    loaded = fam.module.load(args, cfg, impl)
    info = loaded.adapter.info
    from lm_eval_spot.families.common import log

    log.info("loaded target %s: family=%s impl=%s block_len=%d mask_id=%d stop_ids=%s device=%s dtype=%s",
             args.pretrained, fam.name, impl, info.block_len, info.mask_id, sorted(info.stop_ids),
             loaded.adapter.device, args.dtype)
    return loaded
