"""Arguments for the chat template (mlx-lm's `--chat-template-config`, its server's `--chat-template-args` and
request field `chat_template_kwargs`, e.g. Qwen3's {"enable_thinking": false}) reach the template in every
front end: the one-shot CLI, the chat and the server (a request's own over the server's)."""

import pytest

from dflash_mlx.models.loading import apply_chat_template
from dflash_mlx.testing.targets import byte_tokenizer

# a template that shows what it was given
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
            "{% if style is defined %}<{{ style }}>{% endif %}<assistant>")


def _tokenizer():
    tok = byte_tokenizer()
    tok._tokenizer.chat_template = TEMPLATE
    return tok


def test_the_library_passes_them_to_the_template():
    tok = _tokenizer()  # (mlx-lm's wrapper says enable_thinking=False where the tokenizer has no thinking tokens)
    assert apply_chat_template(tok, "hi") == "<user>hi<no-think><assistant>"
    assert apply_chat_template(tok, "hi", template_kwargs={"enable_thinking": True}) == "<user>hi<assistant>"
    assert apply_chat_template(tok, "hi", template_kwargs={"style": "terse"}) == "<user>hi<no-think><terse><assistant>"


def test_the_cli_takes_a_json_object(capsys, monkeypatch):
    import json

    import dflash_mlx.models.loading as loading
    from dflash_mlx.cli.main import main
    from dflash_mlx.testing.targets import tiny_target

    model, _ = tiny_target("qwen3")
    tok = _tokenizer()
    monkeypatch.setattr(loading, "load", lambda name, **kw: (model, tok))
    seen = []
    real = loading.apply_chat_template
    monkeypatch.setattr(loading, "apply_chat_template", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    code = main(["--model", "tests/tiny-qwen3", "--max-tokens", "2", "--json",
                 "--chat-template-config", '{"enable_thinking": true, "style": "terse"}', "hi"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert seen == ["<user>hi<terse><assistant>"] and json.loads(out)["tokens"]
    for bad, words in (("{bad", "not JSON"), ("[1, 2]", "a JSON object of the template's arguments")):
        code = main(["--chat-template-config", bad, "hi"])
        _, err = capsys.readouterr()
        assert code == 2 and err.count("\n") == 1 and words in err, err


def test_the_chat_renders_with_them():
    from dflash_mlx.testing.targets import tiny_target
    from dflash_mlx.tui.cli import build_parser
    from dflash_mlx.tui.session import ChatSession

    model, _ = tiny_target("qwen3")
    session = ChatSession(model, _tokenizer(), None, template_kwargs={"enable_thinking": True, "style": "a"})
    want = _tokenizer().encode("<user>hi<a><assistant>", add_special_tokens=False)
    assert session.prompt_ids([{"role": "user", "content": "hi"}])[-len(want):] == want
    args = build_parser().parse_args(["--chat-template-config", '{"enable_thinking": false}'])
    assert args.chat_template_config == {"enable_thinking": False}


def test_the_server_uses_its_own_and_the_request_s():
    from dflash_mlx.serve.requests import RequestError
    from dflash_mlx.serve.worker import Worker
    from dflash_mlx.testing.targets import tiny_target

    model, _ = tiny_target("qwen3")
    worker = Worker(model, None, _tokenizer(), model_name="tiny", chat_template_args={"enable_thinking": True,
                                                                                      "style": "s"})
    hi = [{"role": "user", "content": "hi"}]
    text = lambda ids: worker.tokenizer.decode(ids)  # noqa: E731
    assert text(worker.encode_chat(hi)).endswith("<user>hi<s><assistant>")
    assert text(worker.encode_chat(hi, template_kwargs={"enable_thinking": False})).endswith(
        "<user>hi<no-think><s><assistant>")  # (the request's over the server's, the rest kept)
    worker = Worker(model, None, _tokenizer(), model_name="tiny")
    assert text(worker.encode_chat(hi)).endswith("<user>hi<no-think><assistant>")
    broken = _tokenizer()
    broken._tokenizer.chat_template = "{{ raise_exception('no ' + style) }}"
    with pytest.raises(RequestError, match="chat template refused the messages: no thinking"):
        Worker(model, None, broken, model_name="tiny").encode_chat(hi, template_kwargs={"style": "thinking"})


def test_a_chat_request_s_chat_template_kwargs_reach_the_template():
    from dflash_mlx.testing.targets import tiny_target
    from test_server import MODEL, serving

    model, _ = tiny_target("qwen3")
    tok = _tokenizer()
    with serving(model, None, tok, template=TEMPLATE, chat_template_args={"style": "s"}) as s:
        hi = [{"role": "user", "content": "hi"}]
        for kwargs, rendered in (({}, "<user>hi<no-think><s><assistant>"),
                                 ({"chat_template_kwargs": {"enable_thinking": True}}, "<user>hi<s><assistant>")):
            r = s.client.chat.completions.create(model=MODEL, messages=hi, max_tokens=1, extra_body=kwargs)
            assert r.usage.prompt_tokens == len(s.worker.encode_text(rendered)), (kwargs, rendered)
        bad = s.client.with_options(max_retries=0).chat.completions
        with pytest.raises(Exception, match="chat_template_kwargs"):
            bad.create(model=MODEL, messages=hi, max_tokens=1, extra_body={"chat_template_kwargs": [1]})


def test_a_prefill_response_is_continued(capsys, monkeypatch):
    """mlx-lm's `--prefill-response`: the answer's start is the template's last assistant message, continued
    (`continue_final_message`), and the answer is the model's greedy continuation of that prompt."""
    import json

    import dflash_mlx.models.loading as loading
    from dflash_mlx.cli.main import main
    from dflash_mlx.engine.responses import wrap_tokenizer
    from dflash_mlx.generate import encode_prompt
    from gguf_helpers import load_packaged
    from dflash_mlx.testing.targets import greedy_reference

    tok = _tokenizer()
    assert apply_chat_template(tok, "hi", prefill_response="Sure") == "<user>hi<assistant>Sure"
    model, smol = load_packaged("smollm2-135m")
    text = apply_chat_template(smol, "Name a colour.", prefill_response="My favourite colour is")
    assert text.endswith("<|im_start|>assistant\nMy favourite colour is")
    monkeypatch.setattr(loading, "load", lambda name, **kw: (model, smol))
    code = main(["--max-tokens", "6", "--json", "--prefill-response", "My favourite colour is", "Name a colour."])
    out, err = capsys.readouterr()
    assert code == 0, err
    ref = greedy_reference(model, encode_prompt(wrap_tokenizer(smol), text), 6)
    assert json.loads(out)["tokens"] == ref[: len(json.loads(out)["tokens"])] and json.loads(out)["tokens"]
