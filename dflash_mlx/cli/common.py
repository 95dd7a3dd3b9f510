"""What every front end (one-shot run, chat, bench, serve, train, doctor, export) shares:
the one-line error type and argument parser, options from flags, and the model and draft
they load, with one-line errors.

`dflash_mlx.cli.main.main` runs each front end and turns these errors into one line and an exit
status; nothing here dispatches, so front ends import this module, never `cli`.
"""

import argparse

EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130

# What `dflash-mlx --help` lists; `dflash_mlx.cli.main.SUBCOMMANDS` says which module runs each.
SUBCOMMAND_HELP = {
    "chat": "Textual chat app",
    "bench": "benchmarks: DFlash vs plain decoding",
    "train": "train a DFlash draft for an mlx-lm target",
    "doctor": "report MLX backend, BLAS, packaged models",
    "export": "write a loaded model as a standard mlx-lm folder",
    "export-draft": "write a draft for vLLM, SGLang or speculators",
    "serve": "OpenAI-compatible HTTP server",
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
    from dflash_mlx.models.loading import ModelLoadError, resolve_source

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
    from dflash_mlx.models.packaged import is_packaged

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
    from dflash_mlx.models.draft.config import DraftMismatchError
    from dflash_mlx.models.packaged import draft_label

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
