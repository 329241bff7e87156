"""The MSA indexer: per-block causal max scores, then top-k block selection.

``index_scores_kernel``: a program owns one row tile (up to ``TOKENS_PER_TILE``
query tokens of one request times all index heads, packed as MMA rows) and a
contiguous chunk of logical blocks. Each index-K page is read once for all
heads and tokens of the tile: for decode with ``TOKENS_PER_TILE >= n`` that is
once per request. ``tile_map`` rows: ``[request, first token, first token's
position - seq_len, tokens]`` (see attention.py). Lengths are clamped and
index-K rows past the tile's last visible position never loaded, as in
attention.py; a NaN/Inf query row scores NaN on the blocks it sees.

``select_blocks_kernel``: one program per (token, index head). The row's
visible scores sit in registers as 64-bit keys (score, then lower id; forced
init/local blocks rank +inf, NaN ranks -inf but still beats nothing); a
bitonic top-k picks the best ``TOPK`` in log-depth rounds (long rows: first
the best chunks, then the best blocks inside them), and a sort writes the
chosen ids ascending, then -1.
"""

import triton
import triton.language as tl

from .common import PAGE_SIZE, mma


@triton.jit(do_not_specialize=["max_blocks", "blocks_per_program"])
def index_scores_kernel(
    q_ptr,            # [T, Hi, Di]                   q dtype
    k_ptr,            # [pages, PAGE_SIZE, Di] @ k_off  cache dtype (one shared head)
    block_table_ptr,  # [R, max_blocks] int32
    seq_lens_ptr,     # [R] int32
    tile_map_ptr,     # [num_tiles, 4] int32
    k_off,
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_kn, stride_kd,
    stride_br, stride_bb,
    stride_si, stride_st, stride_sb,
    max_blocks,
    blocks_per_program,
    scores_ptr,       # [Hi, T, max_blocks] fp32, any strides
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STEP_GROUP: tl.constexpr,
):
    chunk = tl.program_id(0)
    tile = tl.program_id(1)
    # multiples of 16, stated so the compiler sees it under jax-triton too (see attention.py)
    k_off = (k_off // 16) * 16
    stride_kp, stride_kn = (stride_kp // 16) * 16, (stride_kn // 16) * 16

    req = tl.load(tile_map_ptr + tile * 4)
    tok0 = tl.load(tile_map_ptr + tile * 4 + 1)
    pos0_minus_len = tl.load(tile_map_ptr + tile * 4 + 2)
    ntok = tl.load(tile_map_ptr + tile * 4 + 3)
    # lengths past the table behave as its width, negative ones as 0 (see attention.py)
    seq_len = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + req), 0), max_blocks * PAGE_SIZE)
    # KV rows the tile's last token sees: later rows (stale, maybe NaN) are never loaded
    tile_kv_len = tl.maximum(seq_len + pos0_minus_len + ntok, 0)
    tile_blocks = tl.cdiv(tile_kv_len, PAGE_SIZE)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    m_tok = offs_m // HEADS_PAD
    m_head = offs_m % HEADS_PAD
    m_valid = (m_tok < ntok) & (m_head < NUM_HEADS)
    m_pos = seq_len + pos0_minus_len + m_tok
    m_t = tok0 + m_tok

    # [BLOCK_M, Di]
    q = tl.load(q_ptr + m_t[:, None] * stride_qt + m_head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=m_valid[:, None], other=0.0)
    # [BLOCK_M]: NaN or Inf in a row's query makes its visible blocks' scores NaN
    q_bad = tl.max(((q != q) | (tl.abs(q) == float("inf"))).to(tl.int32), axis=1) > 0

    b_begin = chunk * blocks_per_program
    b_end = tl.minimum(b_begin + blocks_per_program, max_blocks)

    score_rows = scores_ptr + m_head * stride_si + m_t * stride_st
    # visible blocks, STEP_GROUP at a time: page ids gathered up front so the
    # index-K loads of the inner loop wait on no other load and pipeline
    seen_end = tl.minimum(b_end, tile_blocks)
    offs_g = tl.arange(0, STEP_GROUP)
    for g0 in range(b_begin, seen_end, STEP_GROUP):
        g_page = tl.load(block_table_ptr + req * stride_br + (g0 + offs_g) * stride_bb, mask=g0 + offs_g < seen_end,
                         other=0)
        for j in range(0, tl.minimum(seen_end - g0, STEP_GROUP)):
            block = g0 + j
            page = tl.sum(tl.where(offs_g == j, g_page, 0), axis=0).to(tl.int64)
            best = tl.full([BLOCK_M], float("-inf"), tl.float32)
            for n0 in tl.static_range(0, PAGE_SIZE, BLOCK_N):
                kv_tok = n0 + offs_n
                kv_pos = block * PAGE_SIZE + kv_tok
                # [BLOCK_N, Di]
                k = tl.load(k_ptr + k_off + page * stride_kp + kv_tok[:, None] * stride_kn
                            + offs_d[None, :] * stride_kd, mask=(kv_pos < tile_kv_len)[:, None], other=0.0)
                # [BLOCK_M, BLOCK_N]
                s = mma(q, tl.trans(k))
                s = tl.where(kv_pos[None, :] <= m_pos[:, None], s, float("-inf"))
                best = tl.maximum(best, tl.max(s, axis=1))
            best = tl.where(q_bad & (block * PAGE_SIZE <= m_pos), float("nan"), best)
            tl.store(score_rows + block * stride_sb, best, mask=m_valid)
    # blocks no token of the tile sees
    for block in range(tl.maximum(b_begin, tile_blocks), b_end):
        tl.store(score_rows + block * stride_sb, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=m_valid)


@triton.jit
def _rank_keys(row_ptr, stride_sb, blocks, visible_blocks, INIT_BLOCKS: tl.constexpr, LOCAL_BLOCKS: tl.constexpr,
               BLOCKS_PAD: tl.constexpr):
    """One int64 key per block id in ``blocks``: larger = chosen first.

    High half: the rank key's order-preserving int32 image (forced blocks +inf,
    NaN -inf, -0.0 as +0.0; blocks past the visible ones below everything).
    Low half: the complement of the block id, so equal scores go to the lower
    id and no two keys are equal.
    """
    visible = blocks < visible_blocks
    score = tl.load(row_ptr + blocks * stride_sb, mask=visible, other=float("-inf"))
    rank = tl.where(score != score, float("-inf"), score)
    rank = tl.where(rank == 0.0, 0.0, rank)
    forced = (blocks < INIT_BLOCKS) | (blocks >= visible_blocks - LOCAL_BLOCKS)
    rank = tl.where(forced, float("inf"), rank)
    bits = rank.to(tl.int32, bitcast=True)
    ordered = tl.where(visible, bits ^ ((bits >> 31) & 0x7FFFFFFF), -0x80000000)
    return (ordered.to(tl.int64) << 32) | (BLOCKS_PAD - 1 - blocks).to(tl.int64)


@triton.jit
def _top(keys, K: tl.constexpr):
    """The ``K`` largest of ``keys``, largest first (``tl.topk`` cannot take K = 1)."""
    if K == 1:
        top = tl.max(keys, axis=0, keep_dims=True)
    else:
        top = tl.topk(keys, K)
    return top


@triton.jit(do_not_specialize=["max_blocks"])
def select_blocks_kernel(
    scores_ptr,       # [Hi, T, max_blocks] fp32, any strides
    seq_lens_ptr,     # [R] int32
    token_map_ptr,    # [T, 2] int32: request, position - seq_len
    stride_si, stride_st, stride_sb,
    stride_oi, stride_ot, stride_ok,
    max_blocks,
    ids_ptr,          # [Hi, T, TOPK] int32, any strides
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    INIT_BLOCKS: tl.constexpr,
    LOCAL_BLOCKS: tl.constexpr,
    BLOCKS_PAD: tl.constexpr,
    CHUNK: tl.constexpr,              # 0: one top-k over the row; else two levels, see below
):
    t = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.load(token_map_ptr + t * 2)
    pos_minus_len = tl.load(token_map_ptr + t * 2 + 1)
    # lengths past the table behave as its width, negative ones as 0 (see attention.py)
    seq_len = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + req), 0), max_blocks * PAGE_SIZE)
    kv_len = tl.maximum(seq_len + pos_minus_len + 1, 0)
    visible_blocks = tl.cdiv(kv_len, PAGE_SIZE)
    num_chosen = tl.minimum(visible_blocks, TOPK)
    row = scores_ptr + head * stride_si + t * stride_st

    # [BLOCKS_PAD]
    key = _rank_keys(row, stride_sb, tl.arange(0, BLOCKS_PAD), visible_blocks, INIT_BLOCKS, LOCAL_BLOCKS,
                     BLOCKS_PAD)
    if CHUNK > 0:
        # Long rows: the TOPK_PAD best blocks lie in the TOPK_PAD chunks of CHUNK
        # blocks with the best maxima (a block outside them has TOPK_PAD better
        # chunk maxima above it). Keep only those chunks' blocks as candidates.
        chunk_best = tl.max(tl.reshape(key, [BLOCKS_PAD // CHUNK, CHUNK]), axis=1)
        top_chunks = _top(chunk_best, TOPK_PAD)
        chunk = (BLOCKS_PAD - 1 - (top_chunks & 0xFFFFFFFF).to(tl.int32)) // CHUNK
        # [TOPK_PAD, CHUNK] -> [TOPK_PAD * CHUNK]
        candidates = chunk[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        key = tl.reshape(_rank_keys(row, stride_sb, candidates, visible_blocks, INIT_BLOCKS, LOCAL_BLOCKS,
                                    BLOCKS_PAD), [TOPK_PAD * CHUNK])
    # [TOPK_PAD], best first (bitonic top-k: log-depth compare-exchange rounds);
    # the first num_chosen are the chosen blocks
    best = _top(key, TOPK_PAD)
    offs_k = tl.arange(0, TOPK_PAD)
    ids = tl.where(offs_k < num_chosen, BLOCKS_PAD - 1 - (best & 0xFFFFFFFF).to(tl.int32), BLOCKS_PAD)
    # -- ascending ids, then -1
    if TOPK_PAD > 1:
        ids = tl.sort(ids)
    ids = tl.where(ids < BLOCKS_PAD, ids, -1)
    out_row = ids_ptr + head * stride_oi + t * stride_ot
    tl.store(out_row + offs_k * stride_ok, ids, mask=offs_k < TOPK)
