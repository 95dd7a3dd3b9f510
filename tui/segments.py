"""Answer text split by cycle: tokens the draft proposed and the target accepted vs
the target's own (bonus) token, for the colour-by-cycle view."""

from itertools import groupby
from typing import Iterable, List, NamedTuple, Sequence


class Segment(NamedTuple):
    text: str
    drafted: bool  # True: proposed by the draft and accepted; False: the target's token
    cycle: int


class CycleText:
    """Accumulates committed tokens and yields their text in per-cycle segments.

    The text of a token run is read off the decode of the whole answer so far:
    decoding tokens one by one would mangle characters split across byte tokens.
    A trailing U+FFFD (an incomplete UTF-8 sequence) is held back until the rest
    of the character arrives, and then belongs to the segment that completes it.
    """

    def __init__(self, tokenizer, stop_ids: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.ids: List[int] = []
        self.text = ""
        self.segments: List[Segment] = []
        self.cycles = 0
        self.drafted = 0  # tokens (stop tokens excluded) the draft proposed and the target kept
        self.bonus = 0  # tokens the target chose itself

    def add(self, tokens: Sequence[int], from_draft: Sequence[bool]) -> List[Segment]:
        """Add one cycle's committed tokens; return the segments it produced."""
        cycle = self.cycles
        self.cycles += 1
        new = []
        for drafted, run in groupby(zip(tokens, from_draft), key=lambda tf: tf[1]):
            ids = [t for t, _ in run if t not in self.stop_ids]
            if not ids:
                continue
            self.ids.extend(ids)
            if drafted:
                self.drafted += len(ids)
            else:
                self.bonus += len(ids)
            full = self.tokenizer.decode(self.ids).rstrip("\ufffd")
            if not full.startswith(self.text):
                continue  # a tokenizer whose decode is not prefix-stable: skip, never garble
            piece, self.text = full[len(self.text):], full
            if piece:
                new.append(Segment(piece, bool(drafted), cycle))
        self.segments.extend(new)
        return new
