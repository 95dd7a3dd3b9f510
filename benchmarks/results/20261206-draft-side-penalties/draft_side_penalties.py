import sys, time
import dflash_mlx
import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors
from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.engine import drafter as D
from dflash_mlx.bench.suites import load_suite, format_prompt

mode = sys.argv[1]
BS = "auto" if sys.argv[2] == "auto" else int(sys.argv[2])
PEN = dict(repetition_penalty=1.1)
PROCS = make_logits_processors(**PEN)
orig = D.DraftContext.draft_logits
T2D = None

def patched(self, last, width):
    logits = orig(self, last, width)
    hist = mx.concatenate([mx.array(list(self.state.tokens), dtype=mx.int32), last.astype(mx.int32).reshape(-1)])
    global T2D
    if T2D is None:
        import numpy as np
        ids = np.array(self.draft.vocab_ids)
        t2d = np.full(49152, -1, dtype=np.int32); t2d[ids] = np.arange(len(ids))
        T2D = t2d
    import numpy as np
    hn = T2D[np.array(hist)]
    hist = mx.array(hn[hn >= 0])
    if mode == "stale":
        x = logits[0]
        for p in PROCS:
            x = p(hist, x)
        return x[None]
    if mode == "seq":
        rows, h = [], hist
        for i in range(logits.shape[1]):
            r = logits[0, i:i + 1]
            for p in PROCS:
                r = p(h, r)
            rows.append(r)
            h = mx.concatenate([h, mx.argmax(r, axis=-1).astype(mx.int32)])
        return mx.concatenate(rows)[None]
    return logits

D.DraftContext.draft_logits = patched
model, tok = load("smollm2-135m")
draft = load_draft("smollm2-135m", model)
prompts = load_suite("gsm8k", 4) + load_suite("humaneval", 3) + load_suite("mtbench", 3)
accepts, toks, secs, outs = [], 0, 0.0, []
for pr in prompts:
    text = format_prompt(tok, pr)
    t = time.perf_counter(); out = []
    for r in stream_generate(model, draft, tok, text, max_tokens=128, block_size=BS, **PEN):
        out += r.tokens
        last = r
    secs += time.perf_counter() - t - last.prompt_time
    accepts += last.accept_lengths
    toks += len(out); outs.append(out)
import hashlib, json
print(mode, "tau", round(1 + sum(accepts) / len(accepts), 3), "tok/s", round(toks / secs, 2),
      "hash", hashlib.md5(json.dumps(outs).encode()).hexdigest()[:10])
