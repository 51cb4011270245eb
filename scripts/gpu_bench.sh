#!/usr/bin/env bash
# The benchmark on a CUDA machine that has python3 + torch but no project install (e.g. a lent GPU box); the
# bench reads its prompts through lm-eval's task manager, so lm-eval 0.4.13 must be importable there (its wheels and
# their dependencies in .whl/, or installed: far more than scripts/gpu_wheels.txt, and datasets' pyarrow/pandas
# alone exceed a device run's 64 MiB carry, so this works only where the machine's image has them). On a bare
# machine, scripts/gpu_check.sh runs the embedded benchmark's main rows without lm-eval:
#   bash scripts/gpu_bench.sh --n 10            # extra arguments go to python -m research.bench
# Wheels in .whl/ (transformers 4.57.x, tokenizers, huggingface_hub) are used when present, so the target runs
# under the transformers version the tests pin. The target runs on the GPU; drafting and verification logic
# run on the CPU (tiny tensors).
set -euo pipefail
OUT=${OUT:-gpu_out}
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m research.bench --device cuda --threads 4 --out "$OUT/bench" "$@" 2>&1 | tr '\r' '\n' | grep -v "^bench: " | tee "$OUT/bench_log.txt"
