"""A caller's own forwards on the engine's model, on another thread, while the engine decodes
(`models.target.stand_ins`): `foreign_forwards` runs mlx-lm forwards of a fixed prompt in a loop, with
Python switching threads every 10 us so they interleave with the building of the engine's verifies, and
counts those whose logits are not the ones that prompt gives with nothing else running."""

import contextlib
import random
import sys
import threading
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


# mlx-lm's own forwards of these, from two threads at once, crash MLX 0.32.4's CPU backend whatever the
# engine does (Gemma 3n: two threads x 1,000 plain forwards segfaulted in 4 runs of 5, compile on or off)
CONCURRENCY_UNSAFE = frozenset({"gemma3n"})


def foreign_case(seed: int, key: str) -> bool:
    """Whether the option fuzz's case `seed` on architecture `key` runs foreign forwards (one in ten)."""
    return random.Random(f"foreign {seed}").random() < 0.1 and key not in CONCURRENCY_UNSAFE


@dataclass
class Foreign:
    forwards: int = 0
    wrong: int = 0
    error: str = ""

    def fault(self) -> str:
        """What went wrong on the foreign thread ("" where nothing did)."""
        if self.error or self.wrong:
            return f"foreign forwards: {self.wrong} of {self.forwards} gave other logits {self.error}".strip()
        return ""


def plain_logits(model, prompt) -> mx.array:
    """mlx-lm's forward of `prompt` (token ids) on fresh caches, evaluated: logits [1, T, V]."""
    out = model(mx.array([prompt]), cache=make_prompt_cache(model))
    mx.eval(out)
    return out


@contextlib.contextmanager
def foreign_forwards(model, prompt, on: bool = True, switch_interval: float = 1e-5):
    """Inside: another thread runs `model` on `prompt` (token ids) again and again; yields a `Foreign`
    tally, complete on exit (at least one forward is waited for). `on=False`: nothing runs."""
    if not on:
        yield Foreign()
        return
    clean, tally, stop = plain_logits(model, prompt), Foreign(), threading.Event()

    def loop():
        try:
            while not stop.is_set() or tally.forwards == 0:
                tally.wrong += not mx.array_equal(plain_logits(model, prompt), clean).item()
                tally.forwards += 1
        except Exception as e:  # (the tally carries it to the caller's thread)
            tally.error = f"{type(e).__name__}: {e}"
        finally:
            mx.clear_streams()  # (MLX's streams of a thread go before it ends, else the exit may abort)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval)
    thread = threading.Thread(target=loop, name="foreign forwards", daemon=True)
    thread.start()
    try:
        yield tally
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
