"""A width policy learned on short prompts, then a long document: decode tok/s of `auto` vs plain.

    OPENBLAS_NUM_THREADS=1 python benchmarks/context_ranges.py [--depth 3500] [--document 0]

The embedded default target and its shipped draft, greedy, 48 tokens. The pair's policy first
learns on 3 MT-Bench and 3 GSM8K prompts (64 tokens each), as in a chat or a server; then the
held-out document `--document` cut to `--depth` tokens is answered with `auto` three times (the
first pays the prefill and the policy's first cycles at that depth), plain decoding between them
from the same prompt cache, and twice more with a fresh policy (`forget_sizers`). Prints each
run's decode tok/s, tau, widths and proposal kinds, and whether its tokens equal plain decoding's.
Single runs of 48 tokens: read the ratios as rough.
"""

import argparse

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.policy import sizer as policy
from dflash_mlx.bench.depth import _run, prompt_at_depth
from dflash_mlx.bench.suites import format_prompt, load_suite
from dflash_mlx.bench.documents import EVAL_DOCUMENTS, read_documents
from dflash_mlx.generate import make_prompt_cache
from dflash_mlx.engine.prompt_cache import PromptCache

MAX_TOKENS = 48


def times_line(sizer) -> str:
    return f"times {({w: round(t * 1e3, 1) for w, t in sorted(sizer.times.items())})} load {sizer.load:.3f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=3500)
    ap.add_argument("--document", type=int, default=0, help="index into the held-out documents")
    args = ap.parse_args()

    model, tok = load("smollm2-135m", quiet=True)
    draft = load_draft("smollm2-135m", model)
    docs, _ = read_documents(EVAL_DOCUMENTS)
    for p in load_suite("mtbench", 3) + load_suite("gsm8k", 3):
        list(stream_generate(model, draft, tok, format_prompt(tok, p), max_tokens=64))
    sizer = policy.sizer_for(model, draft)
    print("after the short prompts:", times_line(sizer), flush=True)

    ids = prompt_at_depth(tok, docs[args.document], args.depth)
    cache = make_prompt_cache(model, draft)

    def auto():
        return _run(stream_generate(model, draft, tok, ids, max_tokens=MAX_TOKENS, prompt_cache=cache))

    def plain():
        shared = PromptCache(model=model, target_cache=cache.target_cache, tokens=list(cache.tokens))
        return _run(stream_generate(model, draft, tok, ids, max_tokens=MAX_TOKENS, baseline=True,
                                    prompt_cache=shared))

    runs = {"auto, learned on short prompts (prefill)": auto()}
    print("at depth:", times_line(policy.sizer_for(model, draft)), flush=True)
    for rep in range(2):
        runs[f"plain {rep}"] = plain()
        runs[f"auto, learned on short prompts {rep}"] = auto()
    for rep in range(2):
        policy.forget_sizers()
        runs[f"auto, fresh policy {rep}"] = auto()
        runs[f"plain, again {rep}"] = plain()
    reference = runs["plain 0"]["tokens"]
    for name, r in runs.items():
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        print(f"{name}: {r['decode_tps']:.2f} tok/s, tau {tau}, widths {r['widths']}, {r['proposals']}, "
              f"same tokens {r['tokens'] == reference}", flush=True)


if __name__ == "__main__":
    main()
