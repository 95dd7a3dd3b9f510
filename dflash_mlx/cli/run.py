"""`dflash-mlx "prompt"`: one prompt, streamed answer, one stats line.

Errors raise `CLIError` (or the loaders' own errors); `dflash_mlx.cli.main.main`
turns them into one line and an exit status.
"""

import json
import sys

from dflash_mlx.cli.cache_prompt import after_cache, model_for
from dflash_mlx.cli.common import (EXIT_USAGE, SUBCOMMAND_HELP, ArgumentParser, CLIError, add_distributed_arg,
                                   add_draft_bits_arg, add_kv_cache_args, add_mlx_lm_only_args, add_model_load_args,
                                   add_prefill_step_arg, add_template_config_arg, checked_options, kv_cache_kwargs,
                                   launched, load_model_and_draft, max_kv_size_note, model_load_kwargs, no_draft_note,
                                   prompt_progress, refuse_mlx_lm_only_args, remembers, true_or_false,
                                   use_default_chat_template)
from dflash_mlx.options import add_generation_args


def build_parser():
    from dflash_mlx.models.packaged import DEFAULT_MODEL, packaged_names

    p = ArgumentParser(
        prog="dflash-mlx",
        description=(
            "Answer one prompt with DFlash speculative decoding and print tokens/s and tau "
            "(mean tokens committed per target forward). Subcommands: "
            + "; ".join(f"{name}: {what}" for name, what in SUBCOMMAND_HELP.items())
            + " (dflash-mlx SUBCOMMAND --help)."
        ),
    )
    p.add_argument("prompt", nargs="?", help="the prompt; '-' or omitted reads standard input")
    p.add_argument("-p", "--prompt", dest="prompt_flag", default=None, metavar="PROMPT",
                   help="the prompt as mlx-lm's generate takes it (instead of the argument; '-' reads standard input)")
    p.add_argument(
        "-m", "--model", default=None,
        help=f"packaged name ({', '.join(packaged_names())}), .gguf file, mlx-lm folder or "
        f"hub id (default: the one --prompt-cache-file names, else {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--draft",
        help="DFlash draft: packaged name, folder or hub id (default: the packaged draft of a "
        "packaged --model; with none, copies of the context alone)",
    )
    add_draft_bits_arg(p)
    add_model_load_args(p)
    add_distributed_arg(p)
    add_generation_args(p)
    p.add_argument("--system", "--system-prompt", default=None, help="system prompt")
    p.add_argument("--no-chat-template", "--ignore-chat-template", action="store_true", help="use the prompt text as is")
    p.add_argument("--use-default-chat-template", action="store_true",
                   help="a tokenizer without a chat template uses its default one, as mlx-lm's flag")
    p.add_argument("--prefill-response", default=None, metavar="TEXT",
                   help="the start of the answer, which the model continues (as mlx-lm's; not printed)")
    add_prefill_step_arg(p)
    add_template_config_arg(p)
    p.add_argument("--baseline", action="store_true",
                   help="plain decoding with the target alone: no draft, no copies (for comparison)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="weight dtype (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--deterministic", action="store_true",
                   help="every target row in plain decoding's shapes: greedy output is mlx-lm's token for token "
                        "on GPU kernels too, in every dtype, at the cost of the wide verify's speed")
    add_kv_cache_args(p)
    p.add_argument("--prompt-cache-file", default=None, metavar="FILE",
                   help="answer after a prompt cached by dflash-mlx cache-prompt (or mlx-lm's cache_prompt): the "
                        "prompt is what follows it, as mlx-lm's generate --prompt-cache-file")
    p.add_argument("--verbose", type=true_or_false, default=True, metavar="{True,False}",
                   help="False: the answer alone, no stats line (mlx-lm's flag; default: True)")
    add_mlx_lm_only_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("--debug", action="store_true", help="show a traceback on errors (any subcommand)")
    return p


def _read_prompt(args) -> str:
    if args.prompt is not None and args.prompt_flag is not None:
        raise CLIError("the prompt is given twice (as the argument and as -p/--prompt): give it once", EXIT_USAGE)
    prompt = args.prompt if args.prompt_flag is None else args.prompt_flag
    if prompt is None or prompt == "-":
        if prompt is None and sys.stdin.isatty():
            raise CLIError('no prompt given: dflash-mlx "your prompt" (or pipe it on stdin)', EXIT_USAGE)
        try:
            prompt = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise CLIError(f"the prompt on standard input is not valid UTF-8 ({e.reason} at byte {e.start})",
                           EXIT_USAGE) from None
    else:
        # argv arrives decoded with surrogateescape: invalid bytes become lone surrogates.
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise CLIError("the prompt is not valid UTF-8", EXIT_USAGE) from None
    if not prompt.strip():
        raise CLIError("the prompt is empty", EXIT_USAGE)
    return prompt


def run(args) -> int:
    refuse_mlx_lm_only_args(args)
    options = checked_options(args)
    kv_cache = kv_cache_kwargs(args)  # (a bad setting is a usage error before anything loads)
    speaks = launched(args.distributed)
    args.model = model_for(args.model, args.prompt_cache_file)
    prompt = _read_prompt(args) if speaks else None
    if args.distributed is not None:
        from dflash_mlx.models.sharded import share

        prompt = share(prompt)  # rank 0's, read once
    model, tokenizer, draft, draft_label = load_model_and_draft(
        args.model, args.draft, args.baseline, dtype=args.dtype, quiet=args.json or not speaks,
        draft_bits=args.draft_bits, without_draft=True, distributed=args.distributed, **model_load_kwargs(args))
    if args.use_default_chat_template:
        use_default_chat_template(tokenizer)
    if draft is None and not args.baseline and speaks:
        print(f"dflash-mlx: {no_draft_note(args.model)}", file=sys.stderr)
    note = max_kv_size_note(args, model)
    if note and speaks:
        print(f"dflash-mlx: {note}", file=sys.stderr)

    from dflash_mlx import stream_generate
    from dflash_mlx.engine.responses import wrap_tokenizer
    from dflash_mlx.generate import encode_prompt, tokens_to_window
    from dflash_mlx.models.loading import apply_chat_template
    from dflash_mlx.models.target.adapter import target_for
    from dflash_mlx.policy import memory

    state = None
    if args.prompt_cache_file is not None:
        state, prompt_ids, notes = after_cache(args, model, tokenizer, draft, prompt)
        for line in notes if speaks else ():
            print(f"dflash-mlx: {line}", file=sys.stderr)
    elif args.no_chat_template:
        text = (f"{args.system}\n\n{prompt}" if args.system else prompt) + (args.prefill_response or "")
        prompt_ids = encode_prompt(wrap_tokenizer(tokenizer), text)
    else:
        text = apply_chat_template(tokenizer, prompt, system=args.system, template_kwargs=args.chat_template_config,
                                   prefill_response=args.prefill_response)
        prompt_ids = encode_prompt(wrap_tokenizer(tokenizer), text)

    # The library decodes past the model's context window as mlx-lm does; the CLI stops there.
    kwargs = options.generate_kwargs()
    kwargs["max_tokens"] = tokens_to_window(target_for(model, draft).max_context, len(prompt_ids),
                                            options.max_tokens)
    if remembers(args):  # what `auto` learned in earlier runs on this machine
        memory.restore(model, draft)
    pieces, tokens, last = [], [], None
    try:
        for r in stream_generate(model, draft, tokenizer, prompt_ids, baseline=args.baseline,
                                 deterministic=args.deterministic or None, **kv_cache, **kwargs, prompt_cache=state,
                                 prefill_step_size=args.prefill_step_size,
                                 prompt_progress_callback=prompt_progress() if speaks else None):
            pieces.append(r.text)
            tokens.extend(r.tokens)
            last = r
            if not args.json:
                sys.stdout.write(r.text)
                sys.stdout.flush()
    except ValueError as e:  # the engine's checks: prompt past the context window, ...
        raise CLIError(str(e), EXIT_USAGE) from None
    if remembers(args):
        memory.save(model, draft)

    if last is None:
        raise CLIError("the engine produced no output")
    if last.finish_reason == "length" and last.generation_tokens < options.max_tokens:
        print(f"dflash-mlx: stopped after {last.generation_tokens} tokens: the context window is full",
              file=sys.stderr)
    stats = {
        "prompt_tokens": last.prompt_tokens,
        "prefill_tokens": last.prefill_tokens,  # (the rest came from --prompt-cache-file)
        "generation_tokens": len(tokens),
        "generation_tps": last.generation_tps,
        "prompt_tps": last.prompt_tps,
        "peak_memory_gb": last.peak_memory,
        "finish_reason": last.finish_reason,
    }
    tau = last.tau if last.accept_lengths else None
    if args.json:
        out = {"text": "".join(pieces), "tokens": tokens, **stats,
               "accept_lengths": list(last.accept_lengths), "tau": tau, "model": args.model,
               "draft": draft_label, "proposals": dict(last.proposal_counts)}
        print(json.dumps(out, ensure_ascii=False))
        return 0
    tau_s = f", tau {tau:.2f}" if tau is not None else " (baseline)"
    for kind, label in (("tree", "trees"), ("copy", "copies"), ("copy_tree", "copy trees"),
                        ("global_copy", "earlier answers")):
        counts = last.proposal_counts.get(kind)
        if counts:
            tau_s += f", {counts[1]} from {label}"
    if not speaks:
        return 0
    print()
    if not args.verbose:  # (mlx-lm's --verbose False: the answer alone)
        return 0
    print(
        f"[{stats['generation_tokens']} tokens, {stats['generation_tps']:.1f} tok/s{tau_s}, "
        f"prompt {_prompt_part(stats)}, "
        f"peak {stats['peak_memory_gb']:.2f} GB]",
        file=sys.stderr,
    )
    return 0


def _prompt_part(stats) -> str:
    """The stats line's prompt part: its tokens, and at what rate those not cached ran."""
    total, ran = stats["prompt_tokens"], stats["prefill_tokens"]
    if ran >= total:
        return f"{total} tokens at {stats['prompt_tps']:.1f} tok/s"
    return f"{total} tokens ({total - ran} cached, {ran} run at {stats['prompt_tps']:.1f} tok/s)"


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))
