"""Run `python -m lm_eval_spot.tools.check` on tiny random-weight checkpoints of every fixture family, built from
the official remote code in ../shared/remote_code (needs ../shared and transformers 4.57.x; the numbers in
docs/families.md come from this script). Usage: python scripts/check_fixtures.py [--out DIR]"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.remote_fixtures import add_test_stubs, build_remote, save_checkpoint, tokenizer_mask_id  # noqa: E402

from lm_eval_spot.tools import check  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None, help="folder for the checkpoints and JSON (default: a temp dir)")
    a = ap.parse_args()
    root = a.out or Path(tempfile.mkdtemp())
    root.mkdir(parents=True, exist_ok=True)
    add_test_stubs()  # TEST-ONLY flash_attn stand-in: SDAR's remote code imports flash_attn
    save_checkpoint(build_remote("sdar", mask_token_id=tokenizer_mask_id()), root / "sdar")
    save_checkpoint(build_remote("llada2_moe", seed=1), root / "llada2")
    from helpers.targets import build  # the fixture tweaks for the bidirectional families (see there)

    for fam in ("llada", "dream"):
        save_checkpoint(build(fam, tokenizer_mask_id()), root / fam)
    runs = {
        "sdar-native": f"pretrained={root / 'sdar'},trust_remote_code=true",
        "sdar-remote": f"pretrained={root / 'sdar'},impl=remote,trust_remote_code=true",
        "llada2-fp32": f"pretrained={root / 'llada2'},trust_remote_code=true,block_len=8",
        "llada2-bf16": f"pretrained={root / 'llada2'},trust_remote_code=true,block_len=8,dtype=bfloat16",
        "llada-native": f"pretrained={root / 'llada'},trust_remote_code=true,block_len=8",
        "llada-approx": f"pretrained={root / 'llada'},cache=approx,block_len=8",
        "dream-remote": f"pretrained={root / 'dream'},impl=remote,trust_remote_code=true,block_len=8",
        "dream-approx": f"pretrained={root / 'dream'},cache=approx,block_len=8",
    }
    worst = 0
    for name, model_args in runs.items():
        print(f"\n## {name}\n")
        worst = max(worst, check.main(["--model_args", model_args, "--out", str(root / f"{name}.json")]))
    return worst


if __name__ == "__main__":
    sys.exit(main())
