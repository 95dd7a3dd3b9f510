"""The chat app's widgets: one message, the live stats panel, the settings dialog."""

import dataclasses
from typing import List, Optional

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Markdown, Static

from dflash_mlx.tui.segments import Segment
from dflash_mlx.tui.session import Settings

DRAFT_STYLE = "bold green"  # tokens the draft proposed and the target accepted
BONUS_STYLE = "bold magenta"  # the target's own token that closes each cycle


def coloured(segments: List[Segment]) -> Text:
    """Answer text coloured by cycle; alternate cycles are underlined so cycle borders show."""
    text = Text()
    for seg in segments:
        style = DRAFT_STYLE if seg.drafted else BONUS_STYLE
        if seg.cycle % 2:
            style += " underline"
        text.append(seg.text, style=style)
    return text


class MessageView(Vertical):
    """One turn of the conversation: a user line, or an assistant answer."""

    DEFAULT_CSS = """
    MessageView { height: auto; margin: 0 0 1 0; }
    MessageView .role { color: $text-muted; text-style: bold; }
    MessageView.user .role { color: $accent; }
    MessageView Markdown { margin: 0; padding: 0; }
    MessageView .note { color: $warning; }
    """

    def __init__(self, role: str, text: str = "", colour_cycles: bool = False):
        super().__init__(classes=role)
        self.role = role
        self.text = text
        self.segments: List[Segment] = []
        self.colour_cycles = colour_cycles
        self._dirty = False
        self.note_text = ""

    def compose(self) -> ComposeResult:
        yield Label("you" if self.role == "user" else "assistant", classes="role")
        if self.role == "user":
            yield Static(Text(self.text), classes="body")
        else:
            yield Markdown(self.text, classes="body")
            yield Static("", classes="cycles")
            yield Label("", classes="note")

    def on_mount(self) -> None:
        if self.role != "user":
            self._show_mode()

    def _show_mode(self) -> None:
        self.query_one(Markdown).display = not self.colour_cycles
        self.query_one(".cycles", Static).display = self.colour_cycles

    def stream(self, text: str, segments: List[Segment]) -> None:
        """Take the answer so far; it is drawn by `flush` (the app calls it on a timer)."""
        self.text = text
        self.segments = segments
        self._dirty = True

    def flush(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        # Only the visible form is redrawn; the other catches up on toggle.
        if self.colour_cycles:
            self.query_one(".cycles", Static).update(coloured(self.segments))
        else:
            self.query_one(Markdown).update(self.text)

    def set_colour_cycles(self, on: bool) -> None:
        self.colour_cycles = on
        self._dirty = True
        self._show_mode()
        self.flush()

    def note(self, text: str) -> None:
        self.note_text = text
        self.query_one(".note", Label).update(text)


class StatsPanel(Static):
    DEFAULT_CSS = """
    StatsPanel { width: 44; height: 1fr; border-left: solid $primary; padding: 0 1; overflow-y: auto; }
    """

    def __init__(self, **kwargs):
        super().__init__("", **kwargs)
        self.lines: List[str] = []

    def show(self, lines: List[str]) -> None:
        self.lines = lines
        text = Text()
        for line in lines:
            style = ""
            if line.startswith(("DFlash", "tau")):
                style = "bold green"
            elif line.startswith(("baseline", "speed-up")):
                style = "bold yellow"
            elif line.startswith(("accept length", "model", "draft")):
                style = "bold"
            text.append(line + "\n", style=style)
        self.update(text)

    @property
    def plain(self) -> str:
        return "\n".join(self.lines)


class SettingsScreen(ModalScreen[Optional[Settings]]):
    """The generation options and the system prompt; dismisses with the new settings."""

    DEFAULT_CSS = """
    SettingsScreen { align: center middle; }
    SettingsScreen > Grid {
        grid-size: 4; grid-columns: 13 18 13 18; grid-rows: auto; grid-gutter: 0 1;
        width: 72; height: auto; padding: 1 2; border: thick $primary; background: $surface;
    }
    SettingsScreen Label { padding: 1 0 0 0; }
    SettingsScreen #system { column-span: 3; }
    """
    BINDINGS = [Binding("escape", "cancel", "cancel")]

    # (field, label, how the text becomes a value); the values are checked by Settings.check
    FIELDS = (
        ("block_size", "block size", str),
        ("max_tokens", "max tokens", int),
        ("temperature", "temperature", float),
        ("top_p", "top-p", float),
        ("top_k", "top-k", int),
        ("min_p", "min-p", float),
        ("xtc_probability", "xtc", float),
        ("xtc_threshold", "xtc threshold", float),
        ("seed", "seed", int),
        ("draft_sampling", "proposals", str),
        ("repetition_penalty", "repetition", float),
    )
    OPTIONAL = ("seed", "repetition_penalty")  # empty: None (no seed; no penalty)

    def __init__(self, settings: Settings, draft_block_size: int):
        super().__init__()
        self.settings = settings
        self.draft_block_size = draft_block_size

    def compose(self) -> ComposeResult:
        s = self.settings
        placeholders = {"block_size": f"auto (empty), draft ({self.draft_block_size}) or a number",
                        "seed": "empty: none", "draft_sampling": "argmax or sample",
                        "repetition_penalty": "empty: off (e.g. 1.1)", "xtc_probability": "0: off (e.g. 0.5)"}
        with Grid():
            for name, label, _ in self.FIELDS:
                value = getattr(s, name)
                yield Label(label)
                yield Input("" if value is None else f"{value:g}" if isinstance(value, float) else str(value),
                            placeholder=placeholders.get(name, ""), id=name)
            if len(self.FIELDS) % 2:  # (the system prompt starts a row of its own)
                yield Label("")
                yield Label("")
            yield Label("system prompt")
            yield Input(s.system, placeholder="(the template's default)", id="system")
            yield Button("Save", variant="primary", id="save")
            yield Button("Cancel", id="cancel")

    def read(self) -> Settings:
        """Settings from the form; ValueError with a readable message if a field is bad."""
        values = {}
        for name, label, kind in self.FIELDS:
            text = self.query_one(f"#{name}", Input).value.strip()
            if kind is str:
                values[name] = text  # block size and draft sampling: Settings.check reads the text
                continue
            if not text and name in self.OPTIONAL:
                values[name] = None
                continue
            try:
                values[name] = kind(text)
            except ValueError:
                what = "a whole number" if kind is int else "a number"
                raise ValueError(f"{label} takes {what}, got {text!r}") from None
        values["system"] = self.query_one("#system", Input).value
        return dataclasses.replace(self.settings, **values).check()

    def _save(self) -> None:
        try:
            self.dismiss(self.read())
        except ValueError as e:
            self.notify(str(e), title="settings", severity="error")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self._save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self._save()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)
