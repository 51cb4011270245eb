"""Model cards (`model_cards/*.md`): a YAML front matter with a target's interface facts and recommended
settings, then prose. `card=NAME` fills the model args a user leaves unset; explicit args win. A card never turns
on trust_remote_code: running a checkpoint's code stays the user's explicit choice."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lm_eval_spot import families
from lm_eval_spot.settings.args import DTYPES, IMPLS, SpotArgError, SpotArgs, parse_args

REQUIRED = ("family", "hub_id", "mask_id", "eos_id", "stop_ids", "block_len", "grid_origin", "chat_template",
            "dtype", "transformers", "prefix_cache", "budget", "gamma", "drafter")
OPTIONAL = ("impl", "eot_id", "variants", "verified", "shape", "spot_variant")
# card field -> model arg it fills
ARG_FIELDS = {"hub_id": "pretrained", "family": "family", "impl": "impl", "block_len": "block_len",
              "mask_id": "mask_id", "stop_ids": "stop_ids", "dtype": "dtype", "budget": "budget", "gamma": "gamma"}


@dataclass(frozen=True)
class Card:
    name: str
    fields: dict[str, Any] = field(hash=False)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]


def cards_dir() -> Path:
    """Inside the installed package, or the repo's `model_cards/` in a source checkout."""
    here = Path(__file__).resolve().parents[1]  # the package
    for cand in (here / "model_cards", here.parent / "model_cards"):
        if cand.is_dir():
            return cand
    return here / "model_cards"


def _front_matter(path: Path) -> dict[str, Any] | None:
    import yaml

    text = path.read_text()
    if not text.startswith("---\n"):
        return None
    end = text.find("\n---", 4)
    if end < 0:
        raise SpotArgError(f"spot-dlm: model card {path.name} has an unterminated front matter")
    data = yaml.safe_load(text[4:end])
    if not isinstance(data, dict):
        raise SpotArgError(f"spot-dlm: model card {path.name}: the front matter is not a mapping")
    return data


def card_names() -> list[str]:
    """Every loadable card name, block variants included (e.g. sdar-4b-chat-b32)."""
    out = []
    for path in sorted(cards_dir().glob("*.md")):
        data = _front_matter(path)
        if data is None:
            continue
        out.append(path.stem)
        out.extend(f"{path.stem}-{v}" for v in (data.get("variants") or {}))
    return out


def load_card(name: str) -> Card:
    base, variant = name, None
    path = cards_dir() / f"{name}.md"
    if not path.is_file() and "-" in name:
        base, variant = name.rsplit("-", 1)
        path = cards_dir() / f"{base}.md"
    data = _front_matter(path) if path.is_file() else None
    if data is None or (variant is not None and variant not in (data.get("variants") or {})):
        raise SpotArgError(f"spot-dlm: card={name!r} is not known; accepted: {', '.join(card_names())}")
    fields_ = {k: v for k, v in data.items() if k != "variants"}
    if variant is not None:
        fields_.update(data["variants"][variant])
    fields_["variants"] = data.get("variants") or {}
    return validate(Card(name, fields_))


def validate(card: Card) -> Card:
    """Every field present and well-typed; the family and impl exist. Raises SpotArgError naming the field."""
    f = card.fields

    def bad(key: str, why: str) -> SpotArgError:
        return SpotArgError(f"spot-dlm: model card {card.name}: {key} {why}")

    missing = [k for k in REQUIRED if k not in f]
    if missing:
        raise bad(", ".join(missing), "missing")
    extra = sorted(set(f) - set(REQUIRED) - set(OPTIONAL))
    if extra:
        raise bad(", ".join(extra), "not a card field")
    fam = families.by_name(f["family"])
    if f.get("impl") is not None and (f["impl"] not in IMPLS or f["impl"] not in fam.impls):
        raise bad("impl", f"must be one of {', '.join(fam.impls)}")
    for key in ("mask_id", "eos_id", "block_len"):
        if not isinstance(f[key], int) or f[key] < (1 if key == "block_len" else 0):
            raise bad(key, "must be a non-negative integer" if key != "block_len" else "must be a positive integer")
    stops = f["stop_ids"]
    if not isinstance(stops, list) or not stops or not all(isinstance(s, int) and s >= 0 for s in stops):
        raise bad("stop_ids", "must be a non-empty list of token ids")
    if f["eos_id"] not in stops or (f.get("eot_id") is not None and f["eot_id"] not in stops):
        raise bad("stop_ids", "must contain eos_id and eot_id")
    if f["mask_id"] in stops:
        raise bad("mask_id", "must not be a stop id")
    if f["grid_origin"] not in ("zero", "prompt_end"):
        raise bad("grid_origin", "must be zero or prompt_end")
    if f["prefix_cache"] not in ("exact", "approximate"):
        raise bad("prefix_cache", "must be exact or approximate")
    concrete = [d for d in DTYPES if d != "auto"]
    if f["dtype"] not in concrete:  # a card states the dtype its numbers were measured in, never auto
        raise bad("dtype", f"must be one of {', '.join(concrete)}")
    if not (f["budget"] == "auto" or (isinstance(f["budget"], int) and f["budget"] >= 1)):
        raise bad("budget", "must be auto or a positive integer")
    if not isinstance(f["gamma"], (int, float)) or not 0 <= f["gamma"] < 1:
        raise bad("gamma", "must be a number in [0, 1)")
    if f["drafter"] is not None and not isinstance(f["drafter"], str):
        raise bad("drafter", "must be a drafter folder, a shipped drafter's name (transfer, paper, small) or null")
    if f.get("spot_variant") is not None and not isinstance(f["spot_variant"], str):
        raise bad("spot_variant", "must be a text: the block variant recommended for SPOT, and why")
    for name, over in (f.get("variants") or {}).items():
        if not isinstance(over, dict) or not set(over) <= {"hub_id", "block_len"}:
            raise bad(f"variants.{name}", "may set only hub_id and block_len")
    return card


def card_defaults(name: str) -> dict[str, Any]:
    """The model args a card fills (explicit args override them)."""
    card = load_card(name)
    out = {arg: card.fields[key] for key, arg in ARG_FIELDS.items() if card.fields.get(key) is not None}
    if card.fields.get("drafter"):
        out["drafter"] = card.fields["drafter"]
    out["card"] = name
    return out


def parse_model_args(raw: dict[str, Any]) -> SpotArgs:
    """The user's model args validated, with `card=NAME`'s defaults filled in where the user left them unset."""
    if raw.get("card") is not None:
        raw = {**card_defaults(str(raw["card"])), **{k: v for k, v in raw.items() if v is not None}}
    return parse_args(raw)
