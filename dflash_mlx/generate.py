"""`stream_generate` and `generate`: one answer, streamed as responses.

The response layer, as in mlx-lm: `stream_generate` (what the CLI, the chat app, the
benchmarks and, for targets the batch engine does not take, the server use) checks its
arguments and runs the request as the batch-of-one case of `engine.engine.BatchEngine`,
whose lone row runs `engine.cycle.cycle` on its own caches; `engine.responses.Answer` turns
steps into text and statistics. Plain decoding is the same cycle with the null drafter
(`engine.drafter.PlainDecoding`) at width 1.
"""

import os
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit

from dflash_mlx.engine.engine import BatchEngine
from dflash_mlx.engine.prompt_cache import PromptCache, make_prompt_cache  # noqa: F401 (public path)
from dflash_mlx.engine.responses import (DFlashResponse, TokenLogprob, stop_ids, tau,  # noqa: F401 (public paths)
                                         wrap_tokenizer)
from dflash_mlx.engine.rows import BatchRequest
from dflash_mlx.models.target.adapter import target_for
from dflash_mlx.models.target.kv_quantization import DEFAULT_START as DEFAULT_QUANTIZED_KV_START
from dflash_mlx.models.target.kv_quantization import make_kv_quantization
from dflash_mlx.models.target.kv_window import checked_max_kv_size
from dflash_mlx.speculation.xtc import make_xtc
from dflash_mlx.options import AUTO, GenerationOptions, fixed_width
from dflash_mlx.speculation.accept import make_acceptor
from dflash_mlx.speculation.suffix_index import SuffixIndex, make_suffix_index  # noqa: F401 (public path)


DETERMINISTIC_ENV = "DFLASH_MLX_DETERMINISTIC"


def encode_prompt(tokenizer, prompt: Union[str, Sequence[int], mx.array]) -> List[int]:
    if isinstance(prompt, mx.array):
        return prompt.reshape(-1).tolist()
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        return list(tokenizer.encode(prompt, add_special_tokens=add_special))
    return [int(t) for t in prompt]


def tokens_to_window(window: Optional[int], prompt_length: int, max_tokens: int) -> int:
    """`max_tokens`, cut to what fits in a context `window` (a target's `max_context`; None: no
    limit) after a prompt of `prompt_length` tokens: where a front end stops (the CLI, the chat
    app, the server), since `stream_generate` decodes on past the window, as mlx-lm does. A
    prompt that fills the window is left to the engine to refuse."""
    if window and prompt_length < window:
        return min(max_tokens, window - prompt_length)
    return max_tokens


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
    prefill_step_size: int = 2048,
    draft_sampling: str = "argmax",
    split_head: Optional[bool] = None,
    logprobs: Optional[int] = None,
    copy_proposals: bool = True,
    token_trees: bool = True,
    suffix_index: Optional[SuffixIndex] = None,
    deterministic: Optional[bool] = None,
    repetition_penalty: Optional[float] = None,
    repetition_context_size: int = 20,
    presence_penalty: Optional[float] = None,
    presence_context_size: int = 20,
    frequency_penalty: Optional[float] = None,
    frequency_context_size: int = 20,
    logit_bias: Optional[Dict[int, float]] = None,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: Optional[Sequence[int]] = None,
    min_tokens_to_keep: int = 1,
    logits_processors: Optional[Sequence[Callable]] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    max_kv_size: Optional[int] = None,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
) -> Iterator[DFlashResponse]:
    """Generate with DFlash speculative decoding, one response per cycle.

    Greedy output (temperature 0) is exactly the target's own greedy output.
    `block_size`: "auto" (the default, as in every front end) picks each cycle's
    verify width from measured acceptance and cycle times (see `dflash_mlx.policy.sizer`);
    "draft" is always the draft's own block size (z-lab's behaviour); a whole number
    a fixed width (`dflash_mlx.options.BLOCK_SIZE_SPELLINGS`).
    `baseline=True` decodes with the target alone: plain decoding, nothing else.
    `draft=None` (no DFlash draft) with "auto" verifies copies (below) where they pay and
    plain steps otherwise; with any other block size it is plain decoding.
    `split_head`: verify's LM head in two pieces (`engine.cycle.HeadRows`); None: on CPUs only.
    `logprobs`: None (off, no cost), or k >= 0: each response's `logprobs` gives its
    tokens' log-probabilities under the target's own distribution (after penalties and
    logits processors, before temperature and filters, as mlx-lm's) and the k most
    likely tokens there (`TokenLogprob`).
    `copy_proposals` (with "auto"): a cycle may verify a copy of a span of the context
    instead of the draft's block, when measured acceptance and cost say it commits more
    tokens per second (`dflash_mlx.policy.copies`); exact either way.
    `suffix_index` (`make_suffix_index(model)`, kept by the caller across calls): earlier
    calls' prompts and answers, a source of copies beside the context's own; this call's
    prompt and answer go into it when it ends (`dflash_mlx.speculation.suffix_index`).
    `token_trees` (with "auto", on attention-only targets that take a tree's mask and
    positions, `dflash_mlx.models.target.tree_attention.tree_support`): a drafted cycle may
    verify a tree of the draft's likeliest continuations instead of its chain, when trees
    have committed more tokens at that width (`dflash_mlx.policy.trees`); at temperature > 0
    the tree is sampled down exactly (`dflash_mlx.speculation.tree.accept_sampled`).
    `deterministic` (None: `DFLASH_MLX_DETERMINISTIC=1` turns it on): every target row runs in
    the shapes plain decoding gives it, so greedy output is mlx-lm's token for token on GPU
    kernels too, in every dtype, at the cost of the wide verify's speed
    (`dflash_mlx.models.target.exact_rows`); chains and copies only, no token trees.
    `repetition_penalty` ... `logit_bias` (mlx-lm's `make_logits_processors`) and `logits_processors`
    (mlx-lm's `LogitsProcessor`s, (tokens, logits) -> logits, applied after those): each verify row's
    logits are processed as mlx-lm's `generate_step` processes that step's, after the prompt and every
    token before it (`dflash_mlx.speculation.processors`), so greedy output is mlx-lm's under the same
    processors and sampling keeps their distribution; `logprobs` are then the processed ones, as mlx-lm's.
    `kv_bits` (None: off), `kv_group_size`, `quantized_kv_start`: mlx-lm's quantized KV cache, its attention
    caches quantized in place once they hold `quantized_kv_start` tokens, where mlx-lm's `generate_step` does
    it, so greedy output is mlx-lm's under the same arguments (`dflash_mlx.models.target.kv_quantization`);
    chains and copies only, no token trees; refused, in one line, where mlx-lm cannot quantize the caches.
    `min_tokens_to_keep`: the fewest tokens min-p leaves (mlx-lm's `make_sampler` argument).
    `xtc_probability`, `xtc_threshold`, `xtc_special_tokens` (at temperature > 0): mlx-lm's XTC sampling filter
    (`make_sampler`'s arguments; special tokens None: a newline and the end tokens, as mlx-lm's generate CLI and
    server keep them), each verify row with its own coin, so sampling keeps the XTC distribution
    (`dflash_mlx.speculation.xtc`).
    `max_kv_size` (None: unbounded): mlx-lm's bounded KV cache, the first 4 tokens and the last ones of a
    window of `max_kv_size` (on a model that makes no caches of its own, as mlx-lm's `make_prompt_cache`), each
    verify row masked as its own plain-decoding step is, so greedy output is mlx-lm's `generate_step(max_kv_size=)`
    (`dflash_mlx.models.target.kv_window`); chains and copies only, no token trees; with `prompt_cache`, the
    cache's own bound (`make_prompt_cache(model, draft, max_kv_size=)`).
    `prompt_progress_callback(done, total)`: mlx-lm's, over the prompt tokens a reused `prompt_cache` does
    not hold: (0, total) first, then after each prefill forward, (total, total) last.
    """
    tokenizer = wrap_tokenizer(tokenizer)
    prompt_ids = encode_prompt(tokenizer, prompt)
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token of input")
    use_draft = draft is not None and not baseline
    target = target_for(model, draft)
    if use_draft and hasattr(draft, "check_tokenizer"):  # (an autoregressive draft: the same token texts)
        draft.check_tokenizer(tokenizer)
    if deterministic is None:
        deterministic = os.environ.get(DETERMINISTIC_ENV, "").strip() in ("1", "true", "on")
    target.deterministic = deterministic  # refuses a target it cannot run exactly, in one line
    fixed_width(block_size, draft.block_size if use_draft else 1)  # ValueError for a bad one
    make_acceptor(temperature, top_p=top_p, top_k=top_k, min_p=min_p, draft_sampling=draft_sampling,
                  min_tokens_to_keep=min_tokens_to_keep,
                  xtc=make_xtc(xtc_probability, xtc_threshold, xtc_special_tokens))  # checks
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if logprobs is not None and (isinstance(logprobs, bool) or int(logprobs) < 0):
        raise ValueError(f"logprobs must be None (off) or a whole number >= 0 of alternatives, got {logprobs!r}")
    kv_quantization = make_kv_quantization(kv_bits, kv_group_size, quantized_kv_start)  # ValueError for bad ones
    max_kv_size = checked_max_kv_size(max_kv_size)
    if suffix_index is not None and not suffix_index.made_for(model):
        raise ValueError("suffix_index was made for another model; make one with make_suffix_index(model)")

    state = prompt_cache
    if state is None:
        state = make_prompt_cache(model, draft if use_draft else None, max_kv_size=max_kv_size)
    elif state.model is not model or (use_draft and state.draft is not draft):
        raise ValueError("prompt_cache was made for another model/draft; make a new one")
    elif max_kv_size is not None and state.max_kv_size != max_kv_size:
        raise ValueError(f"prompt_cache was made with max_kv_size={state.max_kv_size}, not {max_kv_size}: make one "
                         f"with make_prompt_cache(model, draft, max_kv_size={max_kv_size})")
    elif not use_draft and state.draft is not None:
        raise ValueError("prompt_cache holds a draft context; use it with the same draft")
    # (a prompt past the context window is refused by `engine.add`)
    # One sequence is the batch-of-one case of the engine: alone, a row runs `cycle` on its own
    # caches, with trees, copies and a split head.
    engine = BatchEngine(model, draft if use_draft else None, tokenizer, max_batch=1, target=target,
                         prefill_chunk=prefill_step_size, prefill_budget=len(prompt_ids),
                         block_size=1 if baseline else block_size, copy_proposals=copy_proposals and not baseline,
                         token_trees=token_trees, split_head=split_head, profile=profile,
                         snapshot_prompts=False, suffix_index=None if baseline else suffix_index)
    options = GenerationOptions(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                min_p=min_p, seed=seed, draft_sampling=draft_sampling,
                                repetition_penalty=repetition_penalty, repetition_context_size=repetition_context_size,
                                presence_penalty=presence_penalty, presence_context_size=presence_context_size,
                                frequency_penalty=frequency_penalty, frequency_context_size=frequency_context_size,
                                logit_bias=logit_bias, xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
                                xtc_special_tokens=None if xtc_special_tokens is None else tuple(xtc_special_tokens),
                                min_tokens_to_keep=min_tokens_to_keep).check_penalties()
    # mlx-lm's set-up: its generation stream, and (on Apple GPUs) the model's
    # weights wired in memory for the length of the generation.
    with wired_limit(model, [generation_stream]):
        engine.add(BatchRequest(prompt_ids, options, stop_token_ids or (), logprobs, state,
                                logits_processors=tuple(logits_processors or ()), kv_quantization=kv_quantization,
                                prompt_progress=prompt_progress_callback))
        while not engine.idle:  # the first token goes out before the first cycle runs
            for _, response in engine.prefill_step():
                yield response
            for _, response in engine.decode_step():
                yield response


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
