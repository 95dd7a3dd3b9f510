"""mlx-lm's `--draft-model` in the engine against mlx-lm's own speculative decoding: same draft model, same prompts.

    python benchmarks/draft_model_vs_mlx_lm.py [--draft-layers 6] [--num-draft-tokens 3] [--max-tokens 96]

No two models of one tokenizer ship in this project's packages, so the draft model is the packaged
SmolLM2-135M-Instruct target cut to its first `--draft-layers` layers (with its own final norm and LM
head): a model of the target's tokenizer at a fraction of its cost, whose guesses are weak (the
self-speculation of LayerSkip, without its training). Interleaved per prompt, as
`engine_vs_reference.py` runs (its prompts and timing): mlx-lm's plain decoding; mlx-lm's speculative
decoding (`stream_generate(draft_model=, num_draft_tokens=N)`); ours with the same draft model
(`AutoregressiveDraft`) at width N + 1 and at `auto`; ours without a draft. Every configuration's
tokens are compared with mlx-lm's plain decoding. Results: benchmarks/results/<date>-draft-model/.
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import dflash_mlx  # noqa: E402,F401  (before mlx.core: BLAS routing)
import mlx.core as mx  # noqa: E402

from dflash_mlx import load  # noqa: E402
from dflash_mlx.models.draft.autoregressive import AutoregressiveDraft  # noqa: E402
from engine_vs_reference import (compare, environment, mlx_lm_plain, ours, prompts_from_suites,  # noqa: E402
                                 speed_table, timed)


def mlx_lm_speculative(model, draft_model, tokenizer, num_draft_tokens: int):
    """mlx-lm's own speculative decoding (`speculative_generate_step`) with `draft_model`, greedy."""
    from mlx_lm.generate import stream_generate as lm_stream_generate
    from mlx_lm.sample_utils import make_sampler

    class _Step:
        def __init__(self, r):
            self.tokens = [r.token]

    def run(prompt, max_tokens):
        stream = lm_stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens,
                                    sampler=make_sampler(0.0), draft_model=draft_model,
                                    num_draft_tokens=num_draft_tokens)
        return timed(_Step(r) for r in stream)

    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--draft-layers", type=int, default=6, help="layers of the target the draft model keeps")
    p.add_argument("--num-draft-tokens", type=int, default=3, help="mlx-lm's; ours verifies N + 1 rows at most")
    p.add_argument("--per-suite", type=int, default=2, help="prompts per suite (gsm8k, humaneval, mtbench)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    model, tokenizer = load("smollm2-135m", quiet=True)
    small, _ = load("smollm2-135m", quiet=True)
    layers = len(small.model.layers)
    small.model.layers = small.model.layers[: args.draft_layers]
    n = args.num_draft_tokens
    draft = AutoregressiveDraft(small, tokenizer, num_draft_tokens=n)
    prompts = prompts_from_suites(tokenizer, args.per_suite)
    configs = {
        "mlx-lm plain decoding": mlx_lm_plain(model, tokenizer),
        f"mlx-lm speculative, {n} draft tokens": mlx_lm_speculative(model, small, tokenizer, n),
        f"ours, draft model, width {n + 1}": ours(model, draft, tokenizer, n + 1),
        "ours, draft model, auto": ours(model, draft, tokenizer, "auto"),
        "ours, no draft (copies), auto": ours(model, None, tokenizer, "auto"),
    }
    rows, mismatches = compare(configs, prompts, args.max_tokens)
    base = rows["mlx-lm plain decoding"]
    out = Path(args.out or HERE / "results" / f"{datetime.date.today():%Y%m%d}-draft-model")
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    lines = [f"# mlx-lm's --draft-model: ours against mlx-lm's speculative decoding ({datetime.date.today()})", "",
             f"{len(prompts)} prompts (gsm8k, humaneval, mtbench, {args.per_suite} each), {args.max_tokens} tokens, "
             f"greedy, SmolLM2-135M-Instruct float32 (target, {layers} layers), draft model: its first "
             f"{args.draft_layers} layers with its final norm and head; interleaved in one process. "
             f"Tokens identical to mlx-lm's plain decoding: {'yes' if not mismatches else mismatches}.", "",
             *speed_table(rows, "mlx-lm plain decoding")]
    lines += ["", f"Machine: {env['machine']}, MLX {env['mlx']} (CPU backend), BLAS {env['blas']}, load average "
              f"{env['load_average'][0]:.1f} at the end."]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"environment": env, "args": vars(args), "rows": rows,
                                                  "mismatches": mismatches}, indent=1, default=str))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    names = list(rows)
    ax.barh(names[::-1], [rows[k]["tok_s"] / base["tok_s"] for k in names[::-1]])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set(xlabel="decode speed vs mlx-lm's plain decoding", title="same draft model, same prompts (CPU)")
    fig.tight_layout()
    fig.savefig(out / "speed.png", dpi=110)
    print((out / "README.md").read_text())


if __name__ == "__main__":
    main()
