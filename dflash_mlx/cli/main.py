"""`dflash-mlx` command line: a one-shot prompt by default, subcommands for the rest.

Each subcommand lives in its own module and is imported only when used, so
`dflash-mlx "prompt"` does not pay for Textual, plotting or training code.

Errors are handled here, once for every subcommand: a bad model, draft, file or
option prints one line to stderr and exits non-zero (2: bad input, 1: it could
not be done), Ctrl-C exits 130, and a traceback appears only with `--debug`.
"""

import importlib
import os
import sys

from dflash_mlx.models.draft.config import DraftMismatchError
from dflash_mlx.cli.common import EXIT_FAIL, EXIT_INTERRUPTED, SUBCOMMAND_HELP, CLIError
from dflash_mlx.models.loading import ModelLoadError

# The module that runs each subcommand (its `main(argv)`); `cli.common.SUBCOMMAND_HELP` describes them.
SUBCOMMANDS = {
    "chat": "dflash_mlx.tui.cli",
    "bench": "dflash_mlx.bench.cli",
    "train": "dflash_mlx.train.cli",
    "doctor": "dflash_mlx.cli.doctor",
    "export": "dflash_mlx.cli.export",
    "export-draft": "dflash_mlx.cli.export_draft",
    "serve": "dflash_mlx.serve.cli",
    "cache-prompt": "dflash_mlx.cli.cache_prompt",
}


def _one_line(e: BaseException) -> str:
    if isinstance(e, MemoryError):
        return "out of memory"
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, (CLIError, ModelLoadError, DraftMismatchError, FileNotFoundError, ValueError)):
        return text
    return f"{type(e).__name__}: {text} (run with --debug for the traceback)"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if argv and argv[0] in SUBCOMMANDS:
        prog = f"dflash-mlx {argv[0]}"
        module_name, args = SUBCOMMANDS[argv[0]], argv[1:]
    else:
        prog, module_name, args = "dflash-mlx", "dflash_mlx.cli.run", argv
    try:
        code = importlib.import_module(module_name).main(args)
        if code == 0:  # a split target's other ranks see this rank end well (`models.peers`)
            from dflash_mlx.models import peers

            peers.done()
        return code
    except KeyboardInterrupt:
        if debug:
            raise
        sys.stdout.flush()
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader went away (`dflash-mlx ... | head`): stop quietly, and keep
        # Python from complaining again when it flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        if debug:
            raise
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return e.code if isinstance(e, CLIError) else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
