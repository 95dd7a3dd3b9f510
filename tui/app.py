"""`dflash-mlx chat`: a terminal chat that shows speculative decoding at work.

Threading: every MLX call (loading, generation, the baseline run) happens on one
long-lived Textual thread worker that takes jobs from a queue, so the models are
only ever used from one thread and the UI thread never waits on the model. The
worker reports back with messages; the UI redraws streamed text on a short timer
so a fast model cannot flood it.
"""

import queue
import threading
from typing import Callable, Optional

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Header, Input
from textual.worker import get_current_worker

from dflash_mlx.options import DRAFT_WIDTH
from dflash_mlx.tui.session import ChatSession, Settings, Turn
from dflash_mlx.tui.stats import panel_lines
from dflash_mlx.tui.template import Template
from dflash_mlx.tui.widgets import MessageView, SettingsScreen, StatsPanel

REDRAW_S = 0.1  # streamed text and stats are redrawn at most this often


class Loaded(Message):
    def __init__(self, session: ChatSession, model_name: str, draft_name: str, note: str = ""):
        super().__init__()
        self.session, self.model_name, self.draft_name, self.note = session, model_name, draft_name, note


class TurnUpdate(Message):
    """A snapshot of the answer after one engine cycle (copied: the worker keeps appending)."""

    def __init__(self, turn: Turn, final: bool = False):
        super().__init__()
        self.turn = turn
        self.text = turn.text
        self.segments = list(turn.cycles.segments)
        self.final = final


class BaselineDone(Message):
    def __init__(self, turn: Turn):
        super().__init__()
        self.turn = turn


class EngineFailed(Message):
    def __init__(self, what: str, error: BaseException):
        super().__init__()
        self.what, self.error = what, error


class ChatApp(App):
    TITLE = "dflash-mlx chat"
    CSS = """
    #chat { width: 1fr; height: 1fr; padding: 0 1; }
    #prompt { dock: bottom; }
    """
    BINDINGS = [
        Binding("escape", "stop", "stop"),
        # priority: the input box would otherwise take ctrl+c as "copy"
        Binding("ctrl+c", "stop", "stop", show=False, priority=True),
        Binding("ctrl+n", "new_chat", "new chat"),
        Binding("f2", "settings", "settings"),
        Binding("f3", "baseline", "plain-decoding rate"),
        Binding("f4,ctrl+t", "toggle_colours", "colour by cycle"),
        Binding("ctrl+q", "quit", "quit", priority=True),
    ]

    def __init__(self, model=None, tokenizer=None, draft=None, *, model_name: Optional[str] = None,
                 draft_name: Optional[str] = None, settings: Optional[Settings] = None,
                 template: Optional[Template] = None, stream_fn: Optional[Callable] = None,
                 draft_bits: Optional[int] = None, kv_cache: Optional[dict] = None,
                 template_kwargs: Optional[dict] = None, load_kwargs: Optional[dict] = None,
                 document: Optional[str] = None, prefill_step_size: int = 2048):
        """Give `model`, `tokenizer` and `draft` (tests, embedding), or names to load
        (`model_name`, `draft_name`, quantized to `draft_bits`) on the engine thread once the app is up.
        `kv_cache`: mlx-lm's quantized or bounded KV cache arguments, `template_kwargs`: more arguments for the
        chat template (`ChatSession`); `load_kwargs`: what else `load_model_and_draft` loads the model with
        (`cli.common.model_load_kwargs`: adapters, extra end tokens, remote code). `document`: a `dflash-mlx cache-prompt` file every chat starts with
        (`ChatSession.open_document`)."""
        super().__init__()
        self.settings = (settings or Settings()).check()
        self.template = template
        self.stream_fn = stream_fn
        self.session: Optional[ChatSession] = None
        self._given = (model, tokenizer, draft) if model is not None else None
        self.model_name = model_name or (type(model).__module__.rsplit(".", 1)[-1] if model is not None else "")
        self.draft_name = draft_name or ("none" if draft is None and model is not None else "")
        self.draft_bits = draft_bits
        self.kv_cache = kv_cache
        self.template_kwargs = template_kwargs
        self.load_kwargs = dict(load_kwargs or {})
        self.document = document
        self.document_note = ""
        self.prefill_step_size = prefill_step_size  # (prompt tokens a prefill forward runs at most)
        self.colour_cycles = False
        self.busy = False
        self.status = "loading" if self._given is None else "ready"
        self.turns = 0  # answers finished (stopped ones included); tests wait on it
        self.baselines = 0
        self._jobs: "queue.Queue" = queue.Queue()
        self._stop = threading.Event()
        self._current: Optional[MessageView] = None
        self._last_turn: Optional[Turn] = None

    # -- layout --------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal():
            yield VerticalScroll(id="chat")
            yield StatsPanel(id="stats")
        yield Input(placeholder="Message (Enter to send, Esc to stop, F2 settings, Ctrl+Q quit)", id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self._engine_loop()
        self.set_interval(REDRAW_S, self._redraw)
        if self._given is not None:
            model, tokenizer, draft = self._given
            self.session = self._new_session(model, tokenizer, draft)
            self._say_document()
        else:
            self._submit("loading the model", self._load)
        self._refresh_panel()
        self.query_one("#prompt", Input).focus()

    def _say_document(self) -> None:
        if self.document_note:
            self.notify(self.document_note, title="document", timeout=8)

    def _new_session(self, model, tokenizer, draft) -> ChatSession:
        kwargs = {} if self.stream_fn is None else {"stream_fn": self.stream_fn}
        session = ChatSession(model, tokenizer, draft, self.settings, self.template, kv_cache=self.kv_cache,
                              template_kwargs=self.template_kwargs, prefill_step_size=self.prefill_step_size,
                              **kwargs)
        if self.document is not None:
            try:
                self.document_note = session.open_document(self.document)
            except ValueError as e:  # (the chat goes on without it)
                self.document_note = f"not loaded, the chat starts without it: {e}"
        return session

    # -- the engine thread -----------------------------------------------------------
    @work(thread=True, group="engine", exit_on_error=False)
    def _engine_loop(self) -> None:
        worker = get_current_worker()
        try:
            while not worker.is_cancelled:
                try:
                    job = self._jobs.get(timeout=0.1)
                except queue.Empty:
                    continue
                if job is None:
                    return
                what, fn = job
                try:
                    fn()
                except Exception as e:  # reported in the UI; the engine thread lives on
                    self.post_message(EngineFailed(what, e))
        finally:
            # MLX wants a thread's streams destroyed before the thread ends; left to
            # the exit-time teardown, it races the interpreter's shutdown and the
            # process aborts ("terminate called without an active exception").
            import mlx.core as mx

            mx.clear_streams()

    def _submit(self, what: str, fn: Callable[[], None]) -> None:
        self._jobs.put((what, fn))

    def _load(self) -> None:
        from dflash_mlx.cli.common import load_model_and_draft, no_draft_note
        from dflash_mlx.models.packaged import untrained_draft

        model, tokenizer, draft, label = load_model_and_draft(self.model_name, self.draft_name or None, quiet=True,
                                                              draft_bits=self.draft_bits, without_draft=True,
                                                              **self.load_kwargs)
        note = "" if not untrained_draft(self.draft_name or self.model_name) else (
            "no trained draft ships for this model yet: an untrained draft is used (exact output, low acceptance)")
        if draft is None:
            label, note = "none (copies of the context)", no_draft_note(self.model_name)
        self.post_message(Loaded(self._new_session(model, tokenizer, draft), self.model_name, label, note))

    def _stopping(self) -> bool:
        return self._stop.is_set() or get_current_worker().is_cancelled

    # -- messages from the engine -------------------------------------------------------
    def on_loaded(self, msg: Loaded) -> None:
        self.session = msg.session
        self.model_name, self.draft_name = msg.model_name, msg.draft_name
        self.status = "ready"
        if msg.note:
            self.notify(msg.note, title="draft", severity="warning", timeout=8)
        self._say_document()
        self._refresh_panel()

    def on_turn_update(self, msg: TurnUpdate) -> None:
        if self._current is None:
            return
        self._current.stream(msg.text, msg.segments)
        self._last_turn = msg.turn
        if msg.final:
            turn = msg.turn
            self._current.flush()
            if turn.stopped:
                self._current.note("(stopped)")
            elif turn.stats.finish == "length":
                self._current.note(f"(max tokens: {turn.settings.max_tokens})")
            self._current = None
            self.busy = False
            self.status = "ready"
            self.turns += 1
            self._refresh_panel()

    def on_baseline_done(self, msg: BaselineDone) -> None:
        self.busy = False
        self.status = "ready"
        self.baselines += 1
        self._refresh_panel()

    def on_engine_failed(self, msg: EngineFailed) -> None:
        self.notify(f"{type(msg.error).__name__}: {msg.error}", title=f"error {msg.what}",
                    severity="error", timeout=10)
        if self._current is not None:
            self._current.note("(failed: see the notification; the conversation is unchanged)")
            self._current.flush()
            self._current = None
        self.busy = False
        self.status = "ready" if self.session is not None else "not loaded"
        self._refresh_panel()

    def _redraw(self) -> None:
        if self._current is not None:
            self._current.flush()
            self.query_one("#chat", VerticalScroll).scroll_end(animate=False)
            self._refresh_panel()

    def _refresh_panel(self) -> None:
        s = self.session.settings if self.session else self.settings
        if self.session:
            block, max_block = self.session.block_size, self.session.max_block_size
        else:  # not loaded yet: no draft to resolve None against
            block, max_block = ("draft's" if s.block_size == DRAFT_WIDTH else s.block_size), None
        stats = self._last_turn.stats if self._last_turn is not None else None
        self.query_one(StatsPanel).show(panel_lines(
            stats, self.model_name or "?", self.draft_name or "?", block, s.temperature,
            s.max_tokens, self.colour_cycles, self.status, max_block,
        ))

    # -- user actions -----------------------------------------------------------------
    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.session is None:
            if self.status == "not loaded":
                self.notify("no model: it failed to load (see the error); restart with another --model",
                            severity="error")
            else:
                self.notify("the model is still loading", severity="warning")
            return
        if self.busy:
            self.notify("still answering: Esc stops it", severity="warning")
            return
        event.input.value = ""
        self.send(text)

    def send(self, text: str) -> None:
        chat = self.query_one("#chat", VerticalScroll)
        chat.mount(MessageView("user", text))
        self._current = MessageView("assistant", colour_cycles=self.colour_cycles)
        chat.mount(self._current)
        chat.scroll_end(animate=False)
        self.busy = True
        self.status = "generating"
        self._stop.clear()
        session = self.session

        def job():
            turn = session.turn(text, lambda t, new: self.post_message(TurnUpdate(t)), self._stopping)
            self.post_message(TurnUpdate(turn, final=True))

        self._submit("while answering", job)

    def action_stop(self) -> None:
        if self.busy:
            self._stop.set()
            self.status = "stopping"
        else:
            self.notify("nothing to stop (Ctrl+Q quits)", timeout=2)

    def action_new_chat(self) -> None:
        if self.busy:
            self.notify("stop the answer first (Esc)", severity="warning")
            return
        self.query_one("#chat", VerticalScroll).remove_children()
        self._last_turn = None
        if self.session is not None:
            session = self.session
            # the cache's arrays belong to the engine thread: drop them there
            self._submit("starting a new chat", session.new_chat)
        self._refresh_panel()

    def action_settings(self) -> None:
        current = self.session.settings if self.session else self.settings
        draft_block = self.session.draft_block_size if self.session else 1

        def apply(new: Optional[Settings]) -> None:
            if new is None:
                return
            self.settings = new
            if self.session is not None:
                # read by the next turn; a running answer keeps its own copy
                self.session.settings = new
            self._refresh_panel()
            self.notify("settings saved: they apply from the next answer", timeout=3)

        self.push_screen(SettingsScreen(current, draft_block), apply)

    def action_baseline(self) -> None:
        turn = self._last_turn
        if turn is None or self.busy:
            self.notify("ask something first, and wait for the answer", severity="warning")
            return
        self.busy = True
        self.status = "plain decoding"
        self._stop.clear()
        self._refresh_panel()
        session = self.session

        def job():
            session.baseline(turn, self._stopping)
            self.post_message(BaselineDone(turn))

        self._submit("in the plain-decoding run", job)

    def action_toggle_colours(self) -> None:
        self.colour_cycles = not self.colour_cycles
        for view in self.query(MessageView):
            if view.role == "assistant":
                view.set_colour_cycles(self.colour_cycles)
        self._refresh_panel()

    def on_unmount(self) -> None:
        self._stop.set()
        self._jobs.put(None)
