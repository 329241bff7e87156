"""Append a step's new K, V and index-K rows to one layer's paged caches.

A program writes ``BLOCK_T`` new tokens (one on a GPU, many in the interpreter, whose
cost is per program); token ``t``'s ``slot_mapping[t] = slot * PAGE_SIZE + offset``
names the page (a pool slot) and the row inside it; ``-1`` skips the token
(padding). The program copies the token's ``[Hk, D]`` K and V rows and its
``[Di]`` index-K row into the caches, which are strided views of ONE buffer
(``pool_ptr``) at element offsets ``k_off``/``v_off``/``index_k_off``: a layer
of the flat sub-page pool (see pool.py), or a standalone cache with offset 0.
The pool is the kernel's only output and is updated in place (JAX aliases it to
its input; torch passes the same tensor as ``pool_in_ptr`` and ``pool_ptr``).
The buffer's own dtype does not matter: the kernel addresses K/V as
``KV_DTYPE`` and index-K as ``INDEX_DTYPE`` elements from its start (a byte
pool holds sub-pages of both). FP8 caches (float8e4nv) store
``saturate(x / scale)`` rounded to nearest even (``common.to_e4m3``), with the
layer's ``k_scale``/``v_scale`` read from memory; index-K is unscaled.

Addresses are int64: pools exceed 2**31 elements. Slot values are not checked
here (that would need the host): a slot outside the pool is undefined
behaviour (it writes out of bounds). ``M3_VALIDATE=1`` checks them on the host
before the launch (``validate.check_slot_mapping_values``).
"""

import triton
import triton.language as tl

from .common import PAGE_SIZE, multiple_of_16, release_next_grid, to_e4m3, typed, wait_for_previous_grid


@triton.jit(do_not_specialize=["num_tokens"])
def cache_write_kernel(
    k_ptr,             # [T, Hk, D]   new K rows, the model's dtype (read if WRITE_K)
    v_ptr,             # [T, Hk, D]   new V rows (read if WRITE_V)
    index_k_ptr,       # [T, Di]      new index-K rows (read if WRITE_INDEX)
    slot_mapping_ptr,  # [T] int32/int64: slot * PAGE_SIZE + offset in page, -1 = skip
    k_scale_ptr,       # [] fp32: stored K = saturate(K / k_scale) (FP8 K/V only; unread otherwise)
    v_scale_ptr,       # [] fp32: stored V = saturate(V / v_scale)
    pool_in_ptr,       # the pool as the aliased input (jax-triton passes it; torch passes the pool twice)
    k_off, v_off, index_k_off,   # offsets of the layer's caches in the pool, in KV_DTYPE / INDEX_DTYPE elements
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_it, stride_id,
    stride_ckp, stride_ckh, stride_ckn, stride_ckd,  # k_cache [slots, Hk, PAGE_SIZE, D] @ k_off
    stride_cvp, stride_cvh, stride_cvn, stride_cvd,  # v_cache [slots, Hk, PAGE_SIZE, D] @ v_off
    stride_cip, stride_cin, stride_cid,              # index_k_cache [slots, PAGE_SIZE, Di] @ index_k_off
    num_tokens,
    pool_ptr,          # flat pool buffer, written in place
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INDEX_HEAD_DIM: tl.constexpr,
    WRITE_K: tl.constexpr,
    WRITE_V: tl.constexpr,
    WRITE_INDEX: tl.constexpr,
    BLOCK_T: tl.constexpr,             # tokens per program
    KV_DTYPE: tl.constexpr,            # element type of the K/V caches (float8e4nv: FP8, scaled)
    INDEX_DTYPE: tl.constexpr,         # element type of the index-K cache (float8e4nv: FP8, unscaled)
    ALIGNED: tl.constexpr,             # row strides, cache offsets and strides are multiples of 16 (common.aligned)
    PDL: tl.constexpr = False,        # launched as a programmatic dependent (common.release_next_grid)
):
    release_next_grid(PDL)
    wait_for_previous_grid(PDL)   # no map of its own: everything it reads may come from earlier kernels
    kv_pool, index_pool = typed(pool_ptr, KV_DTYPE), typed(pool_ptr, INDEX_DTYPE)
    if ALIGNED:   # then rows load and store as 16-byte vectors under jax-triton too
        stride_kt, stride_kh = multiple_of_16(stride_kt), multiple_of_16(stride_kh)
        stride_vt, stride_vh, stride_it = multiple_of_16(stride_vt), multiple_of_16(stride_vh), multiple_of_16(stride_it)
        k_off, v_off, index_k_off = multiple_of_16(k_off), multiple_of_16(v_off), multiple_of_16(index_k_off)
        stride_ckp, stride_ckh, stride_ckn = multiple_of_16(stride_ckp), multiple_of_16(stride_ckh), \
            multiple_of_16(stride_ckn)
        stride_cvp, stride_cvh, stride_cvn = multiple_of_16(stride_cvp), multiple_of_16(stride_cvh), \
            multiple_of_16(stride_cvn)
        stride_cip, stride_cin = multiple_of_16(stride_cip), multiple_of_16(stride_cin)
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_mapping_ptr + offs_t, mask=offs_t < num_tokens, other=-1).to(tl.int64)
    t_ok = slot >= 0
    # [BLOCK_T]: each token's page and row in it
    page = tl.where(t_ok, slot, 0) // PAGE_SIZE
    row = tl.where(t_ok, slot, 0) % PAGE_SIZE
    # [BLOCK_T, 1, 1] for the [BLOCK_T, HEADS_PAD, D] K/V rows
    t3, page3, row3 = offs_t[:, None, None], page[:, None, None], row[:, None, None]
    offs_h = tl.arange(0, HEADS_PAD)[None, :, None]
    offs_d = tl.arange(0, HEAD_DIM)[None, None, :]
    # [BLOCK_T, HEADS_PAD, 1], broadcast over D by the loads and stores
    m = t_ok[:, None, None] & (offs_h < NUM_KV_HEADS)
    if WRITE_K:
        k = tl.load(k_ptr + t3 * stride_kt + offs_h * stride_kh + offs_d * stride_kd, mask=m)
        if KV_DTYPE == tl.float8e4nv:
            k = to_e4m3(k, tl.load(k_scale_ptr))
        dst = kv_pool + k_off + page3 * stride_ckp + row3 * stride_ckn + offs_h * stride_ckh + offs_d * stride_ckd
        tl.store(dst, k.to(KV_DTYPE), mask=m)
    if WRITE_V:
        v = tl.load(v_ptr + t3 * stride_vt + offs_h * stride_vh + offs_d * stride_vd, mask=m)
        if KV_DTYPE == tl.float8e4nv:
            v = to_e4m3(v, tl.load(v_scale_ptr))
        dst = kv_pool + v_off + page3 * stride_cvp + row3 * stride_cvn + offs_h * stride_cvh + offs_d * stride_cvd
        tl.store(dst, v.to(KV_DTYPE), mask=m)
    if WRITE_INDEX:
        offs_i = tl.arange(0, INDEX_HEAD_DIM)[None, :]
        # [BLOCK_T, Di]
        ik = tl.load(index_k_ptr + offs_t[:, None] * stride_it + offs_i * stride_id, mask=t_ok[:, None])
        if INDEX_DTYPE == tl.float8e4nv:
            ik = to_e4m3(ik, 1.0)
        dst = index_pool + index_k_off + page[:, None] * stride_cip + row[:, None] * stride_cin + offs_i * stride_cid
        tl.store(dst, ik.to(INDEX_DTYPE), mask=t_ok[:, None])
