"""The GPU check's `kvcache` part: mlx-lm's KV cache options on the backend's kernels.

  - `row_invariant_width`: the most verify rows whose forward and LM head equal, bit for bit, as many
    one-row steps on a quantized KV cache (`models.target.kv_quantization`): what a verify holds while a
    cache is or will be quantized (3 on this project's CPU; expected 1 on a GPU);
  - whether DFlash at `auto` (and in deterministic mode) stays mlx-lm's greedy decode under `kv_bits` 8
    (quantized from the first token) and under `max_kv_size` (`models.target.kv_window`).
"""

import random
import time
from typing import Dict, List

import parts  # (beside this file)
from dflash_mlx.models.target import kv_quantization
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.testing.targets import greedy_reference


def run(models: Dict[str, tuple], tokens: int, window: int, deadline: float, log=print) -> List[Dict]:
    """`models`: name -> (model, tokenizer), heads of 64 dimensions or more (groups of 64)."""
    rows = []
    for name, (model, tok) in models.items():
        target = Target(model)
        for bits in (8, 4):
            try:
                width = kv_quantization.row_invariant_width(target, bits, 64)
            except Exception as e:  # (a refusal: one line in the table)
                width = f"{type(e).__name__}: {e}"[:120]
            rows.append(dict(model=name, setting=f"kv_bits {bits}", row_invariant_width=width))
            log(f"  {name}: kv_bits {bits}: {width} rows round as one-row steps")
        vocab = model.model.embed_tokens.weight.shape[0]
        prompt = [random.Random(1).randrange(0, min(vocab, 30000)) for _ in range(24)]
        settings = {"kv_bits 8": dict(kv_bits=8, kv_group_size=64, quantized_kv_start=0),
                    f"max_kv_size {window}": dict(max_kv_size=window)}
        for setting, kwargs in settings.items():
            ref = greedy_reference(model, prompt, tokens, **kwargs)
            for deterministic in (False, True):
                if time.perf_counter() > deadline:
                    log(f"  kvcache: out of time before {name} {setting}")
                    return rows
                rights = [random.Random(c).randrange(0, 16) for c in range(tokens + 1)]
                draft = parts.OracleDraft(model, prompt + ref, vocab, lambda c: rights[c])
                try:
                    out, _, accepts = parts.decode(model, draft, tok, prompt, tokens, "auto",
                                                   deterministic=deterministic, **kwargs)
                except Exception as e:
                    rows.append(dict(model=name, setting=setting, deterministic=deterministic, error=str(e)[:160]))
                    continue
                at = parts.first_divergence(out, ref)
                rows.append(dict(model=name, setting=setting, deterministic=deterministic, tokens=len(ref),
                                 diverged_at=at, tau=round(len(out) / max(len(accepts), 1), 2)))
                log(f"  {name} {setting} deterministic={deterministic}: "
                    f"{'mlx-lm' + chr(39) + 's tokens' if at is None else f'parted at token {at}'}")
    return rows
