"""A real tool-call transcript of `dflash-mlx serve`, for the README.

Serves `dflash_mlx.testing.targets.tool_call_target` (a tiny target that calls get_weather
greedily, with a tool-capable chat template) with a random draft through the real
engine, on a free loopback port, and prints the raw HTTP exchanges of a whole agent
loop (the question, the model's tool call, the tool's result, the answer) for the
OpenAI and the Anthropic APIs, and a streamed tool call, as Markdown.

    python benchmarks/server_tool_transcript.py > transcript.md
"""

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)

import json

import httpx

from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.serve.worker import Worker
from dflash_mlx.testing.serving import http_server
from dflash_mlx.testing.targets import tool_call_target

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def short(obj):
    """The response without the engine statistics block (it is in every usage)."""
    obj = json.loads(json.dumps(obj))
    if isinstance(obj.get("usage"), dict) and "dflash" in obj["usage"]:
        obj["usage"]["dflash"] = {k: obj["usage"]["dflash"][k] for k in ("tau", "cycles", "block_size")}
    return obj


def show(title, path, body, response, tools_shown=False):
    shown = dict(body, tools="(as above)") if tools_shown else body
    print(f"**{title}**: `POST {path}`\n\n```json\n{json.dumps(shown, ensure_ascii=False)}\n```\n")
    print(f"answer ({response.status_code}):\n\n```json\n{json.dumps(short(response.json()), indent=1, ensure_ascii=False)}"
          "\n```\n")


def main():
    model, tok = tool_call_target()
    worker = Worker(model, random_draft(model, block_size=4), tok, model_name="tool-target", draft_name="random")
    with http_server(worker) as url:
        http = httpx.Client(base_url=url, timeout=60)
        print("### OpenAI chat completions\n")
        q = [{"role": "user", "content": "What is the weather in Paris?"}]
        body = {"model": "tool-target", "messages": q, "tools": TOOLS, "max_tokens": 64}
        r = http.post("/v1/chat/completions", json=body)
        show("1. the question, with the tools", "/v1/chat/completions", body, r)
        call = r.json()["choices"][0]["message"]["tool_calls"][0]
        body2 = dict(body, messages=q + [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"sky": "sunny", "celsius": 22})}])
        show("2. the tool's result goes back", "/v1/chat/completions", body2, http.post("/v1/chat/completions", json=body2),
             tools_shown=True)

        print("**the tool call streamed** (`\"stream\": true`), server-sent events as sent:\n\n```")
        with http.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as s:
            for line in s.iter_lines():
                if line:
                    print(line)
        print("```\n")

        print("### Anthropic messages\n")
        tools = [{"name": "get_weather", "description": "The weather in a city",
                  "input_schema": TOOLS[0]["function"]["parameters"]}]
        body = {"model": "tool-target", "max_tokens": 64, "messages": q, "tools": tools}
        r = http.post("/v1/messages", json=body)
        show("1. the question, with the tools", "/v1/messages", body, r)
        use = r.json()["content"][0]
        body2 = dict(body, messages=q + [
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                          "content": json.dumps({"sky": "sunny", "celsius": 22})}]}])
        show("2. the tool's result goes back", "/v1/messages", body2, http.post("/v1/messages", json=body2),
             tools_shown=True)
        print("**the tool call streamed**, Anthropic's events as sent:\n\n```")
        with http.stream("POST", "/v1/messages", json=dict(body, stream=True)) as s:
            for line in s.iter_lines():
                if line:
                    print(line)
        print("```")


if __name__ == "__main__":
    main()
