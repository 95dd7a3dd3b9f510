"""Generation options, once for every front end.

The one-shot CLI, the chat app (flags and its settings dialog), the benchmarks
and the server all read block size and sampling settings through this module:
`parse_block_size` takes the same spellings everywhere, `GenerationOptions.check`
rejects bad values with one message each before any model is loaded, and
`add_generation_args` declares the flags once. `stream_generate` keeps its own
argument guards for library callers.
"""

import argparse
from dataclasses import dataclass, fields
from typing import Dict, Optional, Tuple, Union

# The verify width's spellings, the same in the library, every flag, the chat dialog and
# the server: AUTO (the default) picks each cycle's width from measured acceptance and
# cost (`dflash_mlx.policy.sizer`); DRAFT_WIDTH is always the draft's own block size (what
# z-lab's reference does); a whole number is that fixed width.
AUTO = "auto"
DRAFT_WIDTH = "draft"
BLOCK_SIZE_SPELLINGS = f"'{AUTO}' (default), '{DRAFT_WIDTH}' (the draft's own block size) or a whole number >= 1"
DRAFT_SAMPLING_MODES = ("argmax", "sample")

BlockSize = Union[int, str]

# `GenerationOptions`' fields for mlx-lm's penalties (`make_logits_processors`), beside `logit_bias`
PENALTY_FIELDS = ("repetition_penalty", "repetition_context_size", "presence_penalty", "presence_context_size",
                  "frequency_penalty", "frequency_context_size")


def parse_block_size(text) -> BlockSize:
    """`AUTO`, `DRAFT_WIDTH` or a whole number >= 1, from the text as typed (a flag, a
    dialog field, a JSON value, a library argument). None or empty: the default, `AUTO`."""
    if text is None:
        return AUTO
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        s = str(text).strip().lower() if isinstance(text, str) else None
        if s in ("", AUTO):
            return AUTO
        if s == DRAFT_WIDTH:
            return DRAFT_WIDTH
        try:
            value = int(s)
        except (TypeError, ValueError):
            value = None
    if value is None or value < 1:
        raise ValueError(f"block size takes {BLOCK_SIZE_SPELLINGS}, got {text!r}")
    return value


def fixed_width(block_size: BlockSize, draft_block_size: int) -> Optional[int]:
    """The fixed verify width `block_size` names for a draft of `draft_block_size`; None for `AUTO`."""
    block_size = parse_block_size(block_size)
    if block_size == AUTO:
        return None
    return draft_block_size if block_size == DRAFT_WIDTH else block_size


@dataclass
class GenerationOptions:
    """What one answer is generated with (`stream_generate`'s keyword arguments)."""

    max_tokens: int = 256
    block_size: BlockSize = AUTO  # see BLOCK_SIZE_SPELLINGS
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: Optional[int] = None
    draft_sampling: str = "argmax"  # proposals at temperature > 0: draft argmax or sampled
    # mlx-lm's logits processors (`make_logits_processors`), each over the last `*_context_size` tokens of
    # the prompt and answer: None or 0 off
    repetition_penalty: Optional[float] = None  # > 1: such a token's logit divided (negative: multiplied) by it
    repetition_context_size: int = 20
    presence_penalty: Optional[float] = None  # subtracted from such a token's logit (OpenAI's)
    presence_context_size: int = 20
    frequency_penalty: Optional[float] = None  # subtracted once for each time it occurs there (OpenAI's)
    frequency_context_size: int = 20
    logit_bias: Optional[Dict[int, float]] = None  # token id -> added to its logit at every step
    # mlx-lm's XTC at temperature > 0: in that share of steps, every token above the threshold but the least
    # likely of them is dropped (never the special tokens; None: a newline and the end tokens, as mlx-lm's
    # front ends keep)
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: Optional[Tuple[int, ...]] = None
    min_tokens_to_keep: int = 1  # the fewest tokens min-p leaves (mlx-lm's make_sampler's)

    def penalties(self) -> dict:
        """The penalty and logit bias fields set (for a front end that hands them on, the benchmark's
        two engines), empty where none is."""
        if not self.processors():
            return {}
        return {name: getattr(self, name) for name in PENALTY_FIELDS + ("logit_bias",)}

    def processors(self) -> list:
        """mlx-lm's logits processors for the penalties and logit bias set (empty when none is)."""
        from mlx_lm.sample_utils import make_logits_processors

        return make_logits_processors(self.logit_bias, self.repetition_penalty, self.repetition_context_size,
                                      self.presence_penalty, self.presence_context_size, self.frequency_penalty,
                                      self.frequency_context_size)

    def check(self) -> "GenerationOptions":
        """`self` when every value is usable; else ValueError naming the first bad one."""
        self.block_size = parse_block_size(self.block_size)
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max tokens must be a whole number >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1] (1: off), got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top-k must be a whole number >= 0 (0: off), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min-p must be in [0, 1] (0: off), got {self.min_p!r}")
        if not _is_int(self.min_tokens_to_keep) or self.min_tokens_to_keep < 1:
            raise ValueError(f"min tokens to keep must be a whole number >= 1, got {self.min_tokens_to_keep!r}")
        if not _is_number(self.xtc_probability) or not 0 <= self.xtc_probability <= 1:
            raise ValueError(f"xtc probability must be in [0, 1] (0: off), got {self.xtc_probability!r}")
        if not _is_number(self.xtc_threshold) or not 0 <= self.xtc_threshold <= 0.5:
            raise ValueError(f"xtc threshold must be in [0, 0.5], got {self.xtc_threshold!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be a whole number, got {self.seed!r}")
        self.check_penalties()
        if self.draft_sampling not in DRAFT_SAMPLING_MODES:
            raise ValueError(
                f"draft sampling must be one of {', '.join(DRAFT_SAMPLING_MODES)}, "
                f"got {self.draft_sampling!r}"
            )
        return self

    def check_penalties(self) -> "GenerationOptions":
        """`check` of the penalties and logit bias alone (`stream_generate` checks the rest its own way)."""
        if self.repetition_penalty is not None and (not _is_number(self.repetition_penalty)
                                                    or self.repetition_penalty < 0):
            raise ValueError(f"repetition penalty must be >= 0 (1 or 0: off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and (not _is_number(value) or abs(value) == float("inf")):
                raise ValueError(f"{name.replace('_', ' ')} must be a number (0: off), got {value!r}")
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be a whole number >= 1, got {value!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit bias must map token ids to numbers, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0 or not _is_number(bias) or abs(bias) == float("inf"):
                    raise ValueError(f"logit bias must map token ids (whole numbers >= 0) to finite numbers, "
                                     f"got {token!r}: {bias!r}")
        return self

    def generate_kwargs(self) -> dict:
        """Keyword arguments for `stream_generate` (only the generation options,
        also on a subclass that carries more settings)."""
        return {f.name: getattr(self, f.name) for f in fields(GenerationOptions)}

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "GenerationOptions":
        """The options `add_generation_args` declared, from parsed flags."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # NaN is no value


def block_size_arg(text: str) -> BlockSize:
    """`parse_block_size` as an argparse `type=` (its message as the usage error)."""
    try:
        return parse_block_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_generation_args(parser: argparse.ArgumentParser, defaults: Optional[GenerationOptions] = None,
                        skip=()) -> argparse.ArgumentParser:
    """Declare the generation flags (--max-tokens, --block-size, sampling) on `parser`.

    `defaults` sets a front end's own defaults (the chat app answers longer);
    names in `skip` are left out (the benchmarks sweep block sizes their own way).
    Values are checked by `GenerationOptions.check`, not here, so every front
    end reports a bad one the same way.
    """
    d = defaults or GenerationOptions()
    flags = {
        "max_tokens": dict(type=int, help=f"most tokens to generate (default: {d.max_tokens})"),
        "block_size": dict(
            type=block_size_arg,
            help="tokens verified per cycle: 'auto' picks each cycle's verify width from measured "
            "acceptance and cost, up to the draft's block size; 'draft' always the draft's own "
            f"block size; or a whole number (default: {d.block_size})",
        ),
        "temperature": dict(type=float, help=f"0 = greedy (default: {d.temperature})"),
        "top_p": dict(type=float, help="nucleus sampling, in (0, 1] (default: 1, off)"),
        "top_k": dict(type=int, help="keep the k likeliest tokens (default: 0, off)"),
        "min_p": dict(type=float, help="drop tokens below min-p x the top probability (default: 0, off)"),
        "min_tokens_to_keep": dict(type=int, help="the fewest tokens min-p leaves, as mlx-lm's (default: 1)"),
        "xtc_probability": dict(type=float, help="mlx-lm's XTC: the share of steps that drop every token above "
                                "--xtc-threshold but the least likely of them (default: 0, off)"),
        "xtc_threshold": dict(type=float, help=f"in [0, 0.5] (default: {d.xtc_threshold})"),
        "seed": dict(type=int, help=f"sampling seed (default: {'none' if d.seed is None else d.seed})"),
        "draft_sampling": dict(
            choices=DRAFT_SAMPLING_MODES,
            help="draft proposals at temperature > 0: the draft's argmax (default) or sampled from it",
        ),
        "repetition_penalty": dict(type=float, help="divide the logits of tokens among the last "
                                   "--repetition-context-size by this (mlx-lm's; e.g. 1.1; default: off)"),
        "repetition_context_size": dict(type=int, help=f"tokens the repetition penalty looks back over "
                                        f"(default: {d.repetition_context_size})"),
        "presence_penalty": dict(type=float, help="subtract this from the logits of tokens among the last "
                                 "--presence-context-size (OpenAI's; default: off)"),
        "frequency_penalty": dict(type=float, help="subtract this for each time a token occurs among the last "
                                  "--frequency-context-size (OpenAI's; default: off)"),
        "presence_context_size": dict(type=int, help=f"default: {d.presence_context_size}"),
        "frequency_context_size": dict(type=int, help=f"default: {d.frequency_context_size}"),
    }
    aliases = {"temperature": ["--temp"]}  # (mlx-lm's spelling)
    for name, kwargs in flags.items():
        if name not in skip:
            parser.add_argument("--" + name.replace("_", "-"), *aliases.get(name, []), default=getattr(d, name),
                                **kwargs)
    return parser
