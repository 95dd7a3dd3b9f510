"""Copy proposals: propose the continuation of the longest earlier match of the context's suffix.

Rewrites, edits, quotes and repeated answers are mostly spans of what the context
already holds. `ContextIndex` keeps, for every n-gram of the context (n up to
`MAX_NGRAM`) that has a next token, the latest position where it ended; a lookup
finds the longest n-gram the context ends with that occurred before, and proposes
what followed it (past the end of the context, a repeat continues with its period).
Appending a token costs `MAX_NGRAM` dictionary writes, so the index follows the
committed tokens at amortized O(1) per token. Each n-gram's earlier ends are chained
(`earlier`, one packed int per n-gram), so `matches` also finds what followed it in other
places: several continuations for a copy tree (`copy_tree`).

`CopyRecord` learns how often copies are right: per match length and per depth of
the proposal, as decayed hit/trial counts (the same estimate `policy.acceptance.DraftAcceptance`
keeps for the draft), and gives the expected number of accepted tokens of a copy
(cf. Arctic Inference's suffix decoding, which scores a candidate by its expected
accepted tokens), from which `policy.copies` decides when a copy is verified and how
much of it. A copy is a deterministic proposal: greedy acceptance is exact, and at
temperature > 0 it is a one-hot q, exact with the usual rejection step.
"""

from array import array
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

MAX_NGRAM = 8
# Earlier occurrences of one n-gram looked at for other continuations (most recent first).
MAX_STEPS = 8


@dataclass
class CopyMatch:
    """The context's last `length` tokens occurred before, ending just before `start`:
    what followed them, `continuation`, is the proposal. `shared`: found in earlier
    requests (`suffix_index.SuffixIndex`; `start` is then a position there), not in the context."""

    length: int
    start: int
    continuation: List[int]
    shared: bool = False


class ContextIndex:
    """Hashed n-grams (n = 1..MAX_NGRAM) of a token sequence -> the latest position each
    ended at, for n-grams that have a next token."""

    def __init__(self, tokens: Sequence[int] = ()):
        self.tokens: List[int] = []
        self.latest: Dict[Tuple[int, ...], int] = {}
        # earlier[n - 1][e]: the end before e of the n-gram ending at e, -1 for none
        self.earlier: List[array] = [array("i") for _ in range(MAX_NGRAM)]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]):
        seq, latest, earlier = self.tokens, self.latest, self.earlier
        for t in tokens:
            i = len(seq)  # the new token's position: every n-gram ending at i-1 now has a next token
            if i:
                for n in range(1, MAX_NGRAM + 1):
                    if n <= i:
                        key = tuple(seq[i - n : i])
                        earlier[n - 1].append(latest.get(key, -1))
                        latest[key] = i - 1
                    else:
                        earlier[n - 1].append(-1)
            seq.append(int(t))

    def follows(self, tokens: Sequence[int]) -> bool:
        """Whether the index's tokens are a prefix of `tokens` (then `extend` brings it up to date)."""
        n = len(self.tokens)
        return len(tokens) >= n and list(tokens[:n]) == self.tokens

    def match(self, max_tokens: int) -> Optional[CopyMatch]:
        """The longest earlier occurrence of the context's suffix and up to `max_tokens`
        tokens of what followed it; None when not even the last token occurred before."""
        found = self.matches(max_tokens, 1)
        return found[0] if found else None

    def matches(self, max_tokens: int, k: int) -> List[CopyMatch]:
        """Up to `k` distinct continuations of the context's suffix: the longest match's
        occurrences first, most recent first (up to `MAX_STEPS` of each), then shorter ones'."""
        seq, end = self.tokens, len(self.tokens)
        found: List[CopyMatch] = []
        seen = set()
        for n in range(min(MAX_NGRAM, end - 1), 0, -1):
            last, chain = self.latest.get(tuple(seq[end - n :]), -1), self.earlier[n - 1]
            for _ in range(MAX_STEPS):
                if last < 0:
                    break
                start = last + 1
                period = end - start  # the match repeats every `period` tokens past the end
                continuation = [seq[start + j] if start + j < end else seq[start + (j % period)]
                                for j in range(max_tokens)]
                if tuple(continuation) not in seen:
                    seen.add(tuple(continuation))
                    found.append(CopyMatch(n, start, continuation))
                    if len(found) >= k:
                        return found
                last = chain[last]
        return found


class CopyRecord:
    """How often a copy's tokens are accepted, per match length and depth (decayed counts)."""

    def __init__(self, max_depth: int, decay: float = 0.95, prior: float = 0.3, prior_strength: float = 2.0):
        self.max_depth = max_depth
        self.decay = decay
        self.prior = prior
        self.prior_strength = prior_strength
        self.hits = [[0.0] * max_depth for _ in range(MAX_NGRAM + 1)]
        self.trials = [[0.0] * max_depth for _ in range(MAX_NGRAM + 1)]

    def alpha(self, length: int) -> List[float]:
        """P(copy token k+1 accepted | tokens up to k were), per depth k, for a match of `length`.
        A depth seen rarely leans on the depth above it."""
        hits, trials = self.hits[length], self.trials[length]
        out, above = [], self.prior
        for k in range(self.max_depth):
            rate = (hits[k] + self.prior_strength * above) / (trials[k] + self.prior_strength)
            out.append(rate)
            above = rate
        return out

    def expected_tokens(self, length: int, n: int) -> float:
        """Expected accepted copy tokens when `n` of them are verified."""
        total, chain = 0.0, 1.0
        for a in self.alpha(length)[:n]:
            chain *= a
            total += chain
        return total

    def update(self, length: int, proposed: int, accepted: int):
        """A copy of a match of `length`: `proposed` tokens verified, the first `accepted` right."""
        hits, trials = self.hits[length], self.trials[length]
        for k in range(self.max_depth):
            hits[k] *= self.decay
            trials[k] *= self.decay
        for k in range(min(proposed, accepted + 1, self.max_depth)):
            trials[k] += 1.0
            hits[k] += 1.0 if k < accepted else 0.0


# Verify rows a copy may fill: dense where acceptance changes most, as the draft's widths.
COPY_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 15)
