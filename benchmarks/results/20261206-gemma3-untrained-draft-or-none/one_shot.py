"""One-shot runs of the packaged Gemma 3 270M (base) with the untrained draft `load_draft` makes for it,
or with no draft (copies of the context alone): a fresh process a run, as `dflash-mlx "..."` is.

    for i in 0 1 2 3 4 5; do for c in untrained none; do
        echo "$i $c $(taskset -c 0 python one_shot.py $c $i 2>/dev/null)"; done; done
"""

import json
import sys
import time

import dflash_mlx  # noqa: F401  (before mlx.core)
from dflash_mlx import load, load_draft, stream_generate

PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
           "The history of the Roman Empire", "Here is a list of fruits:\n1. Apple\n2.",
           "Once upon a time, in a small village,"]

model, tok = load("gemma3-270m", quiet=True)[:2]
draft = load_draft("gemma3-270m", model, quiet=True) if sys.argv[1] == "untrained" else None
out, t0 = [], None
for r in stream_generate(model, draft, tok, tok.encode(PROMPTS[int(sys.argv[2])]), max_tokens=96):
    out += r.tokens
    if t0 is None:
        t0 = time.perf_counter()
print(json.dumps({"n": len(out) - 1, "s": time.perf_counter() - t0, "tau": r.tau, "h": hash(tuple(out))}))
