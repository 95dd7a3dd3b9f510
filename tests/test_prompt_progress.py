"""`prompt_progress_callback` (mlx-lm's): the library reports a prompt's prefill as mlx-lm's `generate_step`
does, over the tokens a reused prompt cache does not hold; the CLI shows a long one on a terminal."""

import io

import mlx.core as mx
from mlx_lm.generate import generate_step

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.cli.common import prompt_progress
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.testing.targets import tiny_target


def _calls(fn, *args, **kwargs):
    calls = []
    for _ in fn(*args, prompt_progress_callback=lambda done, total: calls.append((done, total)), **kwargs):
        pass
    return calls


def test_the_calls_are_mlx_lm_s():
    model, tok = tiny_target("qwen3")
    draft = random_draft(model, block_size=8, num_layers=1)
    for length, step in ((39, 16), (1, 16), (17, 16), (40, 2048)):
        prompt = [(7 * i) % 200 + 1 for i in range(length)]
        want = _calls(generate_step, mx.array(prompt), model, max_tokens=3, prefill_step_size=step)
        assert _calls(stream_generate, model, draft, tok, prompt, max_tokens=3, prefill_step_size=step) == want
        assert want[0] == (0, length) and want[-1] == (length, length)


def test_a_reused_prompt_cache_reports_only_the_new_tokens():
    model, tok = tiny_target("qwen3")
    draft = random_draft(model, block_size=8, num_layers=1)
    cache = make_prompt_cache(model, draft)
    prompt = list(range(1, 30))
    answer = [t for r in stream_generate(model, draft, tok, prompt, max_tokens=5, prompt_cache=cache) for t in r.tokens]
    follow = prompt + answer + list(range(40, 50))
    held = len(cache.tokens)  # (the prompt and the answer but its last token: all a prefix of `follow`)
    calls = _calls(stream_generate, model, draft, tok, follow, max_tokens=3, prompt_cache=cache)
    new = len(follow) - held
    assert calls[0] == (0, new) and calls[-1] == (new, new) and 10 <= new <= 11  # (the answer's last token, then 10)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_cli_shows_a_long_prompt_on_a_terminal_only():
    term = _Terminal()
    show = prompt_progress(term, at_least=100)
    for done in (0, 64, 128, 150):
        show(done, 150)
    out = term.getvalue()
    assert "prompt 150/150 tokens" in out and "ETA 0:00:00" in out and out.endswith("\r\033[K")
    term = _Terminal()
    show = prompt_progress(term, at_least=100)
    show(0, 40), show(40, 40)  # a short prompt: nothing
    assert term.getvalue() == ""
    assert prompt_progress(io.StringIO()) is None  # not a terminal: no callback
