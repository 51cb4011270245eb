#!/usr/bin/env bash
# The README's worked example: control and SPOT at T=0 and T=1 on the embedded target, then compare.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/compare_example}
LIMIT=${LIMIT:-50}
for mode in control spot; do
  for T in 0 1; do
    gen=""; [ "$T" = 1 ] && gen="--gen_kwargs temperature=1.0,do_sample=true"
    .venv/bin/lm_eval --model spot-dlm --model_args mode=$mode --tasks spot_arith --limit "$LIMIT" \
      --device cpu $gen --log_samples --output_path "$OUT/${mode}_T$T"
  done
done
.venv/bin/python -m lm_eval_spot.tools.compare "$OUT"/control_T0 "$OUT"/control_T1 "$OUT"/spot_T0 "$OUT"/spot_T1 --out "$OUT/compare"
