"""A step's inputs, built once: the scheduler's rows -> padded numpy arrays and the planner's plan.

The scheduler (``m3_engine.scheduler``) decides a step: which requests run,
how many query tokens each, which drafts a verify row checks.
:meth:`StepBuilder.build` turns that decision into the :class:`Step` every
runner consumes as it is: token ids, positions, slot mapping, block table,
lengths and logits rows, padded by the engine's one padding policy
(``m3_engine.buckets.StepBuckets``), and the ``planner.StepPlan`` of the padded
step, planned here and nowhere else.

Row layout of a step (padding only where the policy pads)::

    real context rows | padding context row (padding tokens) | empty context rows | generation rows | padding rows

Framework-neutral: pure Python and numpy; every array is int32.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from m3_kernels.planner import PAGE_SIZE, StepConfig, StepPlan, StepPlanner

from .buckets import StepBuckets

__all__ = ["Step", "StepBuilder", "prompt_logprob_positions"]


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """The host inputs of one step: rows ``[0, num_context)`` are context (prefill)
    rows, the rest generation rows, padding rows included (``m3_engine.buckets``).
    ``T = plan.num_tokens``, ``R = plan.num_rows``.

    input_ids:      [T] int32 token ids (0 for padding tokens).
    positions:      [T] int32 position of each token in its request (0 for padding).
    slot_mapping:   [T] int32 ``slot * 128 + offset`` where the token's K/V/index-K
                    go (``write_cache``); -1 for padding tokens.
    block_table:    [R, max_blocks] int32 slot ids per row; -1 past a row's slots
                    and in padding rows.
    seq_lens:       [R] int32 KV length per row, this step's tokens included (0: padding).
    cu_seqlens_q:   [R + 1] int32 query-token offsets of the rows.
    logits_indices: [L] int32 token rows whose logits are sampled, in row order: the
                    last token of each row that ends its prompt or generates; every
                    token of a verify row (speculative decoding).
    request_ids:    [L] int32 the request of each logits row.
    output_index:   [L] int32 how many tokens that request has generated before this
                    one (with ``request_ids``: a per-token key for seeded sampling
                    that does not depend on batching; a verify row's position ``j``
                    has the request's output length + ``j``).
    plan:           the ``planner.StepPlan`` of the padded step (spans, block bounds,
                    prefill maps).
    rows:           ``((request, q_len), ...)`` of the real rows, context rows first.
    row_index:      [real rows] int32 the row of each real row in the arrays.
    num_logits:     [real rows] int32 logits rows of each real row (0, 1, or ``k + 1``
                    for a verify row).
    drafts:         per real row, the draft tokens it verifies (empty: not a verify row).
    carry_from:     [T] int32 or None. Async scheduling: a generation row whose last token the
                    previous step samples (still in flight when this step is built) takes it on
                    the device: ``carry_from[t]`` is that token's logits row in the previous step,
                    -1 where ``input_ids[t]`` holds (its host value is 0 when carried). None: every
                    token id is on the host.
    num_prompt_tokens: prompt tokens the step computes (its prefill chunks).
    prompt_logits_indices: [P] int32 token rows whose logits give prompt logprobs (the
                    requests with ``prompt_logprobs``: :func:`prompt_logprob_positions`), in
                    row order; empty on other steps. A runner returns the logits of
                    :attr:`forward_logits_indices`.
    prompt_spans:   per row with prompt-logprob rows, ``(row, start, end)``: ``rows[row]``'s prompt
                    positions ``start .. end - 1`` whose logits those are, in
                    ``prompt_logits_indices`` order (taken when the step is built: scheduling it
                    moves the requests' ``num_cached`` on).
    """
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_table: np.ndarray
    seq_lens: np.ndarray
    cu_seqlens_q: np.ndarray
    logits_indices: np.ndarray
    request_ids: np.ndarray
    output_index: np.ndarray
    plan: StepPlan
    rows: tuple = dataclasses.field(repr=False, default=())
    row_index: np.ndarray = dataclasses.field(repr=False, default=None)
    num_logits: np.ndarray = dataclasses.field(repr=False, default=None)
    drafts: tuple = dataclasses.field(repr=False, default=())
    carry_from: np.ndarray | None = dataclasses.field(repr=False, default=None)
    num_prompt_tokens: int = 0
    prompt_logits_indices: np.ndarray = dataclasses.field(repr=False, default_factory=lambda: np.zeros(0, np.int32))
    prompt_spans: tuple = dataclasses.field(repr=False, default=())

    @property
    def forward_logits_indices(self) -> np.ndarray:
        """The token rows whose logits the model step computes: ``logits_indices`` (sampled), then
        ``prompt_logits_indices``."""
        if not len(self.prompt_logits_indices):
            return self.logits_indices
        return np.concatenate([self.logits_indices, self.prompt_logits_indices])

    @property
    def num_verify_rows(self) -> int:
        return sum(1 for d in self.drafts if len(d))

    @property
    def num_context(self) -> int:
        """Context rows (the row prefix), padding context rows included."""
        return self.plan.context.num_rows

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    @property
    def num_rows(self) -> int:
        return self.plan.num_rows

    @property
    def is_decode(self) -> bool:
        """Generation rows only (one token each, or ``k + 1`` when verifying): the step a CUDA graph /
        a compiled decode step replays."""
        return self.plan.context.num_rows == 0


class StepBuilder:
    """Builds each step's :class:`Step` from the scheduler's rows, padded by ``buckets`` and planned
    once by ``planner``, a ``StepPlanner`` of ``buckets.planner_config(step_config)`` (one rank's
    heads: every rank runs the plans made here)."""

    def __init__(self, buckets: StepBuckets, step_config: StepConfig):
        self.buckets = buckets
        self.planner = StepPlanner(buckets.planner_config(step_config))

    def build(self, rows: Sequence[tuple], num_context: int, drafts: dict) -> Step:
        """The step of ``rows`` (``(request, q_len)``, the ``num_context`` context rows first, then the
        generation rows, all with one query length), vectorised over rows (host time of a decode step
        at batch 64 and 1024 block-table columns, schedule + update: ~0.6 ms on a 2-core CI machine).
        ``drafts``: request id -> drafts, for the verify rows (each with ``k + 1`` tokens)."""
        n, n_ctx = len(rows), num_context
        q = np.array([k for _, k in rows], np.int64)
        cached = np.array([r.num_cached for r, _ in rows], np.int64)
        query_len = int(q[n_ctx]) if n > n_ctx else 0
        shape = self.buckets.shape(n_ctx, int(q[:n_ctx].sum()), n - n_ctx, query_len)
        R, T, max_blocks = shape.num_rows, shape.num_tokens, self.planner.config.max_blocks

        # rows: the real ones where the layout puts them; the padding context row takes the padding tokens
        row_index = np.concatenate([np.arange(n_ctx), shape.context_rows + np.arange(n - n_ctx)])
        q_lens = np.zeros(R, np.int64)
        q_lens[shape.context_rows + n - n_ctx:] = query_len
        q_lens[row_index] = q
        padding_tokens = shape.context_tokens - int(q[:n_ctx].sum())
        if padding_tokens:
            q_lens[n_ctx] = padding_tokens   # the padding context row
        cu = np.zeros(R + 1, np.int32)
        cu[1:] = np.cumsum(q_lens)
        seq_lens = np.zeros(R, np.int32)
        seq_lens[row_index] = cached + q
        block_table = np.full((R, max_blocks), -1, np.int32)
        block_table[row_index] = [r.table_row for r, _ in rows]
        plan = self.planner.plan(seq_lens, q_lens=q_lens, num_context=shape.context_rows)

        # every real token: its row, its index in the step, its position
        row_of = np.repeat(np.arange(n), q)
        local = np.arange(len(row_of)) - np.repeat(np.cumsum(q) - q, q)
        first = cu[row_index]   # each real row's first token
        token = first[row_of] + local
        pos = cached[row_of] + local
        input_ids = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slot_mapping = np.full(T, -1, np.int32)
        # generation rows: the token sampled last, on the device when it is still in flight (carry_from)
        input_ids[token] = np.concatenate([_verify_tokens(r, k, drafts[r.id]) if r.id in drafts else
                                           [0] if r.num_inflight else
                                           r.output[-1:] if r.prefilled else r.prompt[r.num_cached:r.num_cached + k]
                                           for r, k in rows])
        carried = np.array([r.num_inflight > 0 for r, _ in rows], bool)
        carry_from = None
        if carried.any():   # a carried row has one token: its first
            carry_from = np.full(T, -1, np.int32)
            carry_from[first[carried]] = [r.inflight_row for r, _ in rows if r.num_inflight]
        positions[token] = pos
        slot_mapping[token] = block_table[row_index[row_of], pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE

        # the last token of each row that ends its prompt or generates samples the next token; every
        # token of a verify row samples (position j checks draft j; the last one gives the bonus token)
        verify = np.array([r.id in drafts for r, _ in rows], bool)
        samples = cached + q >= np.array([len(r.prompt) for r, _ in rows])
        num_logits = np.where(verify, q, samples).astype(np.int32)
        sampled = np.where(verify, first, first + q - 1)
        local = np.arange(int(num_logits.sum())) - np.repeat(np.cumsum(num_logits) - num_logits, num_logits)
        prompt_spans = tuple((i, start, end) for i, (r, k) in enumerate(rows[:n_ctx])
                             for start, end in [prompt_logprob_positions(r, k)] if end > start)
        prompt_rows = [first[i] + np.arange(end - start) for i, start, end in prompt_spans]
        return Step(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, block_table=block_table,
                    seq_lens=seq_lens, cu_seqlens_q=cu,
                    logits_indices=(np.repeat(sampled, num_logits) + local).astype(np.int32),
                    request_ids=np.repeat(np.array([r.id for r, _ in rows], np.int32), num_logits),
                    output_index=(np.repeat(np.array([r.num_generated for r, _ in rows], np.int32), num_logits)
                                  + local).astype(np.int32),
                    plan=plan, rows=tuple(rows), row_index=row_index.astype(np.int32), num_logits=num_logits,
                    drafts=tuple(tuple(drafts[r.id].tolist()) if r.id in drafts else () for r, _ in rows),
                    carry_from=carry_from,
                    num_prompt_tokens=int(sum(k for r, k in rows if not r.prefilled)),
                    prompt_logits_indices=np.concatenate(prompt_rows).astype(np.int32) if prompt_rows else
                    np.zeros(0, np.int32), prompt_spans=prompt_spans)


    def dummy(self, shape, kv_len: int = 0) -> Step:
        """A step of ``shape`` (a ``StepShape``) that reads slot 0 only and writes nothing: a start-up
        warm-up runs it to compile (JAX) or capture (torch) the programs of that shape. Every row has
        ``kv_len`` KV tokens (at least its query tokens; 0: padding rows, which read nothing), its
        block table slot 0 in every column, its tokens slot -1; the context tokens all sit in the
        first context row. One logits row: the first token."""
        R, T, max_blocks = shape.num_rows, shape.num_tokens, self.planner.config.max_blocks
        q_lens = np.zeros(R, np.int64)
        if shape.context_rows:
            q_lens[0] = shape.context_tokens
        q_lens[shape.context_rows:] = shape.query_len
        seq_lens = np.zeros(R, np.int32)
        if kv_len:
            if kv_len < q_lens.max():
                raise ValueError(f"kv_len: expected 0 or at least the query tokens of a row "
                                 f"({int(q_lens.max())}), got {kv_len}")
            seq_lens[q_lens > 0] = kv_len
        cu = np.zeros(R + 1, np.int32)
        cu[1:] = np.cumsum(q_lens)
        plan = self.planner.plan(seq_lens, q_lens=q_lens, num_context=shape.context_rows)
        positions = np.concatenate([np.arange(s - q, s) if s else np.zeros(q, np.int64)
                                    for q, s in zip(q_lens, seq_lens)]).astype(np.int32)
        one = np.zeros(1, np.int32)
        return Step(input_ids=np.zeros(T, np.int32), positions=positions, slot_mapping=np.full(T, -1, np.int32),
                    block_table=np.zeros((R, max_blocks), np.int32) if kv_len else
                    np.full((R, max_blocks), -1, np.int32),
                    seq_lens=seq_lens, cu_seqlens_q=cu, logits_indices=one, request_ids=one, output_index=one,
                    plan=plan)


def prompt_logprob_positions(r, q: int) -> tuple:
    """``(start, end)``: the prompt positions of a row of ``q`` query tokens of request ``r`` whose
    logits give prompt logprobs (position ``p``'s logits: the logprob of ``prompt[p + 1]``):
    ``[num_cached, min(num_cached + q, len(prompt) - 1))`` for a prompt chunk of a request with
    ``prompt_logprobs``, else empty."""
    start = r.num_cached
    if not r.prompt_logprobs or start >= len(r.prompt):
        return start, start
    return start, max(start, min(start + q, len(r.prompt) - 1))


def _verify_tokens(r, q: int, drafts: np.ndarray) -> np.ndarray:
    """A verify row's ``q`` input tokens: the token sampled last, the drafts, then that last token
    again as padding (padding positions are never accepted: only ``len(drafts)`` are checked)."""
    out = np.full(q, r.output[-1], np.int32)
    out[1:1 + len(drafts)] = drafts
    return out
