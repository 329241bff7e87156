"""``LLMEngine``: the request loop, as vLLM's (add_request / step / abort_request).

    engine.add_request("r0", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():          # RequestOutputs of the requests that moved this step
            print(out.request_id, out.outputs[0].text, out.finished)

One step: the scheduler picks the rows (``m3_engine.scheduler``), the runner
runs the model and the shared sampling kernel on them (``m3_engine.runner``),
the scheduler takes the new tokens (end-of-sequence, stop tokens, length),
then each request's detokenizer turns them into text and stop strings are
looked for; with an EAGLE-3 draft model, the runner then runs the draft
(``runner.propose``) for the drafts the next step verifies. A request that
finishes frees its cache pages at once. The engine is not thread-safe: one
thread drives it (the server runs it in one loop).
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Optional, Sequence, Union

import numpy as np

from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .runner import Runner, SampleResult, SamplingBatch
from .sampling_params import MAX_SEED, SamplingParams
from .scheduler import Scheduler
from .step_inputs import Step
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["LLMEngine", "PromptType"]

PromptType = Union[str, Sequence[int], dict]


class _Request:
    """The engine's view of one request (the scheduler keeps its own: ids, slots, cache)."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_ids: list, params: SamplingParams,
                 seed: int, scheduler_id: int, detokenizer: Optional[IncrementalDetokenizer], arrival: float):
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.seed, self.scheduler_id, self.detokenizer = seed, scheduler_id, detokenizer
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

    def output(self) -> RequestOutput:
        """The request so far. Its prompt ids are the request's own list (never changed after it is
        queued: copying a long prompt on every step of every request cost milliseconds a step)."""
        finished = self.finish_reason is not None
        text = self.text if finished or not self.hold else self.text[:max(len(self.text) - self.hold, 0)]
        completion = CompletionOutput(index=0, text=text, token_ids=list(self.token_ids),
                                      cumulative_logprob=self.cumulative_logprob,
                                      logprobs=None if self.logprobs is None else list(self.logprobs),
                                      finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_ids,
                             outputs=[completion], finished=finished, metrics=self.metrics,
                             num_cached_tokens=self.num_cached_tokens)


class LLMEngine:
    """Requests in, ``RequestOutput``s out, over one runner.

    runner:    a framework's :class:`m3_engine.runner.Runner`.
    scheduler: the :class:`m3_engine.scheduler.Scheduler` over the runner's pool.
    tokenizer: the model folder's, or None (token-id prompts only, empty texts).
    seed:      requests without a seed draw ``seed`` mixed with their arrival number.
    generation_defaults: ``SamplingParams`` fields from ``generation_config.json`` that
               replace the fields a request leaves at their class defaults.
    """

    def __init__(self, runner: Runner, scheduler: Scheduler, *, tokenizer: Optional[Tokenizer], seed: int = 0,
                 generation_defaults: Optional[dict] = None):
        self.runner, self.scheduler, self.tokenizer = runner, scheduler, tokenizer
        self.seed = seed
        self.generation_defaults = dict(generation_defaults or {})
        self._requests: dict[str, _Request] = {}       # request id -> unfinished request
        self._by_scheduler_id: dict[int, _Request] = {}
        self._arrivals = itertools.count()
        self._counts = {"prompt_tokens": 0, "generation_tokens": 0, "finished_requests": 0, "steps": 0}

    # -- requests ----------------------------------------------------------------------------------

    def add_request(self, request_id: Optional[str], prompt: PromptType,
                    params: Optional[SamplingParams] = None, *, arrival_time: Optional[float] = None) -> str:
        """Queue a prompt (text, token ids, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``);
        -> its request id (a fresh one when ``request_id`` is None). Bad input raises here,
        before anything is queued."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params: expected a SamplingParams, got {type(params).__name__}")
        params = params.with_defaults(self.generation_defaults)
        text, ids = self.tokenize_prompt(prompt)
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id: expected a string, got {type(request_id).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        scheduler_id = self.scheduler.add_request(ids, params.max_tokens, stop_token_ids=params.stop_token_ids,
                                                  ignore_eos=params.ignore_eos)
        number = next(self._arrivals)   # only accepted requests count: they key the unseeded requests' seeds
        if request_id is None:
            request_id = str(number) if str(number) not in self._requests else f"{number}-{uuid.uuid4().hex}"
        if params.seed is None:
            seed = int(np.random.SeedSequence([self.seed, number]).generate_state(1, np.uint64)[0]) & MAX_SEED
        else:
            seed = params.seed
        detokenizer = None if self.tokenizer is None else \
            IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        request = _Request(request_id, text, ids, params, seed, scheduler_id, detokenizer,
                           time.time() if arrival_time is None else arrival_time)
        self._requests[request_id] = request
        self._by_scheduler_id[scheduler_id] = request
        return request_id

    def tokenize_prompt(self, prompt: PromptType) -> tuple:
        """A prompt -> ``(text or None, token ids)``; the ids are checked by the scheduler."""
        if isinstance(prompt, dict):
            if not prompt or set(prompt) - {"prompt", "prompt_token_ids"}:
                raise ValueError(f"prompt: expected {{'prompt': text}} or {{'prompt_token_ids': [...]}}, "
                                 f"got keys {sorted(prompt)}")
            if "prompt_token_ids" in prompt:   # ids win; a text beside them is only shown
                return prompt.get("prompt"), self.tokenize_prompt(list(prompt["prompt_token_ids"]))[1]
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise TypeError(f"prompt: expected {{'prompt': text}}, got a {type(prompt).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: a text prompt needs tokenizer.json in the model folder; pass token ids")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise ValueError(f"prompt: {prompt!r} encodes to no tokens")
            return prompt, ids
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt: empty prompt (expected at least one token id)")
        if not isinstance(prompt, (list, tuple)):
            raise TypeError(f"prompt: expected a string, a list of token ids or a dict, got {type(prompt).__name__}")
        types = set(map(type, prompt))   # one pass in C: a 32k-token prompt costs microseconds, not 10 ms
        if any(t is bool or not issubclass(t, (int, np.integer)) for t in types):
            raise TypeError(f"prompt: expected a list of int token ids, got {prompt!r:.80}")
        return None, list(prompt) if types == {int} else [int(t) for t in prompt]

    def abort_request(self, request_ids: Union[str, Sequence[str]]) -> None:
        """Finish these requests now (``finish_reason="abort"``) and free their pages; unknown or
        finished ids are ignored."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                self.scheduler.finish_request(request.scheduler_id, "abort")
                self._finish(request, "abort", None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def stats(self) -> dict:
        """Counters since start-up and the state now: requests, tokens, speculative decoding, pool pages,
        prefix cache."""
        s, blocks = self.scheduler, self.scheduler.blocks
        return dict(self._counts, **s.spec_stats, running_requests=s.num_running, waiting_requests=s.num_waiting,
                    total_pages=s.config.num_slots, free_pages=s.num_free_slots,
                    prefix_cache_hit_tokens=blocks.hit_tokens, prefix_cache_query_tokens=blocks.query_tokens,
                    prefix_cache_hit_rate=blocks.hit_tokens / max(blocks.query_tokens, 1),
                    cached_blocks=blocks.num_cached, evictable_blocks=blocks.num_evictable)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- steps -------------------------------------------------------------------------------------

    def step(self) -> list:
        """Run one step; -> the ``RequestOutput`` of each request that got a token or finished in
        it (cumulative: text and token ids so far)."""
        if not self.scheduler.has_unfinished():
            return []
        step = self.scheduler.schedule()
        rows = [self._by_scheduler_id[int(i)] for i in step.request_ids]
        now = time.time()
        for r, _ in step.rows:
            request = self._by_scheduler_id[r.id]
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
                request.num_cached_tokens = r.num_cached   # prompt tokens served by the prefix cache
        try:
            result = self.runner.execute(step, self._sampling_batch(step, rows))
        except BaseException:
            self.scheduler.cancel(step)
            raise
        self._counts["prompt_tokens"] += sum(q for r, q in step.rows if not r.prefilled)
        finished = set(self.scheduler.update(step, result.tokens))
        self._counts["steps"] += 1
        now = time.time()
        outputs = []
        for (r, _), count in zip(step.rows, step.num_logits.tolist()):
            if count:
                request = self._by_scheduler_id[r.id]
                self._emit(request, r, result, r.id in finished, now)
                outputs.append(request.output())
        if self.scheduler.eagle3:
            self._draft(step, result.tokens)
        return outputs

    def _draft(self, step: Step, tokens: np.ndarray) -> None:
        """EAGLE-3: run the draft model after ``step`` (its K/V rows for the step's tokens, and the
        drafts the next step verifies), timed as the requests' draft time."""
        work = self.scheduler.draft_pass(step, tokens)
        start = time.perf_counter()
        drafts = self.runner.propose(work)
        self.scheduler.set_drafts(work, drafts, time.perf_counter() - start)

    def _emit(self, request: _Request, r, result: SampleResult, finished: bool, now: float) -> None:
        """Hand the scheduler request ``r``'s new tokens to ``request``: token ids, logprobs, text,
        stop strings (one token at a time: a stop string inside an accepted run of drafts cuts the
        output where plain decoding would have), metrics; finish it when it ends."""
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.metrics.last_token_time = now
        m = request.metrics
        m.num_draft_tokens, m.num_accepted_tokens = r.spec_draft_tokens, r.spec_accepted_tokens
        m.num_verify_steps, m.draft_time = r.spec_verify_steps, r.spec_draft_time
        reason = stop_reason = None
        for j, token in enumerate(r.emitted):
            i = r.emitted_row + j
            last = j == len(r.emitted) - 1
            request.token_ids.append(token)
            self._counts["generation_tokens"] += 1
            if request.logprobs is not None:
                request.logprobs.append(self._logprobs(result, i, token, request.params.logprobs))
                request.cumulative_logprob += float(result.logprobs[i])
            if last and finished:
                reason, stop_reason = r.finish_reason, r.stop_reason
            if request.detokenizer is not None:
                start = len(request.text)
                request.text += request.detokenizer.add([token])
                if reason is not None:
                    request.text += request.detokenizer.finish()
                hit = self._find_stop(request, start)
                if hit is not None:
                    if reason is None:
                        self.scheduler.finish_request(r.id, "stop")
                    reason, stop_reason = "stop", hit
                    break
        if reason is not None:
            self._finish(request, reason, stop_reason)

    def _sampling_batch(self, step: Step, rows: list) -> SamplingBatch:
        params = [r.params for r in rows]
        penalties = any(p.has_penalties for p in params)
        asked = [p.logprobs for p in params if p.logprobs is not None]

        def ids(lists):
            out = np.full((len(lists), max(map(len, lists), default=0) or 1), -1, np.int32)
            for i, x in enumerate(lists):
                out[i, :len(x)] = x
            return out

        return SamplingBatch(
            temperature=np.array([p.temperature for p in params], np.float32),
            top_k=np.array([max(p.top_k, 0) for p in params], np.int32),
            top_p=np.array([p.top_p for p in params], np.float32),
            min_p=np.array([p.min_p for p in params], np.float32),
            seeds=np.array([r.seed for r in rows], np.int64),
            counters=np.asarray(step.output_index, np.int32),
            repetition_penalty=np.array([p.repetition_penalty for p in params], np.float32) if penalties else None,
            presence_penalty=np.array([p.presence_penalty for p in params], np.float32) if penalties else None,
            frequency_penalty=np.array([p.frequency_penalty for p in params], np.float32) if penalties else None,
            prompt_ids=ids([r.prompt_ids for r in rows]) if penalties else None,
            output_ids=ids(self._outputs_so_far(step)) if penalties else None,
            num_logprobs=max(asked) if asked else None)

    def _outputs_so_far(self, step: Step) -> list:
        """Per logits row, the output its penalties count: a verify row's position ``j`` counts the
        request's tokens and the drafts before ``j`` (what it has generated if they are accepted)."""
        out = []
        for (r, _), count, drafts in zip(step.rows, step.num_logits.tolist(), step.drafts):
            tokens = self._by_scheduler_id[r.id].token_ids
            out += [tokens + list(drafts[:j]) for j in range(count)]
        return out

    def _logprobs(self, result: SampleResult, i: int, token: int, n: int) -> dict:
        text = self.tokenizer.token_text if self.tokenizer is not None else (lambda t: None)
        entry = {}
        for rank, (t, lp) in enumerate(zip(result.top_ids[i, :n].tolist(), result.top_logprobs[i, :n].tolist())):
            entry[int(t)] = Logprob(float(lp), rank + 1, text(t))
        if token not in entry:
            entry[token] = Logprob(float(result.logprobs[i]), int(result.ranks[i]), text(token))
        return entry

    def _find_stop(self, request: _Request, start: int) -> Optional[str]:
        """The first stop string in the text that ends at or after ``start`` (where this step's
        text began): cut the text there; -> the stop string, or None."""
        if not request.params.stop:
            return None
        longest = max(map(len, request.params.stop))
        best = None
        for s in request.params.stop:
            j = request.text.find(s, max(start - longest + 1, 0))
            if j >= 0 and (best is None or j < best[0]):
                best = (j, s)
        if best is None:
            return None
        j, s = best
        request.text = request.text[:j + len(s)] if request.params.include_stop_str_in_output else request.text[:j]
        return s

    def _finish(self, request: _Request, reason: str, stop_reason) -> None:
        request.finish_reason, request.stop_reason = reason, stop_reason
        request.metrics.finished_time = time.time()
        self._requests.pop(request.request_id, None)
        self._by_scheduler_id.pop(request.scheduler_id, None)
        self.scheduler.forget(request.scheduler_id)
        self._counts["finished_requests"] += 1
