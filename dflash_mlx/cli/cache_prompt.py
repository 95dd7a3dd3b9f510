"""`dflash-mlx cache-prompt`: run a prompt once and save the caches it leaves, as mlx-lm's `cache_prompt`.

`dflash-mlx --prompt-cache-file FILE "question"` then answers after it without running it again (a long
document, a long system prompt): the file holds the target's caches and the draft's context, in mlx-lm's
format (`engine.prompt_cache_file`), so mlx-lm's generate --prompt-cache-file reads it too, and files
mlx-lm's cache_prompt wrote are read here. As mlx-lm's: with a chat template, the cached text is the
user's message left open, and the question is what the template puts after it.
"""

import json
import sys
import time
from pathlib import Path
from typing import Optional

from dflash_mlx.cli.common import (EXIT_USAGE, ArgumentParser, CLIError, add_draft_bits_arg, add_eos_tokens,
                                   add_kv_cache_args, add_model_load_args, add_prefill_step_arg, add_template_config_arg,
                                   kv_cache_kwargs, load_model_and_draft, max_kv_size_note, model_load_kwargs,
                                   prompt_progress, require_prompt_cache_file)

QUERY = "<query>"  # (where the question goes, to find what the template puts after the cached text)


def cached_text(tokenizer, prompt: str, system: Optional[str] = None, template_kwargs=None) -> str:
    """The text a prompt cache holds: with a chat template, the user's message left open (mlx-lm's
    `cache_prompt`); without one, the system text and the prompt, as `apply_chat_template` joins them."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                             continue_final_message=True, **(template_kwargs or {}))
    return "\n\n".join(m["content"] for m in messages)


def text_after_cache(tokenizer, question: str, system: Optional[str] = None, template_kwargs=None,
                     prefill_response: Optional[str] = None) -> str:
    """What follows a cached prompt's text for `question`: mlx-lm's generate --prompt-cache-file takes the
    whole template's text from where the last message's content starts."""
    from dflash_mlx.models.loading import apply_chat_template

    if not getattr(tokenizer, "chat_template", None):
        return question + (prefill_response or "")
    full = apply_chat_template(tokenizer, question, system=system, template_kwargs=template_kwargs,
                               prefill_response=prefill_response)
    if prefill_response is not None:
        marked = apply_chat_template(tokenizer, question, system=system, template_kwargs=template_kwargs,
                                     prefill_response=QUERY)
    else:
        marked = apply_chat_template(tokenizer, QUERY, system=system, template_kwargs=template_kwargs)
    return full[marked.index(QUERY):]


def file_metadata(path) -> dict:
    """The metadata a prompt cache file holds (mlx-lm's keys and ours), read from its header alone; {} when
    there is none to read (`load_prompt_cache` then says what is wrong with the file)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size)) if 0 < size < 1 << 28 else {}
    except (OSError, ValueError):
        return {}
    # (mlx-lm's `save_prompt_cache` flattens [metadata, classes, scalars]: its metadata is under "0.")
    flat = header.get("__metadata__") or {}
    return {k[2:]: v for k, v in flat.items() if k.startswith("0.")}


def build_parser():
    from dflash_mlx.models.packaged import DEFAULT_MODEL

    p = ArgumentParser(prog="dflash-mlx cache-prompt",
                       description="Run a prompt once and save the caches it leaves (the target's and the draft's) "
                                   "for dflash-mlx --prompt-cache-file, as mlx-lm's cache_prompt (mlx-lm's "
                                   "generate --prompt-cache-file reads the file too).")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"as dflash-mlx --model (default: {DEFAULT_MODEL})")
    p.add_argument("--draft", help="DFlash draft whose context is saved too (default: the packaged model's draft)")
    p.add_argument("--no-draft", action="store_true", help="save the target's caches only")
    add_draft_bits_arg(p)
    add_model_load_args(p)
    p.add_argument("--prompt", required=True, help="the text to cache ('-' reads standard input)")
    p.add_argument("--prompt-cache-file", required=True, help="the .safetensors file to write")
    p.add_argument("--system", "--system-prompt", default=None, help="system prompt (cached with the prompt)")
    p.add_argument("--eos-token", default=None, metavar="TOKEN",
                   help="a token that ends the answers after this file, kept in its tokenizer config as mlx-lm's "
                        "cache_prompt keeps it")
    p.add_argument("--no-chat-template", "--ignore-chat-template", action="store_true",
                   help="cache the prompt text as is")
    add_template_config_arg(p)
    add_prefill_step_arg(p)
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="weight dtype (default: float32 on CPU, bfloat16 on GPU); use the same when answering")
    add_kv_cache_args(p)
    return p


def _read(prompt: str) -> str:
    if prompt == "-":
        try:
            prompt = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise CLIError(f"the prompt on standard input is not valid UTF-8 ({e.reason} at byte {e.start})",
                           EXIT_USAGE) from None
    if not prompt.strip():
        raise CLIError("the prompt is empty", EXIT_USAGE)
    return prompt


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    kv_cache = kv_cache_kwargs(args)
    prompt = _read(args.prompt)
    out = Path(args.prompt_cache_file)
    if not out.parent.is_dir():
        raise CLIError(f"--prompt-cache-file: no folder {out.parent} to write {out.name} in", EXIT_USAGE)
    model, tokenizer, draft, _ = load_model_and_draft(
        args.model, args.draft, args.no_draft, dtype=args.dtype, draft_bits=args.draft_bits, without_draft=True,
        **model_load_kwargs(args))
    note = max_kv_size_note(args, model)
    if note:
        print(f"dflash-mlx: {note}", file=sys.stderr)

    from dflash_mlx import make_prompt_cache, stream_generate
    from dflash_mlx.engine.prompt_cache_file import save_prompt_cache
    from dflash_mlx.engine.responses import wrap_tokenizer
    from dflash_mlx.generate import encode_prompt

    if args.no_chat_template:  # (as `dflash-mlx --no-chat-template` joins them)
        text = f"{args.system}\n\n{prompt}" if args.system else prompt
    else:
        text = cached_text(tokenizer, prompt, args.system, args.chat_template_config)
    ids = encode_prompt(wrap_tokenizer(tokenizer), text)
    state = make_prompt_cache(model, draft, max_kv_size=kv_cache.pop("max_kv_size", None))
    started = time.perf_counter()
    try:  # (one token: the prompt's forwards are what fills the caches; the token is not kept)
        for _ in stream_generate(model, draft, tokenizer, ids, max_tokens=1, prompt_cache=state,
                                 prefill_step_size=args.prefill_step_size, prompt_progress_callback=prompt_progress(),
                                 **kv_cache):
            pass
    except ValueError as e:  # prompt past the context window, a cache setting the model cannot take
        raise CLIError(str(e), EXIT_USAGE) from None
    seconds = time.perf_counter() - started
    save_prompt_cache(out, state, model_name=args.model,
                      tokenizer_config={"eos_token": args.eos_token} if args.eos_token else None,
                      text={"prompt": prompt, "system": args.system, "chat_template": not args.no_chat_template})
    import mlx.core as mx

    print(f"dflash-mlx: cached {len(ids)} prompt tokens in {seconds:.1f} s ({len(ids) / seconds:.1f} tok/s)"
          f"{' with the draft context' if draft is not None else ''}, peak {mx.get_peak_memory() / 1e9:.2f} GB, "
          f"to {out} ({out.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    return 0


# -- answering after a cached prompt (`dflash-mlx --prompt-cache-file`) ------------------------------------


def model_for(model: Optional[str], cache_file: Optional[str]) -> str:
    """The model a run loads: --model, else the one --prompt-cache-file names (as mlx-lm's generate), else the
    default. A file of mlx-lm's (no fingerprint to check) naming another model is refused, as mlx-lm does."""
    from dflash_mlx.models.packaged import DEFAULT_MODEL

    require_prompt_cache_file(cache_file)
    metadata = file_metadata(cache_file) if cache_file else {}
    named = metadata.get("model") or None
    if model is None:
        return named or DEFAULT_MODEL
    if named and named != model and "dflash_mlx" not in metadata:
        raise CLIError(f"--prompt-cache-file {cache_file} was made with model {named!r}, not {model!r}: pass "
                       f"--model {named} (or leave --model out)", EXIT_USAGE)
    return model


def after_cache(args, model, tokenizer, draft, question: str):
    """(the loaded `PromptCache`, the prompt ids to pass with it, notes to print) for --prompt-cache-file."""
    from dflash_mlx.engine.prompt_cache_file import PromptCacheFileError, continued, load_prompt_cache

    if args.distributed is not None:
        raise CLIError("--prompt-cache-file: a prompt cache file is for a target in one process, not --distributed",
                       EXIT_USAGE)
    try:
        state, info = load_prompt_cache(args.prompt_cache_file, model, None if args.baseline else draft)
    except PromptCacheFileError as e:
        raise CLIError(f"--prompt-cache-file: {e}", EXIT_USAGE) from None
    if info.kv_bits is not None and args.kv_bits is not None and args.kv_bits != info.kv_bits:
        raise CLIError(f"--kv-bits {args.kv_bits} does not match the {info.kv_bits}-bit KV cache of "
                       f"{args.prompt_cache_file}", EXIT_USAGE)
    if args.no_chat_template:
        text = question + (args.prefill_response or "")
    else:
        text = text_after_cache(tokenizer, question, args.system, args.chat_template_config, args.prefill_response)
    suffix = list(tokenizer.encode(text, add_special_tokens=False))
    if info.tokenizer_config.get("eos_token"):  # (mlx-lm's generate loads its tokenizer with the file's config)
        add_eos_tokens(tokenizer, [info.tokenizer_config["eos_token"]])
    notes = []
    if info.draft_context == "cold":
        notes.append(f"{args.prompt_cache_file} holds no context for this draft: it drafts from what follows "
                     "(the same tokens, fewer accepted; cache the prompt with this draft)")
    return state, continued(state, suffix), notes
