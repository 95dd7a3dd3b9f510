"""`dflash-mlx` command line: a one-shot prompt by default, subcommands for the rest.

Each subcommand lives in its own module and is imported only when used, so
`dflash-mlx "prompt"` does not pay for Textual, plotting or training code.

Errors are handled here, once for every subcommand: a bad model, draft, file or
option prints one line to stderr and exits non-zero (2: bad input, 1: it could
not be done), Ctrl-C exits 130, and a traceback appears only with `--debug`.
"""

import argparse
import importlib
import os
import sys

EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130

SUBCOMMANDS = {
    "chat": ("dflash_mlx.tui.app", "Textual chat app"),
    "bench": ("dflash_mlx.bench.cli", "benchmarks: DFlash vs plain decoding"),
    "train": ("dflash_mlx.train.cli", "train a DFlash draft for an mlx-lm target"),
    "doctor": ("dflash_mlx.doctor", "report MLX backend, BLAS, packaged models"),
    "export": ("dflash_mlx.export", "write a loaded model as a standard mlx-lm folder"),
    "export-draft": ("dflash_mlx.interop.export_draft", "write a draft for vLLM, SGLang or speculators"),
    "serve": ("dflash_mlx.server", "OpenAI-compatible HTTP server"),
}


class CLIError(Exception):
    """A one-line error for the user; `code` is the exit status."""

    def __init__(self, message, code=EXIT_FAIL):
        super().__init__(message)
        self.code = code


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (`CLIError`) instead of usage + message."""

    def error(self, message):
        raise CLIError(f"{message} (see {self.prog} --help)", EXIT_USAGE)


def usage_error(e: Exception) -> CLIError:
    """A bad option value (e.g. from `GenerationOptions.check`) as a usage error."""
    return CLIError(str(e), EXIT_USAGE)


def checked_options(args, cls=None, **extra):
    """The generation options in flags from `add_generation_args` (plus `extra` fields
    of a subclass `cls`), checked: a bad value is a usage error."""
    from dflash_mlx.options import GenerationOptions

    try:
        return (cls or GenerationOptions)(**vars(GenerationOptions.from_args(args)), **extra).check()
    except ValueError as e:
        raise usage_error(e) from None


def check_sources(model: str, draft=None) -> None:
    """Fail on a model or draft name that cannot be anything, before loading either."""
    from dflash_mlx.loading import ModelLoadError, resolve_source

    try:
        resolve_source(model)
        if draft is not None:
            resolve_source(draft, "draft")
    except ModelLoadError as e:
        raise CLIError(str(e)) from None


def draft_for(model: str, draft=None, baseline=None):
    """The draft a front end loads for `model`: `draft`, else a packaged model's own.

    `baseline` is the front end's --baseline flag: True means no draft (None is
    returned); None means the front end has no such flag. Both names are
    checked before anything loads.
    """
    from dflash_mlx.packaged import is_packaged

    check_sources(model)
    if baseline:
        return None
    if draft is None:
        if not is_packaged(model):
            alternative = "" if baseline is None else ", or --baseline to use the target alone"
            raise CLIError(f"no DFlash draft for {model!r}: pass --draft (a folder or hub id){alternative}")
        draft = model
    check_sources(model, draft)
    return draft


def load_model_and_draft(model: str, draft=None, baseline=None, dtype=None, quiet=False):
    """`(model, tokenizer, draft or None, draft label or None)` for a front end's flags."""
    from dflash_mlx import load, load_draft
    from dflash_mlx.draft import DraftMismatchError
    from dflash_mlx.packaged import draft_label

    draft_name = draft_for(model, draft, baseline)
    target, tokenizer = load(model, dtype=dtype, quiet=quiet)
    if draft_name is None:
        return target, tokenizer, None, None
    try:
        loaded = load_draft(draft_name, target, quiet=quiet)
    except DraftMismatchError as e:
        raise CLIError(f"draft {draft_name!r} does not fit model {model!r}: {e}") from None
    except (FileNotFoundError, ValueError) as e:
        raise CLIError(f"could not load draft {draft_name!r}: {e}") from None
    return target, tokenizer, loaded, draft_label(draft_name)


def _one_line(e: BaseException) -> str:
    from dflash_mlx.draft import DraftMismatchError
    from dflash_mlx.loading import ModelLoadError

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
        module_name, args = SUBCOMMANDS[argv[0]][0], argv[1:]
    else:
        prog, module_name, args = "dflash-mlx", "dflash_mlx.run", argv
    try:
        return importlib.import_module(module_name).main(args)
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
    # `python -m dflash_mlx.cli` runs this file as __main__; the subcommands import
    # dflash_mlx.cli, so its CLIError is the one to catch
    from dflash_mlx.cli import main as cli_main

    sys.exit(cli_main())
