"""Fused MoE experts: each touched expert's weights read once, SwiGLU-OAI and the routing weights fused.

``out[t] = scale * sum_j w[t, j] * expert_{ids[t, j]}(x[t]) (+ shared_expert(x[t]))`` for the k experts
chosen per token (``ids``, ``w``: the router's), where ``expert_e(x) = down_e(swiglu_oai(gate_up_e(x)))``
with the canonical weights ``gate_up [E, 2I, H]`` (gate rows, then up rows) and ``down [E, H, I]``; the
optional shared expert has the same form and width (``[2I, H]``, ``[H, I]``) and runs as one more
expert, id E, weight 1, of every token. Four launches, in the order :func:`plan` gives them:

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

``plan`` and ``check_moe_call`` at the end are the host side both launchers share.
"""

import dataclasses

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


@triton.jit
def align_kernel(ids_ptr, num_tokens,
                 sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
                 NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr,
                 EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr, NUM_BLOCKS: tl.constexpr,
                 CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """One program. ``ids`` [T, k] int32 -> ``sorted_pairs`` [NUM_BLOCKS * BLOCK_M] int32 (the pairs of
    expert 0, padding, the pairs of expert 1, ...; padding rows unwritten), ``block_expert`` /
    ``block_rows`` [NUM_BLOCKS] int32. Experts run 0..E (E: the shared one, when SHARED)."""
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
    for b0 in range(0, NUM_BLOCKS, CHUNK):
        block = b0 + tl.arange(0, CHUNK)
        first = block * BLOCK_M
        # the block's expert: the first whose padded group ends after the block's first row
        expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        mine = experts[None, :] == expert[:, None]
        end = tl.sum(tl.where(mine, (starts + counts)[None, :], 0), axis=1)   # the expert's last pair + 1
        active = first < used
        tl.store(block_expert_ptr + block, tl.where(active, expert, -1), mask=block < NUM_BLOCKS)
        tl.store(block_rows_ptr + block, tl.where(active, tl.minimum(end - first, BLOCK_M), 0),
                 mask=block < NUM_BLOCKS)


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
    contiguous; act [NUM_BLOCKS * BLOCK_M, INTER]."""
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
    act [NUM_BLOCKS * BLOCK_M, INTER]; w [E, HIDDEN, INTER], shared_w [HIDDEN, INTER] contiguous;
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


# -- host side (both launchers) ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """One kernel's grid and launch parameters (``constexprs`` by name, beyond the shape ones)."""
    grid: tuple
    num_warps: int
    num_stages: int
    constexprs: dict


@dataclasses.dataclass(frozen=True)
class MoEPlan:
    """The four launches of one fused-MoE call, from shapes alone."""
    num_tokens: int
    pairs_per_token: int     # k, or k + 1 with the shared expert
    block_m: int
    num_blocks: int
    align: KernelLaunch
    gate_up: KernelLaunch
    down: KernelLaunch
    sum: KernelLaunch

    @property
    def num_pairs(self) -> int:
        return self.num_tokens * self.pairs_per_token

    @property
    def num_rows(self) -> int:
        """Rows of the sorted (padded) pair order: ``act``'s and ``sorted_pairs``' length."""
        return self.num_blocks * self.block_m


# GPU block sizes (H200-tuned for bf16: python3 -m benchmarks.moe --tune): decode-sized calls stream weights
# (16-row blocks), prefill-sized ones (>= 32 pairs per expert on average) are compute-bound (64-row blocks);
# float32 runs them with fewer stages where its tiles would not fit ``_SHARED_MEMORY``
_GPU_DECODE = dict(block_m=16, gate_up=(32, 128, 4, 4), down=(64, 128, 4, 4))
_GPU_PREFILL = dict(block_m=64, gate_up=(128, 64, 4, 4), down=(128, 64, 4, 3))
# shared memory the GEMMs' pipelined tiles may take (an H100 / H200 block has 227 KiB; Triton adds its own)
_SHARED_MEMORY = 200 << 10


def plan(num_tokens: int, num_experts: int, top_k: int, shared: bool, hidden: int, inter: int,
         itemsize: int, interpret: bool) -> MoEPlan:
    """The launches of a call with these shapes (``itemsize``: bytes per element of x and the weights).
    Block sizes and stages change the speed only, never a result."""
    per_token = top_k + shared
    pairs, experts = num_tokens * per_token, num_experts + shared
    if interpret:
        # the interpreter's cost is per program: whole rows of N and K per program where they are small
        block_m = 16
        gate_up = (min(triton.next_power_of_2(inter), 128), min(triton.next_power_of_2(hidden), 256), 1, 1)
        down = (min(triton.next_power_of_2(hidden), 256), min(triton.next_power_of_2(inter), 256), 1, 1)
    else:
        sizes = _GPU_PREFILL if pairs >= 32 * experts else _GPU_DECODE
        block_m, gate_up, down = sizes["block_m"], sizes["gate_up"], sizes["down"]
    # each expert with pairs adds at most one block beyond an even split of the pairs
    num_blocks = triton.cdiv(pairs, block_m) + min(experts, pairs)
    shape = dict(NUM_EXPERTS=num_experts, TOP_K=top_k, SHARED=shared)
    sum_block = min(triton.next_power_of_2(hidden), 1024)

    def gemm(n, sizes, weight_tiles):
        block_n, block_k, warps, stages = sizes
        # an estimate: each stage holds a [BLOCK_M, BLOCK_K] tile of rows and weight_tiles [BLOCK_N, BLOCK_K]
        # weight tiles (test_plans_fit_hopper_shared_memory checks what Triton allocates)
        stage_bytes = (block_m + weight_tiles * block_n) * block_k * itemsize
        stages = max(1, min(stages, _SHARED_MEMORY // stage_bytes))
        return KernelLaunch((num_blocks, triton.cdiv(n, block_n)), warps, stages,
                            dict(shape, HIDDEN=hidden, INTER=inter, BLOCK_M=block_m, BLOCK_N=block_n,
                                 BLOCK_K=block_k))

    return MoEPlan(
        num_tokens=num_tokens, pairs_per_token=per_token, block_m=block_m, num_blocks=num_blocks,
        align=KernelLaunch((1,), 4, 1, dict(shape, EXPERTS_POW2=triton.next_power_of_2(experts), BLOCK_M=block_m,
                                            NUM_BLOCKS=num_blocks, CHUNK=256 if interpret else 64)),
        gate_up=gemm(inter, gate_up, 2), down=gemm(hidden, down, 1),
        sum=KernelLaunch((num_tokens, triton.cdiv(hidden, sum_block)), 4, 1,
                         dict(HIDDEN=hidden, TOP_K=top_k, SHARED=shared, BLOCK_H=sum_block)))


def check_moe_call(x, w_gate_up, w_down, topk_ids, topk_weights, shared_gate_up, shared_down) -> tuple:
    """Check ``fused_moe``'s arguments (shapes and dtypes only) -> (T, E, k, H, I)."""
    # absolute: the interpreted copy of this module shares the one validate
    from m3_kernels.validate import FLOAT_DTYPES, check_dim, check_dtype, check_rank, dtype_name

    check_rank("x", x, 2, "[T, H]")
    check_dtype("x", x, FLOAT_DTYPES)
    tokens, hidden = (int(s) for s in x.shape)
    check_rank("w_gate_up", w_gate_up, 3, "[E, 2I, H]")
    check_rank("w_down", w_down, 3, "[E, H, I]")
    experts, two_inter = int(w_gate_up.shape[0]), int(w_gate_up.shape[1])
    if two_inter % 2:
        raise ValueError(f"w_gate_up: expected [E, 2I, H] (gate rows, then up rows), got an odd 2I = {two_inter}")
    inter = two_inter // 2
    check_dim("w_gate_up", w_gate_up, 2, hidden, "H (columns of x)")
    check_dim("w_down", w_down, 0, experts, "E (experts of w_gate_up)")
    check_dim("w_down", w_down, 1, hidden, "H (columns of x)")
    check_dim("w_down", w_down, 2, inter, "I (half the rows of w_gate_up)")
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError("shared_gate_up, shared_down: pass both (the shared expert) or neither")
    weights = [("w_gate_up", w_gate_up), ("w_down", w_down)]
    if shared_gate_up is not None:
        check_rank("shared_gate_up", shared_gate_up, 2, "[2I, H]")
        check_rank("shared_down", shared_down, 2, "[H, I]")
        check_dim("shared_gate_up", shared_gate_up, 0, two_inter, "2I (the experts' width: a shared expert of "
                  "another width runs outside fused_moe)")
        check_dim("shared_gate_up", shared_gate_up, 1, hidden, "H (columns of x)")
        check_dim("shared_down", shared_down, 0, hidden, "H (columns of x)")
        check_dim("shared_down", shared_down, 1, inter, "I (the experts' width)")
        weights += [("shared_gate_up", shared_gate_up), ("shared_down", shared_down)]
    for name, w in weights:
        if dtype_name(w) != dtype_name(x):
            raise TypeError(f"{name}: expected the dtype of x ({dtype_name(x)}), got {dtype_name(w)}")
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
