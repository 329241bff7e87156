"""One launch description per kernel: everything a launcher needs, from shapes alone.

A builder here turns operands (arrays as the kernel sees them: the object
passed as the pointer, an element offset, shape and strides), maps and
options into a :class:`Launch`: the kernel, its grid, its arguments in
signature order, its outputs, constexprs, warps and stages, and the launch
that follows it (the split-K merge; after select_blocks, the attention that
reads its ids). The model-step kernels' builders (norm, router, q/k RoPE,
fused MoE, sampling) are in ``step_launches.py``, with the same types.
``m3_torch.ops.run(launch, outputs)`` and ``m3_jax.ops.run(launch)``
execute every Launch; they add only
:func:`grid_dependency` (below), so the two frameworks compile the same
kernel variant with the same arguments, and their results are bit-identical
by construction.

Kernel signature convention (jax-triton's): input pointers and runtime
scalars, then the output pointers, then the ``tl.constexpr`` parameters.
Every kernel also takes ``PDL`` (``common.release_next_grid``), the one
constexpr that is a fact of the device rather than of the shapes: the runners
add :func:`grid_dependency` of their GPU to every launch (the same value for
the same GPU).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import triton.language as tl

from . import tuning
from .common import aligned
from .maps import RowTile, cdiv, contiguous_strides, next_pow2
from .validate import check_cache_layout

LOG2E = math.log2(math.e)
# CUDA grids hold at most this many blocks on axes 1 and 2 (axis 0: 2^31 - 1)
MAX_GRID_Y = 65535
# element types the kernels read and write, by name (validate.FLOAT_DTYPES and the FP8 cache format)
TRITON_DTYPES = {"bfloat16": tl.bfloat16, "float16": tl.float16, "float32": tl.float32,
                 "float8_e4m3fn": tl.float8e4nv}


# programmatic dependent launch (griddepcontrol) needs sm_90
PDL_MIN_CAPABILITY = (9, 0)


def grid_dependency(capability) -> dict:
    """``{"PDL": ...}`` for a launch on an NVIDIA GPU of compute ``capability`` (major, minor), or
    anywhere else (None: the interpreter, other vendors' GPUs). torch launches such kernels with
    ``launch_pdl`` (inside a CUDA graph too); jax-triton launches without it, where the kernel's
    wait is a no-op."""
    return {"PDL": capability is not None and tuple(capability) >= PDL_MIN_CAPABILITY}


def tile_grid(num_tiles: int, other: int, *rest: int):
    """-> (grid, TILES_ON_AXIS_0): ``(other, num_tiles, *rest)``, or ``(num_tiles, other, *rest)`` when the
    tiles outnumber axis 1's limit (``common.tile_program`` reads either)."""
    on_x = num_tiles > MAX_GRID_Y
    return ((num_tiles, other) if on_x else (other, num_tiles)) + tuple(rest), on_x


@dataclasses.dataclass(frozen=True)
class Operand:
    """An array as a kernel reads it: ``element(i) = flat(ref)[offset + sum(i_k * strides_k)]``.

    torch: the tensor itself, offset 0 (its data pointer already includes its
    storage offset) and ``.stride()``; JAX: the buffer of a PagedView with its
    offset and strides, or a dense array with row-major strides. ``dtype``: the
    element type the kernel reads, by name (a view of a byte pool reads its own
    type, not the buffer's); offset and strides count those elements. Caches
    must name it; other operands may leave it None.
    """
    ref: Any
    offset: int
    shape: tuple
    strides: tuple
    dtype: Optional[str] = None

    @property
    def triton_dtype(self):
        return TRITON_DTYPES[self.dtype]


@dataclasses.dataclass(frozen=True)
class Output:
    """One output pointer of a launch.

    scratch: a float32 workspace in the contiguous layout given here (torch
             hands in a flat buffer at least this large; JAX allocates it).
    unused:  the kernel variant never touches it (torch passes any tensor; JAX
             a 1-element dummy).
    """
    name: str
    shape: tuple
    dtype: str
    strides: tuple
    scratch: bool = False
    unused: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Prev:
    """In the args of a chained launch (``Launch.then``): output ``index`` of the launch ``back`` launches
    before it (1: the one before)."""
    index: int
    back: int = 1


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: str                     # "<module>.<function>" of m3_kernels
    grid: tuple
    args: tuple                     # everything before the outputs, in signature order
    outputs: tuple                  # Output per output pointer, in signature order
    constexprs: dict
    num_warps: int
    num_stages: int
    aliases: tuple = ()             # (arg index, output index): one buffer, updated in place
    then: Optional["Launch"] = None  # the launch that follows (reads earlier launches' outputs via Prev)

    @property
    def empty(self) -> bool:
        return math.prod(self.grid) == 0


# -- the indexer ------------------------------------------------------------------------

def index_scores(*, idx_q: Operand, index_k: Operand, block_table: Operand, seq_lens, tile_map, tile: RowTile,
                 out_strides, dtype: str, interpret: bool, skip_blocks: int) -> Launch:
    """Per-block causal max scores over ``tile_map``'s row tiles -> ``scores [Hi, T, max_blocks]`` float32.

    ``dtype``: of idx_q (picks the tuning; an FP8 index-K cache reuses its configs). ``skip_blocks``:
    0 scores every tile; the MSA ops pass ``topk``, and tiles whose tokens see at most that many blocks
    are left unwritten (selection takes all their blocks without reading scores)."""
    num_tokens, num_heads, head_dim = idx_q.shape
    max_blocks = block_table.shape[1]
    num_tiles = int(tile_map.shape[0])
    cfg = tuning.index_scores(tile=tile, num_tiles=num_tiles, head_dim=head_dim, max_blocks=max_blocks,
                              interpret=interpret, dtype=dtype)
    check_cache_layout("index_k_cache", index_k.offset, index_k.strides)
    args = (idx_q.ref, index_k.ref, block_table.ref, seq_lens, tile_map, index_k.offset, *idx_q.strides,
            *index_k.strides, *block_table.strides, *out_strides, max_blocks, cfg.blocks_per_program)
    out = Output("scores", (num_heads, num_tokens, max_blocks), "float32", tuple(out_strides))
    grid, tiles_on_x = tile_grid(num_tiles, cfg.num_chunks)
    return Launch("index.index_scores_kernel", grid, args, (out,),
                  dict(NUM_HEADS=num_heads, HEADS_PAD=tile.heads_pad, HEAD_DIM=head_dim, BLOCK_M=tile.block_m,
                       BLOCK_N=cfg.block_n, STEP_GROUP=tuning.STEP_GROUP, K_DTYPE=index_k.triton_dtype,
                       SKIP_BLOCKS=int(skip_blocks), TILES_ON_AXIS_0=tiles_on_x,
                       ALIGNED=aligned(*idx_q.strides[:2])),
                  cfg.num_warps, cfg.num_stages)


def select_blocks(*, scores: Operand, seq_lens, token_map, topk: int, init_blocks: int, local_blocks: int,
                  out_strides, interpret: bool) -> Launch:
    """Top-``topk`` blocks per (token, index head) -> ``block_ids [Hi, T, topk]`` int32."""
    num_heads, num_tokens, max_blocks = scores.shape
    cfg = tuning.select_blocks(num_tokens=num_tokens, num_heads=num_heads, max_blocks=max_blocks, topk=topk,
                               interpret=interpret)
    args = (scores.ref, seq_lens, token_map, *scores.strides, *out_strides, num_tokens, max_blocks)
    out = Output("block_ids", (num_heads, num_tokens, topk), "int32", tuple(out_strides))
    return Launch("index.select_blocks_kernel", (cdiv(num_tokens, cfg.tokens_per_program), num_heads), args, (out,),
                  dict(TOPK=topk, TOPK_PAD=next_pow2(topk), INIT_BLOCKS=init_blocks, LOCAL_BLOCKS=local_blocks,
                       BLOCKS_PAD=cfg.blocks_pad, CHUNK=cfg.chunk, BLOCK_T=cfg.tokens_per_program),
                  cfg.num_warps, 1)


# -- paged attention ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Selection:
    """The MSA ops' block selection ahead of their sparse attention: ``select_blocks`` of
    ``scores`` (``[Hk, T, max_blocks]``; ``token_map`` its token map) -> the ``block_ids``
    output (``[Hk, T, topk]`` int32, ``out_strides``). :func:`paged_attention` runs it inside
    the attention launch (whose tile map then gives the tokens' positions; ``token_map`` is not
    read) or as a launch of its own before it (see below)."""
    scores: Operand
    token_map: Any
    topk: int
    init_blocks: int
    local_blocks: int
    out_strides: tuple


# A sparse attention launch of one-token tiles and ONE split selects its tokens' blocks itself (each
# program runs select_blocks' code on its token's scores, in registers: index.select_rows) instead of
# reading them from a selection launch before it. H200, msa_decode, n = 1, same-call A/B of both
# trees, each run twice (results/2026-12-01-h200-s11-fused-select-ab.json, -s11.md): batch 32-128 (one split)
# 0.91-0.99x the time, msa_prefill at 128k 92.8 against 101.5 ms; batch 1-8 (4-16 splits, each
# re-running the whole top-k before its first block) 0.96-1.06x, so launches with splits keep the
# selection launch.


def paged_attention(*, q: Operand, k: Operand, v: Operand, block_ids: Optional[Operand], block_table: Operand,
                    seq_lens, tile_map, tile: RowTile, sm_scale: float, out_dtype: str, out_strides,
                    interpret: bool, k_scale=None, v_scale=None, select: Optional[Selection] = None) -> Launch:
    """Paged GQA attention over ``tile_map``'s row tiles -> ``out [T, Hq, D]``.

    Sparse when ``block_ids`` is given (each token's chosen blocks) or ``select``
    (chosen first, :class:`Selection`; the ids are then the ``block_ids`` output), dense
    otherwise (every visible block). With several splits the attention launch writes
    float32 partials (scratch outputs) and a merge launch follows.
    FP8 caches (``k.dtype`` float8_e4m3fn) read ``k_scale``/``v_scale``: one-element
    float32 arrays (the public ops make them from None or Python floats); the
    launch of any other cache ignores them.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, max_blocks = k.shape[1], block_table.shape[1]
    if select is not None and block_ids is not None:
        raise ValueError("paged_attention: block_ids or select, not both")
    if select is not None and tuple(select.scores.shape) != (num_kv_heads, num_tokens, max_blocks):
        raise ValueError(f"select: scores {tuple(select.scores.shape)}, expected (KV heads, tokens, the block "
                         f"table's width) = {(num_kv_heads, num_tokens, max_blocks)}")
    sparse = block_ids is not None or select is not None
    topk = select.topk if select is not None else block_ids.shape[2] if sparse else 1
    num_tiles = int(tile_map.shape[0])
    cfg = tuning.attention(tile=tile, num_tiles=num_tiles, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           topk=topk if sparse else 0, max_blocks=max_blocks, sparse=sparse, interpret=interpret,
                           dtype=out_dtype, kv_fp8=k.triton_dtype == tl.float8e4nv)
    first = None   # the selection launch, when the attention launch does not select itself
    if select is not None and not (tile.tokens_per_tile == 1 and cfg.num_splits == 1):   # not fused: see above
        first = select_blocks(scores=select.scores, seq_lens=seq_lens, token_map=select.token_map, topk=topk,
                              init_blocks=select.init_blocks, local_blocks=select.local_blocks,
                              out_strides=select.out_strides, interpret=interpret)
        block_ids = Operand(Prev(0), 0, first.outputs[0].shape, tuple(select.out_strides), "int32")
        select = None
    check_cache_layout("k_cache", k.offset, k.strides)
    check_cache_layout("v_cache", v.offset, v.strides)
    out = Output("out", (num_tokens, num_q_heads, head_dim), out_dtype, tuple(out_strides))
    grid, tiles_on_x = tile_grid(num_tiles, cfg.num_splits, num_kv_heads)
    if cfg.num_splits == 1:
        # the program writes the output itself; the lse pointer is never touched
        outputs = (out, Output("partial_lse", (1,), "float32", (1,), scratch=True, unused=True))
        o_strides = (out_strides[0], out_strides[1], 0, out_strides[2])
        lse_strides = (0, 0, 0)
    else:
        part_o = (num_tokens, num_q_heads, cfg.num_splits, head_dim)
        part_lse = (num_tokens, num_q_heads, cfg.num_splits)
        o_strides, lse_strides = contiguous_strides(part_o), contiguous_strides(part_lse)
        outputs = (Output("partial_out", part_o, "float32", o_strides, scratch=True),
                   Output("partial_lse", part_lse, "float32", lse_strides, scratch=True))
    # pointers the variant never reads get the block table as a stand-in: the block ids (dense, or
    # chosen here), the scores (unless chosen here)
    absent = Operand(block_table.ref, 0, (0, 0, 0), (0, 0, 0))
    ids = block_ids if block_ids is not None else absent
    scores = select.scores if select is not None else absent
    constexprs = dict(GROUP=tile.heads, GROUP_PAD=tile.heads_pad, HEAD_DIM=head_dim, TOPK=topk,
                      TOPK_PAD=next_pow2(topk), TOKENS_PER_TILE=tile.tokens_per_tile,
                      ENTRIES_PAD=tile.tokens_per_tile * next_pow2(topk), BLOCK_M=tile.block_m,
                      BLOCK_N=cfg.block_n, STEP_GROUP=tuning.STEP_GROUP, SPARSE=sparse,
                      NUM_SPLITS=cfg.num_splits, KV_DTYPE=k.triton_dtype, TILES_ON_AXIS_0=tiles_on_x,
                      SELECT=False, INIT_BLOCKS=0, LOCAL_BLOCKS=0, BLOCKS_PAD=1, SELECT_CHUNK=0)
    if select is not None:
        sel = tuning.select_blocks(num_tokens=num_tokens, num_heads=num_kv_heads, max_blocks=max_blocks, topk=topk,
                                   interpret=interpret)
        constexprs.update(SELECT=True, INIT_BLOCKS=select.init_blocks, LOCAL_BLOCKS=select.local_blocks,
                          BLOCKS_PAD=sel.blocks_pad, SELECT_CHUNK=sel.chunk)
        ids_strides = tuple(select.out_strides)
        outputs += (Output("block_ids", (num_kv_heads, num_tokens, topk), "int32", ids_strides),)
    else:
        ids_strides = ids.strides
        outputs += (Output("block_ids", (1,), "int32", (1,), unused=True),)
    constexprs["ALIGNED"] = aligned(*q.strides[:2], *o_strides[:3], *ids_strides[:2])
    scales = _scales(k, k_scale, v_scale, seq_lens)
    args = (q.ref, k.ref, v.ref, ids.ref, scores.ref, block_table.ref, seq_lens, tile_map, *scales,
            float(sm_scale) * LOG2E, k.offset, v.offset, max_blocks, *q.strides, *k.strides, *v.strides,
            *ids_strides, *scores.strides, *block_table.strides, *o_strides, *lse_strides)
    launch = Launch("attention.paged_attention_kernel", grid, args, outputs, constexprs, cfg.num_warps,
                    cfg.num_stages)
    if cfg.num_splits > 1:
        merge = Launch("merge.merge_splits_kernel", (num_tokens, num_q_heads),
                       (Prev(0), Prev(1), *o_strides, *lse_strides, *out_strides), (out,),
                       dict(HEAD_DIM=head_dim, NUM_SPLITS=cfg.num_splits),
                       tuning.MERGE_NUM_WARPS, 1)
        launch = dataclasses.replace(launch, then=merge)
    return launch if first is None else dataclasses.replace(first, then=launch)


def _scales(cache: Operand, k_scale, v_scale, dummy) -> tuple:
    """The (k_scale, v_scale) pointers of a launch: the scales for an FP8 cache, else ``dummy``
    twice (an array the kernel variant never reads through them)."""
    if cache.triton_dtype != tl.float8e4nv:
        return dummy, dummy
    if k_scale is None or v_scale is None:
        raise ValueError("k_scale, v_scale: an FP8 K/V cache needs both (one-element float32 arrays)")
    return k_scale, v_scale


# -- cache writes -------------------------------------------------------------------------

def write_cache(*, k: Operand, v: Operand, index_k: Optional[Operand], slot_mapping, pool, pool_shape, pool_dtype,
                k_cache: Optional[Operand], v_cache: Optional[Operand], index_k_cache: Optional[Operand],
                interpret: bool, k_scale=None, v_scale=None) -> Launch:
    """Append a step's rows to the caches that live in ``pool`` (one flat buffer; None = not in it).

    The pool is the kernel's only output, aliased to its input ``pool_in``:
    JAX updates it in place through the alias, torch passes the same tensor twice.
    Cache offsets and strides count each cache's own elements from the buffer's
    start (a byte pool holds caches of several dtypes). FP8 K/V caches quantise
    with ``k_scale``/``v_scale`` (one-element float32 arrays).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    absent3, absent4 = Operand(None, 0, (), (0, 0, 0), k.dtype), Operand(None, 0, (), (0, 0, 0, 0), k.dtype)
    kc, vc, ic = (c if c is not None else a for c, a in ((k_cache, absent4), (v_cache, absent4),
                                                        (index_k_cache, absent3)))
    kv_cache = kc if k_cache is not None else vc
    ik = index_k if index_k is not None else Operand(k.ref, 0, (0, 0), (0, 0))  # never read without an index cache
    args = (k.ref, v.ref, ik.ref, slot_mapping, *_scales(kv_cache, k_scale, v_scale, slot_mapping), pool,
            kc.offset, vc.offset, ic.offset, *k.strides, *v.strides, *ik.strides, *kc.strides, *vc.strides,
            *ic.strides, num_tokens)
    out = Output("pool", tuple(pool_shape), pool_dtype, contiguous_strides(pool_shape))
    tokens = tuning.CACHE_WRITE_INTERPRETER_TOKENS if interpret else 1
    return Launch("cache_write.cache_write_kernel", (cdiv(num_tokens, tokens),), args, (out,),
                  dict(NUM_KV_HEADS=num_kv_heads, HEADS_PAD=next_pow2(num_kv_heads), HEAD_DIM=head_dim,
                       INDEX_HEAD_DIM=index_k.shape[1] if index_k is not None else 16,
                       WRITE_K=k_cache is not None, WRITE_V=v_cache is not None,
                       WRITE_INDEX=index_k_cache is not None, BLOCK_T=tokens, KV_DTYPE=kv_cache.triton_dtype,
                       INDEX_DTYPE=ic.triton_dtype,
                       ALIGNED=aligned(*k.strides[:2], *v.strides[:2], *ik.strides[:1], kc.offset, vc.offset,
                                       ic.offset, *kc.strides[:3], *vc.strides[:3], *ic.strides[:2])),
                  tuning.CACHE_WRITE_NUM_WARPS, 1, aliases=((6, 0),))   # args[6]: pool
