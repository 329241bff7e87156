"""RMSNorm of rows, optionally after the residual add: ``add_rms_norm`` and ``rms_norm``.

One program per ``BLOCK_R`` rows (1 on GPUs; many in the interpreter, whose
cost is per program), each row whole in registers (``BLOCK_H`` >= H). For a
row ``x`` of ``[T, H]`` in bfloat16 / float16 / float32:

    residual_out = x + residual_in, added in float32 and rounded once to x's dtype
                   (torch's and XLA's add of two such tensors); HAS_RESIDUAL only
    r            = residual_out (or x) in float32
    normed       = (r * inv_rms(r)) * (1 + weight), in float32, rounded to x's dtype

which is the models' Gemma-style ``rms_norm`` (m3_torch/model.py, m3_jax/model.py)
operation for operation, except for how ``mean(r^2)`` is summed (below).

``inv_rms`` (also used by the q/k norms of ``qk_rope.py``): the squares
``r * r`` are rounded to float32 as the models round them, then summed EXACTLY:
each square is scaled by a power of two chosen from the row's largest square
(exact), truncated to an int64 multiple of 2^-48 of that scale (each term
loses < 2^-48 of the largest; a row's sum < 2^15 * 2^48 fits an int64) and
the integers are added. The sum is then rounded to float32 once, divided by
the row length (IEEE division), ``eps`` added, and ``1 / sqrt`` taken as two
correctly rounded operations (``sqrt_rn``, ``div_rn``). The model's float32
sum rounds at every step in an order of its own; this one is within 2^-32 of
the exact sum before its one rounding, so it matches a float64 reference
better than the model does.

Same bits from torch and JAX: integer addition is associative, so the sum
cannot depend on the reduction tree the compiler builds from the register
layout (torch and jax-triton hand it different divisibility facts, hence
possibly different layouts); maxima are exact; every other operation is
elementwise and correctly rounded, with no multiply-add the compiler could
fuse into an FMA. ``ALIGNED`` (host side: ``common.aligned``) gives jax-triton's
build the facts torch's has, for speed. Non-finite rows follow the
model: a NaN anywhere makes the row's normed values NaN; an infinite square
(|r| >= 2^64) makes ``inv_rms`` 0 (normed 0, NaN where r is infinite).

The host side (shapes and dtypes only) is shared by both launchers:
``validate.check_norm_call``, ``tuning.norm``, ``step_launches.rms_norm``.
"""

import triton
import triton.language as tl

from .common import multiple_of_16, release_next_grid, wait_for_previous_grid

# Squares are summed as int64 multiples of 2^-FRACTION_BITS of a power of two above the row's largest square:
# rows of at most MAX_WIDTH elements keep the sum below 2^63.
FRACTION_BITS = tl.constexpr(48)
MAX_WIDTH = 1 << 15


@triton.jit
def inv_rms(x, n, eps, AXIS: tl.constexpr):
    """``1 / sqrt(mean(x^2) + eps)`` over axis ``AXIS`` of the float32 tensor ``x`` (-> that axis reduced).

    ``n``: the row length (lanes past it must hold 0). The squares are summed exactly (module docstring),
    so the result does not depend on the reduction order."""
    sq = x * x
    has_nan = tl.max((sq != sq).to(tl.int32), axis=AXIS) > 0
    finite = tl.where(sq < float("inf"), sq, 0.0)   # NaN and inf out (handled below)
    top = tl.max(finite, axis=AXIS)
    has_inf = tl.max((sq == float("inf")).to(tl.int32), axis=AXIS) > 0
    # top < 2^(b - 126) for its biased exponent b (also for b = 0); scaled by 2^(126 - b + 48), every square
    # is below 2^48. The factor is capped at 2^127 (rows whose largest square is below 2^-78 keep fewer bits).
    biased = (top.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(126 - biased + FRACTION_BITS, 127)
    up = ((e + 127) << 23).to(tl.float32, bitcast=True)                       # 2^e, exact
    units = (finite * tl.expand_dims(up, AXIS)).to(tl.int64)                 # truncated: < 2^48 each
    total = tl.sum(units, axis=AXIS)                                          # exact
    down = ((1023 - e).to(tl.int64) << 52).to(tl.float64, bitcast=True)      # 2^-e as float64, exact
    total = (total.to(tl.float64) * down).to(tl.float32)
    total = tl.where(has_inf, float("inf"), total)
    total = tl.where(has_nan, float("nan"), total)
    mean = tl.div_rn(total, tl.zeros_like(total) + n)
    one = tl.full(mean.shape, 1.0, tl.float32)
    return tl.div_rn(one, tl.sqrt_rn(mean + eps))


@triton.jit(do_not_specialize=["num_rows"])
def rms_norm_kernel(
    x_ptr,              # [T, H] bf16 / fp16 / fp32, strides (stride_xt, stride_xh)
    residual_ptr,       # [T, H] x's dtype, strides (stride_rt, stride_rh) (read if HAS_RESIDUAL)
    weight_ptr,         # [H] any float dtype, unit stride: the norm scales 1 + weight
    num_rows, eps,
    stride_xt, stride_xh, stride_rt, stride_rh,
    normed_ptr,         # [T, H] out, x's dtype, contiguous
    residual_out_ptr,   # [T, H] out, x's dtype, contiguous (written if HAS_RESIDUAL)
    HIDDEN: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ALIGNED: tl.constexpr,      # the row strides are multiples of 16 (``common.aligned``): stated for the compiler
    BLOCK_R: tl.constexpr,      # rows per program (1 on GPUs)
    BLOCK_H: tl.constexpr,      # next power of two >= HIDDEN
    PDL: tl.constexpr = False,
):
    release_next_grid(PDL)
    wait_for_previous_grid(PDL)
    if ALIGNED:
        stride_xt, stride_rt = multiple_of_16(stride_xt), multiple_of_16(stride_rt)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    m_h = cols < HIDDEN
    # [BLOCK_R, BLOCK_H]
    m = (rows < num_rows)[:, None] & m_h[None, :]
    r = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xh, mask=m, other=0.0).to(tl.float32)
    out_offs = rows[:, None] * HIDDEN + cols[None, :]
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + rows[:, None] * stride_rt + cols[None, :] * stride_rh, mask=m, other=0.0)
        r = (r + res.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + out_offs, r, mask=m)
        r = r.to(tl.float32)
    # [BLOCK_H]
    scale = 1.0 + tl.load(weight_ptr + cols, mask=m_h, other=0.0).to(tl.float32)
    # [BLOCK_R]
    inv = inv_rms(r, HIDDEN, eps, 1)
    normed = (r * inv[:, None]) * scale[None, :]
    tl.store(normed_ptr + out_offs, normed.to(normed_ptr.dtype.element_ty), mask=m)
