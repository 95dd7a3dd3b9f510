"""Copies without a draft: plain steps queued first while no copy pays (new) against read first (old), and plain.

    python benchmarks/results/20261205-no-draft-queued-first/nodraft_ab.py SHORT MAX_TOKENS   (here: 2 96)
"""
import sys, json, math
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import dflash_mlx
from dflash_mlx import load
from dflash_mlx.bench.suites import Prompt, format_prompt, load_suite
from dflash_mlx.policy.sizer import forget_sizers
from dflash_mlx.engine import ahead
import no_draft_copies as B

orig = ahead.plan_copies
def old_plan_copies(ctx, plan, budget):
    orig(ctx, plan, budget); ctx.copies_pay = True  # never queued first where copies are on (the code before)
model, tok = load("smollm2-135m", quiet=True)
render = lambda p: format_prompt(tok, p)
prompts = load_suite("copy") + [p for s in B.SHORT for p in load_suite(s, int(sys.argv[1]))]
CF = {"plain": dict(baseline=True), "new": dict(), "old": dict()}
def go(cfg, text, n):
    ahead.plan_copies = old_plan_copies if cfg == "old" else orig
    try:
        return B.run(model, tok, text, n, **CF[cfg])
    finally:
        ahead.plan_copies = orig
forget_sizers()
task = load_suite("mbpp", 1)[0]
warm = Prompt("copy", "warm-up", [{"role": "user", "content": "Repeat the text below word for word.\n\n" + task.text}], {"task": "warm-up"})
for c in CF: go(c, render(warm), 64)
recs = []
names = list(CF)
for i, p in enumerate(prompts):
    text = render(p); order = names[i % 3:] + names[: i % 3]
    rec = {"suite": p.suite, "task": p.meta.get("task", p.suite)}
    outs = set()
    for c in order:
        tokens, last, cpu = go(c, text, int(sys.argv[2]))
        outs.add(tuple(tokens)); rec[c] = last.generation_tps
        rec[c + "_props"] = last.proposal_counts
    rec["identical"] = len(outs) == 1
    recs.append(rec)
    print(i, p.suite, rec["task"], {c: round(rec[c], 2) for c in CF}, rec["identical"], flush=True)
g = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))
for name, sel in (("copy suite", lambda r: r["suite"] == "copy"), ("short suites", lambda r: r["suite"] != "copy")):
    rs = [r for r in recs if sel(r)]
    print(name, "new/plain", round(g([r["new"] / r["plain"] for r in rs]), 3), "worst", round(min(r["new"] / r["plain"] for r in rs), 3),
          "| old/plain", round(g([r["old"] / r["plain"] for r in rs]), 3), "worst", round(min(r["old"] / r["plain"] for r in rs), 3),
          "| new/old", round(g([r["new"] / r["old"] for r in rs]), 3))
print("identical", all(r["identical"] for r in recs))
json.dump(recs, open(Path(__file__).with_name("results.json"), "w"))
