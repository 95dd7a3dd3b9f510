"""The chat app, headless (Textual's pilot) on tiny random models.

The tiny qwen3 target answers greedily with ':' bytes, which re-tokenize to the
same tokens, so a second turn's prompt starts with exactly the tokens the cache
holds and the reuse arithmetic below is exact.
"""

import asyncio
import threading
import time

import pytest

import dflash_mlx  # noqa: F401  (BLAS routing before mlx.core)
from dflash_mlx.testing import targets
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.generate import encode_prompt, stream_generate
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.cli.main import main as cli_main
from dflash_mlx.tui.app import ChatApp
from dflash_mlx.tui.cli import build_parser, settings_from_args
from dflash_mlx.tui.segments import CycleText
from dflash_mlx.tui.session import ChatSession, Settings
from dflash_mlx.tui.stats import TurnStats, histogram, panel_lines, sparkline
from dflash_mlx.tui.template import render_prompt, role_template
from dflash_mlx.tui.widgets import MessageView, SettingsScreen, StatsPanel

MAX = 12  # answer length in most tests: short, so each test takes well under a second


@pytest.fixture(autouse=True)
def one_proposal_kind(monkeypatch):
    """These tests follow the app's streaming cycle by cycle with a random draft that is never
    right (one token per cycle); the tiny target's answers repeat, which copy proposals would
    commit in long runs. The proposal policy is tested in test_copy_proposals.py."""
    from dflash_mlx.policy.copies import CopyPolicy
    from dflash_mlx.policy.copy_trees import CopyTreePolicy

    monkeypatch.setattr(CopyPolicy, "choose", lambda self, match, remaining, draft_width: 0)
    monkeypatch.setattr(CopyTreePolicy, "plan", lambda self, *args: None)


@pytest.fixture(scope="module")
def tiny():
    model, tok = targets.tiny_target("qwen3", seed=0)
    draft = random_draft(model, num_layers=1, block_size=4)
    return model, tok, draft


def run(app, script, size=(110, 40)):
    """Run `script(pilot)` against `app` headless; return what it returns."""

    async def go():
        async with app.run_test(size=size) as pilot:
            return await script(pilot)

    return asyncio.run(go())


async def wait_for(pilot, cond, timeout=30.0, what="condition"):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def ask(pilot, text, turns_before=None):
    app = pilot.app
    n = app.turns if turns_before is None else turns_before
    app.query_one("#prompt").value = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.turns > n, what="the answer")
    await pilot.pause(0.05)
    return app._last_turn


def notifications(app):
    return [(n.message, n.severity) for n in app._notifications]


def prompt_ids(tok, messages):
    return encode_prompt(tok, render_prompt(tok, messages))


def oracle_draft(model, tok, prompt, n, block_size=4, accept=10**9):
    """A scripted draft that knows the target's greedy answer to `prompt` (accepts up to `accept` per cycle)."""
    ids = prompt_ids(tok, [{"role": "user", "content": prompt}])
    ref = targets.greedy_reference(model, ids, n + block_size)
    return targets.ScriptedDraft(Target(model), ids + ref, lambda c: accept, block_size=block_size)


# -- plain pieces -----------------------------------------------------------------


def test_sparkline_and_histogram():
    assert sparkline([0, 3, 1], top=3) == "▁█▃"
    assert sparkline([]) == ""
    assert len(sparkline(list(range(100)), width=32)) == 32
    lines = histogram([0, 0, 2, 2, 2, 3], 4, width=6)
    assert lines == ["0 │████ 2", "1 │", "2 │██████ 3", "3 │██ 1"]


def test_role_template_history_is_a_prefix_of_the_next_prompt():
    first = role_template([{"role": "user", "content": "hi"}])
    answer = " hello"
    second = role_template([
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": answer},
        {"role": "user", "content": "more"},
    ])
    assert second.startswith(first + answer)
    assert first == "User: hi\nAssistant:"


def test_cycle_text_holds_back_split_characters(tiny):
    _, tok, _ = tiny
    ids = tok.encode("é!", add_special_tokens=False)  # 'é' is two byte tokens
    assert len(ids) == 3
    ct = CycleText(tok, stop_ids=tok.eos_token_ids)
    assert ct.add(ids[:1], [False]) == []  # half a character: nothing to show yet
    segs = ct.add(ids[1:] + [targets.EOS_ID], [True, False, False])
    assert [(s.text, s.drafted, s.cycle) for s in segs] == [("é", True, 1), ("!", False, 1)]
    assert (ct.drafted, ct.bonus) == (1, 2) and ct.text == "é!"


def parse_args(argv):
    return build_parser().parse_args(argv)


def test_cli_args_and_bad_settings(capsys):
    a = parse_args(["--model", "m", "--block-size", "3", "--temperature", "0.5", "--max-tokens", "9", "--system", "S"])
    assert (a.model, a.draft, a.block_size, a.temperature, a.max_tokens, a.system) == ("m", None, 3, 0.5, 9, "S")
    assert parse_args([]).model == "smollm2-135m"
    assert parse_args([]).block_size == "auto"  # adaptive verify width, as in the one-shot CLI
    assert parse_args([]).max_tokens == 512  # the chat's own default
    assert parse_args(["--block-size", "AUTO"]).block_size == "auto"
    # refused before any model loads or the app starts, one line each
    for argv, words in ((["--max-tokens", "0"], "max tokens must be"),
                        (["--top-p", "1.5"], "top-p must be in (0, 1]"),
                        (["--block-size", "0"], "block size takes 'auto' (default), 'draft'"),
                        (["--block-size", "x"], "got 'x'"),
                        (["--model", "no-such-model"], "unknown model 'no-such-model'")):
        assert cli_main(["chat", *argv]) != 0, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("dflash-mlx chat: error: ") and words in err, err


def test_block_size_setting_values():
    assert Settings().block_size == "auto"
    for ok in ("auto", "draft", 1, 16):
        assert Settings(block_size=ok).check().block_size == ok
    assert Settings(block_size=None).check().block_size == "auto"
    for bad in (0, -3, "x", 2.5, True):
        with pytest.raises(ValueError, match=r"block size takes 'auto' \(default\), 'draft'"):
            Settings(block_size=bad).check()


# -- the app ----------------------------------------------------------------------


def test_send_prompt_streams_text_and_stats(tiny):
    model, tok, draft = tiny
    app = ChatApp(model, tok, draft, model_name="tiny-qwen3", draft_name="random-b4",
                  settings=Settings(max_tokens=MAX))

    async def script(pilot):
        turn = await ask(pilot, "hello")
        view = [v for v in app.query(MessageView) if v.role == "assistant"][0]
        return turn, view.text, view.query_one("Markdown").source, app.query_one(StatsPanel).plain

    turn, view_text, md_source, panel = run(app, script)
    ids = prompt_ids(tok, [{"role": "user", "content": "hello"}])
    expected = targets.greedy_reference(model, ids, MAX)
    assert turn.tokens == expected  # exact: DFlash greedy == the target's greedy
    assert view_text == md_source == tok.decode(expected) == turn.text
    assert len(turn.stats.accept_lengths) == MAX - 1  # one cycle per token: the random draft is never right
    for line in ("model  tiny-qwen3", "draft  random-b4", f"tokens    {MAX:8d}",
                 f"prompt    {len(ids):8d}  prefilled {len(ids)}", "tau           1.00 tokens/forward"):
        assert line in panel
    assert turn.stats.tps > 0 and "DFlash" in panel


class Gate:
    """Wraps the engine: after `after` responses it blocks until released (a slow model)."""

    def __init__(self, after):
        self.after = after
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args, **kwargs):
        for i, r in enumerate(stream_generate(*args, **kwargs)):
            yield r
            if i + 1 == self.after:
                self.reached.set()
                assert self.release.wait(20)


def test_stop_mid_answer_keeps_the_conversation(tiny):
    model, tok, draft = tiny
    gate = Gate(after=3)
    app = ChatApp(model, tok, draft, settings=Settings(max_tokens=40), stream_fn=gate)

    async def script(pilot):
        app.query_one("#prompt").value = "hello"
        await pilot.press("enter")
        await wait_for(pilot, gate.reached.is_set, what="the engine to pause")
        view = [v for v in app.query(MessageView) if v.role == "assistant"][0]
        # streamed: the partial answer is on screen while the engine is still busy
        await wait_for(pilot, lambda: view.query_one("Markdown").source == ":" * 3, what="streamed text")
        assert app.busy and "tokens           3" in app.query_one(StatsPanel).plain
        await pilot.press("escape")  # the UI answers while the engine thread is blocked
        assert app.status == "stopping"
        gate.release.set()
        await wait_for(pilot, lambda: app.turns == 1, what="the stop")
        await pilot.pause(0.05)
        stopped = app._last_turn
        assert view.note_text == "(stopped)"
        assert "finish     stopped" in app.query_one(StatsPanel).plain
        # the conversation goes on from the partial answer
        gate.after = 0
        nxt = await ask(pilot, "go on", turns_before=1)
        return stopped, nxt

    stopped, nxt = run(app, script)
    assert stopped.stopped and stopped.stats.finish == "stopped"
    assert len(stopped.tokens) == 4  # the cycle in flight when Esc came, then no more
    assert app.session.messages[:2] == [{"role": "user", "content": "hello"},
                                        {"role": "assistant", "content": "::::"}]
    assert nxt.stats.finish == "length" and len(nxt.tokens) == 40


def test_second_turn_reuses_the_cache_exactly(tiny):
    model, tok, draft = tiny
    app = ChatApp(model, tok, draft, settings=Settings(max_tokens=MAX))

    async def script(pilot):
        first = await ask(pilot, "hello")
        second = await ask(pilot, "and then?")
        return first, second, app.query_one(StatsPanel).plain

    first, second, panel = run(app, script)
    ids1 = first.prompt_ids
    ids2 = prompt_ids(tok, [{"role": "user", "content": "hello"},
                            {"role": "assistant", "content": first.text},
                            {"role": "user", "content": "and then?"}])
    assert second.prompt_ids == ids2
    assert ids2[: len(ids1) + MAX] == ids1 + first.tokens  # the answer re-tokenizes to itself
    # The cache holds prompt 1 and every answer token but the last (it was never fed
    # back), so the new turn prefills that token plus the new turn's text only.
    new = len(ids2) - (len(ids1) + MAX - 1)
    assert second.stats.prefill_tokens == new < len(ids2) // 2
    assert f"prompt    {len(ids2):8d}  prefilled {new}" in panel
    assert f"reused {len(ids2) - new}" in panel
    # exact: the same tokens as prefilling the whole conversation from scratch
    fresh = [t for r in stream_generate(model, draft, tok, ids2, max_tokens=MAX, block_size="draft") for t in r.tokens]
    assert second.tokens == fresh


def test_turn_ending_on_eos_reuses_the_cache(tiny):
    """ChatML-like: the stop token is also the template's end-of-turn marker.

    The engine never feeds the stop token to the target, the template writes it
    back after the answer, so the next prompt starts with everything cached."""
    model, _, draft = tiny
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    base = targets.byte_tokenizer()
    colon = base.encode(":", add_special_tokens=False)[0]
    tok = TokenizerWrapper(base._tokenizer, eos_token_ids=[colon])

    def chatml(messages):  # role_template with ':' closing each assistant turn
        return "".join(f"{m['content']}:\n\n" if m["role"] == "assistant" else role_template([m])
                       for m in messages)

    app = ChatApp(model, tok, draft, settings=Settings(max_tokens=MAX), template=chatml)

    async def script(pilot):
        return await ask(pilot, "hello"), await ask(pilot, "again")

    first, second = run(app, script)
    assert first.stats.finish == "stop" and first.tokens == [colon] and first.text == ""
    assert second.prompt_ids[: len(first.prompt_ids) + 1] == first.prompt_ids + [colon]
    assert second.stats.prefill_tokens == len(second.prompt_ids) - len(first.prompt_ids)


def test_settings_change_takes_effect(tiny):
    model, tok, _ = tiny
    draft = oracle_draft(model, tok, "hello", 20)  # accepts every drafted token
    calls = []

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return stream_generate(*args, **kwargs)

    # a fixed width, the draft's: "auto" would vary it and the accept lengths with it
    app = ChatApp(model, tok, draft, settings=Settings(max_tokens=MAX, block_size=4), stream_fn=recording)

    async def script(pilot):
        before = await ask(pilot, "hello")
        await pilot.press("ctrl+n")
        await pilot.press("f2")
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#block_size").value = "2"
        app.screen.query_one("#max_tokens").value = "7"
        app.screen.query_one("#temperature").value = "0"
        app.screen.query_one("#system").value = ""
        await pilot.click("#save")
        await pilot.pause(0.05)
        assert not isinstance(app.screen, SettingsScreen)
        draft.cycle = 0
        after = await ask(pilot, "hello")
        return before, after, app.query_one(StatsPanel).plain

    before, after, panel = run(app, script)
    # block 4: three drafted tokens kept per cycle (the last cycle is cut by max tokens)
    assert set(before.stats.accept_lengths[:-1]) == {3}
    assert calls[-1]["block_size"] == 2 and calls[-1]["max_tokens"] == 7
    assert len(after.tokens) == 7 and after.stats.finish == "length"
    assert set(after.stats.accept_lengths) == {1}  # block 2: one drafted token per cycle
    assert "block 2  temp 0  max 7" in panel


def test_bad_setting_is_refused_with_a_notification(tiny):
    model, tok, draft = tiny
    app = ChatApp(model, tok, draft, settings=Settings(max_tokens=MAX))

    async def script(pilot):
        await pilot.press("f2")
        return (await try_values(app, pilot, app.screen.query_one("#max_tokens"), ("lots",)))["lots"]

    still_open, notes = run(app, script)
    assert still_open
    assert any("whole number" in m and sev == "error" for m, sev in notes)
    assert app.session.settings.max_tokens == MAX


async def try_values(app, pilot, field, texts):
    """Type each text into a settings field and press Enter: {text: (dialog still open, new notes)}."""
    out = {}
    field.focus()
    for text in texts:
        field.value = text
        # by identity, not count: on a busy machine earlier toasts time out meanwhile
        seen = {id(n) for n in app._notifications}
        await pilot.press("enter")  # Enter in a field saves (a click could land on the last toast)
        for _ in range(500):  # until the refusal shows or the dialog closes (a busy machine is slow)
            await pilot.pause(0.02)
            new = [(n.message, n.severity) for n in app._notifications if id(n) not in seen]
            if new or not isinstance(app.screen, SettingsScreen):
                break
        out[text] = (isinstance(app.screen, SettingsScreen), new)
    return out


def test_settings_dialog_rejects_a_bad_top_p_and_saves_a_good_one(tiny):
    model, tok, draft = tiny
    app = ChatApp(model, tok, draft, settings=Settings(max_tokens=MAX))

    async def script(pilot):
        await pilot.press("f2")
        field = app.screen.query_one("#top_p")
        shown = field.value
        refused = await try_values(app, pilot, field, ("1.5", "0", "most"))
        field.value = "0.9"
        proposals = app.screen.query_one("#draft_sampling")
        bad_proposals = (await try_values(app, pilot, proposals, ("beam",)))["beam"]
        proposals.value = "sample"
        app.screen.query_one("#temperature").value = "0.7"
        app.screen.query_one("#seed").value = "5"
        assert app.screen.query_one("#repetition_penalty").value == ""
        penalty = app.screen.query_one("#repetition_penalty")
        bad_penalty = (await try_values(app, pilot, penalty, ("-1",)))["-1"]
        penalty.value = "1.1"
        threshold = app.screen.query_one("#xtc_threshold")
        bad_threshold = (await try_values(app, pilot, threshold, ("0.7",)))["0.7"]
        threshold.value = "0.2"
        app.screen.query_one("#xtc_probability").value = "0.5"
        await pilot.press("enter")
        await pilot.pause(0.05)
        return shown, refused, bad_proposals, (bad_penalty, bad_threshold), isinstance(app.screen, SettingsScreen)

    shown, refused, bad_proposals, (bad_penalty, bad_threshold), still_open = run(app, script)
    assert shown == "1"
    for text, (was_open, notes) in refused.items():
        assert was_open, text
        assert len(notes) == 1 and notes[0][1] == "error" and "top-p" in notes[0][0], (text, notes)
    assert "(0, 1]" in refused["1.5"][1][0][0] and "takes a number, got 'most'" in refused["most"][1][0][0]
    assert bad_proposals[0] and "draft sampling must be one of argmax, sample" in bad_proposals[1][0][0]
    assert not still_open
    s = app.session.settings
    assert bad_penalty[0] and "repetition penalty must be >= 0" in bad_penalty[1][0][0]
    assert (s.top_p, s.temperature, s.seed, s.max_tokens, s.draft_sampling) == (0.9, 0.7, 5, MAX, "sample")
    assert s.repetition_penalty == 1.1 and len(s.processors()) == 1
    assert bad_threshold[0] and "xtc threshold must be in [0, 0.5]" in bad_threshold[1][0][0]
    assert (s.xtc_probability, s.xtc_threshold) == (0.5, 0.2)


def test_engine_error_shows_a_notification_and_the_app_goes_on(tiny):
    model, tok, draft = tiny

    def broken(*args, **kwargs):
        raise RuntimeError("the accelerator caught fire")
        yield  # a generator, like the engine

    app = ChatApp(model, tok, draft, settings=Settings(max_tokens=MAX), stream_fn=broken)

    async def script(pilot):
        app.query_one("#prompt").value = "hello"
        await pilot.press("enter")
        await wait_for(pilot, lambda: notifications(app), what="a notification")
        await wait_for(pilot, lambda: not app.busy, what="the app to be idle")
        notes = notifications(app)
        app.session.stream_fn = stream_generate
        turn = await ask(pilot, "hello")
        return notes, turn

    notes, turn = run(app, script)
    assert notes == [("RuntimeError: the accelerator caught fire", "error")]
    assert len(turn.tokens) == MAX
    # the failed turn left no trace in the conversation: the retry prefills from scratch
    assert app.session.messages == [{"role": "user", "content": "hello"},
                                    {"role": "assistant", "content": turn.text}]
    assert turn.stats.prefill_tokens == turn.stats.prompt_tokens


def test_colour_by_cycle_marks_drafted_and_bonus_tokens(tiny):
    model, tok, _ = tiny
    draft = oracle_draft(model, tok, "hello", MAX, block_size=4, accept=2)
    # fixed width 4, so every cycle can hold its 2 drafted tokens + 1 bonus
    app = ChatApp(model, tok, draft, settings=Settings(max_tokens=MAX, block_size=4))

    async def script(pilot):
        turn = await ask(pilot, "hello")
        await pilot.press("f4")
        await pilot.pause(0.05)
        view = [v for v in app.query(MessageView) if v.role == "assistant"][0]
        shown = view.query_one(".cycles").display and not view.query_one("Markdown").display
        return turn, view, shown, app.query_one(StatsPanel).plain

    turn, view, shown, panel = run(app, script)
    # first token from prefill, then cycles of 2 drafted + 1 bonus
    assert turn.from_draft[:7] == [False, True, True, False, True, True, False]
    assert (turn.cycles.drafted, turn.cycles.bonus) == (turn.from_draft.count(True), turn.from_draft.count(False))
    assert set(turn.stats.accept_lengths[:-1]) == {2}
    assert [s.drafted for s in view.segments[:4]] == [False, True, False, True]
    assert "".join(s.text for s in view.segments) == turn.text
    assert "colour by cycle: on" in panel and shown


def test_baseline_rate_on_request(tiny):
    model, tok, draft = tiny
    app = ChatApp(model, tok, draft, settings=Settings(max_tokens=MAX))

    async def script(pilot):
        turn = await ask(pilot, "hello")
        assert "F3 runs plain decoding" in app.query_one(StatsPanel).plain
        await pilot.press("f3")
        await wait_for(pilot, lambda: app.baselines == 1, what="the baseline run")
        await pilot.pause(0.05)
        return turn, app.query_one(StatsPanel).plain

    turn, panel = run(app, script)
    assert turn.stats.baseline_tps > 0 and turn.stats.baseline_same is True
    assert "same tokens" in panel and "speed-up" in panel


def test_new_chat_forgets_the_conversation(tiny):
    model, tok, draft = tiny
    app = ChatApp(model, tok, draft, settings=Settings(max_tokens=MAX))

    async def script(pilot):
        await ask(pilot, "hello")
        await pilot.press("ctrl+n")
        await pilot.pause(0.05)
        assert len(app.query(MessageView)) == 0
        return await ask(pilot, "hello")

    turn = run(app, script)
    assert app.session.messages[0] == {"role": "user", "content": "hello"} and len(app.session.messages) == 2
    assert turn.stats.prefill_tokens == turn.stats.prompt_tokens  # nothing cached from before


def test_quit_while_answering_ends_the_engine_thread(tiny):
    model, tok, draft = tiny
    gate = Gate(after=2)
    app = ChatApp(model, tok, draft, settings=Settings(max_tokens=200), stream_fn=gate)
    threads = {}

    async def script(pilot):
        app.query_one("#prompt").value = "hello"
        await pilot.press("enter")
        await wait_for(pilot, gate.reached.is_set, what="the engine to pause")
        threads["engine"] = [t for t in threading.enumerate() if t is not threading.main_thread()]
        gate.release.set()
        await pilot.press("ctrl+q")

    run(app, script)
    assert app.return_code in (0, None)
    assert not any(t.is_alive() for t in threads["engine"] if "asyncio" in t.name)
    assert app.session.last.stopped  # the answer was cut at the next cycle, not run to 200
    assert len(app.session.last.tokens) < 200


def test_session_without_textual(tiny):
    """The session is usable on its own (one thread, no UI)."""
    model, tok, draft = tiny
    s = ChatSession(model, tok, draft, Settings(max_tokens=5, system="Be brief."))
    seen = []
    t = s.turn("hi", lambda turn, new: seen.append(len(turn.tokens)), lambda: False)
    assert seen == [1, 2, 3, 4, 5] and t.prompt_ids == encode_prompt(tok, "Be brief.\n\nUser: hi\nAssistant:")


def test_a_chat_with_a_small_model_draft_answers_as_the_target():
    """mlx-lm's --draft-model in the chat (`models.draft.autoregressive`): two turns, each the target's greedy
    answer to the whole conversation so far, the second over the first's cache."""
    model, tok = targets.tiny_target("qwen3", seed=1, tie_word_embeddings=False)
    s = ChatSession(model, tok, targets.small_draft_model(model, 3), Settings(max_tokens=12))
    for text in ("hi", "and then"):
        t = s.turn(text, lambda turn, new: None, lambda: False)
        want = targets.greedy_reference(model, t.prompt_ids, 12, stop_ids=[targets.EOS_ID])
        assert t.tokens == want[: len(t.tokens)] and len(t.tokens) == min(12, len(want))


def test_an_answer_stops_where_the_context_window_does():
    """The library decodes past `max_position_embeddings` as mlx-lm does; a chat answer stops there."""
    model, tok = targets.tiny_target("qwen3", seed=0, max_position_embeddings=40)
    s = ChatSession(model, tok, random_draft(model, num_layers=1, block_size=4), Settings(max_tokens=100))
    t = s.turn("hi", lambda turn, new: None, lambda: False)
    assert len(t.prompt_ids) + len(t.tokens) == 40 and t.stats.finish == "length"


def test_model_that_fails_to_load_is_reported(tmp_path):
    app = ChatApp(model_name=str(tmp_path / "no-such-model"))

    async def script(pilot):
        await wait_for(pilot, lambda: notifications(app), what="a notification")
        app.query_one("#prompt").value = "hello"
        await pilot.press("enter")  # refused politely, no crash
        await pilot.pause(0.05)
        return notifications(app), app.query_one(StatsPanel).plain

    notes, panel = run(app, script)
    assert notes[0][1] == "error" and "no-such-model" in notes[0][0]
    assert notes[1][1] == "error" and "failed to load" in notes[1][0]
    assert "status not loaded" in panel and app.session is None


EXIT_SCRIPT = """
import asyncio
import dflash_mlx
from dflash_mlx.testing import targets
from dflash_mlx.models.draft.checkpoints import random_draft
from dflash_mlx.tui.app import ChatApp
from dflash_mlx.tui.session import Settings
model, tok = targets.tiny_target("qwen3")
app = ChatApp(model, tok, random_draft(model, num_layers=1, block_size=4), settings=Settings(max_tokens=60))

async def go():
    async with app.run_test() as pilot:
        app.query_one("#prompt").value = "hello"
        await pilot.press("enter")
        while app.turns < 1:
            await pilot.pause(0.02)
        await pilot.press("ctrl+q")

asyncio.run(go())
print("answered", len(app.session.last.tokens))
"""


def test_process_exits_cleanly_after_generating_on_the_engine_thread():
    """Generate on the engine thread, quit, and the process ends with status 0.

    (MLX aborts a process whose worker thread's streams are still alive at exit
    in some timings; the engine thread clears them. This run checks the whole
    path ends cleanly; it does not force the racy timing.)"""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "answered 60" in p.stdout and "terminate called" not in p.stderr


def test_sampling_options_reach_the_engine():
    a = parse_args(["--temperature", "0.7", "--top-p", "0.9", "--top-k", "20", "--min-p", "0.05", "--seed", "3"])
    settings = settings_from_args(a)
    model, tok = targets.tiny_target("llama")
    calls = []

    def stream_fn(*args, **kwargs):
        calls.append(kwargs)
        yield from ()

    session = ChatSession(model, tok, random_draft(model, num_layers=1, block_size=4), settings, stream_fn=stream_fn)
    session.turn("hi", lambda turn, new: None, lambda: False)
    assert {k: calls[-1][k] for k in ("temperature", "top_p", "top_k", "min_p", "seed")} == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 3}
    assert calls[-1]["prefill_step_size"] == 2048
    steps = ChatSession(model, tok, None, settings, stream_fn=stream_fn,
                        prefill_step_size=parse_args(["--prefill-step-size", "64"]).prefill_step_size)
    steps.turn("hi", lambda turn, new: None, lambda: False)
    assert calls[-1]["prefill_step_size"] == 64  # (mlx-lm's chat's flag)


# -- block size "auto" (the default) ----------------------------------------------


class Recorder:
    """Wraps the engine: keeps what each call was given and every response."""

    def __init__(self):
        self.calls, self.responses = [], []

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs)
        for r in stream_generate(*args, **kwargs):
            self.responses.append(r)
            yield r


def test_default_block_size_is_auto_and_reaches_the_engine(tiny):
    model, tok, _ = tiny
    n = 20
    draft = oracle_draft(model, tok, "hello", n)  # block 4, always right: every width is tried
    engine = Recorder()
    app = ChatApp(model, tok, draft, settings=Settings(max_tokens=n), stream_fn=engine)

    async def script(pilot):
        return await ask(pilot, "hello"), app.query_one(StatsPanel).plain

    turn, panel = run(app, script)
    assert engine.calls[-1]["block_size"] == "auto"
    widths = [r.verify_width for r in engine.responses[1:]]  # the first response is the prefill's
    assert len(set(widths)) > 1 and max(widths) <= draft.block_size and min(widths) >= 1
    # each cycle keeps every drafted token: accept length = its verify width - 1
    assert turn.stats.accept_lengths == [w - 1 for w in widths]
    ids = prompt_ids(tok, [{"role": "user", "content": "hello"}])
    assert turn.tokens == targets.greedy_reference(model, ids, n)  # the width never changes the output
    assert turn.stats.verify_width == widths[-1]
    assert f"block auto ({widths[-1]})  temp 0  max {n}" in panel


def test_draft_block_size_setting_keeps_the_width_fixed(tiny):
    model, tok, _ = tiny
    draft = oracle_draft(model, tok, "hello", MAX)
    engine = Recorder()
    session = ChatSession(model, tok, draft, Settings(max_tokens=MAX, block_size="draft"), stream_fn=engine)
    session.turn("hello", lambda turn, new: None, lambda: False)
    assert engine.calls[-1]["block_size"] == "draft"  # the engine resolves it to the draft's
    widths = [r.verify_width for r in engine.responses[1:]]
    assert widths[:-1] == [4] * (len(widths) - 1)  # the last cycle is cut by max tokens
    assert (session.block_size, session.max_block_size) == (4, 4)
    session.settings = Settings(block_size="auto")
    assert (session.block_size, session.max_block_size) == ("auto", 4)  # auto scales to the draft's


def test_settings_dialog_takes_auto_draft_or_a_number(tiny):
    model, tok, draft = tiny
    app = ChatApp(model, tok, draft, settings=Settings(max_tokens=MAX))

    async def script(pilot):
        await pilot.press("f2")
        field = app.screen.query_one("#block_size")
        shown = (field.value, str(field.placeholder))
        parsed = {}
        for text in ("auto", " Auto ", "8", "", "draft"):
            field.value = text
            parsed[text] = app.screen.read().block_size
        refused = await try_values(app, pilot, field, ("0", "x", "2.5"))
        field.value = "8"
        await pilot.press("enter")
        await pilot.pause(0.05)
        return shown, parsed, refused, app.query_one(StatsPanel).plain

    shown, parsed, refused, panel = run(app, script)
    assert shown == ("auto", "auto (empty), draft (4) or a number")
    assert parsed == {"auto": "auto", " Auto ": "auto", "8": 8, "": "auto", "draft": "draft"}
    for text, (still_open, notes) in refused.items():
        assert still_open, text
        assert len(notes) == 1 and notes[0][1] == "error" and "block size" in notes[0][0], (text, notes)
    assert "'0'" in refused["0"][1][0][0] and "'x'" in refused["x"][1][0][0]
    assert app.session.settings.block_size == 8 and "block 8  temp 0" in panel


def test_stats_panel_under_auto():
    before = panel_lines(None, "m", "d", "auto", 0.0, 32, False, "ready", max_block=4)
    assert "block auto  temp 0  max 32" in before  # no cycle yet: no width to show
    stats = TurnStats(accept_lengths=[3, 1, 0, 3], verify_width=2)
    lines = panel_lines(stats, "m", "d", "auto", 0.0, 32, False, "ready", max_block=8)
    assert "block auto (2)  temp 0  max 32" in lines
    # the draft's block size bounds the scales: top bar at 7 accepted, bins up to the longest seen
    assert sparkline([3, 1, 0, 3], top=7) in lines
    assert lines[-4:] == histogram([3, 1, 0, 3], 4)
    # without a bound it still renders, scaled to what was seen
    unbounded = panel_lines(stats, "m", "d", "auto", 0.0, 32, False, "ready")
    assert "block auto (2)  temp 0  max 32" in unbounded and sparkline([3, 1, 0, 3], top=3) in unbounded
    assert "block 4  temp 0  max 32" in panel_lines(stats, "m", "d", 4, 0.0, 32, False, "ready")


KV_CACHE_SETTINGS = {  # (model, its chat's kv_cache, bad flags, their usage error)
    "kv_bits": (("llama", dict(hidden_size=128, layer_types=["full_attention"] * 4, sliding_window=None)),
                dict(kv_bits=2, kv_group_size=32, quantized_kv_start=30),
                ["--kv-bits", "4", "--quantized-kv-start", "-1"], "quantized_kv_start must be"),
    "max_kv_size": (("qwen3", dict(head_dim=32, tie_word_embeddings=False)), dict(max_kv_size=8),
                    ["--max-kv-size", "3"], "max_kv_size must be a whole number > 4"),
}


@pytest.mark.parametrize("setting", list(KV_CACHE_SETTINGS))
def test_chat_with_mlx_lm_s_kv_cache_settings(setting):
    """`dflash-mlx chat --kv-bits` / `--max-kv-size`: every answer and baseline run gets mlx-lm's quantized or
    bounded KV cache (the conversation's prompt cache bounded from its first turn); the first answer is
    mlx-lm's greedy decode under it, and a later turn's baseline (a fresh cache, converted or filled where
    the conversation's was not) is not called a mismatch. A bad setting is a usage error before the app starts."""
    from dflash_mlx.cli.common import CLIError, kv_cache_kwargs

    (arch, overrides), kv, bad_flags, error = KV_CACHE_SETTINGS[setting]
    model, tok = targets.tiny_target(arch, **overrides)
    calls = []

    def stream_fn(*args, **kwargs):
        calls.append({k: kwargs.get(k) for k in kv})
        return stream_generate(*args, **kwargs)

    s = ChatSession(model, tok, random_draft(model, num_layers=1, block_size=4),
                    Settings(max_tokens=24, system="Be brief."), stream_fn=stream_fn, kv_cache=kv)
    first = s.turn("hello there", lambda turn, new: None, lambda: False)
    assert s.cache.windowed == (setting == "max_kv_size") and s.cache.max_kv_size == kv.get("max_kv_size")
    ref = targets.greedy_reference(model, first.prompt_ids, 24, **kv)
    assert first.tokens == ref[: len(first.tokens)] and len(first.tokens) >= 4 and not first.reused_cache
    assert ref != targets.greedy_reference(model, first.prompt_ids, 24)  # (the setting changes this answer)
    s.baseline(first, lambda: False)
    assert first.stats.baseline_same is True
    second = s.turn("and again", lambda turn, new: None, lambda: False)
    s.baseline(second, lambda: False)
    assert second.reused_cache and second.stats.baseline_same is None
    assert calls == [kv] * 4
    with pytest.raises(CLIError, match=error):
        kv_cache_kwargs(build_parser().parse_args(bad_flags))


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_chat_with_a_cached_document(tmp_path):
    """`dflash-mlx chat --prompt-cache-file`: every chat starts with the document the file holds, its caches
    loaded rather than run: the first turn prefills only what follows it, a new chat too, and the answers are
    the target's greedy decode of the whole conversation; a file cached with another system prompt, or with
    no text (mlx-lm's), is refused in one line, and the app goes on without it."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache as mlx_lm_cache
    from mlx_lm.models.cache import save_prompt_cache as mlx_lm_save

    import mlx.core as mx

    from dflash_mlx import make_prompt_cache, save_prompt_cache
    from dflash_mlx.cli.cache_prompt import cached_text

    model, tok = targets.tiny_target("qwen3", seed=0)
    tok._tokenizer.chat_template = CHAT_TEMPLATE
    draft = random_draft(model, num_layers=1, block_size=4)
    document = "The quick brown fox jumps over the lazy dog. " * 6
    state = make_prompt_cache(model, draft)
    ids = encode_prompt(tok, cached_text(tok, document))
    list(stream_generate(model, draft, tok, ids, max_tokens=1, prompt_cache=state))
    path = tmp_path / "doc.safetensors"
    save_prompt_cache(path, state, text={"prompt": document, "system": None, "chat_template": True})
    s = ChatSession(model, tok, draft, Settings(max_tokens=MAX))
    assert s.open_document(path) == f"document: {len(ids)} tokens from {path}"
    for question in ("What jumps?", "Who is lazy?"):
        t = s.turn(question, lambda turn, new: None, lambda: False)
        whole = prompt_ids(tok, [{"role": "user", "content": f"{document}\n\n{question}"}])
        assert t.prompt_ids == whole and t.user == question
        assert t.stats.prefill_tokens < len(whole) - len(ids) + 4  # (the document's tokens came from the file)
        assert t.tokens == targets.greedy_reference(model, whole, MAX)[: len(t.tokens)] and len(t.tokens) >= 4
        s.new_chat()
    with pytest.raises(ValueError, match="cached with no system prompt: start the chat with the same --system"):
        ChatSession(model, tok, draft, Settings(system="Be brief.")).open_document(path)
    cache = mlx_lm_cache(model)
    for _ in generate_step(mx.array(ids), model, max_tokens=0, prompt_cache=cache):
        pass
    mlx_lm_save(str(tmp_path / "theirs.safetensors"), cache, {"model": "tiny", "tokenizer_config": "{}"})
    with pytest.raises(ValueError, match="does not say what text it cached"):
        ChatSession(model, tok, draft, Settings()).open_document(tmp_path / "theirs.safetensors")

    app = ChatApp(model, tok, draft, settings=Settings(max_tokens=MAX), document=str(path))

    async def script(pilot):
        turn = await ask(pilot, "What jumps?")
        return turn, notifications(app)

    turn, notes = run(app, script)
    assert (f"document: {len(ids)} tokens from {path}", "information") in notes
    assert turn.stats.prefill_tokens < len(turn.prompt_ids) - len(ids) + 4
    app = ChatApp(model, tok, draft, settings=Settings(max_tokens=MAX), document=str(tmp_path / "theirs.safetensors"))

    async def opened(pilot):
        await pilot.pause(0.2)
        return notifications(app)

    assert any("not loaded, the chat starts without it" in m for m, _ in run(app, opened))
