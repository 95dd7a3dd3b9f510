"""Copies from earlier requests (`speculation.suffix_index.SuffixIndex`): the index, its byte
bound, the policy's separate record, and the library's and the server's opt-outs."""

import random
import tracemalloc

import pytest

import dflash_mlx  # noqa: F401
from dflash_mlx import make_suffix_index, stream_generate
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.policy.copies import CopyPolicy, copy_policy_for
from dflash_mlx.policy.sizer import BlockSizer, forget_sizers, sizer_for
from dflash_mlx.speculation.copies import ContextIndex, CopyMatch
from dflash_mlx.speculation.suffix_index import BYTES_PER_TOKEN, SuffixIndex
from dflash_mlx.testing.targets import chain_target, greedy_reference

TEXT = "Quick-brown,fx"  # chain_target's answer: these 14 tokens over and over
N = 13  # answers shorter than one period: the context alone holds nothing to copy


@pytest.fixture(scope="module")
def chain():
    return chain_target(TEXT)


def decode(model, draft, tok, prompt, **kw):
    tokens, responses = [], []
    for r in stream_generate(model, draft, tok, prompt, stop_token_ids=[], **kw):
        tokens += r.tokens
        responses.append(r)
    return tokens, responses


# -- the index ------------------------------------------------------------------------------


def test_the_index_proposes_what_followed_in_the_latest_earlier_request():
    index = SuffixIndex()
    index.add([1, 2, 3, 4, 5, 6])
    index.add([9, 3, 4, 7, 8])  # a later request: 3, 4 went on with 7 there
    m = index.match([0, 3, 4], 5)
    assert (m.length, m.continuation, m.shared) == (2, [7, 8], True)  # up to that request's end
    m = index.match([2, 3, 4], 5)  # a longer match wins over a later one
    assert (m.length, m.continuation) == (3, [5, 6])
    assert index.match([42], 5) is None and index.match([8], 5) is None  # 8 has no next token


def test_a_conversation_resent_whole_is_indexed_once():
    index = SuffixIndex()
    turn = [5, 6, 7, 8]
    for more in ([9, 10], [11, 12, 13], [14]):
        turn = turn + more
        index.add(turn)
    assert index.stats()["documents"] == 1 and index.stats()["tokens"] == len(turn)
    before = index.nbytes
    index.add(turn[:6] + [20, 21, 22])  # another branch of it: only what follows the shared part
    assert index.stats()["documents"] == 2
    assert index.nbytes - before == 4 * 9 + BYTES_PER_TOKEN * 3
    assert index.match([6, 20], 3).continuation == [21, 22]
    assert index.match([10], 3).continuation == [20, 21, 22]  # the latest
    assert index.match([10, 11], 3).continuation == [12, 13, 14]
    assert index.match([12, 13], 3).continuation == [14]


def test_eviction_keeps_the_index_within_its_bound_oldest_first():
    rng = random.Random(0)
    bound = 60 * BYTES_PER_TOKEN
    index = SuffixIndex(bound)
    docs = [[1000 * d + i for i in range(20)] for d in range(8)]  # distinct tokens per request
    for d in docs:
        index.add(d)
        assert index.nbytes <= bound
    assert index.match(docs[-1][:3], 2).continuation == docs[-1][3:5]
    assert index.match(docs[0][:3], 2) is None  # the oldest went first
    index.add([rng.randrange(100) for _ in range(500)])  # one request past the bound: its end is kept
    assert index.nbytes <= bound and index.stats()["documents"] == 1
    assert SuffixIndex(0).match([1], 1) is None


def test_bytes_per_token_bounds_what_the_index_holds():
    """The estimate the bound counts is at least the memory tracemalloc sees (vocabulary 50k)."""
    rng = random.Random(1)
    docs = [[rng.randrange(50_000) for _ in range(1000)] for _ in range(4)]
    index = SuffixIndex(1 << 40)
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for d in docs:
            index.add(d)
        used = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert used <= index.nbytes <= 1.6 * used


# -- the policy -----------------------------------------------------------------------------


def test_a_failing_shared_source_stops_being_proposed_and_the_contexts_own_copies_go_on():
    sizer = BlockSizer(1)
    for _ in range(3):
        sizer.update(1, 0, 1.0)
    policy = CopyPolicy(sizer)
    for w in (2, 4, 8, 16):
        for _ in range(2):
            sizer.costs.record(w, 1.0 + 0.02 * w)
    local = ContextIndex(list(range(20)) * 2).match(15)
    shared = CopyMatch(local.length, 0, local.continuation, shared=True)
    assert policy.choose(shared, 100, 1) > 0 and policy.choose(local, 100, 1) > 0
    for _ in range(20):
        policy.update(shared.length, 8, 0, 1.2, shared=True)
    assert policy.choose(shared, 100, 1) == 0 and policy.choose(local, 100, 1) > 0
    assert policy.best([local, shared], 100, 1)[0] is local


# -- the library ------------------------------------------------------------------------------


@pytest.fixture
def steady_costs(monkeypatch):
    """Cycle times from a fixed cost model, each verify row 5% of a plain step, as on a CPU
    (on the tiny target two rows cost what one does): the policy's choices are reproducible."""
    from dflash_mlx.policy.cost import CycleCosts

    record = CycleCosts.record
    monkeypatch.setattr(CycleCosts, "record", lambda self, width, seconds: record(self, width, 1 + 0.05 * (width - 1)))


@pytest.mark.parametrize("with_draft", [False, True])
def test_a_second_request_copies_the_first_answer_from_the_index(chain, with_draft, steady_costs):
    model, tok = chain
    draft = random_draft(model, num_layers=1, block_size=16, seed=0) if with_draft else None
    prompt = tok.encode("Q", add_special_tokens=False)
    ref = greedy_reference(model, prompt, N)
    forget_sizers()
    index = make_suffix_index(model)
    first, responses = decode(model, draft, tok, prompt, max_tokens=N, suffix_index=index)
    assert first == ref and "global_copy" not in responses[-1].proposal_counts
    assert index.stats()["tokens"] == 1 + N
    second, responses = decode(model, draft, tok, prompt, max_tokens=N, suffix_index=index)
    assert second == ref
    counts = responses[-1].proposal_counts
    assert counts["global_copy"][1] >= N - 3 and "copy" not in counts  # counted apart from the context's
    policy = copy_policy_for(sizer_for(model, draft))
    assert sum(map(sum, policy.shared_record.trials)) > 0 and sum(map(sum, policy.record.trials)) == 0
    # without the index the context holds nothing to copy
    _, responses = decode(model, draft, tok, prompt, max_tokens=N)
    assert not {"copy", "global_copy"} & set(responses[-1].proposal_counts)
    with pytest.raises(ValueError, match="another model"):
        decode(model, draft, tok, prompt, max_tokens=2, suffix_index=make_suffix_index(chain_target("ab")[0]))


def test_an_index_that_keeps_failing_stops_being_proposed(chain, monkeypatch, steady_costs):
    """The index holds a wrong continuation (and keeps it: nothing is added): global copies
    are tried, rejected, and after a few requests no longer proposed (on the tiny target a
    verify of two rows costs what one does: without `steady_costs` a failing copy costs nothing)."""
    model, tok = chain
    prompt = tok.encode("Q", add_special_tokens=False)
    index = make_suffix_index(model)
    index.add(prompt + tok.encode("abcdefghijklmn", add_special_tokens=False))
    monkeypatch.setattr(SuffixIndex, "add", lambda self, tokens: None)

    forget_sizers()
    tried = []
    for _ in range(8):
        out, responses = decode(model, None, tok, prompt, max_tokens=N, suffix_index=index)
        assert out == greedy_reference(model, prompt, N)
        tried.append(responses[-1].proposal_counts.get("global_copy", [0, 0])[0])
    assert tried[0] > 0 and tried[-3:] == [0, 0, 0]


# -- the server ---------------------------------------------------------------------------------


@pytest.mark.parametrize("max_batch", [1, 4])
def test_server_shares_the_index_and_a_request_can_opt_out(chain, max_batch, steady_costs):
    from test_server import serving

    model, tok = chain
    prompt = tok.encode("Q", add_special_tokens=False)
    ref = greedy_reference(model, prompt, N)
    forget_sizers()

    def complete(s, **extra):
        r = s.client.completions.create(model="tiny", prompt=prompt, max_tokens=N, temperature=0, **extra)
        assert tok.encode(r.choices[0].text, add_special_tokens=False) == ref
        return r.usage.dflash["proposals"]

    opt_out = {"extra_body": {"dflash": {"global_copies": False}}}
    with serving(model, None, tok, max_batch=max_batch) as s:
        assert "global_copy" not in complete(s, **opt_out)
        assert s.worker.health()["global_copies"]["documents"] == 0  # an opted-out request adds nothing
        assert "global_copy" not in complete(s)  # nothing earlier yet
        assert s.worker.health()["global_copies"]["tokens"] == 1 + N
        assert "global_copy" not in complete(s, **opt_out)  # copies nothing either
        assert complete(s)["global_copy"][1] >= N - 3
    with serving(model, None, tok, max_batch=max_batch, global_copies_bytes=0) as s:  # --no-global-copies
        complete(s)
        assert "global_copy" not in complete(s) and s.worker.health()["global_copies"] is None


def test_serve_flags():
    from dflash_mlx.serve.cli import build_parser
    from dflash_mlx.speculation.suffix_index import DEFAULT_SUFFIX_INDEX_BYTES

    args = build_parser().parse_args([])
    assert args.global_copies_bytes == DEFAULT_SUFFIX_INDEX_BYTES and not args.no_global_copies
    args = build_parser().parse_args(["--global-copies-bytes", "64M", "--no-global-copies"])
    assert args.global_copies_bytes == 64 << 20 and args.no_global_copies


def test_the_chat_keeps_one_index_for_its_session(chain, steady_costs):
    """A new chat starts a new conversation, not a new index: the same question answered again
    is copied from the earlier conversation's answer."""
    from dflash_mlx.tui.session import ChatSession, Settings

    model, tok = chain
    last = []

    def stream_fn(*args, **kwargs):
        for r in stream_generate(*args, **kwargs):
            last[:] = [r]
            yield r

    session = ChatSession(model, tok, None, Settings(max_tokens=N), template=lambda msgs: msgs[-1]["content"],
                          stream_fn=stream_fn)
    forget_sizers()
    first = session.turn("Q", lambda turn, new: None, lambda: False)
    assert "global_copy" not in last[0].proposal_counts
    session.new_chat()
    second = session.turn("Q", lambda turn, new: None, lambda: False)
    assert second.tokens == first.tokens == greedy_reference(model, tok.encode("Q", add_special_tokens=False), N)
    assert last[0].proposal_counts["global_copy"][1] >= N - 3
