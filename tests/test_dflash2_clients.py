"""A DFlash 2 draft, written to a folder in z-lab's layout, through every client that takes
`--draft PATH`: the one-shot CLI, the chat app (headless) and the benchmarks; each must give
the target's own greedy tokens (the same as `--baseline`)."""

import asyncio
import json
import time

import pytest

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)
from dflash_mlx.cli.main import main as cli_main
from dflash_mlx.models.draft.checkpoints import random_draft, save_draft
from gguf_helpers import write_tiny_gguf

MAX = 12


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("dflash2")
    model = write_tiny_gguf(d / "tiny.gguf", "llama")
    save_draft(random_draft(model, num_layers=2, block_size=4, version=2, seed=5), d / "draft2")
    assert json.loads((d / "draft2" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    return d


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))


def one_shot(capsys, files, *flags):
    code = cli_main(["--model", str(files / "tiny.gguf"), "--max-tokens", str(MAX), "--json", *flags,
                     "the quick brown fox"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_cli_dflash2_draft_equals_baseline(files, capsys):
    base = one_shot(capsys, files, "--baseline")
    assert len(base["tokens"]) > 1
    for block in ("4", "auto"):
        r = one_shot(capsys, files, "--draft", str(files / "draft2"), "--block-size", block)
        assert r["tokens"] == base["tokens"], block
        assert r["draft"] == str(files / "draft2") and r["accept_lengths"]


def test_chat_app_with_dflash2_draft(files):
    """`dflash-mlx chat --model M --draft PATH`: the app loads both itself; two turns
    (the second through the prompt cache) give the target's greedy answers."""
    from dflash_mlx import load
    from dflash_mlx.generate import encode_prompt
    from dflash_mlx.testing.targets import greedy_reference
    from dflash_mlx.tui.app import ChatApp
    from dflash_mlx.tui.session import Settings
    from dflash_mlx.tui.template import render_prompt

    app = ChatApp(model_name=str(files / "tiny.gguf"), draft_name=str(files / "draft2"),
                  settings=Settings(max_tokens=MAX))

    async def wait_for(pilot, cond, what):
        end = time.monotonic() + 60
        while not cond():
            assert time.monotonic() < end, f"timed out waiting for {what}"
            await pilot.pause(0.02)

    async def ask(pilot, text):
        n = app.turns
        app.query_one("#prompt").value = text
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.turns > n, "the answer")
        await pilot.pause(0.05)
        return app._last_turn

    async def go():
        async with app.run_test(size=(110, 40)) as pilot:
            await wait_for(pilot, lambda: app.session is not None, "the models to load")
            return await ask(pilot, "hello"), await ask(pilot, "and then?")

    first, second = asyncio.run(go())
    assert type(app.session.draft).__name__ == "DFlash2DraftModel"
    model, tok = load(str(files / "tiny.gguf"), quiet=True)
    messages = [{"role": "user", "content": "hello"}]
    assert first.tokens == greedy_reference(model, encode_prompt(tok, render_prompt(tok, messages)), MAX)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and then?"}]
    ids2 = encode_prompt(tok, render_prompt(tok, messages))
    assert second.prompt_ids == ids2
    assert second.tokens == greedy_reference(model, ids2, MAX)[: len(second.tokens)]
    assert second.stats.prefill_tokens < len(ids2)  # the cache was reused


def test_bench_with_dflash2_draft(files, tmp_path):
    from dflash_mlx.bench import cli as bench_cli

    out = tmp_path / "run"
    rc = bench_cli.main(["--model", str(files / "tiny.gguf"), "--draft", str(files / "draft2"),
                         "--suite", "gsm8k", "--limit", "1", "--max-tokens", "8", "--block-sizes", "4,auto",
                         "--forward-reps", "1", "--no-plots", "--no-warmup", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    records = [rec for p in doc["prompts"] for rec in p["dflash"].values()]
    assert len(records) == 2 and all(rec["tokens_match"] is True for rec in records)
