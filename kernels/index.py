"""The MSA indexer: per-block causal max scores, then top-k block selection.

``index_scores_kernel``: a program owns one row tile (up to ``TOKENS_PER_TILE``
query tokens of one request times all index heads, packed as MMA rows) and a
contiguous chunk of logical blocks. Each index-K page is read once for all
heads and tokens of the tile: for decode with ``TOKENS_PER_TILE >= n`` that is
once per request. ``SKIP_BLOCKS > 0`` (the MSA ops pass ``topk``): a tile whose
tokens all see at most that many blocks writes nothing, since selection takes
every visible block of such a token without reading its scores; the public
``index_scores`` passes 0 and scores every tile. ``tile_map`` rows: ``[request, first token, first token's
position - seq_len, tokens]`` (see attention.py). Lengths are clamped and
index-K rows past the tile's last visible position never loaded, as in
attention.py; a NaN/Inf query row scores NaN on the blocks it sees. An FP8
(float8e4nv, unscaled) index-K cache is widened for the dot, exactly: to
float16 with a bfloat16 query (``common.fp16_operand``: one conversion
instruction per pair of keys) or an FP8 one (whose cache is always FP8), to
the query's dtype otherwise.

``select_blocks_kernel``: one program per index head and ``BLOCK_T`` tokens (one
on a GPU, many in the interpreter, whose cost is per program). A row's
visible scores sit in registers as 64-bit keys (score, then lower id; forced
init/local blocks rank +inf, NaN ranks -inf but still beats nothing; a row with
at most ``TOPK`` visible blocks takes them all and reads no score); a
bitonic top-k picks the best ``TOPK`` in log-depth rounds (long rows: first
the best chunks, then the best blocks inside them), and a sort writes the
chosen ids ascending, then -1.
"""

import triton
import triton.language as tl

from .common import (PAGE_SIZE, fp16_operand, mma, multiple_of_16, pick, release_next_grid, tile_program, tile_row,
                     typed, visible_len, wait_for_previous_grid, whole_blocks_end)


@triton.jit(do_not_specialize=["max_blocks", "blocks_per_program", "stride_si"])
def index_scores_kernel(
    q_ptr,            # [T, Hi, Di]                   q dtype
    k_ptr,            # [pages, PAGE_SIZE, Di] @ k_off  K_DTYPE (one shared head; any buffer's pointer)
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
    K_DTYPE: tl.constexpr,            # the index-K cache's element type (float8e4nv: FP8, unscaled)
    SKIP_BLOCKS: tl.constexpr,        # > 0: tiles that see at most this many blocks write nothing
    TILES_ON_AXIS_0: tl.constexpr,    # grid (tiles, chunks), else (chunks, tiles)
    ALIGNED: tl.constexpr,            # q's token and head strides are multiples of 16 (common.aligned)
    PDL: tl.constexpr = False,        # launched as a programmatic dependent (common.release_next_grid)
):
    release_next_grid(PDL)
    tile, chunk = tile_program(TILES_ON_AXIS_0)   # grid (chunks, tiles), or (tiles, chunks)
    k_ptr = typed(k_ptr, K_DTYPE)
    k_off = multiple_of_16(k_off)
    stride_kp, stride_kn = multiple_of_16(stride_kp), multiple_of_16(stride_kn)
    if ALIGNED:   # then q rows load as 16-byte vectors under jax-triton too
        stride_qt, stride_qh = multiple_of_16(stride_qt), multiple_of_16(stride_qh)

    req, tok0, pos0_minus_len, ntok = tile_row(tile_map_ptr, tile)
    wait_for_previous_grid(PDL)   # the tile map is read; everything else may come from earlier kernels
    seq_len = visible_len(seq_lens_ptr, req, max_blocks)
    # blocks some token of the tile sees
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
    q_unscale = 1.0
    if q.dtype == tl.float8e4nv:
        tl.static_assert(K_DTYPE == tl.float8e4nv, "an FP8 index query needs an FP8 index-K cache")
        q = q.to(tl.float16)             # every e4m3 value is a float16
    elif K_DTYPE == tl.float8e4nv and q.dtype == tl.bfloat16:
        q, q_unscale = fp16_operand(q)   # FP8 keys widen to float16 in one instruction per pair; [BLOCK_M]
    # [BLOCK_M]: NaN or Inf in a row's query makes its visible blocks' scores NaN (widening keeps both)
    q_bad = tl.max(((q != q) | (tl.abs(q) == float("inf"))).to(tl.int32), axis=1) > 0

    b_begin = chunk * blocks_per_program
    b_end = tl.minimum(b_begin + blocks_per_program, max_blocks)
    if SKIP_BLOCKS > 0:
        b_end = tl.where(tile_blocks <= SKIP_BLOCKS, b_begin, b_end)   # both loops below: no iterations

    score_rows = scores_ptr + m_head * stride_si + m_t * stride_st
    # visible blocks, STEP_GROUP at a time: page ids gathered up front so the
    # index-K loads of the inner loop wait on no other load and pipeline.
    # Tiles of 64+ rows (prefill): blocks before `whole` end at or before the tile's first token;
    # every row sees them in full, so they run without the causal mask (phase 0), the rest with it.
    # Decode tiles keep one masked loop (two cost them 3-6%, up to 30% at 1k with n = 8).
    MASK_ALL: tl.constexpr = BLOCK_M < 64
    seen_end = tl.minimum(b_end, tile_blocks)
    if MASK_ALL:
        whole = b_begin
    else:
        whole = whole_blocks_end(seq_len + pos0_minus_len, b_begin, seen_end)
    offs_g = tl.arange(0, STEP_GROUP)
    for phase in tl.static_range(1 if MASK_ALL else 0, 2):
        p_lo = whole if phase == 1 else b_begin
        p_hi = seen_end if phase == 1 else whole
        for g0 in range(p_lo, p_hi, STEP_GROUP):
            g_page = tl.load(block_table_ptr + req * stride_br + (g0 + offs_g) * stride_bb,
                             mask=g0 + offs_g < p_hi, other=0)
            for j in range(0, tl.minimum(p_hi - g0, STEP_GROUP)):
                block = g0 + j
                page = pick(g_page, offs_g, j).to(tl.int64)
                best = tl.full([BLOCK_M], float("-inf"), tl.float32)
                for n0 in tl.static_range(0, PAGE_SIZE, BLOCK_N):
                    kv_tok = n0 + offs_n
                    # [BLOCK_N, Di] in q's dtype (FP8: widened, exactly)
                    # stale rows (maybe NaN/Inf) only feed scores that tl.where replaces by -inf
                    k = tl.load(k_ptr + k_off + page * stride_kp + kv_tok[:, None] * stride_kn
                                + offs_d[None, :] * stride_kd).to(q.dtype)
                    # [BLOCK_M, BLOCK_N]
                    s = mma(q, tl.trans(k))
                    if phase == 1:   # the causal mask
                        s = tl.where(block * PAGE_SIZE + kv_tok[None, :] <= m_pos[:, None], s, float("-inf"))
                    best = tl.maximum(best, tl.max(s, axis=1))
                best = tl.where(q_bad & (block * PAGE_SIZE <= m_pos), float("nan"), best * q_unscale)
                tl.store(score_rows + block * stride_sb, best, mask=m_valid)
    # blocks no token of the tile sees
    for block in range(tl.maximum(b_begin, tile_blocks), b_end):
        tl.store(score_rows + block * stride_sb, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=m_valid)


@triton.jit
def _rank_keys(row_ptr, stride_sb, blocks, visible_blocks, TOPK: tl.constexpr, INIT_BLOCKS: tl.constexpr,
               LOCAL_BLOCKS: tl.constexpr, BLOCKS_PAD: tl.constexpr):
    """One int64 key per block id in ``blocks``: larger = chosen first.

    High half: the rank key's order-preserving int32 image (forced blocks +inf,
    NaN -inf, -0.0 as +0.0; blocks past the visible ones below everything).
    Low half: the complement of the block id, so equal scores go to the lower
    id and no two keys are equal.
    """
    visible = blocks < visible_blocks
    # a row with at most TOPK visible blocks takes them all: its scores are not read (the MSA ops skip
    # scoring such rows), every visible block ranks alike
    score = tl.load(row_ptr + blocks * stride_sb, mask=visible & (visible_blocks > TOPK), other=float("-inf"))
    rank = tl.where(score != score, float("-inf"), score)
    rank = tl.where(rank == 0.0, 0.0, rank)
    forced = (blocks < INIT_BLOCKS) | (blocks >= visible_blocks - LOCAL_BLOCKS)
    rank = tl.where(forced, float("inf"), rank)
    bits = rank.to(tl.int32, bitcast=True)
    ordered = tl.where(visible, bits ^ ((bits >> 31) & 0x7FFFFFFF), -0x80000000)
    return (ordered.to(tl.int64) << 32) | (BLOCKS_PAD - 1 - blocks).to(tl.int64)


@triton.jit
def _top(keys, K: tl.constexpr):
    """The ``K`` largest of each row of ``keys`` [rows, n], largest first (``tl.topk`` cannot take K = 1)."""
    if K == 1:
        top = tl.max(keys, axis=1, keep_dims=True)
    else:
        top = tl.topk(keys, K)
    return top


@triton.jit
def select_rows(rows, stride_sb, visible_blocks, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                INIT_BLOCKS: tl.constexpr, LOCAL_BLOCKS: tl.constexpr, BLOCKS_PAD: tl.constexpr,
                CHUNK: tl.constexpr):
    """The chosen blocks of score rows: ``rows`` ``[R, 1]`` pointers to their first scores,
    ``visible_blocks`` ``[R, 1]`` -> ``[R, TOPK_PAD]`` int32, each row's ids ascending, then -1.

    ``select_blocks_kernel`` runs it on its tokens; sparse attention with one token per tile
    (``attention.py``, ``SELECT``) on its token, so a one-split attention launch needs no
    selection launch before it.
    """
    BLOCK_T: tl.constexpr = rows.shape[0]
    num_chosen = tl.minimum(visible_blocks, TOPK)
    # [BLOCK_T, BLOCKS_PAD]
    key = _rank_keys(rows, stride_sb, tl.arange(0, BLOCKS_PAD)[None, :], visible_blocks, TOPK, INIT_BLOCKS,
                     LOCAL_BLOCKS, BLOCKS_PAD)
    if CHUNK > 0:
        # Long rows: the TOPK_PAD best blocks lie in the TOPK_PAD chunks of CHUNK
        # blocks with the best maxima (a block outside them has TOPK_PAD better
        # chunk maxima above it). Keep only those chunks' blocks as candidates.
        chunk_best = tl.max(tl.reshape(key, [BLOCK_T, BLOCKS_PAD // CHUNK, CHUNK]), axis=2)
        top_chunks = _top(chunk_best, TOPK_PAD)
        chunk = (BLOCKS_PAD - 1 - (top_chunks & 0xFFFFFFFF).to(tl.int32)) // CHUNK
        # [BLOCK_T, TOPK_PAD, CHUNK] -> [BLOCK_T, TOPK_PAD * CHUNK]
        candidates = chunk[:, :, None] * CHUNK + tl.arange(0, CHUNK)[None, None, :]
        key = tl.reshape(_rank_keys(rows[:, :, None], stride_sb, candidates, visible_blocks[:, :, None],
                                    TOPK, INIT_BLOCKS, LOCAL_BLOCKS, BLOCKS_PAD), [BLOCK_T, TOPK_PAD * CHUNK])
    # [BLOCK_T, TOPK_PAD], best first (bitonic top-k: log-depth compare-exchange
    # rounds); the first num_chosen of a row are its chosen blocks
    best = _top(key, TOPK_PAD)
    offs_k = tl.arange(0, TOPK_PAD)[None, :]
    ids = tl.where(offs_k < num_chosen, BLOCKS_PAD - 1 - (best & 0xFFFFFFFF).to(tl.int32), BLOCKS_PAD)
    # -- ascending ids, then -1
    if TOPK_PAD > 1:
        ids = tl.sort(ids)
    return tl.where(ids < BLOCKS_PAD, ids, -1)


@triton.jit(do_not_specialize=["num_tokens", "max_blocks", "stride_si"])
def select_blocks_kernel(
    scores_ptr,       # [Hi, T, max_blocks] fp32, any strides
    seq_lens_ptr,     # [R] int32
    token_map_ptr,    # [T, 2] int32: request, position - seq_len
    stride_si, stride_st, stride_sb,
    stride_oi, stride_ot, stride_ok,
    num_tokens,
    max_blocks,
    ids_ptr,          # [Hi, T, TOPK] int32, any strides
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    INIT_BLOCKS: tl.constexpr,
    LOCAL_BLOCKS: tl.constexpr,
    BLOCKS_PAD: tl.constexpr,
    CHUNK: tl.constexpr,              # 0: one top-k over the row; else two levels (select_rows)
    BLOCK_T: tl.constexpr,            # tokens per program (rows of every tensor below)
    PDL: tl.constexpr = False,        # launched as a programmatic dependent (common.release_next_grid)
):
    release_next_grid(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    t_ok = offs_t < num_tokens
    req = tl.load(token_map_ptr + offs_t * 2, mask=t_ok, other=0)
    pos_minus_len = tl.load(token_map_ptr + offs_t * 2 + 1, mask=t_ok, other=-(1 << 30))
    wait_for_previous_grid(PDL)   # the token map is read; everything else may come from earlier kernels
    kv_len = tl.maximum(visible_len(seq_lens_ptr, req, max_blocks) + pos_minus_len + 1, 0)
    # [BLOCK_T, 1]
    visible_blocks = tl.cdiv(kv_len, PAGE_SIZE)[:, None]
    rows = scores_ptr + head * stride_si + offs_t[:, None] * stride_st
    ids = select_rows(rows, stride_sb, visible_blocks, TOPK, TOPK_PAD, INIT_BLOCKS, LOCAL_BLOCKS, BLOCKS_PAD, CHUNK)
    offs_k = tl.arange(0, TOPK_PAD)[None, :]
    out = ids_ptr + head * stride_oi + offs_t[:, None] * stride_ot + offs_k * stride_ok
    tl.store(out, ids, mask=t_ok[:, None] & (offs_k < TOPK))
