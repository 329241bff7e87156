"""``EngineCore``: the token side of the engine (vLLM's engine core): scheduler, runner, sampling.

    core.add_request("r0", [1, 450, 4996], SamplingParams(max_tokens=8))
    while core.has_unfinished_requests():
        outputs = core.execute_step()      # CoreOutput: the new token ids of each request that moved
        core.propose_drafts()              # EAGLE-3's draft pass for the next step (else nothing)

It takes token ids and resolved ``SamplingParams`` (the model's generation defaults already
applied) and gives token ids, logprobs as numbers and finish reasons; it never sees text.
Text (detokenization, stop strings) is the front end's: ``m3_engine.output_processor``, used
by ``LLMEngine`` in the same process and by ``m3-serve`` in its HTTP process while this core
runs in a process of its own (``m3_engine.server.core_process``). A stop string found by the
front end ends its request in the core with :meth:`finish_request`.

One step: the scheduler picks the rows (``m3_engine.scheduler``), the runner runs the model
and the shared sampling kernel on them (``m3_engine.runner``), the scheduler takes the new
tokens (end-of-sequence, stop tokens, length). A step's token bitmask (``SamplingBatch.token_bitmask``,
applied by the sampling kernel) forbids, per logits row: what a request's ``structured_outputs``
grammar does not allow next (its matcher is advanced by its new tokens after the step;
``m3_engine.structured_outputs``), the stop tokens (the model's eos ids unless ``ignore_eos``,
and ``stop_token_ids``) while the request has fewer than ``min_tokens`` outputs, and its
``bad_words`` (vLLM's rule: :func:`bad_words_token_ids`, :func:`banned_tokens`); the masks
are ANDed. A request with ``prompt_logprobs`` gets the logprobs of its prompt's tokens from
the steps that compute its prompt (``Step.prompt_logits_indices``), handed out with its first
token. ``max_tokens=None`` is the rest of the context: ``max_model_len`` - the prompt's length.
With an EAGLE-3 draft model, :meth:`propose_drafts` runs the draft (``runner.propose``) for the
drafts the next step verifies; it comes after the front end finished the requests its stop strings ended (the
scheduler drafts for unfinished requests only). A request that finishes frees its cache pages at
once. Not thread-safe: one thread drives it.

**The token bitmask comes late** (vLLM's order): the runner launches a step's forward, then asks for
its bitmask (``SamplingBatch.late_token_bitmask``, ``m3_engine.runner``), then launches its sampling,
so the host fills the mask while the device runs the forward.

**Async scheduling** (``async_scheduling=True``, vLLM's option): the device never waits for the
host between steps. Each :meth:`execute_step` schedules and submits the next step while the
last one runs, then waits for the last one's tokens and hands them out::

    call k:   schedule + submit step k+1  |  wait for step k, update, outputs of step k
    device:   ... step k ...................... step k+1 ...........................

Step ``k + 1`` is scheduled before step ``k``'s tokens are known: its generation rows take those
tokens on the device (``Step.carry_from``); a request that step ``k`` ends by length is left
out of it, and one that step ``k`` ends by a stop token, by completing its grammar (or that is
aborted or stopped by a stop string meanwhile) has its row of step ``k + 1`` discarded
(``m3_engine.scheduler``). When step ``k + 1`` is masked, the wait for step ``k`` moves inside its
submission: its forward is launched, then the host waits for step ``k``'s tokens, applies them
(scheduler update, grammar advance), fills step ``k + 1``'s mask from them (the rows of a request
that ended meanwhile allow every token: they are discarded) and only then launches its sampling::

    call k:   schedule, launch forward k+1 | wait for step k, update, fill mask k+1 | launch sampling k+1
    device:   ... step k ...................... forward k+1 ..................... sampling k+1 ...

so structured outputs, ``min_tokens`` and bad words (of any length) run ahead too. Outputs are the
same tokens as with synchronous steps, one call later. A step runs synchronously (the next one
scheduled after its tokens are back) when a request it samples for uses penalties: the next step
uploads its output ids. Not with speculative decoding (``m3_engine.args`` refuses it). When a
step's submission fails after the tokens of the step before it were applied, :meth:`execute_step`
hands those out and raises the failure at its next call.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from .runner import Runner, SampleResult, SamplingBatch
from .sampling_params import MAX_SEED, SamplingParams
from .scheduler import Scheduler
from .step_inputs import Step
from .step_timeline import StepProfile, StepTimeline
from .structured_outputs import Grammar, StructuredOutputsBackend, fill_bitmask, forbid_tokens
from .tokenizer import Tokenizer

__all__ = ["EngineCore", "CoreOutput", "TokenLogprobs", "bad_words_token_ids", "banned_tokens"]


@dataclasses.dataclass
class TokenLogprobs:
    """One generated token's logprobs: the ``top_ids`` / ``top_logprobs`` asked for (most likely
    first), and the sampled token's own ``logprob`` and ``rank`` (1 = most likely)."""
    top_ids: list[int]
    top_logprobs: list[float]
    logprob: float
    rank: int


@dataclasses.dataclass
class CoreOutput:
    """What one step did to one request: the tokens it emitted (several after a verify step), their
    logprobs when asked, and its end (``finish_reason`` "stop" for eos, a stop token or a completed
    grammar, "length"; ``stop_reason`` the stop token id). The request's cache and speculative
    decoding numbers are its totals so far. ``prompt_logprobs`` (with the first token of a request
    that asked): per prompt position ``p`` but the last, the logprobs of ``prompt[p + 1]``."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[list[TokenLogprobs]] = None     # one per new token, when the request asked
    prompt_logprobs: Optional[list[TokenLogprobs]] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None
    num_cached_tokens: int = 0              # prompt tokens served by the prefix cache
    first_scheduled_time: Optional[float] = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    draft_time: float = 0.0


class _CoreRequest:
    """The core's view of one request (the scheduler keeps its own: ids, slots, cache)."""

    def __init__(self, request_id: str, prompt_ids: list, params: SamplingParams, seed: int, scheduler_id: int,
                 grammar: Optional[Grammar], stop_ids: tuple, bad_words: list):
        self.request_id, self.prompt_ids, self.params = request_id, prompt_ids, params
        self.seed, self.scheduler_id, self.grammar = seed, scheduler_id, grammar
        self.stop_ids, self.bad_words = stop_ids, bad_words   # what min_tokens forbids; bad words' token ids
        self.longest_bad_word = max(map(len, bad_words), default=0)
        self.token_ids: list = []          # what the penalties count
        self.num_cached_tokens = 0
        self.first_scheduled_time: Optional[float] = None
        self.prompt_logprobs: Optional[list] = [] if params.prompt_logprobs is not None else None
        self.prompt_logprobs_sent = False

    @property
    def bans_tokens(self) -> bool:
        """Whether its next rows forbid tokens: stop tokens before ``min_tokens``, or bad words."""
        return bool(self.bad_words) or len(self.token_ids) < self.params.min_tokens

    @property
    def masked(self) -> bool:
        """Whether its next rows need a token bitmask: a grammar, or tokens it bans."""
        return self.grammar is not None or self.bans_tokens


@dataclasses.dataclass(eq=False)
class _Submitted:
    """A step launched on the runner: its handle (``Runner.submit``), whether the next step may be
    scheduled before its tokens are back, and once its tokens are back and applied, its outputs."""
    step: Step
    handle: Any
    may_run_ahead: bool
    prompt_spans: list   # [(request, start, end)]: the prompt logprobs the step's result holds
    taken: bool = False                    # runner.result returned its tokens
    outputs: Optional[list] = None         # what _apply made of them
    device_wait: float = 0.0               # seconds runner.result waited for them (the step timeline)


class EngineCore:
    """Token ids in, :class:`CoreOutput`s out, over one runner.

    runner:    a framework's :class:`m3_engine.runner.Runner`.
    scheduler: the :class:`m3_engine.scheduler.Scheduler` over the runner's pool.
    tokenizer: the model folder's, or None; structured outputs need it (xgrammar's vocabulary).
    seed:      requests without a seed draw ``seed`` mixed with their arrival number.
    async_scheduling: schedule and submit each step while the previous one runs (the module
               docstring); the scheduler must not speculate.
    """

    def __init__(self, runner: Runner, scheduler: Scheduler, *, tokenizer: Optional[Tokenizer], seed: int = 0,
                 async_scheduling: bool = False):
        if not isinstance(async_scheduling, bool):
            raise TypeError(f"async_scheduling: expected a bool, got {async_scheduling!r}")
        if async_scheduling and scheduler.speculative is not None:
            raise ValueError(f"async_scheduling: not with speculative decoding (method "
                             f"{scheduler.speculative.method!r}): expected async_scheduling=False")
        self.runner, self.scheduler, self.tokenizer = runner, scheduler, tokenizer
        self.seed = seed
        self.async_scheduling = async_scheduling
        self._in_flight: Optional[_Submitted] = None   # the step submitted and not yet updated
        self._failure: Optional[Exception] = None       # a submission's failure, raised at the next step
        self._requests: dict[str, _CoreRequest] = {}       # request id -> unfinished request
        self._by_scheduler_id: dict[int, _CoreRequest] = {}
        self._arrivals = itertools.count()
        self._structured: Optional[StructuredOutputsBackend] = None   # built by the first constrained request
        self._draft_work: Optional[tuple] = None   # EAGLE-3: (step, tokens) of the step the draft pass follows
        # steps_ahead: steps scheduled and submitted while the step before them was still running
        self._counts = {"prompt_tokens": 0, "generation_tokens": 0, "finished_requests": 0, "steps": 0,
                        "steps_ahead": 0}
        self.timeline = StepTimeline.from_environ()   # a line per step with $M3_STEP_TIMELINE (benchmarks)
        self.profile = StepProfile.from_environ()     # cProfile of the steps with $M3_STEP_PROFILE (benchmarks)

    # -- requests ----------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list, params: SamplingParams) -> None:
        """Queue a request: its prompt's token ids (checked by the scheduler) and its resolved
        sampling parameters. Bad input raises here, before anything is queued."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id: expected a string, got {type(request_id).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if params.n != 1:
            raise ValueError(f"n: the engine core takes one completion a request (got n={params.n}): the "
                             f"output processor fans a request out (m3_engine.output_processor.child_requests)")
        grammar = self._grammar(params)   # compiles the constraint: a bad one raises before anything is queued
        vocab_size = self.scheduler.vocab_size
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words, vocab_size) if params.bad_words else []
        stop_ids = () if params.min_tokens == 0 else tuple(sorted(
            {t for t in params.stop_token_ids if t < vocab_size} |
            (set() if params.ignore_eos else set(self.scheduler.eos_token_ids))))
        scheduler_id = self.scheduler.add_request(prompt_ids, params.max_tokens, stop_token_ids=params.stop_token_ids,
                                                  ignore_eos=params.ignore_eos,
                                                  prompt_logprobs=params.prompt_logprobs is not None)
        number = next(self._arrivals)   # only accepted requests count: they key the unseeded requests' seeds
        if params.seed is None:
            seed = int(np.random.SeedSequence([self.seed, number]).generate_state(1, np.uint64)[0]) & MAX_SEED
        else:
            seed = params.seed
        request = _CoreRequest(request_id, prompt_ids, params, seed, scheduler_id, grammar, stop_ids, bad_words)
        self._requests[request_id] = request
        self._by_scheduler_id[scheduler_id] = request
        if self.timeline is not None:
            self.timeline.added(request_id)

    def _grammar(self, params: SamplingParams) -> Optional[Grammar]:
        """A constrained request's matcher (the backend is built on the first one); None without
        ``structured_outputs``."""
        if params.structured_outputs is None:
            return None
        if self._structured is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs: needs the model folder's tokenizer (tokenizer.json)")
            self._structured = StructuredOutputsBackend(self.tokenizer, vocab_size=self.scheduler.vocab_size)
        return self._structured.grammar(params.structured_outputs,
                                        stop_token_ids=[*self.scheduler.eos_token_ids, *params.stop_token_ids])

    def finish_request(self, request_ids: Union[str, Sequence[str]], reason: str = "abort") -> None:
        """End these requests now and free their pages: ``"abort"``, or ``"stop"`` for a stop string
        the front end found. Unknown or finished ids are ignored. A step in flight keeps running;
        what it samples for them is discarded."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self._requests.pop(request_id, None)
            if request is not None:
                self.scheduler.finish_request(request.scheduler_id, reason)
                self._forget(request)
                if self.timeline is not None:
                    self.timeline.forget([request_id])
        self._drain_if_idle()

    def has_unfinished_requests(self) -> bool:
        """Requests still running, or a failure held for the next :meth:`execute_step` (it raises there)."""
        return bool(self._requests) or self._failure is not None

    def unfinished_request_ids(self) -> list:
        return list(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

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

    # -- steps -------------------------------------------------------------------------------------

    def execute_step(self) -> list:
        """Run one model step; -> a :class:`CoreOutput` for each request that got tokens in it.
        With async scheduling the step whose tokens come back is the one the previous call submitted,
        and the next one is submitted first (the module docstring). With an EAGLE-3 draft model,
        :meth:`propose_drafts` must follow before the next step."""
        if self.profile is None:
            return self._execute_step()
        with self.profile:
            return self._execute_step()

    def _execute_step(self) -> list:
        if self._draft_work is not None:
            raise RuntimeError("execute_step: the last step's draft pass has not run (call propose_drafts() first)")
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        start = time.time()
        if self._in_flight is None:
            if not self.scheduler.has_unfinished():
                return []
            self._in_flight = self._submit(previous=None)
        done, self._in_flight = self._in_flight, None
        try:
            if done.may_run_ahead:
                self._in_flight = self._submit(previous=done)
            outputs = self._take(done)
        except Exception as e:
            if done.outputs is None:
                self._cancel(done)
                raise
            self._failure = e   # the next step failed after this one's tokens were applied: hand them out
            outputs = done.outputs
        except BaseException:
            self._cancel(done)
            raise
        self._drain_if_idle()
        if self.timeline is not None:
            self.timeline.record(start, done.step, done.device_wait, outputs)
        return outputs

    def _cancel(self, done: _Submitted) -> None:
        """A step failed: undo the scheduling of the step in flight and of ``done`` unless its tokens came
        back (nothing of them is applied when the runner failed)."""
        if self._in_flight is not None:
            self.scheduler.cancel(self._in_flight.step)
            self._in_flight = None
        if not done.taken:
            self.scheduler.cancel(done.step)

    def _take(self, done: _Submitted) -> list:
        """Wait for a step's tokens and apply them, once (the next step's late bitmask may have done it)."""
        if not done.taken:
            waited = time.perf_counter()
            result = self.runner.result(done.handle)
            done.device_wait = time.perf_counter() - waited
            done.taken = True
            done.outputs = self._apply(done, result)
        return done.outputs

    def _submit(self, previous: Optional[_Submitted]) -> Optional[_Submitted]:
        """Schedule the next step and launch it. ``previous``: the step still running, whose sampled
        tokens the new one may take on the device, and which a masked new step takes (waits for and
        applies) before its bitmask is filled. -> None when no step can run before ``previous``'s
        tokens are back."""
        if not self.scheduler.has_unfinished():
            return None
        step = self.scheduler.schedule()
        if step is None:
            return None
        rows = [self._by_scheduler_id[int(i)] for i in step.request_ids]
        now = time.time()
        for r, _ in step.rows:
            request = self._by_scheduler_id[r.id]
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                request.num_cached_tokens = r.prefix_hit_tokens
        prompt_spans = self._prompt_spans(step)
        late_bitmask = None
        if any(r.masked for r in rows):
            requests = [self._by_scheduler_id[r.id] for r, _ in step.rows]

            def late_bitmask():   # called by the runner once the step's forward is launched
                if previous is not None:
                    self._take(previous)
                return self._token_bitmask(step, requests)

        try:
            handle = self.runner.submit(step, self._sampling_batch(step, rows, prompt_spans, late_bitmask),
                                        previous.handle if step.carry_from is not None else None)
        except BaseException:
            self.scheduler.cancel(step)
            raise
        self._counts["prompt_tokens"] += step.num_prompt_tokens
        self._counts["steps_ahead"] += previous is not None
        may_run_ahead = self.async_scheduling and not any(r.params.has_penalties for r in rows)
        return _Submitted(step, handle, may_run_ahead, prompt_spans)

    def _apply(self, done: _Submitted, result: SampleResult) -> list:
        """A step's sampled tokens (and prompt logprobs): the scheduler's update, then the outputs of
        the requests that got tokens (not of those that ended while it ran)."""
        step = done.step
        if done.prompt_spans:
            self._take_prompt_logprobs(done.prompt_spans, result)
        finished = set(self.scheduler.update(step, result.tokens))
        self._counts["steps"] += 1
        outputs = []
        for (r, _), count in zip(step.rows, step.num_logits.tolist()):
            if count and (not r.finished or r.id in finished):
                outputs.append(self._emit(self._by_scheduler_id[r.id], r, result, r.id in finished))
        if self.scheduler.eagle3:
            self._draft_work = (step, result.tokens)
        return outputs

    def _drain_if_idle(self) -> None:
        """With no request left, wait for the step in flight (every row of it discarded): no step
        outlives the requests it ran."""
        if self._in_flight is not None and not self.scheduler.has_unfinished():
            last, self._in_flight = self._in_flight, None
            self.scheduler.update(last.step, self.runner.result(last.handle).tokens)
            self._counts["steps"] += 1

    def propose_drafts(self) -> None:
        """EAGLE-3: run the draft model after the last step (its K/V rows for the step's tokens, and
        the drafts the next step verifies), timed as the requests' draft time; nothing otherwise.
        Call it once the requests that a stop string ended are finished."""
        if self._draft_work is None:
            return
        step, tokens = self._draft_work
        self._draft_work = None
        work = self.scheduler.draft_pass(step, tokens)
        start = time.perf_counter()
        drafts = self.runner.propose(work)
        self.scheduler.set_drafts(work, drafts, time.perf_counter() - start)

    def step(self) -> list:
        """:meth:`execute_step` then :meth:`propose_drafts`, for a caller without stop strings."""
        outputs = self.execute_step()
        self.propose_drafts()
        return outputs

    def _emit(self, request: _CoreRequest, r, result: SampleResult, finished: bool) -> CoreOutput:
        """The scheduler request ``r``'s new tokens: token ids, logprobs, the grammar advanced (one
        token at a time: a grammar that completes inside an accepted run of drafts ends the output
        where plain decoding would have); the request is finished when it ends."""
        out = CoreOutput(request.request_id, [], [] if request.params.logprobs is not None else None,
                         num_cached_tokens=request.num_cached_tokens,
                         first_scheduled_time=request.first_scheduled_time,
                         num_draft_tokens=r.spec_draft_tokens, num_accepted_tokens=r.spec_accepted_tokens,
                         num_verify_steps=r.spec_verify_steps, draft_time=r.spec_draft_time)
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            out.prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
        reason = stop_reason = None
        for j, token in enumerate(r.emitted):
            i = r.emitted_row + j
            request.token_ids.append(token)
            out.new_token_ids.append(token)
            self._counts["generation_tokens"] += 1
            if out.new_logprobs is not None:
                out.new_logprobs.append(self._logprobs(result, i, request.params.logprobs))
            if request.grammar is not None:
                request.grammar.accept(token)
            if j == len(r.emitted) - 1 and finished:
                reason, stop_reason = r.finish_reason, r.stop_reason
            if request.grammar is not None and request.grammar.is_terminated and reason != "stop":
                # the grammar ended on a stop token the scheduler let through (ignore_eos), or on the last
                # token max_tokens allowed: the output is complete
                self.scheduler.finish_request(r.id, "stop")   # no-op when the scheduler finished it already
                reason, stop_reason = "stop", None
            if reason is not None:
                break
        if reason is not None:
            out.finish_reason, out.stop_reason = reason, stop_reason
            del self._requests[request.request_id]
            self._forget(request)
        return out

    def _forget(self, request: _CoreRequest) -> None:
        self._by_scheduler_id.pop(request.scheduler_id, None)
        self.scheduler.forget(request.scheduler_id)
        self._counts["finished_requests"] += 1

    @staticmethod
    def _logprobs(result: SampleResult, i: int, n: int) -> TokenLogprobs:
        # N = 0 asks for the sampled token's logprob alone: a step whose rows all ask for 0 has no top arrays
        top_ids, top_logprobs = (result.top_ids[i, :n].tolist(),
                                 result.top_logprobs[i, :n].tolist()) if n else ([], [])
        return TokenLogprobs(top_ids, top_logprobs, float(result.logprobs[i]), int(result.ranks[i]))

    def _prompt_spans(self, step: Step) -> list:
        """``[(request, start, end)]``: the prompt positions whose logprobs this step computes, in the
        order of ``step.prompt_logits_indices``."""
        return [(self._by_scheduler_id[step.rows[row][0].id], start, end) for row, start, end in step.prompt_spans]

    def _take_prompt_logprobs(self, spans: list, result: SampleResult) -> None:
        i = 0
        for request, start, end in spans:
            n = request.params.prompt_logprobs
            for _ in range(start, end):
                top_ids, top_logprobs = (result.prompt_top_ids[i, :n].tolist(),
                                         result.prompt_top_logprobs[i, :n].tolist()) if n else ([], [])
                request.prompt_logprobs.append(TokenLogprobs(top_ids, top_logprobs, float(result.prompt_logprobs[i]),
                                                             int(result.prompt_ranks[i])))
                i += 1

    def _sampling_batch(self, step: Step, rows: list, prompt_spans: list,
                        late_bitmask: Optional[Callable[[], np.ndarray]]) -> SamplingBatch:
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
            num_logprobs=max(asked) if asked else None,
            late_token_bitmask=late_bitmask,
            prompt_targets=np.concatenate([np.asarray(request.prompt_ids[start + 1:end + 1], np.int32)
                                           for request, start, end in prompt_spans]) if prompt_spans else None,
            num_prompt_logprobs=max((request.params.prompt_logprobs for request, _, _ in prompt_spans), default=None))

    def _token_bitmask(self, step: Step, requests: list) -> np.ndarray:
        """The step's token bitmask (module docstring), from the requests' tokens so far; ``requests``:
        per row of the step. The rows of a request that ended since the step was scheduled allow every
        token (they are discarded)."""
        counts = step.num_logits.tolist()
        live = [not r.finished for r, _ in step.rows]
        vocab_size = self.scheduler.vocab_size
        bitmask = fill_bitmask([(request.grammar if alive else None, count, drafts) for request, alive, count, drafts
                                in zip(requests, live, counts, step.drafts)], vocab_size)
        start = 0
        for request, alive, count, drafts in zip(requests, live, counts, step.drafts):
            if alive and request.bans_tokens:
                keep = request.longest_bad_word - 1   # the output's tail a bad word's prefix may match
                tail = request.token_ids[len(request.token_ids) - keep:] if keep else []
                for j in range(count):   # a verify row's row j follows drafts 0..j-1
                    banned = banned_tokens(len(request.token_ids) + j, tail + list(drafts[:j]),
                                           request.params.min_tokens, request.stop_ids, request.bad_words)
                    if banned:
                        forbid_tokens(bitmask, start + j, banned)
                        if not bitmask[start + j].any():
                            raise RuntimeError(f"request {request.request_id!r}: its grammar allows only tokens "
                                               f"that min_tokens or bad_words forbid")
            start += count
        return bitmask

    def _outputs_so_far(self, step: Step) -> list:
        """Per logits row, the output its penalties count: a verify row's position ``j`` counts the
        request's tokens and the drafts before ``j`` (what it has generated if they are accepted)."""
        out = []
        for (r, _), count, drafts in zip(step.rows, step.num_logits.tolist(), step.drafts):
            tokens = self._by_scheduler_id[r.id].token_ids
            out += [tokens + list(drafts[:j]) for j in range(count)]
        return out


def bad_words_token_ids(tokenizer: Optional[Tokenizer], words: Sequence[str], vocab_size: int) -> list:
    """The token ids of ``SamplingParams.bad_words``, vLLM's way: each word (its leading spaces
    stripped) as it encodes alone, and with one leading space when that encodes to as many tokens
    and another first token (the same word in the middle of a text). ``ValueError`` for a word
    that encodes to nothing or to an id outside ``[0, vocab_size)``."""
    if tokenizer is None:
        raise ValueError("bad_words: needs the model folder's tokenizer (tokenizer.json)")
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words: {word!r} encodes to no tokens")
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(list(plain))
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            out.append(list(spaced))
    outside = [t for ids in out for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise ValueError(f"bad_words: token id {outside[0]} is outside the vocabulary [0, {vocab_size})")
    return out


def banned_tokens(num_output: int, tail: Sequence[int], min_tokens: int, stop_ids: Sequence[int],
                  bad_words: Sequence[Sequence[int]]) -> list:
    """The tokens a logits row may not sample: ``stop_ids`` while the request's output has fewer
    than ``min_tokens`` tokens (``num_output`` before this row); a one-token bad word's token; a
    longer bad word's last token when the output ends with the rest of the word (vLLM's
    ``apply_bad_words``, over the output's tokens only). ``tail``: the output's last tokens (at
    least the longest bad word's length - 1 of them, or all)."""
    banned = list(stop_ids) if num_output < min_tokens else []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix == 0 or (num_output >= prefix and list(tail[len(tail) - prefix:]) == list(word[:-1])):
            banned.append(word[-1])
    return banned
