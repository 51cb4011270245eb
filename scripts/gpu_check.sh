#!/usr/bin/env bash
# The device check of issue 26, for a bare GPU machine (python3 + torch, no internet). Writes ONE JSON,
# $OUT/gpu_check.json (rewritten after each section, so a stopped run keeps what it finished), with:
#   t(R) for R = 1..21 at prompt lengths 256 and 1,024 on a random-init SDAR-1.7B-shaped Qwen3 in bf16, fused and
#   reference shared-prefix attention side by side (plus the peak memory of each forward on CUDA); the share of
#   decode time outside the target forwards for control and SPOT D = 8 with the drafter on the host; batch-shape
#   invariance (logit difference, transition flips) at R = 9 and 21; the embedded benchmark's NFE and throughput
#   ratios for control, graph D = 8, SPOT D = 8 and D = 20 at T = 0 and 1.
#
#   OUT=gpu_check bash scripts/gpu_check.sh                 # on the GPU (meant to finish within 8 min on an H200)
#   bash scripts/gpu_check.sh --device cpu --quick          # smoke run on a CPU: tiny shape, ~15 s
#
# Wheels: every package the check imports besides torch is pinned in scripts/gpu_wheels.txt. Fetch them once,
# where pip reaches a registry, into .whl/ (git-ignored; ~34 MiB, name it in the device run's `carry`):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -r scripts/gpu_wheels.txt -d .whl
# When the folder holds wheels they are installed with pip install --no-index --no-deps --find-links into a
# folder of their own ($SITE) put first on PYTHONPATH: the machine's own, newer transformers and hub stay
# installed but unused. Without wheels the interpreter's packages are used (a warning names any other version).
#
# Options: --wheels DIR (default .whl); --device (default cuda), --quick and anything else go to
# python -m research.scale_probe --check. PYTHON picks the interpreter (default python3).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
OUT=${OUT:-gpu_check}
SITE=${SITE:-/tmp/spot_gpu_check_site}
WHEELS=$ROOT/.whl
ARGS=()
DEVICE=()
while (($#)); do
  case $1 in
    --wheels) WHEELS=$2; shift 2 ;;
    --device) DEVICE=(--device "$2"); shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
((${#DEVICE[@]})) || DEVICE=(--device cuda)
mkdir -p "$OUT"
t0=$(date +%s)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --upgrade \
    --find-links "$WHEELS" --target "$SITE" -r "$ROOT/scripts/gpu_wheels.txt"
  export PYTHONPATH=$SITE:$PYTHONPATH
fi
# Every pin importable, at its version (a missing one stops the run here rather than minutes in).
"$PY" - "$ROOT/scripts/gpu_wheels.txt" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version

missing, other = [], []
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, want = line.split("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        missing.append(line)
        continue
    if have != want:
        other.append(f"{name} {have} (pinned {want})")
if other:
    print("gpu_check: WARNING: versions other than scripts/gpu_wheels.txt:", ", ".join(other), file=sys.stderr)
if missing:
    sys.exit("gpu_check: missing " + ", ".join(missing) + ": put their wheels in .whl/ (see scripts/gpu_check.sh)")
PYEOF
PYTHONUNBUFFERED=1 "$PY" -m research.scale_probe --check "${DEVICE[@]}" --out "$OUT/gpu_check.json" \
  ${ARGS[@]+"${ARGS[@]}"} 2>&1 | tee "$OUT/gpu_check.log"
echo "gpu_check: $OUT/gpu_check.json in $(($(date +%s) - t0)) s" | tee -a "$OUT/gpu_check.log"
