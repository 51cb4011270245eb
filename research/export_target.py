"""Export a trained target's final folder as a shipped asset: weights cast to a smaller dtype (bfloat16 halves a
float32 checkpoint; `dtype=auto` loads it back as float32 on a CPU and as bfloat16 on CUDA), config, generation
config and tokenizer copied, nothing else (no optimizer state, no logs).

    python -m research.export_target --src /work/runs/en5/final --out lm_eval_spot/assets/spot-gsm8k-target

Reads and writes safetensors only (no pickled code runs).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger("research.export_target")

KEEP = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export(src: Path, out: Path, dtype: str = "bfloat16") -> int:
    """Write the asset; returns the weights file's size in bytes."""
    weights = src / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} is missing (a research.train_target final folder holds it)")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(DTYPES[dtype]).contiguous() if v.is_floating_point() else v
               for k, v in load_file(str(weights)).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in KEEP:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = dtype  # what the weights are stored in (transformers >= 4.56 writes this key)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    size = (out / "model.safetensors").stat().st_size
    log.info("wrote %s (%d tensors, %.2f MB of weights in %s)", out, len(tensors), size / 1e6, dtype)
    return size


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, required=True, help="a trained target's final folder")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    export(a.src, a.out, a.dtype)


if __name__ == "__main__":
    main()
