import contextlib
import sys
import time
sys.path.insert(0, "/work/main/benchmarks/gpu")
import dflash_mlx
import mlx.core as mx
import parts
from unittest import mock
from dflash_mlx.models.target import adapter, taps
from dflash_mlx.engine import cycle
L = int(sys.argv[1]); N = 256 if L < 8 else 128
model = parts.build(dict(parts.TINY, num_hidden_layers=L), mx.float32)
tok = parts.tokenizer_for(parts.TINY["vocab_size"])
prompt = list(range(10, 42))
ref = parts.greedy_reference(model, prompt, N + 16)
real = adapter.submit_layers
res = {}
for rep in range(int(sys.argv[2])):
    for v in (("all", "verify") if rep % 2 else ("verify", "all")):
        # "all": a plain forward with nothing to tap is cut into pieces too (needs the temporary edit of
        # `Target._forward`'s fast path described in README.md); "verify": as built
        pieces = real if v == "all" else (lambda t: frozenset())
        with mock.patch.object(adapter, "submit_layers", pieces):
            for mode in ("ahead", "read_first"):
                read_first = mock.patch.object(cycle, "before_reading", lambda *a: False)
                with read_first if mode == "read_first" else contextlib.nullcontext():
                    out, secs, acc = parts.decode(model, None, tok, prompt, N, 1, baseline=True)
                assert out[:N] == ref[:N]
                res.setdefault(f"{mode} {v}", []).append(1000 * secs / (len(acc) - 1))
for k, v in sorted(res.items()):
    v2 = sorted(v)
    print(f"{k:18s} best {v2[0]:.3f} median {v2[len(v2)//2]:.3f}")
