"""The measurements of the GPU check (`check.py`), one function a part; each returns a dict.

  ops          per-op row invariance: does row i of a k-row product equal the 1-row product?
  exactness    (a) first divergences of DFlash's greedy output from mlx-lm's, per 1,000 tokens
  shapes       (c) big random 4-bit targets: verify cost t(k)/t(1), speed-up at scripted tau
  host         (d) time a cycle spends outside the forwards, on a target whose compute is nil
  smollm2      (b) the packaged SmolLM2 + shipped draft against plain decoding and z-lab's engine
"""

import contextlib
import os
import random
import time
from typing import Dict, List, Sequence
from unittest import mock

import dflash_mlx  # noqa: F401  (before mlx.core)
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dflash_mlx import stream_generate
from dflash_mlx.testing.targets import ScriptedDraft, greedy_reference

# -- models -------------------------------------------------------------------------------------

MID = dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=8, intermediate_size=2816,
           num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=32000, rms_norm_eps=1e-6,
           rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=False)
QWEN3_8B = dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, intermediate_size=6144,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                     mlp_only_layers=[], norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6,
                     max_position_embeddings=40960, tie_word_embeddings=False)
TINY = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, rms_norm_eps=1e-6, rope_theta=1e4,
            max_position_embeddings=4096, tie_word_embeddings=False)


def build(cfg: dict, dtype, bits=None, seed: int = 0):
    """mlx-lm's model for `cfg`, random weights (embedding x4 for varied greedy output), in `dtype`,
    affine-quantized to `bits` (group 64) when given; evaluated layer by layer (big MoEs fit)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(dict(cfg))
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(dict(cfg)))
    model.set_dtype(dtype)
    emb = model.model.embed_tokens
    emb.weight = (emb.weight * 4).astype(dtype)
    for layer in model.model.layers:
        if bits:
            nn.quantize(layer, group_size=64, bits=bits)
        mx.eval(layer.parameters())
    if bits:
        nn.quantize(model, group_size=64, bits=bits, class_predicate=lambda p, m: p == "lm_head")
    mx.eval(model.parameters())
    model.eval()
    return model


def tokenizer_for(vocab_size: int):
    """A word-level tokenizer over `vocab_size` ids (t0, t1, ...): random targets' text is never read.
    It detokenizes as the byte-level BPE tokenizers of real models do (mlx-lm's
    `BPEStreamingDetokenizer`, a constant cost a token), not with mlx-lm's naive fallback, which
    decodes the whole line again every token and, on text with no newline, costs more the longer
    the answer (0.1-0.2 ms a token by 256 tokens)."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.decoder = decoders.ByteLevel()
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{vocab_size - 1}"),
                            detokenizer_class=BPEStreamingDetokenizer)


class OracleDraft(ScriptedDraft):
    """`ScriptedDraft` for any vocabulary, on the device: it proposes `reference` (right for the
    first `right(c)` positions of its c-th proposal, wrong after) as one-hot logits built on the
    GPU, not copied from the host."""

    def __init__(self, model, reference: Sequence[int], vocab_size: int, right, block_size: int = 16):
        super().__init__(target_of(model), list(reference) + [0] * 64, right, block_size)
        self.vocab_size = vocab_size

    def propose_logits(self, last_token, features, cache, block_size):
        self.inject(features, cache)
        p, n = cache[0].offset, block_size - 1
        right = self.wrong_from(self.cycle)
        self.cycle += 1
        ids = [self.reference[p + 1 + i] if i < right else (self.reference[p + 1 + i] + 1) % self.vocab_size
               for i in range(n)]
        hot = mx.arange(self.vocab_size)[None, None, :] == mx.array(ids)[None, :, None]
        return mx.where(hot, 0.0, -1e4).astype(mx.float32)


_TARGETS = {}


def target_of(model):
    """One `Target` a model (its construction probes a forward)."""
    from dflash_mlx.models.target.adapter import Target

    if id(model) not in _TARGETS:
        _TARGETS[id(model)] = (model, Target(model))
    return _TARGETS[id(model)][1]


def default_dtype():
    """bfloat16 on a GPU, float32 on the CPU (where bf16 matmuls are the slow path)."""
    return mx.bfloat16 if mx.default_device().type == mx.DeviceType.gpu else mx.float32


def sync():
    mx.synchronize() if hasattr(mx, "synchronize") else mx.eval(mx.zeros(1))


def best_call_seconds(fn, iters: int, reps: int, warm: int = 0) -> float:
    """Seconds one call of `fn` takes, its output evaluated: the best of `reps` runs of `iters` calls,
    after `warm` calls not timed."""
    for _ in range(warm):
        mx.eval(fn())
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters):
            mx.eval(fn())
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def decode(model, draft, tok, prompt, max_tokens, width, deterministic=False, baseline=False, **kwargs):
    """(tokens, seconds from the first token to the last, accept lengths) of one greedy answer
    (`kwargs`: more of `stream_generate`'s)."""
    out, first_at, last = [], None, None
    for last in stream_generate(model, draft, tok, prompt, max_tokens=max_tokens, block_size=width,
                                stop_token_ids=[], deterministic=deterministic, baseline=baseline, **kwargs):
        out += last.tokens
        if first_at is None:
            first_at = time.perf_counter()
    return out, time.perf_counter() - first_at, last.accept_lengths


def first_divergence(out: List[int], ref: List[int]):
    return next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)


# -- parts ----------------------------------------------------------------------------------------

def ops(ks=(2, 4, 16), H: int = 2048, N: int = 4096) -> Dict:
    """For each dtype: whether row i of a k-row op equals the same row alone (bitwise), and the
    largest difference, for the products a verify widens: linear, quantized linear, attention."""
    out = {}
    mx.random.seed(0)
    for name, dtype, bits in (("bfloat16", mx.bfloat16, None), ("float16", mx.float16, None),
                              ("float32", mx.float32, None), ("4-bit", mx.bfloat16, 4), ("8-bit", mx.bfloat16, 8)):
        layer = nn.Linear(H, N, bias=False)
        layer.set_dtype(dtype)
        if bits:
            layer = nn.QuantizedLinear.from_linear(layer, group_size=64, bits=bits)
        x = mx.random.normal((1, 16, H)).astype(dtype)
        row = {}
        for k in ks:
            wide = layer(x[:, :k])
            alone = mx.concatenate([layer(x[:, i : i + 1]) for i in range(k)], axis=1)
            batched = layer(x[:, :k].reshape(k, 1, H)).reshape(1, k, N)  # rows as a batch of 1-row products
            mx.eval(wide, alone, batched)
            row[k] = dict(equal=bool(mx.array_equal(wide, alone).item()),
                          max_diff=float(mx.abs(wide.astype(mx.float32) - alone.astype(mx.float32)).max().item()),
                          batch_equal=bool(mx.array_equal(batched, alone).item()))
        out[f"linear {name}"] = row
    for name, dtype in (("bfloat16", mx.bfloat16), ("float16", mx.float16)):
        q = mx.random.normal((1, 8, 16, 128)).astype(dtype)
        kv = mx.random.normal((1, 2, 512 + 16, 128)).astype(dtype)
        row = {}
        for k in ks:
            mask = mx.arange(512 + k)[None, :] <= (512 + mx.arange(k))[:, None]
            wide = mx.fast.scaled_dot_product_attention(q[:, :, :k], kv[:, :, : 512 + k], kv[:, :, : 512 + k],
                                                         scale=0.088, mask=mask)
            alone = mx.concatenate([mx.fast.scaled_dot_product_attention(
                q[:, :, i : i + 1], kv[:, :, : 512 + i + 1], kv[:, :, : 512 + i + 1], scale=0.088)
                for i in range(k)], axis=2)
            mx.eval(wide, alone)
            row[k] = dict(equal=bool(mx.array_equal(wide, alone).item()),
                          max_diff=float(mx.abs(wide.astype(mx.float32) - alone.astype(mx.float32)).max().item()))
        out[f"attention {name}"] = row
    return out


def exactness(models: Dict[str, tuple], widths=(1, 4, 16, "auto"), prompts: int = 4, tokens: int = 256,
              deadline: float = 1e18, log=print) -> List[Dict]:
    """(a): per model (name -> (model, tokenizer)) and width, DFlash with a draft that proposes
    mlx-lm's own continuation (right for a random 0-15 tokens a cycle) against mlx-lm's greedy
    decode; then deterministic mode. A divergence is the first differing token of an answer."""
    rows = []
    for name, (model, tok) in models.items():
        vocab = model.model.embed_tokens.weight.shape[0] if hasattr(model, "model") else tok.vocab_size
        cases = []
        for p in range(prompts):
            rng = random.Random(p)
            prompt = [rng.randrange(0, min(vocab, 30000)) for _ in range(16 + 48 * p)]
            cases.append((prompt, greedy_reference(model, prompt, tokens)))
        # deterministic mode first (its claim must hold wherever it runs), then with dflash-mlx's CUDA kernels on
        # (qmv_rows, gemv_rows: a verify's projections as decode steps'; the newer question, before the time
        # runs out), then the default
        passes = [(True, False)] + ([(False, True)] if on_cuda() else []) + [(False, False)]
        for deterministic, kernels in passes:
            for width in (widths if not deterministic else [w for w in widths if w != 1]):
                if time.perf_counter() > deadline:
                    log(f"  exactness: out of time before {name} width {width}")
                    return rows
                compared = diverged = 0
                for prompt, ref in cases:
                    rights = [random.Random(len(prompt) + c).randrange(0, 16) for c in range(tokens + 1)]
                    draft = OracleDraft(model, prompt + ref, vocab, lambda c: rights[c])
                    try:
                        with cuda_kernels(kernels):
                            out, _, _ = decode(model, draft, tok, prompt, tokens, width, deterministic=deterministic)
                    except Exception as e:  # a refusal (deterministic mode): one line in the table
                        rows.append(dict(model=name, width=str(width), deterministic=deterministic, error=str(e)))
                        break
                    at = first_divergence(out, ref)
                    compared += len(ref) if at is None else at + 1
                    diverged += at is not None
                else:
                    rows.append(dict(model=name + (", CUDA kernels" if kernels else ""), width=str(width),
                                     deterministic=deterministic, answers=len(cases),
                                     diverged=diverged, tokens=compared,
                                     per_1000=round(1000 * diverged / max(compared, 1), 2)))
                    log(f"  {name} width {width} deterministic={deterministic} kernels={kernels}: {diverged}/{len(cases)} diverged "
                        f"over {compared} tokens")
    return rows


def verify_costs(model, contexts=(128, 2048, 8192), widths=range(1, 17), reps: int = 5) -> Dict:
    """t(k) in ms: one forward of k tokens on a cache holding `context` tokens (restored between reps)."""
    from mlx_lm.models.cache import make_prompt_cache

    vocab = model.model.embed_tokens.weight.shape[0]
    out = {}
    for context in contexts:
        cache = make_prompt_cache(model)
        for s in range(0, context, 2048):
            model(mx.arange(s, min(s + 2048, context))[None] % min(vocab, 1000), cache=cache)
            mx.eval([c.state for c in cache])
        times = {}
        for k in widths:
            tokens = mx.arange(k)[None] + 7
            best = []
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                mx.eval(model(tokens, cache=cache))
                sync()
                best.append(time.perf_counter() - t0)
                for c in cache:
                    c.trim(k)
            times[k] = 1000 * float(np.median(best))
        out[context] = times
    return out


def scripted_speedups(model, tok, taus=(2, 4, 6, 8), tokens: int = 128, prompt_len: int = 128) -> List[Dict]:
    """(c): plain decoding against DFlash with an oracle draft at width tau (every block accepted:
    tau tokens a cycle), both through the engine and mlx-lm's own plain decode."""
    vocab = model.model.embed_tokens.weight.shape[0]
    prompt = [random.Random(1).randrange(0, min(vocab, 30000)) for _ in range(prompt_len)]
    ref = greedy_reference(model, prompt, tokens + 16)
    plain_tokens, plain_s, _ = decode(model, None, tok, prompt, tokens, 1, baseline=True)
    _, plain_s, _ = decode(model, None, tok, prompt, tokens, 1, baseline=True)  # warm
    t0 = time.perf_counter()
    n = 0
    from mlx_lm.generate import generate_step
    for _ in generate_step(mx.array(prompt), model, max_tokens=tokens, sampler=lambda x: mx.argmax(x, axis=-1)):
        n += 1
        if n == 1:
            t0 = time.perf_counter()
    mlx_lm_s = time.perf_counter() - t0
    rows = []
    for tau in taus:
        # one draft: the warm-up teaches the pair's look-ahead that its chains are accepted whole
        draft = OracleDraft(model, prompt + ref, vocab, lambda c: 10**9, block_size=tau)
        decode(model, draft, tok, prompt, tokens, tau)  # warm
        out, secs, accepts = decode(model, draft, tok, prompt, tokens, tau)
        with no_guess():
            _, secs_no_guess, _ = decode(model, draft, tok, prompt, tokens, tau)
        with whole_graph():  # (its tokens too: where a graph is cut must change no value on this backend)
            out_whole, secs_whole_graph, _ = decode(model, draft, tok, prompt, tokens, tau)
        with pieces(4):  # (where a command buffer's commit costs, fewer pieces may pay better)
            out_every_4, secs_every_4, _ = decode(model, draft, tok, prompt, tokens, tau)
        kernels = {}
        if on_cuda():  # the CUDA kernels for the verify's projections: speed, and its tokens
            with cuda_kernels():
                decode(model, draft, tok, prompt, tokens, tau)  # warm: the kernel compiles per variant
                out_kernels, secs_kernels, _ = decode(model, draft, tok, prompt, tokens, tau)
            kernels = dict(speedup_cuda_kernels=round(plain_s / secs_kernels, 3),
                           exact_cuda_kernels=out_kernels == ref[: len(out_kernels)])
        rows.append(dict(tau=tau, width=tau, measured_tau=round(float(np.mean([a + 1 for a in accepts])), 2),
                         exact=out == ref[: len(out)] == out_whole == out_every_4, seconds=secs, plain_seconds=plain_s,
                         mlx_lm_seconds=mlx_lm_s, speedup=round(plain_s / secs, 3),
                         speedup_vs_mlx_lm=round(mlx_lm_s / secs, 3),
                         speedup_no_guess=round(plain_s / secs_no_guess, 3),
                         speedup_whole_graph=round(plain_s / secs_whole_graph, 3),
                         speedup_every_4_layers=round(plain_s / secs_every_4, 3), **kernels))
    return rows


def no_guess():
    """No cycle's successor queued before its read on a guess (`policy.lookahead`), in this process
    while inside: what the guess buys."""
    from dflash_mlx.policy.lookahead import LookAhead

    return mock.patch.object(LookAhead, "pays", lambda self, width: False)


def pieces(every: int):
    """Every forward's graph queued every `every` layers while the host builds the rest (0: whole;
    `models.target.taps.SUBMIT_EVERY`, 1 by default), in this process while inside."""
    from dflash_mlx.models.target import taps

    return mock.patch.object(taps, "SUBMIT_EVERY", every)


def on_cuda() -> bool:
    from dflash_mlx.kernels import selection

    return selection.on_cuda()


def cuda_kernels(on: bool = True):
    """dflash-mlx's CUDA kernels on (`DFLASH_MLX_KERNELS=cuda`: qmv_rows and gemv_rows for a verify's
    projections), in this process while inside; `on` False: nothing changed."""
    return mock.patch.dict(os.environ, {"DFLASH_MLX_KERNELS": "cuda"}) if on else contextlib.nullcontext()


def whole_graph():
    """Every forward's graph queued whole, not a layer at a time: what the pieces buy."""
    return pieces(0)


def host(widths=(1, 2, 4, 8, 16), tokens: int = 256, reps: int = 3, layers: int = 2) -> Dict:
    """(d): the CPU oracle probe on this device: a target whose compute is nil (`TINY`, with `layers`
    decoder layers), every block accepted; mlx-lm's plain step against the engine's plain step and its cycles."""
    from mlx_lm.generate import generate_step

    model = build(dict(TINY, num_hidden_layers=layers), default_dtype())
    tok = tokenizer_for(TINY["vocab_size"])
    prompt = list(range(10, 42))
    ref = greedy_reference(model, prompt, tokens + 16)
    best = {}

    def mlx_lm_step():
        t0, n = None, 0
        for _ in generate_step(mx.array(prompt), model, max_tokens=tokens, sampler=lambda x: mx.argmax(x, axis=-1)):
            n += 1
            if n == 1:
                t0 = time.perf_counter()
        return (time.perf_counter() - t0) / (n - 1)

    best["mlx_lm_step_ms"] = 1000 * min(mlx_lm_step() for _ in range(reps))
    plain = lambda: 1000 * decode(model, None, tok, prompt, tokens, 1, baseline=True)[1] / (tokens - 1)  # noqa: E731
    best["engine_plain_step_ms"] = min(plain() for _ in range(reps))
    # the same with each plain step queued only after the host has read the last (`ahead.before_reading`
    # off): what mlx-lm's pipelining of plain steps buys on this device
    from dflash_mlx.engine import cycle

    with mock.patch.object(cycle, "before_reading", lambda *args: False):  # this process only
        best["engine_plain_step_read_first_ms"] = min(plain() for _ in range(reps))
    best["cycles"] = {w: dict(cycle_ms=ms, speedup=round(best["mlx_lm_step_ms"] * w / ms, 2))
                      for w, ms in oracle_cycles(model, tok, prompt, ref, widths, tokens, reps).items()}
    with no_guess():
        for w, ms in oracle_cycles(model, tok, prompt, ref, widths, tokens, reps).items():
            best["cycles"][w]["cycle_ms_no_guess"] = ms
    with whole_graph():
        for w, ms in oracle_cycles(model, tok, prompt, ref, widths, tokens, reps).items():
            best["cycles"][w]["cycle_ms_whole_graph"] = ms
    best["ceiling"] = compute_ceiling(model, widths, len(prompt), tokens)
    for w, c in best["cycles"].items():
        c["efficiency"] = round(c["speedup"] / best["ceiling"]["ideal"][w], 3)
    best["host_calls"] = host_calls(model, tok, prompt, ref, widths, min(tokens, 64))
    return best


def compute_ceiling(model, widths, prompt_len: int, tokens: int, points: int = 4, reps: int = 9) -> Dict:
    """What the forwards alone allow: t(k), the target's forward of k tokens, averaged over the
    contexts a decode of `tokens` passes through, and the ideal speed of width w against plain
    steps, w * t(1) / t(w). "Compute is nil" holds only where t(w) = t(1); on MLX's CPU backend the
    attention's softmax (a scalar exp, ~15 ns an element) makes a 16-row verify cost more."""
    contexts = [prompt_len + int(tokens * (i + 0.5) / points) for i in range(points)]
    costs = verify_costs(model, contexts=contexts, widths=sorted(set(widths) | {1}), reps=reps)
    mean = {w: float(np.mean([costs[c][w] for c in contexts])) for w in widths}
    return dict(contexts=contexts, verify_ms={w: round(t, 4) for w, t in mean.items()},
                ideal={w: round(w * mean[1] / mean[w], 2) for w in widths})


def oracle_cycles(model, tok, prompt, ref, widths, tokens: int, reps: int) -> Dict[int, float]:
    """ms a cycle at each width, best of `reps`, with an oracle draft (every block accepted). One draft a
    width for all its reps: what the pair's policies learn (`policy.lookahead`) carries over from one
    answer to the next, as in a chat or a server."""
    cycles = {}
    for w in widths:
        times = []
        draft = OracleDraft(model, prompt + ref, model.args.vocab_size, lambda c: 10**9, block_size=w)
        for _ in range(reps):
            _, secs, accepts = decode(model, draft, tok, prompt, tokens, w)
            times.append(secs / max(len(accepts) - 1, 1))
        cycles[w] = 1000 * min(times)
    return cycles


# The calls through which the host waits for the device: evaluations, and reads of an array's
# values (a read of an array not yet evaluated evaluates it and waits; of one evaluated, it only copies).
WAITS = ("eval", "item", "tolist")


def host_calls(model, tok, prompt, ref, widths, tokens: int) -> Dict:
    """Per step of mlx-lm's plain decode and per cycle of the engine at each width (oracle draft,
    every block accepted): how many times the host calls `mx.eval`, `mx.async_eval` and an
    array's `item`/`tolist`. Counted through wrappers put on those four for the count only and
    taken off after (MLX's functions are not Python functions: no profile hook sees them); no
    timing here. `syncs`: the evaluations, plus reads where no evaluation came first in the step."""
    from mlx_lm.generate import generate_step

    def counted(run):
        calls = []
        owners = [(mx, "eval"), (mx, "async_eval"), (mx.array, "item"), (mx.array, "tolist")]
        originals = [getattr(owner, name) for owner, name in owners]

        def wrapper(name, original):
            def call(*args, **kwargs):
                calls.append(name)
                return original(*args, **kwargs)
            return call

        marks = []
        for (owner, name), original in zip(owners, originals):
            setattr(owner, name, wrapper(name, original))
        try:
            for _ in run():
                marks.append(len(calls))
        finally:
            for (owner, name), original in zip(owners, originals):
                setattr(owner, name, original)
        steps = [calls[a:b] for a, b in zip(marks[1:], marks[2:])]  # past the prefill and first token
        return _per_step(steps)

    def lm():
        return generate_step(mx.array(prompt), model, max_tokens=tokens, sampler=lambda x: mx.argmax(x, axis=-1))

    def engine(w):
        draft = None if w == 1 else OracleDraft(model, prompt + ref, model.args.vocab_size, lambda c: 10**9,
                                                block_size=w)
        return stream_generate(model, draft, tok, prompt, max_tokens=tokens, block_size=w, stop_token_ids=[],
                               baseline=w == 1)

    return {"mlx_lm_step": counted(lm), **{w: counted(lambda w=w: engine(w)) for w in widths}}


def _per_step(steps: List[List[str]]) -> Dict:
    """Mean calls of each kind a step, and the syncs: an `eval`, or a read with no `eval` before it
    in its step (that read evaluates what it reads)."""
    n = max(len(steps), 1)
    out = {name: round(sum(s.count(name) for s in steps) / n, 2) for name in WAITS + ("async_eval",)}
    syncs = 0
    for s in steps:
        evaluated = False
        for name in s:
            if name == "eval":
                syncs, evaluated = syncs + 1, True
            elif name in ("item", "tolist") and not evaluated:
                syncs, evaluated = syncs + 1, True
    out["syncs"] = round(syncs / n, 2)
    return out
