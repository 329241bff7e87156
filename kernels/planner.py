"""Step planner: what a mixed prefill/decode step needs, resolved once on the host.

A step's batch holds context (prefill) requests first and generation requests
last (SPEC.md, "Prefill and mixed steps"). From the scheduler's host-side
lengths, :meth:`StepPlanner.plan` resolves, once per step (not per layer):

* the context span: rows ``[0, Rc)``, tokens ``[0, Tc)``, its max KV length and
  block bound, and its prefill tile/token maps (:class:`PrefillPlan`);
* the generation span: rows ``[Rc, R)``, tokens ``[Tc, T)``, its uniform query
  length ``n``, the max KV length over the generation rows ALONE (a long
  context row must not inflate the decode bound) and its block bound;
* the padded batch size for CUDA-graph capture (pure generation steps only:
  prefill is never captured);
* the workspace use of this step, inside one persistent arena whose layout
  (:class:`WorkspaceLayout`) is sized once at the engine's max batch, so
  buffer addresses are stable across steps.

Decode kernels own the generation span and prefill kernels the context span,
each with its own block bound. Batches of any other shape (a generation row
before a context row, generation rows of different query lengths, lengths past
the configured maxima) raise ``ValueError``.

Framework-neutral: pure Python and numpy. The torch and JAX launchers move the
numpy maps to their devices (cached on the plan, so once per step).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import numpy as np

from . import tuning
from .maps import (PAGE_SIZE, cdiv, decode_tile, index_tile, max_row_tiles, next_pow2, prefill_tile_kind, row_tile,
                   varlen_maps)
ARENA_ALIGN = 256  # bytes; every arena region starts on this boundary

__all__ = ["StepConfig", "StepPlanner", "StepPlan", "Span", "PrefillPlan",
           "WorkspaceLayout", "Region", "prefill_plan", "block_bound"]


# -- helpers -------------------------------------------------------------------------

def _ints(name, values) -> tuple:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of ints, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: expected integers, got dtype {arr.dtype}")
    return tuple(int(x) for x in arr)


def block_bound(max_kv_len: int, max_blocks: int) -> int:
    """Block-table columns a span's kernels use: ``ceil(max_kv_len / 128)`` rounded
    up to a power of two (few kernel variants), at least 1, at most ``max_blocks``."""
    return min(max(next_pow2(cdiv(max_kv_len, PAGE_SIZE)), 1), max_blocks)


# -- prefill maps --------------------------------------------------------------------

TILE_KINDS = ("attention", "token", "index")

@dataclasses.dataclass(frozen=True, eq=False)
class PrefillPlan:
    """Host-side geometry of varlen query rows (a prefill call or a step's context span).

    q_lens:    query tokens per request (from ``cu_seqlens_q``).
    token_map: ``[T, 2]`` int32, ``[request, position - seq_len]`` per token.
    Tile maps depend on how many heads share a tile; :meth:`tiles` builds each
    once and caches it, padded with empty tiles to :func:`max_row_tiles` of
    (T, R), so the launch geometry depends on (T, R, max query length) only:
    both frameworks launch the same grid (bit-identical results) and a jitted
    JAX step keeps its shapes when the query lengths move. :meth:`memo` lets a
    launcher cache device copies here, so a step uploads its maps once, not
    once per layer.
    """
    q_lens: tuple
    token_map: np.ndarray
    tile_tokens: int = 0   # the query length the row tiles are sized for; 0: the longest row's
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def num_rows(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.q_lens))

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def cu_seqlens(self) -> np.ndarray:
        """``[R + 1]`` int32."""
        return np.concatenate([[0], np.cumsum(self.q_lens, dtype=np.int64)]).astype(np.int32)

    def tiles(self, heads: int, kind: str = "attention"):
        """-> ``(RowTile, tile_map [max_tiles, 4] int32)`` for tiles of ``heads`` heads per token.

        ``heads``: GROUP = Hq // Hk for attention, Hi for the indexer. ``kind`` (one of
        ``TILE_KINDS``): "attention" (up to ``maps.MAX_TILE_TOKENS`` tokens a tile), "token" (one;
        sparse attention whose tokens share few blocks, ``maps.prefill_tile_kind``) or "index"
        (the indexer's, :func:`~m3_kernels.maps.index_tile`).
        """
        key = ("tiles", int(heads), kind)
        if key not in self._cache:
            tile = self._row_tile(heads, kind)
            tile_map, _ = varlen_maps(self.q_lens, tile.tokens_per_tile, num_tiles=self.max_tiles(heads, kind))
            self._cache[key] = (tile, tile_map)
        return self._cache[key]

    def _row_tile(self, heads: int, kind: str):
        if kind not in TILE_KINDS:
            raise ValueError(f"tile kind {kind!r}: expected one of {TILE_KINDS}")
        max_tokens = 1 if kind == "token" else max(self.tile_tokens or self.max_q_len, 1)
        return (index_tile if kind == "index" else row_tile)(int(heads), max_tokens)

    def max_tiles(self, heads: int, kind: str = "attention") -> int:
        """Tile-count upper bound for any requests with this many rows and tokens (the padded map's rows)."""
        tile = self._row_tile(heads, kind)
        return max_row_tiles(self.num_tokens, self.num_rows, tile.tokens_per_tile)

    def memo(self, key, build):
        """``build()`` once per ``key`` for the life of this plan (device copies of maps)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


def prefill_plan(cu_seqlens_q) -> PrefillPlan:
    """``cu_seqlens_q`` (host ints, ``[R + 1]``, starts at 0, non-decreasing) -> PrefillPlan."""
    cu = _ints("cu_seqlens_q", cu_seqlens_q)
    if not cu or cu[0] != 0:
        raise ValueError(f"cu_seqlens_q: expected [R + 1] offsets starting at 0, got {list(cu)[:8]}")
    q_lens = tuple(b - a for a, b in zip(cu[:-1], cu[1:]))
    if any(x < 0 for x in q_lens):
        raise ValueError(f"cu_seqlens_q: offsets must be non-decreasing, got {list(cu)[:8]}...")
    return _from_q_lens(q_lens)


def _from_q_lens(q_lens, tile_tokens: int = 0) -> PrefillPlan:
    if len(q_lens) == 0:   # a step without context rows (every decode step): nothing to map
        return PrefillPlan((), _NO_TOKENS)
    _, token_map = varlen_maps(q_lens, 1)
    return PrefillPlan(tuple(int(x) for x in q_lens), token_map, tile_tokens=int(tile_tokens))


_NO_TOKENS = np.zeros((0, 2), np.int32)
_NO_TOKENS.flags.writeable = False


# -- workspace arena -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Region:
    """One buffer of the arena: ``numel`` elements of ``dtype`` from byte ``offset``."""
    offset: int
    numel: int
    dtype: str  # "float32" | "int32"

    @property
    def nbytes(self) -> int:
        return self.numel * 4


@dataclasses.dataclass(frozen=True)
class WorkspaceLayout:
    """The persistent arena of a step: one byte buffer holding every workspace.

    scores       float32  index scores ``[Hi, T_span, blocks_span]`` (spans run
                          one after the other and share it)
    block_ids    int32    ``[Hk, T, topk]``, the step's selected blocks
    partial_out  float32  split-K partial outputs ``[T_span, Hq, splits, D]``
    partial_lse  float32  split-K log-sum-exps ``[T_span, Hq, splits]``
    """
    regions: tuple  # ((name, Region), ...)
    nbytes: int

    def __getitem__(self, name) -> Region:
        return dict(self.regions)[name]


def _layout(sizes: dict) -> WorkspaceLayout:
    regions, offset = [], 0
    for name, (numel, dtype) in sizes.items():
        regions.append((name, Region(offset, int(numel), dtype)))
        offset += cdiv(int(numel) * 4, ARENA_ALIGN) * ARENA_ALIGN
    return WorkspaceLayout(tuple(regions), max(offset, ARENA_ALIGN))


# -- configuration and plan ----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Engine constants, fixed at start-up (per tensor-parallel rank).

    num_q_heads, num_kv_heads, head_dim: this rank's attention heads (Hq, Hk, D);
        the indexer has Hi = Hk heads.
    max_batch:      rows per step, padding rows included.
    max_num_tokens: query tokens per step, padding included.
    max_blocks:     columns of the block table (max KV length / 128).
    topk:           blocks selected per token and KV head.
    graph_batch_sizes: generation batch sizes captured as CUDA graphs; a pure
        generation step is padded (rows with ``seq_len = 0``) to the smallest
        one that fits.
    static_row_tiles: size the context span's row tiles for its token count, not
        its longest row (the tiles then follow from the padded shape alone: a
        compiled step's key never depends on the query lengths).
    """
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_batch: int
    max_num_tokens: int
    max_blocks: int
    topk: int = 16
    graph_batch_sizes: tuple = ()
    static_row_tiles: bool = False

    def __post_init__(self):
        for name in ("num_q_heads", "num_kv_heads", "head_dim", "max_batch", "max_num_tokens", "max_blocks",
                     "topk"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"StepConfig.{name}: expected an int >= 1, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"StepConfig: num_q_heads={self.num_q_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        sizes = tuple(sorted({int(s) for s in self.graph_batch_sizes}))
        if sizes and (sizes[0] < 1 or sizes[-1] > self.max_batch):
            raise ValueError(f"StepConfig.graph_batch_sizes: expected sizes in [1, max_batch={self.max_batch}], "
                             f"got {sizes}")
        object.__setattr__(self, "graph_batch_sizes", sizes)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def max_kv_len(self) -> int:
        return self.max_blocks * PAGE_SIZE


@dataclasses.dataclass(frozen=True)
class Span:
    """Rows ``[row_start, row_start + num_rows)`` and tokens ``[token_start, token_start + num_tokens)`` of a step.

    The context span (the row prefix) runs the prefill kernels over ``prefill``'s
    maps; the generation span (the suffix) runs the decode kernels with
    ``decode_query_len`` tokens per row (``prefill`` is None). ``max_kv_len`` is
    over the span's own rows, and ``max_blocks = block_bound(max_kv_len)`` bounds
    the block-table columns its kernels read. ``num_rows`` includes
    ``num_padding_rows`` rows added for graph capture (the caller gives them
    ``seq_len = 0``).
    """
    row_start: int
    num_rows: int
    token_start: int
    num_tokens: int
    max_kv_len: int
    max_blocks: int
    prefill: PrefillPlan | None = None
    decode_query_len: int = 0
    num_padding_rows: int = 0

    @property
    def rows(self) -> slice:
        return slice(self.row_start, self.row_start + self.num_rows)

    @property
    def tokens(self) -> slice:
        return slice(self.token_start, self.token_start + self.num_tokens)


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
    config: StepConfig
    context: Span
    generation: Span
    layout: WorkspaceLayout

    @property
    def spans(self) -> tuple:
        """The non-empty spans, context first."""
        return tuple(s for s in (self.context, self.generation) if s.num_rows)

    @property
    def block_bound(self) -> int:
        """The most block-table columns any span of the step reads."""
        return max((s.max_blocks for s in self.spans), default=0)

    @property
    def num_rows(self) -> int:
        """Rows the step's tensors must have (padding rows included)."""
        return self.context.num_rows + self.generation.num_rows

    @property
    def num_tokens(self) -> int:
        """Query tokens the step's tensors must have (padding tokens included)."""
        return self.context.num_tokens + self.generation.num_tokens

    @property
    def padded_batch_size(self) -> int:
        return self.num_rows

    @property
    def cuda_graph(self) -> bool:
        """True when the step may replay a captured graph: generation rows only,
        padded to one of ``config.graph_batch_sizes``."""
        g = self.generation
        return self.context.num_rows == 0 and g.num_rows in self.config.graph_batch_sizes

    def workspace_use(self) -> dict:
        """Elements of each arena region this step uses (sparse or dense layers, either span, GPU or CPU)."""
        cfg, use = self.config, {"scores": 0, "partial_out": 0, "partial_lse": 0}
        for span in self.spans:
            use["scores"] = max(use["scores"], cfg.num_kv_heads * span.num_tokens * span.max_blocks)
            for sparse, interpret in itertools.product((True, False), (False, True)):
                if span.prefill is not None:
                    tile, tile_map = span.prefill.tiles(cfg.group, prefill_tile_kind(sparse, span.max_blocks,
                                                                                     cfg.topk))
                    num_tiles = tile_map.shape[0]
                else:
                    tile = decode_tile(cfg.group, span.decode_query_len, sparse, max_blocks=span.max_blocks,
                                       topk=cfg.topk, num_requests=span.num_rows, num_kv_heads=cfg.num_kv_heads,
                                       interpret=interpret)
                    num_tiles = cdiv(span.decode_query_len, tile.tokens_per_tile) * span.num_rows
                splits = tuning.attention(tile=tile, num_tiles=num_tiles, num_kv_heads=cfg.num_kv_heads,
                                          head_dim=cfg.head_dim, topk=cfg.topk, max_blocks=span.max_blocks,
                                          sparse=sparse, interpret=interpret).num_splits
                if splits > 1:
                    rows = span.num_tokens * cfg.num_q_heads * splits
                    use["partial_out"] = max(use["partial_out"], rows * cfg.head_dim)
                    use["partial_lse"] = max(use["partial_lse"], rows)
        use["block_ids"] = cfg.num_kv_heads * self.num_tokens * cfg.topk
        return use


class StepPlanner:
    """Plans steps for one engine configuration; owns the arena layout.

    >>> planner = StepPlanner(StepConfig(num_q_heads=64, num_kv_heads=4, head_dim=128,
    ...                                  max_batch=256, max_num_tokens=8192, max_blocks=1024))
    >>> plan = planner.plan(seq_lens=[5000, 700, 901], cu_seqlens_q=[0, 300, 301, 302], num_context=1)
    >>> plan.generation.row_start, plan.generation.decode_query_len, plan.generation.max_kv_len
    (1, 1, 901)
    """

    def __init__(self, config: StepConfig):
        self.config = config
        self.layout = self.workspace_layout(config)

    @staticmethod
    def workspace_layout(config: StepConfig) -> WorkspaceLayout:
        """The arena at the max batch: every step's :meth:`StepPlan.workspace_use` fits it."""
        c = config
        # Split-K partials: a launch over T tokens in `tiles` row tiles of at most
        # `tpt` tokens (work = tiles * Hk programs per split, T <= work * tpt / Hk)
        # uses T * splits rows, splits <= ceil(TARGET / work), and only when
        # splits >= 2, i.e. work < TARGET. So T * splits <= tpt * (TARGET + work - 1) / Hk
        # < tpt * 2 * TARGET / Hk, and <= max_num_tokens * ceil(TARGET / Hk).
        # tpt grows with the query length: take the largest. (Sparse attention
        # aims at fewer programs than dense: fewer splits.)
        tpt = row_tile(c.group, c.max_num_tokens).tokens_per_tile
        target = tuning.max_target_programs()
        partial_rows = min(cdiv(tpt * (2 * target - 2), c.num_kv_heads),
                           c.max_num_tokens * cdiv(target, c.num_kv_heads))
        return _layout({
            "scores": (c.num_kv_heads * c.max_num_tokens * c.max_blocks, "float32"),
            "block_ids": (c.num_kv_heads * c.max_num_tokens * c.topk, "int32"),
            "partial_out": (partial_rows * c.num_q_heads * c.head_dim, "float32"),
            "partial_lse": (partial_rows * c.num_q_heads, "float32"),
        })

    def plan(self, seq_lens: Sequence[int], *, cu_seqlens_q=None, q_lens=None, num_context: int) -> StepPlan:
        """Resolve one step.

        seq_lens:      host ints ``[R]``: KV length per row, new tokens included
                       (0 for a padding row).
        cu_seqlens_q:  host ints ``[R + 1]``, or ``q_lens`` ``[R]``: query tokens per row.
        num_context:   the first ``num_context`` rows are context (prefill) rows;
                       the rest are generation rows, all with the same query length.
        """
        cfg = self.config
        seq_lens = _ints("seq_lens", seq_lens)
        if (cu_seqlens_q is None) == (q_lens is None):
            raise ValueError("plan: pass exactly one of cu_seqlens_q and q_lens")
        prefill_all = prefill_plan(cu_seqlens_q) if q_lens is None else None
        q_lens = prefill_all.q_lens if q_lens is None else _ints("q_lens", q_lens)
        R = len(seq_lens)
        if len(q_lens) != R:
            raise ValueError(f"cu_seqlens_q/q_lens: expected {R} query lengths (one per row of seq_lens), "
                             f"got {len(q_lens)}")
        if any(s < 0 for s in seq_lens) or any(q < 0 for q in q_lens):
            raise ValueError("seq_lens and query lengths must be >= 0")
        if not isinstance(num_context, (int, np.integer)) or not 0 <= num_context <= R:
            raise ValueError(f"num_context: expected an int in [0, R={R}], got {num_context!r}")
        Rc = int(num_context)

        # -- generation span: the row suffix, one query length
        gen_q = q_lens[Rc:]
        n = gen_q[0] if gen_q else 0
        if any(q != n for q in gen_q):
            bad = next(Rc + i for i, q in enumerate(gen_q) if q != n)
            raise ValueError(f"generation rows (rows {Rc}..{R - 1}, after the {Rc} context rows) must share one "
                             f"query length: row {Rc} has {n}, row {bad} has {q_lens[bad]}. Put context "
                             f"requests first and generation requests last")
        if gen_q and n < 1:
            raise ValueError(f"generation rows need >= 1 query token, got query length 0 (rows {Rc}..{R - 1})")
        Rg = R - Rc
        pad = 0
        if Rc == 0 and Rg and cfg.graph_batch_sizes and Rg <= cfg.graph_batch_sizes[-1]:
            pad = next(s for s in cfg.graph_batch_sizes if s >= Rg) - Rg
        gen_kv = max(seq_lens[Rc:], default=0)
        Tc = sum(q_lens[:Rc])
        generation = Span(row_start=Rc, num_rows=Rg + pad, token_start=Tc, num_tokens=(Rg + pad) * n,
                          max_kv_len=gen_kv, max_blocks=block_bound(gen_kv, cfg.max_blocks), decode_query_len=n,
                          num_padding_rows=pad)

        # -- context span: the row prefix, any query lengths
        ctx_kv = max(seq_lens[:Rc], default=0)
        context = Span(row_start=0, num_rows=Rc, token_start=0, num_tokens=Tc, max_kv_len=ctx_kv,
                       max_blocks=block_bound(ctx_kv, cfg.max_blocks),
                       prefill=_from_q_lens(q_lens[:Rc], Tc if cfg.static_row_tiles else 0))

        plan = StepPlan(cfg, context, generation, self.layout)
        if plan.num_rows > cfg.max_batch:
            raise ValueError(f"step has {plan.num_rows} rows (padding included), more than max_batch={cfg.max_batch}")
        if plan.num_tokens > cfg.max_num_tokens:
            raise ValueError(f"step has {plan.num_tokens} query tokens (padding included), more than "
                             f"max_num_tokens={cfg.max_num_tokens}")
        if max(ctx_kv, gen_kv) > cfg.max_kv_len:
            raise ValueError(f"seq_lens: a row holds {max(ctx_kv, gen_kv)} tokens, more than max_blocks * 128 = "
                             f"{cfg.max_kv_len}")
        if Rc:  # build the context maps now, once per step
            for sparse in (True, False):
                context.prefill.tiles(cfg.group, prefill_tile_kind(sparse, context.max_blocks, cfg.topk))
            context.prefill.tiles(cfg.num_kv_heads, "index")
        return plan
