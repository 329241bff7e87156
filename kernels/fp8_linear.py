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

Three kernels:

1. ``quantize_act_kernel``, grid (T, ceil(K / 128 / GROUPS)): ``xq``, ``x_scale`` from ``x``. A group's
   scale is ``max(amax, AMAX_FLOOR) / 448`` (an all-zero group gets a tiny scale and zero codes,
   never 0 / 0); NaN elements are left out of ``amax`` and stay NaN; the codes are
   ``to_e4m3(x, scale)``: IEEE division, saturated to +-448, rounded to nearest even. This is
   exactly the references' ``quantize_activation_ref`` (m3_torch / m3_jax ``reference``), bit for bit,
   on every GPU and in the interpreter.
2. ``fp8_linear_kernel``, grid (ceil(N / BLOCK_N), ceil(T / BLOCK_M), SPLITS): one [BLOCK_M, BLOCK_N] tile
   of ``out`` per program, over one range of ``SPLIT_BLOCKS`` K blocks (``BLOCK_K`` = 128, one scale per
   K tile; all of K with one split). Decode-sized calls (T <= 64) are weight-bound: every weight byte is
   read once (one row tile of up to 64 tokens), and N and K are split over the grid so that every SM
   holds a few programs, enough bytes in flight to stream at the copy bandwidth (N = 3072 alone makes
   48 programs of BLOCK_N 64); see ``tuning.fp8_linear``. With one split the program rounds its sum to
   out's dtype; with more it writes float32 partial sums ``[SPLITS, T, N]``. The tile is computed
   transposed, ``W_tile . x_tile^T``: the weight rows fill the 64-row side of Hopper's ``wgmma`` and the
   few tokens its narrow side (m64n16k32 e4m3 at T <= 16; a 16-token tile as the 64-row side would fall
   back to ``mma.sync`` on operands widened to float16). The scales of the next K block are loaded one
   iteration ahead (the tiles are pipelined by ``cp.async``, the scale loads are not). Before waiting
   for the previous kernel, a program sends its first ``PREFETCH_BLOCKS`` weight blocks to L2 (a
   ``prefetch`` hint, not a read: no kernel writes weights, and L2 is the GPU's point of coherence).
3. ``sum_splits_kernel`` (only with SPLITS > 1), grid (ceil(T * N / BLOCK)): ``out`` = the partial sums
   added in split order in float32, rounded once to out's dtype. A fixed order, no atomics: the same
   bits on every run and from both frameworks.

The quantization stays a kernel of its own: fused into fp8_linear_kernel every program would quantize
its whole row tile again (BLOCK_M >= 16 rows, of which T are real), and at T = 64 the N / BLOCK_N-fold
repeated IEEE divisions would cost more ALU time than the weight stream takes.

In Triton's interpreter ``common.mma`` widens the e4m3 tiles to float32 before the dot (exact:
every e4m3 value is a float32, every product of two fits float32's mantissa), so the CPU result
differs from a GPU's only in the order of the float32 sums.

Launch descriptions: ``step_launches.quantize_activation`` and ``step_launches.fp8_linear``; block sizes:
``tuning.fp8_quantize`` and ``tuning.fp8_linear``; argument checks: ``validate.check_fp8_linear_call``.
"""

import triton
import triton.language as tl

from .common import E4M3_MAX, mma, release_next_grid, to_e4m3, wait_for_previous_grid
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
def prefetch_l2(ptrs):
    """A hint, not a read: the GPU brings the line holding each address of ``ptrs`` from memory into L2
    (``prefetch.global.L2``); nothing reaches the program's registers. L2 is the GPU's point of coherence,
    so a prefetched line can never hold an older value than memory."""
    tl.inline_asm_elementwise("mov.u32 $0, 0; prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def fp8_linear_kernel(xq_ptr,       # [T, K] float8_e4m3fn, contiguous
                      x_scale_ptr,  # [T, K_BLOCKS] float32
                      w_ptr,        # [N, K] float8_e4m3fn, contiguous
                      w_scale_ptr,  # [N_BLOCKS, K_BLOCKS] float32
                      num_tokens,
                      out_ptr,      # [SPLITS, T, N]: x's dtype with one split ([T, N]), float32 partial sums with more
                      N: tl.constexpr, K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT_BLOCKS: tl.constexpr, PREFETCH_BLOCKS: tl.constexpr, PDL: tl.constexpr = False):
    """``out[split, t, n] = sum_kb (xq[t, kb] . w[n, kb]) * x_scale[t, kb] * w_scale[n // 128, kb]`` over the
    split's K blocks ``[SPLIT_BLOCKS * split, ...)``, in order, rounded once to out's dtype."""
    tl.static_assert(BLOCK_K == 128, "one scale per K tile: BLOCK_K must be the format's block, 128")
    tl.static_assert(128 % BLOCK_N == 0, "one weight scale per K tile: BLOCK_N must divide the format's block")
    release_next_grid(PDL)
    n_tile, m_tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    K_BLOCKS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    kb_start = split * SPLIT_BLOCKS
    kb_end = tl.minimum(kb_start + SPLIT_BLOCKS, K_BLOCKS)
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    if PREFETCH_BLOCKS > 0:
        # the first weight blocks of the split start their way into L2 while the previous kernel finishes
        # (no kernel writes weights); [BLOCK_N, PREFETCH_BLOCKS] lines of 128 bytes, clamped to the split
        kb_ahead = tl.minimum(kb_start + tl.arange(0, PREFETCH_BLOCKS), kb_end - 1)
        prefetch_l2(w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * K + kb_ahead[None, :] * BLOCK_K)
    wait_for_previous_grid(PDL)
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_rows, m_n = rows < num_tokens, n < N
    p_x = xq_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :]
    p_w = w_ptr + n.to(tl.int64)[:, None] * K + kk[None, :]
    p_xs = x_scale_ptr + rows.to(tl.int64) * K_BLOCKS
    p_ws = w_scale_ptr + (n_tile * BLOCK_N // 128) * K_BLOCKS   # the tile's rows share one row of scales
    # The scales of block kb are loaded at the end of iteration kb - 1: the tiles are pipelined (cp.async,
    # num_stages), these small loads are not, and loaded where they are used their latency would hold up
    # every iteration; this way it passes during the next tile's wait and MMA.
    b_xs = tl.load(p_xs + kb_start, mask=m_rows, other=0.0)   # [BLOCK_M]
    b_ws = tl.load(p_ws + kb_start)                           # a scalar
    # transposed, [BLOCK_N, BLOCK_M]: the weight rows fill the MMA's 64-row side, the tokens its narrow one
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for kb in range(kb_start, kb_end):
        m_k = kb * BLOCK_K + kk < K
        # [BLOCK_M, BLOCK_K], [BLOCK_N, BLOCK_K]
        b_x = tl.load(p_x + kb * BLOCK_K, mask=m_rows[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w + kb * BLOCK_K, mask=m_n[:, None] & m_k[None, :], other=0.0)
        acc += mma(b_w, tl.trans(b_x)) * b_ws * b_xs[None, :]
        has_next = kb + 1 < kb_end
        b_xs = tl.load(p_xs + kb + 1, mask=m_rows & has_next, other=0.0)
        b_ws = tl.load(p_ws + kb + 1, mask=has_next, other=0.0)
    out = tl.trans(acc).to(out_ptr.dtype.element_ty)
    p_out = out_ptr + split.to(tl.int64) * num_tokens * N + rows.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(p_out, out, mask=m_rows[:, None] & m_n[None, :])


@triton.jit
def sum_splits_kernel(partial_ptr,   # [SPLITS, size] float32: fp8_linear_kernel's partial sums
                      size,          # T * N
                      out_ptr,       # [size] ([T, N]) in x's dtype
                      SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """``out = ((partial[0] + partial[1]) + partial[2]) + ...`` in float32, rounded once; BLOCK elements a program."""
    release_next_grid(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    wait_for_previous_grid(PDL)
    mask = offs < size
    p_partial = partial_ptr + offs
    acc = tl.load(p_partial, mask=mask, other=0.0)
    for _ in tl.static_range(1, SPLITS):   # unrolled: every split's load is in flight at once
        p_partial += size
        acc += tl.load(p_partial, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
