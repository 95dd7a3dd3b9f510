"""The DFlash cycle of one sequence: prefill, then draft -> verify -> accept -> rollback.

Token-level pieces, as mlx-lm keeps its step functions apart from its response layer:
`prefill_chunks`, and `cycle`, one cycle of one sequence on its own caches, with the split
of its verify's LM head (`HeadRows`). The engine (`engine.BatchEngine`) runs `cycle` for a
row that decodes alone, which is every `stream_generate` call, and its own batched cycle
(`batch_cycle`) for two rows or more. What a cycle asks of the draft: `drafter`.
"""

import time
from typing import Callable, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash_mlx.engine.ahead import (Context, Launched, ahead, before_reading, copy_in_sight, discard, land, launch,
                                     make_plan, may_launch, take)
from dflash_mlx.engine.distributed import share_seconds
from dflash_mlx.engine.prompt_cache import PromptCache
from dflash_mlx.engine.responses import Step, committed_span, token_logprobs
from dflash_mlx.models.target.adapter import Target
from dflash_mlx.models.target.exact_rows import MLX_LM_PREFILL_STEP
from dflash_mlx.models.target.kv_quantization import convert_due
from dflash_mlx.models.target.kv_window import chunk_rows
from dflash_mlx.models.target.tree_attention import compact_cache
from dflash_mlx.speculation.copies import CopyMatch
from dflash_mlx.speculation.processors import process_first
from dflash_mlx.speculation.tree_verify import verify_token_tree, verify_tree


class HeadRows:
    """How many verify rows get the target's LM head before the accept length is read.

    Rows past the first rejected draft are never used. On a CPU the head's cost
    grows with its rows (SmolLM2's 49152 x 576 head: ~12 ms for 4 rows, ~21 ms for
    16), so the head first runs on rows that hold the likely accept length, and
    on the rest only when all of those are accepted (`accept_in_pieces`). A GPU
    reads the head once whatever the rows: there all rows run at once, no extra sync.
    """

    # Below this many head weights (vocab x hidden) a CPU's head costs less than the second
    # host sync a split can take (a tiny target: ~0.15 ms a cycle of 2.3 measured there).
    SPLIT_FROM = 4_000_000

    @classmethod
    def pays(cls, target) -> bool:
        """Whether splitting the head saves time: on a CPU, for a head of SPLIT_FROM weights or more."""
        return mx.default_device() == mx.cpu and target.vocab_size * target.hidden_size >= cls.SPLIT_FROM

    def __init__(self, split: bool):
        self.split = split
        self.mean_accept = 0.0  # moving average of recent accept lengths

    def first(self, width: int) -> int:
        if not self.split:
            return width
        # The second piece costs about another whole head, so the first should
        # hold the accept length most of the time: for roughly geometric accept
        # lengths with mean m, P(accept >= 2m + 2) is about e^-2.
        return max(4, int(2 * self.mean_accept) + 3)

    def update(self, accept_length: int):
        self.mean_accept += 0.1 * (accept_length - self.mean_accept)


def prefill_bounds(num_tokens: int, step_size: int, deterministic: bool = False) -> List[Tuple[int, int]]:
    """(start, stop) of each prefill forward over `num_tokens` new prompt tokens: all but the last
    in chunks of `step_size` (mlx-lm's own in deterministic mode, with a quantized KV cache, whose conversion
    falls after one of them, `models.target.kv_quantization`, and with a bounded one, whose chunks' masks are
    mlx-lm's prefill's, `models.target.kv_window`), then the last token alone, as
    mlx-lm's `generate_step` runs it. The first token's logits and the last prompt token's cache
    entry are then a one-row forward's, as in plain decoding: a row of a wider forward rounds
    differently (on a GPU by much, on this CPU by ~1e-6 in float32), and a near-tie there would
    part the answer from mlx-lm's from its first token, at every width."""
    if num_tokens < 1:
        return []
    step = MLX_LM_PREFILL_STEP if deterministic else step_size
    body = [(s, min(s + step, num_tokens - 1)) for s in range(0, num_tokens - 1, step)]
    return body + [(num_tokens - 1, num_tokens)]


def prefill_chunks(target: Target, drafter, acceptor, state: PromptCache, prompt_ids: List[int],
                   step_size: int, logits_out: Optional[list] = None, processors=(),
                   progress: Optional[Callable[[int, int], None]] = None):
    """Run the prompt tokens the cache does not hold, `step_size` at a time: a generator that
    yields the tokens run after each chunk but the last and returns (first token [1], tokens
    run) (the engine runs a few chunks of joining requests per step, so running rows keep
    flowing). `logits_out`: a list that gets the last prompt position's logits [1, V], after the
    row's logits `processors` (`speculation.processors`), as the first token is chosen from them.
    `progress(done, total)`: mlx-lm's `prompt_progress_callback`, over the tokens the cache does not hold
    (0 first, then after each forward; `total` last)."""
    discard(target, state)  # a cycle an earlier call launched and never landed
    new_ids = state.reuse(prompt_ids, target, drafter.draft)
    state.valid = False  # until the caches and `tokens` agree again
    cache = state.target_cache
    bounds = prefill_bounds(len(new_ids), step_size,
                            target.deterministic or state.kv_quantization is not None or state.windowed)
    if progress is not None:
        progress(0, len(new_ids))
    for start, stop in bounds:
        with mx.stream(generation_stream):
            if start == 0:
                drafter.absorb(None)
            chunk = mx.array(new_ids[start:stop])[None]
            with chunk_rows(cache):  # (a bounded cache masks them as mlx-lm's prefill does)
                h, feats, _ = target.forward(chunk, cache, drafter.layer_ids, fuse=drafter.fuse)
            drafter.absorb(feats)
            mx.eval([c.state for c in cache], h)
            convert_due(cache, state.kv_quantization)
            if state.draft_cache:
                mx.eval([kv for c in state.draft_cache for kv in c.fetch() if kv is not None])
        if progress is not None:
            progress(stop, len(new_ids))
        if stop < len(new_ids):
            yield chunk.shape[1]
    with mx.stream(generation_stream):
        logits = process_first(processors, prompt_ids[state.history_start:], target.logits(h[:, -1, :]))
        first = acceptor.first_token(logits)
        mx.eval(first)
    if logits_out is not None:
        logits_out.append(logits)
    state.tokens.extend(new_ids)
    state.valid = True
    return first, len(new_ids)


def cycle(ctx: Context, last: mx.array, budget: int, stops, timer,
          logprobs: Optional[int] = None) -> Tuple[Step, mx.array]:
    """One draft -> verify -> accept -> rollback cycle of one sequence on its own (unbatched)
    caches: (its Step, the new last committed token [1]).

    `ctx` (`ahead.Context`): the row's target, drafter, acceptor, width policy (`widths`), prompt
    cache (`state`), head split (`head_rows`) and its copy and tree policies, kept by the row.
    `last` [1]: the last committed token; `budget`: tokens it may still commit. The cycle
    syncs with the host once, to read the accept length (twice when a split LM head needs
    its other rows, see `HeadRows`); `widths` picks its verify width.
    `copies` (with `index`, the context so far): the cycle may verify a copy of what followed
    an earlier occurrence of the context's suffix instead of the draft's block, when that
    is expected to commit more tokens per second (`policy.copies.CopyPolicy`); `shared`, an
    index of earlier requests, offers a candidate beside the context's own.
    `trees` (on targets `tree_attention.tree_support` accepts; sampled exactly at T > 0): a drafted
    cycle may spend its rows on a token tree from the draft's top-k instead of its chain
    (`policy.trees.TreePolicy`, `speculation.tree_verify`; two host syncs in such a cycle).
    `copy_trees` (same targets): where the indexes hold several continuations of the context's
    suffix, the cycle may verify them as one copy tree (`policy.copy_trees.CopyTreePolicy`).
    `logprobs` (None: off) >= 0: the step carries its tokens' `TokenLogprob`s with that
    many alternatives, from the verify's own logits (one more sync when on).
    Where it may (`ahead.may_launch`), the cycle ends by planning and launching the next one
    (`engine.ahead`): its graph is queued before this step's response is built and sent, so the
    device runs it meanwhile; the next call only reads it. A plain step's successor, and on a guess
    a chain's, is queued even before this cycle is read (`ahead.before_reading`, `policy.lookahead`).
    """
    target, drafter, acceptor, widths, state = ctx.target, ctx.drafter, ctx.acceptor, ctx.widths, ctx.state
    head_rows, copies, index, trees, copy_trees = ctx.head_rows, ctx.copies, ctx.index, ctx.trees, ctx.copy_trees
    cache = state.target_cache
    launched, plan = take(state)
    if launched is None:
        if plan is None:
            plan = make_plan(ctx, budget)
        timer.start()
        if plan.tree is None:
            launched = launch(ctx, plan, last, timer, logprobs)
    state.valid = False
    tree_run = None
    early = launched is not None and before_reading(ctx, launched, budget, timer, logprobs)
    guess_last = None
    if early:  # the next cycle queued behind this one before the host reads it: see `guessed` below
        full = launched.width
        with mx.stream(generation_stream):
            if launched.feats is not None:
                drafter.keep(launched.feats)
            guess_last = launched.committed[:, full - 1]
        ahead(ctx, budget - full, guess_last, timer, unread=launched.verify_in)
    if launched is None:  # a token tree: its own verify, two host syncs
        t0 = time.perf_counter()
        width = plan.width
        with mx.stream(generation_stream):
            if plan.copy_tree is not None:
                width = len(plan.copy_tree.tree)
                tree_run = verify_token_tree(target, acceptor, cache, plan.copy_tree.tree, drafter.layer_ids,
                                             drafter.fuse, ctx.processors, state.history)
            else:
                tree_run = verify_tree(target, drafter, acceptor, cache, last, width, ctx.processors, state.history)
        feats, record = tree_run.features, None
        tokens = tree_run.tokens
        a = len(tokens) - 1
        rows = tree_run.path  # verify rows of the committed tokens' inputs, root first
        verified = [tree_run.tree.tokens[r] for r in rows]
        seconds = time.perf_counter() - t0
        if plan.copy_tree is not None:
            share_seconds(target, seconds, copy_trees.count(plan.copy_tree, rows))
        else:
            trees.update(width, a)
            share_seconds(target, seconds, widths.count(width, a, chain=False))
    else:
        width, feats, record = launched.width, launched.feats, launched.record
        land(launched)  # the cycle's host sync and its one read
        read_at = time.perf_counter()
        accepts, chosen, fed = launched.read
        a = accepts[0]
        tokens = chosen[0][: a + 1]
        rows = list(range(a + 1))
        verified = fed[0][: a + 1]
        seconds = launched.seconds()
        if launched.copy_length:
            match = launched.match
            share_seconds(target, seconds, copies.count(match.length, launched.copy_length, a, shared=match.shared))
        else:
            share_seconds(target, seconds, widths.count(width, a))
            if ctx.lookahead is not None:
                if ctx.read_at is not None:  # from read to read: what a guess thrown away would hold the device
                    ctx.lookahead.timed_cycle(width, read_at - ctx.read_at)
                if width > 1:
                    ctx.lookahead.observe(width, a == width - 1)
                elif copies is not None:
                    ctx.after_plain = True  # (whether a copy comes into sight: the next `plan_copies`)
    ctx.read_at = read_at if tree_run is None else None
    head_rows.update(a)
    timer.mark("verify")

    kept, finish = committed_span(tokens, stops, budget)  # fed tokens whose cache entries stay
    # The cycle queued before the read guessed that every row is kept with the exact acceptance's
    # tokens (a plain step's one always is, but for a stop); where not, it is rolled back whole.
    guessed = early and kept == width and finish is None and not launched.redone
    if early and not guessed:
        discard(target, state)
        drafter.unkeep(width - kept)
    step_logprobs = None
    if logprobs is not None:
        if tree_run is not None:
            chosen = tree_run.logits[mx.array(rows[:kept])]
        else:  # row i chose committed token i; the pieces overlap by one row
            chosen, next_row = [], 0
            for start, piece in launched.pieces:
                chosen.append(piece[0, next_row - start :])
                next_row = start + piece.shape[1]
            chosen = mx.concatenate(chosen, axis=0)[:kept]
        step_logprobs = token_logprobs(chosen, tokens[:kept], logprobs)
    with mx.stream(generation_stream):
        if tree_run is not None:
            compact_cache(cache, tree_run.start, rows[:kept], len(tree_run.tree))
            if feats is not None:
                drafter.keep(feats[:, mx.array(rows[:kept])])
        else:
            target.rollback(cache, width, width - kept, record)
            if feats is not None and not early:  # (queued early, it kept them all; `unkeep` took back the rest)
                drafter.keep(feats[:, :kept])
        if not guessed:  # (a guess kept: the next cycle's rows are in, and it did not start past the line)
            convert_due(cache, state.kv_quantization)
    timer.mark("rollback", lambda: [c.state for c in cache])
    state.tokens.extend(verified[:kept])
    state.valid = state.ahead is None
    if index is not None:
        index.extend(tokens[:kept])
        if guessed and copy_in_sight(ctx, budget - kept - 1, state.ahead.width):
            discard(target, state)  # the cycle queued behind this one goes: the copy runs now
            guessed = False
    kind = ("copy_tree" if plan is not None and plan.copy_tree is not None else "tree" if tree_run is not None
            else copy_kind(launched.match) if launched.copy_length else "draft" if width > 1 else None)
    step = Step(tokens[:kept], [i < a for i in range(kept)], finish, min(kept, a), width, timer.result(),
                step_logprobs, kind)
    # (a guess kept: its last token is the lazy one the queued cycle was built on, read already)
    new_last = guess_last if guessed else mx.array([tokens[a]], dtype=mx.int32)
    if not guessed and finish is None and budget - kept > 0 and may_launch(ctx, timer, logprobs):
        ahead(ctx, budget - kept, new_last, timer)
        if ctx.lookahead is not None and launched is not None and isinstance(state.ahead, Launched):
            ctx.lookahead.timed_gap(state.ahead.queued - read_at)  # what a guess would have hidden
    return step, new_last


def copy_kind(match: CopyMatch) -> str:
    """A copy cycle's `Step.proposal`: "copy" of the context, "global_copy" of earlier requests."""
    return "global_copy" if match.shared else "copy"
