"""Continuous batching over the flat sub-page pool: which tokens run in each step.

The engine (``m3_engine.engine.LLMEngine``) drives one loop::

    scheduler = Scheduler(SchedulerConfig(max_batch=8, max_context=4096, num_slots=256), model_config)
    ids = scheduler.add_requests(prompts, max_new_tokens=16)   # validates everything first
    while scheduler.has_unfinished():
        step = scheduler.schedule()                  # one step's rows, built into arrays (m3_engine.step_inputs)
        logits = model(step)                         # [len(step.logits_indices), vocab]: framework code
        scheduler.update(step, sample(logits))       # one new token per logits row
    outputs = [scheduler.output(i) for i in ids]     # the new tokens of each request

A step's effect on the cache is applied when it is scheduled: the rows'
``num_cached`` move past its tokens, and each row that samples has one token
in flight (``Request.num_inflight``) until :meth:`update` brings it. So
**the next step can be scheduled before the last one's tokens are back**
(async scheduling, ``m3_engine.engine_core``): a request whose token is in
flight runs its next generation row with that token taken on the device from
the previous step's output (``Step.carry_from``); a request that the in-flight
token ends by length is not scheduled; one that it ends by a stop token (or an
abort while the step runs) has its row's token discarded by :meth:`update`,
its last cache position given back before its slots are freed. Not with
speculative decoding (a verify row's advance depends on its tokens).

Policy (vLLM-like, deterministic):

* **Slots**: a request reserves, when admitted, the pool slots (pages of 128
  tokens) its KV cache can ever need, ``ceil(min(len(prompt) + max_new_tokens - 1,
  max_context) / 128)``, and frees them when it finishes; later requests reuse
  them (lowest free slot first). No preemption: a request waits in FCFS order
  until its slots are free. A pool that cannot hold ONE request of
  ``max_context`` tokens is an error at construction.
* **Steps**: each step has at most ``max_batch`` rows and ``max_num_tokens``
  query tokens. Generation requests (prompt done) take one token each first,
  then requests in prefill continue (FCFS), then waiting requests are admitted,
  each prefill row taking a chunk of at most ``prefill_chunk`` tokens of what
  the budget leaves. Context rows come first, generation rows last, as
  ``planner.StepPlanner`` wants.
* **Speculative decoding** (``speculative``, ``m3_engine.speculative``): when
  a step speculates, each generation request with room for ``k`` more cache
  positions takes ``k + 1`` tokens (its last token and its drafts, padded),
  every one of them sampled; :meth:`update` keeps the accepted drafts and the
  token after them, and the cached length moves past the accepted ones only.
  A request without that room runs one token as a context row. With an
  EAGLE-3 draft model (method "eagle3") the drafts are the ones the draft
  model made after the previous step: :meth:`draft_pass` says what it runs
  after each step (every step, prefill chunks included), :meth:`set_drafts`
  takes its tokens back; with prefix caching the last cached block of a
  prompt is recomputed (as vLLM does: the draft's row at a block's last
  position depends on the token after the block).
* **Padding**: not decided here: the step builder (``m3_engine.step_inputs``)
  pads each step by the engine's one policy (``m3_engine.buckets``).
* **Stops**: a request finishes at one of its stop token ids or (unless it
  ignores them) the config's eos ids (kept in its output), after
  ``max_new_tokens`` tokens, or when its KV cache is full (``len(prompt) +
  len(output) - 1 == max_context``: the next token would need position
  ``max_context``); the engine ends requests early with :meth:`finish_request`
  (stop strings, aborts).

Bad input (empty prompt, a prompt longer than ``max_context``, a token id
outside ``[0, vocab_size)``, ``max_new_tokens < 1``) raises ``ValueError``
in :meth:`Scheduler.add_requests` before any request is queued.

Framework-neutral: pure Python and numpy; every array is int32.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import numpy as np

from .block_manager import BlockManager, block_hashes
from .model_config import M3TextConfig
from .speculative import SpeculationGate, SpeculativeConfig, ngram_draft, num_accepted
from .buckets import StepBuckets
from .step_inputs import Step, StepBuilder
from m3_kernels.planner import PAGE_SIZE, StepConfig

__all__ = ["SchedulerConfig", "Scheduler", "DraftPass", "Request", "DEFAULT_MAX_CONTEXT",
           "default_graph_batch_sizes"]

DEFAULT_MAX_CONTEXT = 8192   # an engine's max_context when none is given (capped by the model's positions)


def default_graph_batch_sizes(max_batch: int) -> tuple:
    """1, 2, 4, 8, then multiples of 16 up to ``max_batch`` (and ``max_batch`` itself)."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch} | set(range(16, max_batch + 1, 16)) | {max_batch}
    return tuple(sorted(sizes))


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Engine limits, fixed at start-up.

    max_batch:         rows per step (padding rows not counted: ``m3_engine.buckets``).
    max_context:       KV tokens per request (prompt + generated tokens in the cache).
    num_slots:         pool slots (pages of 128 tokens); >= ceil(max_context / 128).
    max_num_tokens:    query tokens per step (padding tokens not counted); default
                       ``max(2048, max_batch)``.
    prefill_chunk:     prompt tokens per request per step; default ``max_num_tokens``.
    graph_batch_sizes: batch sizes pure generation steps are padded to where the runner
                       pads them (``StepBuckets.decode_batch_sizes``; sorted on
                       construction; each <= max_batch).
    enable_prefix_caching: reuse the cached full blocks of earlier requests'
                       tokens (``m3_engine.block_manager``).
    """
    max_batch: int
    max_context: int
    num_slots: int
    max_num_tokens: int | None = None
    prefill_chunk: int | None = None
    graph_batch_sizes: tuple[int, ...] = ()
    enable_prefix_caching: bool = False

    @classmethod
    def from_engine_args(cls, config: M3TextConfig, *, max_num_seqs, max_model_len, num_gpu_blocks_override,
                         max_num_batched_tokens=None, prefill_chunk=None, graph_batch_sizes=None,
                         enable_prefix_caching=False) -> "SchedulerConfig":
        """The limits of an engine from the keyword arguments both ``LLM`` classes take (vLLM's names).

        max_model_len None: ``min(DEFAULT_MAX_CONTEXT, max_position_embeddings)``; more
        than the model's positions is an error. num_gpu_blocks_override None: ``max_num_seqs``
        requests of ``max_model_len`` tokens; fewer pages than one such request is an
        error. graph_batch_sizes None: :func:`default_graph_batch_sizes` up to the smaller of
        ``max_num_seqs`` and ``max_num_batched_tokens``.
        """
        max_batch = _int("max_num_seqs", max_num_seqs)
        max_context = min(DEFAULT_MAX_CONTEXT, config.max_position_embeddings) if max_model_len is None else \
            _int("max_model_len", max_model_len)
        if max_context > config.max_position_embeddings:
            raise ValueError(f"max_model_len: expected <= max_position_embeddings={config.max_position_embeddings} "
                             f"of the model, got {max_context}")
        max_blocks = -(-max_context // PAGE_SIZE)
        num_slots = max_batch * max_blocks if num_gpu_blocks_override is None else \
            _int("num_gpu_blocks_override", num_gpu_blocks_override)
        if num_slots < max_blocks:
            raise ValueError(f"num_gpu_blocks_override={num_slots} cannot hold one request of max_model_len="
                             f"{max_context} tokens: it needs {max_blocks} pages of {PAGE_SIZE} tokens")
        if max_num_batched_tokens is not None:
            _int("max_num_batched_tokens", max_num_batched_tokens)
        if graph_batch_sizes is None:   # a step runs at most max_num_batched_tokens generation rows
            graph_batch_sizes = default_graph_batch_sizes(
                max_batch if max_num_batched_tokens is None else min(max_batch, max_num_batched_tokens))
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching: expected a bool, got {enable_prefix_caching!r}")
        return cls(max_batch=max_batch, max_context=max_context, num_slots=num_slots,
                   max_num_tokens=max_num_batched_tokens, prefill_chunk=prefill_chunk,
                   graph_batch_sizes=tuple(graph_batch_sizes), enable_prefix_caching=enable_prefix_caching)

    def __post_init__(self):
        if self.max_num_tokens is None:
            object.__setattr__(self, "max_num_tokens", max(2048, _int("max_batch", self.max_batch)))
        if self.prefill_chunk is None:
            object.__setattr__(self, "prefill_chunk", self.max_num_tokens)
        for name in ("max_batch", "max_context", "num_slots", "max_num_tokens", "prefill_chunk"):
            _int(name, getattr(self, name))
        sizes = tuple(sorted({_int("graph_batch_sizes", v) for v in self.graph_batch_sizes}))
        object.__setattr__(self, "graph_batch_sizes", sizes)
        if self.max_blocks > self.num_slots:
            raise ValueError(f"num_slots={self.num_slots} is too small for one request of max_context="
                             f"{self.max_context} tokens: it needs {self.max_blocks} slots of {PAGE_SIZE} tokens")
        if self.graph_batch_sizes and self.graph_batch_sizes[-1] > min(self.max_batch, self.max_num_tokens):
            raise ValueError(f"graph_batch_sizes: expected sizes <= max_num_seqs={self.max_batch} and <= "
                             f"max_num_batched_tokens={self.max_num_tokens}, got {self.graph_batch_sizes}")

    @property
    def max_blocks(self) -> int:
        """Columns of the block table: ``ceil(max_context / 128)``."""
        return -(-self.max_context // PAGE_SIZE)


@dataclasses.dataclass(eq=False)
class Request:
    """One prompt in flight. ``output`` grows by one token per sampled step."""
    id: int
    prompt: np.ndarray                  # [len] int32, read-only
    max_new_tokens: int
    stop_token_ids: frozenset = frozenset()   # end the request (besides the model's eos ids)
    ignore_eos: bool = False            # the model's eos ids do not end it
    prompt_logprobs: bool = False       # every prompt position's logits are returned (no prefix cache)
    output: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0                 # tokens whose K/V are in the cache
    slots: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))  # int32, reserved at admission
    table_row: np.ndarray | None = None  # [max_blocks] int32: slots, then -1; built once at admission
    block_hashes: list = dataclasses.field(default_factory=list)  # of its full blocks (prefix caching)
    num_registered: int = 0             # full blocks registered in the prefix cache
    finish_reason: str | None = None    # None (running) | "stop" (eos, stop token or string) | "length" | "abort"
    stop_reason: int | None = None      # the stop token id that ended it (None for eos)
    emitted: tuple = ()                 # the tokens the last update() appended (more than one after a verify)
    emitted_row: int = 0                # the logits row (of that step) of the first of them
    num_inflight: int = 0               # tokens sampled by scheduled steps, not yet given to update()
    inflight_row: int = 0               # the logits row of the last scheduled step that samples its next token
    prefix_hit_tokens: int = 0          # prompt tokens served by the prefix cache at admission
    gate: SpeculationGate = dataclasses.field(default_factory=SpeculationGate)
    spec_draft_tokens: int = 0          # drafts proposed (speculative decoding)
    spec_accepted_tokens: int = 0       # drafts accepted
    spec_verify_steps: int = 0          # steps in which it verified drafts
    spec_draft_time: float = 0.0        # seconds spent proposing its drafts
    # eagle3: the drafts the last draft pass made for its next tokens (empty: none)
    draft_tokens: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))

    _sequence: np.ndarray | None = dataclasses.field(default=None, repr=False)   # tokens() buffer
    _filled: int = 0

    def tokens(self) -> np.ndarray:
        """Prompt + output so far, int32 (a view of a buffer that grows with the output: no copy of
        the prompt per step)."""
        n = self.num_tokens
        if self._sequence is None or len(self._sequence) < n:
            buffer = np.empty(max(2 * n, len(self.prompt) + self.max_new_tokens), np.int32)
            buffer[:len(self.prompt)] = self.prompt
            self._sequence, self._filled = buffer, len(self.prompt)
        if self._filled < n:
            self._sequence[self._filled:n] = self.output[self._filled - len(self.prompt):]
            self._filled = n
        return self._sequence[:n]

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens (the ones update() brought)."""
        return len(self.prompt) + len(self.output)

    @property
    def num_generated(self) -> int:
        """Generated tokens, those still in flight included."""
        return len(self.output) + self.num_inflight

    @property
    def prefilled(self) -> bool:
        """True once the whole prompt is in the cache (the request then generates one token per step)."""
        return self.num_cached >= len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True, eq=False)
class DraftPass:
    """What an EAGLE-3 draft model runs after a step (:meth:`Scheduler.draft_pass`): a first pass
    over the step's token rows, then ``k - 1`` one-token steps for the ``n`` requests that draft.
    int32 numpy arrays.

    step:          the target step: the first pass runs its rows with its positions, slot
                   mapping, block table and lengths, and the target's aux hidden states.
    input_ids:     [T] the first pass's tokens: the row at position ``p`` takes the token at
                   ``p + 1`` (the next prompt token, or the token sampled at that row; 0 for padding).
    request_ids:   [n] the requests that draft (scheduler ids).
    rows:          [n] each one's token row in the step at its last valid position (the last
                   token of a row, or ``p + accepted`` of a verify row): its ``h_out`` gives draft 1.
    positions:     [k - 1, n] position of chain step ``i`` (= the request's cached length + i).
    slot_mapping:  [k - 1, n] the cache rows chain step ``i`` writes.
    seq_lens:      [k - 1, n] KV lengths of chain step ``i`` (its position + 1).
    block_table:   [n, max_blocks] the requests' block-table rows.
    """
    step: Step
    input_ids: np.ndarray
    request_ids: np.ndarray
    rows: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)


class Scheduler:
    """Requests, slots and step metadata for one engine (see the module docstring).

    config: the engine limits.
    model:  the model config (heads, topk, vocabulary, eos ids).
    builder: the ``m3_engine.step_inputs.StepBuilder`` that turns each step's rows into
             its arrays and plan; default: all heads on one rank, pure generation steps
             padded to ``config.graph_batch_sizes``, steps with context rows not padded.
    speculative: a ``SpeculativeConfig`` (``m3_engine.speculative``): generation rows
             verify drafts when a step speculates; None: never.
    """

    def __init__(self, config: SchedulerConfig, model: M3TextConfig, *, builder: StepBuilder | None = None,
                 speculative: SpeculativeConfig | None = None):
        self.config = config
        self.speculative = speculative
        self.num_speculative_tokens = speculative.num_speculative_tokens if speculative is not None else 0
        self.eagle3 = speculative is not None and speculative.method == "eagle3"   # drafts from draft_pass()
        # totals since start-up: steps with a verify row, rows that verified drafts, draft tokens proposed
        # and accepted, seconds spent proposing
        self.spec_stats = {"spec_verify_steps": 0, "spec_drafts": 0, "spec_draft_tokens": 0,
                           "spec_accepted_tokens": 0, "spec_draft_time_s": 0.0}
        self.num_steps = 0   # steps updated so far (speculation's probes go by it)
        self.vocab_size = model.vocab_size
        self.eos_token_ids = frozenset(model.eos_token_ids)
        self.builder = builder or StepBuilder(
            StepBuckets.from_config(config, speculative, pad_prefill=False, pad_decode=True),
            StepConfig(num_q_heads=model.num_attention_heads, num_kv_heads=model.num_key_value_heads,
                       head_dim=model.head_dim, max_batch=config.max_batch, max_num_tokens=config.max_num_tokens,
                       max_blocks=config.max_blocks, topk=model.index_topk_blocks))
        self.requests: dict[int, Request] = {}
        self._waiting: list[Request] = []   # FCFS, not admitted
        self._running: list[Request] = []   # admitted, in admission order
        self.blocks = BlockManager(config.num_slots, config.enable_prefix_caching)
        self._next_id = 0
        self._in_flight: list[Step] = []   # scheduled, not yet updated (oldest first; two at most)

    # -- requests ------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], max_new_tokens: Optional[int], *, stop_token_ids: Sequence[int] = (),
                    ignore_eos: bool = False, prompt_logprobs: bool = False) -> int:
        """Queue one prompt (token ids); -> its request id. ``ValueError`` for an empty prompt,
        one longer than ``max_context``, a token id outside ``[0, vocab_size)`` or
        ``max_new_tokens < 1``; ``TypeError`` for a prompt that is not a sequence of ints.
        ``max_new_tokens`` None: up to the end of the context (``max_context`` - the prompt's length).
        ``prompt_logprobs``: its steps return the logits of every prompt position
        (``Step.prompt_logits_indices``), so its whole prompt is computed (no prefix cache)."""
        if max_new_tokens is not None:
            _check_budget(max_new_tokens)
        prompt = self._check_prompt("prompt", prompt)
        if max_new_tokens is None:   # the rest of the context (at least one token)
            max_new_tokens = max(self.config.max_context - len(prompt), 1)
        return self._queue(prompt, max_new_tokens, stop_token_ids, ignore_eos, prompt_logprobs)

    def add_requests(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[int]:
        """Queue prompts (lists of token ids) with one budget; -> their request ids, in order.
        Every prompt is checked (as in :meth:`add_request`) before any is queued."""
        _check_budget(max_new_tokens)
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts: expected a list of token-id lists, got {type(prompts).__name__}")
        checked = [self._check_prompt(f"prompts[{i}]", p) for i, p in enumerate(prompts)]
        return [self._queue(prompt, max_new_tokens, (), False, False) for prompt in checked]

    def _queue(self, prompt: np.ndarray, max_new_tokens: int, stop_token_ids, ignore_eos, prompt_logprobs) -> int:
        request = Request(self._next_id, prompt, int(max_new_tokens), frozenset(map(int, stop_token_ids)),
                          bool(ignore_eos), bool(prompt_logprobs))
        self._next_id += 1
        self.requests[request.id] = request
        self._waiting.append(request)
        return request.id

    def _check_prompt(self, name: str, prompt) -> np.ndarray:
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (Sequence, np.ndarray)):
            raise TypeError(f"{name}: expected a list of token ids, got {type(prompt).__name__}")
        arr = np.asarray(prompt)
        if arr.ndim != 1:
            raise ValueError(f"{name}: expected a 1-D list of token ids, got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError(f"{name}: empty prompt (expected at least one token id)")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name}: expected integer token ids, got {arr.dtype} values")
        if arr.size > self.config.max_context:
            raise ValueError(f"{name}: {arr.size} tokens, longer than max_model_len={self.config.max_context} "
                             f"(the engine's KV tokens per request)")
        bad = np.flatnonzero((arr < 0) | (arr >= self.vocab_size))
        if bad.size:
            j = int(bad[0])
            raise ValueError(f"{name}[{j}]: token id {int(arr[j])} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        arr = arr.astype(np.int32)
        arr.flags.writeable = False
        return arr

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def finish_request(self, request_id: int, reason: str) -> None:
        """End a request now (a stop string, an abort): it leaves the queue or frees its slots. While
        a step that runs it is in flight, its slots are freed too: steps run in order on the device,
        so a later step that reuses them writes after that one; :meth:`update` discards its token."""
        r = self.requests[request_id]
        if r.finished:
            return
        r.finish_reason = reason
        if r in self._waiting:
            self._waiting.remove(r)
        else:
            self._finish(r)

    def cancel(self, step: Step) -> None:
        """Forget a scheduled step whose model run failed: what scheduling it applied is undone. Cancel
        the newest in-flight step first."""
        if not self._in_flight or step is not self._in_flight[-1]:
            raise ValueError("cancel: expected the last step schedule() returned that is not updated yet")
        self._in_flight.pop()
        for (r, q), count in zip(step.rows, step.num_logits.tolist()):
            if count <= 1:
                r.num_cached -= q
            if count == 1:
                r.num_inflight -= 1

    def output(self, request_id: int) -> list[int]:
        """The tokens generated so far for a request (all of them once it finished)."""
        return list(self.requests[request_id].output)

    def forget(self, request_id: int) -> list[int]:
        """A finished request's tokens; the scheduler forgets the request (its slots went back when
        it finished). The engine calls this once it has handed out the request's last output."""
        r = self.requests[request_id]
        if not r.finished:
            raise ValueError(f"forget: request {request_id} has not finished")
        del self.requests[request_id]
        return r.output

    @property
    def num_free_slots(self) -> int:
        """Slots no request holds (prefix caching: cached blocks nobody holds included)."""
        return self.blocks.num_available

    # -- steps ---------------------------------------------------------------------

    def schedule(self) -> Step | None:
        """The next step. It may be scheduled while the previous one is in flight (not given to
        :meth:`update` yet; not with speculative decoding): -> None when no row can run before that
        step's tokens are back (the requests left end with them, or wait for their slots)."""
        if len(self._in_flight) > 1 or (self._in_flight and self.speculative is not None):
            raise RuntimeError("schedule: the previous step has not been given to update() yet")
        if not self.has_unfinished():
            raise RuntimeError("schedule: no unfinished requests")
        cfg = self.config
        tokens_left = cfg.max_num_tokens
        rows_left = cfg.max_batch
        generation, context = [], []  # [(request, q_len)]
        drafts = {}                   # request id -> the drafts it verifies this step

        candidates = [r for r in self._running if r.prefilled and not self._ends_by_length(r)]
        candidates = candidates[:min(rows_left, tokens_left)]
        if self.num_speculative_tokens:
            drafts = self._propose(candidates, tokens_left)
        k = self.num_speculative_tokens
        for r in candidates:
            if not drafts:
                generation.append((r, 1))
            elif r.id in drafts:
                generation.append((r, k + 1))
            else:   # no room for k more positions: one token, as a context row (prefill kernels take it)
                context.append((r, 1))
            rows_left, tokens_left = rows_left - 1, tokens_left - (k + 1 if r.id in drafts else 1)
        for r in self._running:
            if not r.prefilled and rows_left and tokens_left:
                q = min(len(r.prompt) - r.num_cached, cfg.prefill_chunk, tokens_left)
                context.append((r, q))
                rows_left, tokens_left = rows_left - 1, tokens_left - q
        while self._waiting and rows_left and tokens_left:
            r = self._waiting[0]
            hits = self._cached_prefix(r)
            num_new = self._slots_needed(r) - len(hits)
            if not self.blocks.can_admit(hits, num_new):
                break
            self._waiting.pop(0)
            r.slots = self.blocks.admit(hits, num_new, len(r.prompt))
            r.table_row = np.full(cfg.max_blocks, -1, np.int32)
            r.table_row[:len(r.slots)] = r.slots
            r.num_cached, r.num_registered = len(hits) * PAGE_SIZE, len(hits)   # prefill starts after the hits
            r.prefix_hit_tokens = r.num_cached
            self._running.append(r)
            q = min(len(r.prompt) - r.num_cached, cfg.prefill_chunk, tokens_left)
            context.append((r, q))
            rows_left, tokens_left = rows_left - 1, tokens_left - q
        if not generation and not context:
            if self._in_flight:
                return None
            raise RuntimeError("schedule: nothing fits in a step (this is a bug)")   # construction guarantees one
        step = self.builder.build(context + generation, len(context), drafts)
        self._advance(step)
        self._in_flight.append(step)
        return step

    def _advance(self, step: Step) -> None:
        """What ``step`` does whatever its tokens: its rows' tokens are in the cache, and each row that
        samples (a verify row excepted: its advance depends on the drafts accepted) has one token in
        flight, at its logits row."""
        row = 0
        for (r, q), count in zip(step.rows, step.num_logits.tolist()):
            if count <= 1:
                r.num_cached += q
            if count == 1:
                r.num_inflight += 1
                r.inflight_row = row
            row += count

    def _ends_by_length(self, r: Request) -> bool:
        """The tokens in flight for ``r`` end it by length (``max_new_tokens``, or a full cache)."""
        return r.num_generated >= r.max_new_tokens or len(r.prompt) + r.num_generated - 1 >= self.config.max_context

    def _propose(self, candidates: list, tokens_left: int) -> dict:
        """The drafts of a step that speculates: request id -> drafts (possibly empty) for every
        candidate with room for ``k`` more positions; ``{}`` when the step does not speculate (too
        many rows, no room in the token budget, or no request has a draft)."""
        spec, k = self.speculative, self.num_speculative_tokens
        if len(candidates) > spec.disable_by_batch_size or len(candidates) * (k + 1) > tokens_left:
            return {}
        drafts, any_draft = {}, False
        for r in candidates:
            if not self._has_room(r):
                continue
            useful = min(k, r.max_new_tokens - len(r.output) - 1)   # a verify emits up to drafts + 1 tokens
            d = np.zeros(0, np.int32)
            if useful > 0 and r.gate.wants_drafts(self.num_steps):
                if self.eagle3:   # the draft model's, made after the last step (and timed there)
                    d = r.draft_tokens[:useful]
                else:
                    start = time.perf_counter()
                    d = ngram_draft(r.tokens(), useful, spec.prompt_lookup_min, spec.prompt_lookup_max)
                    seconds = time.perf_counter() - start
                    r.spec_draft_time += seconds
                    self.spec_stats["spec_draft_time_s"] += seconds
            drafts[r.id] = d
            any_draft |= len(d) > 0
        return drafts if any_draft else {}

    def _cached_prefix(self, r: Request) -> list:
        """The cached slots of ``r``'s longest cached prompt prefix, in whole blocks before the block
        of its last prompt token (that one is always computed: its logits start the generation)."""
        if not self.blocks.caching or r.prompt_logprobs:
            return []
        usable = (len(r.prompt) - 1) // PAGE_SIZE
        r.block_hashes = block_hashes(r.prompt, usable, r.block_hashes)
        hits = self.blocks.match(r.block_hashes[:usable])
        if self.eagle3:   # the draft's K/V row at a block's last position took the NEXT block's first token,
            return hits[:-1]   # which this prompt may not share: recompute the last hit block (vLLM does too)
        return hits

    def _register_full_blocks(self, r: Request) -> None:
        """Offer ``r``'s blocks whose K/V rows are all in the cache now to the prefix cache."""
        full = min(r.num_cached, r.num_tokens) // PAGE_SIZE   # blocks whose tokens are known, too
        if not self.blocks.caching or full <= r.num_registered:
            return
        tokens = r.prompt if full * PAGE_SIZE <= len(r.prompt) else \
            np.concatenate([r.prompt, np.asarray(r.output, np.int32)])
        r.block_hashes = block_hashes(tokens, full, r.block_hashes)
        for b in range(r.num_registered, full):
            self.blocks.register(int(r.slots[b]), r.block_hashes[b])
        r.num_registered = full

    def _has_room(self, r: Request) -> bool:
        """``r`` owns the cache positions a verify step writes: ``num_cached .. num_cached + k``."""
        return r.num_cached + self.num_speculative_tokens < min(len(r.slots) * PAGE_SIZE, self.config.max_context)

    def _slots_needed(self, r: Request) -> int:
        # speculative decoding writes up to k draft positions past the last token that is kept (an EAGLE-3
        # draft's chain writes its own K/V at positions num_cached .. num_cached + k - 2: fewer)
        cache_tokens = min(len(r.prompt) + r.max_new_tokens - 1 + self.num_speculative_tokens,
                           self.config.max_context)
        return -(-cache_tokens // PAGE_SIZE)

    def update(self, step: Step, next_tokens: Sequence[int]) -> list[int]:
        """Feed back the tokens sampled from ``step``'s logits rows (``[L]`` ints, in
        ``step.logits_indices`` order); ``step`` is the oldest scheduled step not updated yet.
        -> ids of the requests that finished (their slots are free again). Each request
        that sampled gets its new tokens in ``output`` and, for this step only, in
        ``emitted`` (one token; after a verify, the accepted drafts and one more, cut after
        a stop). A request that ended while the step was in flight gets nothing."""
        if not self._in_flight or step is not self._in_flight[0]:
            raise ValueError("update: expected the oldest step schedule() returned that is not updated yet")
        tokens = np.asarray(next_tokens).reshape(-1)
        if tokens.shape[0] != len(step.logits_indices):
            raise ValueError(f"next_tokens: expected {len(step.logits_indices)} tokens (one per logits row), "
                             f"got {tokens.shape[0]}")
        self._in_flight.pop(0)
        self.num_steps += 1
        tokens = tokens.tolist()
        finished, row = [], 0
        for (r, q), count, drafts in zip(step.rows, step.num_logits.tolist(), step.drafts):
            first, row = row, row + count
            if r.finished:   # ended (a stop token of the step before, an abort) while this step ran
                continue
            if not count:   # a prefill chunk that does not end its prompt
                self._register_full_blocks(r)
                continue
            sampled, r.emitted_row = tokens[first:row], first
            if self.eagle3:
                r.draft_tokens = r.draft_tokens[:0]   # made for the tokens before this step's
            if count > 1:   # a verify row: drafts (maybe none) then padding
                accepted = num_accepted(drafts, sampled)
                new, r.num_cached = sampled[:accepted + 1], r.num_cached + 1 + accepted
                if drafts:
                    r.spec_verify_steps += 1
                    r.spec_draft_tokens += len(drafts)
                    r.spec_accepted_tokens += accepted
                    self.spec_stats["spec_drafts"] += 1
                    self.spec_stats["spec_draft_tokens"] += len(drafts)
                    self.spec_stats["spec_accepted_tokens"] += accepted
                    r.gate.record(len(drafts), accepted)
            else:
                new = sampled[:1]
                r.num_inflight -= 1
            start = len(r.output)
            for token in new:
                if self._append(r, int(token)):
                    break
            r.emitted = tuple(r.output[start:])
            if r.finished:   # K/V rows past its last token (a stop inside an accepted run, or written by the
                r.num_cached = min(r.num_cached, r.num_tokens - 1)   # step in flight after this one) are dropped
                r.num_inflight = 0   # the token the step in flight samples for it is discarded
            self._register_full_blocks(r)
            if r.finished:
                self._finish(r)
                finished.append(r.id)
        self.spec_stats["spec_verify_steps"] += step.num_verify_rows > 0
        return finished

    def draft_pass(self, step: Step, next_tokens: Sequence[int]) -> DraftPass:
        """EAGLE-3: what the draft model runs after ``step`` (call after :meth:`update` with the same
        tokens, and after any request it ended was finished): the first pass over every token row of
        the step, and a chain for each request that may verify drafts in the next step (it has the
        room and the token budget left, and its acceptance gate lets it draft; none when the next step
        cannot speculate: more rows than ``disable_by_batch_size`` or ``k + 1`` tokens a row over
        ``max_num_tokens``)."""
        if not self.eagle3:
            raise RuntimeError("draft_pass: the engine has no EAGLE-3 draft model")
        k, cu = self.num_speculative_tokens, step.cu_seqlens_q
        ids = np.zeros(step.num_tokens, np.int32)
        ids[:-1] = step.input_ids[1:]        # the next token of the row (each row's last token: below)
        ids[step.slot_mapping < 0] = 0       # padding tokens
        drafting = []                        # (request, its last valid token row)
        for (r, q), row, count in zip(step.rows, step.row_index.tolist(), step.num_logits.tolist()):
            if not count:   # a prompt chunk that does not end the prompt: the next chunk's first token
                ids[cu[row] + q - 1] = r.prompt[r.num_cached]
            elif (not r.finished and self._has_room(r) and len(r.output) + 1 < r.max_new_tokens
                  and r.gate.wants_drafts(self.num_steps)):   # the next step's _propose asks the same
                drafting.append((r, int(step.logits_indices[r.emitted_row + len(r.emitted) - 1])))
        ids[step.logits_indices] = np.asarray(next_tokens, np.int32).reshape(-1)   # the token sampled there
        n = len(drafting)
        if n > self.speculative.disable_by_batch_size or n * (k + 1) > self.config.max_num_tokens:
            drafting, n = [], 0
        table = np.array([r.table_row for r, _ in drafting], np.int32).reshape(n, self.config.max_blocks)
        positions = np.array([r.num_cached for r, _ in drafting], np.int32)[None, :] + \
            np.arange(k - 1, dtype=np.int32)[:, None]
        slots = table[np.arange(n)[None, :], positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        return DraftPass(step=step, input_ids=ids, request_ids=np.array([r.id for r, _ in drafting], np.int32),
                         rows=np.array([row for _, row in drafting], np.int32), positions=positions,
                         slot_mapping=slots.astype(np.int32), seq_lens=positions + 1, block_table=table)

    def set_drafts(self, work: DraftPass, drafts, seconds: float) -> None:
        """EAGLE-3: the draft tokens ``[n, k]`` the draft model made for ``work``'s requests (the next
        step verifies them), and the seconds the whole pass took (shared by those requests)."""
        drafts = np.asarray(drafts, np.int32)
        if drafts.shape != (work.num_requests, self.num_speculative_tokens):
            raise ValueError(f"drafts: expected shape {(work.num_requests, self.num_speculative_tokens)}, "
                             f"got {drafts.shape}")
        for request_id, d in zip(work.request_ids.tolist(), drafts):
            r = self.requests[request_id]
            r.draft_tokens = d
            r.spec_draft_time += seconds / work.num_requests
        self.spec_stats["spec_draft_time_s"] += seconds

    def _append(self, r: Request, token: int) -> bool:
        """Append one sampled token; -> True when it ends the request (``finish_reason`` set)."""
        r.output.append(token)
        if token in r.stop_token_ids:
            r.finish_reason, r.stop_reason = "stop", token
        elif token in self.eos_token_ids and not r.ignore_eos:
            r.finish_reason = "stop"
        elif len(r.output) >= r.max_new_tokens or r.num_tokens - 1 >= self.config.max_context:
            r.finish_reason = "length"
        return r.finished

    def _finish(self, r: Request):
        self._running.remove(r)
        self.blocks.release(r.slots.tolist())
        r.slots, r.table_row = r.slots[:0], None


def _check_budget(max_new_tokens) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise TypeError(f"max_new_tokens: expected an int, got {type(max_new_tokens).__name__}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")


def _int(name, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return int(value)
