"""Logits processors on verify rows: repetition, presence and frequency penalties, logit bias, or any
of mlx-lm's `LogitsProcessor`s ((tokens, logits [1, V]) -> logits [1, V]).

mlx-lm's `generate_step` calls each processor on one step's logits with `tokens`: every token of the
prompt and of the answer so far, the one that step fed included. A verify row stands for one such
step: row r of a verify that fed [last, d1 .. dn] after the context `prior` (the tokens whose cache
entries were already written) is the step that fed its own input, so it gets prior + inputs[:r + 1];
a token tree's node gets prior and the tokens on its path from the root, itself included. Where a
draft is rejected, the rows past it saw wrong tokens, as their logits did, and acceptance never reads
them. Each row is processed on its own, with the calls mlx-lm's step makes on the same values, so
greedy output stays mlx-lm's under the same processors and sampling draws from the processed
distribution (the acceptors and `sampling_logprobs` take processed logits).

A cycle queued before the host read the one before it (`engine.ahead.before_reading`,
`engine.batch_ahead.before_reading`) queues on the guess that every token that cycle fed is kept: its
prior ends with those tokens, lazy (`process_prior`'s `unread`), as mlx-lm's own queued step holds its
last token; where the guess fails, the cycle is discarded.
"""

from typing import Callable, List, Optional, Sequence

import mlx.core as mx

from dflash_mlx.models.target.tree_attention import TokenTree

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def _apply(processors: Sequence[LogitsProcessor], histories: List[mx.array], logits: mx.array) -> mx.array:
    """logits [R, V], histories[r] row r's tokens -> the processed logits [R, V]."""
    rows = []
    for r, history in enumerate(histories):
        row = logits[r : r + 1]
        for processor in processors:
            row = processor(history, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)


def _tokens(prior) -> mx.array:
    """Host tokens (or an array of them, kept) as an int32 array [T]."""
    return prior if isinstance(prior, mx.array) else mx.array(list(prior), dtype=mx.int32)


def process_prior(processors: Sequence[LogitsProcessor], prior: Sequence[int], unread: Optional[mx.array] = None):
    """`prior` as the array the rows' histories start with, made once, as the verify is built (the host's
    list grows once the cycle is read), then `unread` [k] (lazy: the tokens a cycle not read yet fed); None
    without processors."""
    if not processors:
        return None
    head = _tokens(prior)
    return head if unread is None else mx.concatenate([head, unread.astype(mx.int32)])


def process_first(processors: Sequence[LogitsProcessor], prompt: Sequence[int], logits: mx.array) -> mx.array:
    """The last prompt position's logits [1, V], processed as mlx-lm's first step is (after the whole prompt)."""
    if not processors:
        return logits
    return _apply(processors, [_tokens(prompt)], logits)


def process_chain(processors: Sequence[LogitsProcessor], prior, inputs: mx.array, logits: mx.array,
                  start: int = 0) -> mx.array:
    """Verify rows start .. start + R - 1 of one sequence, logits [1, R, V], whose verify fed `inputs` [1, W]
    (lazy is fine) after `prior` (host tokens, or `_tokens` of them) -> processed [1, R, V]."""
    if not processors:
        return logits
    head = _tokens(prior)
    fed = inputs[0].astype(mx.int32)
    histories = [mx.concatenate([head, fed[: r + 1]]) for r in range(start, start + logits.shape[1])]
    return _apply(processors, histories, logits[0])[None]


def process_tree(processors: Sequence[LogitsProcessor], prior: Sequence[int], tree: TokenTree,
                 logits: mx.array) -> mx.array:
    """A token tree's verify, logits [N, V] (node 0 the root, the last committed token) -> processed [N, V]."""
    if not processors:
        return logits
    paths: List[List[int]] = []
    for node, parent in enumerate(tree.parents):
        paths.append((paths[parent] if parent >= 0 else []) + [tree.tokens[node]])
    prior = list(prior)
    return _apply(processors, [_tokens(prior + path) for path in paths], logits)
