"""The depth benchmark: DFlash's default width against plain decoding deep into a context.

    python benchmarks/depth.py                      # shipped draft, depths 256 / 1k / 2k / 4k / window
    python benchmarks/depth.py --draft my-draft --out benchmarks/results/<date>-depth-my-draft

The same as `dflash-mlx bench --suite depth` (all of that command's options apply);
the method is in `dflash_mlx/bench/depth.py`.
"""

import sys

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
from dflash_mlx.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["--suite", "depth", *sys.argv[1:]]))
