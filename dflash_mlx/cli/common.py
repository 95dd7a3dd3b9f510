"""What every front end (one-shot run, chat, bench, serve, train, doctor, export) shares:
the one-line error type and argument parser, options from flags, and the model and draft
they load, with one-line errors.

`dflash_mlx.cli.main.main` runs each front end and turns these errors into one line and an exit
status; nothing here dispatches, so front ends import this module, never `cli`.
"""

import argparse
import sys
from typing import Optional

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
    "cache-prompt": "run a prompt once and save its caches for --prompt-cache-file",
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


def no_draft_note(model: str) -> str:
    """What a front end says when `model` has no DFlash draft (it then decodes with copies)."""
    return (f"no DFlash draft for {model!r}: copies of the context are on (verified where they pay, plain "
            "steps otherwise; exact); --draft adds a draft, --baseline is plain decoding")


def draft_for(model: str, draft=None, baseline=None, without_draft: bool = False):
    """The draft a front end loads for `model`: `draft`, else the trained draft shipped with a packaged model.

    `baseline` is the front end's --baseline flag: True means no draft (None is
    returned); None means the front end has no such flag. Both names are
    checked before anything loads. `without_draft`: a front end that decodes with
    copies of the context alone gets None for a model with no draft (else an error).
    A packaged model with no trained draft shipped yet has none: an untrained one only
    costs time (its chains are rarely accepted; `--draft <packaged name>` still loads one).
    """
    from dflash_mlx.models.packaged import is_packaged, untrained_draft

    check_sources(model)
    if baseline:
        return None
    if draft is None:
        if not is_packaged(model) or untrained_draft(model):
            if without_draft:
                return None
            shipped = " (none is shipped with it yet)" if is_packaged(model) else ""
            alternative = "" if baseline is None else ", or --baseline to use the target alone"
            raise CLIError(f"no DFlash draft for {model!r}{shipped}: pass --draft (a folder or hub id){alternative}")
        draft = model
    check_sources(model, draft)
    return draft


def remembers(args) -> bool:
    """Whether a front end starts from what `auto` learned in earlier runs on this machine and keeps what it
    learns for the next (`policy.memory`): not for plain decoding, nor split (every rank must choose alike)."""
    return not args.baseline and getattr(args, "distributed", None) is None


def add_distributed_arg(parser) -> None:
    """`--distributed`: the target split over the processes `mlx.launch` started."""
    parser.add_argument("--distributed", choices=("tensor", "pipeline", "auto"), default=None,
                        help="under mlx.launch: split the target over the launched processes, tensor parallel "
                        "(Model.shard), pipeline parallel (its layers), or auto (tensor where mlx-lm has it); "
                        "rank 0 reads the prompt and prints; the draft is loaded whole on every rank "
                        "(default: one process; see docs/distributed.md)")


def launched(distributed) -> bool:
    """Whether this process speaks for the run: always, except a rank other than 0 under
    --distributed (its standard output then goes nowhere)."""
    if distributed is None:
        return True
    import os
    import sys

    from dflash_mlx.models import peers
    from dflash_mlx.models.sharded import world

    if world().size() < 2:
        raise CLIError("--distributed needs two or more processes: start it with mlx.launch "
                       "(e.g. mlx.launch -n 2 --backend ring --hostfile hosts.json ...)", EXIT_USAGE)
    # a rank that ends ends the others, however the ranks were started (`models.peers`)
    peers.watch(world())
    if world().rank() == 0:
        return True
    sys.stdout = open(os.devnull, "w")
    return False


def add_draft_bits_arg(parser) -> None:
    """`--draft-bits`, beside every front end's --draft."""
    parser.add_argument("--draft-bits", type=int, choices=(4, 8), default=None,
                        help="quantize a float draft's projections to 4 or 8 bits on load (MLX affine, "
                        "group size 64; default: as stored; a draft stored quantized loads quantized)")


def positive_int(text: str) -> int:
    """A whole number >= 1, as an argparse `type=`."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def add_prefill_step_arg(parser) -> None:
    """mlx-lm's `--prefill-step-size`, in every front end that runs prompts."""
    parser.add_argument("--prefill-step-size", type=positive_int, default=2048,
                        help="prompt tokens a prefill forward runs at most, as mlx-lm's (default: 2048)")


def add_model_load_args(parser) -> None:
    """mlx-lm's flags for what is loaded beside the model (`--adapter-path`, `--extra-eos-token`,
    `--trust-remote-code`, `--draft-model`, `--num-draft-tokens`), in every front end that loads one."""
    from dflash_mlx.models.draft.autoregressive import DEFAULT_DRAFT_TOKENS

    parser.add_argument("--adapter-path", default=None, metavar="FOLDER",
                        help="fine-tuned adapters for --model, as mlx_lm.lora writes them (adapter_config.json, "
                             "adapters.safetensors); the draft made for the base model still fits")
    parser.add_argument("--extra-eos-token", action="append", default=[], metavar="TOKEN",
                        help="one more token that ends an answer, as mlx-lm's flag: a token's text (e.g. "
                             "'<|im_end|>') or its id; repeat it for more (one a flag, so a prompt can follow)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let a hub model's or folder's tokenizer run its own code, as mlx-lm's flag")
    parser.add_argument("--draft-model", default=None, metavar="MODEL",
                        help="mlx-lm's small-model draft instead of a DFlash draft: a model of the target's "
                             "tokenizer (name, .gguf, folder or hub id) drafting one token a forward, exact")
    parser.add_argument("--num-draft-tokens", type=positive_int, default=None, metavar="N",
                        help=f"with --draft-model: the most tokens it drafts a cycle (mlx-lm's flag; default "
                             f"{DEFAULT_DRAFT_TOKENS}); --block-size auto sizes each cycle up to N + 1 rows")


def require_prompt_cache_file(path) -> None:
    """A `--prompt-cache-file` that is no file, refused before the model loads."""
    from pathlib import Path

    if path is not None and not Path(path).is_file():
        raise CLIError(f"--prompt-cache-file: no file {path}: make one with dflash-mlx cache-prompt", EXIT_USAGE)


def model_load_kwargs(args) -> dict:
    """`load_model_and_draft`'s arguments from `add_model_load_args`' flags."""
    return dict(adapter_path=args.adapter_path, extra_eos_tokens=args.extra_eos_token,
                trust_remote_code=args.trust_remote_code, draft_model=args.draft_model,
                num_draft_tokens=args.num_draft_tokens)


def add_eos_tokens(tokenizer, tokens) -> None:
    """mlx-lm's `add_eos_token` for each of `tokens` (a token's text or id); CLIError naming one that the
    tokenizer does not have (mlx-lm would take an unknown text as the unknown token's id)."""
    for token in tokens or ():
        text = str(token)
        token_id = int(text) if text.isdigit() else tokenizer.convert_tokens_to_ids(text)
        unknown = getattr(tokenizer, "unk_token_id", None)
        if token_id is None or (token_id == unknown and text != getattr(tokenizer, "unk_token", None)) \
                or not 0 <= token_id < len(tokenizer.get_vocab()):
            raise CLIError(f"--extra-eos-token: {text!r} is not a token of this model's tokenizer: give a token's "
                           "text as the tokenizer spells it, or its id", EXIT_USAGE)
        tokenizer.add_eos_token(str(token_id))


def add_kv_cache_args(parser) -> None:
    """mlx-lm's flags for a quantized KV cache (`models.target.kv_quantization`) and a bounded one
    (`models.target.kv_window`), in every front end that runs one sequence at a time (the one-shot CLI, the
    chat; the server then serves one request at a time)."""
    from dflash_mlx.models.target.kv_quantization import BITS, DEFAULT_START, GROUP_SIZES

    parser.add_argument("--kv-bits", type=int, default=None, choices=BITS,
                        help="quantize the KV cache to this many bits once it holds --quantized-kv-start tokens, "
                             "as mlx-lm's --kv-bits (greedy output stays mlx-lm's under it; default: off)")
    parser.add_argument("--kv-group-size", type=int, default=64, choices=GROUP_SIZES, help="default: 64")
    parser.add_argument("--quantized-kv-start", type=int, default=DEFAULT_START,
                        help=f"tokens in the cache before it is quantized (default: {DEFAULT_START})")
    parser.add_argument("--max-kv-size", type=int, default=None,
                        help="keep at most this many tokens in the KV cache, the first 4 and the latest, as "
                             "mlx-lm's --max-kv-size (greedy output stays mlx-lm's under it; a model that makes "
                             "its own caches ignores it, as under mlx-lm; default: unbounded)")


def kv_cache_kwargs(args) -> dict:
    """`stream_generate`'s KV cache arguments (quantized, bounded) from `add_kv_cache_args`' flags (empty when off)."""
    from dflash_mlx.models.target.kv_quantization import KVQuantization

    from dflash_mlx.models.target.kv_window import checked_max_kv_size

    kwargs = {}
    try:
        if args.kv_bits is not None:
            KVQuantization(args.kv_bits, args.kv_group_size, args.quantized_kv_start)
            kwargs.update(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                          quantized_kv_start=args.quantized_kv_start)
        if args.max_kv_size is not None:
            kwargs.update(max_kv_size=checked_max_kv_size(args.max_kv_size))
    except ValueError as e:
        raise CLIError(str(e), EXIT_USAGE) from None
    return kwargs


# mlx-lm generate's flags that dflash-mlx does not take, and what to use instead: declared so that an
# mlx_lm.generate command line gets one line saying so rather than "unrecognized arguments"
MLX_LM_ONLY = {
    "--image": "images are not taken: dflash-mlx runs the language model of a multimodal model, on text",
    "--quantize-activations": "not supported: quantize the model's weights (mlx_lm.convert) instead",
    "--pipeline": "a model split over processes runs under mlx.launch with --distributed pipeline (or tensor, or "
                  "auto: tensor where the model has it)",
}


def _mlx_lm_only_dest(flag: str) -> str:
    return "mlx_lm_only_" + flag[2:].replace("-", "_")


def add_mlx_lm_only_args(parser) -> None:
    """`MLX_LM_ONLY`'s flags, hidden from --help; `refuse_mlx_lm_only_args` refuses them in one line."""
    for flag in MLX_LM_ONLY:
        names = [flag] + (["-qa"] if flag == "--quantize-activations" else [])
        parser.add_argument(*names, dest=_mlx_lm_only_dest(flag), nargs="*", default=None, help=argparse.SUPPRESS)


def refuse_mlx_lm_only_args(args) -> None:
    for flag, instead in MLX_LM_ONLY.items():
        if getattr(args, _mlx_lm_only_dest(flag), None) is not None:
            raise CLIError(f"{flag} (mlx-lm's): {instead}", EXIT_USAGE)


def true_or_false(text: str) -> bool:
    """mlx-lm's boolean flag values (True/False, T/F, any case)."""
    value = text.strip().lower()
    if value in ("true", "t"):
        return True
    if value in ("false", "f"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def use_default_chat_template(tokenizer) -> None:
    """mlx-lm's --use-default-chat-template: a tokenizer without a chat template takes its default one."""
    if getattr(tokenizer, "chat_template", None):
        return
    default = getattr(tokenizer, "default_chat_template", None)
    if not default:
        raise CLIError("--use-default-chat-template: this tokenizer has no chat template and no default one: use "
                       "--no-chat-template, or --chat-template-config with a model that has one", EXIT_USAGE)
    tokenizer.chat_template = default


def prompt_progress(stream=None, at_least: int = 4096):
    """A `prompt_progress_callback` that shows a long prompt's prefill (at least `at_least` tokens to run) on a
    terminal's `stream` (stderr), with rate and ETA, and clears its line when done; None off a terminal."""
    from dflash_mlx.progress import Progress

    stream = stream or sys.stderr
    if not stream.isatty():
        return None
    shown = []

    def update(done: int, total: int):
        if total < at_least:
            return
        if not shown:
            shown.append(Progress(total, "prompt", "tokens", every=0.5, stream=stream))
        shown[0].update(done, force=done == total)
        if done == total:
            stream.write("\r\033[K")  # (the stats line follows the answer, not this one)
            stream.flush()
            shown.clear()

    return update


def template_kwargs_arg(text: str) -> dict:
    """A JSON object of keyword arguments for the chat template (mlx-lm's `--chat-template-config` /
    `--chat-template-args`), as an argparse `type=`."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg} at character {e.pos}): give an object such as "
                                         "'{\"enable_thinking\": false}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of the template's arguments, got {text!r}")
    return value


def add_template_config_arg(parser) -> None:
    """mlx-lm's `--chat-template-config`, in the front ends that apply the chat template themselves (the
    one-shot CLI, the chat; the server's `--chat-template-args` is its server's flag)."""
    parser.add_argument("--chat-template-config", type=template_kwargs_arg, default=None, metavar="JSON",
                        help="more arguments for the chat template, as mlx-lm's: a JSON object such as "
                             "'{\"enable_thinking\": false}'")


def max_kv_size_note(args, model) -> Optional[str]:
    """A line for a `--max-kv-size` the model ignores (it makes its own caches, as mlx-lm's Llama, Gemma 3
    and Qwen3.5 do: mlx-lm ignores the bound there too), else None."""
    from dflash_mlx.models.target.kv_window import bounds

    if getattr(args, "max_kv_size", None) is None or bounds(model):
        return None
    return (f"--max-kv-size: {type(model).__module__.split('.')[-1]} models make their own caches; mlx-lm ignores "
            "the bound for them, and so does dflash-mlx (the cache is unbounded)")


def load_model_and_draft(model: str, draft=None, baseline=None, dtype=None, quiet=False, draft_bits=None,
                         without_draft: bool = False, distributed=None, adapter_path=None, extra_eos_tokens=(),
                         trust_remote_code: bool = False, draft_model=None, num_draft_tokens=None):
    """`(model, tokenizer, draft or None, draft label or None)` for a front end's flags
    (`distributed`: the target split over the processes of mlx.launch; the draft whole on each;
    `adapter_path`: mlx-lm's fine-tuned adapters on the target; `extra_eos_tokens`: more tokens that end
    an answer; `trust_remote_code`: mlx-lm's, for the tokenizer of a folder or hub model; `draft_model`,
    `num_draft_tokens`: mlx-lm's small-model draft, `models.draft.autoregressive`)."""
    from dflash_mlx import load, load_draft
    from dflash_mlx.models.draft.autoregressive import DEFAULT_DRAFT_TOKENS, load_draft_model
    from dflash_mlx.models.draft.config import DraftMismatchError
    from dflash_mlx.models.draft.quantize import describe
    from dflash_mlx.models.packaged import draft_label

    if num_draft_tokens is not None and draft_model is None:
        raise CLIError("--num-draft-tokens sizes a --draft-model's drafts: give one (or --block-size)", EXIT_USAGE)
    if draft_model is not None and (draft is not None or draft_bits is not None):
        raise CLIError(f"--draft-model and {'--draft' if draft is not None else '--draft-bits'} both given: "
                       "--draft-model drafts with a small model, --draft with a DFlash draft; pick one", EXIT_USAGE)
    draft_name = None if draft_model is not None else draft_for(model, draft, baseline, without_draft)
    if draft_model is not None and not baseline:
        check_sources(model, draft_model)
    target, tokenizer = load(model, dtype=dtype, quiet=quiet, distributed=distributed, adapter_path=adapter_path,
                             trust_remote_code=trust_remote_code)
    add_eos_tokens(tokenizer, extra_eos_tokens)
    if draft_model is not None and not baseline:  # mlx-lm's small-model draft (`models.draft.autoregressive`)
        n = DEFAULT_DRAFT_TOKENS if num_draft_tokens is None else num_draft_tokens
        try:
            small = load_draft_model(draft_model, target, tokenizer, n, dtype=dtype, quiet=quiet,
                                     trust_remote_code=trust_remote_code)
        except DraftMismatchError as e:
            raise CLIError(f"--draft-model {draft_model!r} does not fit the model: {e}") from None
        return target, tokenizer, small, f"{draft_model} (a small-model draft, up to {n} tokens a cycle)"
    if draft_name is None:
        return target, tokenizer, None, None
    try:
        loaded = load_draft(draft_name, target, quiet=quiet, bits=draft_bits)
    except DraftMismatchError as e:
        raise CLIError(f"draft {draft_name!r} does not fit model {model!r}: {e}") from None
    except (FileNotFoundError, ValueError) as e:
        raise CLIError(f"could not load draft {draft_name!r}: {e}") from None
    quantized = describe(loaded) if loaded is not None else None
    return target, tokenizer, loaded, draft_label(draft_name) + (f" ({quantized})" if quantized else "")
