"""A conversation with one model + draft: prompts, the kept prompt cache, turns.

No Textual here: the app calls these methods on its engine thread, and tests can
call them directly. Every MLX call of a session must happen on one thread.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Union

from dflash_mlx.generate import (encode_prompt, make_prompt_cache, make_suffix_index, stop_ids, stream_generate,
                                 target_for, tokens_to_window)
from dflash_mlx.policy import memory
from dflash_mlx.policy.copies import NO_DRAFT_MAX_COPY
from dflash_mlx.options import AUTO, GenerationOptions, fixed_width

from dflash_mlx.tui.segments import CycleText, Segment
from dflash_mlx.tui.stats import TurnStats
from dflash_mlx.tui.template import Template, render_prompt


@dataclass
class Settings(GenerationOptions):
    """What the chat answers with: the generation options plus the system prompt."""

    max_tokens: int = 512  # a chat answer runs longer than the one-shot CLI's default
    system: str = ""

    def check(self) -> "Settings":
        super().check()
        if not isinstance(self.system, str):
            raise ValueError(f"system prompt must be text, got {self.system!r}")
        return self


@dataclass
class Turn:
    """One answer as it is produced."""

    user: str
    prompt_ids: List[int]
    settings: Settings
    text: str = ""
    tokens: List[int] = field(default_factory=list)
    from_draft: List[bool] = field(default_factory=list)
    stats: TurnStats = field(default_factory=TurnStats)
    cycles: Optional[CycleText] = None
    stopped: bool = False
    reused_cache: bool = False  # the conversation's caches held earlier turns when it started


class ChatSession:
    def __init__(self, model, tokenizer, draft, settings: Optional[Settings] = None,
                 template: Optional[Template] = None, stream_fn=stream_generate, kv_cache: Optional[dict] = None,
                 template_kwargs: Optional[dict] = None, prefill_step_size: int = 2048):
        """`kv_cache`: mlx-lm's quantized KV cache (`stream_generate`'s `kv_bits`, `kv_group_size`,
        `quantized_kv_start`) or its bounded one (`max_kv_size`) for every answer and baseline run; None:
        full precision, unbounded. `template_kwargs`: more arguments for the chat template (mlx-lm's
        `--chat-template-config`, e.g. {"enable_thinking": False}). `prefill_step_size`: prompt tokens a prefill
        forward runs at most (mlx-lm's chat's flag)."""
        self.model = model
        self.tokenizer = tokenizer
        self.draft = draft
        self.settings = settings or Settings()
        self.template = template
        self.stream_fn = stream_fn  # the engine; tests wrap it to pace or break it
        self.kv_cache = dict(kv_cache or {})
        self.template_kwargs = template_kwargs
        self.prefill_step_size = prefill_step_size
        self.messages: List[Dict[str, str]] = []  # user/assistant turns, system kept apart
        self.document: Optional[str] = None  # a cached document every chat starts with (`open_document`)
        self.cache = None
        self.last: Optional[Turn] = None
        # earlier turns of every conversation of the session, for copies (kept by "new chat")
        self.suffix_index = make_suffix_index(model)
        self.context_window = target_for(model, draft).max_context  # where an answer stops

    @property
    def draft_block_size(self) -> int:
        return getattr(self.draft, "block_size", 1) if self.draft is not None else 1

    @property
    def block_size(self) -> Union[int, str]:
        """The setting as shown: a number or "auto" ("draft" resolved to the draft's own)."""
        return fixed_width(self.settings.block_size, self.draft_block_size) or AUTO

    @property
    def max_block_size(self) -> int:
        """The widest verify a cycle can have: the top of the accept-length scales."""
        b = self.block_size
        # "auto" never verifies more than the draft's block size (with no draft, the longest copy)
        if b == "auto":
            return self.draft_block_size if self.draft is not None else NO_DRAFT_MAX_COPY + 1
        return b

    def new_chat(self) -> None:
        """Forget the conversation and the cache (it is rebuilt on the next turn); with a document, the cache
        stays: the next chat's prompt shares the document with it, and only the rest runs."""
        self.messages = []
        if self.document is None:
            self.cache = None
        self.last = None

    def open_document(self, path) -> str:
        """Start every chat with the document a `dflash-mlx cache-prompt` file holds, its caches loaded rather
        than run: the first message is the document, a blank line, then what the user asks. Returns a line
        saying so; ValueError for a file that does not fit (another model) or holds no text (mlx-lm's)."""
        import mlx.core as mx

        from dflash_mlx.engine.prompt_cache_file import load_prompt_cache

        state, info = load_prompt_cache(path, self.model, self.draft)
        text = info.text or {}
        if "prompt" not in text or not text.get("chat_template", True):
            raise ValueError(f"{path} does not say what text it cached (mlx-lm's cache_prompt, or "
                             "--no-chat-template): make it with dflash-mlx cache-prompt for the chat")
        if (text.get("system") or "") != (self.settings.system or ""):
            cached = f"the system prompt {text['system']!r}" if text.get("system") else "no system prompt"
            raise ValueError(f"{path} was cached with {cached}: start the chat with the same --system")
        state.history_start = 0  # (a chat's penalties see the whole conversation, as in any chat)
        if target_for(self.model, self.draft).recurrent:  # (not trimmed back to the document: kept whole)
            state.max_snapshots = 1
            state.snapshot()
        # (evaluated here: MLX arrays still lazy on this thread's stream cannot be evaluated by the engine's thread)
        mx.eval([c.state for c in state.target_cache],
                [kv for c in state.draft_cache or () for kv in c.fetch() if kv is not None])
        self.cache, self.document, self.messages = state, text["prompt"], []
        memory.restore(self.model, self.draft)
        return (f"document: {len(state.tokens)} tokens from {path}"
                + ("" if info.draft_context == "restored" else " (no draft context in the file: it drafts from "
                   "what follows)"))

    def prompt_ids(self, messages) -> List[int]:
        text = render_prompt(self.tokenizer, messages, self.settings.system or None, self.template,
                             self.template_kwargs)
        return encode_prompt(self.tokenizer, text)

    def turn(self, user: str, on_update: Callable[[Turn, List[Segment]], None],
             should_stop: Callable[[], bool]) -> Turn:
        """Answer `user`, calling `on_update` after every engine cycle.

        The conversation keeps a stopped answer as far as it got. If the engine
        fails, the conversation is left as it was before this turn.
        """
        s = self.settings
        first = f"{self.document}\n\n{user}" if self.document is not None and not self.messages else user
        messages = self.messages + [{"role": "user", "content": first}]
        turn = Turn(user, self.prompt_ids(messages), Settings(**vars(s)))
        turn.cycles = CycleText(self.tokenizer, stop_ids(self.tokenizer))
        self.last = turn
        if self.cache is None:
            self.cache = make_prompt_cache(self.model, self.draft, max_kv_size=self.kv_cache.get("max_kv_size"))
            memory.restore(self.model, self.draft)  # what `auto` learned in earlier runs on this machine
        turn.reused_cache = bool(self.cache.tokens)
        kwargs = s.generate_kwargs()  # the answer stops where the model's context window does
        kwargs["max_tokens"] = tokens_to_window(self.context_window, len(turn.prompt_ids), s.max_tokens)
        stream = self.stream_fn(
            self.model, self.draft, self.tokenizer, turn.prompt_ids, prompt_cache=self.cache,
            suffix_index=self.suffix_index, prefill_step_size=self.prefill_step_size, **self.kv_cache, **kwargs,
        )
        try:
            for r in stream:
                turn.text += r.text
                turn.tokens.extend(r.tokens)
                turn.from_draft.extend(r.from_draft)
                turn.stats.update(r)
                new = turn.cycles.add(r.tokens, r.from_draft)
                on_update(turn, new)
                if r.finish_reason is None and should_stop():
                    # Between cycles the cache and its token list agree, so the
                    # next turn still reuses everything up to here.
                    turn.stopped = True
                    turn.stats.finish = "stopped"
                    break
        finally:
            stream.close()
        self.messages = messages + [{"role": "assistant", "content": turn.text}]
        memory.save(self.model, self.draft)
        return turn

    def baseline(self, turn: Turn, should_stop: Callable[[], bool]) -> Turn:
        """Decode `turn`'s prompt again with the target alone; record the rate on `turn`.

        It gets a fresh cache (plain decoding cannot use one holding draft context)
        and the same token budget as the answer, so the rates are comparable.
        """
        s = turn.settings
        budget = max(1, turn.stats.generation_tokens)
        stats, tokens = TurnStats(), []
        stream = self.stream_fn(
            self.model, self.draft, self.tokenizer, turn.prompt_ids, max_tokens=budget,
            temperature=s.temperature, baseline=True, **self.kv_cache,
        )
        try:
            for r in stream:
                tokens.extend(r.tokens)
                stats.update(r)
                if should_stop():
                    return turn
        finally:
            stream.close()
        turn.stats.baseline_tps = stats.tps
        # Greedy DFlash must give the target's own tokens; with sampling they differ anyway, and so they may
        # with a quantized KV cache that earlier turns converted where this fresh one is not (as mlx-lm's would)
        # (a bounded cache, too: the earlier turns' tokens it dropped are not dropped from a fresh one's prompt)
        comparable = s.temperature == 0 and not (self.kv_cache and turn.reused_cache)
        turn.stats.baseline_same = tokens == turn.tokens if comparable else None
        return turn
