"""A quantized KV cache (`kv_bits`) on every architecture of the quick check: exact, or refused in one line.

    python benchmarks/kv_bits_sweep.py [--bits 2] [--keys qwen3,llama] [--out DIR]

Each architecture of `dflash_mlx.testing.arch_check` is built with heads of 32 dimensions (its config's
`head_dim` set to 32 where it has one, else its hidden size in heads of 32, else its own heads widened to
32: the tiny configs' heads of 8-16 fit no quantization group; `build`), then decoded greedily by DFlash
with mlx-lm's quantized KV cache (`--bits`, groups of 32, quantized from 3 tokens into the answer: the
conversion falls inside a verify's rows) against mlx-lm's own `generate_step` with the same arguments: a
random draft at `auto`, a scripted draft right for a random number of tokens each cycle at its block size,
and no draft. "changed"
says whether the quantized cache changed mlx-lm's answer (where not, the case could not catch a misplaced
conversion). Writes README.md and results.json.
"""

import argparse
import copy
import datetime
import random
import sys
from pathlib import Path

import dflash_mlx  # noqa: F401  (before mlx.core)
import mlx.core as mx

HERE = Path(__file__).resolve().parent
GROUP = 32
PROMPT_LEN, MAX_TOKENS, BLOCK = 20, 16, 8


def build(key: str, wide: bool = False):
    """`key`'s tiny model with heads of 32 dimensions: its `head_dim` 32 where it has one, else its hidden
    size in heads of 32; `wide`: its own heads of 32 each (the hidden size grown to fit) instead."""
    from dflash_mlx.testing import arch_check

    cfg = copy.deepcopy(arch_check.ARCHITECTURES[key])
    text = cfg.get("text_config", cfg)
    heads = text.get("num_attention_heads", 4)
    if wide:  # its own heads, 32 dimensions each
        text["hidden_size"] = 32 * heads
        if "head_dim" in text:
            text["head_dim"] = 32
    elif "head_dim" in text:
        text["head_dim"] = 32
    else:  # its own hidden size, in heads of 32
        heads = max(1, text.get("hidden_size", 64) // 32)
        kv_heads = text.get("num_key_value_heads") or heads
        text["num_attention_heads"] = heads
        text["num_key_value_heads"] = kv_heads if kv_heads <= heads and heads % kv_heads == 0 else 1
    return arch_check.build(key, config=cfg)


def check(key: str, bits: int) -> dict:
    from dflash_mlx import stream_generate
    from dflash_mlx.models.draft.checkpoints import random_draft
    from dflash_mlx.models.target.adapter import Target, UnsupportedTargetError
    from dflash_mlx.models.target.kv_quantization import KVQuantization, refusal
    from dflash_mlx.testing.targets import EOS_ID, ScriptedDraft, byte_tokenizer, greedy_reference

    for wide in (False, True):  # (where the first shape gives no head of 32 dimensions, the second)
        try:
            model = build(key, wide)
        except Exception as e:
            outcome = dict(status="not built", reason=f"heads of 32 dimensions: {type(e).__name__}: {e}"[:200])
            continue
        try:
            target = Target(model)
        except UnsupportedTargetError as e:
            outcome = dict(status="refused", reason=f"(as a target) {e}")
            continue
        reason = refusal(target, KVQuantization(bits, GROUP, PROMPT_LEN + 3))
        outcome = None if reason is None else dict(status="refused", reason=reason)
        if reason is None or "in groups of" not in reason:
            break
    if outcome is not None:
        return outcome
    kv = dict(kv_bits=bits, kv_group_size=GROUP, quantized_kv_start=PROMPT_LEN + 3)
    for s in range(20):
        rng = random.Random(s)
        prompt = [rng.randrange(0, 256) for _ in range(PROMPT_LEN)]
        ref = greedy_reference(model, prompt, MAX_TOKENS, **kv)
        if EOS_ID not in ref:
            break
    changed = ref != greedy_reference(model, prompt, MAX_TOKENS)
    tok = byte_tokenizer()

    def decode(draft, width, **extra):
        out = []
        for r in stream_generate(model, draft, tok, prompt, max_tokens=MAX_TOKENS, block_size=width,
                                 stop_token_ids=[], **kv, **extra):
            out += r.tokens
        return out

    rng = random.Random(1)
    right = [rng.randrange(0, BLOCK) for _ in range(100)]
    runs = {"random draft, auto": lambda: decode(random_draft(model, num_layers=1, block_size=BLOCK, seed=3), "auto"),
            "scripted draft": lambda: decode(ScriptedDraft(Target(model), prompt + ref, lambda c: right[c],
                                                           block_size=BLOCK), "draft"),
            "no draft": lambda: decode(None, "auto")}
    for name, run in runs.items():
        try:
            out = run()
        except UnsupportedTargetError as e:
            return dict(status="refused", reason=str(e), changed=changed)
        if out != ref:
            return dict(status="mismatch", reason=f"{name}: {out} != mlx-lm's {ref}", changed=changed)
    return dict(status="exact", changed=changed)


def main(argv=None):
    from dflash_mlx.testing import arch_check
    from dflash_mlx.testing.arch_sweep import exact_and_changed, sweep, write_report

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--keys", default=None, help="comma-separated architecture keys (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    keys = args.keys.split(",") if args.keys else list(arch_check.ARCHITECTURES)
    results, counts, seconds = sweep(keys, lambda key: check(key, args.bits))
    command = (f"`python benchmarks/kv_bits_sweep.py --bits {args.bits}`: {len(keys)} architectures, kv_bits "
               f"{args.bits}, groups of {GROUP}, quantized from {PROMPT_LEN + 3} tokens (3 into the answer), "
               f"{MAX_TOKENS} tokens, float32, MLX {mx.__version__} ({mx.default_device()}); {seconds:.0f} s.")
    changed = (f"Exact where the quantized cache changed mlx-lm's answer: {exact_and_changed(results)} of "
               f"{counts.get('exact', 0)}.")
    out = Path(args.out or HERE / "results" / f"{datetime.date.today():%Y%m%d}-kv-bits-sweep")
    return write_report(out, f"A quantized KV cache on every architecture ({datetime.date.today()})", command,
                        results, counts, changed, dict(bits=args.bits, group=GROUP))


if __name__ == "__main__":
    sys.exit(main())
