"""A long document cached in a file, then questions after it: what the file saves, and what the draft's
saved context buys.

    python benchmarks/prompt_cache_file_speed.py [--model smollm2-135m] [--length 1024] [--questions 3]
                                                 [--max-tokens 64] [--out DIR]

The packaged target and its shipped draft, greedy. Each evaluation document of `bench.documents` (the
depth benchmark's) is cut to `--length` prompt tokens with a question after it, as the depth benchmark
builds it; the document part (the chat template's head and the document) is cached once, and each
question is then answered four ways:

- **whole prompt**: no file, the document and the question prefilled together (`auto`);
- **our file**: `save_prompt_cache` after the engine ran the document, with the draft's context; loaded,
  only the question prefilled (`auto`);
- **mlx-lm's file**: mlx-lm's own prefill of the document, saved by its `save_prompt_cache` (no draft
  context: the draft starts cold) (`auto`);
- **plain after our file**: plain decoding (`baseline=True`) after our file.

Time to the first token counts loading the file. The answers after our file (DFlash and plain decoding)
must be the same tokens; each answer after mlx-lm's file is checked against mlx-lm's `generate_step` after
that file. Writes results.json, README.md and ttft.png.
"""

import argparse
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
import mlx.core as mx

HERE = Path(__file__).resolve().parent
WAYS = ("whole prompt", "our file", "mlx-lm's file", "plain after our file")


def answer(model, draft, tok, prompt_ids, max_tokens, state=None, baseline=False, load_seconds=0.0) -> dict:
    from dflash_mlx import stream_generate

    out, first, last, t0 = [], None, None, time.perf_counter()
    for last in stream_generate(model, draft, tok, prompt_ids, max_tokens=max_tokens, prompt_cache=state,
                                baseline=baseline):
        out += last.tokens
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return {"tokens": out, "ttft_s": load_seconds + first - t0, "prefilled": last.prefill_tokens,
            "decode_tps": (len(out) - 1) / (end - first) if len(out) > 1 else 0.0,
            "tau": last.tau if last.accept_lengths else None}


def main(argv=None):
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import load_prompt_cache as mlx_lm_load
    from mlx_lm.models.cache import make_prompt_cache as mlx_lm_cache
    from mlx_lm.models.cache import save_prompt_cache as mlx_lm_save

    from dflash_mlx import load, load_draft, make_prompt_cache, stream_generate
    from dflash_mlx.bench.documents import EVAL_DOCUMENTS, QUESTIONS, document_prompt_parts, read_documents
    from dflash_mlx.cli.doctor import machine, results_footer
    from dflash_mlx.engine.prompt_cache_file import continued, load_prompt_cache, save_prompt_cache
    from dflash_mlx.progress import Progress

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    load_start = os.getloadavg()
    model, tok = load(args.model)
    draft = load_draft(args.model, model)
    docs, missing = read_documents(EVAL_DOCUMENTS)
    rows, progress = [], Progress(len(docs) * args.questions, "questions")
    # (a first answer warms the width policy and the kernels: not measured)
    head, body, tail = document_prompt_parts(tok, docs[0], 256, 0)
    answer(model, draft, tok, head + body + tail, 16)
    with tempfile.TemporaryDirectory() as tmp:
        for doc in docs:
            head, body, _ = document_prompt_parts(tok, doc, args.length, 0)
            prefix = head + body
            ours, theirs = Path(tmp) / f"{doc.sha256}.safetensors", Path(tmp) / f"{doc.sha256}-mlx.safetensors"
            t0 = time.perf_counter()
            state = make_prompt_cache(model, draft)
            list(stream_generate(model, draft, tok, prefix, max_tokens=1, prompt_cache=state))
            save_prompt_cache(ours, state, model_name=args.model)
            cache_seconds = time.perf_counter() - t0
            cache = mlx_lm_cache(model)
            for _ in generate_step(mx.array(prefix), model, max_tokens=0, prompt_cache=cache):
                pass
            mlx_lm_save(str(theirs), cache, {"model": args.model, "tokenizer_config": "{}"})
            for q in range(args.questions):
                _, _, tail = document_prompt_parts(tok, doc, args.length, q)
                row = {"document": doc.name, "question": QUESTIONS[doc.kind][q], "prefix_tokens": len(prefix),
                       "suffix_tokens": len(tail), "cache_seconds": cache_seconds,
                       "file_mb": ours.stat().st_size / 1e6, "mlx_lm_file_mb": theirs.stat().st_size / 1e6}
                row["whole prompt"] = answer(model, draft, tok, prefix + tail, args.max_tokens)
                for way, path, with_draft, baseline in (("our file", ours, draft, False),
                                                        ("mlx-lm's file", theirs, draft, False),
                                                        ("plain after our file", ours, None, True)):
                    t0 = time.perf_counter()
                    loaded, _ = load_prompt_cache(path, model, with_draft)
                    row[way] = answer(model, with_draft if not baseline else draft, tok, continued(loaded, tail),
                                      args.max_tokens, loaded, baseline, time.perf_counter() - t0)
                ref = [int(t) for t, _ in generate_step(mx.array(tail), model, max_tokens=len(row["mlx-lm's file"]
                                                                                              ["tokens"]),
                                                        prompt_cache=mlx_lm_load(str(theirs)),
                                                        sampler=lambda x: mx.argmax(x, axis=-1))]
                row["exact"] = {"our file = plain after it": row["our file"]["tokens"] ==
                                row["plain after our file"]["tokens"],
                                "mlx-lm's file = mlx-lm after it": row["mlx-lm's file"]["tokens"] == ref}
                rows.append(row)
                progress.update(len(rows), f"{doc.name} q{q}: ttft {row['whole prompt']['ttft_s']:.2f} s whole, "
                                f"{row['our file']['ttft_s']:.2f} s after the file", force=True)
    progress.close()
    report(rows, args, machine(), missing, results_footer(load_start, os.getloadavg()))


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def report(rows, args, machine_info, missing, footer):
    out = Path(args.out or HERE / "results" / f"{datetime.date.today():%Y%m%d}-prompt-cache-file-speed")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"machine": machine_info, "args": vars(args), "rows": rows},
                                                 indent=1))
    plain_tps = _mean([r["plain after our file"]["decode_tps"] for r in rows])
    lines = [f"# A document in a prompt cache file, then questions ({datetime.date.today()})", "",
             f"`python benchmarks/prompt_cache_file_speed.py --length {args.length} --questions {args.questions} "
             f"--max-tokens {args.max_tokens}`: {args.model} and its shipped draft, greedy, {len(rows)} questions "
             f"after {len({r['document'] for r in rows})} documents of {rows[0]['prefix_tokens']} tokens "
             f"(cached in {_mean([r['cache_seconds'] for r in rows]):.1f} s; our file "
             f"{_mean([r['file_mb'] for r in rows]):.0f} MB, mlx-lm's {_mean([r['mlx_lm_file_mb'] for r in rows]):.0f}"
             " MB)" + (f"; missing here: {', '.join(missing)}" if missing else "") + ".", "",
             "| way | time to first token (s) | prompt tokens run | decode tok/s | tau | vs plain after the file |",
             "|---|---:|---:|---:|---:|---:|"]
    for way in WAYS:
        tps = _mean([r[way]["decode_tps"] for r in rows])
        lines.append(f"| {way} | {_mean([r[way]['ttft_s'] for r in rows]):.2f} | "
                     f"{_mean([r[way]['prefilled'] for r in rows]):.0f} | {tps:.1f} | "
                     f"{_mean([r[way]['tau'] for r in rows]):.2f} | {tps / plain_tps:.2f}x |")
    exact = {k: sum(r["exact"][k] for r in rows) for k in rows[0]["exact"]}
    lines += ["", "Exact: " + "; ".join(f"{k}: {v} of {len(rows)}" for k, v in exact.items()) + ".", "", *footer]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(WAYS, [_mean([r[w]["ttft_s"] for r in rows]) for w in WAYS])
    axes[0].set(ylabel="s", title="time to the first token")
    axes[1].bar(WAYS, [_mean([r[w]["decode_tps"] for r in rows]) for w in WAYS])
    axes[1].set(ylabel="tokens/s", title="decode speed")
    for ax in axes:
        ax.tick_params(axis="x", rotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(out / "ttft.png", dpi=110)
    print((out / "README.md").read_text())


if __name__ == "__main__":
    main()
