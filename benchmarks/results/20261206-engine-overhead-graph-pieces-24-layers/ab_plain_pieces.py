import sys, time
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
        # "all": a plain forward with nothing to tap is cut into pieces too
        with mock.patch.object(adapter, "submit_layers", (lambda t: real(t)) if v == "all" else (lambda t: frozenset())), \
             mock.patch.object(adapter.Target, "_forward", adapter.Target._forward):
            src_flag = v == "all"
            for mode in ("ahead", "read_first"):
                ctx = mock.patch.object(cycle, "before_reading", lambda *a: False) if mode == "read_first" else mock.MagicMock()
                with ctx:
                    out, secs, acc = parts.decode(model, None, tok, prompt, N, 1, baseline=True)
                assert out[:N] == ref[:N]
                res.setdefault(f"{mode} {v}", []).append(1000 * secs / (len(acc) - 1))
for k, v in sorted(res.items()):
    v2 = sorted(v)
    print(f"{k:18s} best {v2[0]:.3f} median {v2[len(v2)//2]:.3f}")
