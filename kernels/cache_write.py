"""Append a step's new K, V and index-K rows to one layer's paged caches.

One program per new token ``t``: ``slot_mapping[t] = slot * PAGE_SIZE + offset``
names the page (a pool slot) and the row inside it; ``-1`` skips the token
(padding). The program copies the token's ``[Hk, D]`` K and V rows and its
``[Di]`` index-K row into the caches, which are strided views of ONE buffer
(``pool_ptr``) at element offsets ``k_off``/``v_off``/``index_k_off``: a layer
of the flat sub-page pool (see pool.py), or a standalone cache with offset 0.
The pool is the kernel's only output and is updated in place (JAX aliases it to
its input; torch passes the same tensor as ``pool_in_ptr`` and ``pool_ptr``).

Addresses are int64: pools exceed 2**31 elements. Slot values are not checked
here (that would need the host): a slot outside the pool is undefined
behaviour (it writes out of bounds). ``M3_VALIDATE=1`` checks them on the host
before the launch (``validate.check_slot_mapping_values``).
"""

import triton
import triton.language as tl

from .common import PAGE_SIZE


@triton.jit
def cache_write_kernel(
    k_ptr,             # [T, Hk, D]   new K rows, pool dtype (read if WRITE_K)
    v_ptr,             # [T, Hk, D]   new V rows (read if WRITE_V)
    index_k_ptr,       # [T, Di]      new index-K rows (read if WRITE_INDEX)
    slot_mapping_ptr,  # [T] int32/int64: slot * PAGE_SIZE + offset in page, -1 = skip
    pool_in_ptr,       # the pool again (JAX passes the aliased input too); unused
    k_off, v_off, index_k_off,   # element offsets of the layer's caches in the pool
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_it, stride_id,
    stride_ckp, stride_ckh, stride_ckn, stride_ckd,  # k_cache [slots, Hk, PAGE_SIZE, D] @ k_off
    stride_cvp, stride_cvh, stride_cvn, stride_cvd,  # v_cache [slots, Hk, PAGE_SIZE, D] @ v_off
    stride_cip, stride_cin, stride_cid,              # index_k_cache [slots, PAGE_SIZE, Di] @ index_k_off
    pool_ptr,          # flat pool buffer, written in place
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INDEX_HEAD_DIM: tl.constexpr,
    WRITE_K: tl.constexpr,
    WRITE_V: tl.constexpr,
    WRITE_INDEX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:
        page = slot // PAGE_SIZE
        row = slot % PAGE_SIZE
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        m_hd = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
        if WRITE_K:
            # [HEADS_PAD, D]
            k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                        mask=m_hd)
            p_k = (pool_ptr + k_off + page * stride_ckp + row * stride_ckn
                   + offs_h[:, None] * stride_ckh + offs_d[None, :] * stride_ckd)
            tl.store(p_k, k.to(pool_ptr.dtype.element_ty), mask=m_hd)
        if WRITE_V:
            # [HEADS_PAD, D]
            v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                        mask=m_hd)
            p_v = (pool_ptr + v_off + page * stride_cvp + row * stride_cvn
                   + offs_h[:, None] * stride_cvh + offs_d[None, :] * stride_cvd)
            tl.store(p_v, v.to(pool_ptr.dtype.element_ty), mask=m_hd)
        if WRITE_INDEX:
            offs_i = tl.arange(0, INDEX_HEAD_DIM)
            # [Di]
            ik = tl.load(index_k_ptr + t * stride_it + offs_i * stride_id)
            p_i = pool_ptr + index_k_off + page * stride_cip + row * stride_cin + offs_i * stride_cid
            tl.store(p_i, ik.to(pool_ptr.dtype.element_ty))
