"""Per-answer statistics and their text rendering (sparkline, histogram)."""

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

from dflash_mlx.generate import tau

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[int], top: Optional[int] = None, width: int = 32) -> str:
    """One bar per value (the last `width` values), scaled to `top` (default: the max)."""
    values = list(values)[-width:]
    if not values:
        return ""
    top = max(top if top is not None else max(values), 1)
    return "".join(BARS[min(len(BARS) - 1, round(v / top * (len(BARS) - 1)))] for v in values)


def histogram(values: Sequence[int], n_bins: int, width: int = 16) -> List[str]:
    """Lines "a │████ count" for accept lengths 0..n_bins-1, bars scaled to the largest count."""
    counts = [0] * max(n_bins, 1)
    for v in values:
        counts[min(max(v, 0), len(counts) - 1)] += 1
    peak = max(max(counts), 1)
    label = len(str(len(counts) - 1))
    lines = []
    for a, c in enumerate(counts):
        bar = "█" * round(c / peak * width) if c else ""
        lines.append(f"{a:>{label}} │{bar} {c}" if c else f"{a:>{label}} │")
    return lines


@dataclass
class TurnStats:
    """What the live panel shows about the current (or last) answer."""

    prompt_tokens: int = 0
    prefill_tokens: int = 0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    tps: float = 0.0
    peak_memory: float = 0.0
    accept_lengths: List[int] = field(default_factory=list)
    verify_width: Optional[int] = None  # of the last cycle (under "auto" it changes)
    finish: Optional[str] = None  # "stop" | "length" | "stopped" | None while running
    baseline_tps: Optional[float] = None
    baseline_same: Optional[bool] = None

    @property
    def tau(self) -> float:
        return tau(self.accept_lengths)

    @property
    def reused_tokens(self) -> int:
        return self.prompt_tokens - self.prefill_tokens

    def update(self, r) -> None:
        """Take the running numbers from one engine response."""
        self.prompt_tokens = r.prompt_tokens
        self.prefill_tokens = r.prefill_tokens
        self.prompt_time = r.prompt_time
        self.generation_tokens = r.generation_tokens
        self.tps = r.generation_tps
        self.peak_memory = r.peak_memory
        self.accept_lengths = r.accept_lengths  # (a new list)
        if r.verify_width is not None:  # None on the prefill response: keep the last cycle's
            self.verify_width = r.verify_width
        if r.finish_reason is not None:
            self.finish = r.finish_reason


def memory(gb: float) -> str:
    return f"{gb:8.2f} GB" if gb >= 1 else f"{gb * 1000:8.0f} MB"


def block_label(block_size: Union[int, str], stats: Optional[TurnStats]) -> str:
    """The block setting as shown: "4", or "auto (6)" with the width the last cycle verified."""
    if block_size == "auto" and stats is not None and stats.verify_width is not None:
        return f"auto ({stats.verify_width})"
    return str(block_size)


def panel_lines(stats: Optional[TurnStats], model_name: str, draft_name: str,
                block_size: Union[int, str], temperature: float, max_tokens: int,
                colour_cycles: bool, status: str, max_block: Optional[int] = None) -> List[str]:
    """The live panel as plain lines (the widget styles them; tests read them).

    `block_size` is the setting (a number or "auto"); `max_block` is the widest
    verify possible (the draft's block size under "auto"), which scales the
    sparkline and bounds the histogram. It defaults to a numeric `block_size`.
    """
    if max_block is None:
        # "auto" without a bound: scale to what was seen
        max_block = block_size if isinstance(block_size, int) else 1 + max(
            stats.accept_lengths if stats is not None else [], default=0)
    lines = [
        f"model  {model_name}",
        f"draft  {draft_name}",
        f"status {status}",
        "",
        f"block {block_label(block_size, stats)}  temp {temperature:g}  max {max_tokens}",
        f"colour by cycle: {'on' if colour_cycles else 'off'}",
        "",
    ]
    if stats is None:
        return lines + ["no answer yet"]
    s = stats
    lines += [
        f"DFlash    {s.tps:8.1f} tok/s",
        "baseline  " + (f"{s.baseline_tps:8.1f} tok/s" if s.baseline_tps is not None else "  F3 runs plain decoding"),
    ]
    if s.baseline_tps:
        same = {True: "same tokens", False: "tokens differ", None: ""}[s.baseline_same]
        lines.append(f"speed-up  {s.tps / s.baseline_tps:8.2f}x  {same}")
    lines += [
        f"tau       {s.tau:8.2f} tokens/forward",
        f"tokens    {s.generation_tokens:8d}  cycles {len(s.accept_lengths)}",
        f"prompt    {s.prompt_tokens:8d}  prefilled {s.prefill_tokens}",
        f"prefill   {s.prompt_time * 1000:8.0f} ms  reused {s.reused_tokens}",
        f"peak mem  {memory(s.peak_memory)}",
        f"finish    {s.finish or '...':>8}",
        "",
        "accept length per cycle",
        sparkline(s.accept_lengths, top=max(max_block - 1, 1)) or "-",
        "",
        "accept length histogram",
        # bins up to the longest accept seen, so short answers keep the panel short
        *histogram(s.accept_lengths, min(max(s.accept_lengths, default=0) + 1, max(max_block, 1))),
    ]
    return lines
