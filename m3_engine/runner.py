"""The one seam between the engine and a framework: a model runner.

``m3_torch.runner.TorchRunner`` and ``m3_jax.runner.JaxRunner`` implement it;
the engine (``m3_engine.engine.LLMEngine``) drives either through these calls
only, so everything a request does outside the model step lives once, here in
``m3_engine``:

    runner.buckets: StepBuckets                       # how the engine pads its steps for this runner
    runner.scheduler_config: SchedulerConfig          # the engine's limits, num_slots = the pool the runner made
    runner.on_gpu: bool                               # precompile's default (m3_engine.args)
    runner.warm_up(builder) -> dict                   # make every step program now (precompile)
    handle = runner.submit(step, sampling, previous)  # launch one step: model forward, then sampling
    runner.result(handle) -> SampleResult             # wait for it: the sampled tokens on the host
    runner.execute(step, sampling) -> SampleResult    # both at once: result(submit(step, sampling, None))
    runner.propose(work) -> drafts [n, k] int32       # EAGLE-3 only: the draft model after that step
    runner.close()                                    # free the device state (and end TP workers)

``submit`` returns once the step is queued on the device (with the copy of
its sampled outputs to the host started), so the engine can schedule and
submit the next step while it runs (async scheduling,
``m3_engine.engine_core``). That next step may take some input token ids
from this one's sampled tokens without the host seeing them
(``step.carry_from``: index ``i`` is the token ``previous`` sampled at its
logits row ``i``): ``previous`` is the handle of the step submitted just
before (None when ``step.carry_from`` is None). ``result`` is called once per
handle, in submission order.

A step's token bitmask may come late (``sampling.late_token_bitmask``, a
callable; vLLM's order): ``submit`` launches the step's forward first, then
calls it once (:meth:`SamplingBatch.with_token_bitmask`), then launches the
sampling that consumes the mask. The host fills the mask while the device runs
the forward; under async scheduling the call also waits for ``previous``'s
tokens and applies them (the engine's scheduler update and grammar advance,
``m3_engine.engine_core``) first, so it may call ``result(previous)`` from
inside ``submit``. A runner picks its programs by whether the mask comes late
(``late_token_bitmask`` is set) before the mask exists.

``scheduler_config`` is ``args.scheduler`` with ``num_slots`` the pages of the
KV pool the runner allocated: on a GPU without ``num_gpu_blocks_override``,
what ``gpu_memory_utilization`` of it leaves after the weights (the fewest of
any tensor-parallel rank), found only once the weights are loaded, so the
engine builds its scheduler from the runner.

``buckets`` (``m3_engine.buckets.StepBuckets``, set by the runner from the
options) is the padding the runner wants: the engine builds every step with it
(``m3_engine.step_inputs``), so ``step`` (a :class:`m3_engine.step_inputs.Step`:
ids, positions, slot mapping, block table, lengths, the planner's plan) comes
already padded and planned, and the runner consumes it as it is;
``sampling`` holds one entry per logits row of the step. The model step
computes the logits of ``step.forward_logits_indices``: the sampled rows, then
(only on a step that computes a prompt whose request asked for prompt
logprobs) ``step.prompt_logits_indices``, whose log-softmax rows give
``SampleResult.prompt_*``. ``warm_up`` (run by
``LLM()`` when ``precompile`` is on, before it returns) compiles or captures
every program a step of ``builder`` (the engine's ``StepBuilder``) can need,
and returns ``{"programs": n, "compile": seconds, "capture": seconds}``. A runner owns the
weights on its device(s), the KV pool, CUDA graphs or jitted steps, tensor
parallelism, and launches the shared sampling kernel (``m3_torch.sample`` /
``m3_jax.sample``).

With ``speculative_config`` method "eagle3" the runner also owns the draft
head and its pool: ``execute`` keeps the target's aux hidden states of the
step, and ``propose(work)`` (``work``: the scheduler's
:class:`m3_engine.scheduler.DraftPass` for that step) runs the draft's first
pass over the step's rows and its chain, and returns the greedy drafts of
``work.request_ids``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol

import numpy as np

from .buckets import StepBuckets
from .scheduler import DraftPass, SchedulerConfig
from .step_inputs import Step, StepBuilder

__all__ = ["Runner", "SynchronousRunner", "SamplingBatch", "SampleResult"]


@dataclasses.dataclass(frozen=True, eq=False)
class SamplingBatch:
    """Per logits row of a step (``L`` rows, in ``step.logits_indices`` order).

    temperature [L] float32 (0: greedy); top_k [L] int32 (0: off); top_p, min_p [L] float32;
    seeds [L] int64; counters [L] int32 (the row's token index in its request's output).
    Penalties, only when a row uses one (else all None): repetition/presence/frequency
    [L] float32 and the rows' prompt and output ids, [L, P] / [L, O] int32 padded with -1.
    num_logprobs: the largest top-N asked by a row, 0 when a row asks only for the sampled
    token's logprob, None when no row asks for logprobs.
    token_bitmask: only when a row forbids tokens (structured outputs, min_tokens, bad_words; else
    None): [L, ceil(V / 32)] int32, V the logits width; bit ``t % 32`` of word ``t // 32`` set =
    token ``t`` may be sampled (``m3_engine.structured_outputs``); other rows are all ones (-1).
    late_token_bitmask: instead of token_bitmask, a callable returning it, which the runner calls
    once, after launching the step's forward and before launching its sampling (the module
    docstring).
    Prompt logprobs, only on a step with ``step.prompt_logits_indices`` (else None): prompt_targets
    [P] int32, the prompt token that follows each of those rows; num_prompt_logprobs, the
    largest top-N asked (0: the target's logprob and rank only).
    """
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seeds: np.ndarray
    counters: np.ndarray
    repetition_penalty: Optional[np.ndarray] = None
    presence_penalty: Optional[np.ndarray] = None
    frequency_penalty: Optional[np.ndarray] = None
    prompt_ids: Optional[np.ndarray] = None
    output_ids: Optional[np.ndarray] = None
    num_logprobs: Optional[int] = None
    token_bitmask: Optional[np.ndarray] = None
    late_token_bitmask: Optional[Callable[[], np.ndarray]] = None
    prompt_targets: Optional[np.ndarray] = None
    num_prompt_logprobs: Optional[int] = None

    @classmethod
    def greedy(cls, rows: int) -> "SamplingBatch":
        """``rows`` greedy rows (benchmarks and tests that run steps without the engine)."""
        return cls(temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int32),
                   top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32),
                   seeds=np.zeros(rows, np.int64), counters=np.zeros(rows, np.int32))

    def __post_init__(self):
        if self.token_bitmask is not None and self.late_token_bitmask is not None:
            raise ValueError("late_token_bitmask: expected None with a token_bitmask given (one or the other)")

    def with_token_bitmask(self) -> "SamplingBatch":
        """This batch with its late token bitmask filled (``late_token_bitmask()`` called now, once);
        itself when the mask is given or there is none."""
        if self.late_token_bitmask is None:
            return self
        return dataclasses.replace(self, token_bitmask=self.late_token_bitmask(), late_token_bitmask=None)

    @property
    def has_penalties(self) -> bool:
        return self.prompt_ids is not None

    def penalties(self) -> dict:
        """The sampling op's penalty keyword arguments (empty without penalties)."""
        if not self.has_penalties:
            return {}
        return dict(repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, prompt_ids=self.prompt_ids,
                    output_ids=self.output_ids)


@dataclasses.dataclass(frozen=True, eq=False)
class SampleResult:
    """What a step returns to the engine (numpy, one entry per logits row).

    tokens [L] int32; logprobs [L] float32 (the sampled token's raw logprob; with a token
    bitmask, over the allowed tokens' logits, as top_logprobs and ranks);
    with ``num_logprobs = N`` asked: top_ids [L, N] int32 and top_logprobs [L, N]
    float32 (most likely first, ties to the lower id) and ranks [L] int32 (the
    sampled token's rank, 1 = most likely).
    With ``prompt_targets`` (P rows: the logits of ``step.prompt_logits_indices``, raw
    log-softmax, no bitmask): prompt_logprobs [P] float32 and prompt_ranks [P] int32 of the
    targets, prompt_top_ids / prompt_top_logprobs [P, num_prompt_logprobs] as above.
    """
    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: Optional[np.ndarray] = None
    top_logprobs: Optional[np.ndarray] = None
    ranks: Optional[np.ndarray] = None
    prompt_logprobs: Optional[np.ndarray] = None
    prompt_ranks: Optional[np.ndarray] = None
    prompt_top_ids: Optional[np.ndarray] = None
    prompt_top_logprobs: Optional[np.ndarray] = None


class Runner(Protocol):
    """A framework's model runner (see the module docstring)."""

    buckets: StepBuckets
    scheduler_config: SchedulerConfig
    on_gpu: bool

    def submit(self, step: Step, sampling: SamplingBatch, previous: Any = None) -> Any: ...

    def result(self, handle: Any) -> SampleResult: ...

    def execute(self, step: Step, sampling: SamplingBatch) -> SampleResult: ...

    def warm_up(self, builder: StepBuilder) -> dict: ...

    def propose(self, work: DraftPass) -> np.ndarray: ...

    def close(self) -> None: ...


class SynchronousRunner:
    """A base for runners (stand-ins in tests) whose steps are done when ``execute`` returns: ``submit``
    runs the step (its late token bitmask filled first), ``result`` hands its outputs back. No carried
    tokens: not for async scheduling."""

    def submit(self, step: Step, sampling: SamplingBatch, previous: Any = None) -> SampleResult:
        if step.carry_from is not None:
            raise ValueError("step.carry_from: this runner takes every token id from the host "
                             "(expected async_scheduling=False)")
        return self.execute(step, sampling.with_token_bitmask())

    def result(self, handle: SampleResult) -> SampleResult:
        return handle
