"""The DFlash engine: prefill, then draft -> verify -> accept -> rollback cycles.

`stream_generate` is the one engine; the CLI, the chat app and the benchmarks
are clients of it. Each cycle syncs with the host once, to read the accept length.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from dflash_mlx.accept import make_acceptor
from dflash_mlx.adaptive import BlockSizer
from dflash_mlx.prompt_cache import PromptCache, make_prompt_cache  # noqa: F401 (public path)
from dflash_mlx.target import Target


def tau(accept_lengths: Sequence[int]) -> float:
    """Mean tokens committed per target forward after prefill: accepted drafts + the bonus."""
    if not accept_lengths:
        return 0.0
    return sum(a + 1 for a in accept_lengths) / len(accept_lengths)


@dataclass
class DFlashResponse:
    """mlx-lm's `GenerationResponse` fields, plus what speculative decoding adds.

    One response per cycle: `tokens` are all tokens committed by that cycle.
    """

    text: str
    token: int
    tokens: List[int]
    from_draft: List[bool]
    prompt_tokens: int
    prompt_tps: float
    prompt_time: float
    prefill_tokens: int  # prompt tokens actually run (the rest came from prompt_cache)
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: Optional[str] = None
    accept_length: Optional[int] = None
    accept_lengths: List[int] = field(default_factory=list)
    cycle_times: Optional[Dict[str, float]] = None
    verify_width: Optional[int] = None  # tokens the target verified in this cycle (block size)

    @property
    def tau(self) -> float:
        return tau(self.accept_lengths)


def _target_for(model, draft) -> Target:
    target = getattr(draft, "target", None)
    if target is not None and target.model is model:
        return target
    target = Target(model)
    if draft is not None:
        from dflash_mlx.draft import validate_for_target

        if hasattr(draft, "config"):
            validate_for_target(draft.config, target)
        draft.bind(target)
    return target


def _wrap_tokenizer(tokenizer):
    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


def encode_prompt(tokenizer, prompt: Union[str, Sequence[int], mx.array]) -> List[int]:
    if isinstance(prompt, mx.array):
        return prompt.reshape(-1).tolist()
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        return list(tokenizer.encode(prompt, add_special_tokens=add_special))
    return [int(t) for t in prompt]


def _eval_caches(target_cache, draft_cache, *arrays):
    mx.eval([c.state for c in target_cache], *arrays)
    if draft_cache:
        mx.eval([kv for c in draft_cache for kv in c.fetch() if kv is not None])


def stream_generate(
    model,
    draft,
    tokenizer,
    prompt: Union[str, Sequence[int], mx.array],
    max_tokens: int = 256,
    block_size: Union[int, str, None] = None,
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
) -> Iterator[DFlashResponse]:
    """Generate with DFlash speculative decoding, one response per cycle.

    Greedy output (temperature 0) is exactly the target's own greedy output.
    `block_size`: the draft's own when None; "auto" picks each cycle's verify
    width from measured acceptance and cycle times (see `dflash_mlx.adaptive`).
    `baseline=True` (or `draft=None`) decodes with the target alone.
    """
    tokenizer = _wrap_tokenizer(tokenizer)
    prompt_ids = encode_prompt(tokenizer, prompt)
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token of input")
    use_draft = draft is not None and not baseline
    target = _target_for(model, draft)
    sizer = None
    if block_size == "auto":
        block = draft.block_size if use_draft else 1
        sizer = BlockSizer(block) if use_draft else None
    else:
        block = (draft.block_size if block_size is None else int(block_size)) if use_draft else 1
    if block < 1:
        raise ValueError(f"block_size must be >= 1 or 'auto', got {block_size}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    stops = set(tokenizer.eos_token_ids or ()) | set(stop_token_ids or ())
    acceptor = make_acceptor(
        temperature, top_p=top_p, top_k=top_k, min_p=min_p, draft_sampling=draft_sampling
    )
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

    layer_ids = list(draft.config.target_layer_ids) if use_draft else []
    detok = tokenizer.detokenizer
    detok.reset()

    # -- prefill ----------------------------------------------------------------
    tic = time.perf_counter()
    new_ids = state.reuse(prompt_ids, target, draft if use_draft else None)
    state.valid = False  # until the caches and `tokens` agree again
    cache = state.target_cache
    if use_draft and state.pending is not None:
        draft.inject(state.pending, state.draft_cache)
        state.pending = None
    for start in range(0, len(new_ids), prefill_step_size):
        chunk = mx.array(new_ids[start : start + prefill_step_size])[None]
        h, feats, _ = target.forward(chunk, cache, layer_ids)
        if use_draft:
            draft.inject(feats, state.draft_cache)
        _eval_caches(cache, state.draft_cache if use_draft else None, h)
    last = acceptor.first_token(target.logits(h[:, -1, :]))
    mx.eval(last)
    state.tokens.extend(new_ids)
    state.valid = True
    first = last.item()
    prompt_time = time.perf_counter() - tic
    prompt_tps = len(new_ids) / max(prompt_time, 1e-9)

    n_generated = 0
    accept_lengths: List[int] = []
    gen_tic = time.perf_counter()

    def response(tokens, flags, finish, accept_length=None, cycle_times=None, verify_width=None):
        if finish is not None:
            detok.finalize()
        elapsed = time.perf_counter() - gen_tic
        return DFlashResponse(
            text=detok.last_segment,
            token=tokens[-1],
            tokens=list(tokens),
            from_draft=list(flags),
            prompt_tokens=len(prompt_ids),
            prompt_tps=prompt_tps,
            prompt_time=prompt_time,
            prefill_tokens=len(new_ids),
            generation_tokens=n_generated,
            generation_tps=n_generated / elapsed if elapsed > 0 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            accept_length=accept_length,
            accept_lengths=list(accept_lengths),
            cycle_times=cycle_times,
            verify_width=verify_width,
        )

    def commit(token) -> Optional[str]:
        """Count one committed token; say whether generation ends on it."""
        nonlocal n_generated
        n_generated += 1
        if token in stops:
            return "stop"
        detok.add_token(token)
        return "length" if n_generated >= max_tokens else None

    finish = commit(first)
    yield response([first], [False], finish)
    if finish is not None:
        return

    # -- cycles -----------------------------------------------------------------
    last = last.astype(mx.int32)
    pending = None
    while True:
        remaining = max_tokens - n_generated
        if sizer is not None:
            bs = sizer.choose(remaining)
        else:
            bs = min(block, remaining) if use_draft else 1
        times = {} if profile else None
        t0 = time.perf_counter()
        state.valid = False
        proposal = None
        if bs > 1:
            draft_logits = draft.propose_logits(last, pending, state.draft_cache, bs)
            proposal = acceptor.propose(draft, draft_logits)
            verify_in = mx.concatenate([last[:, None], proposal.tokens.astype(mx.int32)], axis=1)
        else:
            if use_draft and pending is not None:
                draft.inject(pending, state.draft_cache)
            verify_in = last[:, None]
        if profile:
            mx.eval(verify_in)
            times["draft"] = time.perf_counter() - t0
            t1 = time.perf_counter()
        h, feats, record = target.forward(verify_in, cache, layer_ids, record=bs > 1)
        accept_len, committed = acceptor.accept(proposal, target.logits(h), draft)
        mx.eval(accept_len, committed, verify_in)  # the cycle's one host sync
        a = accept_len.item()
        if sizer is not None:
            sizer.update(bs, a, time.perf_counter() - t0)
        if profile:
            times["verify"] = time.perf_counter() - t1
        new_tokens = committed[0, : a + 1].tolist()
        fed = verify_in[0].tolist()

        flags, finish = [], None
        for i, tok in enumerate(new_tokens):
            flags.append(i < a)
            finish = commit(tok)
            if finish is not None:
                break
        kept = len(flags)  # fed tokens whose cache entries stay: last + drafts before the final token
        t2 = time.perf_counter()
        target.rollback(cache, bs, bs - kept, record)
        if use_draft:
            pending = feats[:, :kept]
        if profile:
            mx.eval([c.state for c in cache])
            times["rollback"] = time.perf_counter() - t2
            times["other"] = max(0.0, time.perf_counter() - t0 - sum(times.values()))
        state.tokens.extend(fed[:kept])
        state.pending = pending
        state.valid = True
        accept_lengths.append(min(kept, a))
        last = committed[:, a] if finish is None else last
        yield response(new_tokens[:kept], flags, finish, accept_lengths[-1], times, bs)
        if finish is not None:
            return


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
