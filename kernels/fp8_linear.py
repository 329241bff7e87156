"""Block-scaled FP8 linear layers (DeepSeek-V3 / vLLM "fp8 block" format): ``out = x @ W^T``.

The format. A weight ``W [N, K]`` is stored as ``float8_e4m3fn`` codes ``Wq [N, K]`` and one float32
scale per 128 x 128 block, ``w_scale [ceil(N / 128), ceil(K / 128)]`` (a checkpoint's
``weight_scale_inv``, ``weight_block_size: [128, 128]``): ``W[n, k] ~ Wq[n, k] * w_scale[n // 128, k // 128]``,
with ``w_scale = amax(|block|) / 448`` (448: e4m3's largest finite value). Activations are quantized
at run time the same way per token and per 128 channels: ``x [T, K] -> xq [T, K]`` e4m3 and
``x_scale [T, ceil(K / 128)]`` float32. Then

    out[t, n] = sum_kb (xq[t, kb] . Wq[n, kb]) * x_scale[t, kb] * w_scale[n // 128, kb]

where ``kb`` runs over the K blocks of 128 channels: each block's dot is an FP8 tensor-core product
(sm_89+: e4m3 x e4m3 with float32 accumulation), scaled and added to a float32 accumulator. One
block's dot is started from zero each time, so the tensor core's reduced-precision FP8 accumulation
(Hopper keeps about 14 mantissa bits inside one ``wgmma`` chain) spans 128 products only, and the
block sum is promoted to float32 every block (DeepSeek-V3's recipe).

Two kernels:

1. ``quantize_act_kernel``, grid (T, ceil(K / 128 / GROUPS)): ``xq``, ``x_scale`` from ``x``. A group's
   scale is ``max(amax, AMAX_FLOOR) / 448`` (an all-zero group gets a tiny scale and zero codes,
   never 0 / 0); NaN elements are left out of ``amax`` and stay NaN; the codes are
   ``to_e4m3(x, scale)``: IEEE division, saturated to +-448, rounded to nearest even. This is
   exactly the references' ``quantize_activation_ref`` (m3_torch / m3_jax ``reference``), bit for bit,
   on every GPU and in the interpreter.
2. ``fp8_linear_kernel``, grid (ceil(N / BLOCK_N), ceil(T / BLOCK_M)): one [BLOCK_M, BLOCK_N] tile
   of ``out`` per program, looping over the K blocks (``BLOCK_K`` = 128, one scale per K tile).
   Decode-sized calls (T <= 64) are weight-bound: every weight byte is read once (one row tile of
   up to 64 tokens) and N is split over the grid to occupy every SM; see ``tuning.fp8_linear``. The tile is
   computed transposed, ``W_tile . x_tile^T``: the weight rows fill the 64-row side of Hopper's
   ``wgmma`` and the few tokens its narrow side (m64n16k32 e4m3 at T <= 16; a 16-token tile as the
   64-row side would fall back to ``mma.sync`` on operands widened to float16).

In Triton's interpreter ``common.mma`` widens the e4m3 tiles to float32 before the dot (exact:
every e4m3 value is a float32, every product of two fits float32's mantissa), so the CPU result
differs from a GPU's only in the order of the float32 sums.

Launch descriptions: ``step_launches.quantize_activation`` and ``step_launches.fp8_linear``; block sizes:
``tuning.fp8_quantize`` and ``tuning.fp8_linear``; argument checks: ``validate.check_fp8_linear_call``.
"""

import triton
import triton.language as tl

from .common import E4M3_MAX, mma, release_next_grid, to_e4m3, wait_for_previous_grid

# the block size of the format (weights: 128 x 128; activations: 128 channels of one token)
FP8_BLOCK = 128
# a group's amax is at least this (an all-zero group: scale 2.2e-15, codes 0); a kernel constant, its
# ``.value`` on the host
AMAX_FLOOR = tl.constexpr(1e-12)


@triton.jit
def quantize_groups(x):
    """``x`` [GROUPS, 128] (any float dtype) -> (e4m3 codes [GROUPS, 128], float32 scales [GROUPS]):
    ``scale = max(amax over the non-NaN elements, AMAX_FLOOR) / 448``, ``codes = to_e4m3(x, scale)``."""
    x = x.to(tl.float32)
    amax = tl.max(tl.where(x == x, tl.abs(x), 0.0), axis=1)
    amax = tl.maximum(amax, AMAX_FLOOR)
    scale = tl.div_rn(amax, tl.full(amax.shape, E4M3_MAX, tl.float32))   # `/` is approximate on GPUs
    return to_e4m3(x, scale[:, None]), scale


@triton.jit
def quantize_act_kernel(x_ptr,       # [T, K] bfloat16 / float16 / float32, contiguous
                        xq_ptr,      # [T, K] float8_e4m3fn
                        x_scale_ptr,  # [T, K_BLOCKS] float32
                        K: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr = False):
    """Token ``program_id(0)``'s channel groups ``[GROUPS * program_id(1), ...)`` (128 channels each)."""
    release_next_grid(PDL)
    token, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    wait_for_previous_grid(PDL)
    K_BLOCKS: tl.constexpr = (K + 127) // 128
    group = chunk * GROUPS + tl.arange(0, GROUPS)
    # [GROUPS, 128]
    k = group[:, None] * 128 + tl.arange(0, 128)[None, :]
    m_k = k < K
    x = tl.load(x_ptr + token * K + k, mask=m_k, other=0.0)
    xq, scale = quantize_groups(x)
    tl.store(xq_ptr + token * K + k, xq, mask=m_k)
    tl.store(x_scale_ptr + token * K_BLOCKS + group, scale, mask=group < K_BLOCKS)


@triton.jit
def fp8_linear_kernel(xq_ptr,       # [T, K] float8_e4m3fn, contiguous
                      x_scale_ptr,  # [T, K_BLOCKS] float32
                      w_ptr,        # [N, K] float8_e4m3fn, contiguous
                      w_scale_ptr,  # [N_BLOCKS, K_BLOCKS] float32
                      num_tokens,
                      out_ptr,      # [T, N] bfloat16 / float16 / float32
                      N: tl.constexpr, K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr = False):
    """``out[t, n] = sum_kb (xq[t, kb] . w[n, kb]) * x_scale[t, kb] * w_scale[n // 128, kb]``, rounded once."""
    tl.static_assert(BLOCK_K == 128, "one scale per K tile: BLOCK_K must be the format's block, 128")
    release_next_grid(PDL)
    n_tile, m_tile = tl.program_id(0), tl.program_id(1)
    wait_for_previous_grid(PDL)
    K_BLOCKS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m_rows, m_n = rows < num_tokens, n < N
    kk = tl.arange(0, BLOCK_K)
    p_x = xq_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :]
    p_w = w_ptr + n.to(tl.int64)[:, None] * K + kk[None, :]
    p_xs = x_scale_ptr + rows.to(tl.int64) * K_BLOCKS
    p_ws = w_scale_ptr + (n // 128) * K_BLOCKS
    # transposed, [BLOCK_N, BLOCK_M]: the weight rows fill the MMA's 64-row side, the tokens its narrow one
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for kb in range(0, K_BLOCKS):
        m_k = kb * BLOCK_K + kk < K
        # [BLOCK_M, BLOCK_K], [BLOCK_N, BLOCK_K]
        b_x = tl.load(p_x + kb * BLOCK_K, mask=m_rows[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w + kb * BLOCK_K, mask=m_n[:, None] & m_k[None, :], other=0.0)
        # [BLOCK_M], [BLOCK_N]
        b_xs = tl.load(p_xs + kb, mask=m_rows, other=0.0)
        b_ws = tl.load(p_ws + kb, mask=m_n, other=0.0)
        acc += mma(b_w, tl.trans(b_x)) * b_ws[:, None] * b_xs[None, :]
    out = tl.trans(acc).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + n[None, :], out, mask=m_rows[:, None] & m_n[None, :])
