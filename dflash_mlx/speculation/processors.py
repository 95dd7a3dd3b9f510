"""Logits processors on verify rows: repetition, presence and frequency penalties, logit bias, or any
of mlx-lm's `LogitsProcessor`s ((tokens, logits [1, V]) -> logits [1, V]).

mlx-lm's `generate_step` calls each processor on one step's logits with `tokens`: every token of the
prompt and of the answer so far, the one that step fed included. A verify row stands for one such
step: row r of a verify that fed [last, d1 .. dn] after the context `prior` (the tokens whose cache
entries were already written) is the step that fed its own input, so it gets prior + inputs[:r + 1];
a token tree's node gets prior and the tokens on its path from the root, itself included. Where a
draft is rejected, the rows past it saw wrong tokens, as their logits did, and acceptance never reads
them. Each row gets what mlx-lm's step computes from the same values, so greedy output stays mlx-lm's
under the same processors and sampling draws from the processed distribution (the acceptors and
`sampling_logprobs` take processed logits).

The penalties and logit bias a request sets (`option_processors`: mlx-lm's own processors, with what
they are made of) take all the rows of a verify at once: each row's last `context_size` tokens are
gathered into one index matrix and the row's logits updated by the very operations mlx-lm's processor
runs on one row (elementwise, so every row's values are bit for bit mlx-lm's; `tests/test_logits_processors`).
A caller's own processor is called row by row, as mlx-lm would call it.

A cycle queued before the host read the one before it (`engine.ahead.before_reading`,
`engine.batch_ahead.before_reading`) queues on the guess that every token that cycle fed is kept: its
prior ends with those tokens, lazy (`process_prior`'s `unread`), as mlx-lm's own queued step holds its
last token; where the guess fails, the cycle is discarded.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from dflash_mlx.models.target.tree_attention import TokenTree

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class Penalty:
    """One of mlx-lm's penalty or logit-bias processors and what it is made of: called as a
    `LogitsProcessor`, mlx-lm's own runs; `rows` takes many rows at once (see the module's docstring)."""

    kind: str  # "bias" | "repetition" | "presence" | "frequency"
    own: LogitsProcessor
    penalty: float = 0.0
    context_size: int = 0
    bias: tuple = ()  # a logit bias's (token, value) pairs

    @property
    def key(self) -> tuple:
        """What it computes: two with equal keys give every row the same values."""
        return self.kind, self.penalty, self.context_size, self.bias

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        return self.own(tokens, logits)

    def rows(self, histories: "Histories", logits: mx.array) -> mx.array:
        """logits [R, V] -> processed [R, V], row r after `histories` row r."""
        if self.kind == "bias":  # (the same for every history: mlx-lm's own, on all the rows)
            return self.own(None, logits)
        positions, pads, has_history = histories.windows(self.context_size)
        idx = histories.tokens[mx.array(positions)]  # [R, context_size]
        if self.kind == "frequency":  # counted once per occurrence: a pad subtracts nothing
            weights = mx.array(np.where(pads, 0.0, self.penalty)).astype(logits.dtype)
            return logits.at[mx.arange(logits.shape[0])[:, None], idx].subtract(weights)
        picked = mx.take_along_axis(logits, idx, axis=1)
        if self.kind == "repetition":
            changed = mx.where(picked < 0, picked * self.penalty, picked / self.penalty)
        else:  # presence
            changed = picked - self.penalty
        if not has_history.all():  # (mlx-lm skips a step with no tokens)
            changed = mx.where(mx.array(has_history)[:, None], changed, picked)
        return mx.put_along_axis(logits, idx, changed, axis=1)


def option_processors(options) -> List[Penalty]:
    """The processors of `options`' penalties and logit bias (`GenerationOptions` fields), in the order
    and on the conditions of mlx-lm's `make_logits_processors`, each made by mlx-lm."""
    from mlx_lm.sample_utils import (make_frequency_penalty, make_logits_processors, make_presence_penalty,
                                     make_repetition_penalty)

    made = []
    if options.logit_bias:
        made.append(Penalty("bias", make_logits_processors(logit_bias=options.logit_bias)[0],
                            bias=tuple(options.logit_bias.items())))
    for kind, make in (("repetition", make_repetition_penalty), ("presence", make_presence_penalty),
                       ("frequency", make_frequency_penalty)):
        penalty, size = getattr(options, f"{kind}_penalty"), getattr(options, f"{kind}_context_size")
        if penalty is not None and penalty != 0:
            made.append(Penalty(kind, make(penalty, size), penalty, size))
    return made


class Histories:
    """Each row's history as positions in `tokens` [T] (one sequence or several, end to end): row r's
    sequence starts at `rows[r][0]`, its first `rows[r][1]` tokens are its own prior, then come its
    `rows[r][2]` (host positions)."""

    def __init__(self, tokens: mx.array, rows: List[Tuple[int, int, List[int]]]):
        self.tokens, self.rows = tokens, rows

    def windows(self, size: int):
        """(positions [R, size] of each row's last `size` tokens, pads [R, size] where a short history
        repeats its first position, has_history [R]), on the host."""
        positions = np.zeros((len(self.rows), size), dtype=np.int32)
        pads = np.ones((len(self.rows), size), dtype=bool)
        for r, (base, prefix, tail) in enumerate(self.rows):
            own = tail[-size:]
            window = list(range(max(base, base + prefix - (size - len(own))), base + prefix)) + own
            if window:
                positions[r] = window + [window[0]] * (size - len(window))
                pads[r, : len(window)] = False
        return positions, pads, ~pads.all(axis=1)

    def row(self, r: int) -> mx.array:
        """Row r's whole history [T_r] (lazy), as a caller's processor takes it."""
        base, prefix, tail = self.rows[r]
        end = base + prefix
        if tail == list(range(end, end + len(tail))):  # (a chain's row: one slice)
            return self.tokens[base : end + len(tail)]
        return mx.concatenate([self.tokens[base:end], self.tokens[mx.array(tail, dtype=mx.int32)]])


def _apply(processors: Sequence[LogitsProcessor], histories: Histories, logits: mx.array) -> mx.array:
    """logits [R, V] -> processed [R, V]: each processor in turn, on every row (a run of a caller's
    processors row by row, each row through the whole run)."""
    done = 0
    while done < len(processors):
        if isinstance(processors[done], Penalty):
            logits = processors[done].rows(histories, logits)
            done += 1
            continue
        run = []
        while done < len(processors) and not isinstance(processors[done], Penalty):
            run.append(processors[done])
            done += 1
        rows = []
        for r in range(logits.shape[0]):
            row, history = logits[r : r + 1], histories.row(r)
            for processor in run:
                row = processor(history, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    return logits


def _tokens(prior) -> mx.array:
    """Host tokens (or an array of them, kept) as an int32 array [T]."""
    return prior if isinstance(prior, mx.array) else mx.array(list(prior), dtype=mx.int32)


def process_prior(processors: Sequence[LogitsProcessor], prior: Sequence[int], unread: Optional[mx.array] = None):
    """`prior` as the array the rows' histories start with, made once, as the verify is built (the host's
    list grows once the cycle is read), then `unread` [k] or [1, k] (lazy: the tokens a cycle not read yet
    fed); None without processors."""
    if not processors:
        return None
    head = _tokens(prior)
    return head if unread is None else mx.concatenate([head, unread.reshape(-1).astype(mx.int32)])


def process_first(processors: Sequence[LogitsProcessor], prompt: Sequence[int], logits: mx.array) -> mx.array:
    """The last prompt position's logits [1, V], processed as mlx-lm's first step is (after the whole prompt)."""
    if not processors:
        return logits
    head = _tokens(prompt)
    return _apply(processors, Histories(head, [(0, head.shape[0], [])]), logits)


def process_chain(processors: Sequence[LogitsProcessor], prior, inputs: mx.array, logits: mx.array,
                  start: int = 0) -> mx.array:
    """Verify rows start .. start + R - 1 of one sequence, logits [1, R, V], whose verify fed `inputs` [1, W]
    (lazy is fine) after `prior` (host tokens, or `_tokens` of them) -> processed [1, R, V]."""
    if not processors:
        return logits
    head = _tokens(prior)
    n = head.shape[0]
    tokens = mx.concatenate([head, inputs[0].astype(mx.int32)])
    return _apply(processors, Histories(tokens, _chain_rows(0, n, range(start, start + logits.shape[1]))),
                  logits[0])[None]


def _chain_rows(base: int, prefix: int, rows: range) -> List[Tuple[int, int, List[int]]]:
    """`Histories` rows of one chain's verify rows `rows`: its sequence at `base`, `prefix` tokens of prior,
    then row r's fed tokens up to its own."""
    return [(base, prefix, list(range(base + prefix, base + prefix + r + 1))) for r in rows]


def process_batch(processors: Sequence[Sequence[LogitsProcessor]], priors: Sequence, inputs: mx.array,
                  logits: mx.array) -> mx.array:
    """A batch's verify, logits [B, W, V], whose row b fed `inputs[b]` after `priors[b]` (`process_prior`'s,
    None without processors) under its own `processors[b]` -> processed [B, W, V]. Rows whose processors
    are all penalties of the same settings are processed together (one index matrix for all their rows)."""
    groups = {}
    for b, own in enumerate(processors):
        if own:
            same = all(isinstance(p, Penalty) for p in own)
            groups.setdefault(tuple(p.key for p in own) if same else ("own", b), []).append(b)
    out = [logits[b : b + 1] for b in range(logits.shape[0])]
    width = inputs.shape[1]
    for group in groups.values():
        if len(group) == 1:
            b = group[0]
            out[b] = process_chain(processors[b], priors[b], inputs[b : b + 1], logits[b : b + 1])
            continue
        parts, rows, base = [], [], 0
        for b in group:
            head = _tokens(priors[b])
            n = head.shape[0]
            parts += [head, inputs[b].astype(mx.int32)]
            rows += _chain_rows(base, n, range(width))
            base += n + width
        every = len(group) == logits.shape[0]  # (every row: no gather, no split)
        together = (logits if every else logits[mx.array(group)]).reshape(len(group) * width, -1)
        done = _apply(processors[group[0]], Histories(mx.concatenate(parts), rows), together)
        if every:
            return done.reshape(logits.shape)
        for i, b in enumerate(group):
            out[b] = done[i * width : (i + 1) * width][None]
    return mx.concatenate(out, axis=0)


def process_tree(processors: Sequence[LogitsProcessor], prior: Sequence[int], tree: TokenTree,
                 logits: mx.array) -> mx.array:
    """A token tree's verify, logits [N, V] (node 0 the root, the last committed token) -> processed [N, V]."""
    if not processors:
        return logits
    head = _tokens(prior)
    n = head.shape[0]
    paths: List[List[int]] = []
    for node, parent in enumerate(tree.parents):
        paths.append((paths[parent] if parent >= 0 else []) + [n + node])
    tokens = mx.concatenate([head, mx.array(tree.tokens, dtype=mx.int32)])
    return _apply(processors, Histories(tokens, [(0, n, path) for path in paths]), logits)
