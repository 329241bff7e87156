"""Fused MoE experts: each touched expert's weights read once, SwiGLU-OAI and the routing weights fused.

``out[t] = scale * sum_j w[t, j] * expert_{ids[t, j]}(x[t]) (+ shared_expert(x[t]))`` for the k experts
chosen per token (``ids``, ``w``: the router's), where ``expert_e(x) = down_e(swiglu_oai(gate_up_e(x)))``
with the canonical weights ``gate_up [E, 2I, H]`` (gate rows, then up rows) and ``down [E, H, I]``; the
optional shared expert has the same form and width (``[2I, H]``, ``[H, I]``) and runs as one more
expert, id E, weight 1, of every token. Four launches, chained in this order by ``step_launches.fused_moe``:

1. ``align_kernel`` (one program): the (token, expert) pairs ``p = t * S + j`` (``S = k``, or ``k + 1``
   with the shared expert as ``j = k``) grouped by expert, stably, each expert's group padded to a
   multiple of ``BLOCK_M`` rows (vLLM's ``moe_align_block_size``): ``sorted_pairs``, and per block of
   ``BLOCK_M`` rows its expert and how many of its rows hold pairs (an unused block: expert -1).
   Blocks beyond the ones the step needs stay unused, so the grids below depend on the number of
   tokens only (CUDA graphs, jit).
2. ``gate_up_kernel``, grid (blocks, I / BLOCK_N): a block's rows of ``x`` (gathered by token) times
   its expert's gate and up rows ``n``; the epilogue rounds both to the model dtype (the GEMM output
   of the unfused model) and applies SwiGLU-OAI in float32, one rounding -> ``act`` [rows, I] in
   sorted order.
3. ``down_kernel``, grid (blocks, H / BLOCK_N): ``act`` times the expert's ``down`` rows; the epilogue
   rounds to the model dtype, multiplies by the pair's routing weight (the shared expert's: 1) in
   float32 and stores the row at its pair index: ``weighted`` [P, H] float32.
4. ``sum_kernel``, grid (T, H / BLOCK_H): ``routed = sum_{j < k} weighted[t * S + j]`` in the order
   j = 0..k-1 (float32), rounded to the dtype, then ``routed * scale`` rounded, then ``+ shared``
   (the shared pair's row, already a dtype value) rounded: the unfused model's roundings.

Every weight tile is read by one program per block of its expert, and at decode sizes an expert's
pairs fit one block, so each touched expert's weights cross the memory bus once per step (the
step's byte floor). Every result element is computed by one program in a fixed order, so torch and
JAX launches give the same bits. Expert ids must lie in [0, E) (the router's output; not checked on
the device, which would synchronise).

The host side (shapes and dtypes only) is shared by both launchers:
``validate.check_moe_call``, ``tuning.moe``, ``step_launches.fused_moe``.
"""

import triton
import triton.language as tl

from .common import mma, release_next_grid, wait_for_previous_grid


@triton.jit
def pair_experts(ids_ptr, pairs, num_pairs, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                 SHARED: tl.constexpr):
    """The expert of each pair index in ``pairs`` (-1 past ``num_pairs``): ``ids[t, j]``, or E for the
    shared expert's pair ``j = k``."""
    per_token: tl.constexpr = TOP_K + SHARED
    token, j = pairs // per_token, pairs % per_token
    ok = pairs < num_pairs
    routed = tl.load(ids_ptr + token * TOP_K + j, mask=ok & (j < TOP_K), other=NUM_EXPERTS)
    return tl.where(ok, routed, -1)


# the token and block counts change with every step's size: run-time values, one compiled variant for all
@triton.jit(do_not_specialize=["num_tokens", "num_blocks"])
def align_kernel(ids_ptr, num_tokens, num_blocks,
                 sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
                 NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr,
                 EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """One program. ``ids`` [T, k] int32 -> ``sorted_pairs`` [num_blocks * BLOCK_M] int32 (the pairs of
    expert 0, padding, the pairs of expert 1, ...; padding rows unwritten), ``block_expert`` /
    ``block_rows`` [num_blocks] int32. Experts run 0..E (E: the shared one, when SHARED)."""
    release_next_grid(PDL)
    wait_for_previous_grid(PDL)
    num_pairs = num_tokens * (TOP_K + SHARED)
    experts = tl.arange(0, EXPERTS_POW2)
    counts = tl.zeros([EXPERTS_POW2], tl.int32)
    for start in range(0, num_pairs, CHUNK):
        ids = pair_experts(ids_ptr, start + tl.arange(0, CHUNK), num_pairs, NUM_EXPERTS, TOP_K, SHARED)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # each pair's row: its expert's start + the pairs of that expert before it (earlier chunks: `seen`)
    seen = tl.zeros([EXPERTS_POW2], tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = pair_experts(ids_ptr, offs, num_pairs, NUM_EXPERTS, TOP_K, SHARED)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)                  # [CHUNK, experts]
        before = tl.cumsum(hit, axis=0) - hit                                    # same expert, earlier in chunk
        row = tl.sum(hit * (before + (starts + seen)[None, :]), axis=1)
        tl.store(sorted_pairs_ptr + row, offs, mask=offs < num_pairs)
        seen += tl.sum(hit, axis=0)
    used = tl.sum(padded, axis=0)
    for b0 in range(0, num_blocks, CHUNK):
        block = b0 + tl.arange(0, CHUNK)
        first = block * BLOCK_M
        # the block's expert: the first whose padded group ends after the block's first row
        expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        mine = experts[None, :] == expert[:, None]
        end = tl.sum(tl.where(mine, (starts + counts)[None, :], 0), axis=1)   # the expert's last pair + 1
        active = first < used
        tl.store(block_expert_ptr + block, tl.where(active, expert, -1), mask=block < num_blocks)
        tl.store(block_rows_ptr + block, tl.where(active, tl.minimum(end - first, BLOCK_M), 0),
                 mask=block < num_blocks)


@triton.jit
def block_rows(sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, block, BLOCK_M: tl.constexpr):
    """-> (expert, rows [BLOCK_M] (this block's row indices), valid [BLOCK_M], pairs [BLOCK_M])."""
    expert = tl.load(block_expert_ptr + block)
    count = tl.load(block_rows_ptr + block)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = tl.arange(0, BLOCK_M) < count
    pairs = tl.load(sorted_pairs_ptr + rows, mask=valid, other=0)
    return expert, rows, valid, pairs


@triton.jit
def expert_weights(w_ptr, shared_w_ptr, expert, NUM_EXPERTS: tl.constexpr, EXPERT_SIZE: tl.constexpr):
    """-> the first weight of ``expert``: in ``w_ptr`` (``EXPERT_SIZE`` elements an expert), or the shared
    expert's ``shared_w_ptr`` for ``expert == NUM_EXPERTS``."""
    if expert == NUM_EXPERTS:
        w = shared_w_ptr
    else:
        w = w_ptr + expert.to(tl.int64) * EXPERT_SIZE
    return w


@triton.jit
def gate_up_kernel(x_ptr, w_ptr, shared_w_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, alpha, limit,
                   act_ptr,
                   HIDDEN: tl.constexpr, INTER: tl.constexpr, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                   SHARED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr = False):
    """``act[row, n] = swiglu_oai(x[token] . gate_up[e, n], x[token] . gate_up[e, I + n])`` for a block's rows.
    x [T, HIDDEN] contiguous; w [E, 2 * INTER, HIDDEN] and shared_w [2 * INTER, HIDDEN] (expert E)
    contiguous; act [num_blocks * BLOCK_M, INTER]."""
    release_next_grid(PDL)
    block, tile = tl.program_id(0), tl.program_id(1)
    wait_for_previous_grid(PDL)
    expert, rows, valid, pairs = block_rows(sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, block, BLOCK_M)
    if expert >= 0:
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < INTER
        kk = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + (pairs // (TOP_K + SHARED)).to(tl.int64)[:, None] * HIDDEN
        w = expert_weights(w_ptr, shared_w_ptr, expert, NUM_EXPERTS, 2 * INTER * HIDDEN)
        gate_rows = w + n.to(tl.int64)[:, None] * HIDDEN
        up_rows = gate_rows + INTER * HIDDEN
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            k = k0 + kk
            k_ok = k < HIDDEN
            a = tl.load(x_rows + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_gate = tl.load(gate_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            w_up = tl.load(up_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            gate += mma(a, tl.trans(w_gate))
            up += mma(a, tl.trans(w_up))
        dtype = act_ptr.dtype.element_ty
        gate = tl.minimum(gate.to(dtype).to(tl.float32), limit)
        up = tl.minimum(tl.maximum(up.to(dtype).to(tl.float32), -limit), limit)
        act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
        tl.store(act_ptr + rows.to(tl.int64)[:, None] * INTER + n[None, :], act.to(dtype),
                 mask=valid[:, None] & n_ok[None, :])


@triton.jit
def down_kernel(act_ptr, w_ptr, shared_w_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, weights_ptr,
                weighted_ptr,
                HIDDEN: tl.constexpr, INTER: tl.constexpr, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                SHARED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PDL: tl.constexpr = False):
    """``weighted[pair, n] = w[pair] * (act[row] . down[e, n])`` (the dot rounded to the model dtype first).
    act [num_blocks * BLOCK_M, INTER]; w [E, HIDDEN, INTER], shared_w [HIDDEN, INTER] contiguous;
    weights [T, k] float32 (the shared expert's pairs: 1); weighted [P, HIDDEN] float32."""
    release_next_grid(PDL)
    block, tile = tl.program_id(0), tl.program_id(1)
    wait_for_previous_grid(PDL)
    expert, rows, valid, pairs = block_rows(sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, block, BLOCK_M)
    if expert >= 0:
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < HIDDEN
        kk = tl.arange(0, BLOCK_K)
        a_rows = act_ptr + rows.to(tl.int64)[:, None] * INTER
        w = expert_weights(w_ptr, shared_w_ptr, expert, NUM_EXPERTS, HIDDEN * INTER)
        w_rows = w + n.to(tl.int64)[:, None] * INTER
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            k = k0 + kk
            k_ok = k < INTER
            a = tl.load(a_rows + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += mma(a, tl.trans(b))
        per_token: tl.constexpr = TOP_K + SHARED
        j = pairs % per_token
        weight = tl.load(weights_ptr + (pairs // per_token) * TOP_K + j, mask=valid & (j < TOP_K), other=1.0)
        out = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
        tl.store(weighted_ptr + pairs.to(tl.int64)[:, None] * HIDDEN + n[None, :], out,
                 mask=valid[:, None] & n_ok[None, :])


@triton.jit
def sum_kernel(weighted_ptr, scale,
               out_ptr,
               HIDDEN: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr, BLOCK_H: tl.constexpr,
               PDL: tl.constexpr = False):
    """``out[t] = round(round(round(sum_{j < k} weighted[t * S + j]) * scale) + weighted[t * S + k])`` (round:
    to out's dtype; no shared term without SHARED). weighted [P, HIDDEN] float32; out [T, HIDDEN]."""
    release_next_grid(PDL)
    token, tile = tl.program_id(0), tl.program_id(1)
    wait_for_previous_grid(PDL)
    h = tile * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = h < HIDDEN
    src = weighted_ptr + token.to(tl.int64) * ((TOP_K + SHARED) * HIDDEN) + h
    total = tl.load(src, mask=ok, other=0.0)
    for j in tl.static_range(1, TOP_K):
        total += tl.load(src + j * HIDDEN, mask=ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    out = (total.to(dtype).to(tl.float32) * scale).to(dtype)
    if SHARED:
        out = (out.to(tl.float32) + tl.load(src + TOP_K * HIDDEN, mask=ok, other=0.0)).to(dtype)
    tl.store(out_ptr + token.to(tl.int64) * HIDDEN + h, out, mask=ok)
