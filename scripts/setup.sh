#!/usr/bin/env bash
# Set-up for lm-eval-spot: a virtual environment at .venv (reusing one that exists), torch kept if it is
# already importable there (system site-packages are visible) and otherwise the CPU build torch==2.13.0,
# then this package with transformers 4.57.x (the version CI tests; SPOT_TRANSFORMERS=5.* picks another).
# `bash scripts/setup.sh` installs it as users get it (non-editable);
# `bash scripts/setup.sh test` installs it editable with the test extra. SPOT_VENV=DIR uses another folder
# (CI builds a second one with SPOT_TRANSFORMERS=5.* to run the suite under transformers 5.x).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPOT_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
if "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: keeping installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  echo "setup: installing torch==2.13.0 (CPU build)"
  "$PY" -m pip install -q torch==2.13.0
fi
if [ "${1:-}" = "test" ]; then
  "$PY" -m pip install -q -e ".[test]" "transformers==${SPOT_TRANSFORMERS:-4.57.*}"
else
  "$PY" -m pip install -q . "transformers==${SPOT_TRANSFORMERS:-4.57.*}"
fi
"$PY" -m pip check >/dev/null 2>&1 || echo "setup: note: pip check reports conflicts (see '$PY -m pip check')"
echo "setup: done ($("$PY" -c 'import transformers, lm_eval; print("transformers", transformers.__version__, "| lm-eval", lm_eval.__version__)'))"
