"""Steps and responses: what a cycle committed (`Step`) and where an answer ends
(`stop_ids`, `committed_span`), and one answer's steps as `DFlashResponse`s with
detokenized text and running statistics (`Answer`); the one `tau`. Every answer
(`generate.stream_generate`, the server's, through `engine.BatchEngine`) goes through here."""

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper


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
    cycle_times: Optional[Dict[str, float]] = None
    verify_width: Optional[int] = None  # tokens the target verified in this cycle (block size)
    # what this cycle verified: "draft" | "tree" | "copy" | "global_copy" | "copy_tree" | None (plain step, prefill)
    proposal: Optional[str] = None
    proposal_counts: Dict[str, List[int]] = field(default_factory=dict)  # kind -> [cycles, tokens committed]
    logprobs: Optional[List["TokenLogprob"]] = None  # one per token of `tokens`, when asked for
    # the answer's accept lengths (a list that only grows) and how many of them are this response's
    _accepts: List[int] = field(default_factory=list, repr=False, compare=False)
    _cycles: int = 0

    @property
    def accept_lengths(self) -> List[int]:
        """Every cycle's accept length so far, as a new list: made when read, so a step's response
        costs the same at the answer's first cycle and at its thousandth."""
        return self._accepts[: self._cycles]

    @property
    def tau(self) -> float:
        return tau(self.accept_lengths)


@dataclass
class TokenLogprob:
    """A committed token's log-probability under the target's own distribution
    (log-softmax of its logits, before temperature and filters), and the `top`
    most likely tokens there as (token id, log-probability), most likely first."""

    token: int
    logprob: float
    top: List[Tuple[int, float]]


def token_logprobs(logits: mx.array, tokens: Sequence[int], top: int) -> List[TokenLogprob]:
    """logits [n, V] of the rows that chose `tokens` (n of them) -> one `TokenLogprob` each."""
    logp = logits.astype(mx.float32)
    logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logp, mx.array(list(tokens))[:, None], axis=-1)[:, 0]
    best = None
    if top > 0:
        k = min(top, logp.shape[-1])
        idx = mx.argpartition(-logp, kth=k - 1, axis=-1)[:, :k]
        vals = mx.take_along_axis(logp, idx, axis=-1)
        order = mx.argsort(-vals, axis=-1)
        best = (mx.take_along_axis(idx, order, axis=-1), mx.take_along_axis(vals, order, axis=-1))
        mx.eval(chosen, *best)
        best = (best[0].tolist(), best[1].tolist())
    chosen = chosen.tolist()
    return [TokenLogprob(int(t), chosen[i], list(zip(best[0][i], best[1][i])) if best else [])
            for i, t in enumerate(tokens)]


@dataclass
class Step:
    """What one cycle committed, before text and statistics."""

    tokens: List[int]
    from_draft: List[bool]
    finish: Optional[str]  # "stop" (the last token is a stop id) | "length" | None
    accept_length: int
    width: int
    times: Optional[Dict[str, float]] = None
    logprobs: Optional[List[TokenLogprob]] = None
    proposal: Optional[str] = None  # what was verified: "draft" | "tree" | "copy" | "copy_tree" | ... | None (plain)


def wrap_tokenizer(tokenizer) -> TokenizerWrapper:
    """mlx-lm's wrapper (EOS ids, streaming detokenizer) around a tokenizer, unless it is one."""
    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


def stop_ids(tokenizer, extra: Sequence[int] = ()) -> set:
    """The token ids that end an answer: the tokenizer's EOS ids plus `extra`."""
    return set(wrap_tokenizer(tokenizer).eos_token_ids or ()) | set(extra or ())


def committed_span(tokens: List[int], stops, budget: int) -> Tuple[int, Optional[str]]:
    """How many of a cycle's tokens are committed, and whether generation ends there."""
    for i, tok in enumerate(tokens):
        if tok in stops:
            return i + 1, "stop"
        if i + 1 >= budget:
            return i + 1, "length"
    return len(tokens), None


class Answer:
    """One answer's steps as `DFlashResponse`s: detokenized text and running statistics
    (every row of the engine, alone or batched, makes its responses here)."""

    def __init__(self, tokenizer, prompt_tokens: int, prefilled: int, prompt_time: float):
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.prompt_tokens = prompt_tokens
        self.prefilled = prefilled
        self.prompt_time = prompt_time
        self.prompt_tps = prefilled / max(prompt_time, 1e-9)
        self.generated = 0
        self.accept_lengths: List[int] = []
        self.proposal_counts: Dict[str, List[int]] = {}
        self.started = time.perf_counter()

    def response(self, step: Step, first: bool = False) -> DFlashResponse:
        """`first`: the token prefill chose (no cycle behind it)."""
        self.generated += len(step.tokens)
        text_tokens = step.tokens[:-1] if step.finish == "stop" else step.tokens
        for tok in text_tokens:
            self.detok.add_token(tok)
        if step.finish is not None:
            self.detok.finalize()
        if not first:
            self.accept_lengths.append(step.accept_length)
            counts = self.proposal_counts.setdefault(step.proposal or "plain", [0, 0])
            counts[0] += 1
            counts[1] += len(step.tokens)
        elapsed = time.perf_counter() - self.started
        return DFlashResponse(
            text=self.detok.last_segment,
            token=step.tokens[-1],
            tokens=step.tokens,  # (a step's lists are its response's alone)
            from_draft=step.from_draft,
            prompt_tokens=self.prompt_tokens,
            prompt_tps=self.prompt_tps,
            prompt_time=self.prompt_time,
            prefill_tokens=self.prefilled,
            generation_tokens=self.generated,
            generation_tps=self.generated / elapsed if elapsed > 0 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=step.finish,
            accept_length=None if first else step.accept_length,
            _accepts=self.accept_lengths,
            _cycles=len(self.accept_lengths),
            cycle_times=step.times,
            verify_width=None if first else step.width,
            logprobs=step.logprobs,
            proposal=step.proposal,
            proposal_counts={k: list(v) for k, v in self.proposal_counts.items()},  # (a few kinds at most)
        )


def first_step(first_token: int, stops, max_tokens: int, logits: Optional[mx.array] = None,
               logprobs: Optional[int] = None) -> Step:
    """The step of the token prefill chose (`logits` [1, V] its row, for logprobs)."""
    _, finish = committed_span([first_token], stops, max_tokens)
    first_logprobs = token_logprobs(logits, [first_token], logprobs) if logprobs is not None else None
    return Step([first_token], [False], finish, 0, 1, logprobs=first_logprobs)
