"""Fused MoE experts with block-scaled FP8 weights (the format of ``fp8_linear``): the GEMM kernels.

The experts of ``moe`` (same routing, same SwiGLU-OAI, same sums) with every expert weight in
``float8_e4m3fn`` and one float32 scale per 128 x 128 block: ``gate_up [E, 2I, H]`` with
``gate_up_scale [E, 2I / 128, H / 128]``, ``down [E, H, I]`` with ``down_scale [E, H / 128, I / 128]``,
and the shared expert (expert E) as ``[2I, H]`` / ``[2I / 128, H / 128]`` and ``[H, I]`` /
``[H / 128, I / 128]``. H and I are multiples of 128, so no scale block straddles the gate and the up
rows (checkpoints quantize ``gate_proj`` and ``up_proj`` apart). Five launches:

1. ``fp8_linear.quantize_act_kernel``: ``x [T, H]`` -> ``xq [T, H]`` e4m3, ``x_scale [T, H / 128]``.
2. ``moe.align_kernel``: the pairs grouped by expert in blocks of ``BLOCK_M`` rows, as for bf16.
3. ``fp8_gate_up_kernel``, grid (blocks, I / 128): a block's rows of ``xq`` times its expert's gate and
   up rows ``n`` (one 128-row scale block each), each 128-channel K block's FP8 dot scaled by the
   token's and the weight block's scales; the epilogue rounds gate and up to the model dtype
   (``DTYPE``), applies SwiGLU-OAI in float32 and rounds the result to ``DTYPE`` (the unfused model's
   ``act``), then quantizes it like ``quantize_act_kernel`` (``BLOCK_N`` = 128: one program holds a
   row's whole group) -> ``act [rows, I]`` e4m3 and ``act_scale [rows, I / 128]``.
4. ``fp8_down_kernel``, grid (blocks, H / BLOCK_N): ``act`` times the expert's ``down`` rows, scaled the
   same way; the epilogue rounds to ``DTYPE`` and multiplies by the pair's routing weight in float32
   -> ``weighted [P, H]`` float32.
5. ``moe.sum_kernel``: the weighted sum, routing scale and shared expert, as for bf16.

Launch description: ``step_launches.fused_moe_fp8``; block sizes: ``tuning.fp8_moe``; argument checks:
``validate.check_fp8_moe_call``.
"""

import triton
import triton.language as tl

from .common import mma, release_next_grid, wait_for_previous_grid
from .fp8_linear import quantize_groups
from .moe import block_rows, expert_weights


@triton.jit
def fp8_gate_up_kernel(xq_ptr,               # [T, HIDDEN] float8_e4m3fn
                       x_scale_ptr,          # [T, HIDDEN / 128] float32
                       w_ptr,                # [E, 2 * INTER, HIDDEN] float8_e4m3fn
                       w_scale_ptr,          # [E, 2 * INTER / 128, HIDDEN / 128] float32
                       shared_w_ptr,         # [2 * INTER, HIDDEN] float8_e4m3fn (expert E)
                       shared_w_scale_ptr,   # [2 * INTER / 128, HIDDEN / 128] float32
                       sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, alpha, limit,
                       act_ptr,              # [NUM_BLOCKS * BLOCK_M, INTER] float8_e4m3fn
                       act_scale_ptr,        # [NUM_BLOCKS * BLOCK_M, INTER / 128] float32
                       HIDDEN: tl.constexpr, INTER: tl.constexpr, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                       SHARED: tl.constexpr, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """``act[row, n] = quantize(swiglu_oai(x[token] . gate_up[e, n], x[token] . gate_up[e, I + n]))`` for a
    block's rows and the 128 columns ``n`` of this program's tile."""
    tl.static_assert(BLOCK_N == 128, "one program quantizes whole 128-channel groups of act: BLOCK_N must be 128")
    tl.static_assert(BLOCK_K == 128, "one scale per K tile: BLOCK_K must be the format's block, 128")
    release_next_grid(PDL)
    block, tile = tl.program_id(0), tl.program_id(1)
    wait_for_previous_grid(PDL)
    expert, rows, valid, pairs = block_rows(sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, block, BLOCK_M)
    if expert >= 0:
        H_BLOCKS: tl.constexpr = HIDDEN // 128
        I_BLOCKS: tl.constexpr = INTER // 128
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        tokens = (pairs // (TOP_K + SHARED)).to(tl.int64)
        p_x = xq_ptr + tokens[:, None] * HIDDEN + kk[None, :]
        p_xs = x_scale_ptr + tokens * H_BLOCKS
        w = expert_weights(w_ptr, shared_w_ptr, expert, NUM_EXPERTS, 2 * INTER * HIDDEN)
        w_scale = expert_weights(w_scale_ptr, shared_w_scale_ptr, expert, NUM_EXPERTS, 2 * I_BLOCKS * H_BLOCKS)
        p_gate = w + n.to(tl.int64)[:, None] * HIDDEN + kk[None, :]
        p_up = p_gate + INTER * HIDDEN
        p_gate_scale = w_scale + tile * H_BLOCKS              # the tile's rows are one scale block
        p_up_scale = p_gate_scale + I_BLOCKS * H_BLOCKS
        # transposed, [BLOCK_N, BLOCK_M]: the weight rows fill the MMA's 64-row side, the block's rows its
        # narrow one (fp8_linear_kernel)
        gate = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for kb in range(0, H_BLOCKS):
            # [BLOCK_M, BLOCK_K], [BLOCK_M]
            b_x = tl.load(p_x + kb * BLOCK_K, mask=valid[:, None], other=0.0)
            b_xs = tl.load(p_xs + kb, mask=valid, other=0.0)
            # [BLOCK_N, BLOCK_K] each
            b_gate = tl.load(p_gate + kb * BLOCK_K)
            b_up = tl.load(p_up + kb * BLOCK_K)
            gate += mma(b_gate, tl.trans(b_x)) * tl.load(p_gate_scale + kb) * b_xs[None, :]
            up += mma(b_up, tl.trans(b_x)) * tl.load(p_up_scale + kb) * b_xs[None, :]
        gate, up = tl.trans(gate), tl.trans(up)
        gate = tl.minimum(gate.to(DTYPE).to(tl.float32), limit)
        up = tl.minimum(tl.maximum(up.to(DTYPE).to(tl.float32), -limit), limit)
        act = ((up + 1.0) * (gate * tl.sigmoid(gate * alpha))).to(DTYPE)
        # [BLOCK_M, 128], [BLOCK_M]: each row's group of this tile
        act_q, act_scale = quantize_groups(act)
        out_rows = rows.to(tl.int64)
        tl.store(act_ptr + out_rows[:, None] * INTER + n[None, :], act_q, mask=valid[:, None])
        tl.store(act_scale_ptr + out_rows * I_BLOCKS + tile, act_scale, mask=valid)


@triton.jit
def fp8_down_kernel(act_ptr,              # [NUM_BLOCKS * BLOCK_M, INTER] float8_e4m3fn
                    act_scale_ptr,        # [NUM_BLOCKS * BLOCK_M, INTER / 128] float32
                    w_ptr,                # [E, HIDDEN, INTER] float8_e4m3fn
                    w_scale_ptr,          # [E, HIDDEN / 128, INTER / 128] float32
                    shared_w_ptr,         # [HIDDEN, INTER] float8_e4m3fn (expert E)
                    shared_w_scale_ptr,   # [HIDDEN / 128, INTER / 128] float32
                    sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
                    weights_ptr,          # [T, TOP_K] float32
                    weighted_ptr,         # [P, HIDDEN] float32
                    HIDDEN: tl.constexpr, INTER: tl.constexpr, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                    SHARED: tl.constexpr, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """``weighted[pair, n] = w[pair] * (act[row] . down[e, n])`` (the dot rounded to ``DTYPE`` first; the
    shared expert's pairs: weight 1)."""
    tl.static_assert(BLOCK_K == 128, "one scale per K tile: BLOCK_K must be the format's block, 128")
    release_next_grid(PDL)
    block, tile = tl.program_id(0), tl.program_id(1)
    wait_for_previous_grid(PDL)
    expert, rows, valid, pairs = block_rows(sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, block, BLOCK_M)
    if expert >= 0:
        H_BLOCKS: tl.constexpr = HIDDEN // 128
        I_BLOCKS: tl.constexpr = INTER // 128
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = n < HIDDEN
        kk = tl.arange(0, BLOCK_K)
        p_a = act_ptr + rows.to(tl.int64)[:, None] * INTER + kk[None, :]
        p_as = act_scale_ptr + rows.to(tl.int64) * I_BLOCKS
        w = expert_weights(w_ptr, shared_w_ptr, expert, NUM_EXPERTS, HIDDEN * INTER)
        w_scale = expert_weights(w_scale_ptr, shared_w_scale_ptr, expert, NUM_EXPERTS, H_BLOCKS * I_BLOCKS)
        p_w = w + n.to(tl.int64)[:, None] * INTER + kk[None, :]
        p_ws = w_scale + (n // 128) * I_BLOCKS
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)   # transposed, as in fp8_gate_up_kernel
        for kb in range(0, I_BLOCKS):
            # [BLOCK_M, BLOCK_K], [BLOCK_M]
            b_a = tl.load(p_a + kb * BLOCK_K, mask=valid[:, None], other=0.0)
            b_as = tl.load(p_as + kb, mask=valid, other=0.0)
            # [BLOCK_N, BLOCK_K], [BLOCK_N]
            b_w = tl.load(p_w + kb * BLOCK_K, mask=m_n[:, None], other=0.0)
            b_ws = tl.load(p_ws + kb, mask=m_n, other=0.0)
            acc += mma(b_w, tl.trans(b_a)) * b_ws[:, None] * b_as[None, :]
        acc = tl.trans(acc)
        per_token: tl.constexpr = TOP_K + SHARED
        j = pairs % per_token
        weight = tl.load(weights_ptr + (pairs // per_token) * TOP_K + j, mask=valid & (j < TOP_K), other=1.0)
        out = acc.to(DTYPE).to(tl.float32) * weight[:, None]
        tl.store(weighted_ptr + pairs.to(tl.int64)[:, None] * HIDDEN + n[None, :], out,
                 mask=valid[:, None] & m_n[None, :])
