# A/B: a forward's graph queued in pieces (taps.submit_layers) or whole, SmolLM2 + shipped draft, one process
import sys, time, json
import dflash_mlx
import mlx.core as mx
from dflash_mlx.models.target import taps
from dflash_mlx.bench.suites import load_suite, format_prompt
from dflash_mlx.generate import stream_generate
real = taps.submit_layers
model, tok = dflash_mlx.load("smollm2-135m")
draft = dflash_mlx.load_draft("smollm2-135m", model)
suites = sys.argv[1].split(",")
block = sys.argv[2] if len(sys.argv) > 2 else "auto"
block = block if block == "auto" else int(block)
prompts = [format_prompt(tok, p) for s in suites for p in load_suite(s, limit=2)]
def run(variant, prompt, baseline=False):
    taps.SUBMIT_EVERY = 1 if variant == "pieces" else 0
    n, t0, toks = 0, None, []
    for r in stream_generate(model, draft, tok, prompt, max_tokens=128, block_size=block, baseline=baseline):
        toks += r.tokens
        if t0 is None: t0 = time.perf_counter()
    return len(toks) - 1, time.perf_counter() - t0, toks, r.accept_lengths
res = {"pieces": [0, 0], "whole": [0, 0], "pieces_plain": [0, 0], "whole_plain": [0, 0]}
for rnd in range(int(sys.argv[3]) if len(sys.argv) > 3 else 2):
    for i, p in enumerate(prompts):
        outs = {}
        for v in (("pieces", "whole") if rnd % 2 == 0 else ("whole", "pieces")):
            n, s, toks, acc = run(v, p); res[v][0] += n; res[v][1] += s; outs[v] = toks
            n, s, toks2, _ = run(v, p, baseline=True); res[v + "_plain"][0] += n; res[v + "_plain"][1] += s
            assert toks2 == toks, "not lossless"
        assert outs["pieces"] == outs["whole"]
    print(rnd, {k: round(a / b, 2) for k, (a, b) in res.items()}, flush=True)
