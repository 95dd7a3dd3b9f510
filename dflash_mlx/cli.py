"""`dflash-mlx` command line: a one-shot prompt by default, subcommands for the rest.

Each subcommand lives in its own module and is imported only when used, so
`dflash-mlx "prompt"` does not pay for Textual, plotting or training code.
"""

import importlib
import sys

SUBCOMMANDS = {
    "chat": ("dflash_mlx.tui.app", "Textual chat app"),
    "bench": ("dflash_mlx.bench.cli", "benchmarks: DFlash vs plain decoding"),
    "train": ("dflash_mlx.train.cli", "train a DFlash draft for an mlx-lm target"),
    "doctor": ("dflash_mlx.doctor", "report MLX backend, BLAS, packaged models"),
    "export": ("dflash_mlx.export", "write a loaded model as a standard mlx-lm folder"),
    "serve": ("dflash_mlx.server", "OpenAI-compatible HTTP server"),
}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
        return module.main(argv[1:])
    from dflash_mlx import run

    return run.main(argv)


if __name__ == "__main__":
    sys.exit(main())
