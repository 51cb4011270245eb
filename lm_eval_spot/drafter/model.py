"""The commit-order model: which still-masked slot of the active block will the target commit next?

A 3-layer bidirectional transformer over the L slots (paper: d_model 128, 8 heads, ~0.62M parameters).
Checkpoints are safetensors weights plus JSON metadata; loading one checks that it fits the target.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lm_eval_spot.settings.args import SpotUserError
from lm_eval_spot.drafter.encoder import encode
from lm_eval_spot.decoding.stale import Stale
from lm_eval_spot.drafter.features import FEATURE_VERSION, MASKED, MAX_DEPTH, TOP_K, node_status, prob_features


log = logging.getLogger(__name__)


class DrafterMismatchError(SpotUserError):
    """A drafter checkpoint that does not fit the target or this code (block length, feature version)."""


@dataclass(frozen=True)
class OrderModelConfig:
    d_model: int = 128
    n_heads: int = 8
    n_layers: int = 3
    d_ff: int = 512
    top_k: int = TOP_K
    max_block_len: int = 64
    dropout: float = 0.0


@dataclass(frozen=True)
class DrafterMeta:
    feature_version: int
    top_k: int
    block_lens: tuple[int, ...]  # block lengths it was trained on (and is allowed to run at)
    target: str
    task: str
    heldout_accuracy: float | None = None
    heldout_stale_conf_accuracy: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class OrderModel(nn.Module):
    def __init__(self, cfg: OrderModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.inp = nn.Linear(2 * cfg.top_k, d)
        self.status = nn.Embedding(4, d)
        self.depth = nn.Embedding(MAX_DEPTH + 1, d)
        self.slot = nn.Embedding(cfg.max_block_len, d)
        layer = nn.TransformerEncoderLayer(d, cfg.n_heads, cfg.d_ff, cfg.dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)

    def forward(self, probs_feat: torch.Tensor, status: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """probs_feat [N, L, 2k] (or [L, 2k], shared), status/depth [N, L] -> logits [N, L] over MASKED slots
        (-inf elsewhere)."""
        n, L = status.shape
        x = self.inp(probs_feat)
        if x.dim() == 2:
            x = x.unsqueeze(0).expand(n, -1, -1)
        slots = torch.arange(L, device=status.device)
        x = x + self.status(status) + self.depth(depth.clamp(max=MAX_DEPTH)) + self.slot(slots)[None]
        h = self.norm(self.encoder(x))
        logits = self.head(h).squeeze(-1)
        return logits.masked_fill(status != MASKED, float("-inf"))

    def shared_input(self, probs_feat: torch.Tensor) -> torch.Tensor:
        """[L, 2k] -> [L, d]: the part of the input that every hypothetical state of one round shares."""
        L = probs_feat.shape[0]
        return self.inp(probs_feat) + self.slot(torch.arange(L, device=probs_feat.device))

    def infer(self, shared: torch.Tensor, status: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """Inference forward (same weights and maths as `forward`, eval only): `shared` from `shared_input`.

        The encoder runs as functional ops (`encoder.encode`): drafting calls the model once per tree level, and
        on small inputs the module-level dispatch of nn.TransformerEncoder costs more than its arithmetic.
        """
        F = torch.nn.functional
        d = self.cfg.d_model
        x = encode(self.encoder, shared.unsqueeze(0) + self.status(status) + self.depth(depth.clamp(max=MAX_DEPTH)))
        h = F.layer_norm(x, (d,), self.norm.weight, self.norm.bias, self.norm.eps)
        logits = F.linear(h, self.head.weight, self.head.bias).squeeze(-1)
        return logits.masked_fill(status != MASKED, float("-inf"))

    # The interface the tree proposer and the cost measurement use (shared with factored.FactoredOrderModel).
    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @torch.no_grad()
    def prepare(
        self, stale: Stale, committed: torch.Tensor, eligible: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Trajectories store top-k probabilities in float16; rounding the same way here keeps the inputs the
        # model sees at inference identical in kind to its training inputs (near-1 values saturate alike).
        topk = stale.topk[:, : self.cfg.top_k].to(self.device).half().float()
        return self.shared_input(prob_features(topk)), committed.to(self.device), eligible.to(self.device)

    @torch.no_grad()
    def node_probs(self, prep: tuple[torch.Tensor, torch.Tensor, torch.Tensor], depth_maps: torch.Tensor) -> torch.Tensor:
        shared, committed, eligible = prep
        dm = depth_maps.to(self.device)
        logits = self.infer(shared, node_status(committed, eligible, dm), dm)
        return torch.softmax(logits, dim=-1).nan_to_num(0.0).cpu()


DrafterModel = Any  # OrderModel | factored.FactoredOrderModel (a union would make the modules import each other)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def save_drafter(model: DrafterModel, meta: DrafterMeta, out_dir: Path) -> None:
    """Weights (safetensors) + config/metadata (JSON), each written atomically."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    with tempfile.NamedTemporaryFile(dir=out_dir, suffix=".tmp", delete=False) as f:
        tmp = f.name
    save_file(state, tmp)
    os.replace(tmp, out_dir / "drafter.safetensors")
    # The weights' digest lets a load detect a truncated or altered file (safetensors has no checksum).
    digest = hashlib.sha256((out_dir / "drafter.safetensors").read_bytes()).hexdigest()
    doc = {"config": asdict(model.cfg), "meta": asdict(meta), "params": n_params(model), "weights_sha256": digest}
    tmp_json = out_dir / "drafter.json.tmp"
    tmp_json.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp_json, out_dir / "drafter.json")


def feature_version_of(model: DrafterModel) -> int:
    from lm_eval_spot.drafter.factored import FACTORED_FEATURE_VERSION, FactoredOrderModel

    return FACTORED_FEATURE_VERSION if isinstance(model, FactoredOrderModel) else FEATURE_VERSION


def build_model(config: dict[str, Any]) -> DrafterModel:
    """A model from its saved config: `arch` "factored" (feature version 2) or absent (the per-node encoder, v1)."""
    from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel

    config = dict(config)
    arch = config.get("arch", "encoder")
    if arch == "factored":
        return FactoredOrderModel(FactoredConfig(**config))
    if arch != "encoder":
        raise DrafterMismatchError(f"spot-dlm: unknown drafter arch {arch!r}; accepted: 'factored' or 'encoder'")
    config.pop("arch", None)
    return OrderModel(OrderModelConfig(**config))


def load_drafter(path: Path, block_len: int) -> tuple[DrafterModel, DrafterMeta]:
    """Load a drafter folder; fail clearly if it does not fit (feature version, a block longer than its slot
    tables) or is damaged; a block length it was not trained on runs with a warning.

    Nothing in the folder executes: the description is JSON, the weights safetensors (a pickle is refused), and
    the weights' sha256 (written by `save_drafter`) is checked, so a truncated or altered file stops the run.
    """
    model, meta = read_drafter(path)
    check_block_len(model, meta, block_len, str(path))
    return model, meta


def read_drafter(path: Path) -> tuple[DrafterModel, DrafterMeta]:
    """A drafter folder's model (eval mode) and description, checked as `load_drafter` checks them but for no
    particular block length (training starts from it: `python -m lm_eval_spot.training train --init`)."""
    path = Path(path)
    doc, meta = _read_description(path)
    try:
        model = build_model(doc["config"])
    except (TypeError, ValueError) as err:
        if isinstance(err, DrafterMismatchError):
            raise
        raise DrafterMismatchError(f"spot-dlm: drafter {str(path)!r}: drafter.json's config is not valid ({err})") from None
    expected = feature_version_of(model)
    if meta.feature_version != expected:
        raise DrafterMismatchError(
            f"spot-dlm: drafter {str(path)!r} has feature version {meta.feature_version}, this code reads "
            f"version {expected} for its architecture; retrain it with python -m lm_eval_spot.training.train"
        )
    state = _read_weights(path, doc.get("weights_sha256"))
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[1:2] or [str(err)[:200]]
        raise DrafterMismatchError(
            f"spot-dlm: drafter {str(path)!r}: drafter.safetensors does not match drafter.json's config "
            f"({first[0].strip()})"
        ) from None
    return model.eval(), meta


def check_block_len(model: DrafterModel, meta: DrafterMeta, block_len: int, name: str) -> None:
    """A block length the drafter never saw runs with a warning (its inputs are defined for any length up to its
    slot tables); one past those tables is refused."""
    if block_len in meta.block_lens:
        return
    if block_len > model.cfg.max_block_len:
        raise DrafterMismatchError(
            f"spot-dlm: drafter {name!r} reads blocks of at most {model.cfg.max_block_len} slots, the target runs "
            f"block_len={block_len}; accepted: block_len <= {model.cfg.max_block_len} or another drafter"
        )
    log.warning("spot-dlm: drafter %r was trained for block length(s) %s, the target runs block_len=%d: it runs "
                "(outputs stay exact) but may accept fewer drafts than a drafter trained at this length",
                name, list(meta.block_lens), block_len)


def _read_description(path: Path) -> tuple[dict[str, Any], DrafterMeta]:
    doc_path = path / "drafter.json"
    if not doc_path.is_file():
        raise DrafterMismatchError(f"spot-dlm: drafter={str(path)!r} has no drafter.json (not a drafter folder)")
    try:
        doc = json.loads(doc_path.read_text(encoding="utf-8"))
        meta_d = dict(doc["meta"])
        meta_d["block_lens"] = tuple(int(b) for b in meta_d["block_lens"])
        return doc, DrafterMeta(**meta_d)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise DrafterMismatchError(
            f"spot-dlm: drafter {str(path)!r}: drafter.json is not a drafter description "
            f"({type(err).__name__}: {str(err)[:120]}); rewrite it with python -m lm_eval_spot.training.train"
        ) from None


def _read_weights(path: Path, sha256: str | None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    weights = path / "drafter.safetensors"
    if not weights.is_file():
        raise DrafterMismatchError(f"spot-dlm: drafter {str(path)!r} has no drafter.safetensors")
    data = weights.read_bytes()
    if data[:2] == b"PK" or data[:1] == b"\x80":
        raise DrafterMismatchError(
            f"spot-dlm: drafter {str(path)!r}: drafter.safetensors is a pickle (torch.save), not safetensors; "
            "refused, nothing in it was run. Save drafters with lm_eval_spot.drafter.model.save_drafter"
        )
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise DrafterMismatchError(
            f"spot-dlm: drafter {str(path)!r}: drafter.safetensors does not have the sha256 drafter.json records "
            "(truncated, altered or from another training run)"
        )
    try:
        return load(data)
    except Exception as err:  # safetensors raises its own error types for a damaged header
        raise DrafterMismatchError(
            f"spot-dlm: drafter {str(path)!r}: drafter.safetensors is not a readable safetensors file "
            f"({type(err).__name__}: {str(err)[:120]}; truncated or damaged)"
        ) from None
