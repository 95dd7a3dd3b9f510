"""Agents on `dflash-mlx serve`: OpenAI tool calls, the Anthropic Messages API and logprobs,
through the real engine with a draft, with the official `openai` and `anthropic` clients.

The target (`testing.tool_call_target`) is a tiny llama built to emit a fixed tool call
greedily after a user turn and a fixed answer after a tool result; its chat template, written
for it, is tool-capable in the form mlx-lm's json_tools parser reads. Every expected answer
comes from `generate` on the same prompt.
"""

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)

import json

import httpx
import mlx.core as mx
import pytest

from dflash_mlx import generate, stream_generate
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.testing.targets import (EOS_ID, TOOL_CALL_TOKENS, TOOL_ANSWER_TOKENS, TOOL_TEMPLATE, greedy_reference,
                                tiny_target, tool_call_target, tool_call_tokenizer)
from dflash_mlx.tool_calls import ToolCallStream
from test_server import MODEL, serving

CALL = "".join(TOOL_CALL_TOKENS)
ANSWER = "".join(TOOL_ANSWER_TOKENS)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def agent():
    model, tok = tool_call_target()
    import anthropic  # (here, not at collection: its import takes ~1 s of each pytest worker)

    with serving(model, random_draft(model, block_size=4), tok, template=None) as s:
        s.anthropic = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)
        yield s


def engine_text(s, messages, tools=TOOLS, max_tokens=32):
    """`generate` on the prompt the server builds, checked against the target's own greedy decode."""
    ids = s.worker.encode_chat(messages, tools=tools)
    text = generate(s.model, s.draft, s.tok, ids, max_tokens=max_tokens, block_size=4)
    want = greedy_reference(s.model, ids, max_tokens, stop_ids=[EOS_ID])
    assert text == s.tok.decode([t for t in want if t != EOS_ID])
    return ids, text


def parsed(text):
    """The calls in `text` by the tokenizer's own mlx-lm parser."""
    s = ToolCallStream(tool_call_tokenizer(), TOOLS)
    events = s.feed(text) + s.finish()
    return [c for kind, v in events if kind == "calls" for c in v]


def test_tool_parser_is_inferred_as_mlx_lm_infers_it(tmp_path, monkeypatch):
    from mlx_lm.tokenizer_utils import load as mlx_lm_load_tokenizer

    from dflash_mlx.models.gguf.loader import load_gguf
    from gguf_helpers import write_tiny_gguf

    tok = tool_call_tokenizer()
    tok._tokenizer.save_pretrained(tmp_path / "folder")
    theirs = mlx_lm_load_tokenizer(tmp_path / "folder")  # what mlx-lm's own loader infers
    assert theirs.has_tool_calling and theirs.tool_parser.__module__ == "mlx_lm.tool_parsers.json_tools"
    assert tok.tool_parser is theirs.tool_parser and tok.tool_call_start == "<tool_call>"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "tools.gguf", "llama", chat_template=TOOL_TEMPLATE)
    _, gguf_tok, _ = load_gguf(tmp_path / "tools.gguf", progress=lambda *a: None)
    assert gguf_tok.tool_parser is theirs.tool_parser and gguf_tok.tool_call_end == "</tool_call>"
    write_tiny_gguf(tmp_path / "plain.gguf", "llama", chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not load_gguf(tmp_path / "plain.gguf", progress=lambda *a: None)[1].has_tool_calling


def test_tool_call_stream_keeps_text_and_gives_back_what_it_cannot_parse():
    tok = tool_call_tokenizer()
    s = ToolCallStream(tok, TOOLS)
    pieces = [CALL[:5], CALL[5:40], CALL[40:] + " after"]
    events = [e for p in pieces for e in s.feed("before " + p if p is pieces[0] else p)] + s.finish()
    assert events[0] == ("text", "before ") and events[-1] == ("text", " after")
    assert [e for e in events if e[0] == "calls"] == [("calls", [{"name": "get_weather", "arguments": {"city": "Paris"}}])]
    s = ToolCallStream(tok, TOOLS)
    broken = "<tool_call>{not json}</tool_call>"
    assert "".join(v for _, v in s.feed(broken) + s.finish()) == broken  # never dropped
    s = ToolCallStream(tok, TOOLS)
    assert "".join(v for _, v in s.feed(CALL[:30]) + s.finish()) == CALL[:30]  # cut off by max_tokens


def openai_turn(s, messages, stream, **kw):
    """(content, tool calls as dicts, finish reason) from the openai client, streamed or not."""
    args = dict(model=MODEL, messages=messages, tools=TOOLS, max_tokens=32, **kw)
    if not stream:
        r = s.client.chat.completions.create(**args)
        c = r.choices[0]
        calls = [tc.model_dump() for tc in c.message.tool_calls or []]
        return c.message.content, calls, c.finish_reason
    content, calls, finish = "", {}, None
    for chunk in s.client.chat.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:  # reassembled as OpenAI documents deltas
            call = calls.setdefault(tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            call["id"] += tc.id or ""
            call["function"]["name"] += tc.function.name or ""
            call["function"]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_openai_agent_loop_is_the_engines_greedy_output(agent, stream):
    _, text = engine_text(agent, QUESTION)
    assert text == CALL
    content, calls, finish = openai_turn(agent, QUESTION, stream)
    assert content is None and finish == "tool_calls" and len(calls) == 1
    call = calls[0]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert [{"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])}] == parsed(text)

    # the tool runs; its result goes back with the assistant's call
    turn2 = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 22 C"}]
    _, answer = engine_text(agent, [QUESTION[0], {"role": "assistant", "content": "", "tool_calls": [
        dict(call, function={"name": "get_weather", "arguments": {"city": "Paris"}})]}, turn2[2]])
    assert answer == ANSWER
    content, calls, finish = openai_turn(agent, turn2, stream)
    assert (content, calls, finish) == (ANSWER, [], "stop")


def test_streamed_tool_call_deltas_reassemble_to_the_whole_call(agent):
    _, whole, _ = openai_turn(agent, QUESTION, stream=False)
    _, streamed, _ = openai_turn(agent, QUESTION, stream=True)
    for c in whole + streamed:
        c.pop("id")
    assert streamed == whole and len(whole) == 1


def test_one_call_asked_for_ends_the_answer_at_the_call(agent):
    _, calls, finish = openai_turn(agent, QUESTION, stream=False, parallel_tool_calls=False)
    assert finish == "tool_calls" and [c["function"]["name"] for c in calls] == ["get_weather"]
    m = anthropic_turn(agent, QUESTION, stream=True, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use" and [b.name for b in m.content] == ["get_weather"]


def test_tool_choice_none_and_tool_less_requests_give_the_raw_text(agent):
    r = agent.client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none",
                                             max_tokens=32)
    _, text = engine_text(agent, QUESTION, tools=None)  # 'none': the tools are not rendered
    assert r.choices[0].message.content == text and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def anthropic_tools():
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in TOOLS]


def anthropic_turn(s, messages, stream, **kw):
    args = dict(dict(model=MODEL, max_tokens=32, messages=messages, tools=anthropic_tools()), **kw)
    if not stream:
        return s.anthropic.messages.create(**args)
    with s.anthropic.messages.stream(**args) as events:
        kinds = [e.type for e in events]
        message = events.get_final_message()
    # the documented sequence: message_start, blocks (start, deltas, stop), message_delta, message_stop
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == len(message.content)
    return message


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_agent_loop_is_the_engines_greedy_output(agent, stream):
    ids, text = engine_text(agent, QUESTION)
    m = anthropic_turn(agent, QUESTION, stream)
    assert m.stop_reason == "tool_use" and m.model == MODEL and m.role == "assistant"
    assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", c["name"], c["arguments"]) for c in parsed(text)]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids)  # Anthropic's split
    assert m.usage.output_tokens == len(agent.tok.encode(text)) + 1  # + EOS
    use = m.content[0]
    assert use.id.startswith("toolu_")
    turn2 = QUESTION + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 22 C"}]},
    ]
    m2 = anthropic_turn(agent, turn2, stream)
    assert m2.stop_reason == "end_turn"
    assert [(b.type, b.text) for b in m2.content] == [("text", ANSWER)]
    _, answer = engine_text(agent, [QUESTION[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": use.input}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny, 22 C"}])
    assert answer == ANSWER


def test_anthropic_stream_tool_use_input_reassembles_to_the_whole_call(agent):
    whole = anthropic_turn(agent, QUESTION, stream=False)
    with agent.anthropic.messages.stream(model=MODEL, max_tokens=32, messages=QUESTION, tools=anthropic_tools()) as ev:
        partial = "".join(e.delta.partial_json for e in ev if e.type == "content_block_delta"
                          and e.delta.type == "input_json_delta")
    assert json.loads(partial) == whole.content[0].input


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_system_stop_sequences_and_max_tokens(agent, stream):
    turn = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "rain"}]}]
    m = anthropic_turn(agent, turn, stream, system="be brief", stop_sequences=["22°"])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "22°")
    assert [b.text for b in m.content] == ["Sunny and "]
    m = anthropic_turn(agent, turn, stream, max_tokens=1)
    assert m.stop_reason == "max_tokens" and [b.text for b in m.content] == ["Sunny"]


def test_anthropic_count_tokens_and_errors(agent):
    import anthropic

    n = agent.anthropic.messages.count_tokens(model=MODEL, messages=QUESTION, tools=anthropic_tools())
    assert n.input_tokens == len(agent.worker.encode_chat(QUESTION, tools=TOOLS))
    with pytest.raises(anthropic.NotFoundError) as e:
        agent.anthropic.messages.create(model="claude-x", max_tokens=4, messages=QUESTION)
    assert e.value.body["error"]["type"] == "not_found_error" and "not served" in e.value.body["error"]["message"]
    for body, words in (
        ({"model": MODEL, "messages": QUESTION}, "'max_tokens': is required"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "wizard", "content": "x"}]}, "'messages[0].role'"),
        ({"model": MODEL, "max_tokens": 4, "messages": QUESTION, "tool_choice": {"type": "any"}}, "cannot force"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
         "'messages[0].content[0]': unknown type 'image'"),
        ({"model": MODEL, "max_tokens": 4, "messages": QUESTION, "system": 5}, "'system': Input should be a valid string"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "'messages[0].content[0].text': is required"),
        ({"model": MODEL, "max_tokens": 4, "messages": QUESTION, "tools": [{"name": "f"}]},
         "'tools[0].input_schema': is required"),
    ):
        r = httpx.post(agent.url + "/v1/messages", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and words in r.json()["error"]["message"], r.text


def test_tools_on_a_template_without_tool_support_get_a_clear_400():
    model, tok = tiny_target("llama", seed=0, layer_types=None, sliding_window=None)
    with serving(model, None, tok) as s:
        r = httpx.post(s.url + "/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": QUESTION,
                                                     "tools": anthropic_tools()}, timeout=30)
        assert r.status_code == 400 and "no tool support" in r.json()["error"]["message"]


# -- logprobs -------------------------------------------------------------------------


def forward_logprobs(model, ids, tokens):
    """log-softmax of a plain mlx-lm forward over prompt + tokens, at each emitted token."""
    logits = model(mx.array(ids + tokens)[None])[0, len(ids) - 1 : -1].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return logp, mx.take_along_axis(logp, mx.array(tokens)[:, None], axis=-1)[:, 0]


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_engine_logprobs_are_the_targets_own_log_softmax(temperature):
    from dflash_mlx.testing.targets import ScriptedDraft, clean_case
    from dflash_mlx.models.target.adapter import Target

    model, tok = tiny_target("llama", seed=1, layer_types=None, sliding_window=None)
    ids, ref = clean_case(model, 24, 40, seed=5)
    # an oracle draft at T=0 (whole blocks accepted: both pieces of the split LM head), a random one when sampling
    draft = ScriptedDraft(Target(model), ids + ref, lambda c: 10**9, block_size=8) if temperature == 0 else \
        random_draft(model, block_size=8)
    tokens, lps = [], []
    for r in stream_generate(model, draft, tok, ids, max_tokens=40, block_size=8, temperature=temperature,
                             seed=7, logprobs=3):
        tokens += r.tokens
        lps += r.logprobs
    if temperature == 0:
        assert tokens == ref[: len(tokens)]  # lossless with logprobs on
    logp, want = forward_logprobs(model, ids, tokens)
    assert [t.token for t in lps] == tokens
    assert mx.abs(mx.array([t.logprob for t in lps]) - want).max().item() < 1e-4
    top = mx.argsort(-logp, axis=-1)[:, :3].tolist()
    assert [[i for i, _ in t.top] for t in lps] == top


def test_logprobs_over_http_match_the_forward(agent):
    ids = agent.worker.encode_chat(QUESTION, tools=TOOLS)
    r = agent.client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=32,
                                             logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    tokens = agent.tok.encode(CALL, add_special_tokens=False)
    _, want = forward_logprobs(agent.model, ids, tokens)
    assert [c.token for c in content] == TOOL_CALL_TOKENS
    assert max(abs(c.logprob - w) for c, w in zip(content, want.tolist())) < 1e-4
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    prompt = "Sunny"
    c = agent.client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=1)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text == " and 22°C in Paris."
    assert lp.text_offset == [0, len(" and 22°C")]
    _, want = forward_logprobs(agent.model, agent.worker.encode_text(prompt),
                               agent.tok.encode(c.choices[0].text, add_special_tokens=False))
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs, want.tolist())) < 1e-4
