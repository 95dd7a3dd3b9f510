import sys, time
sys.path.insert(0, "/work/main/benchmarks/gpu")
import dflash_mlx
import mlx.core as mx
import parts
from unittest import mock
from dflash_mlx.models.target import taps
L = int(sys.argv[1]); N = 256
model = parts.build(dict(parts.TINY, num_hidden_layers=L), mx.float32)
tok = parts.tokenizer_for(parts.TINY["vocab_size"])
prompt = list(range(10, 42))
ref = parts.greedy_reference(model, prompt, N + 16)
res = {}
drafts = {W: parts.OracleDraft(model, prompt + ref, model.args.vocab_size, lambda c: 10**9, block_size=W)
          for W in (1, 16)}
for rep in range(int(sys.argv[2])):
    for W in (1, 16):
        for v in (("p1", "whole") if rep % 2 else ("whole", "p1")):
            with mock.patch.object(taps, "SUBMIT_EVERY", 1 if v == "p1" else 0):
                out, secs, acc = parts.decode(model, drafts[W], tok, prompt, N, W)
            res.setdefault(f"w{W} {v}", []).append(1000 * secs / (len(acc) - 1))
for k, v in sorted(res.items()):
    v2 = sorted(v)
    print(f"{k:10s} best {v2[0]:.3f} median {v2[len(v2)//2]:.3f}")
