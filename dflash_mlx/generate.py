"""The DFlash engine: prefill, then draft -> verify -> accept -> rollback cycles.

Two layers, as in mlx-lm: `prefill` and `cycles` work on tokens and caches;
`stream_generate` (the single-sequence engine the CLI, the chat app, the benchmarks and,
for targets the batch engine does not take, the server use) checks arguments and turns
steps into text and statistics (`responses.Answer`). Plain decoding is the same loop
with the null drafter (`PlainDecoding`) at width 1.
"""

import copy
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from dflash_mlx.accept import GreedyAcceptor, Proposal, accept_in_pieces, make_acceptor
from dflash_mlx.adaptive import FixedWidth, sizer_for
from dflash_mlx.copy_proposals import ContextIndex, CopyPolicy, copy_policy_for
from dflash_mlx.options import AUTO, fixed_width
from dflash_mlx.prompt_cache import PromptCache, make_prompt_cache  # noqa: F401 (public path)
from dflash_mlx.responses import (  # noqa: F401 (DFlashResponse, TokenLogprob, tau: public paths)
    Answer, DFlashResponse, Step, TokenLogprob, committed_span, first_step, tau, token_logprobs,
)
from dflash_mlx.target import Target, target_for
from dflash_mlx.token_tree import TreePolicy, compact_cache, tree_policy_for, tree_support, verify_tree


def _wrap_tokenizer(tokenizer):
    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


def stop_ids(tokenizer, extra: Sequence[int] = ()) -> set:
    """The token ids that end an answer: the tokenizer's EOS ids plus `extra`."""
    return set(_wrap_tokenizer(tokenizer).eos_token_ids or ()) | set(extra or ())


def encode_prompt(tokenizer, prompt: Union[str, Sequence[int], mx.array]) -> List[int]:
    if isinstance(prompt, mx.array):
        return prompt.reshape(-1).tolist()
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        return list(tokenizer.encode(prompt, add_special_tokens=add_special))
    return [int(t) for t in prompt]


# -- drafters: what a cycle asks of the draft ------------------------------------


class PlainDecoding:
    """The null drafter: no draft, so every cycle is a one-token target step."""

    draft = None
    layer_ids: List[int] = []

    def absorb(self, features):
        pass

    def keep(self, features):
        pass


class DraftContext:
    """A draft and its context cache (held by the prompt cache) as the cycles use them.

    Features of committed positions wait in `state.pending` until the next draft
    forward absorbs them, so a width-1 cycle runs no draft computation at all.
    """

    # Past this many waiting positions they are absorbed anyway, which bounds the
    # lazy graph a long stretch of width-1 cycles would otherwise build up.
    MAX_PENDING = 64

    def __init__(self, draft, state: PromptCache):
        self.draft = draft
        self.state = state
        self.layer_ids = list(draft.config.target_layer_ids)

    def absorb(self, features: Optional[mx.array]):
        """Inject features now (prefill), after whatever was waiting."""
        pending, self.state.pending = self.state.pending, None
        if pending is not None:
            self.draft.inject(pending, self.state.draft_cache)
        self.draft.inject(features, self.state.draft_cache)

    def keep(self, features: mx.array):
        pending = self.state.pending
        self.state.pending = features if pending is None else mx.concatenate([pending, features], axis=1)
        if self.state.pending.shape[1] > self.MAX_PENDING:
            self.absorb(None)

    def draft_logits(self, last: mx.array, width: int) -> mx.array:
        """The draft's logits [1, width - 1, V_draft] for the block after `last`."""
        pending, self.state.pending = self.state.pending, None
        return self.draft.propose_logits(last, pending, self.state.draft_cache, width)

    def propose(self, last: mx.array, width: int, acceptor) -> Proposal:
        return acceptor.propose(self.draft, self.draft_logits(last, width))


class HeadRows:
    """How many verify rows get the target's LM head before the accept length is read.

    Rows past the first rejected draft are never used. On a CPU the head's cost
    grows with its rows (SmolLM2's 49152 x 576 head: ~12 ms for 4 rows, ~21 ms for
    16), so the head first runs on rows that hold the likely accept length, and
    on the rest only when all of those are accepted (`accept_in_pieces`). A GPU
    reads the head once whatever the rows: there all rows run at once, no extra sync.
    """

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


# -- profiling -------------------------------------------------------------------


class PhaseTimer:
    """Wall time per cycle phase. It evaluates at each phase boundary, which costs
    host syncs the engine otherwise avoids: for benchmarks only."""

    def start(self):
        self.t0 = self.t = time.perf_counter()
        self.times: Dict[str, float] = {}

    def mark(self, phase: str, arrays=None):
        """`arrays`: what the phase produced (or a function returning it) to wait for."""
        if arrays is not None:
            mx.eval(arrays() if callable(arrays) else arrays)
        now = time.perf_counter()
        self.times[phase] = now - self.t
        self.t = now

    def result(self) -> Dict[str, float]:
        self.times["other"] = max(0.0, time.perf_counter() - self.t0 - sum(self.times.values()))
        return dict(self.times)


class NoTimer:
    """Profiling off: no syncs, no times."""

    def start(self):
        pass

    def mark(self, phase, arrays=None):
        pass

    def result(self):
        return None


# -- the token-level engine ----------------------------------------------------------


def prefill(target: Target, drafter, acceptor, state: PromptCache, prompt_ids: List[int],
            step_size: int, logits_out: Optional[list] = None) -> Tuple[mx.array, int]:
    """Run the prompt tokens the cache does not hold; return (first token [1], tokens run).

    `logits_out`: a list that gets the last prompt position's logits [1, V] (for logprobs)."""
    chunks = prefill_chunks(target, drafter, acceptor, state, prompt_ids, step_size, logits_out)
    while True:
        try:
            next(chunks)
        except StopIteration as done:
            return done.value


def prefill_chunks(target: Target, drafter, acceptor, state: PromptCache, prompt_ids: List[int],
                   step_size: int, logits_out: Optional[list] = None):
    """`prefill` a chunk of `step_size` tokens at a time: a generator that yields the tokens
    run after each chunk but the last and returns what `prefill` returns (the batch engine
    runs a few chunks of joining requests per cycle, so the running ones keep flowing)."""
    new_ids = state.reuse(prompt_ids, target, drafter.draft)
    state.valid = False  # until the caches and `tokens` agree again
    cache = state.target_cache
    for start in range(0, len(new_ids), step_size):
        with mx.stream(generation_stream):
            if start == 0:
                drafter.absorb(None)
            chunk = mx.array(new_ids[start : start + step_size])[None]
            h, feats, _ = target.forward(chunk, cache, drafter.layer_ids)
            drafter.absorb(feats)
            mx.eval([c.state for c in cache], h)
            if state.draft_cache:
                mx.eval([kv for c in state.draft_cache for kv in c.fetch() if kv is not None])
        if start + step_size < len(new_ids):
            yield chunk.shape[1]
    with mx.stream(generation_stream):
        logits = target.logits(h[:, -1, :])
        first = acceptor.first_token(logits)
        mx.eval(first)
    if logits_out is not None:
        logits_out.append(logits)
    state.tokens.extend(new_ids)
    state.valid = True
    return first, len(new_ids)


def cycles(target: Target, drafter, acceptor, widths, state: PromptCache, last: mx.array,
           budget: int, stops, timer, split_head: Optional[bool] = None,
           logprobs: Optional[int] = None, copies: Optional[CopyPolicy] = None,
           index: Optional[ContextIndex] = None, trees: Optional[TreePolicy] = None) -> Iterator[Step]:
    """Draft -> verify -> accept -> rollback until a stop id or `budget` more tokens.

    `last` [1]: the last committed token. Each cycle syncs with the host once,
    to read the accept length (twice when a split LM head needs its other rows,
    see `HeadRows`; `split_head` None: on CPUs); `widths` picks each cycle's verify width.
    `copies` (with `index`, the context so far): a cycle may verify a copy of what followed
    an earlier occurrence of the context's suffix instead of the draft's block, when that
    is expected to commit more tokens per second (`copy_proposals.CopyPolicy`).
    `trees` (greedy, on targets `token_tree.tree_support` accepts): a drafted cycle may
    spend its rows on a token tree from the draft's top-k instead of its chain
    (`token_tree.TreePolicy`; two host syncs in such a cycle).
    `logprobs` (None: off) >= 0: each step carries its tokens' `TokenLogprob`s with that
    many alternatives, from the verify's own logits (one more sync when on).
    """
    cache = state.target_cache
    head_rows = HeadRows(split=mx.default_device() == mx.cpu if split_head is None else split_head)
    while budget > 0:
        width = widths.choose(budget)
        match, copy_length = None, 0
        if copies is not None:
            match = index.match(copies.max_length)
            copy_length = copies.choose(match, budget, width)
        use_tree = False
        if trees is not None and not copy_length:
            explore = trees.explore(width, min(budget, widths.max_block))
            if explore is not None:
                width, use_tree = explore, True
            else:
                use_tree = trees.choose(width, widths.chain_tokens(width))
        timer.start()
        t0 = time.perf_counter()
        state.valid = False
        tree_run = None
        with mx.stream(generation_stream):
            if use_tree:
                tree_run = verify_tree(target, drafter, acceptor, cache, last, width)
                feats, record = tree_run.features, None
            else:
                if copy_length:
                    width = copy_length + 1
                    proposal = Proposal(mx.array([match.continuation[:copy_length]], dtype=mx.int32))
                    verify_in = mx.concatenate([last[:, None], proposal.tokens], axis=1)
                elif width > 1:
                    proposal = drafter.propose(last, width, acceptor)
                    verify_in = mx.concatenate([last[:, None], proposal.tokens], axis=1)
                    # The draft runs while the host builds the verify graph (on a GPU
                    # the whole draft forward hides behind it).
                    mx.async_eval(verify_in)
                else:
                    proposal, verify_in = None, last[:, None]
                timer.mark("draft", verify_in)
                h, feats, record = target.forward(verify_in, cache, drafter.layer_ids, record=width > 1)
                pieces = []  # (first row, logits [1, rows, V]) of each head piece, kept only for logprobs

                def row_logits(start, stop):
                    out = target.logits(h[:, start:stop])
                    if logprobs is not None:
                        pieces.append((start, out))
                    return out

                accept_len, committed = accept_in_pieces(acceptor, proposal, row_logits, head_rows.first(width),
                                                         drafter.draft)
        if tree_run is not None:
            tokens = tree_run.tokens
            a = len(tokens) - 1
            rows = tree_run.path  # verify rows of the committed tokens' inputs, root first
            verified = [tree_run.tree.tokens[r] for r in rows]
            trees.update(width, a)
            widths.update(width, a, time.perf_counter() - t0, chain=False)
        else:
            mx.eval(accept_len, committed, verify_in)  # the cycle's host sync
            a = accept_len.item()
            tokens = committed[0, : a + 1].tolist()
            rows = list(range(a + 1))
            verified = verify_in[0, : a + 1].tolist()
            if copy_length:
                copies.update(match.length, copy_length, a, time.perf_counter() - t0)
            else:
                widths.update(width, a, time.perf_counter() - t0)
        head_rows.update(a)
        timer.mark("verify")

        kept, finish = committed_span(tokens, stops, budget)  # fed tokens whose cache entries stay
        step_logprobs = None
        if logprobs is not None:
            if tree_run is not None:
                chosen = tree_run.logits[mx.array(rows[:kept])]
            else:  # row i chose committed token i; the pieces overlap by one row
                chosen, next_row = [], 0
                for start, piece in pieces:
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
                if feats is not None:
                    drafter.keep(feats[:, :kept])
        timer.mark("rollback", lambda: [c.state for c in cache])
        state.tokens.extend(verified[:kept])
        state.valid = True
        if index is not None:
            index.extend(tokens[:kept])
        budget -= kept
        last = mx.array([tokens[a]], dtype=mx.int32)
        kind = "tree" if tree_run is not None else ("copy" if copy_length else ("draft" if width > 1 else None))
        yield Step(tokens[:kept], [i < a for i in range(kept)], finish, min(kept, a), width, timer.result(),
                   step_logprobs, kind)
        if finish is not None:
            return


# -- the response layer: arguments, text, statistics -------------------------------


def stream_generate(
    model,
    draft,
    tokenizer,
    prompt: Union[str, Sequence[int], mx.array],
    max_tokens: int = 256,
    block_size: Union[int, str, None] = AUTO,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: Optional[int] = None,
    stop_token_ids: Optional[Sequence[int]] = None,
    prompt_cache: Optional[PromptCache] = None,
    baseline: bool = False,
    profile: bool = False,
    prefill_step_size: int = 512,
    draft_sampling: str = "argmax",
    split_head: Optional[bool] = None,
    logprobs: Optional[int] = None,
    copy_proposals: bool = True,
    token_trees: bool = True,
) -> Iterator[DFlashResponse]:
    """Generate with DFlash speculative decoding, one response per cycle.

    Greedy output (temperature 0) is exactly the target's own greedy output.
    `block_size`: "auto" (the default, as in every front end) picks each cycle's
    verify width from measured acceptance and cycle times (see `dflash_mlx.adaptive`);
    "draft" is always the draft's own block size (z-lab's behaviour); a whole number
    a fixed width (`dflash_mlx.options.BLOCK_SIZE_SPELLINGS`).
    `baseline=True` (or `draft=None`) decodes with the target alone.
    `split_head`: verify's LM head in two pieces (`HeadRows`); None: on CPUs only.
    `logprobs`: None (off, no cost), or k >= 0: each response's `logprobs` gives its
    tokens' log-probabilities under the target's unmodified distribution (before
    temperature and filters) and the k most likely tokens there (`TokenLogprob`).
    `copy_proposals` (with "auto"): a cycle may verify a copy of a span of the context
    instead of the draft's block, when measured acceptance and cost say it commits more
    tokens per second (`dflash_mlx.copy_proposals`); exact either way.
    `token_trees` (with "auto", greedy, on attention-only targets that take a tree's mask
    and positions, `dflash_mlx.token_tree.tree_support`): a drafted cycle may verify a
    tree of the draft's likeliest continuations instead of its chain, when trees have
    committed more tokens at that width. At temperature > 0 cycles verify chains.
    """
    tokenizer = _wrap_tokenizer(tokenizer)
    prompt_ids = encode_prompt(tokenizer, prompt)
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token of input")
    use_draft = draft is not None and not baseline
    target = target_for(model, draft)
    width = fixed_width(block_size, draft.block_size if use_draft else 1)  # ValueError for a bad one
    if not use_draft:
        width = 1
    acceptor = make_acceptor(
        temperature, top_p=top_p, top_k=top_k, min_p=min_p, draft_sampling=draft_sampling
    )
    copies = trees = None
    if width is None:
        widths = sizer_for(model, draft)
        if profile:
            # profiling syncs at every phase: its cycle times must not teach the shared policy
            widths = copy.deepcopy(widths)  # its copy and tree policies come along, riding on the copy
        copies = copy_policy_for(widths) if copy_proposals else None
        if token_trees and isinstance(acceptor, GreedyAcceptor) and tree_support(target) is None:
            trees = tree_policy_for(widths)
        widths.trees_on = trees is not None
    else:
        widths = FixedWidth(width)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if logprobs is not None and (isinstance(logprobs, bool) or int(logprobs) < 0):
        raise ValueError(f"logprobs must be None (off) or a whole number >= 0 of alternatives, got {logprobs!r}")
    stops = stop_ids(tokenizer, stop_token_ids)
    if seed is not None:
        mx.random.seed(seed)

    state = prompt_cache
    if state is None:
        state = make_prompt_cache(model, draft if use_draft else None)
    elif state.model is not model or (use_draft and state.draft is not draft):
        raise ValueError("prompt_cache was made for another model/draft; make a new one")
    elif not use_draft and state.draft is not None:
        raise ValueError("prompt_cache holds a draft context; use it with the same draft")
    if target.max_context and len(prompt_ids) >= target.max_context:
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens but {target.name} has a context window "
            f"of {target.max_context} tokens: shorten the prompt"
        )
    if target.max_context:
        max_tokens = min(max_tokens, target.max_context - len(prompt_ids))
    drafter = DraftContext(draft, state) if use_draft else PlainDecoding()
    timer = PhaseTimer() if profile else NoTimer()

    # mlx-lm's set-up: its generation stream, and (on Apple GPUs) the model's
    # weights wired in memory for the length of the generation.
    with wired_limit(model, [generation_stream]):
        yield from _respond(target, drafter, acceptor, widths, state, tokenizer, prompt_ids,
                            max_tokens, stops, timer, prefill_step_size, split_head, logprobs, copies, trees)


def _respond(target, drafter, acceptor, widths, state, tokenizer, prompt_ids, max_tokens, stops,
             timer, prefill_step_size, split_head=None, logprobs=None,
             copies=None, trees=None) -> Iterator[DFlashResponse]:
    """Steps of `prefill` and `cycles` as responses: detokenized text and running statistics."""
    tic = time.perf_counter()
    first_logits = [] if logprobs is not None else None
    last, prefilled = prefill(target, drafter, acceptor, state, prompt_ids, prefill_step_size, first_logits)
    answer = Answer(tokenizer, len(prompt_ids), prefilled, time.perf_counter() - tic)
    first_token = last.item()
    step = first_step(first_token, stops, max_tokens, first_logits[0] if first_logits else None, logprobs)
    yield answer.response(step, first=True)
    if step.finish is not None:
        return
    index = state.context_index(first_token) if copies is not None else None
    for step in cycles(target, drafter, acceptor, widths, state, last, max_tokens - 1, stops, timer, split_head,
                       logprobs, copies, index, trees):
        yield answer.response(step)


def generate(model, draft, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """Whole text of `stream_generate`."""
    text = []
    last = None
    for last in stream_generate(model, draft, tokenizer, prompt, **kwargs):
        text.append(last.text)
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print(
            f"\n{last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s, "
            f"tau {last.tau:.2f}, prompt {last.prompt_tokens} tokens at {last.prompt_tps:.1f} tok/s"
        )
    return "".join(text)
