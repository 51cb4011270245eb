# Sourced by the GPU scripts: output folder, PYTHONPATH (the checkout, plus wheels from .whl/ when present, so the
# target runs under the transformers version the tests pin) and the GPU's identity in $OUT/gpu.txt.
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-deps --target /tmp/spot_deps .whl/*.whl
  export PYTHONPATH=/tmp/spot_deps:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
