"""Requests in the engine: what was asked (`BatchRequest`), and a `Row`, one request's own
state there and its bookkeeping.

A row holds what is its own in any batch: its `PromptCache` (its caches while it decodes
alone or joins, its draft's context cache always), its drafter, its acceptor (greedy or its
own sampling), its copy and tree policies, its stop ids, its budget of tokens and its
`Answer`. What a step commits to it goes through the row: the first token once its prompt
is in (`begin_answer`), a lone cycle (`cycle_alone`), its part of a batched verify
(`commit`), and its response for each (`respond`).
"""

import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx

from dflash_mlx.engine.ahead import Context
from dflash_mlx.engine.cycle import HeadRows, cycle, prefill_chunks
from dflash_mlx.engine.distributed import shared_seed
from dflash_mlx.engine.drafter import DraftContext, PlainDecoding
from dflash_mlx.engine.prompt_cache import PromptCache, make_prompt_cache
from dflash_mlx.speculation.xtc import front_end_special_tokens, make_xtc
from dflash_mlx.engine.responses import (Answer, DFlashResponse, Step, committed_span, first_step, stop_ids,
                                         token_logprobs)
from dflash_mlx.models.target.kv_quantization import KVQuantization, holds_quantized
from dflash_mlx.models.target.tree_attention import tree_support
from dflash_mlx.options import GenerationOptions
from dflash_mlx.policy.copies import copy_policy_for
from dflash_mlx.policy.copy_trees import copy_tree_policy_for
from dflash_mlx.policy.lookahead import lookahead_for
from dflash_mlx.policy.trees import tree_policy_for
from dflash_mlx.speculation.accept import make_acceptor
from dflash_mlx.speculation.processors import option_processors


@dataclass
class BatchRequest:
    """One answer asked of the engine. `options.block_size` is not used (the batch's width
    policy decides); `prompt_cache`: caches whose prefix the prompt may reuse (else new)."""

    prompt_ids: List[int]
    options: GenerationOptions
    stop_token_ids: Sequence[int] = ()
    logprobs: Optional[int] = None
    prompt_cache: Optional[PromptCache] = None
    global_copies: bool = True  # copies from the engine's index of earlier requests, and this one kept there
    # mlx-lm `LogitsProcessor`s of the caller's own, after those `options` sets (`speculation.processors`)
    logits_processors: Sequence = ()
    # mlx-lm's kv_bits, kv_group_size and quantized_kv_start (`models.target.kv_quantization`); None: off
    kv_quantization: Optional[KVQuantization] = None
    # mlx-lm's prompt_progress_callback: (tokens run, tokens to run) as the prompt's chunks run
    prompt_progress: Optional[Callable[[int, int], None]] = None


class Row:
    """A request in the engine: joining (its prompt being prefilled), decoding, or done."""

    def __init__(self, uid: int, request: BatchRequest, engine):
        """`engine`: the `BatchEngine` the row joins (its models, width policy and settings)."""
        self.uid = uid
        self.request = request
        opts = request.options
        # a recurrent state cannot be trimmed back to a shared prefix: the end of the prompt is
        # kept as a snapshot, which a next turn that starts with this prompt restores
        self.state = request.prompt_cache or make_prompt_cache(engine.model, engine.draft,
                                                               max_snapshots=1 if engine.target.recurrent else 0)
        self.state.kv_quantization = request.kv_quantization
        # (a token tree's verify writes rows it then moves: full-precision attention caches only, not windows)
        trees_on = (engine.token_trees and request.kv_quantization is None
                    and not holds_quantized(self.state.target_cache) and not self.state.windowed)
        self.drafter = DraftContext(engine.draft, self.state) if engine.draft is not None else PlainDecoding()
        special = (opts.xtc_special_tokens if opts.xtc_special_tokens is not None
                   else front_end_special_tokens(engine.tokenizer) if opts.xtc_probability > 0 else ())
        self.acceptor = make_acceptor(opts.temperature, top_p=opts.top_p, top_k=opts.top_k, min_p=opts.min_p,
                                      draft_sampling=opts.draft_sampling, min_tokens_to_keep=opts.min_tokens_to_keep,
                                      xtc=make_xtc(opts.xtc_probability, opts.xtc_threshold, special))
        self.lookahead = lookahead_for(engine.model, engine.draft) if engine.guesses_roll_back else None
        self.seed = shared_seed(engine.target, opts.seed)  # every rank of a split target samples alike
        # copies and trees ride on the pair's own sizer (bucket 1), as in every single-sequence
        # call; trees only while the row decodes alone (`cycle.cycle`)
        self.head_rows = HeadRows(split=HeadRows.pays(engine.target) if engine.split_head is None
                                  else engine.split_head)
        sizer = engine.widths.sizer(1) if engine.widths is not None else None
        self.copies = copy_policy_for(sizer) if sizer is not None and engine.copy_proposals else None
        self.trees = (tree_policy_for(sizer) if sizer is not None and engine.draft is not None and trees_on
                      and tree_support(engine.target) is None else None)
        # several continuations of a copy as one tree, on targets that take trees (with a draft or not)
        self.copy_trees = (copy_tree_policy_for(sizer) if self.copies is not None and trees_on
                           and tree_support(engine.target) is None else None)
        # earlier requests' prompts and answers (`speculation.suffix_index`), unless this one opted out
        self.shared = engine.suffix_index if self.copies is not None and request.global_copies else None
        self.index = None  # the context's copy index (`context_index`), kept up to date by every cycle
        self.context: Optional[Context] = None  # what its lone cycles read (`cycle.cycle`), made at the first
        self.stops = stop_ids(engine.tokenizer, request.stop_token_ids)
        self.budget = opts.max_tokens  # (past the model's position limit it decodes on, as mlx-lm does)
        self.first_logits: Optional[list] = [] if request.logprobs is not None else None
        self.processors = tuple(option_processors(opts)) + tuple(request.logits_processors or ())
        self.prefill = prefill_chunks(engine.target, self.drafter, self.acceptor, self.state, request.prompt_ids,
                                      engine.prefill_chunk, self.first_logits, self.processors,
                                      request.prompt_progress)
        self.queued_at = time.perf_counter()
        self.started: Optional[float] = None
        self.last: Optional[mx.array] = None  # [1] the last committed token
        self.answer: Optional[Answer] = None
        self.done = False

    def context_index(self):
        """The index copies match against (made on first use, from the prompt cache's)."""
        if self.index is None:
            self.index = self.state.context_index(int(self.last.item()))
        return self.index

    def copy_matches(self, max_length: int) -> list:
        """Its copy candidates: the context's own match, and one from earlier requests."""
        index = self.context_index()
        return [index.match(max_length), self.shared.match(index.tokens, max_length) if self.shared else None]

    def document(self) -> List[int]:
        """Its prompt and what it answered so far (for the index of earlier requests)."""
        if self.index is not None:  # kept up to date by every cycle
            return list(self.index.tokens)
        return list(self.state.tokens) + [int(self.last.item())] if self.last is not None else []

    # -- joining

    def start(self):
        """Its prompt's first chunk runs now: the row's clock starts (and its seed is set)."""
        if self.started is not None:
            return
        self.started = time.perf_counter()
        if self.seed is not None:
            # as stream_generate does; the random stream is the batch's, so a seed reproduces
            # a sampled answer only for a row that runs alone (at a fixed width)
            mx.random.seed(self.seed)

    def cancel_prefill(self):
        self.prefill.close()
        self.state.valid = False  # a prefill cut short: nothing of it may be reused

    def begin_answer(self, last: mx.array, prefilled: int, tokenizer) -> Step:
        """Its prompt is in (`prefilled` tokens run, `last` [1] the token prefill chose):
        its answer starts, with the step of that first token."""
        self.last = last
        self.answer = Answer(tokenizer, len(self.request.prompt_ids), prefilled, time.perf_counter() - self.started)
        first = int(last.item())
        step = first_step(first, self.stops, self.budget, self.first_logits[0] if self.first_logits else None,
                          self.request.logprobs)
        self.budget -= 1
        return step

    # -- decoding

    def cycle_alone(self, target, widths, timer) -> Step:
        """One `cycle.cycle` on the row's own caches, with its copies and trees."""
        if self.context is None:
            index = self.context_index() if self.copies is not None else None
            self.context = Context(target, self.drafter, self.acceptor, widths, self.state, self.head_rows,
                                   self.copies, index, self.trees, self.shared, self.copy_trees,
                                   lookahead=self.lookahead, processors=self.processors)
        self.context.widths = widths
        step, self.last = cycle(self.context, self.last, self.budget, self.stops, timer, self.request.logprobs)
        self.budget -= len(step.tokens)
        return step

    def commit(self, chosen: List[int], fed: List[int], accepted: int, last: mx.array, width: int,
               proposal: Optional[str], logits: mx.array) -> Step:
        """The row's part of a batched verify of `width`: `fed` the tokens it fed, `chosen` the
        tokens its acceptor chose after each, of which the first `accepted` + 1 stand; `last`
        [1] the last of those; `logits` [width, V] its verify rows. Its step, of the tokens
        it keeps (a stop or its budget may end it sooner)."""
        tokens = chosen[: accepted + 1]
        kept, finish = committed_span(tokens, self.stops, self.budget)
        lps = (token_logprobs(logits[:kept], tokens[:kept], self.request.logprobs)
               if self.request.logprobs is not None else None)
        self.last = last
        self.budget -= kept
        self.state.tokens.extend(fed[:kept])
        if self.index is not None:
            self.index.extend(tokens[:kept])
        return Step(tokens[:kept], [i < accepted for i in range(kept)], finish, min(kept, accepted), width,
                    logprobs=lps, proposal=proposal)

    def respond(self, step: Step, first: bool = False) -> Tuple["Row", DFlashResponse]:
        """(the row, its response for `step`); a step that finishes the answer ends the row."""
        if step.finish is not None:
            self.done = True
        return self, self.answer.response(step, first=first)
