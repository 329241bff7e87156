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

``plan`` and ``check_fp8_moe_call`` at the end are the host side both launchers share.
"""

import dataclasses

import triton
import triton.language as tl

from . import moe
from .common import mma, release_next_grid, wait_for_previous_grid
from .fp8_linear import FP8_BLOCK, quantize_block_sizes, quantize_groups, scale_blocks
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


# -- host side (both launchers) ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FP8MoEPlan:
    """The five launches of one FP8 fused-MoE call, from shapes alone: ``moe``'s plan (its align and sum
    launches, block rows and counts) with FP8 GEMMs, and the quantization of x."""
    moe: moe.MoEPlan
    quantize: dict          # quantize_block_sizes: grid, warps, stages, constexprs
    gate_up: moe.KernelLaunch
    down: moe.KernelLaunch


# GPU tiles (BLOCK_N, num_warps, num_stages) of the FP8 GEMMs, by moe.plan's block rows (16: decode-sized
# calls, 64: prefill-sized). gate_up's BLOCK_N is the format's 128 (its epilogue quantizes whole groups);
# BLOCK_K is 128 everywhere (one scale per K tile). Per stage, e4m3 tiles take (BLOCK_M + 2 * 128) * 128 bytes
# in gate_up (36 KiB at BLOCK_M 16) and (BLOCK_M + BLOCK_N) * 128 in down. Not yet swept on a GPU
# (``python3 -m benchmarks.fp8_linear --tune``).
GPU_FP8_MOE = {16: dict(gate_up=(128, 4, 4), down=(64, 4, 4)),
               64: dict(gate_up=(128, 8, 3), down=(128, 4, 3))}


def plan(num_tokens: int, num_experts: int, top_k: int, shared: bool, hidden: int, inter: int, dtype,
         interpret: bool) -> FP8MoEPlan:
    """The launches of a call with these shapes (``dtype``: the model's, a ``tl`` dtype: x's and the output's).
    Block sizes and stages change the speed only, never a result."""
    base = moe.plan(num_tokens, num_experts, top_k, shared, hidden, inter, 1, interpret)
    if interpret:
        gate_up, down = (128, 1, 1), (min(triton.next_power_of_2(hidden), 256), 1, 1)
    else:
        gate_up, down = GPU_FP8_MOE[base.block_m]["gate_up"], GPU_FP8_MOE[base.block_m]["down"]
    shape = dict(HIDDEN=hidden, INTER=inter, NUM_EXPERTS=num_experts, TOP_K=top_k, SHARED=shared, DTYPE=dtype,
                 BLOCK_M=base.block_m, BLOCK_K=FP8_BLOCK)

    def gemm(n, sizes):
        block_n, warps, stages = sizes
        return moe.KernelLaunch((base.num_blocks, triton.cdiv(n, block_n)), warps, stages, dict(shape, BLOCK_N=block_n))

    return FP8MoEPlan(moe=base, quantize=quantize_block_sizes(num_tokens, hidden, interpret),
                      gate_up=gemm(inter, gate_up), down=gemm(hidden, down))


def check_fp8_moe_call(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights,
                       shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale) -> tuple:
    """Check ``fused_moe_fp8``'s arguments (shapes and dtypes only) -> (T, E, k, H, I)."""
    # absolute: the interpreted copy of this module shares the one validate
    from m3_kernels.fp8_linear import check_weight
    from m3_kernels.validate import FLOAT_DTYPES, check_dim, check_dtype, check_rank

    check_rank("x", x, 2, "[T, H]")
    check_dtype("x", x, FLOAT_DTYPES)
    tokens, hidden = (int(s) for s in x.shape)
    two_inter, _ = check_weight("w_gate_up", w_gate_up, "w_gate_up_scale", w_gate_up_scale, "[E, 2I, H]", "2I", "H")
    experts, inter = int(w_gate_up.shape[0]), two_inter // 2
    if hidden % FP8_BLOCK or two_inter % (2 * FP8_BLOCK):
        raise ValueError(f"w_gate_up: expected H and I multiples of {FP8_BLOCK} (whole scale blocks, none "
                         f"straddling the gate and up rows), got H = {hidden}, 2I = {two_inter}")
    check_dim("w_gate_up", w_gate_up, 2, hidden, "H (columns of x)")
    check_weight("w_down", w_down, "w_down_scale", w_down_scale, "[E, H, I]", "H", "I")
    check_dim("w_down", w_down, 0, experts, "E (experts of w_gate_up)")
    check_dim("w_down", w_down, 1, hidden, "H (columns of x)")
    check_dim("w_down", w_down, 2, inter, "I (half the rows of w_gate_up)")
    shared = (shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale)
    if any(t is None for t in shared) and any(t is not None for t in shared):
        raise ValueError("shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale: pass all four (the "
                         "shared expert) or none")
    if shared_gate_up is not None:
        check_weight("shared_gate_up", shared_gate_up, "shared_gate_up_scale", shared_gate_up_scale, "[2I, H]",
                     "2I", "H")
        check_weight("shared_down", shared_down, "shared_down_scale", shared_down_scale, "[H, I]", "H", "I")
        check_dim("shared_gate_up", shared_gate_up, 0, two_inter, "2I (the experts' width)")
        check_dim("shared_gate_up", shared_gate_up, 1, hidden, "H (columns of x)")
        check_dim("shared_down", shared_down, 0, hidden, "H (columns of x)")
        check_dim("shared_down", shared_down, 1, inter, "I (the experts' width)")
    check_rank("topk_ids", topk_ids, 2, "[T, k]")
    check_dtype("topk_ids", topk_ids, "int32")
    check_dim("topk_ids", topk_ids, 0, tokens, "T (rows of x)")
    top_k = int(topk_ids.shape[1])
    if not 1 <= top_k <= experts:
        raise ValueError(f"topk_ids: expected k in [1, E = {experts}] experts per token, got k = {top_k}")
    check_rank("topk_weights", topk_weights, 2, "[T, k]")
    check_dtype("topk_weights", topk_weights, "float32")
    check_dim("topk_weights", topk_weights, 0, tokens, "T (rows of x)")
    check_dim("topk_weights", topk_weights, 1, top_k, "k (columns of topk_ids)")
    return tokens, experts, top_k, hidden, inter


def act_shapes(fp8_plan: FP8MoEPlan, inter: int) -> tuple:
    """-> the shapes of ``act`` and ``act_scale`` (the GEMMs' intermediate) for this plan."""
    return (fp8_plan.moe.num_rows, inter), (fp8_plan.moe.num_rows, scale_blocks(inter))
