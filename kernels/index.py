"""The MSA indexer: per-block causal max scores, then top-k block selection.

``index_scores_kernel``: a program owns one row tile (up to ``TOKENS_PER_TILE``
query tokens of one request times all index heads, packed as MMA rows) and a
contiguous chunk of logical blocks. Each index-K page is read once for all
heads and tokens of the tile: for decode with ``TOKENS_PER_TILE >= n`` that is
once per request. ``tile_map`` rows: ``[request, first token, first token's
position - seq_len, tokens]`` (see attention.py).

``select_blocks_kernel``: one program per (token, index head). The row's
visible scores sit in registers; ``TOPK`` rounds of "max, lowest id among the
maxima" pick the blocks (forced init/local blocks rank +inf, NaN ranks -inf
but still beats nothing), then a prefix sum writes the chosen ids ascending
and -1 after them. No sort: k is 16 and rows hold at most a few thousand.
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
    seq_len = tl.load(seq_lens_ptr + req)
    tile_blocks = tl.cdiv(tl.maximum(seq_len + pos0_minus_len + ntok, 0), PAGE_SIZE)

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
                # [BLOCK_N, Di]
                k = tl.load(k_ptr + k_off + page * stride_kp + kv_tok[:, None] * stride_kn
                            + offs_d[None, :] * stride_kd)
                # [BLOCK_M, BLOCK_N]
                s = mma(q, tl.trans(k))
                s = tl.where(block * PAGE_SIZE + kv_tok[None, :] <= m_pos[:, None], s, float("-inf"))
                best = tl.maximum(best, tl.max(s, axis=1))
            tl.store(score_rows + block * stride_sb, best, mask=m_valid)
    # blocks no token of the tile sees
    for block in range(tl.maximum(b_begin, tile_blocks), b_end):
        tl.store(score_rows + block * stride_sb, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=m_valid)


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
):
    t = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.load(token_map_ptr + t * 2)
    pos_minus_len = tl.load(token_map_ptr + t * 2 + 1)
    seq_len = tl.load(seq_lens_ptr + req)
    kv_len = tl.maximum(seq_len + pos_minus_len + 1, 0)
    visible_blocks = tl.minimum(tl.cdiv(kv_len, PAGE_SIZE), max_blocks)
    num_chosen = tl.minimum(visible_blocks, TOPK)

    offs_b = tl.arange(0, BLOCKS_PAD)
    visible = offs_b < visible_blocks
    # [BLOCKS_PAD]
    score = tl.load(scores_ptr + head * stride_si + t * stride_st + offs_b * stride_sb, mask=visible,
                    other=float("-inf"))
    rank_key = tl.where(score != score, float("-inf"), score)  # NaN loses
    forced = (offs_b < INIT_BLOCKS) | (offs_b >= visible_blocks - LOCAL_BLOCKS)
    rank_key = tl.where(forced, float("inf"), rank_key)

    available = visible
    chosen = offs_b < 0
    for k in tl.static_range(TOPK):
        best = tl.max(tl.where(available, rank_key, float("-inf")), axis=0)
        pick = tl.min(tl.where(available & (rank_key == best), offs_b, BLOCKS_PAD), axis=0)
        hit = (offs_b == pick) & (k < num_chosen)
        chosen = chosen | hit
        available = available & ~hit

    # -- ascending ids, then -1
    slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    out_row = ids_ptr + head * stride_oi + t * stride_ot
    tl.store(out_row + slot * stride_ok, offs_b, mask=chosen)
    offs_k = tl.arange(0, TOPK_PAD)
    tl.store(out_row + offs_k * stride_ok, tl.full([TOPK_PAD], -1, tl.int32),
             mask=(offs_k >= num_chosen) & (offs_k < TOPK))
