"""Paged GQA attention over 128-token blocks, split-K (flash-decoding).

One kernel serves ``sparse_decode`` (the blocks each token's indexer chose),
``dense_decode`` (every visible block) and the prefill ops.

A program owns one (row tile, KV head, split):

* row tile: up to ``TOKENS_PER_TILE`` consecutive query tokens of ONE request
  times the ``GROUP`` query heads that read the KV head, packed as the rows of
  one MMA tile, so every K/V block is read once for all of them. ``tile_map``
  describes each tile (built on the host from shapes for decode, from
  ``cu_seqlens_q`` for prefill):
  ``[request, first token (global index), first token's position - seq_len, tokens]``.
* split: a contiguous share of the tile's block list. Dense: every visible
  block. Sparse, one token per tile: its TOPK slots, of which the split visits
  only the valid ones (-1 and out-of-range ids are skipped: a token that sees
  fewer than TOPK blocks costs its blocks, not TOPK). Sparse, several tokens
  per tile: the distinct blocks they chose (a block chosen by several tokens
  is done once, for all of them), so the tile reads each distinct chosen
  block once.

``SELECT`` (sparse, one token per tile): the program chooses its token's
blocks from the index scores itself, with ``select_blocks``' code
(``index.select_rows``), and writes them to ``ids_ptr``, so the MSA ops need
no selection launch before a one-split attention launch.

Each program writes its softmax-normalised partial output and log-sum-exp
(base 2); ``merge.merge_splits_kernel`` combines the splits. With one split the
program writes the final output itself.

Values (SPEC.md, "Values the kernels must survive"):

* ``seq_lens`` is clamped to ``[0, max_blocks * 128]`` on the device: no tile
  reads past its request's row of ``block_table``; negative lengths are padding.
* K/V rows past the tile's last visible position (stale rows of the last page,
  which may hold NaN/Inf) are never loaded: the loads are masked by the tile's
  KV length, the scores by each row's own position (exact causality). Dense
  tiles of 64+ rows (prefill) run the blocks that end before their first token
  without the mask (every row sees them whole): in a long prompt that is nearly
  every block (a 32k prompt 1.17x faster; decode tiles keep one loop).
* Rows that see nothing get zeros (lse -inf). A row with NaN or Inf in q is
  all NaN (its lse too, which the merge keeps), on every split count.

FP8 caches (``KV_DTYPE`` float8e4nv): K/V tiles are widened (exactly) to
float16 with a bfloat16 q (``common.fp16_operand``: one conversion instruction
per pair; q goes to float16 once, each row scaled by a power of two folded
into its score scale), to q's dtype otherwise, for the same MMAs (the
probabilities go to float16 too); ``K = stored * k_scale`` is folded into the score
scale and ``V = stored * v_scale`` applied once to each output row the program
writes (the output, and every split's partial, is linear in V). Both scales
are read from memory, so a captured graph or jitted step takes new values.
"""

import triton
import triton.language as tl

from .common import (PAGE_SIZE, fp16_operand, mma, multiple_of_16, pick, release_next_grid, tile_program, tile_row,
                     typed, visible_len, wait_for_previous_grid, whole_blocks_end)
from .index import select_rows


@triton.jit
def distinct_blocks(ids_ptr, stride_it, stride_is, ntok, req_blocks, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                    ENTRIES_PAD: tl.constexpr):
    """The distinct valid blocks chosen by a tile's ``ntok`` tokens (``ids_ptr``: its first token's row).

    Entry ``e`` is slot ``e % TOPK_PAD`` of tile token ``e // TOPK_PAD``. Returns
    ``(e_block, e_ok, e_rank)`` over the entries: the block id, whether the entry
    is a valid first occurrence (-1, out-of-range and repeated ids are not),
    and its rank among those (the order the tile visits the blocks in).
    """
    offs_e = tl.arange(0, ENTRIES_PAD)
    e_tok = offs_e // TOPK_PAD
    e_ok = (e_tok < ntok) & (offs_e % TOPK_PAD < TOPK)
    # [ENTRIES_PAD]
    e_block = tl.load(ids_ptr + e_tok * stride_it + (offs_e % TOPK_PAD) * stride_is, mask=e_ok, other=-1)
    e_ok = e_ok & (e_block >= 0) & (e_block < req_blocks)
    # [ENTRIES_PAD, ENTRIES_PAD]: entry e repeats an earlier entry
    repeat = (e_block[:, None] == e_block[None, :]) & (offs_e[None, :] < offs_e[:, None]) & e_ok[None, :]
    e_ok = e_ok & (tl.max(repeat.to(tl.int32), axis=1) == 0)
    return e_block, e_ok, tl.cumsum(e_ok.to(tl.int32), axis=0) - 1


@triton.jit(do_not_specialize=["max_blocks", "stride_si"])
def paged_attention_kernel(
    q_ptr,            # [T, Hq, D]                        q dtype
    k_ptr,            # [pages, Hk, PAGE_SIZE, D] @ k_off  KV_DTYPE (read through any buffer's pointer)
    v_ptr,            # [pages, Hk, PAGE_SIZE, D] @ v_off  KV_DTYPE
    block_ids_ptr,    # [Hk, T, TOPK] int32, distinct per row, -1 = empty slot (SPARSE, not SELECT)
    scores_ptr,       # [Hk, T, max_blocks] fp32 index scores (SELECT only)
    block_table_ptr,  # [R, max_blocks] int32
    seq_lens_ptr,     # [R] int32, KV length including the request's query tokens
    tile_map_ptr,     # [num_tiles, 4] int32, see the module docstring
    k_scale_ptr,      # [] fp32: K = stored K * k_scale (FP8 caches only; unread otherwise)
    v_scale_ptr,      # [] fp32: V = stored V * v_scale (FP8 caches only)
    qk_scale,         # sm_scale * log2(e)
    k_off, v_off,     # element offsets of the caches inside their buffers
    max_blocks,       # columns of block_table: no request reads past its row
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_kh, stride_kn, stride_kd,
    stride_vp, stride_vh, stride_vn, stride_vd,
    stride_ih, stride_it, stride_is,  # block ids: read (SPARSE), or written to ids_ptr (SELECT)
    stride_si, stride_st, stride_sb,
    stride_br, stride_bb,
    stride_ot, stride_oh, stride_os, stride_od,
    stride_lt, stride_lh, stride_ls,
    o_ptr,            # NUM_SPLITS == 1: out [T, Hq, D]; else partial out [T, Hq, NUM_SPLITS, D] fp32
    lse_ptr,          # [T, Hq, NUM_SPLITS] fp32 (base-2 log-sum-exp); unused when NUM_SPLITS == 1
    ids_ptr,          # [Hk, T, TOPK] int32: the blocks SELECT chose (unused otherwise)
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    ENTRIES_PAD: tl.constexpr,        # TOKENS_PER_TILE * TOPK_PAD (sparse)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STEP_GROUP: tl.constexpr,         # blocks whose page ids are gathered at once
    SPARSE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    KV_DTYPE: tl.constexpr,           # the caches' element type; float8e4nv: FP8, scaled
    TILES_ON_AXIS_0: tl.constexpr,    # grid (tiles, splits, KV heads), else (splits, tiles, KV heads)
    SELECT: tl.constexpr,             # one-token sparse tiles: choose the blocks from the scores here,
    INIT_BLOCKS: tl.constexpr,        # with select_blocks' rule and constants (index.select_rows;
    LOCAL_BLOCKS: tl.constexpr,       # unused otherwise)
    BLOCKS_PAD: tl.constexpr,
    SELECT_CHUNK: tl.constexpr,
    ALIGNED: tl.constexpr,            # q's, o's and the ids' row strides are multiples of 16 (common.aligned)
    PDL: tl.constexpr = False,        # launched as a programmatic dependent (common.release_next_grid)
):
    release_next_grid(PDL)
    # grid (splits, tiles, KV heads), or (tiles, splits, KV heads) past 65535 row tiles (a long prompt,
    # one token per tile). (Always one axis of (tile, split) compiled to other decode code: batch 128
    # at 16k took 11% longer.)
    tile, split = tile_program(TILES_ON_AXIS_0)
    kv_head = tl.program_id(2)
    KV_FP8: tl.constexpr = KV_DTYPE == tl.float8e4nv
    k_ptr, v_ptr = typed(k_ptr, KV_DTYPE), typed(v_ptr, KV_DTYPE)
    qk_scale = tl.full([], qk_scale, tl.float32)  # float32 from both launchers (m3_jax passes np.float32)
    k_off, v_off = multiple_of_16(k_off), multiple_of_16(v_off)
    stride_kp, stride_kh, stride_kn = multiple_of_16(stride_kp), multiple_of_16(stride_kh), multiple_of_16(stride_kn)
    stride_vp, stride_vh, stride_vn = multiple_of_16(stride_vp), multiple_of_16(stride_vh), multiple_of_16(stride_vn)
    if ALIGNED:   # then q / block-id rows load and out rows store as 16-byte vectors under jax-triton too
        stride_qt, stride_qh = multiple_of_16(stride_qt), multiple_of_16(stride_qh)
        stride_ot, stride_oh, stride_os = multiple_of_16(stride_ot), multiple_of_16(stride_oh), multiple_of_16(stride_os)
        stride_ih, stride_it = multiple_of_16(stride_ih), multiple_of_16(stride_it)

    # -- the tile's request, tokens and positions
    req, tok0, pos0_minus_len, ntok = tile_row(tile_map_ptr, tile)
    wait_for_previous_grid(PDL)   # the tile map is read; everything else may come from earlier kernels
    seq_len = visible_len(seq_lens_ptr, req, max_blocks)
    # A block past the request's last written block is never read: its page
    # table entry may hold garbage.
    req_blocks = tl.cdiv(seq_len, PAGE_SIZE)
    # KV rows the tile's last token sees: V rows past it (stale rows of the last
    # page, which may hold NaN/Inf) are never loaded.
    tile_kv_len = tl.maximum(seq_len + pos0_minus_len + ntok, 0)
    tile_blocks = tl.cdiv(tile_kv_len, PAGE_SIZE)
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    m_tok = offs_m // GROUP_PAD                      # tile-local token of each row
    m_head = kv_head * GROUP + offs_m % GROUP_PAD    # query head of each row
    m_valid = (m_tok < ntok) & (offs_m % GROUP_PAD < GROUP)
    m_pos = seq_len + pos0_minus_len + m_tok         # each row's query position
    m_t = tok0 + m_tok

    # [BLOCK_M, D]
    q = tl.load(q_ptr + m_t[:, None] * stride_qt + m_head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=m_valid[:, None], other=0.0)
    # [BLOCK_M]: rows whose query holds NaN or Inf and that see something come out NaN.
    # Their scores are NaN or +-Inf anyway, but an Inf whose scores are all -inf
    # would look like an empty row. (Rewriting q itself costs ~10% in 128-row tiles.)
    q_bad = (tl.max(((q != q) | (tl.abs(q) == float("inf"))).to(tl.int32), axis=1) > 0) & (m_pos >= 0)
    row_scale = qk_scale
    if KV_FP8 and q.dtype == tl.bfloat16:
        q, q_unscale = fp16_operand(q)   # FP8 K/V then widen to float16 in one instruction per pair
        row_scale = (qk_scale * q_unscale)[:, None]   # [BLOCK_M, 1]: each row's power of two

    if SPARSE:
        if TOKENS_PER_TILE == 1:
            # one token: walk its TOPK slots; -1 or out-of-range ids are masked
            num_steps = TOPK
            if SELECT:
                # the token's blocks from its scores ([TOPK_PAD], ascending, then -1: select_blocks'
                # code); each split would choose the same, split 0 writes them (the launch layer
                # selects here only in launches of one split: launches.Selection)
                offs_s = tl.arange(0, TOPK_PAD)
                score_row = scores_ptr + kv_head * stride_si + tok0 * stride_st
                chosen = tl.reshape(select_rows(score_row + tl.zeros([1, 1], tl.int32), stride_sb,
                                                tile_blocks + tl.zeros([1, 1], tl.int32), TOPK, TOPK_PAD,
                                                INIT_BLOCKS, LOCAL_BLOCKS, BLOCKS_PAD, SELECT_CHUNK), [TOPK_PAD])
                tl.store(ids_ptr + kv_head * stride_ih + tok0 * stride_it + offs_s * stride_is, chosen,
                         mask=(offs_s < TOPK) & (split == 0) & (ntok > 0))
        else:
            # several tokens: the tile's distinct chosen blocks, each done once for all of them
            e_block, e_ok, e_rank = distinct_blocks(block_ids_ptr + kv_head * stride_ih + tok0 * stride_it,
                                                    stride_it, stride_is, ntok, req_blocks, TOPK, TOPK_PAD,
                                                    ENTRIES_PAD)
            num_steps = tl.sum(e_ok.to(tl.int32), axis=0)
            # [BLOCK_M, TOPK_PAD]: each row's chosen blocks
            offs_s = tl.arange(0, TOPK_PAD)
            m_ids = tl.load(block_ids_ptr + kv_head * stride_ih + m_t[:, None] * stride_it
                            + offs_s[None, :] * stride_is,
                            mask=m_valid[:, None] & (offs_s[None, :] < TOPK), other=-1)
    else:
        num_steps = tile_blocks

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    k_base = k_ptr + k_off + kv_head * stride_kh
    v_base = v_ptr + v_off + kv_head * stride_vh
    ids_base = block_ids_ptr + kv_head * stride_ih + tok0 * stride_it
    # This split's contiguous share of the block list, STEP_GROUP blocks at a
    # time: their page ids are gathered up front, so the K/V loads of the inner
    # loop wait on no other load and pipeline.
    SUBTILES: tl.constexpr = PAGE_SIZE // BLOCK_N
    per_split = tl.cdiv(num_steps, NUM_SPLITS)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, num_steps)
    # Dense tiles of 64+ rows (prefill): the blocks before `whole` are seen in full by every row of
    # the tile (they end at or before its first token), so they run without the causal mask (phase
    # 0); the rest with it (phase 1). Sparse and small (decode) tiles run phase 1 only: one loop.
    MASK_ALL: tl.constexpr = SPARSE or BLOCK_M < 64
    if MASK_ALL:
        whole = lo
    else:
        whole = whole_blocks_end(seq_len + pos0_minus_len, lo, hi)
    offs_g = tl.arange(0, STEP_GROUP)
    for phase in tl.static_range(1 if MASK_ALL else 0, 2):
        p_lo = whole if phase == 1 else lo
        p_hi = hi if phase == 1 else whole
        for g0 in range(p_lo, p_hi, STEP_GROUP):
            g_step = g0 + offs_g
            g_in = g_step < p_hi
            g_len = tl.minimum(p_hi - g0, STEP_GROUP)   # blocks this group visits
            if SPARSE:
                if TOKENS_PER_TILE == 1:
                    # [STEP_GROUP]
                    if SELECT:
                        nth = offs_s[None, :] == g_step[:, None]
                        g_block = tl.where(g_in, tl.max(tl.where(nth, chosen[None, :], -1), axis=1), -1)
                    else:
                        g_block = tl.load(ids_base + g_step * stride_is, mask=g_in, other=-1)
                    g_ok = g_in & (g_block >= 0) & (g_block < req_blocks)
                    # the valid slots only, in slot order: a token that sees fewer than TOPK blocks
                    # (short contexts) runs fewer iterations (an empty slot's would change nothing)
                    g_len = tl.sum(g_ok.to(tl.int32), axis=0)
                    nth = g_ok[None, :] & ((tl.cumsum(g_ok.to(tl.int32), axis=0) - 1)[None, :] == offs_g[:, None])
                    g_block = tl.max(tl.where(nth, g_block[None, :], -1), axis=1)
                    g_ok = offs_g < g_len
                else:
                    # [STEP_GROUP, ENTRIES_PAD] -> the g_step-th distinct block
                    nth = e_ok[None, :] & (e_rank[None, :] == g_step[:, None])
                    g_block = tl.max(tl.where(nth, e_block[None, :], -1), axis=1)
                    g_ok = g_in & (g_block >= 0)
            else:
                g_block = g_step
                g_ok = g_in
            g_page = tl.load(block_table_ptr + req * stride_br + g_block * stride_bb, mask=g_ok, other=0)
            for it in range(0, g_len * SUBTILES):
                j = it // SUBTILES
                kv_tok = (it - j * SUBTILES) * BLOCK_N + offs_n
                block = pick(g_block, offs_g, j)
                page = pick(g_page, offs_g, j).to(tl.int64)
                block_ok = pick(g_ok.to(tl.int32), offs_g, j) > 0
                kv_pos = block * PAGE_SIZE + kv_tok
                # [BLOCK_N, D] in q's dtype (FP8: widened, exactly). K rows no token sees only
                # feed scores that are replaced by -inf below; V rows are multiplied (0 x NaN =
                # NaN), so only rows some token of the tile sees are loaded: stale rows may hold NaN/Inf.
                k = tl.load(k_base + page * stride_kp + kv_tok[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                            mask=block_ok, other=0.0).to(q.dtype)
                if phase == 1:   # the causal mask
                    v_ok = (block_ok & (kv_pos < tile_kv_len))[:, None]
                else:
                    v_ok = block_ok
                v = tl.load(v_base + page * stride_vp + kv_tok[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                            mask=v_ok, other=0.0).to(q.dtype)
                # [BLOCK_M, BLOCK_N]
                s = mma(q, tl.trans(k)) * row_scale
                if phase == 1:   # the causal mask
                    if SPARSE:
                        if TOKENS_PER_TILE == 1:
                            m_member = m_valid & block_ok
                        else:
                            m_member = tl.max((m_ids == block).to(tl.int32), axis=1) > 0
                    else:
                        m_member = m_valid
                    visible = m_member[:, None] & (kv_pos[None, :] <= m_pos[:, None])
                    s = tl.where(visible, s, float("-inf"))
                # -- online softmax; a row with nothing visible yet keeps m = -inf
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_base)
                p = tl.exp2(s - m_base[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + mma(p.to(v.dtype), v)
                m_i = m_new

    # -- write: rows that saw nothing get zeros (and lse = -inf); a NaN row stays NaN
    seen = l_i != 0.0
    out = tl.where(q_bad[:, None], float("nan"), acc / tl.where(seen, l_i, 1.0)[:, None])
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)
    o_rows = o_ptr + m_t * stride_ot + m_head * stride_oh
    if NUM_SPLITS == 1:
        tl.store(o_rows[:, None] + offs_d[None, :] * stride_od, out.to(o_ptr.dtype.element_ty), mask=m_valid[:, None])
    else:
        tl.store(o_rows[:, None] + split * stride_os + offs_d[None, :] * stride_od, out, mask=m_valid[:, None])
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        lse = tl.where(q_bad, float("nan"), lse)   # not an empty split: the merged row is NaN
        tl.store(lse_ptr + m_t * stride_lt + m_head * stride_lh + split * stride_ls, lse, mask=m_valid)
