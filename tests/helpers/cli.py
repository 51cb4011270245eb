"""The real `lm_eval` CLI in a subprocess, as the tests run it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

# The lm_eval console script of the interpreter running the tests (a venv need not be activated).
LM_EVAL = str(Path(sys.executable).with_name("lm_eval")) if Path(sys.executable).with_name("lm_eval").exists() \
    else (shutil.which("lm_eval") or "lm_eval")


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([LM_EVAL, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=900)

