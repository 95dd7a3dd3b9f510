"""`dflash-mlx chat`'s flags, and the app started from them (`tui/app.py`)."""

import sys

from dflash_mlx.cli.common import (ArgumentParser, add_draft_bits_arg, add_kv_cache_args, add_mlx_lm_only_args,
                                   add_model_load_args, add_prefill_step_arg, add_template_config_arg, checked_options,
                                   draft_for, kv_cache_kwargs, model_load_kwargs, refuse_mlx_lm_only_args,
                                   require_prompt_cache_file)
from dflash_mlx.options import add_generation_args
from dflash_mlx.tui.session import Settings


def build_parser():
    from dflash_mlx.models.packaged import DEFAULT_MODEL

    p = ArgumentParser(prog="dflash-mlx chat", description="Terminal chat with DFlash speculative decoding.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="packaged name, mlx-lm folder, .gguf file or hub id")
    p.add_argument("--draft", default=None, help="DFlash draft (packaged name, folder or hub id); default: --model's")
    add_draft_bits_arg(p)
    add_model_load_args(p)
    add_generation_args(p, Settings())
    p.add_argument("--system", "--system-prompt", default="", help="system prompt (default: the chat template's)")
    add_template_config_arg(p)
    add_kv_cache_args(p)
    add_prefill_step_arg(p)
    add_mlx_lm_only_args(p)
    p.add_argument("--prompt-cache-file", default=None, metavar="FILE",
                   help="a document cached by dflash-mlx cache-prompt: every chat starts with it, its caches loaded "
                        "rather than run (give the same --model and --system)")
    return p


def settings_from_args(args) -> Settings:
    """The chat's settings from its flags; CLIError (a usage error) naming a bad one."""
    return checked_options(args, Settings, system=args.system)


def main(argv=None) -> int:
    from dflash_mlx.tui.app import ChatApp  # (Textual: imported once the flags are good)

    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    refuse_mlx_lm_only_args(args)
    settings = settings_from_args(args)
    # a name that cannot be a model or draft fails here, not after the app is up
    draft_for(args.model, args.draft, without_draft=True)  # no draft: copies of the context alone
    require_prompt_cache_file(args.prompt_cache_file)
    app = ChatApp(model_name=args.model, draft_name=args.draft, settings=settings, draft_bits=args.draft_bits,
                  kv_cache=kv_cache_kwargs(args), template_kwargs=args.chat_template_config,
                  load_kwargs=model_load_kwargs(args), document=args.prompt_cache_file,
                  prefill_step_size=args.prefill_step_size)
    app.run()  # Textual restores the terminal when run() returns, also after an exception
    return app.return_code or 0


if __name__ == "__main__":
    raise SystemExit(main())
