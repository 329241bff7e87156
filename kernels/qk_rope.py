"""q/k norms, RoPE and the cache write of one attention layer, from the fused projection.

Input: a row of ``qkv [T, Hq*D + 2*Hk*D (+ Hi*Di + Di)]``, the output of the
models' fused projection (``M3Model._project``): q heads, k heads, v heads,
and on sparse layers the index-q heads (``Hi == Hk``) and the one index-k head.
Per token:

    q     = rope(rms_norm(q_h, q_norm), rotary_dim)                  -> q_ptr [T, Hq, D]
    k     = rope(rms_norm(k_h, k_norm), rotary_dim)                  -> the K cache row of slot_mapping[t]
    v     = v_h                                                      -> the V cache row
    idx_q = rope(rms_norm(iq_h, index_q_norm), index_rotary_dim)     -> index_q_ptr [T, Hi, Di]  (SPARSE)
    idx_k = rope(rms_norm(ik, index_k_norm), index_rotary_dim)       -> the index-K cache row    (SPARSE)

``rms_norm`` is ``norm.inv_rms`` per head (the models' Gemma RMSNorm, its sum
of squares exact), rounded to the model dtype. ``rope(x, R)`` rotates the
first R channels in the rotate-half form: channel j < R/2 pairs with j + R/2,
``out = x * cos + rotate_half(x) * sin``, with ``angle[j] = float(position) *
inv_freq[j mod (rotary_dim / 2)]`` in float32 (the models' ``cat(freqs,
freqs)`` table, of which the index RoPE takes the first
``index_rotary_dim = min(rotary_dim, Di)`` columns), and cos / sin of it
rounded to float32 and then to the model dtype as ``rope_cos_sin`` rounds
them. They are evaluated in float64 (on GPUs libdevice's ``cos``/``sin`` with
full range reduction: angles reach 5e5 radians at long positions, where
float32 approximations fail), so the float32 value is the correctly rounded
one but in rare double-rounding cases. Both products are rounded to
the dtype and then their float32 sum (torch's bf16/fp16 arithmetic, which the
unfused model does op by op); channels past R pass unchanged.

No FMA contraction: GPUs compile this kernel with ``enable_fp_fusion=False``.
With fusion on, LLVM narrowed ``round(round(x * cos) + round(r * sin))`` of
bf16 values to bf16 operations and fused them into ``fma.rn.bf16`` (the
product unrounded): 12% of q's values were an ulp from the model's on an H200.

Where the rounding can differ from the unfused torch model: the sum of
squares (exact here, float32 in the model's order; ``norm.py``), the inverse
square root (sqrt then an IEEE division here), cos / sin (rounded from float64
here, torch's float32 functions there). Each is a float32 rounding; in
bf16 / fp16 they show as a rare one-ulp difference.

Caches (as ``cache_write.py``): views of ONE buffer, ``pool_ptr``, at element
offsets ``k_off`` / ``v_off`` / ``index_k_off`` and their strides, each read
as its own dtype (``KV_DTYPE``, ``INDEX_DTYPE``); token t goes to row
``slot_mapping[t] % PAGE_SIZE`` of page ``slot_mapping[t] // PAGE_SIZE``, -1
skips it. FP8 caches store ``common.to_e4m3`` of the dtype-rounded rows (K/V
divided by ``k_scale`` / ``v_scale``, index-K unscaled): the bytes
``write_cache`` stores from the same rows.

Grid: ``(token tiles of BLOCK_T, 1 + q-head groups of Q_HEADS)``. Program
(i, 0) does the token tile's k, v, idx_q and idx_k (and its cache writes);
program (i, g >= 1) its q heads ``[(g - 1) * Q_HEADS, g * Q_HEADS)``. GPUs run
one token per program (the real model: 4 programs of 16 q heads and one of
4 k, 4 v, 4 index-q heads and the index-k head per token); the interpreter many
tokens and all q heads.

Same bits from torch and JAX: every operation is elementwise or an exact
reduction (the norms' integer sums, maxima), so nothing depends on the
register layout the compiler picks for either framework (compiled for sm_90
as torch and as jax-triton build it, the two kernels are the same
instructions). ``ALIGNED`` (``step_launches.qk_rope_aligned``) gives jax-triton's build the
divisibility facts torch's has, so both vectorize their loads and stores.

The host side (shapes and dtypes only) is shared by both launchers:
``validate.check_qk_rope_call``, ``tuning.qk_rope``, ``step_launches.qk_norm_rope``.
"""

import triton
import triton.language as tl

from .common import PAGE_SIZE, multiple_of_16, release_next_grid, to_e4m3, typed, wait_for_previous_grid
from .norm import inv_rms


@triton.jit
def norm_rope(src, m, weight_ptr, inv_freq_ptr, pos, eps, stride_c,
              DIM: tl.constexpr, ROT: tl.constexpr, HALF_TABLE: tl.constexpr):
    """RMSNorm then RoPE of heads of DIM channels -> [BLOCK_T, HEADS, DIM] float32 (values of the model dtype
    but the last rounding, which the caller's store does).

    src:  [BLOCK_T, HEADS, 1] pointers to channel 0 of each head (channel j at ``src + j * stride_c``);
    m:    [BLOCK_T, HEADS, 1] heads to load (others read as 0); weight_ptr: [DIM] the norm's weight;
    pos:  [BLOCK_T] float32 positions; ROT: channels rotated; HALF_TABLE: rotary_dim / 2 (inv_freq's length)."""
    dtype = src.dtype.element_ty
    d = tl.arange(0, DIM)[None, None, :]
    x = tl.load(src + d * stride_c, mask=m, other=0.0).to(tl.float32)
    inv = inv_rms(x, DIM, eps, 2)[:, :, None]
    normed = ((x * inv) * (1.0 + tl.load(weight_ptr + d).to(tl.float32))).to(dtype).to(tl.float32)
    # rotate_half: channel j < R/2 takes -x[j + R/2], j in [R/2, R) takes x[j - R/2]; normed like x itself
    HALF: tl.constexpr = ROT // 2
    partner = tl.where(d < HALF, d + HALF, tl.where(d < ROT, d - HALF, d))
    xp = tl.load(src + partner * stride_c, mask=m, other=0.0).to(tl.float32)
    normed_p = ((xp * inv) * (1.0 + tl.load(weight_ptr + partner).to(tl.float32))).to(dtype).to(tl.float32)
    rotated = tl.where(d < HALF, -normed_p, normed_p)
    # [BLOCK_T, 1, DIM]: the models' cos / sin table, in the model dtype
    freq = tl.load(inv_freq_ptr + d % HALF_TABLE, mask=d < ROT, other=0.0)
    angle = (pos[:, None, None] * freq).to(tl.float64)   # the float32 angle, exactly
    cos = tl.cos(angle).to(tl.float32).to(dtype).to(tl.float32)
    sin = tl.sin(angle).to(tl.float32).to(dtype).to(tl.float32)
    roped = (normed * cos).to(dtype).to(tl.float32) + (rotated * sin).to(dtype).to(tl.float32)
    return tl.where(d < ROT, roped, normed)


@triton.jit(do_not_specialize=["num_tokens"])
def qk_norm_rope_kernel(
    qkv_ptr,           # [T, W] bf16 / fp16 / fp32, strides (stride_xt, stride_xc): q | k | v (| index q | index k)
    positions_ptr,     # [T] int32 / int64
    inv_freq_ptr,      # [ROTARY_DIM // 2] fp32
    q_norm_ptr,        # [D] any float dtype, unit stride (norm scale 1 + w)
    k_norm_ptr,        # [D]
    index_q_norm_ptr,  # [Di] (read if SPARSE)
    index_k_norm_ptr,  # [Di] (read if SPARSE)
    slot_mapping_ptr,  # [T] int32 / int64: slot * PAGE_SIZE + row in page, -1 = skip
    k_scale_ptr,       # [] fp32: stored K = saturate(K / k_scale) (FP8 K/V only; unread otherwise)
    v_scale_ptr,       # [] fp32: stored V = saturate(V / v_scale)
    pool_in_ptr,       # the pool as the aliased input (jax-triton passes it; torch passes the pool twice)
    k_off, v_off, index_k_off,   # offsets of the layer's caches in the pool, in KV_DTYPE / INDEX_DTYPE elements
    stride_ckp, stride_ckh, stride_ckn, stride_ckd,  # k_cache [slots, Hk, PAGE_SIZE, D] @ k_off
    stride_cvp, stride_cvh, stride_cvn, stride_cvd,  # v_cache [slots, Hk, PAGE_SIZE, D] @ v_off
    stride_cip, stride_cin, stride_cid,              # index_k_cache [slots, PAGE_SIZE, Di] @ index_k_off
    stride_xt, stride_xc,
    num_tokens, eps,
    q_ptr,             # [T, Hq, D] out, qkv's dtype, contiguous
    index_q_ptr,       # [T, Hk, Di] out, qkv's dtype, contiguous (written if SPARSE)
    pool_ptr,          # flat pool buffer, written in place
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,        # also the index-q heads
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INDEX_HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    INDEX_ROTARY_DIM: tl.constexpr,    # min(ROTARY_DIM, INDEX_HEAD_DIM)
    SPARSE: tl.constexpr,              # the index heads are there (and their cache)
    BLOCK_T: tl.constexpr,             # tokens per program
    Q_HEADS: tl.constexpr,             # q heads per program (a power of two)
    KV_DTYPE: tl.constexpr,            # element type of the K/V caches (float8e4nv: FP8, scaled)
    INDEX_DTYPE: tl.constexpr,         # element type of the index-K cache (float8e4nv: FP8, unscaled)
    ALIGNED: tl.constexpr,             # qkv's row stride, the cache offsets and strides but the last are
                                       # multiples of 16 (``common.aligned``): stated for the compiler
    PDL: tl.constexpr = False,
):
    release_next_grid(PDL)
    wait_for_previous_grid(PDL)   # no map of its own: everything it reads may come from earlier kernels
    if ALIGNED:
        stride_xt = multiple_of_16(stride_xt)
        k_off, v_off, index_k_off = multiple_of_16(k_off), multiple_of_16(v_off), multiple_of_16(index_k_off)
        stride_ckp, stride_cvp, stride_cip = multiple_of_16(stride_ckp), multiple_of_16(stride_cvp), \
            multiple_of_16(stride_cip)
        stride_ckn, stride_cvn, stride_cin = multiple_of_16(stride_ckn), multiple_of_16(stride_cvn), \
            multiple_of_16(stride_cin)
        stride_ckh, stride_cvh = multiple_of_16(stride_ckh), multiple_of_16(stride_cvh)
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = tokens < num_tokens
    pos = tl.load(positions_ptr + tokens, mask=m_t, other=0).to(tl.float32)
    # [BLOCK_T, 1, 1] token rows of qkv; channel offsets [1, 1, D] / [1, 1, Di]
    rows = qkv_ptr + tokens[:, None, None] * stride_xt
    offs_d = tl.arange(0, HEAD_DIM)[None, None, :]
    offs_i = tl.arange(0, INDEX_HEAD_DIM)[None, None, :]
    HALF_TABLE: tl.constexpr = ROTARY_DIM // 2
    group = tl.program_id(1)
    if group > 0:
        # -- q heads of this group
        heads = (group - 1) * Q_HEADS + tl.arange(0, Q_HEADS)[None, :, None]
        m_q = m_t[:, None, None] & (heads < NUM_Q_HEADS)
        q = norm_rope(rows + heads * HEAD_DIM * stride_xc, m_q, q_norm_ptr, inv_freq_ptr, pos, eps, stride_xc,
                      HEAD_DIM, ROTARY_DIM, HALF_TABLE)
        q_dst = q_ptr + (tokens[:, None, None] * NUM_Q_HEADS + heads) * HEAD_DIM + offs_d
        tl.store(q_dst, q.to(q_ptr.dtype.element_ty), mask=m_q)
    else:
        # -- k, v (and the index heads) into the caches; idx_q out
        slot = tl.load(slot_mapping_ptr + tokens, mask=m_t, other=-1).to(tl.int64)
        t_ok = slot >= 0
        # [BLOCK_T, 1, 1]: each token's page and row in it
        page = (tl.where(t_ok, slot, 0) // PAGE_SIZE)[:, None, None]
        row = (tl.where(t_ok, slot, 0) % PAGE_SIZE)[:, None, None]
        kv_heads = tl.arange(0, KV_HEADS_PAD)[None, :, None]
        # [BLOCK_T, KV_HEADS_PAD, 1]: the rows written
        m_kv = t_ok[:, None, None] & (kv_heads < NUM_KV_HEADS)
        kv_pool = typed(pool_ptr, KV_DTYPE)
        k_col = NUM_Q_HEADS * HEAD_DIM
        k = norm_rope(rows + (k_col + kv_heads * HEAD_DIM) * stride_xc, m_kv, k_norm_ptr, inv_freq_ptr, pos, eps,
                      stride_xc, HEAD_DIM, ROTARY_DIM, HALF_TABLE).to(qkv_ptr.dtype.element_ty)
        if KV_DTYPE == tl.float8e4nv:
            k = to_e4m3(k, tl.load(k_scale_ptr))
        k_dst = kv_pool + k_off + page * stride_ckp + row * stride_ckn + kv_heads * stride_ckh + offs_d * stride_ckd
        tl.store(k_dst, k.to(KV_DTYPE), mask=m_kv)
        v_col = k_col + NUM_KV_HEADS * HEAD_DIM
        v = tl.load(rows + (v_col + kv_heads * HEAD_DIM + offs_d) * stride_xc, mask=m_kv)
        if KV_DTYPE == tl.float8e4nv:
            v = to_e4m3(v, tl.load(v_scale_ptr))
        v_dst = kv_pool + v_off + page * stride_cvp + row * stride_cvn + kv_heads * stride_cvh + offs_d * stride_cvd
        tl.store(v_dst, v.to(KV_DTYPE), mask=m_kv)
        if SPARSE:
            iq_col = v_col + NUM_KV_HEADS * HEAD_DIM
            m_iq = m_t[:, None, None] & (kv_heads < NUM_KV_HEADS)
            idx_q = norm_rope(rows + (iq_col + kv_heads * INDEX_HEAD_DIM) * stride_xc, m_iq, index_q_norm_ptr,
                              inv_freq_ptr, pos, eps, stride_xc, INDEX_HEAD_DIM, INDEX_ROTARY_DIM, HALF_TABLE)
            iq_dst = index_q_ptr + (tokens[:, None, None] * NUM_KV_HEADS + kv_heads) * INDEX_HEAD_DIM + offs_i
            tl.store(iq_dst, idx_q.to(index_q_ptr.dtype.element_ty), mask=m_iq)
            # [BLOCK_T, 1, Di]: the one index-k head
            ik_col = iq_col + NUM_KV_HEADS * INDEX_HEAD_DIM
            m_ik = t_ok[:, None, None]
            idx_k = norm_rope(rows + ik_col * stride_xc, m_ik, index_k_norm_ptr, inv_freq_ptr, pos, eps, stride_xc,
                              INDEX_HEAD_DIM, INDEX_ROTARY_DIM, HALF_TABLE).to(qkv_ptr.dtype.element_ty)
            if INDEX_DTYPE == tl.float8e4nv:
                idx_k = to_e4m3(idx_k, 1.0)
            ik_dst = (typed(pool_ptr, INDEX_DTYPE) + index_k_off + page * stride_cip + row * stride_cin
                      + offs_i * stride_cid)
            tl.store(ik_dst, idx_k.to(INDEX_DTYPE), mask=m_ik)
