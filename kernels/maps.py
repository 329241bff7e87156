"""Row tiles and the tile/token maps every kernel walks (decode, prefill, mixed steps).

A *row tile* packs up to ``tokens_per_tile`` consecutive query tokens of ONE
request times the heads that share a KV (or index) head into the rows of one
MMA tile, so each cached block is read once for all of them.

    tile_map[i]  = [request, first token, position of first token - seq_len, tokens]
    token_map[t] = [request, position of token t - seq_len]

Token ``j`` of a request with ``q_len`` query tokens sits at
``seq_len - q_len + j`` (SPEC.md, position rule), so the maps depend on the
query lengths only, never on ``seq_lens``: decode maps are fixed per batch
shape, prefill maps per ``cu_seqlens_q``. Everything here is shapes and numpy.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

PAGE_SIZE = 128  # tokens per sparse block and per KV page (SPEC.md); the kernels' PAGE_SIZE is this int
# block-scaled FP8 weights: one float32 scale per FP8_BLOCK x FP8_BLOCK weight block and per FP8_BLOCK
# channels of a token's activations (kernels/fp8_linear.py, fp8_moe.py)
FP8_BLOCK = 128
# MXFP8 checkpoints (OCP MX): one UE8M0 scale per MX_BLOCK elements along K, converted to FP8_BLOCK blocks at load
MX_BLOCK = 32

# Rows of one MMA tile (tokens x heads) are capped here; tl.dot wants >= 16.
MAX_TILE_ROWS = 128
MIN_TILE_ROWS = 16
# ... and attention tiles hold at most this many tokens: sparse attention de-duplicates
# the tile's TOKENS x TOPK chosen ids with a square comparison in registers. The
# indexer's tiles have no such bound (index_tile).
MAX_TILE_TOKENS = 8
# An empty tile (padding of a prefill map) starts this far before its request: it reads no block.
EMPTY_TILE_POSITION = -(1 << 30)


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for s in reversed(tuple(shape)):
        strides.append(acc)
        acc *= int(s)
    return tuple(reversed(strides))


@dataclasses.dataclass(frozen=True)
class RowTile:
    """How query tokens x heads are packed into the rows of one MMA tile."""
    heads: int            # heads per token in a tile (GROUP = Hq // Hk, or Hi)
    heads_pad: int        # power of two >= heads
    tokens_per_tile: int  # power of two
    block_m: int          # rows of the tile, >= MIN_TILE_ROWS


def row_tile(heads: int, max_tokens: int, max_tile_tokens: int | None = None) -> RowTile:
    """The attention row tile of ``heads`` heads per token for queries of up to ``max_tokens`` tokens."""
    heads_pad = next_pow2(heads)
    cap = MAX_TILE_TOKENS if max_tile_tokens is None else max_tile_tokens
    tpt = max(1, min(next_pow2(max_tokens), MAX_TILE_ROWS // heads_pad, cap))
    return RowTile(heads, heads_pad, tpt, max(MIN_TILE_ROWS, tpt * heads_pad))


def index_tile(heads: int, max_tokens: int) -> RowTile:
    """The indexer's row tile: as many tokens as MAX_TILE_ROWS rows hold (a prefill's index-K
    pages are read once per tile: 32 tokens x 4 heads scored a 32k prompt 1.6x faster than 8;
    docs/PERF.md)."""
    return row_tile(heads, max_tokens, max_tile_tokens=MAX_TILE_ROWS)


# Sparse decode with several query tokens per request (MTP): pack them into one
# tile (each distinct chosen block read once, but every row computed against
# every block of the union) or give each token its own tile (per-token work
# only; the shared blocks come from L2). Packing pays when it at least halves
# the block visits: the union of the tokens' choices is at most max_blocks,
# against decode_query_len * topk visits one tile per token. Measured on an
# H200 (docs/PERF.md): packed wins at contexts <= 4k (36 blocks), per-token
# from 16k (141 blocks) on, at decode_query_len = 8.
SPARSE_PACK_RATIO = 2
# ... and, on a GPU, when the packed launch has at least this many (request, KV head) programs before
# its splits: fewer packed tiles leave most SMs idle or split each tile's few blocks many ways, and
# one token per tile is faster (H200, M3, msa_decode, results/2026-12-01-h200-s9-mtp-layouts.log,
# summed over the 5 cases of each batch: batch 1-2 per token 1.1-1.6x faster in every case (n = 8,
# 4k: 18.3 us against 30.1); batch 4 (16 programs) 124.5 against 128.0 us; batch 8 level; batch 16
# and up packed ahead, though n = 2 at batch 16-32 and n = 4 / 1k at batch 16 still favour one token
# per tile). The interpreter's cost is per program: it packs whenever the ratio says so.
SPARSE_PACK_MIN_PROGRAMS = 32


def packs_sparse_decode(decode_query_len: int, max_blocks: int, topk: int) -> bool:
    return SPARSE_PACK_RATIO * max_blocks <= decode_query_len * topk


def decode_tile(group: int, decode_query_len: int, sparse: bool, *, max_blocks: int, topk: int, num_requests: int,
                num_kv_heads: int, interpret: bool) -> RowTile:
    """The attention row tile of a decode launch with ``decode_query_len`` tokens per request."""
    packed = not sparse or (packs_sparse_decode(decode_query_len, max_blocks, topk)
                            and (interpret or num_requests * num_kv_heads >= SPARSE_PACK_MIN_PROGRAMS))
    return row_tile(group, decode_query_len if packed else 1)


def prefill_tile_kind(sparse: bool, max_blocks: int, topk: int) -> str:
    """The row tiles of a prefill attention launch (``PrefillPlan.tiles`` kinds): "attention", up to
    MAX_TILE_TOKENS tokens, or for sparse attention whose tiles would not at least halve the block
    visits (decode's rule, :func:`packs_sparse_decode`) "token", one token per tile. A 32k prompt on an
    H200: 16.1 ms with one token per tile against 31.3 ms packed (random choices, 72 distinct blocks
    per 8-token tile), 15.9 against 16.8 (neighbours sharing, 37 blocks); 8k, packed: 4.0 / 3.2 ms
    against 4.0 / 3.9 (docs/PERF.md, "Prefill")."""
    return "attention" if not sparse or packs_sparse_decode(MAX_TILE_TOKENS, max_blocks, topk) else "token"


def max_row_tiles(num_tokens: int, num_rows: int, tokens_per_tile: int) -> int:
    """Upper bound on the row tiles of any ``num_rows`` requests holding ``num_tokens`` tokens.

    ``sum ceil(q_r / tpt) <= (T + R * (tpt - 1)) // tpt``, and a tile holds >= 1 token.
    """
    return min(num_tokens, (num_tokens + num_rows * (tokens_per_tile - 1)) // tokens_per_tile)


def varlen_maps(q_lens, tokens_per_tile: int, num_tiles: int | None = None):
    """-> ``(tile_map [tiles, 4], token_map [T, 2])`` int32 for requests of ``q_lens[r]`` query tokens.

    Request r's tiles cover its tokens ``tokens_per_tile`` at a time:
    ``[r, first token, its index in the request - q_len, tokens]``; its tokens are
    ``[r, index - q_len]``. ``num_tiles`` pads the tile map with empty tiles (no
    tokens, a first position far before the request's start, so they read no
    block). Vectorised: a 128k-token prompt's one-token map takes milliseconds.
    """
    q = np.asarray([int(x) for x in q_lens], np.int64).reshape(-1)
    starts = np.cumsum(q) - q                             # each request's first token
    per_request = -(-q // tokens_per_tile)                # its tiles
    r = np.repeat(np.arange(len(q)), per_request)         # each tile's request
    j0 = (np.arange(len(r)) - np.repeat(np.cumsum(per_request) - per_request, per_request)) * tokens_per_tile
    tiles = np.stack([r, starts[r] + j0, j0 - q[r], np.minimum(tokens_per_tile, q[r] - j0)], axis=1)
    rt = np.repeat(np.arange(len(q)), q)                  # each token's request
    tokens = np.stack([rt, np.arange(len(rt)) - starts[rt] - q[rt]], axis=1)
    if num_tiles is not None:
        if len(tiles) > num_tiles:
            raise ValueError(f"{len(tiles)} row tiles do not fit the {num_tiles} planned")
        tiles = np.concatenate([tiles, np.tile([[0, 0, EMPTY_TILE_POSITION, 0]], (num_tiles - len(tiles), 1))])
    return tiles.astype(np.int32).reshape(-1, 4), tokens.astype(np.int32).reshape(-1, 2)


@functools.lru_cache(maxsize=256)
def decode_maps(num_requests: int, decode_query_len: int, tokens_per_tile: int):
    """Decode maps (``q_lens = [decode_query_len] * num_requests``), built once per shape (read-only)."""
    tile_map, token_map = varlen_maps([decode_query_len] * num_requests, tokens_per_tile)
    tile_map.flags.writeable = token_map.flags.writeable = False
    return tile_map, token_map
