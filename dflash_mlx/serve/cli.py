"""`dflash-mlx serve`'s command line: its flags, loading the target and draft into a
`Worker`, and running the app (`dflash_mlx.serve.app`) on uvicorn until Ctrl-C or SIGTERM.

The flags' defaults are the server's: `--max-tokens` and the sampling flags are the
defaults of a request's own fields, `--max-batch` follows the machine's memory.
Under `mlx.launch` with `--distributed`, rank 0 serves HTTP and every other rank runs the
same engine steps without serving (`ranks.follow`); a rank that fails ends with one line.
"""

import argparse
import logging
import signal
import sys
import threading

import uvicorn

from dflash_mlx.cli.common import (ArgumentParser, CLIError, add_distributed_arg, add_draft_bits_arg, add_kv_cache_args,
                                   add_mlx_lm_only_args, add_model_load_args, add_prefill_step_arg, checked_options,
                                   kv_cache_kwargs, launched, load_model_and_draft, max_kv_size_note,
                                   model_load_kwargs, no_draft_note, positive_int, refuse_mlx_lm_only_args,
                                   remembers, template_kwargs_arg, use_default_chat_template)
from dflash_mlx.models.packaged import DEFAULT_MODEL
from dflash_mlx.options import GenerationOptions, add_generation_args
from dflash_mlx.policy import memory
from dflash_mlx.serve.app import create_app
from dflash_mlx.serve.cache_pool import DEFAULT_PROMPT_CACHE_BYTES
from dflash_mlx.serve.ranks import STOP_S, end_within, exit_now, follow
from dflash_mlx.serve.worker import Worker, default_max_batch
from dflash_mlx.speculation.suffix_index import DEFAULT_SUFFIX_INDEX_BYTES


DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _bytes(text: str) -> int:
    """A size in bytes: a whole number, optionally with K, M, G or T (powers of 1024)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    if t and t[-1] in "KMGT":
        scale, t = 1024 ** ("KMGT".index(t[-1]) + 1), t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        value = -1
    if value < 0 or value != value:
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 512M, 2G or 1000000, got {text!r}")
    return int(value)


def build_parser():
    p = ArgumentParser(
        prog="dflash-mlx serve",
        description="OpenAI-compatible server (POST /v1/chat/completions, /v1/completions; "
        "GET /v1/models, /health) on DFlash speculative decoding.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"packaged name, .gguf file, mlx-lm folder or hub id (default: {DEFAULT_MODEL})")
    p.add_argument("--draft", help="DFlash draft: packaged name, folder or hub id "
                   "(default: the packaged draft of a packaged --model; with none, copies of the context alone)")
    add_draft_bits_arg(p)
    add_model_load_args(p)
    add_distributed_arg(p)
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default: {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})")
    # --max-tokens and the sampling flags are the defaults of a request's own fields
    add_generation_args(p, GenerationOptions(max_tokens=512))
    p.add_argument("--max-batch", "--decode-concurrency", type=positive_int, default=None,
                   help="requests decoding at once (continuous batching; 1: one at a time; default: "
                   f"{default_max_batch()} on this machine, one per 3 GiB of memory); targets the batch "
                   "engine does not take are served one at a time")
    p.add_argument("--queue-size", type=positive_int, default=16,
                   help="requests that may wait for a free row; more get 429 with Retry-After (default: 16)")
    p.add_argument("--snapshots", "--prompt-cache-size", type=_count, default=4,
                   help="cached conversations kept for prefix reuse across requests (default: 4)")
    p.add_argument("--prompt-cache-bytes", type=_bytes, default=DEFAULT_PROMPT_CACHE_BYTES,
                   help="most bytes the cached conversations hold, e.g. 512M, 2G or a number (default: 1G); "
                   "batched, the running requests' caches count too (no new request joins past it); "
                   "one at a time, the current conversation comes on top")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="weight dtype (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--baseline", action="store_true",
                   help="serve the target alone: plain decoding, no draft, no copies")
    p.add_argument("--global-copies-bytes", type=_bytes, default=DEFAULT_SUFFIX_INDEX_BYTES,
                   help="most bytes the index of earlier requests' prompts and answers holds, which every "
                   "request copies from beside its own conversation, oldest dropped first (default: 256M)")
    p.add_argument("--deterministic", action="store_true",
                   help="every target row in plain decoding's shapes: greedy answers are mlx-lm's token for token "
                        "on GPU kernels too; one request at a time")
    p.add_argument("--chat-template-args", type=template_kwargs_arg, default=None, metavar="JSON",
                   help="arguments for the chat template of every chat request, as mlx-lm's server's: a JSON "
                        "object such as '{\"enable_thinking\": false}' (a request's chat_template_kwargs win)")
    add_kv_cache_args(p)
    add_prefill_step_arg(p)
    p.add_argument("--allowed-origins", type=lambda text: [o.strip() for o in text.split(",") if o.strip()],
                   default=["*"], metavar="ORIGINS",
                   help="comma-separated origins of the web pages whose scripts may call the server (CORS), as "
                        "mlx-lm's server's flag (default: *, any)")
    p.add_argument("--chat-template", default=None, metavar="JINJA",
                   help="the chat template to use instead of the tokenizer's, as mlx-lm's server's flag")
    p.add_argument("--use-default-chat-template", action="store_true",
                   help="a tokenizer without a chat template uses its default one, as mlx-lm's flag")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   type=str.upper, help="the server's log level, as mlx-lm's (default: INFO)")
    p.add_argument("--prompt-concurrency", type=positive_int, default=None,
                   help="accepted for mlx-lm's command lines; not used: a prompt joins the batch in chunks "
                        "between its cycles (--prefill-step-size)")
    add_mlx_lm_only_args(p)
    p.add_argument("--no-global-copies", action="store_true",
                   help="no index of earlier requests: each request copies from its own conversation only "
                   "(privacy between users; one request opts out with \"dflash\": {\"global_copies\": false})")
    return p


def load_worker(args, speaks: bool = True) -> Worker:
    refuse_mlx_lm_only_args(args)
    options = checked_options(args)
    model, tokenizer, draft, draft_name = load_model_and_draft(args.model, args.draft, args.baseline,
                                                               dtype=args.dtype, draft_bits=args.draft_bits,
                                                               without_draft=True,
                                                               distributed=getattr(args, "distributed", None),
                                                               **model_load_kwargs(args))
    if args.chat_template:
        tokenizer.chat_template = args.chat_template
    elif args.use_default_chat_template:
        use_default_chat_template(tokenizer)
    if draft is None and not args.baseline and speaks:
        print(f"dflash-mlx serve: {no_draft_note(args.model)}", file=sys.stderr)
    note = max_kv_size_note(args, model)
    if note and speaks:
        print(f"dflash-mlx serve: {note}", file=sys.stderr)
    if remembers(args):  # before the engine makes the pair's policies
        memory.restore(model, draft)
    return Worker(model, draft, tokenizer, model_name=args.model, draft_name=draft_name,
                  options=options, queue_size=args.queue_size, max_snapshots=args.snapshots,
                  prompt_cache_bytes=args.prompt_cache_bytes, max_batch=args.max_batch, baseline=args.baseline,
                  deterministic=getattr(args, "deterministic", False), kv_cache=kv_cache_kwargs(args),
                  chat_template_args=getattr(args, "chat_template_args", None),
                  prefill_step_size=args.prefill_step_size,
                  global_copies_bytes=0 if args.no_global_copies else args.global_copies_bytes)


def keep_policies(worker: Worker) -> bool:
    """Once the server has stopped: what its policies learned, saved for its next start. True when saved."""
    worker.stop()  # (idempotent) its engine thread ended: the policies are read whole
    return worker.stopped() and memory.save(worker.model, worker.draft)


def main(argv=None) -> int:
    """`dflash-mlx serve`; `dflash_mlx.cli.main.main` turns errors into one line."""
    args = build_parser().parse_args(argv)
    speaks = launched(args.distributed)  # False on ranks other than 0: they follow rank 0's steps
    worker = load_worker(args, speaks)
    if not speaks:
        failed = follow(worker)
        if failed and not worker.ended.is_set():
            exit_now(f"dflash-mlx serve: {failed}")
        if failed:
            raise CLIError(failed)
        return 0
    drafted = (f"with draft {worker.draft_name}" if worker.draft is not None
               else "plain decoding" if worker.baseline else "without a draft (copies of the context)")
    print(f"dflash-mlx serve: {args.model} {drafted}, block size {worker.options.block_size}, "
          f"{worker.scheduling}, on http://{args.host}:{args.port}/v1", file=sys.stderr)
    if args.prompt_concurrency is not None:
        print("dflash-mlx serve: --prompt-concurrency is not used here: a prompt joins the batch in chunks between "
              "its cycles (--prefill-step-size)", file=sys.stderr)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s - %(levelname)s - %(message)s")
    config = uvicorn.Config(create_app(worker, args.allowed_origins), host=args.host, port=args.port,
                            log_level=args.log_level.lower(), timeout_graceful_shutdown=5)
    _serve(config, worker)
    if remembers(args):
        keep_policies(worker)
    failed = worker.failed or worker.ranks.gone()
    if worker.ranks.size > 1 and not worker.ended.is_set():  # stuck in a collective: a rank is gone
        exit_now(f"dflash-mlx serve: {failed or 'rank 0: the other ranks did not stop'}")
    if failed:
        raise CLIError(failed)
    return 0


def _serve(config, worker: Worker):
    class Server(uvicorn.Server):
        """On Ctrl-C / SIGTERM the worker stops first, so open streams end (with an
        error event) at their next cycle instead of waiting out the grace period."""

        def handle_exit(self, sig, frame):
            if worker.ranks.size > 1 and not self.should_exit:  # once: one line, and no waiting forever
                said = f"dflash-mlx serve: rank 0: stopped by {signal.Signals(sig).name}"
                end_within(worker, STOP_S, None if sig == signal.SIGINT else said,  # Ctrl-C: "interrupted"
                           f"{said}; its engine thread did not end within {STOP_S:.0f} s (a rank is gone)")
            threading.Thread(target=worker.stop, daemon=True).start()  # it joins the worker: not on the loop
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            # the engine thread stopped on its own (a rank of a split target is gone): so does the server
            return await super().on_tick(counter) or worker.failed is not None or worker.ranks.gone() is not None

    Server(config).run()


if __name__ == "__main__":
    sys.exit(main())
