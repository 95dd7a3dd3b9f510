"""Deterministic mode (`models/target/exact_rows.py`): every target row runs in the shapes plain
decoding gives it, so greedy DFlash equals mlx-lm's greedy decode token for token in every dtype,
whatever the backend's kernels do with wider products. Here on the default device (the CPU in CI,
a GPU where MLX has one), in float32 and bfloat16; targets it cannot run so are refused in one line.
"""

import random
from contextlib import contextmanager

import mlx.core as mx
import pytest

from dflash_mlx import stream_generate
from dflash_mlx.engine.engine import BatchEngine
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.engine.cycle import prefill_bounds
from dflash_mlx.models.target.exact_rows import MLX_LM_PREFILL_STEP
from dflash_mlx.models.target.rollback import UnsupportedTargetError
from dflash_mlx.testing.targets import (EOS_ID, ScriptedDraft, byte_tokenizer, clean_case, greedy_reference,
                                        tiny_target)

FULL_LLAMA = dict(layer_types=["full_attention"] * 4, sliding_window=None)


def _model(arch, dtype, **overrides):
    model, tok = tiny_target(arch, **overrides)
    if dtype != mx.float32:
        model.set_dtype(dtype)
        mx.eval(model.parameters())
    return model, tok


def _decode(model, draft, tok, prompt, width, max_tokens, stops=()):
    out, accepts = [], []
    for r in stream_generate(model, draft, tok, prompt, max_tokens=max_tokens, block_size=width,
                             stop_token_ids=list(stops), deterministic=True):
        out += r.tokens
        accepts = r.accept_lengths
    return out, accepts

@contextmanager
def rows_seen(target):
    """The row count of every forward through the target's first layer, while in the block."""
    seen, layer = [], target.layers[0]

    class Spy:
        def __call__(self, x, *args, **kwargs):
            seen.append(x.shape[1])
            return layer(x, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(layer, name)

    target.layers[0] = Spy()
    try:
        yield seen
    finally:
        target.layers[0] = layer



@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch,overrides", [("qwen3", {}), ("llama", FULL_LLAMA), ("llama", {}), ("gemma3_text", {})],
                         ids=["qwen3", "llama", "llama-sliding", "gemma3"])
def test_deterministic_greedy_is_mlx_lm_greedy(arch, overrides, dtype):
    model, tok = _model(arch, dtype, **overrides)
    for length in (1, 33):  # one token; past the tiny configs' windows (16, 24)
        rng = random.Random(length)
        prompt = [rng.randrange(0, 256) for _ in range(length)]
        ref = greedy_reference(model, prompt, 24)
        target = Target(model)
        # a scripted draft right for a random number of tokens each cycle: rows are accepted,
        # their cache entries kept, and rejected rows rolled back
        rng_right = random.Random(length + 1)
        right = [rng_right.randrange(0, 8) for _ in range(100)]
        for width in (4, "draft"):
            draft = ScriptedDraft(target, prompt + ref, lambda c: right[c], block_size=8)
            out, accepts = _decode(model, draft, tok, prompt, width, len(ref))
            assert out == ref, (arch, length, width)
            assert max(accepts) > 1, "the scripted draft should have been accepted in places"
        for width in (1, "auto"):
            out, _ = _decode(model, random_draft(model, num_layers=1, block_size=8, seed=3), tok, prompt, width,
                             len(ref))
            assert out == ref, (arch, length, width)


@pytest.mark.parametrize("arch,overrides", [("qwen3", {}), ("llama", FULL_LLAMA)], ids=["qwen3", "llama"])
def test_deterministic_greedy_with_chains_queued_on_a_guess(arch, overrides, monkeypatch):
    """Every drafted chain's successor queued before its read on the guess that it is accepted whole
    (forced on; `policy.lookahead`), the guess right (an oracle draft) or often wrong: mlx-lm's greedy
    tokens in bfloat16, deterministic mode (on a GPU too: `benchmarks/gpu/run.sh` runs this file)."""
    from dflash_mlx.engine import ahead
    from dflash_mlx.engine import cycle as cycle_mod
    from dflash_mlx.policy.lookahead import LookAhead

    monkeypatch.setattr(LookAhead, "pays", lambda self, width: width > 1)
    monkeypatch.setattr(ahead, "BEFORE_READING_ON_CPU", True)
    guesses = []
    before = cycle_mod.before_reading

    def counting(ctx, launched, *args):  # (the chains queued on a guess)
        early = before(ctx, launched, *args)
        guesses.append(early and launched.width > 1)
        return early

    monkeypatch.setattr(cycle_mod, "before_reading", counting)
    model, tok = _model(arch, mx.bfloat16, **overrides)
    prompt = list(range(30, 63))
    ref = greedy_reference(model, prompt, 40)
    right = [random.Random(c).randrange(0, 8) for c in range(100)]
    for wrong_from in (lambda c: right[c], lambda c: 10**9):
        guesses.clear()
        draft = ScriptedDraft(Target(model), prompt + ref + [0] * 16, wrong_from, block_size=4)
        out, _ = _decode(model, draft, tok, prompt, 4, len(ref))
        assert out == ref and sum(guesses) >= 5, arch


def test_deterministic_stops_where_plain_decoding_stops():
    model, tok = _model("qwen3", mx.bfloat16)
    prompt = list(range(40, 60))
    ref = greedy_reference(model, prompt, 20)
    stop = ref[7]
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: 10**9, block_size=8)
    out, _ = _decode(model, draft, tok, prompt, "draft", 20, stops=[stop])
    assert out == ref[: ref.index(stop) + 1]


def test_a_deterministic_verify_runs_one_token_forwards():
    model, tok = _model("qwen3", mx.float32)
    target = Target(model)
    prompt = list(range(30, 50))
    ref = greedy_reference(model, prompt, 16)
    draft = ScriptedDraft(target, prompt + ref, lambda c: 10**9, block_size=8)
    with rows_seen(target) as seen:
        out, accepts = _decode(model, draft, tok, prompt, "draft", 16)
    assert out == ref and max(accepts) == 7
    # the prompt as mlx-lm runs it (all but the last token, then the last alone), then single rows
    assert seen[:2] == [len(prompt) - 1, 1] and set(seen[2:]) == {1}


def test_prefill_bounds_follow_mlx_lm():
    n = MLX_LM_PREFILL_STEP + 52
    assert prefill_bounds(n, 512, True) == [(0, MLX_LM_PREFILL_STEP), (MLX_LM_PREFILL_STEP, n - 1), (n - 1, n)]
    assert prefill_bounds(1, 512, True) == [(0, 1)]
    # every mode runs the last prompt token alone, as mlx-lm does
    assert prefill_bounds(1100, 512, False) == [(0, 512), (512, 1024), (1024, 1099), (1099, 1100)]
    assert prefill_bounds(1025, 512, False) == [(0, 512), (512, 1024), (1024, 1025)]


@pytest.mark.parametrize("key,dtype", [(key, mx.float32) for key in ("qwen3_5", "jamba", "rwkv7", "recurrent_gemma",
                                                                     "deepseek_v41")]
                         # (MoE layers run bfloat16 on a GPU only: MLX's CPU GatherMM takes float32)
                         + [(key, mx.bfloat16) for key in ("qwen3_5", "rwkv7", "recurrent_gemma")])
def test_deterministic_mode_puts_recurrent_state_back_as_the_last_kept_row_left_it(key, dtype):
    """Gated DeltaNet (qwen3_5), Mamba beside attention (jamba), RWKV-7, a recurrent layer beside
    a sliding window (recurrent_gemma), DeepSeek V4.1's compressed groups: each row's state is
    kept, and a rollback puts back the last kept row's (until 2026-12-05 refused)."""
    from dflash_mlx.testing import arch_check

    model = arch_check.build(key)
    if dtype != mx.float32:
        model.set_dtype(dtype)
        mx.eval(model.parameters())
    tok = byte_tokenizer()
    for length in (1, 9):
        prompt, ref = clean_case(model, length, 20, seed=length)  # (no EOS: the engine would stop there)
        right = [random.Random(length + c).randrange(0, 8) for c in range(100)]
        draft = ScriptedDraft(Target(model), prompt + ref, lambda c: right[c], block_size=8)
        out, accepts = _decode(model, draft, tok, prompt, "draft", len(ref))
        assert out == ref, (key, length)
        assert max(accepts) > 1 and min(accepts) < 7, "partial accepts: rows kept and rows rolled back"


def test_targets_deterministic_mode_cannot_run_are_refused_in_one_line():
    from dflash_mlx.models.target.exact_rows import refusal

    class Split:  # what a target split over processes looks like to the refusal
        name, sharding = "qwen3", object()

    assert "split over processes" in refusal(Split())
    model, tok = _model("qwen3", mx.float32)
    target = Target(model)
    target.deterministic = True
    with pytest.raises(UnsupportedTargetError, match="not trees or batches") as e:
        target.forward(mx.array([[1, 2, 3], [4, 5, 6]]), target.make_cache(), record=True)
    assert "\n" not in str(e.value)


def test_a_deterministic_rollback_restores_a_full_sliding_window():
    """Past its window a rotating cache's one-token updates overwrite its oldest entries:
    the rows' rollback puts them back, so rejected rows leave no trace."""
    model, tok = _model("llama", mx.float32, sliding_window=6)
    prompt = list(range(60, 100))
    ref = greedy_reference(model, prompt, 30)
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: c % 5, block_size=8)
    out, accepts = _decode(model, draft, tok, prompt, "draft", 30)
    assert out == ref and 0 in accepts and max(accepts) >= 3


def test_a_deterministic_target_is_not_batched():
    model, tok = _model("qwen3", mx.float32)
    target = Target(model)
    target.deterministic = True
    with pytest.raises(UnsupportedTargetError, match="one sequence"):
        BatchEngine(model, None, tok, max_batch=4, target=target)
    target.deterministic = False
    BatchEngine(model, None, tok, max_batch=4, target=target)


@pytest.mark.skipif(mx.default_device().type != mx.DeviceType.cpu,
                    reason="GPU kernels round 1-row and k-row products differently: there deterministic mode holds")
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_bfloat16_greedy_takes_mlx_lm_argmax_of_log_probabilities(arch):
    """Not deterministic mode: mlx-lm's greedy token is the argmax of logits - logsumexp in the
    logits' dtype; in bfloat16 that rounding merges neighbours, and the first of them wins.
    With the argmax of the raw logits, 6 of these 30 decodes differed from mlx-lm's."""
    model, tok = _model(arch, mx.bfloat16)
    for length in (1, 5, 9, 17, 33):
        rng = random.Random(length)
        prompt = [rng.randrange(0, 256) for _ in range(length)]
        ref = greedy_reference(model, prompt, 24)
        right = [random.Random(length + c).randrange(0, 8) for c in range(100)]
        for width in (4, "draft"):
            draft = ScriptedDraft(Target(model), prompt + ref, lambda c: right[c], block_size=8)
            out = []
            for r in stream_generate(model, draft, tok, prompt, max_tokens=24, block_size=width, stop_token_ids=[]):
                out += r.tokens
            assert out == ref, (arch, length, width)


def test_the_server_in_deterministic_mode_answers_one_request_at_a_time_as_mlx_lm():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_server import serving

    model, tok = _model("qwen3", mx.bfloat16)
    draft = random_draft(model, num_layers=1, block_size=8, seed=3)
    with serving(model, draft, tok, max_batch=4, deterministic=True) as s:
        assert s.worker.max_batch == 1 and "one request at a time" in s.worker.scheduling
        prompt = "tell me something"
        ids = tok.encode(prompt, add_special_tokens=False)
        r = s.client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0.0)
        assert r.usage.completion_tokens == 16
        got = tok.encode(r.choices[0].text, add_special_tokens=False)
        assert got == greedy_reference(model, ids, 16)


def test_the_server_takes_deterministic_mode_for_a_recurrent_target():
    from dflash_mlx.serve.worker import Worker

    model, tok = _model("qwen3_5", mx.float32)
    worker = Worker(model, None, tok, model_name="tiny", deterministic=True)
    assert worker.max_batch == 1


def test_every_mode_runs_the_last_prompt_token_alone_as_mlx_lm_does():
    """The first token's logits and the last prompt token's cache entry come from a one-row
    forward, as in mlx-lm's generate_step, also outside deterministic mode."""
    model, tok = _model("qwen3", mx.float32)
    target = Target(model)
    prompt = list(range(30, 50))
    with rows_seen(target) as seen:
        list(stream_generate(model, ScriptedDraft(target, prompt, lambda c: 0, block_size=8), tok, prompt,
                             max_tokens=1, stop_token_ids=[]))
    assert seen[-2:] == [len(prompt) - 1, 1]  # (forwards before them: the tree probe, once per target)


@pytest.mark.parametrize("key", ["olmo3", "gemma4_text_moe"])
def test_a_stream_closed_with_a_cycle_ahead_leaves_its_sliding_windows_whole(key):
    """A deterministic stream on sliding windows closed while a drafted cycle is launched ahead,
    then a next turn on its prompt cache: the discard puts every window back as the verify found it.
    (It once also restored a window snapshot held by reference, which the verify's one-token updates
    had written into: the next turn parted from mlx-lm at its first token; option fuzz seed 1300126.)"""
    from dflash_mlx.generate import make_prompt_cache
    from dflash_mlx.testing import arch_check

    model = arch_check.build(key)
    rng = random.Random(0)
    prompt = [rng.randrange(3, arch_check.VOCAB) for _ in range(5)]
    draft = random_draft(model, num_layers=1, block_size=16, seed=1)
    cache = make_prompt_cache(model, draft)
    out = []
    stream = stream_generate(model, draft, byte_tokenizer(), prompt, max_tokens=24, block_size=8, stop_token_ids=[],
                             prompt_cache=cache, deterministic=True, token_trees=False, copy_proposals=False)
    for r in stream:
        out += r.tokens
        if len(out) >= 12:
            break
    stream.close()
    assert cache.ahead is not None  # (a cycle was launched ahead, and the next call discards it)
    turn2 = prompt + out + [7, 8, 9, 10]
    want = greedy_reference(model, turn2, 8, stop_ids=[EOS_ID])
    second = [t for r in stream_generate(model, draft, byte_tokenizer(), turn2, max_tokens=8, stop_token_ids=[],
                                         prompt_cache=cache, deterministic=True) for t in r.tokens]
    assert second == want
