"""A lone row's next cycle is launched before the host needs it (`engine/ahead.py`): the
tokens stay mlx-lm's, a cycle launched and never landed leaves the caches whole (an answer
broken off, a second row joining the batch), and nothing is launched where a cycle must sync
more than once or cannot be rolled back whole."""

import random

import mlx.core as mx
import pytest

import dflash_mlx.engine.ahead as ahead_mod
import dflash_mlx.engine.cycle as cycle_mod
from dflash_mlx.kernels import argmax
from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.engine.engine import BatchEngine
from dflash_mlx.engine.rows import BatchRequest
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.options import GenerationOptions
from dflash_mlx.testing.targets import ScriptedDraft, greedy_reference, tiny_target

FULL = dict(layer_types=["full_attention"] * 4, sliding_window=None)


@pytest.fixture
def launches(monkeypatch):
    """Counts the cycles launched ahead and discarded."""
    counts = {"launched": 0, "discarded": 0, "before_reading": 0}
    real_ahead, real_discard = ahead_mod.ahead, ahead_mod.discard

    def counting_ahead(ctx, *args, **kwargs):
        real_ahead(ctx, *args, **kwargs)
        counts["launched"] += isinstance(ctx.state.ahead, ahead_mod.Launched)

    def counting_discard(target, state):
        counts["discarded"] += isinstance(getattr(state, "ahead", None), ahead_mod.Launched)
        real_discard(target, state)

    real_before = ahead_mod.before_reading

    def counting_before(*args):
        early = real_before(*args)
        counts["before_reading"] += early
        return early

    monkeypatch.setattr(cycle_mod, "ahead", counting_ahead)
    monkeypatch.setattr(cycle_mod, "before_reading", counting_before)
    # plain steps queued before their token is read, and the exact argmax: the GPU's path, run here on the CPU
    monkeypatch.setattr(ahead_mod, "BEFORE_READING_ON_CPU", True)
    monkeypatch.setattr(argmax, "pays", lambda logits: False)
    monkeypatch.setattr(cycle_mod, "discard", counting_discard)
    import dflash_mlx.engine.engine as engine_mod

    monkeypatch.setattr(engine_mod, "discard", counting_discard)
    return counts


def _case(model, length=24, tokens=40, seed=0):
    rng = random.Random(seed)
    prompt = [rng.randrange(0, 256) for _ in range(length)]
    return prompt, greedy_reference(model, prompt, tokens)


@pytest.fixture
def fixed_times(monkeypatch):
    """The look-ahead's G and D fixed (1 and 2 ms: a guess pays from P > 1/2), so what it decides
    follows what the cycles accept, not how fast this machine ran them."""
    from dflash_mlx.policy.lookahead import LookAhead

    monkeypatch.setattr(LookAhead, "timed_gap", lambda self, seconds: setattr(self, "gap", 0.001))
    monkeypatch.setattr(LookAhead, "timed_cycle", lambda self, width, seconds: self.device.__setitem__(width, 0.002))


@pytest.fixture
def guesses(monkeypatch):
    """`mode`: "never" (no chain's successor queued before its read), "always" (every one)."""
    from dflash_mlx.policy.lookahead import LookAhead

    def use(mode):
        monkeypatch.setattr(LookAhead, "pays", lambda self, width: mode == "always" and width > 1)
    return use


@pytest.mark.parametrize("width", [1, 4, "draft"])
def test_cycles_launched_ahead_keep_mlx_lm_tokens(width, launches, guesses):
    guesses("never")  # (a guess thrown away is a discard: below)
    model, tok = tiny_target("llama", **FULL)
    prompt, ref = _case(model)
    right = [random.Random(c).randrange(0, 8) for c in range(100)]
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: right[c], block_size=8)
    out = [t for r in stream_generate(model, draft, tok, prompt, max_tokens=len(ref), block_size=width,
                                      stop_token_ids=[]) for t in r.tokens]
    assert out == ref
    assert launches["launched"] > 5 and launches["discarded"] == 0


@pytest.mark.parametrize("queued_first", [True, False])
def test_plain_steps_keep_mlx_lm_tokens_read_first_or_queued_first(queued_first, launches, monkeypatch):
    """Plain steps queued before the last is read (a GPU, a CPU with a core for MLX's worker) and
    read before the next is queued (a CPU with one core): both mlx-lm's tokens, with stop tokens."""
    monkeypatch.setattr(ahead_mod, "BEFORE_READING_ON_CPU", queued_first)
    model, tok = tiny_target("llama", **FULL)
    prompt, ref = _case(model, tokens=40, seed=3)
    out = [t for r in stream_generate(model, None, tok, prompt, max_tokens=len(ref), block_size=1,
                                      stop_token_ids=[]) for t in r.tokens]
    assert out == ref and (launches["before_reading"] > 30) == queued_first
    stop = ref[20]  # a stop token ends the answer there; the step queued behind it goes
    first = ref.index(stop)
    out = [t for r in stream_generate(model, None, tok, prompt, max_tokens=len(ref), block_size=1,
                                      stop_token_ids=[stop]) for t in r.tokens]
    assert out == ref[: first + 1]


@pytest.mark.parametrize("learnt", [True, False])
def test_without_a_draft_plain_steps_are_queued_first_until_a_copy_pays(launches, guesses, fixed_times, monkeypatch,
                                                                        always_copy, learnt):
    """A row without a draft, copies on: its plain steps are queued before the last is read while
    no copy would pay, where the pair's look-ahead finds that pays (G and D fixed here: once most plain
    steps bring no copy into sight); once one would (its answer repeats; a copy wherever a match is,
    fixed here too), the step queued behind is discarded and the copy verified. Where it does not pay
    (`learnt` off: a step's compute far above the gap, copies often in sight), each step is read
    first. mlx-lm's tokens throughout."""
    from dflash_mlx.policy.lookahead import forget_lookaheads
    from dflash_mlx.policy.sizer import forget_sizers
    from dflash_mlx.testing.targets import chain_target

    # (copies decided by the match alone, `always_copy`, not by this machine's measured cycle times: under
    # load the cost model copied as few as 4 tokens of the 60)
    if not learnt:
        guesses("never")
    monkeypatch.setattr(ahead_mod, "BEFORE_READING_ON_CPU", True)
    model, tok = chain_target("Quick-brown,fx")  # the answer: these 14 tokens over and over
    prompt = tok.encode("Q", add_special_tokens=False)
    ref = greedy_reference(model, prompt, 60)
    forget_sizers()
    forget_lookaheads()
    rs = list(stream_generate(model, None, tok, prompt, max_tokens=60, stop_token_ids=[]))
    assert [t for r in rs for t in r.tokens] == ref
    assert rs[-1].proposal_counts.get("copy", [0, 0])[1] >= 20
    if learnt:
        assert launches["before_reading"] >= 5  # the first period: nothing to copy yet
        assert launches["discarded"] >= 1
    else:
        assert launches["before_reading"] == 0 and launches["discarded"] == 0


def test_an_answer_broken_off_leaves_the_prompt_cache_whole(launches):
    """The caller stops reading with a cycle launched: the next call on the same prompt cache
    rolls it back, reuses the prefix and answers as mlx-lm does."""
    model, tok = tiny_target("llama", **FULL)
    prompt, ref = _case(model, tokens=30)
    cache = make_prompt_cache(model, None)
    for n, r in enumerate(stream_generate(model, None, tok, prompt, max_tokens=30, block_size=1,
                                          stop_token_ids=[], prompt_cache=cache)):
        if n == 5:
            break
    assert isinstance(cache.ahead, ahead_mod.Launched) and not cache.valid
    follow = prompt + ref[:3]
    want = greedy_reference(model, follow, 12)
    rs = list(stream_generate(model, None, tok, follow, max_tokens=12, block_size=1, stop_token_ids=[],
                              prompt_cache=cache))
    assert [t for r in rs for t in r.tokens] == want
    assert launches["discarded"] == 1
    assert rs[0].prefill_tokens < len(follow)  # the prefix the broken-off answer left was reused


def test_a_row_joining_a_lone_row_discards_its_launched_cycle(launches, monkeypatch):
    import dflash_mlx.engine.engine as engine_mod

    model, tok = tiny_target("qwen3")
    (p1, r1), (p2, r2) = _case(model, 20, 24, seed=1), _case(model, 28, 24, seed=2)
    engine = BatchEngine(model, None, tok, max_batch=2, block_size=1)
    merged = []  # (the lone row's cache offset, its tokens) as the batch takes its caches
    real_merge = engine_mod.merge_rows

    def merge_rows(caches):
        merged.append((caches[0][0].offset, len(engine.rows[0].state.tokens)))
        return real_merge(caches)

    monkeypatch.setattr(engine_mod, "merge_rows", merge_rows)
    opts = GenerationOptions(max_tokens=24)
    first = engine.add(BatchRequest(p1, opts, ()))
    out = {}
    steps = 0
    while not engine.idle:
        for row, response in engine.step():
            out.setdefault(row.uid, []).extend(response.tokens)
        steps += 1
        if steps == 4:
            engine.add(BatchRequest(p2, opts, ()))
    second = max(out)
    assert out[first.uid] == r1 and out[second] == r2
    assert launches["discarded"] == 1
    assert merged and all(offset == tokens for offset, tokens in merged)


def test_nothing_is_launched_where_a_cycle_syncs_twice_or_state_cannot_roll_back(launches, monkeypatch):
    model, tok = tiny_target("llama", **FULL)
    prompt, ref = _case(model, tokens=16)
    # an LM head in two pieces: such cycles are planned ahead, never launched (narrow ones, one piece, are)
    two_pieces = []
    real_launch = ahead_mod.launch

    def launch(ctx, plan, *args, **kwargs):
        launched = real_launch(ctx, plan, *args, **kwargs)
        two_pieces.append(ctx.head_rows.split and ctx.head_rows.first(launched.width) < launched.width)
        return launched

    monkeypatch.setattr(ahead_mod, "launch", launch)
    for width in ("draft", 3):
        draft = ScriptedDraft(Target(model), prompt + ref, lambda c: 1, block_size=8)
        out = [t for r in stream_generate(model, draft, tok, prompt, max_tokens=16, block_size=width,
                                          stop_token_ids=[], split_head=True) for t in r.tokens]
        assert out == ref
    assert two_pieces and not any(two_pieces) and launches["launched"] == len(two_pieces)
    launches["launched"] = 0
    for kw in (dict(logprobs=2), dict(profile=True)):
        draft = ScriptedDraft(Target(model), prompt + ref, lambda c: 3, block_size=8)
        out = [t for r in stream_generate(model, draft, tok, prompt, max_tokens=16, block_size="draft",
                                          stop_token_ids=[], **kw) for t in r.tokens]
        assert out == ref, kw
    hybrid, tok = tiny_target("qwen3_5")
    prompt, ref = _case(hybrid, tokens=16)
    out = [t for r in stream_generate(hybrid, None, tok, prompt, max_tokens=16, block_size=1, stop_token_ids=[])
           for t in r.tokens]
    assert out == ref
    assert launches["launched"] == 0
    mx.eval(mx.zeros(1))


def test_a_plain_step_queues_the_next_before_the_host_reads_it(launches, monkeypatch):
    """As mlx-lm's generate_step: when the host reads a plain step's token, the next step's graph
    (built on that token's lazy value) is already queued behind it."""
    model, tok = tiny_target("llama", **FULL)
    prompt, ref = _case(model, tokens=24)
    queued_at_read = []
    real_land = cycle_mod.land

    def land(launched):  # the read of a step's token
        queued_at_read.append(isinstance(cache.ahead, ahead_mod.Launched))
        return real_land(launched)

    cache = make_prompt_cache(model, None)
    monkeypatch.setattr(cycle_mod, "land", land)
    out = [t for r in stream_generate(model, None, tok, prompt, max_tokens=len(ref), block_size=1,
                                      stop_token_ids=[], prompt_cache=cache) for t in r.tokens]
    assert out == ref
    assert launches["before_reading"] == len(ref) - 2  # every step but the last (and the first, from prefill)
    assert sum(queued_at_read) >= len(ref) - 3 and launches["discarded"] == 0


@pytest.mark.parametrize("drafted", [False, True])
def test_a_stop_token_discards_the_step_queued_behind_it(launches, drafted):
    """The step queued before its token is read goes when that token is a stop: the prompt cache
    stays whole, and the next call on it answers as mlx-lm does (with a draft: its taps kept)."""
    model, tok = tiny_target("llama", **FULL)
    prompt, ref = _case(model, tokens=30)
    stop = ref[9]
    cut = ref[: ref.index(stop) + 1]
    draft = ScriptedDraft(Target(model), prompt + ref + [0] * 40, lambda c: 3, block_size=4) if drafted else None
    cache = make_prompt_cache(model, draft)
    out = [t for r in stream_generate(model, draft, tok, prompt, max_tokens=30, block_size=1,
                                      stop_token_ids=[stop], prompt_cache=cache) for t in r.tokens]
    assert out == cut
    assert launches["discarded"] == 1 and cache.valid
    follow = prompt + cut + ref[:2]
    want = greedy_reference(model, follow, 12)
    rs = list(stream_generate(model, draft, tok, follow, max_tokens=12, block_size=1, stop_token_ids=[],
                              prompt_cache=cache))
    assert [t for r in rs for t in r.tokens] == want
    assert rs[0].prefill_tokens < len(follow)  # the whole prefix reused


def _draft_state(cache):
    """A prompt cache's draft side: context offsets, keys and values, the features waiting."""
    kv = [c.fetch() for c in cache.draft_cache]
    return ([c.offset for c in cache.draft_cache], [mx.array(k) for k, _ in kv], [mx.array(v) for _, v in kv],
            None if cache.pending is None else mx.array(cache.pending))


@pytest.mark.parametrize("version", [1, 2, "sliding"])
def test_a_chain_guessed_whole_and_wrong_is_rolled_back_target_and_draft(launches, guesses, version):
    """Every drafted chain's successor queued before the read, as if the chain were accepted whole
    (forced): a random draft's chains are not, so nearly every guess is thrown away. mlx-lm's
    tokens, the same accept lengths as a run that never guessed, and the draft's context cache
    and waiting features as that run leaves them (the rows a guess injected trimmed again)."""
    from dflash_mlx.models.draft.checkpoints import random_draft

    model, tok = tiny_target("llama", **FULL)
    prompt, ref = _case(model, tokens=40)
    if version == "sliding":  # a window of 6: its context cache holds `TRIM_SLACK` entries more, for trims
        draft = random_draft(model, num_layers=2, block_size=4, seed=5, sliding_window=6,
                             layer_types=["sliding_attention", "full_attention"])
    else:
        draft = random_draft(model, num_layers=1, block_size=4, seed=5, version=version)
    runs = {}
    for mode in ("never", "always"):
        guesses(mode)
        cache = make_prompt_cache(model, draft)
        rs = list(stream_generate(model, draft, tok, prompt, max_tokens=len(ref), block_size=4,
                                  stop_token_ids=[], prompt_cache=cache))
        runs[mode] = ([t for r in rs for t in r.tokens], rs[-1].accept_lengths, _draft_state(cache), cache)
    assert runs["never"][0] == ref and runs["always"][0] == ref
    assert runs["always"][1] == runs["never"][1]
    assert launches["before_reading"] >= 8 and launches["discarded"] >= 8
    (offsets, keys, values, pending), (offsets2, keys2, values2, pending2) = runs["never"][2], runs["always"][2]
    assert offsets == offsets2 and offsets[0] + (0 if pending is None else pending.shape[1]) == len(prompt) + 39
    for a, b in zip(keys + values, keys2 + values2):  # (rows injected 4 at a time or as kept: BLAS rounds apart)
        assert a.shape == b.shape and mx.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert (pending is None) == (pending2 is None) and (pending is None or mx.array_equal(pending, pending2))
    follow = prompt + ref + ref[:2]  # the prompt cache stays whole for the next turn
    want = greedy_reference(model, follow, 10)
    rs = list(stream_generate(model, draft, tok, follow, max_tokens=10, block_size=4, stop_token_ids=[],
                              prompt_cache=runs["always"][3]))
    assert [t for r in rs for t in r.tokens] == want and rs[0].prefill_tokens < len(follow)


@pytest.mark.parametrize("stop_at", [None, 13, 17])
def test_chains_accepted_whole_are_queued_before_their_read(launches, fixed_times, stop_at):
    """An oracle draft (every chain accepted whole): once the pair's look-ahead has seen a few (G and D
    fixed), each chain's successor is queued before the host reads it, and lands. A stop token ends the answer
    inside or at the end of a chain: the successor goes and the prompt cache stays whole."""
    from dflash_mlx.policy.lookahead import forget_lookaheads

    forget_lookaheads()
    model, tok = tiny_target("llama", **FULL)
    prompt, ref = _case(model, tokens=60, seed=4)
    stop = [ref[stop_at]] if stop_at is not None else []
    want = ref if stop_at is None else ref[: ref.index(ref[stop_at]) + 1]
    draft = ScriptedDraft(Target(model), prompt + ref + [0] * 40, lambda c: 10**9, block_size=4)
    cache = make_prompt_cache(model, draft)
    rs = list(stream_generate(model, draft, tok, prompt, max_tokens=len(ref), block_size=4,
                              stop_token_ids=stop, prompt_cache=cache))
    assert [t for r in rs for t in r.tokens] == want
    cycles = len(rs[-1].accept_lengths)
    if stop_at is None:
        assert launches["before_reading"] >= cycles - 6 and launches["discarded"] <= 1
    assert cache.valid and cache.ahead is None
    follow = prompt + want + ref[:2]
    rs = list(stream_generate(model, draft, tok, follow, max_tokens=8, block_size=4, stop_token_ids=[],
                              prompt_cache=cache))
    assert [t for r in rs for t in r.tokens] == greedy_reference(model, follow, 8)


def test_unkeep_takes_rows_back_from_the_waiting_features_or_the_context_cache():
    from dflash_mlx.engine.drafter import DraftContext
    from dflash_mlx.models.draft.checkpoints import random_draft

    model, _ = tiny_target("llama", **FULL)
    draft = random_draft(model, num_layers=1, block_size=4, seed=1)
    cache = make_prompt_cache(model, draft)
    drafter = DraftContext(draft, cache)
    width = Target(model).hidden_size * len(drafter.layer_ids)
    feats = mx.random.normal((1, 5, width))
    drafter.absorb(feats[:, :3])
    before = _draft_state(cache)
    drafter.keep(feats[:, 3:])
    drafter.unkeep(1)
    assert cache.pending.shape[1] == 1 and mx.array_equal(cache.pending, feats[:, 3:4])
    drafter.unkeep(1)
    assert cache.pending is None
    drafter.keep(feats[:, 3:])
    drafter.absorb(None)  # a draft forward took them
    drafter.unkeep(2)
    after = _draft_state(cache)
    assert after[0] == before[0] == [3] and all(mx.array_equal(a, b) for a, b in zip(after[1], before[1]))


def test_no_guess_where_a_forward_drops_a_chunked_caches_front(launches, guesses):
    """Llama 4's chunked layers drop entries off their cache's front by the offset a forward finds:
    a cycle queued on a guess would count the rows the guess's rollback takes away, so none is."""
    from dflash_mlx.models.draft.checkpoints import random_draft
    from dflash_mlx.testing import arch_check
    from dflash_mlx.testing.targets import byte_tokenizer

    guesses("always")
    model = arch_check.build("llama4/chunk4")
    prompt = list(range(3, 36))
    ref = greedy_reference(model, prompt, 24)
    draft = random_draft(model, num_layers=1, block_size=5, seed=2)
    out = [t for r in stream_generate(model, draft, byte_tokenizer(), prompt, max_tokens=24, block_size=5,
                                      stop_token_ids=[]) for t in r.tokens]
    assert out == ref and launches["before_reading"] == 0


@pytest.mark.parametrize("restored", [True, False])
@pytest.mark.parametrize("arch", ["gpt_oss", "cohere2"])
def test_a_window_whose_stream_closed_with_a_cycle_ahead_takes_a_one_token_next_turn(arch, restored, monkeypatch):
    """An answer broken off (the stream closed) while a wide cycle is launched ahead on sliding windows
    past their size; the next turn on the same prompt cache adds one token, so its prefill is a
    one-token step. The discarded cycle's window is put back as it was (`models.target.windows`):
    trimmed whole instead (the control), mlx-lm's next one-token update raised."""
    from dflash_mlx.testing.archs import build
    from dflash_mlx.testing.targets import byte_tokenizer, clean_case

    if not restored:
        monkeypatch.setattr(ahead_mod, "restore_windows", lambda snapshot: None)
    model = build(arch)
    prompt, ref = clean_case(model, 30, 40, seed=3)
    draft = ScriptedDraft(Target(model), prompt + ref, lambda c: 10**9, block_size=4)
    cache = make_prompt_cache(model, draft)
    got = []
    stream = stream_generate(model, draft, byte_tokenizer(), prompt, max_tokens=40, block_size=4, prompt_cache=cache,
                             stop_token_ids=[])
    for r in stream:
        got += r.tokens
        if len(got) > 25:
            break
    stream.close()
    turn2 = prompt + got + [5]
    want = greedy_reference(model, turn2, 6)

    def next_turn():
        return [t for r in stream_generate(model, draft, byte_tokenizer(), turn2, max_tokens=6, block_size=4,
                                           prompt_cache=cache, stop_token_ids=[]) for t in r.tokens]
    if restored:
        assert next_turn() == want
    else:
        with pytest.raises(ValueError, match="Negative dimensions"):
            next_turn()
