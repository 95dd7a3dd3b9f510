"""`dflash-mlx "prompt"`: one prompt, streamed answer, one stats line.

Errors print one line to stderr and exit non-zero (2: bad input, 1: the model
or draft could not be used, 130: interrupted); no tracebacks.
"""

import argparse
import json
import sys

EXIT_USAGE, EXIT_FAIL, EXIT_INTERRUPTED = 2, 1, 130


class CLIError(Exception):
    def __init__(self, message, code=EXIT_FAIL):
        super().__init__(message)
        self.code = code


def _block_size(text: str):
    return "auto" if text == "auto" else int(text)


def _draft_note():
    from dflash_mlx.packaged import DEFAULT_MODEL, packaged_draft_dir

    if packaged_draft_dir(DEFAULT_MODEL) is not None:
        return f"The default draft for {DEFAULT_MODEL} is a trained DFlash draft shipped with the package."
    return (
        f"Note: no trained draft ships for {DEFAULT_MODEL} yet, so the default draft is "
        "untrained: output is still exactly the target's own (DFlash is lossless), only "
        "slower than plain decoding until the trained draft ships."
    )


def build_parser():
    from dflash_mlx.packaged import DEFAULT_MODEL, packaged_names

    p = argparse.ArgumentParser(
        prog="dflash-mlx",
        description=(
            "Answer one prompt with DFlash speculative decoding and print tokens/s and tau "
            "(mean tokens committed per target forward). Subcommands: chat, bench, train, "
            "doctor, export (dflash-mlx SUBCOMMAND --help). " + _draft_note()
        ),
    )
    p.add_argument("prompt", nargs="?", help="the prompt; '-' or omitted reads standard input")
    p.add_argument(
        "--model", default=DEFAULT_MODEL,
        help=f"packaged name ({', '.join(packaged_names())}), .gguf file, mlx-lm folder or "
        f"hub id (default: {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--draft",
        help="DFlash draft: packaged name, folder or hub id (default: the packaged draft of a "
        "packaged --model)",
    )
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--block-size", type=_block_size, default="auto",
                   help="draft block size, or 'auto' (default): pick each cycle's verify width "
                   "from measured acceptance and cost, up to the draft's block size")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--no-chat-template", action="store_true", help="use the prompt text as is")
    p.add_argument("--baseline", action="store_true", help="decode with the target alone (for comparison)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="weight dtype (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    return p


def _check_args(args):
    if args.max_tokens < 1:
        raise CLIError(f"--max-tokens must be at least 1, got {args.max_tokens}", EXIT_USAGE)
    if isinstance(args.block_size, int) and args.block_size < 1:
        raise CLIError(f"--block-size must be at least 1, got {args.block_size}", EXIT_USAGE)
    if args.temperature < 0:
        raise CLIError(f"--temperature must be >= 0, got {args.temperature}", EXIT_USAGE)
    if not 0 < args.top_p <= 1:
        raise CLIError(f"--top-p must be in (0, 1], got {args.top_p}", EXIT_USAGE)
    if args.top_k < 0 or not 0 <= args.min_p <= 1:
        raise CLIError("--top-k must be >= 0 and --min-p in [0, 1]", EXIT_USAGE)


def _read_prompt(args) -> str:
    prompt = args.prompt
    if prompt is None or prompt == "-":
        if prompt is None and sys.stdin.isatty():
            raise CLIError('no prompt given: dflash-mlx "your prompt" (or pipe it on stdin)', EXIT_USAGE)
        try:
            prompt = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise CLIError(f"the prompt on standard input is not valid UTF-8 ({e.reason} at byte {e.start})", EXIT_USAGE) from None
    else:
        # argv arrives decoded with surrogateescape: invalid bytes become lone surrogates.
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise CLIError("the prompt is not valid UTF-8", EXIT_USAGE) from None
    if not prompt.strip():
        raise CLIError("the prompt is empty", EXIT_USAGE)
    return prompt


def _context_window(model):
    args = getattr(model, "args", None)
    return getattr(args, "max_position_embeddings", None)


def _load(args):
    from dflash_mlx.loading import ModelLoadError, load
    from dflash_mlx.packaged import is_packaged, packaged_draft_dir

    try:
        model, tokenizer = load(args.model, dtype=args.dtype, quiet=args.json)
    except ModelLoadError as e:
        raise CLIError(str(e)) from None
    if args.baseline:
        return model, tokenizer, None, None
    draft_name = args.draft
    if draft_name is None:
        if not is_packaged(args.model):
            raise CLIError(
                f"no DFlash draft for {args.model!r}: pass --draft (folder or hub id), "
                "or --baseline to decode with the target alone"
            )
        draft_name = args.model
    from dflash_mlx import load_draft
    from dflash_mlx.draft import DraftMismatchError

    try:
        draft = load_draft(draft_name, model, quiet=args.json)
    except DraftMismatchError as e:
        raise CLIError(f"draft {draft_name!r} does not fit model {args.model!r}: {e}") from None
    except (FileNotFoundError, ValueError) as e:
        raise CLIError(f"could not load draft {draft_name!r}: {e}") from None
    label = draft_name
    if is_packaged(draft_name) and packaged_draft_dir(draft_name) is None:
        label = f"{draft_name} (untrained)"
    return model, tokenizer, draft, label


def run(args) -> int:
    _check_args(args)
    prompt = _read_prompt(args)
    model, tokenizer, draft, draft_label = _load(args)

    from dflash_mlx import stream_generate
    from dflash_mlx.generate import encode_prompt
    from dflash_mlx.loading import apply_chat_template

    if args.no_chat_template:
        text = f"{args.system}\n\n{prompt}" if args.system else prompt
    else:
        text = apply_chat_template(tokenizer, prompt, system=args.system)
    prompt_ids = encode_prompt(tokenizer, text)
    window = _context_window(model)
    max_tokens = args.max_tokens
    if window:
        if len(prompt_ids) >= window:
            raise CLIError(
                f"the prompt is {len(prompt_ids)} tokens, past the model's context window of "
                f"{window} tokens", EXIT_USAGE,
            )
        if len(prompt_ids) + max_tokens > window:
            max_tokens = window - len(prompt_ids)
            print(f"dflash-mlx: --max-tokens lowered to {max_tokens} to fit the context window", file=sys.stderr)

    pieces, tokens, last = [], [], None
    try:
        for r in stream_generate(
            model, draft, tokenizer, prompt_ids, max_tokens=max_tokens,
            block_size=args.block_size, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, seed=args.seed, baseline=draft is None,
        ):
            pieces.append(r.text)
            tokens.extend(r.tokens)
            last = r
            if not args.json:
                sys.stdout.write(r.text)
                sys.stdout.flush()
    except ValueError as e:
        raise CLIError(str(e)) from None

    accept = list(last.accept_lengths) if last is not None else []
    tau = sum(a + 1 for a in accept) / len(accept) if accept else None
    stats = {
        "prompt_tokens": len(prompt_ids),
        "generation_tokens": len(tokens),
        "generation_tps": last.generation_tps if last else 0.0,
        "prompt_tps": last.prompt_tps if last else 0.0,
        "peak_memory_gb": last.peak_memory if last else 0.0,
        "finish_reason": last.finish_reason if last else None,
    }
    if args.json:
        out = {"text": "".join(pieces), "tokens": tokens, **stats,
               "accept_lengths": accept, "tau": tau, "model": args.model, "draft": draft_label}
        print(json.dumps(out, ensure_ascii=False))
        return 0
    tau_s = f", tau {tau:.2f}" if tau is not None else " (baseline)"
    print()
    print(
        f"[{stats['generation_tokens']} tokens, {stats['generation_tps']:.1f} tok/s{tau_s}, "
        f"prompt {stats['prompt_tokens']} tokens at {stats['prompt_tps']:.1f} tok/s, "
        f"peak {stats['peak_memory_gb']:.2f} GB]",
        file=sys.stderr,
    )
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except CLIError as e:
        print(f"dflash-mlx: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\ndflash-mlx: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader went away (`dflash-mlx ... | head`): stop quietly, and keep
        # Python from complaining again when it flushes stdout at exit
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except MemoryError:
        print("dflash-mlx: error: out of memory", file=sys.stderr)
        return EXIT_FAIL
