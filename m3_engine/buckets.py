"""The padding policy of an engine's steps: which shapes a step's arrays can take.

A step's arrays (``m3_engine.step_inputs``) hold context rows first, then
generation rows. :class:`StepBuckets` says how each part is padded, once for
the whole engine; the step builder applies it, and a runner that compiles
(JAX) or captures (torch's CUDA graphs) steps sees only the shapes it lists:

* **Pure generation steps** (every row generates, one token, or ``k + 1``
  tokens when the step verifies speculative drafts): the rows are padded to the
  smallest of ``decode_batch_sizes`` that holds them (more rows than the largest:
  not padded). Padding rows have ``seq_len = 0`` and as many tokens as the other
  generation rows (token id 0, position 0, slot -1): they read and write nothing.
* **Steps with context rows** (prefill chunks, alone or beside generation
  rows): with ``pad_prefill``, the context tokens are padded to the next of
  ``context_token_buckets`` (8, 12, 16, 24, 32, 48, ...: powers of two and 1.5x
  them, so padding wastes at most a third, then ``max_num_tokens``) by one
  padding context row holding the extra tokens (``seq_len = 0``: its tokens see
  nothing and write nothing), the context rows (that one included) with empty
  rows (no tokens) to the most a step of that bucket can have
  (:meth:`StepBuckets.context_rows`), and the generation rows, if any, to the
  most a step with context rows can have (:meth:`StepBuckets.mixed_generation_rows`).
  So a token bucket gives at most one shape per generation query length (none,
  one token, ``k + 1``): the set stays small enough to compile at start. The
  padding costs empty rows (a row of block table each, empty tiles) and up to
  ``max_num_seqs`` one-token generation rows in a mixed step, cheap beside its
  context tokens. Without ``pad_prefill`` such steps keep their own shape.

JAX pads everything (each shape is one compilation, so the set must be
bounded); torch pads pure generation steps where CUDA graphs replay them and
runs prefill steps eagerly at their own shape (padding them would only add
work). :meth:`StepBuckets.shapes` enumerates every shape the policy can give a
step the scheduler makes, so that an engine can compile that set at start-up;
within a shape, the kernels are further specialised by the block bounds
(:func:`block_bounds`) and row tiles the planner derives from lengths. With
``pad_prefill`` the planner sizes the context row tiles from the padded shape
(``StepConfig.static_row_tiles``), and the JAX runner gives every span the
table's width as its block bound, so one compiled program serves each shape
(docs/ENGINE.md, "Ready means ready").
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, NamedTuple

from m3_kernels.maps import next_pow2
from m3_kernels.planner import StepConfig

__all__ = ["StepBuckets", "StepShape", "token_buckets", "block_bounds"]

MIN_TOKEN_BUCKET = 8


class StepShape(NamedTuple):
    """The shape of a step's arrays (padding included): rows and tokens of each span."""
    context_rows: int
    context_tokens: int
    generation_rows: int
    query_len: int          # tokens per generation row; 0 without generation rows

    @property
    def num_rows(self) -> int:
        return self.context_rows + self.generation_rows

    @property
    def num_tokens(self) -> int:
        return self.context_tokens + self.generation_rows * self.query_len


def token_buckets(max_num_tokens: int) -> tuple:
    """Context-token buckets: 8, 12, 16, 24, 32, 48, ... (powers of two and 1.5x them), those below
    ``max_num_tokens``, then ``max_num_tokens``."""
    buckets, b = set(), MIN_TOKEN_BUCKET
    while b < max_num_tokens:
        buckets |= {b, b * 3 // 2}
        b *= 2
    return tuple(sorted(x for x in buckets if x < max_num_tokens)) + (max_num_tokens,)


def block_bounds(max_blocks: int) -> tuple:
    """Every block bound the planner gives a span (``planner.block_bound``): the powers of two below
    ``max_blocks`` (the table's width), then ``max_blocks``."""
    bounds, b = [], 1
    while b < max_blocks:
        bounds.append(b)
        b *= 2
    return tuple(bounds) + (max_blocks,)


@dataclasses.dataclass(frozen=True)
class StepBuckets:
    """How an engine pads its steps (the module docstring); derived from the engine options.

    max_batch, max_num_tokens: the scheduler's rows and query tokens per step (real rows).
    prefill_chunk:      query tokens of one context row at most (``min(prefill_chunk, max_context)``).
    decode_batch_sizes: the sizes pure generation steps are padded to (the ``graph_batch_sizes``
                        option); empty: not padded.
    pad_prefill:        pad steps with context rows too (tokens, context rows, generation rows).
    verify_query_len:   tokens of a verify row, ``k + 1``, with speculative decoding; 0 without.
    max_verify_rows:    generation rows of a step that verifies, at most (``disable_by_batch_size``).
    """
    max_batch: int
    max_num_tokens: int
    prefill_chunk: int
    decode_batch_sizes: tuple = ()
    pad_prefill: bool = False
    verify_query_len: int = 0
    max_verify_rows: int = 0

    def __post_init__(self):
        for name in ("max_batch", "max_num_tokens", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StepBuckets.{name}: expected an int >= 1, got {value!r}")
        sizes = tuple(sorted(set(self.decode_batch_sizes)))
        if sizes and (sizes[0] < 1 or sizes[-1] > self.max_batch):
            raise ValueError(f"StepBuckets.decode_batch_sizes: expected sizes in [1, max_batch={self.max_batch}], "
                             f"got {sizes}")
        object.__setattr__(self, "decode_batch_sizes", sizes)
        if self.verify_query_len == 1 or self.verify_query_len < 0:
            raise ValueError(f"StepBuckets.verify_query_len: expected 0 (no speculation) or k + 1 >= 2, got "
                             f"{self.verify_query_len}")

    @classmethod
    def from_config(cls, config, speculative, *, pad_prefill: bool, pad_decode: bool) -> "StepBuckets":
        """The policy of an engine with the checked limits ``config`` (a ``SchedulerConfig``) and
        ``speculative`` (a ``SpeculativeConfig`` or None). ``pad_decode``: pad pure generation
        steps to ``config.graph_batch_sizes``; ``pad_prefill``: pad steps with context rows too."""
        k = speculative.num_speculative_tokens if speculative is not None else 0
        return cls(max_batch=config.max_batch, max_num_tokens=config.max_num_tokens,
                   prefill_chunk=min(config.prefill_chunk, config.max_context),
                   decode_batch_sizes=config.graph_batch_sizes if pad_decode else (), pad_prefill=pad_prefill,
                   verify_query_len=k + 1 if k else 0,
                   max_verify_rows=speculative.disable_by_batch_size if k else 0)

    # -- the rule -------------------------------------------------------------------------------

    @property
    def context_token_buckets(self) -> tuple:
        """The context-token counts of a padded step (empty without ``pad_prefill``)."""
        return token_buckets(self.max_num_tokens) if self.pad_prefill else ()

    def generation_rows(self, rows: int) -> int:
        """Generation rows ``rows`` padded: the smallest decode batch size that holds them, else ``rows``."""
        return next((s for s in self.decode_batch_sizes if s >= rows), rows) if rows else 0

    def shape(self, context_rows: int, context_tokens: int, generation_rows: int, query_len: int) -> StepShape:
        """The padded shape of a step of these real rows and tokens."""
        query_len = query_len if generation_rows else 0
        if not context_rows:
            return StepShape(0, 0, self.generation_rows(generation_rows), query_len)
        if not self.pad_prefill:
            return StepShape(context_rows, context_tokens, generation_rows, query_len)
        tokens = next(b for b in self.context_token_buckets if b >= context_tokens)
        return StepShape(self.context_rows(tokens), tokens,
                         self.mixed_generation_rows(query_len) if generation_rows else 0, query_len)

    def context_rows(self, tokens: int) -> int:
        """Context rows of a padded step of ``tokens`` (a bucket) context tokens: a power of two holding
        every context row such a step can have and the padding row (each real row has a token)."""
        return min(next_pow2(self.max_batch + 1), next_pow2(tokens))

    def mixed_generation_rows(self, query_len: int) -> int:
        """Generation rows of a padded step with context rows and generation rows of ``query_len``
        tokens: the most such a step can have (one row and one token go to context), padded as in a
        pure generation step."""
        rows = min(self.max_batch - 1, (self.max_num_tokens - 1) // query_len)
        if query_len > 1:
            rows = min(rows, self.max_verify_rows)
        return self.generation_rows(rows)

    # -- the bounded set ------------------------------------------------------------------------

    def generation_parts(self) -> Iterator[tuple]:
        """``(real generation rows, tokens per row)`` of every step the scheduler can make, ``(0, 0)``
        (no generation rows) included."""
        yield 0, 0
        for rows in range(1, min(self.max_batch, self.max_num_tokens) + 1):
            yield rows, 1
        q = self.verify_query_len
        if q:
            for rows in range(1, min(self.max_batch, self.max_verify_rows, self.max_num_tokens // q) + 1):
                yield rows, q

    def shapes(self) -> Iterator[StepShape]:
        """Every shape :meth:`shape` gives a step the scheduler can make (each once): context rows
        of 1 to ``prefill_chunk`` tokens beside generation rows of one token (or ``k + 1`` when
        verifying, up to ``max_verify_rows`` of them), within ``max_batch`` rows and
        ``max_num_tokens`` tokens. Without ``pad_prefill`` a step with context rows has the shape
        of its own lengths: every row and token count (a large set)."""
        seen = set()
        for gen_rows, q in self.generation_parts():
            if gen_rows:
                shape = self.shape(0, 0, gen_rows, q)
                if shape not in seen:
                    seen.add(shape)
                    yield shape
            tokens_left = self.max_num_tokens - gen_rows * q
            for rows in range(1, min(self.max_batch - gen_rows, tokens_left) + 1):
                low, high = rows, min(rows * self.prefill_chunk, tokens_left)   # context tokens
                for tokens in self._context_token_classes(low, high):
                    shape = self.shape(rows, tokens, gen_rows, q)
                    if shape not in seen:
                        seen.add(shape)
                        yield shape

    def _context_token_classes(self, low: int, high: int) -> Iterator[int]:
        """One context-token count in ``[low, high]`` per distinct padded outcome: with buckets, each
        bucket exactly (no padding row) and just below it (a padding row); else every count."""
        if not self.pad_prefill:
            yield from range(low, high + 1)
            return
        previous = 0
        for bucket in self.context_token_buckets:   # counts in (previous, bucket] pad to bucket
            if low <= bucket <= high:
                yield bucket                           # exactly: no padding row
            below = max(previous + 1, low)
            if below <= min(bucket - 1, high):
                yield below                            # below it: a padding row
            previous = bucket

    @property
    def max_rows(self) -> int:
        """Rows of a padded step at most (the planner's ``max_batch``)."""
        if self.pad_prefill:   # a power of two of context rows (the padding row included) + generation rows
            return next_pow2(self.max_batch + 1) + self.generation_rows(self.max_batch)
        return self.max_batch

    @property
    def max_tokens(self) -> int:
        """Query tokens of a padded step at most (the planner's ``max_num_tokens``)."""
        q = max(self.verify_query_len, 1)
        if self.pad_prefill:   # context tokens up to a bucket <= max_num_tokens, then padded generation rows
            return self.max_num_tokens + self.max_batch * q
        verify = self.generation_rows(min(self.max_batch, self.max_verify_rows, self.max_num_tokens // q)) * q \
            if self.verify_query_len else 0
        return max(self.max_num_tokens, self.generation_rows(min(self.max_batch, self.max_num_tokens)), verify)

    def planner_config(self, step_config: StepConfig) -> StepConfig:
        """``step_config`` (one rank's heads and the table width) with this policy's limits: the config
        of the planner that plans the padded steps."""
        return dataclasses.replace(step_config, max_batch=self.max_rows, max_num_tokens=self.max_tokens,
                                   graph_batch_sizes=self.decode_batch_sizes, static_row_tiles=self.pad_prefill)
