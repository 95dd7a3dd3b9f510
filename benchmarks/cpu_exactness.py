"""How often DFlash's greedy output parts from mlx-lm's on this CPU, per 1,000 tokens, and why.

    python benchmarks/cpu_exactness.py --prompts 4 --tokens 256      # SmolLM2-135M f32, the suites' prompts

On MLX's CPU backend with OpenBLAS (what `import dflash_mlx` routes matmuls to), row i of a
k-row float32 product equals the same row computed alone only for k <= 3: wider products run
OpenBLAS's main kernel, which sums in another order (up to ~6e-5 apart at K = 576; MLX's own
reference BLAS and its quantized kernels are row-invariant). A verify of 4 or more rows then
writes logits and cache entries that differ from plain decoding's in their last bits, and a
near-tie in the target's logits can flip its argmax. This measures that on the packaged target
(float32, the default here): a draft that proposes mlx-lm's own continuation (right for a random
0-15 tokens a cycle, so verifies are wide and every rollback length occurs) at widths 1, 4, 16 and
`auto`, then deterministic mode; each first divergence comes with mlx-lm's top-two logit gap there.
Results: JSON, a README and a plot under benchmarks/results/<date>-cpu-exactness/.
"""

import argparse
import datetime
import json
import random
import sys
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core: BLAS routing)
import mlx.core as mx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "gpu"))

from engine_vs_reference import environment, prompts_from_suites  # noqa: E402
from parts import OracleDraft, decode, first_divergence  # noqa: E402

from dflash_mlx.progress import Progress  # noqa: E402
from dflash_mlx.testing.targets import greedy_reference  # noqa: E402


def top_gap(model, context):
    """mlx-lm's top-two logit gap after `context`, from its own one-token step."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(context[:-1])[None], cache=cache)
    logits = model(mx.array(context[-1:])[None], cache=cache)[0, -1]
    top = mx.sort(logits)
    return float((top[-1] - top[-2]).item())


def row_rounding(model, prompts, starts=(0, 16, 32)) -> dict:
    """How far a 16-row verify's logits are from mlx-lm's one-token steps over the same tokens,
    against the top-two gaps those steps meet: a flip needs a gap below the difference."""
    from mlx_lm.models.cache import make_prompt_cache

    diffs, gaps = [], []
    for _, prompt in prompts:
        ref = greedy_reference(model, prompt, max(starts) + 16)
        for start in starts:
            context = prompt + ref[:start]
            steps, verify = make_prompt_cache(model), make_prompt_cache(model)
            for cache in (steps, verify):
                model(mx.array(context[:-1])[None], cache=cache)
            block = [context[-1]] + ref[start : start + 15]
            wide = model(mx.array(block)[None], cache=verify)[0]
            for i, token in enumerate(block):
                one = model(mx.array([token])[None], cache=steps)[0, -1]
                top = mx.sort(one)
                diffs.append(float(mx.abs(one - wide[i]).max().item()))
                gaps.append(float((top[-1] - top[-2]).item()))
    diffs.sort(), gaps.sort()
    return dict(rows=len(diffs), max_logit_diff=diffs[-1], median_logit_diff=diffs[len(diffs) // 2],
                smallest_top_gap=gaps[0], top_gap_1st_percentile=gaps[len(gaps) // 100])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per suite (gsm8k, humaneval, mtbench)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--widths", default="1,4,16,auto")
    ap.add_argument("--deterministic-widths", default="16", help="widths deterministic mode runs at")
    ap.add_argument("--parts", default="exactness,rounding")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from dflash_mlx.cli.common import load_model_and_draft

    model, tok, _, _ = load_model_and_draft("smollm2-135m", quiet=True)
    vocab = model.model.embed_tokens.weight.shape[0]
    prompts = prompts_from_suites(tok, args.prompts)
    widths = [w if w == "auto" else int(w) for w in args.widths.split(",")]
    runs = [(w, False) for w in widths] + [(w if w == "auto" else int(w), True)
                                           for w in args.deterministic_widths.split(",") if w]
    progress, done = Progress(len(prompts) * (1 + len(runs)), "cpu exactness", "answers"), 0
    rows = {f"{w}{' deterministic' if d else ''}": dict(width=str(w), deterministic=d, answers=0, diverged=0,
                                                       tokens=0, gaps=[]) for w, d in runs}
    t0 = time.perf_counter()
    for name, prompt in (prompts if "exactness" in args.parts else []):
        ref = greedy_reference(model, prompt, args.tokens)
        done += 1
        progress.update(done)
        rights = [random.Random(len(prompt) + c).randrange(0, 16) for c in range(args.tokens + 1)]
        for width, deterministic in runs:
            row = rows[f"{width}{' deterministic' if deterministic else ''}"]
            draft = OracleDraft(model, prompt + ref, vocab, lambda c: rights[c])
            out, _, _ = decode(model, draft, tok, prompt, args.tokens, width, deterministic=deterministic)
            at = first_divergence(out, ref)
            row["answers"] += 1
            row["tokens"] += len(ref) if at is None else at + 1
            if at is not None:
                row["diverged"] += 1
                row["gaps"].append(dict(prompt=name, at=at, gap=top_gap(model, prompt + ref[:at])))
            done += 1
            progress.update(done, f"{sum(r['diverged'] for r in rows.values())} diverged")
    progress.close()
    for row in rows.values():
        row["per_1000"] = round(1000 * row["diverged"] / max(row["tokens"], 1), 2)
    out = Path(args.out or HERE / "results" / f"{datetime.date.today():%Y%m%d}-cpu-exactness")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    result = json.loads(path.read_text()) if path.exists() else {}  # a run of one part keeps the other's
    if "exactness" in args.parts:
        result.update(command=" ".join(["python", "benchmarks/cpu_exactness.py"] + (argv or sys.argv[1:])),
                      environment=environment(), prompts=len(prompts), tokens=args.tokens,
                      seconds=round(time.perf_counter() - t0, 1), rows=list(rows.values()))
        _plot(rows, out / "divergences.png")
    if "rounding" in args.parts:
        result["rounding"] = row_rounding(model, prompts)
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result.get(k) for k in ("rows", "rounding")}, indent=1))


def _plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(rows)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.bar(names, [rows[n]["per_1000"] for n in names], color=["#c44" if rows[n]["diverged"] else "#4a4"
                                                               for n in names])
    ax.set_ylabel("first divergences / 1,000 tokens")
    ax.set_title("SmolLM2-135M f32, MLX CPU + OpenBLAS: DFlash vs mlx-lm greedy")
    plt.xticks(rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
