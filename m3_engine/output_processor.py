"""``OutputProcessor``: the text side of the engine (vLLM's output processor): the engine core's
token ids -> ``RequestOutput``s with text, stop strings applied.

    for child_id, child_params in processor.add_request("r0", "Hello", [1, 450], params, arrival_time=now):
        core.add_request(child_id, [1, 450], child_params)
    outputs, stopped = processor.process(core.execute_step(), time.time())
    core.finish_request(stopped, "stop")       # the engine requests a stop string ended
    core.finish_request(processor.abort_request("r0", now))   # an abort: its unfinished engine requests

Parallel sampling (``SamplingParams.n``) fans out and back in here, the one place ``LLM`` and
``m3-serve`` share (vLLM v1's ``ParentRequest``): a request of ``n`` completions is ``n``
requests of the engine core, ``"{i}_{request_id}"`` (``n == 1``: the request's own id), each
with ``n=1`` and, when the request has a ``seed``, ``seed + i``; only the first computes the
prompt's logprobs. The request's ``RequestOutput`` holds its ``n`` completions (``index``
0..n-1) and is finished when all are. The children are queued together: with prefix caching
one that starts after another computed the prompt's full blocks reuses them.

Per request it keeps the tokens, their logprobs (``Logprob`` entries with the tokens' text), an
incremental detokenizer, and the text handed out: a stop string found in the text cuts it there
and ends the request; while a request runs, the last ``len(longest stop string) - 1`` characters
are held back (they may begin a stop string). Stop strings are looked for once the output has
more than ``min_tokens`` tokens (vLLM's rule). Tokens are taken one at a time, so a stop string
inside an accepted run of drafts ends the output where plain decoding would have. The stop token
that ended a request (an eos or a ``stop_token_ids`` id: the core's ``finish_reason`` "stop")
stays in ``token_ids`` and is left out of the text unless ``include_stop_str_in_output``, as
vLLM's detokenizer leaves it out (it shows when special tokens are kept, or for a stop token that
is a plain word). ``LLMEngine`` uses it in its own process; ``m3-serve`` in its HTTP process,
beside the engine core's process.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .engine_core import CoreOutput, TokenLogprobs
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["OutputProcessor", "ParentRequest", "RequestState", "child_requests"]


def child_requests(request_id: str, params: SamplingParams) -> list:
    """The engine requests of a request: ``[(id, SamplingParams)]``, one per completion (vLLM's
    ``ParentRequest.get_child_info``): ``n == 1``: the request itself; else ``"{i}_{request_id}"``
    with ``n=1``, ``seed + i`` when seeded, and prompt logprobs for the first only."""
    if params.n == 1:
        return [(request_id, params)]
    return [(f"{i}_{request_id}",
             dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i,
                                 prompt_logprobs=params.prompt_logprobs if i == 0 else None))
            for i in range(params.n)]


class RequestState:
    """One engine request's output so far (one completion of its :class:`ParentRequest`), with its text."""

    def __init__(self, request_id: str, index: int, parent: "ParentRequest", params: SamplingParams,
                 tokenizer: Optional[Tokenizer]):
        self.request_id, self.index, self.parent, self.params = request_id, index, parent, params
        self.tokenizer = tokenizer
        self.detokenizer = None if tokenizer is None else \
            IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.token_ids: list = []
        self.text = ""                     # the text handed out (stop strings cut)
        self.logprobs: Optional[list] = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: Optional[list] = None   # [None, {token id: Logprob}, ...] once computed
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.metrics = RequestMetrics(arrival_time=parent.arrival)
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
        if out.prompt_logprobs is not None:
            prompt = self.parent.prompt_ids
            self.prompt_logprobs = [None] + [self._logprobs(int(prompt[p + 1]), lp)
                                             for p, lp in enumerate(out.prompt_logprobs)]
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
                hit = self._find_stop(start) if len(self.token_ids) > self.params.min_tokens else None
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

    def completion(self) -> CompletionOutput:
        """The completion so far (text held back while it may begin a stop string)."""
        text = self.text if self.finished or not self.hold else self.text[:max(len(self.text) - self.hold, 0)]
        return CompletionOutput(index=self.index, text=text, token_ids=list(self.token_ids),
                                cumulative_logprob=self.cumulative_logprob,
                                logprobs=None if self.logprobs is None else list(self.logprobs),
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)

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


class ParentRequest:
    """One request as its caller sees it: its prompt and its ``n`` completions, one
    :class:`RequestState` (an engine request) each."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_ids: list, params: SamplingParams,
                 tokenizer: Optional[Tokenizer], arrival: float):
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.arrival = arrival
        self.children = [RequestState(child_id, i, self, child_params, tokenizer)
                         for i, (child_id, child_params) in enumerate(child_requests(request_id, params))]

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def output(self) -> RequestOutput:
        """The request so far: every completion, in index order. Its prompt ids are the request's own
        list (never changed after it is queued: copying a long prompt on every step of every request
        cost milliseconds a step)."""
        first = self.children[0]
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_ids,
                             outputs=[c.completion() for c in self.children], finished=self.finished,
                             metrics=first.metrics if len(self.children) == 1 else self._metrics(),
                             num_cached_tokens=first.num_cached_tokens, prompt_logprobs=first.prompt_logprobs)

    def _metrics(self) -> RequestMetrics:
        """The completions' metrics together: the first times, the last ones, the summed drafts."""
        ms = [c.metrics for c in self.children]

        def first(name):
            return min((getattr(m, name) for m in ms if getattr(m, name) is not None), default=None)

        return RequestMetrics(arrival_time=self.arrival, first_scheduled_time=first("first_scheduled_time"),
                              first_token_time=first("first_token_time"),
                              last_token_time=max((m.last_token_time for m in ms if m.last_token_time is not None),
                                                  default=None),
                              finished_time=max(m.finished_time for m in ms) if self.finished else None,
                              num_draft_tokens=sum(m.num_draft_tokens for m in ms),
                              num_accepted_tokens=sum(m.num_accepted_tokens for m in ms),
                              num_verify_steps=sum(m.num_verify_steps for m in ms),
                              draft_time=sum(m.draft_time for m in ms))


class OutputProcessor:
    """The text side of every unfinished request of one engine core.

    tokenizer: the model folder's, or None (token ids only: empty texts, no stop strings found).
    """

    def __init__(self, tokenizer: Optional[Tokenizer]):
        self.tokenizer = tokenizer
        self.requests: dict[str, ParentRequest] = {}   # request id -> unfinished request
        self._children: dict[str, RequestState] = {}   # engine request id -> its unfinished completion
        # tokens that reached a request (the tokens the core made after a stop string ended its
        # request, in that step or later, are dropped, not counted): what a server reports as generated
        self.num_generation_tokens = 0

    def add_request(self, request_id: str, prompt: Optional[str], prompt_ids: list, params: SamplingParams, *,
                    arrival_time: float) -> list:
        """Take a request; -> the engine requests to queue in the core, ``[(id, SamplingParams)]``
        (:func:`child_requests`). ``ValueError`` for an id already in use."""
        parent = ParentRequest(request_id, prompt, prompt_ids, params, self.tokenizer, arrival_time)
        if request_id in self.requests or any(c.request_id in self._children for c in parent.children):
            raise ValueError(f"request_id: {request_id!r} is already running")
        self.requests[request_id] = parent
        for child in parent.children:
            self._children[child.request_id] = child
        return [(c.request_id, c.params) for c in parent.children]

    def abort_request(self, request_id: str, now: float) -> list:
        """Forget an unfinished request (its unfinished completions: ``finish_reason="abort"``);
        -> the ids of its engine requests that had not finished (to finish in the core); [] when
        the request is unknown."""
        parent = self.requests.pop(request_id, None)
        if parent is None:
            return []
        left = []
        for child in parent.children:
            if not child.finished:
                child.finish("abort", None, now)
                left.append(child.request_id)
            self._children.pop(child.request_id, None)
        return left

    def parent_id(self, child_id: str) -> Optional[str]:
        """The request an unfinished engine request belongs to (None when unknown)."""
        child = self._children.get(child_id)
        return None if child is None else child.parent.request_id

    def process(self, outputs: list, now: float) -> tuple:
        """One step's :class:`CoreOutput`s -> ``(RequestOutputs of the requests that moved, ids of
        the engine requests a stop string ended)``; outputs of engine requests it does not know
        (aborted meanwhile) are dropped. A finished request is forgotten."""
        moved, stopped = {}, []
        for out in outputs:
            child = self._children.get(out.request_id)
            if child is None:
                continue
            had = len(child.token_ids)
            if child.apply(out, now):
                stopped.append(out.request_id)
            self.num_generation_tokens += len(child.token_ids) - had
            if child.finished:
                del self._children[out.request_id]
            moved[child.parent.request_id] = child.parent
        results = []
        for request_id, parent in moved.items():
            results.append(parent.output())
            if parent.finished:
                del self.requests[request_id]
        return results, stopped
