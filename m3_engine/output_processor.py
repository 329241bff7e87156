"""``OutputProcessor``: the text side of the engine (vLLM's output processor): the engine core's
token ids -> ``RequestOutput``s with text, stop strings applied.

    processor.add_request("r0", "Hello", [1, 450], params, arrival_time=time.time())
    outputs, stopped = processor.process(core.execute_step(), time.time())
    core.finish_request(stopped, "stop")       # the requests a stop string ended

Per request it keeps the tokens, their logprobs (``Logprob`` entries with the tokens' text), an
incremental detokenizer, and the text handed out: a stop string found in the text cuts it there
and ends the request; while a request runs, the last ``len(longest stop string) - 1`` characters
are held back (they may begin a stop string). Tokens are taken one at a time, so a stop string
inside an accepted run of drafts ends the output where plain decoding would have. The stop token
that ended a request (an eos or a ``stop_token_ids`` id: the core's ``finish_reason`` "stop")
stays in ``token_ids`` and is left out of the text unless ``include_stop_str_in_output``, as
vLLM's detokenizer leaves it out (it shows when special tokens are kept, or for a stop token that
is a plain word). ``LLMEngine`` uses it in its own process; ``m3-serve`` in its HTTP process,
beside the engine core's process.
"""

from __future__ import annotations

from typing import Optional

from .engine_core import CoreOutput, TokenLogprobs
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["OutputProcessor", "RequestState"]


class RequestState:
    """One request's output so far, with its text."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_ids: list, params: SamplingParams,
                 tokenizer: Optional[Tokenizer], arrival: float):
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.tokenizer = tokenizer
        self.detokenizer = None if tokenizer is None else \
            IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.token_ids: list = []
        self.text = ""                     # the text handed out (stop strings cut)
        self.logprobs: Optional[list] = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.metrics = RequestMetrics(arrival_time=arrival)
        self.num_cached_tokens = 0
        self.hold = max((len(s) for s in params.stop), default=1) - 1 \
            if params.stop and not params.include_stop_str_in_output else 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, out: CoreOutput, now: float) -> bool:
        """Take one step's :class:`CoreOutput`; -> True when a stop string ended the request here
        (the core must finish it: it does not know)."""
        m = self.metrics
        if m.first_scheduled_time is None:
            m.first_scheduled_time = out.first_scheduled_time
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        m.num_draft_tokens, m.num_accepted_tokens = out.num_draft_tokens, out.num_accepted_tokens
        m.num_verify_steps, m.draft_time = out.num_verify_steps, out.draft_time
        self.num_cached_tokens = out.num_cached_tokens
        reason = stop_reason = None
        stopped = False
        for j, token in enumerate(out.new_token_ids):
            self.token_ids.append(token)
            if self.logprobs is not None:
                self.logprobs.append(self._logprobs(token, out.new_logprobs[j]))
                self.cumulative_logprob += out.new_logprobs[j].logprob
            if j == len(out.new_token_ids) - 1 and out.finish_reason is not None:
                reason, stop_reason = out.finish_reason, out.stop_reason
            if self.detokenizer is not None:
                start = len(self.text)
                if reason != "stop" or self.params.include_stop_str_in_output:   # a stop token adds no text
                    self.text += self.detokenizer.add([token])
                if reason is not None:
                    self.text += self.detokenizer.finish()
                hit = self._find_stop(start)
                if hit is not None:
                    stopped = reason is None
                    reason, stop_reason = "stop", hit
                    break
        if reason is not None:
            self.finish(reason, stop_reason, now)
        return stopped

    def finish(self, reason: str, stop_reason, now: float) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.metrics.finished_time = now

    def output(self) -> RequestOutput:
        """The request so far. Its prompt ids are the request's own list (never changed after it is
        queued: copying a long prompt on every step of every request cost milliseconds a step)."""
        finished = self.finished
        text = self.text if finished or not self.hold else self.text[:max(len(self.text) - self.hold, 0)]
        completion = CompletionOutput(index=0, text=text, token_ids=list(self.token_ids),
                                      cumulative_logprob=self.cumulative_logprob,
                                      logprobs=None if self.logprobs is None else list(self.logprobs),
                                      finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_ids,
                             outputs=[completion], finished=finished, metrics=self.metrics,
                             num_cached_tokens=self.num_cached_tokens)

    def _logprobs(self, token: int, lp: TokenLogprobs) -> dict:
        """``token id -> Logprob`` of the top tokens and the sampled one."""
        text = self.tokenizer.token_text if self.tokenizer is not None else (lambda t: None)
        entry = {}
        for rank, (t, value) in enumerate(zip(lp.top_ids, lp.top_logprobs)):
            entry[int(t)] = Logprob(float(value), rank + 1, text(t))
        if token not in entry:
            entry[token] = Logprob(lp.logprob, lp.rank, text(token))
        return entry

    def _find_stop(self, start: int) -> Optional[str]:
        """The first stop string in the text that ends at or after ``start`` (where this step's
        text began): cut the text there; -> the stop string, or None."""
        if not self.params.stop:
            return None
        longest = max(map(len, self.params.stop))
        best = None
        for s in self.params.stop:
            j = self.text.find(s, max(start - longest + 1, 0))
            if j >= 0 and (best is None or j < best[0]):
                best = (j, s)
        if best is None:
            return None
        j, s = best
        self.text = self.text[:j + len(s)] if self.params.include_stop_str_in_output else self.text[:j]
        return s


class OutputProcessor:
    """The text side of every unfinished request of one engine core.

    tokenizer: the model folder's, or None (token ids only: empty texts, no stop strings found).
    """

    def __init__(self, tokenizer: Optional[Tokenizer]):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}   # request id -> unfinished request

    def add_request(self, request_id: str, prompt: Optional[str], prompt_ids: list, params: SamplingParams, *,
                    arrival_time: float) -> None:
        self.requests[request_id] = RequestState(request_id, prompt, prompt_ids, params, self.tokenizer,
                                                 arrival_time)

    def abort_request(self, request_id: str, now: float) -> Optional[RequestState]:
        """Forget an unfinished request (``finish_reason="abort"``); -> it, or None when unknown."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            state.finish("abort", None, now)
        return state

    def process(self, outputs: list, now: float) -> tuple:
        """One step's :class:`CoreOutput`s -> ``(RequestOutputs, ids of the requests a stop string
        ended)``; outputs of requests it does not know (aborted meanwhile) are dropped. A finished
        request is forgotten."""
        results, stopped = [], []
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue
            if state.apply(out, now):
                stopped.append(out.request_id)
            if state.finished:
                del self.requests[out.request_id]
            results.append(state.output())
        return results, stopped
