"""Merge the split-K partials of paged attention into the output.

Split ``s`` of row ``(t, h)`` left a softmax-normalised partial output and
its base-2 log-sum-exp (``-inf``: the split saw nothing). The merged row is
the lse-weighted mean of the partials. A NaN lse (NaN or Inf in q) is not an
empty split: it makes the row NaN, as the unsplit kernel would. Every layout
comes as strides.
"""

import triton
import triton.language as tl


@triton.jit
def merge_splits_kernel(
    part_o_ptr,       # [T, Hq, NUM_SPLITS, D] fp32
    part_lse_ptr,     # [T, Hq, NUM_SPLITS] fp32, base 2
    stride_pt, stride_ph, stride_ps, stride_pd,
    stride_lt, stride_lh, stride_ls,
    stride_ot, stride_oh, stride_od,
    o_ptr,            # [T, Hq, D] out dtype
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    # [SPLITS_PAD]
    lse = tl.load(part_lse_ptr + t * stride_lt + h * stride_lh + offs_s * stride_ls, mask=offs_s < NUM_SPLITS,
                  other=float("-inf"))
    used = lse != float("-inf")   # NaN counts as used
    m = tl.max(tl.where(used & (lse == lse), lse, float("-inf")), axis=0)
    w = tl.where(used, tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m)), 0.0)
    # [SPLITS_PAD, D]: empty splits are never read
    o = tl.load(part_o_ptr + t * stride_pt + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :] * stride_pd,
                mask=used[:, None], other=0.0)
    den = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(den != 0.0, den, 1.0)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_d * stride_od, out.to(o_ptr.dtype.element_ty))
