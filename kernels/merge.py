"""Merge the split-K partials of paged attention into the output.

Split ``s`` of row ``(t, h)`` left a softmax-normalised partial output and
its base-2 log-sum-exp (``-inf``: the split saw nothing). The merged row is
the lse-weighted mean of the partials. A NaN lse (NaN or Inf in q) is not an
empty split: it makes the row NaN, as the unsplit kernel would. Every layout
comes as strides.
"""

import triton
import triton.language as tl

from .common import release_next_grid, wait_for_previous_grid

# split iterations the merge loops unroll (the dense split-K of a long context has up to 256 splits)
MERGE_UNROLL = tl.constexpr(16)


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
    PDL: tl.constexpr = False,        # launched as a programmatic dependent (common.release_next_grid)
):
    release_next_grid(PDL)
    wait_for_previous_grid(PDL)   # no map of its own: everything it reads comes from the attention launch
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    lse_row = part_lse_ptr + t * stride_lt + h * stride_lh
    o_row = part_o_ptr + t * stride_pt + h * stride_ph + offs_d * stride_pd
    # Splits are combined one after the other, in split order: the sums do not depend
    # on how the compiler lays the data out over threads (which differs with what it
    # knows of the strides: torch and jax-triton tell it different things), so both
    # frameworks get the same bits. The loops are unrolled, and no load waits on another
    # (every split wrote its partial; an empty split's is discarded by the select below,
    # not masked out of the load), so a row's loads are all in flight at once: one memory
    # latency, not one per split. (The select sits between the product and the sum, so
    # they round separately where the masked load let them fuse: last-bit changes.)
    m = float("-inf")
    for s in tl.range(0, NUM_SPLITS, loop_unroll_factor=MERGE_UNROLL):
        lse = tl.load(lse_row + s * stride_ls)
        m = tl.maximum(m, tl.where(lse == lse, lse, float("-inf")))   # NaN does not set the max...
    m = tl.where(m == float("-inf"), 0.0, m)
    den = 0.0
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s in tl.range(0, NUM_SPLITS, loop_unroll_factor=MERGE_UNROLL):
        lse = tl.load(lse_row + s * stride_ls)
        part = tl.load(o_row + s * stride_ps)
        used = lse != float("-inf")                                    # ...but makes the row NaN
        w = tl.where(used, tl.exp2(lse - m), 0.0)
        acc += tl.where(used, w * part, 0.0)   # an empty split's partial never counts
        den += w
    out = acc / tl.where(den != 0.0, den, 1.0)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_d * stride_od, out.to(o_ptr.dtype.element_ty))
