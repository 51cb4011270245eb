#!/usr/bin/env bash
# The real-scale round on a CUDA machine (python3 + torch + the wheels of scripts/gpu_wheels.txt; no lm-eval):
#   OUT=gpu_scale bash scripts/gpu_scale_check.sh
# A random-init SDAR-1.7B-shaped Qwen3 (vocab 151,936, 28 layers, bf16): bytes read back per round, share of
# decode time outside the target forwards (control and SPOT D=8, T=0 and T=1), the forward-time curve t(R) for
# R = 1..21 and batch-shape invariance (largest logit difference and transition flips by R). About 3-5 minutes
# on an H200. The drafter runs on the host. Wheels in .whl/ are used as in gpu_bench.sh (fetch them as
# scripts/gpu_check.sh says); gpu_check.sh is the issue-26 check (both prompt lengths, both attentions, the
# embedded benchmark) in one JSON.
set -euo pipefail
OUT=${OUT:-gpu_scale}
source "$(dirname "$0")/gpu_env.sh"
python3 -m research.scale_probe --shape sdar-1.7b --device cuda --dtype bfloat16 --gen 64 --curve \
  --invariance 21 --trials 2 --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
