"""`dflash-mlx serve` over real HTTP: the official openai client, load, cancellation,
prefix reuse across requests, and bad requests.

Each server runs in a thread on 127.0.0.1 and a free port, on a tiny float32 target
with a random draft; expected outputs come from the target's own greedy decode.
"""

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest

from dflash_mlx import stream_generate
from dflash_mlx.cli.common import CLIError
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.models.loading import apply_chat_template
from dflash_mlx.engine.prompt_cache import common_prefix
from dflash_mlx.serve.cli import build_parser, load_worker
from dflash_mlx.serve.requests import StopMatcher
from dflash_mlx.serve.worker import Worker
from dflash_mlx.testing.serving import http_server
from dflash_mlx.testing.targets import EOS_ID, chain_target, greedy_reference, tiny_target

TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MODEL = "tiny"


@contextlib.contextmanager
def serving(model, draft, tok, template=TEMPLATE, **worker_args):
    """A server on a free loopback port; `template`: the chat template set first (None: keep the tokenizer's)."""
    if template is not None:
        tok._tokenizer.chat_template = template
    worker = Worker(model, draft, tok, model_name=MODEL, draft_name="random", **worker_args)
    with http_server(worker) as url:
        yield SimpleNamespace(
            url=url, worker=worker, model=model, draft=draft, tok=tok,
            client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0),
        )


@pytest.fixture(scope="module")
def attn():
    model, tok = tiny_target("llama", seed=0, layer_types=None, sliding_window=None)
    with serving(model, random_draft(model, block_size=8), tok) as s:
        yield s


@pytest.fixture(scope="module")
def hybrid():
    model, tok = tiny_target("qwen3_5", seed=0)
    with serving(model, random_draft(model, block_size=8), tok) as s:
        yield s


def chat_ids(s, messages):
    return s.worker.encode_chat(messages)


def expected(s, ids, max_tokens):
    """(text, token count) of a cold engine run, itself checked against the target's greedy decode."""
    tokens, text = [], []
    for r in stream_generate(s.model, s.draft, s.tok, ids, max_tokens=max_tokens, block_size="draft"):
        tokens.extend(r.tokens)
        text.append(r.text)
    assert tokens == greedy_reference(s.model, ids, max_tokens, stop_ids=[EOS_ID])[: len(tokens)]
    return "".join(text), len(tokens)


def check_usage(usage, ids, n_tokens):
    assert usage.prompt_tokens == len(ids)
    assert usage.completion_tokens == n_tokens
    assert usage.total_tokens == len(ids) + n_tokens
    d = usage.dflash
    assert d["cycles"] == sum(d["verify_widths"].values()) <= max(n_tokens - 1, 0)  # the first token comes from prefill
    assert d["tau"] >= 1.0 and d["mean_accept_length"] == pytest.approx(d["tau"] - 1.0)
    assert d["prompt_tokens_reused"] + d["prefill_tokens"] == len(ids)
    assert usage.prompt_tokens_details.cached_tokens == d["prompt_tokens_reused"]
    assert d["tokens_per_second"] > 0


# -- the openai client ------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_completion_is_the_targets_greedy_output(attn, stream):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"tell me ({stream})"}]
    ids = chat_ids(attn, messages)
    text, n = expected(attn, ids, 24)
    if stream:
        chunks = list(attn.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].object == "chat.completion.chunk"
        usage = chunks[-1].usage
    else:
        r = attn.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24)
        assert r.object == "chat.completion" and r.model == MODEL and r.choices[0].message.role == "assistant"
        got, finish, usage = r.choices[0].message.content, [r.choices[0].finish_reason], r.usage
    assert got == text
    assert finish == ["length" if n == 24 else "stop"]
    check_usage(usage, ids, n)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_completion_is_the_targets_greedy_output(attn, stream):
    prompt = f"Once upon a time ({stream}),"
    ids = attn.worker.encode_text(prompt)
    text, n = expected(attn, ids, 20)
    if stream:
        chunks = list(attn.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, stream=True))
        got = "".join(c.choices[0].text for c in chunks)
        assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    else:
        r = attn.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
        assert r.object == "text_completion"
        got = r.choices[0].text
        check_usage(r.usage, ids, n)
    assert got == text


@pytest.mark.parametrize("stream", [False, True])
def test_penalties_and_logit_bias_give_mlx_lms_answer(attn, stream):
    """OpenAI's penalties and logit bias and mlx-lm's repetition penalty: the answer is mlx-lm's greedy
    decode under the same processors."""
    from mlx_lm.sample_utils import make_logits_processors

    prompt = f"Again and again ({stream}),"
    ids = attn.worker.encode_text(prompt)
    bias = {ids[-1]: 5.0, ids[0]: -3.0}
    processors = make_logits_processors(bias, 1.3, 16, 0.5, 20, 0.25, 20)
    want = greedy_reference(attn.model, ids, 20, stop_ids=[EOS_ID], logits_processors=processors)
    assert want != greedy_reference(attn.model, ids, 20, stop_ids=[EOS_ID])
    r = attn.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, stream=stream, presence_penalty=0.5, frequency_penalty=0.25,
        logit_bias={str(t): b for t, b in bias.items()}, extra_body={"repetition_penalty": 1.3,
                                                                    "repetition_context_size": 16})
    got = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
    assert got == attn.tok.decode(want[:-1] if want[-1] == EOS_ID else want)


def test_raw_stream_ends_with_done_and_usage_before_it(attn):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", attn.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][6:])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


def test_sampling_request_reaches_the_engine(attn, monkeypatch):
    # Seeds do not make sampled text repeat under block size "auto": the verify
    # widths follow measured times, and each width draws a different number of randoms.
    import dflash_mlx.engine.rows as rows

    made = []

    def recording(temperature, **sampling):
        made.append(dict(sampling, temperature=temperature))
        return real(temperature, **sampling)

    real = rows.make_acceptor
    monkeypatch.setattr(rows, "make_acceptor", recording)
    r = attn.client.completions.create(model=MODEL, prompt="dice", max_tokens=12, temperature=0.9, top_p=0.95, seed=11,
                                       extra_body={"top_k": 20, "min_p": 0.05, "xtc_probability": 0.5,
                                                   "xtc_threshold": 0.2})
    assert r.usage.completion_tokens == 12 or r.choices[0].finish_reason == "stop"
    xtc = made[-1].pop("xtc")
    assert made[-1] == dict(temperature=0.9, top_p=0.95, top_k=20, min_p=0.05, draft_sampling="argmax",
                            min_tokens_to_keep=1)
    tok = attn.worker.tokenizer  # (a newline and the end tokens kept out of XTC, as mlx-lm's server keeps them)
    assert (xtc.probability, xtc.threshold) == (0.5, 0.2)
    assert xtc.special_tokens == tuple(tok.encode("\n")) + tuple(tok.eos_token_ids)


def test_a_small_model_draft_serves_the_targets_greedy_output():
    """mlx-lm's --draft-model behind the server (`models.draft.autoregressive`): two completions at once, batched
    in one engine, each the target's greedy output."""
    from dflash_mlx.testing.targets import small_draft_model

    model, tok = tiny_target("qwen3", seed=1, tie_word_embeddings=False)
    with serving(model, small_draft_model(model, 3), tok, max_batch=2) as s:
        prompts = ["alpha beta", "gamma delta epsilon"]
        want = [expected(s, s.worker.encode_text(p), 16)[0] for p in prompts]
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda p: s.client.completions.create(model=MODEL, prompt=p, max_tokens=16), prompts))
        assert [r.choices[0].text for r in got] == want
        assert all(r.usage.dflash["cycles"] > 0 for r in got)


def test_a_vanishing_temperature_or_top_p_is_greedy(attn):
    # 1/T overflows float32 below ~3e-39 and a top-p of 1e-300 is 0 there: both are greedy in the limit
    text, _ = expected(attn, attn.worker.encode_text("limit"), 8)
    for sampling in ({"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-300}):
        r = attn.client.completions.create(model=MODEL, prompt="limit", max_tokens=8, **sampling)
        assert r.choices[0].text == text, sampling


def test_models_and_health(attn):
    assert [m.id for m in attn.client.models.list().data] == [MODEL]
    h = httpx.get(attn.url + "/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL
    assert h["scheduling"].startswith("continuous batching") and h["queue_size"] == 16
    assert {"busy", "queued", "served", "cancelled", "rejected"} <= set(h)
    assert {"rows", "joining", "max_batch", "widths"} <= set(h["batch"])
    pc = h["prompt_cache"]
    assert pc["max_bytes"] == attn.worker.max_bytes == 1 << 30 and pc["max_snapshots"] == 4
    assert 0 <= pc["snapshot_bytes"] <= pc["max_bytes"] and pc["live_bytes"] >= 0


# -- stop strings -----------------------------------------------------------------


def test_stop_matcher_holds_back_a_possible_stop_prefix():
    m = StopMatcher(["xyz", "END"])
    assert m.feed("abx") == ("ab", False)  # "x" may start "xyz"
    assert m.feed("yq") == ("xyq", False)
    assert m.feed("E") == ("", False)
    assert m.feed("NDtail") == ("", True)
    m = StopMatcher(["xyz"])
    assert m.feed("ax") == ("a", False)
    assert m.flush() == "x"  # the generation ended: what was held back is text after all
    assert StopMatcher([]).feed("xyz") == ("xyz", False)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_across_tokens_cuts_exactly(attn, stream):
    prompt = "stop test"
    ids = attn.worker.encode_text(prompt)
    text, _ = expected(attn, ids, 30)
    ascii_at = next(i for i in range(4, len(text) - 3) if all(" " < c < "~" for c in text[i : i + 3]))
    stop = text[ascii_at : ascii_at + 3]  # three byte tokens
    cut = text[: text.find(stop)]
    if stream:
        chunks = list(attn.client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, stop=[stop], stream=True))
        got = "".join(c.choices[0].text for c in chunks)
        assert all(stop[0] not in c.choices[0].text[len(cut):] for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = attn.client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, stop=stop)
        got, finish = r.choices[0].text, r.choices[0].finish_reason
    assert got == cut and finish == "stop"


# -- load -----------------------------------------------------------------------


def test_eight_concurrent_clients_three_requests_each_exact(attn):
    jobs = []
    for c in range(8):
        for k in range(3):
            kind = ("chat", "completion")[(c + k) % 2]
            stream = bool((c * 3 + k) % 3 == 0)
            text = f"client {c} request {k}"
            ids = chat_ids(attn, [{"role": "user", "content": text}]) if kind == "chat" else attn.worker.encode_text(text)
            jobs.append((c, kind, stream, text, expected(attn, ids, 16)[0]))

    def client(c):
        results = []
        for _, kind, stream, text, _ in [j for j in jobs if j[0] == c]:
            if kind == "chat":
                args = dict(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=16)
                if stream:
                    out = "".join(ch.choices[0].delta.content or "" for ch in attn.client.chat.completions.create(stream=True, **args) if ch.choices)
                else:
                    out = attn.client.chat.completions.create(**args).choices[0].message.content
            else:
                args = dict(model=MODEL, prompt=text, max_tokens=16)
                if stream:
                    out = "".join(ch.choices[0].text for ch in attn.client.completions.create(stream=True, **args))
                else:
                    out = attn.client.completions.create(**args).choices[0].text
            results.append(out)
        return results

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(client, range(8)))
    for c in range(8):
        assert got[c] == [j[4] for j in jobs if j[0] == c], f"client {c}"
    assert len({j[4] for j in jobs}) > 12  # the outputs differ, so cross-talk would show


@pytest.fixture(scope="module")
def endless():
    """A target whose greedy output never ends (no EOS), for cancellation and queueing;
    served one request at a time."""
    model, tok = chain_target("abcdefghij")
    with serving(model, random_draft(model, block_size=4), tok, queue_size=1, max_batch=1) as s:
        yield s


@pytest.fixture(scope="module")
def endless_batched():
    """The endless target served two rows at a time, one more request waiting at most."""
    model, tok = chain_target("abcdefghij")
    with serving(model, random_draft(model, block_size=4), tok, queue_size=1, max_batch=2) as s:
        yield s


def wait_idle(s, timeout=5.0):
    t0 = time.perf_counter()
    while True:
        h = httpx.get(s.url + "/health").json()
        if not h["busy"] and h["queued"] == 0:
            return time.perf_counter() - t0
        assert time.perf_counter() - t0 < timeout, h
        time.sleep(0.005)


def test_client_disconnect_mid_stream_frees_the_server_within_one_cycle(endless):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 3000, "stream": True}
    served = endless.worker.counts["served"]
    with httpx.stream("POST", endless.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
    # the connection is closed here, far before 3000 tokens
    freed_in = wait_idle(endless)
    assert endless.worker.counts["cancelled"] == 1
    assert endless.worker.cycles_after_cancel == [1] or endless.worker.cycles_after_cancel == [0]
    assert endless.worker.counts["served"] == served
    print(f"server idle {freed_in * 1000:.0f} ms after the client went away")
    r = endless.client.completions.create(model=MODEL, prompt="c", max_tokens=7)
    assert r.choices[0].text == "defghij"
    # a client that gives up on a non-streaming answer cancels it too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(endless.url + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
    wait_idle(endless)
    assert endless.worker.counts["cancelled"] == 2 and endless.worker.counts["served"] == served + 1


def test_full_queue_answers_429_and_keeps_serving(endless):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", endless.url + "/v1/completions", json=body, timeout=30) as running:
        lines = running.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(endless.client.completions.create, model=MODEL, prompt="e", max_tokens=4)
            deadline = time.time() + 10
            while httpx.get(endless.url + "/health").json()["queued"] < 1:
                assert time.time() < deadline, str(httpx.get(endless.url + "/health").json())
                time.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as e:
                endless.client.completions.create(model=MODEL, prompt="b", max_tokens=2)
            assert e.value.status_code == 429 and e.value.code == "queue_full"
            running.close()  # the running stream goes away; the waiting request runs
            assert waiting.result(timeout=30).choices[0].text == "fghi"
    assert endless.worker.counts["rejected"] == 1
    assert endless.client.completions.create(model=MODEL, prompt="b", max_tokens=3).choices[0].text == "cde"


def test_batched_rows_then_queue_then_429_with_retry_after(endless_batched):
    s = endless_batched
    assert s.worker.engine is not None and s.worker.health()["batch"]["max_batch"] == 2
    body = {"model": MODEL, "prompt": "a", "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as one, \
            httpx.stream("POST", s.url + "/v1/completions", json={**body, "prompt": "c"}, timeout=30) as two:
        lines_one, lines_two = one.iter_lines(), two.iter_lines()
        next(lines_one), next(lines_two)  # both decode at once: two rows
        deadline = time.time() + 10
        while httpx.get(s.url + "/health").json()["batch"]["rows"] < 2:
            assert time.time() < deadline
            time.sleep(0.01)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(s.client.completions.create, model=MODEL, prompt="e", max_tokens=4)
            while httpx.get(s.url + "/health").json()["queued"] < 1:
                assert time.time() < deadline
                time.sleep(0.01)
            refused = httpx.post(s.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2})
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
            assert int(refused.headers["Retry-After"]) >= 1
            anthropic = httpx.post(s.url + "/v1/messages", json={
                "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
            assert anthropic.status_code == 429 and "Retry-After" in anthropic.headers
            one.close()  # a row frees: the waiting request joins while the other row keeps going
            assert waiting.result(timeout=30).choices[0].text == "fghi"
            assert next(lines_two) is not None
    wait_idle(s)
    h = s.worker.health()
    assert h["rejected"] == 2 and h["cancelled"] == 2 and h["batch"]["rows"] == 0


def test_batched_memory_bound_counts_the_rows_and_keeps_no_conversation_past_it():
    """With a byte bound below one row's caches, rows join one at a time (one running row
    already holds more than the bound) and no finished conversation is kept."""
    model, tok = chain_target("abcdefghij")
    with serving(model, random_draft(model, block_size=4), tok, max_batch=4, prompt_cache_bytes=1) as s:
        body = {"model": MODEL, "prompt": "a", "max_tokens": 3000, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as one:
            lines = one.iter_lines()
            next(lines)
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(s.client.completions.create, model=MODEL, prompt="e", max_tokens=4)
                deadline = time.time() + 10
                while httpx.get(s.url + "/health").json()["queued"] < 1:
                    assert time.time() < deadline
                    time.sleep(0.01)
                h = httpx.get(s.url + "/health").json()
                assert h["batch"]["rows"] == 1 and h["prompt_cache"]["live_bytes"] > h["prompt_cache"]["max_bytes"]
                one.close()  # the running row leaves: the waiting request runs
                assert waiting.result(timeout=30).choices[0].text == "fghi"
        wait_idle(s)
        h = s.worker.health()
        assert h["prompt_cache"]["snapshots"] == 0 and h["prompt_cache"]["snapshot_bytes"] == 0


def _rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024


def test_a_hundred_short_requests_keep_memory_flat(attn):
    """After a warm-up, 100 requests grow RSS by under 20 MB (200 KB a request; measured 0.3 MB
    for 200 requests)."""
    http = httpx.Client(base_url=attn.url, timeout=30)

    def one(i):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": f"short {i % 37}", "max_tokens": 3})
        assert r.status_code == 200, r.text

    for i in range(20):  # warm-up: allocator pools, caches, snapshots at their bound
        one(i)
    before = _rss_mb()
    for i in range(100):
        one(i)
    after = _rss_mb()
    print(f"RSS before {before:.1f} MB, after 100 requests {after:.1f} MB")
    assert after - before < 20
    assert len(attn.worker.pool) <= attn.worker.max_snapshots


# -- prefix reuse -----------------------------------------------------------------


@pytest.mark.parametrize("target", ["attn", "hybrid"])
def test_second_chat_turn_prefills_only_the_new_turn(target, request):
    s = request.getfixturevalue(target)
    turn1 = [{"role": "user", "content": f"first question ({target})"}]
    ids1 = chat_ids(s, turn1)
    r1 = s.client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=12)
    gen1 = greedy_reference(s.model, ids1, 12, stop_ids=[EOS_ID])
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "and a second one"}]
    ids2 = chat_ids(s, turn2)
    text2, n2 = expected(s, ids2, 12)
    r2 = s.client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=12)
    assert r2.choices[0].message.content == text2
    held = ids1 + gen1[:-1]  # what the caches held after turn 1
    if target == "attn":
        want = common_prefix(held, ids2)  # KV trimmed back to the shared prefix
    else:
        want = len(held) if ids2[: len(held)] == held else len(ids1)  # the snapshot at the end of the prompt
    assert want >= len(ids1)
    d = r2.usage.dflash
    assert d["prompt_tokens_reused"] == want and d["prefill_tokens"] == len(ids2) - want
    check_usage(r2.usage, ids2, n2)


@pytest.mark.parametrize("target", ["attn", "hybrid"])
def test_interleaved_token_conversations_reuse_everything(target, request):
    s = request.getfixturevalue(target)
    a1, b1 = list(range(40, 70)), list(range(140, 170))
    gen = {}
    for name, ids in (("a", a1), ("b", b1)):
        r = s.client.completions.create(model=MODEL, prompt=ids, max_tokens=8)
        gen[name] = greedy_reference(s.model, ids, 8, stop_ids=[EOS_ID])
        assert r.choices[0].text == expected(s, ids, 8)[0]
    for name, ids in (("a", a1), ("b", b1)):
        ids2 = ids + gen[name] + [10, 11, 12, 13]
        r = s.client.completions.create(model=MODEL, prompt=ids2, max_tokens=8)
        text, n = expected(s, ids2, 8)
        assert r.choices[0].text == text
        d = r.usage.dflash
        assert d["prompt_tokens_reused"] == len(ids) + len(gen[name]) - 1, name  # all but the last answer token
        assert d["prefill_tokens"] == 1 + 4
        check_usage(r.usage, ids2, n)


# -- bad requests -------------------------------------------------------------------


HI = [{"role": "user", "content": "hi"}]
BAD = [
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None, "not valid JSON"),
    ("/v1/chat/completions", b'\xff\xfe{"messages": []}', 400, None, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1 item"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "required"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "valid list"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0]", "'role' is required"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0]", "unknown role 'wizard'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0].type", "'text'"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ("/v1/chat/completions", {"messages": HI, "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/chat/completions", {"messages": HI, "top_p": 2}, 400, "top_p", "less than or equal to 1"),
    ("/v1/chat/completions", {"messages": HI, "top_k": -1}, 400, "top_k", "greater than or equal to 0"),
    ("/v1/chat/completions", {"messages": HI, "xtc_threshold": 0.7}, 400, "xtc_threshold", "less than or equal to 0.5"),
    ("/v1/chat/completions", {"messages": HI, "xtc_probability": -1}, 400, "xtc_probability",
     "greater than or equal to 0"),
    ("/v1/chat/completions", {"messages": HI, "seed": 1.5}, 400, "seed", "integer"),
    ("/v1/chat/completions", {"messages": HI, "seed": -5}, 400, "seed", "greater than or equal to 0"),
    ("/v1/chat/completions", {"messages": HI, "seed": 2**70}, 400, "seed", "less than 18446744073709551616"),
    ("/v1/chat/completions", {"messages": HI, "stream": "yes"}, 400, "stream", "boolean"),
    ("/v1/chat/completions", {"messages": HI, "stop": 5}, 400, "stop", "valid string or input should be a valid list"),
    ("/v1/chat/completions", {"messages": HI, "n": 2}, 400, "n", "must be 1"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_object"}}, 400, "response_format", "does not constrain"),
    ("/v1/chat/completions", {"messages": HI, "frequency_penalty": 2.5}, 400, "frequency_penalty",
     "less than or equal to 2"),
    ("/v1/chat/completions", {"messages": HI, "repetition_penalty": -1}, 400, "repetition_penalty",
     "greater than or equal to 0"),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"one": 5}}, 400, "logit_bias", "strings of digits"),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"1": 500}}, 400, "logit_bias", "[-100, 100]"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"100000": 1}}, 400, "logit_bias", "outside the model's"),
    ("/v1/chat/completions", {"messages": HI, "functions": [{"name": "f"}]}, 400, "functions", "send 'tools'"),
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs", "needs 'logprobs'"),
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "required"}, 400, "tool_choice", "cannot force"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function"}]}, 400, "tools[0].function", "required"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {}}]}, 400,
     "tools[0].function.name", "required"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id", "required"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     400, "messages[0].tool_calls[0].function.arguments", "not JSON"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools", "no tool support"),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": HI}, 404, "model", "not served"),
    ("/v1/completions", {"prompt": "x" * 5000}, 400, "prompt", "context window"),
    ("/v1/completions", {"prompt": [1, 2, 100000]}, 400, "prompt", "token ids"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", "less than or equal to 20"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", "not supported"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD)
def test_bad_request_gets_its_4xx_and_the_next_good_one_succeeds(attn, path, body, status, param, words):
    http = httpx.Client(base_url=attn.url, timeout=30)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and words in err["message"], err
    good = http.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_openai_client_sees_bad_requests_as_its_own_errors(attn):
    with pytest.raises(openai.NotFoundError):
        attn.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="context window"):
        attn.client.completions.create(model=MODEL, prompt=list(range(250)) * 20)
    r = httpx.get(attn.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_serve_options_are_checked():
    p = build_parser()
    args = p.parse_args(["--block-size", "auto", "--port", "9000", "--queue-size", "3"])
    assert (args.block_size, args.port, args.queue_size, args.host) == ("auto", 9000, 3, "127.0.0.1")
    assert p.parse_args(["--prompt-cache-bytes", "512M"]).prompt_cache_bytes == 512 << 20
    assert p.parse_args(["--prompt-cache-bytes", "2GiB"]).prompt_cache_bytes == 2 << 30
    assert p.parse_args(["--prompt-cache-bytes", "1000"]).prompt_cache_bytes == 1000
    for bad in (["--block-size", "0"], ["--block-size", "big"], ["--queue-size", "0"], ["--snapshots", "-1"],
                ["--prompt-cache-bytes", "lots"], ["--prompt-cache-bytes", "-5M"]):
        with pytest.raises(CLIError, match=bad[0]):
            p.parse_args(bad)
    with pytest.raises(CLIError, match="max tokens"):
        load_worker(p.parse_args(["--max-tokens", "0"]))  # checked before anything loads


def test_lazily_loaded_weights_are_served_from_the_worker_thread():
    # mlx-lm loads weights lazily, and a draft's vocabulary ids may be lazy too:
    # arrays still lazy on the loading thread cannot be evaluated on the worker's.
    import mlx.core as mx
    from mlx.utils import tree_map

    model, tok = tiny_target("llama", seed=2, layer_types=None, sliding_window=None)
    draft = random_draft(model, block_size=4)
    model.update(tree_map(lambda p: p * 1.0, model.parameters()))
    draft.set_vocab(mx.arange(0, 300))
    with serving(model, draft, tok) as s:
        ids = s.worker.encode_text("lazy")
        r = s.client.completions.create(model=MODEL, prompt="lazy", max_tokens=6)
        assert r.choices[0].text == expected(s, ids, 6)[0]


def test_sigterm_stops_the_served_process_cleanly(tmp_path):
    """`dflash-mlx serve` as its own process: SIGTERM mid-stream ends the stream and the process."""
    from dflash_mlx.models.draft.checkpoints import save_draft
    from gguf_helpers import write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    save_draft(random_draft(model, num_layers=1, block_size=4), tmp_path / "draft")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_mlx.cli.main", "serve", "--model", str(tmp_path / "tiny.gguf"),
         "--draft", str(tmp_path / "draft"), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else "slow start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"prompt": "hello", "max_tokens": 3000, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]  # the stream ends: the worker is cancelled at its next cycle
        events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "shutting_down" and rest[-1] == "data: [DONE]"
        # uvicorn shuts down, then re-raises the signal it caught: "terminated by SIGTERM", as it should be
        assert proc.wait(timeout=30) == -signal.SIGTERM
        out = proc.stdout.read()
        assert "Finished server process" in out and "Traceback" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_completion_keeps_the_first_tokens_leading_space():
    # mlx-lm's BPE detokenizer drops the first token's leading space (right for a chat
    # answer); a completion continues its prompt, so the space must stay.
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

    model, tok = chain_target("ab cd")
    tok = TokenizerWrapper(tok._tokenizer, BPEStreamingDetokenizer)
    draft = random_draft(model, block_size=4)
    engine_text = "".join(r.text for r in stream_generate(model, draft, tok, "b", max_tokens=4, block_size="draft"))
    assert engine_text == "cda"
    with serving(model, draft, tok) as s:
        assert s.client.completions.create(model=MODEL, prompt="b", max_tokens=4).choices[0].text == " cda"
        chunks = s.client.completions.create(model=MODEL, prompt="b", max_tokens=4, stream=True)
        assert "".join(c.choices[0].text for c in chunks) == " cda"
        assert s.client.completions.create(model=MODEL, prompt="a", max_tokens=3).choices[0].text == "b c"


def test_text_held_back_for_a_stop_string_is_sent_when_the_answer_ends():
    import mlx.core as mx
    import numpy as np

    model, tok = chain_target("abcd")
    head = np.array(model.lm_head.weight)
    head[EOS_ID] = 2 * head[tok.encode("d", add_special_tokens=False)[0]]  # after "c" comes EOS
    model.lm_head.weight = mx.array(head)
    ids = tok.encode("a")
    assert greedy_reference(model, ids, 5)[:3] == tok.encode("bc", add_special_tokens=False) + [EOS_ID]
    with serving(model, random_draft(model, block_size=4), tok) as s:
        for stream in (False, True):
            args = dict(model=MODEL, prompt="a", max_tokens=5, stop=["cX"])
            if stream:
                text = "".join(c.choices[0].text for c in s.client.completions.create(stream=True, **args))
            else:
                text = s.client.completions.create(**args).choices[0].text
            assert text == "bc"  # "c" waited to see whether "X" followed; EOS came instead


# -- the typed protocol -------------------------------------------------------------


def test_openapi_describes_every_body(attn):
    spec = httpx.get(attn.url + "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, request, answer in (
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletion"),
        ("/v1/completions", "CompletionRequest", "Completion"),
        ("/v1/messages", "MessagesRequest", "MessageResponse"),
        ("/v1/messages/count_tokens", "AnthropicPrompt", "TokenCount"),
    ):
        op = spec["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + request)
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + answer)
        error = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + error)
    roles = {m["properties"]["role"].get("const") or tuple(m["properties"]["role"].get("enum", ()))
             for m in (schemas[n] for n in ("SystemMessage", "UserMessage", "AssistantMessage", "ToolMessage"))}
    assert roles == {("system", "developer"), "user", "assistant", "tool"}


def test_fields_that_change_nothing_are_accepted(attn):
    messages = [{"role": "developer", "content": [{"type": "text", "text": "harmless"}]},
                {"role": "user", "content": "fields"}]
    text, _ = expected(attn, chat_ids(attn, [{"role": "system", "content": "harmless"}, messages[1]]), 6)
    r = attn.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, user="u1", metadata={"k": "v"}, store=False, n=1,
        response_format={"type": "text"}, frequency_penalty=0, presence_penalty=0, tool_choice="none",
        extra_body={"some_future_field": 1})
    assert r.choices[0].message.content == text


def test_mlx_lm_server_command_lines(attn, monkeypatch):
    """mlx_lm.server's flags: --decode-concurrency (--max-batch), --prompt-cache-size (--snapshots),
    --prefill-step-size (the engine's prompt chunks), --allowed-origins (CORS, "*" by default, as mlx-lm's),
    --chat-template, --log-level, --draft-model and --num-draft-tokens (a small-model draft: checked before anything
    loads); its --pipeline is refused in one line before anything loads."""
    from starlette.testclient import TestClient

    import dflash_mlx.serve.cli as serve_cli
    from dflash_mlx.serve.app import create_app

    p = build_parser()
    args = p.parse_args(["--decode-concurrency", "3", "--prompt-cache-size", "2", "--prefill-step-size", "64",
                         "--allowed-origins", "http://a.example, http://b.example", "--log-level", "debug",
                         "--chat-template", "{{ messages[-1]['content'] }}", "--prompt-concurrency", "4"])
    assert (args.max_batch, args.snapshots, args.prefill_step_size, args.log_level) == (3, 2, 64, "DEBUG")
    assert args.allowed_origins == ["http://a.example", "http://b.example"] and p.parse_args([]).allowed_origins == ["*"]
    with pytest.raises(CLIError, match="^--pipeline \\(mlx-lm's\\): "):
        load_worker(p.parse_args(["--pipeline"]))
    with pytest.raises(CLIError, match="^--num-draft-tokens sizes a --draft-model's drafts"):
        load_worker(p.parse_args(["--num-draft-tokens", "3"]))
    with pytest.raises(CLIError, match="no such file or folder for the draft: /no/such/small-model"):
        load_worker(p.parse_args(["--draft-model", "/no/such/small-model"]))
    model, tok = tiny_target("llama", seed=3, layer_types=None, sliding_window=None)
    monkeypatch.setattr(serve_cli, "load_model_and_draft", lambda *a, **kw: (model, tok, None, None))
    worker = load_worker(p.parse_args(["--chat-template", "{{ messages[-1]['content'] }}!", "--max-batch", "2",
                                       "--prefill-step-size", "5", "--baseline"]))
    try:
        assert worker.encode_chat([{"role": "user", "content": "hi"}]) == worker.encode_text("hi!")
        assert worker.engine.prefill_chunk == 5
    finally:
        worker.stop()
    anyone = TestClient(create_app(attn.worker))  # (no lifespan: the fixture's worker keeps running)
    r = anyone.get("/health", headers={"Origin": "http://elsewhere.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    listed = TestClient(create_app(attn.worker, ["http://a.example"]))
    r = listed.options("/v1/chat/completions", headers={"Origin": "http://a.example",
                                                        "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://a.example"
    r = listed.get("/health", headers={"Origin": "http://elsewhere.example"})
    assert "access-control-allow-origin" not in r.headers
