"""The server's jobs: one request on its way through the worker, and what its engine
responses become.

A `Job` carries a `GenerationRequest` and the asyncio queue its route reads; the worker
thread puts events on it ("text", then "done" or "error"). `JobAnswer` turns the job's
engine responses into those events (text pieces with stop strings held back and cut,
logprobs, then the finish reason and usage), the same for batched and one-at-a-time
serving. "Worker" annotations name `dflash_mlx.serve.worker.Worker` (not imported: that
module imports this one).
"""

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

from dflash_mlx.serve.requests import GenerationRequest, RequestError, StopMatcher


@dataclass
class Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)  # the answer is complete: stop generating
    queued_at: float = field(default_factory=time.perf_counter)
    cycles: int = 0  # engine responses the worker has taken so far
    cancel_cycle: Optional[int] = None  # `cycles` when the cancel came

    def cancel(self):
        if not self.cancelled.is_set():
            self.cancel_cycle = self.cycles
            self.cancelled.set()

    def end(self):
        """The client has all of the answer it asked for (its one tool call): end it as served."""
        self.ended.set()

    def emit(self, kind: str, payload: Any = None):
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


def shutting_down() -> RequestError:
    return RequestError("the server is shutting down; retry on its next start", status=503,
                        code="shutting_down", type="server_error")


def lost_leading_space(tokenizer, token: int) -> str:
    """" " when the streaming detokenizer drops the first token's leading space.

    mlx-lm's BPE detokenizer starts every answer without it, right for a chat
    answer but not for a completion, whose text continues the prompt.
    """
    if not isinstance(tokenizer.detokenizer, BPEStreamingDetokenizer):
        return ""
    return " " if tokenizer.decode([token]).startswith(" ") else ""


class JobAnswer:
    """One job's engine responses as events: text pieces (stop strings held back and cut,
    logprobs), then "done" with the finish reason and usage, or the cancellation.
    The worker's tallies (served, cancelled, service times) are counted here too."""

    def __init__(self, worker: "Worker", job: Job):
        self.worker, self.job = worker, job
        self.matcher = StopMatcher(job.request.stop)
        self.started = time.perf_counter()
        self.first, self.last, self.finish, self.stop_matched = True, None, None, False
        self.over = False  # a finish, a stop string, or the client ended or cancelled it
        self.widths: Dict[int, int] = {}
        self.lead = ""

    def feed(self, r) -> bool:
        """Take one engine response; True when the answer is over (a finish, a stop string,
        the client ended or cancelled it)."""
        job, req = self.job, self.job.request
        job.cycles += 1
        if self.first:
            self.first = False
            if req.kind == "completion":
                self.lead = lost_leading_space(self.worker.tokenizer, r.token)
        self.last = r
        if r.verify_width is not None:
            self.widths[r.verify_width] = self.widths.get(r.verify_width, 0) + 1
        text = r.text
        if self.lead and text:
            text = text if text.startswith(self.lead) else self.lead + text
            self.lead = ""
        text, self.stop_matched = self.matcher.feed(text)
        lps = r.logprobs
        if lps is not None and r.finish_reason == "stop":
            lps = lps[:-1]  # the stop token is not part of the answer
        if text or lps:
            job.emit("text", (text, lps))
        if self.stop_matched:
            self.finish = "stop"
        elif r.finish_reason is not None:
            self.finish = r.finish_reason
        elif job.ended.is_set():
            self.finish = "stop"
        self.over = self.finish is not None or job.cancelled.is_set()
        return self.over

    def complete(self):
        """Emit the end: "done" with usage, or (cancelled) "done" without, or the shutdown error."""
        job, worker = self.job, self.worker
        if self.finish is None:  # cancelled (or the server stopping)
            worker.counts["cancelled"] += 1
            worker.cycles_after_cancel.append(job.cycles - (job.cancel_cycle or job.cycles))
            job.emit(*(("error", shutting_down()) if worker.stopping else ("done", None)))
            return
        tail = "" if self.stop_matched else self.matcher.flush()  # held back for a stop string that never came
        if tail:
            job.emit("text", (tail, None))
        worker.counts["served"] += 1
        worker.served_seconds.append(time.perf_counter() - self.started)
        del worker.served_seconds[:-16]
        job.emit("done", {"finish_reason": self.finish, "usage": self.usage(),
                          "stop_sequence": self.matcher.matched if self.stop_matched else None})

    def usage(self) -> dict:
        """OpenAI's usage of the finished answer, with the speculative decoding statistics under "dflash"."""
        job, last = self.job, self.last
        accepts = last.accept_lengths
        reused = last.prompt_tokens - last.prefill_tokens
        return {
            "prompt_tokens": last.prompt_tokens,
            "completion_tokens": last.generation_tokens,
            "total_tokens": last.prompt_tokens + last.generation_tokens,
            "prompt_tokens_details": {"cached_tokens": reused},
            "dflash": {
                "tau": last.tau,
                "mean_accept_length": sum(accepts) / len(accepts) if accepts else 0.0,
                "cycles": len(accepts),
                "verify_widths": {str(k): v for k, v in sorted(self.widths.items())},
                # what cycles verified ("draft", "tree", "copy", "global_copy", "plain"): [cycles, tokens]
                "proposals": {k: list(v) for k, v in last.proposal_counts.items()},
                "prompt_tokens_reused": reused,
                "prefill_tokens": last.prefill_tokens,
                "prompt_tokens_per_second": last.prompt_tps,
                "tokens_per_second": last.generation_tps,
                "queue_seconds": self.started - job.queued_at,
                "seconds": time.perf_counter() - self.started,
                "block_size": job.request.options.block_size,
                "draft": self.worker.draft_name,
            },
        }
