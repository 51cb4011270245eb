#!/usr/bin/env bash
# The benchmark on a CUDA machine that has python3 + torch but no project install (e.g. a lent GPU box):
#   bash scripts/gpu_bench.sh --n 10            # extra arguments go to python -m lm_eval_spot.bench
# Wheels in .whl/ (transformers 4.57.x, tokenizers, huggingface_hub) are used when present, so the target runs
# under the transformers version the tests pin. The target runs on the GPU; drafting and verification logic
# run on the CPU (tiny tensors).
set -euo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-deps --target /tmp/spot_deps .whl/*.whl
  export PYTHONPATH=/tmp/spot_deps:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m lm_eval_spot.bench --device cuda --threads 4 --out "$OUT/bench" "$@" 2>&1 | tr '\r' '\n' | grep -v "^bench: " | tee "$OUT/bench_log.txt"
