"""One-shot CLI runs, a fresh process each (as `dflash-mlx "..."` is), with what `auto` learned kept between
runs (`policy.memory`, a folder of its own that starts empty) or not (`DFLASH_MLX_POLICY_CACHE=0`).

    python one_shot.py OUT.json [--per-suite 3] [--max-tokens 128] [--rounds 1]

SmolLM2-135M-Instruct with its shipped draft, `auto`, greedy; the suite prompts in order, both ways for each
prompt, the order alternating from prompt to prompt. Speed: the CLI's own decode tok/s (`--json`).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import dflash_mlx  # noqa: F401
from dflash_mlx.bench.suites import load_suite


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--per-suite", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    prompts = [(s, p) for s in ("gsm8k", "humaneval", "mtbench") for p in load_suite(s, limit=args.per_suite)]
    prompts = [(s, p.messages[-1]["content"]) for s, p in prompts]
    kept = tempfile.mkdtemp(prefix="policies-")
    runs = []
    for r in range(args.rounds):
        for i, (suite, text) in enumerate(prompts):
            order = ("kept", "fresh") if (i + r) % 2 == 0 else ("fresh", "kept")
            outs = {}
            for how in order:
                env = dict(os.environ, DFLASH_MLX_POLICY_CACHE=kept if how == "kept" else "0")
                done = subprocess.run([sys.executable, "-m", "dflash_mlx.cli.main", "--json", "--max-tokens",
                                       str(args.max_tokens), text], env=env, capture_output=True, text=True, check=True)
                res = json.loads(done.stdout)
                outs[how] = res["tokens"]
                runs.append(dict(round=r, prompt=i, suite=suite, how=how, tokens=len(res["tokens"]),
                                 tps=res["generation_tps"], tau=res["tau"]))
                print(f"round {r} prompt {i} {suite} {how}: {res['generation_tps']:.2f} tok/s, tau {res['tau']:.2f}",
                      flush=True)
            assert outs["kept"] == outs["fresh"], f"prompt {i}: the tokens differ"
    summary = {}
    for how in ("kept", "fresh"):
        mine = [x for x in runs if x["how"] == how]
        secs = sum(x["tokens"] / x["tps"] for x in mine)
        summary[how] = dict(tok_s=sum(x["tokens"] for x in mine) / secs, runs=len(mine))
    summary["ratio"] = summary["kept"]["tok_s"] / summary["fresh"]["tok_s"]
    print(json.dumps(summary))
    with open(args.out, "w") as f:
        json.dump(dict(summary=summary, runs=runs), f, indent=1)


if __name__ == "__main__":
    main()
