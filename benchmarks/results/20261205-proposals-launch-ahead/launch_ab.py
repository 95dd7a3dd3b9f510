"""SmolLM2 on this CPU: cycles launched ahead where the LM head is in one piece, plain steps queued first
despite a raw-argmax flag (new) against nothing launched ahead where the head may split (old), in one
process, a model and draft each (so a width policy each), interleaved prompt by prompt.

    python launch_ab.py MAX_TOKENS PER_SUITE SUITES MODES OUT.json
    (here: 96 3 gsm8k,humaneval,mtbench plain,auto,nodraft ...; 96 12 copy nodraft,auto ...)
"""
import sys, json, math
import dflash_mlx
from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.bench.suites import format_prompt, load_suite
from dflash_mlx.policy.sizer import forget_sizers
from dflash_mlx.engine import ahead as A, cycle as C
(model, tok), (model_old, _) = load("smollm2-135m", quiet=True), load("smollm2-135m", quiet=True)
models = {"new": model, "old": model_old}  # a width policy each, drafted or not
drafts = {"new": load_draft("smollm2-135m"), "old": load_draft("smollm2-135m")}  # a width policy each
n, per = int(sys.argv[1]), int(sys.argv[2])
suites = sys.argv[3].split(",")
prompts = [p for s in suites for p in load_suite(s, per)]
new_may = A.may_launch
old_may = lambda ctx, timer, lp: new_may(ctx, timer, lp) and not ctx.head_rows.split
def go(cfg, text, m):
    mode, code = cfg.split("-")
    A.may_launch = C.may_launch = old_may if code == "old" else new_may
    try:
        toks, last = [], None
        kw = dict(baseline=True) if mode == "plain" else {}
        for last in stream_generate(models[code], None if mode == "nodraft" else drafts[code], tok, text, max_tokens=m, **kw):
            toks += last.tokens
        return toks, last
    finally:
        A.may_launch = C.may_launch = new_may
CF = [m + "-" + c for m in sys.argv[4].split(",") for c in ("new", "old")]
forget_sizers()
for c in CF: go(c, format_prompt(tok, prompts[0]), 32)
recs = []
for i, p in enumerate(prompts):
    text = format_prompt(tok, p)
    order = CF if i % 2 == 0 else CF[::-1]
    rec = {"suite": p.suite}
    outs = {}
    for c in order:
        t, last = go(c, text, n)
        outs.setdefault(c.split("-")[0], set()).add(tuple(t)); rec[c] = last.generation_tps
    rec["identical"] = all(len(v) == 1 for v in outs.values())
    recs.append(rec)
    print(i, p.suite, {c: round(rec[c], 2) for c in CF}, rec["identical"], flush=True)
g = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))
for m in sys.argv[4].split(","):
    print(m, "new/old", round(g([r[m + "-new"] / r[m + "-old"] for r in recs]), 3))
json.dump(recs, open(sys.argv[5], "w"))
