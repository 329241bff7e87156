"""Launch geometry shared by both launchers: tiles, splits, block sizes, maps.

Everything here depends on shapes only (never on ``seq_lens`` values), so a
captured CUDA graph or a jitted JAX step replays without recompiling, and the
torch and JAX launchers pick the same kernel variant for the same shapes,
which is what makes their outputs bit-identical.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .common import PAGE_SIZE as _PAGE_SIZE

PAGE_SIZE = int(_PAGE_SIZE.value)

# Rows of one MMA tile (tokens x heads) are capped here; tl.dot wants >= 16.
MAX_TILE_ROWS = 128
MIN_TILE_ROWS = 16
# ... and hold at most this many tokens: sparse attention de-duplicates the
# tile's TOKENS x TOPK chosen ids with a square comparison in registers.
MAX_TILE_TOKENS = 8
# Split-K and block chunking aim for this many programs: ~8 per SM on a
# 132-SM H100/H200. A constant (not the device's SM count) so both frameworks
# and every GPU choose the same variant for the same shapes.
TARGET_PROGRAMS = 1024
# Sparse attention visits only TOPK blocks per row tile, so it splits only
# while there are fewer (tile, KV head) programs than this, about one per SM.
# Measured on an H200 (M3, context 16k, n = 1; docs/PERF.md): one program per
# (token, KV head) streaming its 16 blocks in one pipelined loop, with no
# partial write and no merge, beats 2-8 splits from 128 such programs on
# (batch 64: 68 us = 93% of the floor, against 91 us with 4 splits).
SPARSE_TARGET_PROGRAMS = 128
# A split-K program gets at least this many blocks (fewer make the pipeline's
# fill and the partial write dominate).
MIN_BLOCKS_PER_SPLIT = 4
# Blocks whose page ids a kernel gathers in one go before loading their K/V.
STEP_GROUP = 16


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class RowTile:
    """How query tokens x heads are packed into the rows of one MMA tile."""
    heads: int            # heads per token in a tile (GROUP or Hi)
    heads_pad: int        # power of two >= heads
    tokens_per_tile: int  # power of two
    block_m: int          # rows of the tile, >= MIN_TILE_ROWS


def row_tile(heads: int, max_tokens: int) -> RowTile:
    heads_pad = next_pow2(heads)
    tpt = max(1, min(next_pow2(max_tokens), MAX_TILE_ROWS // heads_pad, MAX_TILE_TOKENS))
    return RowTile(heads, heads_pad, tpt, max(MIN_TILE_ROWS, tpt * heads_pad))


# Sparse decode with several query tokens per request (MTP): pack them into one
# tile (each distinct chosen block read once, but every row computed against
# every block of the union) or give each token its own tile (per-token work
# only; the shared blocks come from L2). Packing pays when it at least halves
# the block visits: the union of the tokens' choices is at most max_blocks,
# against decode_query_len * topk visits one tile per token. Measured on an
# H200 (docs/PERF.md): packed wins at contexts <= 4k (36 blocks), per-token
# from 16k (141 blocks) on, at n = 8.
SPARSE_PACK_RATIO = 2


def packs_sparse_decode(decode_query_len: int, max_blocks: int, topk: int) -> bool:
    return SPARSE_PACK_RATIO * max_blocks <= decode_query_len * topk


def decode_tile(group: int, decode_query_len: int, sparse: bool, *, max_blocks: int, topk: int) -> RowTile:
    """The row tile of decode attention for ``decode_query_len`` tokens per request."""
    packed = not sparse or packs_sparse_decode(decode_query_len, max_blocks, topk)
    return row_tile(group, decode_query_len if packed else 1)


# -- tile and token maps -------------------------------------------------------
# tile_map[i]  = [request, first token, position of first token - seq_len, tokens]
# token_map[t] = [request, position of token t - seq_len]
# A token j of a request with q_len query tokens sits at seq_len - q_len + j.

def varlen_maps(q_lens, tokens_per_tile: int, num_tiles: int | None = None):
    """Tile and token maps for requests with ``q_lens[r]`` query tokens each.

    ``num_tiles`` pads the tile map to a fixed size with empty tiles: no tokens,
    and a first position far before the request's start, so they read no block.
    """
    tiles, tokens = [], []
    t0 = 0
    for r, q_len in enumerate(int(x) for x in q_lens):
        for j0 in range(0, q_len, tokens_per_tile):
            tiles.append((r, t0 + j0, j0 - q_len, min(tokens_per_tile, q_len - j0)))
        tokens.extend((r, j - q_len) for j in range(q_len))
        t0 += q_len
    if num_tiles is not None:
        if len(tiles) > num_tiles:
            raise ValueError(f"{len(tiles)} row tiles do not fit the {num_tiles} planned")
        tiles.extend([(0, 0, -(1 << 30), 0)] * (num_tiles - len(tiles)))
    tile_map = np.asarray(tiles, np.int32).reshape(-1, 4)
    token_map = np.asarray(tokens, np.int32).reshape(-1, 2)
    return tile_map, token_map


def decode_maps(num_requests: int, decode_query_len: int, tokens_per_tile: int):
    return varlen_maps([decode_query_len] * num_requests, tokens_per_tile)


# -- attention -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    tile: RowTile
    num_tiles: int
    num_splits: int
    num_entries: int
    block_n: int
    num_warps: int
    num_stages: int

    def constexprs(self, *, num_q_heads, head_dim, topk, sparse):
        return dict(
            NUM_Q_HEADS=num_q_heads, GROUP=self.tile.heads, GROUP_PAD=self.tile.heads_pad,
            HEAD_DIM=head_dim, TOPK=max(topk, 1), TOPK_PAD=next_pow2(max(topk, 1)),
            TOKENS_PER_TILE=self.tile.tokens_per_tile,
            ENTRIES_PAD=self.tile.tokens_per_tile * next_pow2(max(topk, 1)), BLOCK_M=self.tile.block_m,
            BLOCK_N=self.block_n, STEP_GROUP=STEP_GROUP, SPARSE=sparse, NUM_SPLITS=self.num_splits)

    def partial_shapes(self, num_tokens, num_q_heads, head_dim):
        """Shapes of the float32 split-K workspaces (partial out, lse), or None."""
        if self.num_splits == 1:
            return None
        return ((num_tokens, num_q_heads, self.num_splits, head_dim),
                (num_tokens, num_q_heads, self.num_splits))


def attention_plan(*, tile: RowTile, num_tiles, num_kv_heads, head_dim, topk, max_blocks,
                   sparse, allow_split=True) -> AttentionPlan:
    """``tile`` from ``row_tile(GROUP, tokens per request)``; ``num_tiles`` rows of the tile map.

    Block sizes, warps and stages: measured on an H200 at batch 64, context 32k
    (benchmarks/tune.py; docs/PERF.md).
    """
    # blocks one tile visits: about topk (its tokens mostly agree) or every block
    num_entries = topk if sparse else max_blocks
    work = max(num_tiles * num_kv_heads, 1)
    splits = 1
    if allow_split:
        target = SPARSE_TARGET_PROGRAMS if sparse else TARGET_PROGRAMS
        min_blocks = 1 if sparse else MIN_BLOCKS_PER_SPLIT
        splits = max(1, min(cdiv(target, work), cdiv(num_entries, min_blocks)))
    if sparse:
        block_n, num_stages = 64, 3
    else:
        block_n, num_stages = (128, 3) if head_dim <= 128 else (64, 3)
    num_warps = 8 if tile.block_m >= 64 else 4
    return AttentionPlan(tile, num_tiles, splits, num_entries, block_n, num_warps, num_stages)


def merge_constexprs(num_q_heads, head_dim, num_splits):
    return dict(NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
                SPLITS_PAD=next_pow2(num_splits))


# -- indexer ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class IndexPlan:
    tile: RowTile
    num_tiles: int
    num_chunks: int
    blocks_per_program: int
    block_n: int
    num_warps: int
    num_stages: int

    def constexprs(self, *, num_heads, head_dim):
        return dict(NUM_HEADS=num_heads, HEADS_PAD=self.tile.heads_pad, HEAD_DIM=head_dim,
                    BLOCK_M=self.tile.block_m, BLOCK_N=self.block_n, STEP_GROUP=STEP_GROUP)


def index_plan(*, tile: RowTile, num_tiles, head_dim, max_blocks) -> IndexPlan:
    """``tile`` from ``row_tile(Hi, tokens per request)``."""
    chunks = max(1, min(cdiv(TARGET_PROGRAMS, max(num_tiles, 1)), max_blocks))
    bpp = max(1, cdiv(max_blocks, chunks))
    chunks = max(1, cdiv(max_blocks, bpp))
    block_n = 128 if head_dim <= 128 else 64
    num_warps = 8 if tile.block_m >= 64 else 4
    return IndexPlan(tile, num_tiles, chunks, bpp, block_n, num_warps, num_stages=3)


# select_blocks: rows of at least SELECT_TWO_LEVEL_BLOCKS (padded) blocks first
# pick the best chunks of SELECT_CHUNK blocks, then the best blocks inside them.
SELECT_CHUNK = 16
SELECT_TWO_LEVEL_BLOCKS = 512


def select_constexprs(*, topk, init_blocks, local_blocks, max_blocks):
    topk_pad = next_pow2(topk)
    blocks_pad = max(next_pow2(max_blocks), topk_pad, 16)
    two_level = blocks_pad >= max(SELECT_TWO_LEVEL_BLOCKS, 2 * topk_pad * SELECT_CHUNK)
    return dict(TOPK=topk, TOPK_PAD=topk_pad, INIT_BLOCKS=init_blocks, LOCAL_BLOCKS=local_blocks,
                BLOCKS_PAD=blocks_pad, CHUNK=SELECT_CHUNK if two_level else 0)


def select_num_warps(num_rows, max_blocks):
    """Warps of one selection program, for ``num_rows`` (token, index head) programs.

    About 1024 warps in all: few rows get 8 warps each, many rows 1 (every
    compare-exchange then stays inside one warp), but a thread holds at most
    64 keys. Measured on an H200 (docs/PERF.md).
    """
    blocks_pad = max(next_pow2(max_blocks), 16)
    return max(1, min(8, next_pow2(cdiv(1024, max(num_rows, 1)))), min(8, blocks_pad // 2048))


LOG2E = math.log2(math.e)


# -- kernel argument lists, in kernel-signature order ---------------------------
# Both launchers build the runtime arguments here; they differ only in where the
# strides come from (torch: .stride(); JAX: computed from shapes and layouts).
# Output pointers follow these (jax-triton appends them), constexprs go by name.

def check_cache_layout(name, offset, strides):
    """Cache offsets and all strides but the last must be multiples of 16 elements.

    The kernels state this to the compiler (``(x // 16) * 16``) so that K/V
    loads vectorize and pipeline in both frameworks. Any cache whose head dim is
    a multiple of 16 (as validate requires) and whose rows are contiguous,
    HND, NHD or inside a pool, satisfies it.
    """
    bad = [int(x) for x in (offset, *strides[:-1]) if int(x) % 16]
    if bad:
        raise ValueError(f"{name}: element offset and strides (except the last) must be multiples of 16, "
                         f"got offset {int(offset)}, strides {tuple(int(x) for x in strides)}")


def attention_args(*, q, k, v, block_ids, block_table, seq_lens, tile_map, sm_scale, k_off, v_off,
                   q_strides, k_strides, v_strides, ids_strides, bt_strides, o_strides):
    """``o_strides``: (token, head, split, dim) strides of the kernel's first output."""
    check_cache_layout("k_cache", k_off, k_strides)
    check_cache_layout("v_cache", v_off, v_strides)
    return [q, k, v, block_ids, block_table, seq_lens, tile_map, float(sm_scale) * LOG2E, int(k_off), int(v_off),
            *q_strides, *k_strides, *v_strides, *ids_strides, *bt_strides, *o_strides]


def index_scores_args(*, idx_q, index_k, block_table, seq_lens, tile_map, k_off, q_strides, k_strides,
                      bt_strides, scores_strides, max_blocks, blocks_per_program):
    check_cache_layout("index_k_cache", k_off, k_strides)
    return [idx_q, index_k, block_table, seq_lens, tile_map, int(k_off), *q_strides, *k_strides, *bt_strides,
            *scores_strides, int(max_blocks), int(blocks_per_program)]


def select_args(*, scores, seq_lens, token_map, scores_strides, ids_strides, max_blocks):
    return [scores, seq_lens, token_map, *scores_strides, *ids_strides, int(max_blocks)]


def contiguous_strides(shape):
    strides, acc = [], 1
    for s in reversed(tuple(shape)):
        strides.append(acc)
        acc *= int(s)
    return tuple(reversed(strides))


def partial_out_strides(num_q_heads, num_splits, head_dim):
    return (num_q_heads * num_splits * head_dim, num_splits * head_dim, head_dim, 1)
