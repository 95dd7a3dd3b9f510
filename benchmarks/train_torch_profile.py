"""CPU profile of train_torch's step: P packs in one step against the same P packs one at a time.

    OMP_NUM_THREADS=2 python benchmarks/train_torch_profile.py --out benchmarks/results/<date>-train-torch-cpu-profile

Needs torch + transformers + speculators (a side venv; never the project's). A small random
Llama target (hidden 128, 6 layers, vocabulary 300) and synthetic records (~250 tokens each);
for P in 1, 2, 4 it times, per phase, (a) one step of P packs (dflash_mlx/train/gpu: one target
pass, one draft forward and backward, one optimizer step) and (b) the old way, P passes of one
pack each with gradients accumulated, and counts with torch's profiler the target and draft
forwards and the matrix products each runs. Writes summary.json and README.md.
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dflash_mlx" / "train" / "gpu"))
import train_torch as T  # noqa: E402

loop = sys.modules[f"{T.PACKAGE}.loop"]
Loss = sys.modules[f"{T.PACKAGE}.loss"].Loss


def tiny_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      max_position_embeddings=2048, eos_token_id=257)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def records(n, rng):
    return [{"id": f"r{i}", "prompt": [rng.randrange(256) for _ in range(rng.randrange(30, 80))],
             "response": [rng.randrange(40, 200) for _ in range(rng.randrange(120, 260))]} for i in range(n)]


def make_run(model, recs, P, seq_len):
    args = argparse.Namespace(layers=2, block_size=8, seq_len=seq_len, packs_per_step=P, feature_batch_tokens=0,
                              gamma=7.0, lr=5e-4, weight_decay=0.01, grad_clip=1.0)
    taps, copy = T.recipe_taps(6, 2)
    vocab = T.build_vocab(recs, 128, 300, always=[257])
    scale = T.feature_scale(model, recs, taps, torch.device("cpu"))
    draft = T.build_draft(model, model.config, args, taps, copy, 299, vocab, scale, recs[0]["prompt"], torch.device("cpu"))
    opt, params = loop.make_optimizer(draft, args, torch.device("cpu"))
    anchors = T.anchors_per_pack(recs, seq_len, 16)
    return loop.Run(args, model, draft, opt, params, Loss("eager"), T.DataOrder(recs, seq_len, 0),
                    T.Schedule(5e-4, 1, 100), T.Budget(None), taps, torch.from_numpy(scale), anchors,
                    torch.device("cpu"), torch.float32, {}, None)


def one_step(run, step_packs, batched):
    """Phase times (s) and supervised tokens of one optimizer step over `step_packs`."""
    t = {"batch": 0.0, "forward_backward": 0.0, "optimizer": 0.0}
    run.opt.zero_grad(set_to_none=True)
    groups = [step_packs] if batched else [[p] for p in step_packs]
    sup = 0
    for g in groups:
        P = run.args.packs_per_step
        run.args.packs_per_step = len(g)
        t0 = time.perf_counter()
        b = loop.batch_for(run, g)
        t1 = time.perf_counter()
        loss, m = loop.forward(run, b, run.loss.config)
        (loss / len(groups)).backward()
        t2 = time.perf_counter()
        run.args.packs_per_step = P
        t["batch"] += t1 - t0
        t["forward_backward"] += t2 - t1
        sup += int(m["full_acc_total"])
    t0 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(run.params, 1.0)
    run.opt.step()
    t["optimizer"] = time.perf_counter() - t0
    return t, sup


def counts(run, step_packs, batched):
    """Target forwards, draft forwards and aten::mm/addmm/bmm calls in one step (torch profiler)."""
    calls = {"target": 0, "draft": 0}
    h1 = run.model.model.register_forward_hook(lambda *a: calls.__setitem__("target", calls["target"] + 1))
    h2 = run.draft.register_forward_hook(lambda *a: calls.__setitem__("draft", calls["draft"] + 1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        one_step(run, step_packs, batched)
    h1.remove()
    h2.remove()
    mm = sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
    return {**calls, "matmul_calls": mm}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    a = p.parse_args()
    rng = random.Random(0)
    recs = records(160, rng)
    rows = []
    model = tiny_target()
    for P in (1, 2, 4):
        for batched in ((True,) if P == 1 else (True, False)):
            run = make_run(model, recs, P, a.seq_len)
            one_step(run, run.order.take(P), batched)  # warm-up
            times, sups = [], []
            for _ in range(a.steps):
                t, s = one_step(run, run.order.take(P), batched)
                times.append(t)
                sups.append(s / sum(t.values()))
            med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731 - a shared machine: the median step
            row = {"packs_per_step": P, "mode": "one step of P packs" if batched else "P packs one at a time",
                   "ms_per_step": {k: round(1000 * med([t[k] for t in times]), 1) for k in times[0]},
                   "supervised_tok_s": round(med(sups)), "per_step": counts(run, run.order.take(P), batched)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "seq_len": a.seq_len,
            "steps": a.steps, "rows": rows}
    (out / "summary.json").write_text(json.dumps(info, indent=2) + "\n")
    lines = ["| packs a step | how | target passes | draft forwards | matmul calls | batch ms | fwd+bwd ms | "
             "optimizer ms | supervised tok/s |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c, ms = r["per_step"], r["ms_per_step"]
        lines.append(f"| {r['packs_per_step']} | {r['mode']} | {c['target']} | {c['draft']} | {c['matmul_calls']} | "
                     f"{ms['batch']} | {ms['forward_backward']} | {ms['optimizer']} | {r['supervised_tok_s']} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
