"""The one tuning table: program targets, split rules, block sizes, warps and stages.

Every launch reads its knobs here, from shapes only (never from ``seq_lens``
values), so a captured CUDA graph or a jitted JAX step replays without
recompiling, and torch and JAX pick the same kernel variant for the same
shapes (bit-identical results). GPU numbers were measured on an H200
(``benchmarks/tune.py``; docs/PERF.md).

Triton's interpreter (CPU tensors) runs a launch's programs one after the
other, so it aims at far fewer programs; it still splits small batches, which
keeps split-K and its merge covered by the CPU tests. Tests that want one
program per row tile use :func:`override`::

    with tuning.override(target_programs=1, sparse_target_programs=1):
        ...
"""

from __future__ import annotations

import contextlib
import dataclasses

from .maps import FP8_BLOCK, MAX_TILE_ROWS, PAGE_SIZE, RowTile, cdiv, next_pow2


@dataclasses.dataclass(frozen=True)
class ProgramTargets:
    # split-K attention and the indexer's block chunks aim at this many programs
    # (~8 per SM on a 132-SM H200; a constant, not the device's SM count, so every
    # GPU and both frameworks choose the same variant)
    target_programs: int
    # sparse attention visits only topk blocks per row tile: it splits only while
    # there are fewer (tile, KV head) programs than this, about one per SM (batch 64,
    # 16k: one program per (token, KV head), no merge, 68 us = 93% of the floor,
    # against 91 us with 4 splits)
    sparse_target_programs: int


GPU = ProgramTargets(target_programs=1024, sparse_target_programs=128)
INTERPRETER = ProgramTargets(target_programs=16, sparse_target_programs=8)
_overrides: dict = {}

# A split-K program of dense attention gets at least this many blocks (fewer make
# the pipeline's fill and the partial write dominate); sparse ones down to 1.
MIN_BLOCKS_PER_SPLIT = 4
# Blocks whose page ids a kernel gathers in one go before loading their K/V.
STEP_GROUP = 16
# select_blocks: rows of at least SELECT_TWO_LEVEL_BLOCKS (padded) blocks first
# pick the best chunks of SELECT_CHUNK blocks, then the best blocks inside them.
SELECT_CHUNK = 16
SELECT_TWO_LEVEL_BLOCKS = 512
# The interpreter's cost is per program: there selection and cache writes take many tokens each.
SELECT_INTERPRETER_TOKENS = 32
CACHE_WRITE_INTERPRETER_TOKENS = 64
MERGE_NUM_WARPS = 4
CACHE_WRITE_NUM_WARPS = 4


def targets(interpret: bool) -> ProgramTargets:
    base = INTERPRETER if interpret else GPU
    return dataclasses.replace(base, **_overrides) if _overrides else base


def max_target_programs() -> int:
    """The most programs any launch aims at (sizes split-K workspaces)."""
    return max(targets(False).target_programs, targets(True).target_programs)


def current_overrides() -> dict:
    """The fields ``override`` has set now (a copy): what a tensor-parallel engine hands its
    worker processes with each step, so that every rank launches the geometry rank 0 planned."""
    return dict(_overrides)


@contextlib.contextmanager
def override(**fields):
    """Other program targets (GPU and interpreter alike) inside the ``with`` block (tests; one thread)."""
    global _overrides
    saved = _overrides
    _overrides = {**saved, **fields}
    try:
        yield
    finally:
        _overrides = saved


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int


def wide(dtype: str) -> bool:
    """float32 operands: tiles of twice the bytes, so smaller blocks and fewer stages fit shared memory."""
    return str(dtype).removeprefix("torch.") == "float32"


def attention(*, tile: RowTile, num_tiles: int, num_kv_heads: int, head_dim: int, topk: int, max_blocks: int,
              sparse: bool, interpret: bool, dtype: str = "bfloat16", kv_fp8: bool = False) -> AttentionConfig:
    """Splits, block size, warps and stages of one paged-attention launch (H200: batch 64, 32k, bf16).
    ``kv_fp8``: e4m3 K/V, whose tiles are half the bytes."""
    # blocks one tile visits: about topk (its tokens mostly agree) or every block
    num_entries = topk if sparse else max_blocks
    work = max(num_tiles * num_kv_heads, 1)
    t = targets(interpret)
    target = t.sparse_target_programs if sparse else t.target_programs
    splits = max(1, min(cdiv(target, work), cdiv(num_entries, 1 if sparse else MIN_BLOCKS_PER_SPLIT)))
    if tile.tokens_per_tile > 1:
        # tiles of several tokens (prefill spans, whose tile count follows the token count, any number;
        # speculative verify rows): a power of two keeps the split counts (kernel variants, all compiled
        # at start) few
        splits = 1 << (splits.bit_length() - 1)
    num_warps = 8 if tile.block_m >= 64 else 4
    if wide(dtype):  # 228 KB of shared memory per SM: K + V tiles of 128 x 128 fp32 take 128 KB a stage
        return AttentionConfig(splits, 64 if tile.block_m <= 16 else 32, num_warps, num_stages=2)
    if sparse and tile.tokens_per_tile == 1 and head_dim <= 128:
        # one token per tile (decode): BLOCK_N 128, with 3 stages while the launch has about one program
        # per SM or fewer, else 2 (`benchmarks.tune sparse`, batch 32 / 64 / 128 at 16k: 40.0 / 69.6 /
        # 131.8 us, against 45.9 / 70.9 / 133.3 with BLOCK_N 64 and 3 stages); FP8 tiles, half the bytes,
        # keep 3 (`tune fp8`, batch 8 / 64: 18.6 / 57.9 us, against 19.6 / 62.2 with BLOCK_N 64)
        stages = 3 if kv_fp8 or splits * work <= t.sparse_target_programs else 2
        return AttentionConfig(splits, 128, num_warps, stages)
    return AttentionConfig(splits, 64 if sparse or head_dim > 128 else 128, num_warps, num_stages=3)


@dataclasses.dataclass(frozen=True)
class IndexConfig:
    num_chunks: int
    blocks_per_program: int
    block_n: int
    num_warps: int
    num_stages: int


def index_scores(*, tile: RowTile, num_tiles: int, head_dim: int, max_blocks: int, interpret: bool,
                 dtype: str = "bfloat16") -> IndexConfig:
    """The indexer's block chunking: ~target programs over (row tiles x block chunks). Full tiles
    (prefill's: MAX_TILE_ROWS = 128 rows) of queries narrower than float32 run 4 warps and 2 stages (H200, M3, one
    prompt, index_scores_prefill, alternated twice in one call, results/2026-12-01-h200-s11-index-tune.json:
    128k 19.8 / 19.7 ms against 22.6 / 22.8 with 8 warps and 3 stages, 32k 1.66 / 1.42 against
    1.68 / 1.70; the same scores); other tiles of 64+ rows keep 8 warps (not measured), float32 ones
    too (a 128 x 128 float32 query is 128 registers a thread at 4 warps)."""
    chunks = max(1, min(cdiv(targets(interpret).target_programs, max(num_tiles, 1)), max_blocks))
    per_program = max(1, cdiv(max_blocks, chunks))
    full = tile.block_m >= MAX_TILE_ROWS and not wide(dtype)
    return IndexConfig(num_chunks=max(1, cdiv(max_blocks, per_program)), blocks_per_program=per_program,
                       block_n=128 if head_dim <= 128 and not wide(dtype) else 64,
                       num_warps=8 if tile.block_m >= 64 and not full else 4,
                       num_stages=2 if wide(dtype) or full else 3)


@dataclasses.dataclass(frozen=True)
class SelectConfig:
    blocks_pad: int       # the row's blocks, padded to a power of two
    chunk: int            # 0: one top-k over the row; else the chunk size of the two-level top-k
    tokens_per_program: int
    num_warps: int


def select_blocks(*, num_tokens: int, num_heads: int, max_blocks: int, topk: int, interpret: bool) -> SelectConfig:
    """One selection launch. GPU: one token per program and about 1024 warps in all: few rows
    get 8 warps each, many rows 1 (every compare-exchange then stays inside one warp), but a
    thread holds at most 64 keys. Interpreter: many tokens per program (its cost is per program)."""
    topk_pad = next_pow2(topk)
    blocks_pad = max(next_pow2(max_blocks), topk_pad, 16)
    two_level = blocks_pad >= max(SELECT_TWO_LEVEL_BLOCKS, 2 * topk_pad * SELECT_CHUNK)
    # interpreter: up to SELECT_INTERPRETER_TOKENS rows, but no more keys than that many rows of 32 blocks
    tokens = max(1, min(SELECT_INTERPRETER_TOKENS, SELECT_INTERPRETER_TOKENS * 32 // blocks_pad)) if interpret else 1
    rows = cdiv(num_tokens, tokens) * num_heads
    warps = max(1, min(8, next_pow2(cdiv(1024, max(rows, 1)))), min(8, blocks_pad // 2048))
    return SelectConfig(blocks_pad, SELECT_CHUNK if two_level else 0, tokens, warps)


assert PAGE_SIZE % 128 == 0  # attention/indexer block_n divide the page


# -- the CuTeDSL indexer (backend="cutedsl", cute_index.py) -------------------------------
# Index-K pages in flight per CTA (a page is 128 x Di elements: 32 KB at Di = 128, bf16) and the
# CTAs the block chunking aims at (None: the Triton scorer's target). `benchmarks.indexer --sweep`
# on an H200 (M3, 16k, batch 1 / 8 / 64; results/2026-12-01-h200-s8-cutedsl-sweep.log): 2 stages and 256
# CTAs took 4.7 / 12.7 / 65.4 us against 4.9 / 14.6 / 65.7 with 3 and 1024 (at batch 8 more CTAs
# mean shorter chains per CTA, each paying the pipeline's fill). Di = 64 is not swept.
CUTEDSL_STAGES = {64: 4, 128: 2}
CUTEDSL_TARGET_PROGRAMS = 256
# The CuTeDSL dense prefill's K/V ring (cute_prefill.py): a stage is one K and one V page, released
# one block after its S (the intra-warpgroup overlap holds V_{j-1} through block j), so the page
# of block j + stages - 1 starts loading only midway through block j: 3 stages keep it more than
# a block ahead. At D = 128 the 32 KiB query tile and 3 stages of 64 KiB fill 225 of the H200's
# 227 KiB of shared memory.
CUTEDSL_PREFILL_STAGES = {64: 4, 128: 3}


@dataclasses.dataclass(frozen=True)
class CuteIndexConfig:
    stages: int
    target_programs: int   # the block chunking aims at this many CTAs, as index_scores does


def cutedsl_index_scores(*, head_dim: int) -> CuteIndexConfig:
    """The CuTeDSL scorer's compile-time knobs (besides the row tile); its chunking is
    ``index_scores``'s, computed in the kernel's host code from the runtime sizes."""
    target = CUTEDSL_TARGET_PROGRAMS if CUTEDSL_TARGET_PROGRAMS is not None else targets(False).target_programs
    return CuteIndexConfig(CUTEDSL_STAGES[head_dim], target)


# -- the model-step kernels -----------------------------------------------------------------
# Their block sizes change the speed only, never a result: every sum they make is exact or runs in the
# same order whatever the block sizes (the kernel modules' docstrings), except the router's logits, whose
# float32 sums follow BLOCK_H's chunks and SPLITS' ranges: the same for torch and JAX, as both read them here.

@dataclasses.dataclass(frozen=True)
class NormConfig:
    block_r: int          # rows per program
    block_h: int          # next power of two >= H: a row whole in registers
    num_warps: int
    num_stages: int


def norm(*, rows: int, hidden: int, interpret: bool) -> NormConfig:
    """``norm.rms_norm_kernel``."""
    block_h = next_pow2(hidden)
    if interpret:
        # the interpreter's cost is per program and operation: up to 2^16 elements per program
        return NormConfig(max(1, min(next_pow2(max(rows, 1)), (1 << 16) // block_h)), block_h, 1, 1)
    # one row per program, 8-32 elements per thread (hidden 6144: 8 warps, 32 each)
    return NormConfig(1, block_h, 4 if block_h <= 2048 else 8 if block_h <= 8192 else 16, 1)


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    experts_pad: int      # next power of two >= max(E, 16)
    # router_logits_kernel
    block_t: int
    block_e: int
    block_h: int
    splits: int           # ranges of H summed by separate programs (grid axis 2)
    num_warps: int
    num_stages: int
    # router_topk_kernel
    topk_block_t: int
    topk_num_warps: int


def router(*, tokens: int, hidden: int, experts: int, interpret: bool) -> RouterConfig:
    """``router.router_logits_kernel`` and ``router.router_topk_kernel``."""
    experts_pad = max(16, next_pow2(experts))
    if interpret:
        # the interpreter's cost is per program and operation: many tokens, wide chunks, one split
        block_t = max(16, min(next_pow2(max(tokens, 1)), 128))
        return RouterConfig(experts_pad, block_t, experts_pad, max(16, min(next_pow2(hidden), 1024)), 1, 1, 1,
                            topk_block_t=block_t, topk_num_warps=1)
    if tokens <= 64:
        # decode: the router weight (E = 128, H = 6144: 1.5 MB of bf16) is the traffic; spread it over
        # E / 16 x 8 programs instead of streaming it through one SM
        return RouterConfig(experts_pad, 16, 16, 64, 8, 4, 3, topk_block_t=16, topk_num_warps=4)
    # prefill: every program streams the whole weight from L2 and its tokens' rows once
    return RouterConfig(experts_pad, 16 if tokens <= 2048 else 64, experts_pad, 64 if experts_pad <= 128 else 32, 1,
                        4, 3, topk_block_t=16, topk_num_warps=4)


@dataclasses.dataclass(frozen=True)
class QKRopeConfig:
    block_t: int          # tokens per program
    q_heads: int          # q heads per program (a power of two)
    num_warps: int
    num_stages: int
    fp_fusion: bool       # GPUs: False, no FMA contraction (qk_rope.py's docstring)


def qk_rope(*, num_tokens: int, num_q_heads: int, head_dim: int, interpret: bool) -> QKRopeConfig:
    """``qk_rope.qk_norm_rope_kernel``."""
    q_heads_pad = next_pow2(num_q_heads)
    if interpret:
        # the interpreter's cost is per program and operation: all q heads, up to ~2^15 q elements a program
        block_t = max(1, min(next_pow2(max(num_tokens, 1)), (1 << 15) // (q_heads_pad * head_dim)))
        return QKRopeConfig(block_t, q_heads_pad, 1, 1, fp_fusion=True)
    # one token a program, up to 2048 q elements (16 heads of 128) per q program
    return QKRopeConfig(1, min(q_heads_pad, max(1, 2048 // head_dim)), 4, 1, fp_fusion=False)


# fused MoE GEMMs, (BLOCK_N, BLOCK_K, warps, stages) per kernel, H200-tuned for bf16
# (python3 -m benchmarks.moe --tune): decode-sized calls stream weights (16-row blocks), prefill-sized ones
# (>= 32 pairs per expert on average) are compute-bound (64-row blocks); float32 runs them with fewer stages
# where its tiles would not fit MOE_SHARED_MEMORY
MOE_GPU_DECODE = dict(block_m=16, gate_up=(32, 128, 4, 4), down=(64, 128, 4, 4))
MOE_GPU_PREFILL = dict(block_m=64, gate_up=(128, 64, 4, 4), down=(128, 64, 4, 3))
# shared memory the GEMMs' pipelined tiles may take (an H100 / H200 block has 227 KiB; Triton adds its own)
MOE_SHARED_MEMORY = 200 << 10
MOE_ALIGN_NUM_WARPS = 4
MOE_SUM_NUM_WARPS = 4


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    block_m: int          # rows of a GEMM block: pairs of one expert
    align_chunk: int      # pairs align_kernel reads at a time
    gate_up: GemmConfig
    down: GemmConfig
    sum_block_h: int


def moe(*, pairs: int, experts: int, hidden: int, inter: int, itemsize: int, interpret: bool) -> MoEConfig:
    """``moe.align_kernel``, ``gate_up_kernel``, ``down_kernel``, ``sum_kernel`` of a call with ``pairs``
    (token, expert) pairs over ``experts`` experts (the shared one included); ``itemsize``: bytes per
    element of x and the weights."""
    if interpret:
        # the interpreter's cost is per program: whole rows of N and K per program where they are small
        block_m = 16
        gate_up = (min(next_pow2(inter), 128), min(next_pow2(hidden), 256), 1, 1)
        down = (min(next_pow2(hidden), 256), min(next_pow2(inter), 256), 1, 1)
    else:
        sizes = MOE_GPU_PREFILL if pairs >= 32 * experts else MOE_GPU_DECODE
        block_m, gate_up, down = sizes["block_m"], sizes["gate_up"], sizes["down"]

    def gemm(sizes, weight_tiles):
        block_n, block_k, warps, stages = sizes
        # an estimate: each stage holds a [BLOCK_M, BLOCK_K] tile of rows and weight_tiles [BLOCK_N, BLOCK_K]
        # weight tiles (test_plans_fit_hopper_shared_memory checks what Triton allocates)
        stage_bytes = (block_m + weight_tiles * block_n) * block_k * itemsize
        return GemmConfig(block_n, block_k, warps, max(1, min(stages, MOE_SHARED_MEMORY // stage_bytes)))

    return MoEConfig(block_m, 256 if interpret else 64, gemm(gate_up, 2), gemm(down, 1),
                     min(next_pow2(hidden), 1024))


# -- block-scaled FP8 weights (fp8_linear.py, fp8_moe.py) ---------------------------------------
# Their block sizes change the speed only: each output element is one program's float32 sum over the
# K blocks of 128 channels, in order (BLOCK_K is the format's block, one scale per K tile).

@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    groups: int           # 128-channel groups per program (a power of two)
    num_warps: int


def fp8_quantize(*, groups: int, interpret: bool) -> QuantizeConfig:
    """``fp8_linear.quantize_act_kernel`` for rows of ``groups`` 128-channel groups."""
    if interpret:
        return QuantizeConfig(next_pow2(groups), 1)   # a whole row per program
    return QuantizeConfig(min(next_pow2(groups), 8), 4)   # 1024 channels a program, 8 a thread


# GPU tiles of fp8_linear_kernel. Decode-sized calls (T <= 64) stream the weight once: one row tile of
# BLOCK_M = T rounded up to a power of two (at least 16, the narrow side of the smallest FP8 wgmma),
# BLOCK_N = 64 weight rows (the MMA's 64-row side), and K split into ranges of at least FP8_LINEAR_MIN_SPLIT_BLOCKS
# blocks until the (N tiles x splits) programs reach FP8_LINEAR_TARGET_PROGRAMS, about two per SM of a
# 132-SM H200: N = 3072 alone makes 48 programs, and one program per SM keeps too few bytes in flight
# (stages x 8 KiB) to stream at the copy bandwidth. With more than one split the programs write float32
# partial sums and sum_splits_kernel adds them in split order. PREFETCH_BLOCKS: K blocks of each program's
# weights sent to L2 before it waits for the previous kernel. Keyed by BLOCK_M; one program's shared memory
# is num_stages x (BLOCK_N + BLOCK_M) x 128 bytes (64 KiB at BLOCK_M 64 and 4 stages: three programs per
# SM). Not yet measured on a GPU: ``python3 -m benchmarks.fp8_linear --tune`` sweeps these knobs.
# Swept on an H200 (benchmarks.fp8_linear --tune, benchmarks/results/2026-12-04-h200-fp8-linear-tune.md):
# prefetch 2 beat 0 and 4 everywhere, 6 stages beat 4 at BLOCK_M 16; at 12288 x 6144 and T = 1, BLOCK_N 128
# with 4 splits was faster still (22.4 against 27.3 us), not adopted from one shape.
FP8_LINEAR_GPU_DECODE = {16: dict(block_n=64, num_warps=4, num_stages=6, prefetch_blocks=2),
                         32: dict(block_n=64, num_warps=4, num_stages=4, prefetch_blocks=2),
                         64: dict(block_n=64, num_warps=4, num_stages=4, prefetch_blocks=2)}
FP8_LINEAR_TARGET_PROGRAMS = 264
FP8_LINEAR_MIN_SPLIT_BLOCKS = 4
# Larger T: 64 x 128 tiles (compute-bound), one split.
FP8_LINEAR_GPU_PREFILL = dict(block_m=64, block_n=128, num_warps=4, num_stages=3)
# sum_splits_kernel on a GPU: outputs per program, warps
FP8_SUM_BLOCK = 1024
FP8_SUM_NUM_WARPS = 4


@dataclasses.dataclass(frozen=True)
class FP8LinearConfig:
    block_m: int          # tokens per program
    block_n: int          # output columns per program (divides 128: one weight scale per K block)
    splits: int           # ranges of K blocks (programs per output tile); the launch evens them out
    prefetch_blocks: int  # K blocks of weights prefetched into L2 before the grid wait (0 or a power of two)
    num_warps: int
    num_stages: int
    sum_block: int        # sum_splits_kernel's outputs per program


def fp8_linear(*, tokens: int, n: int, k: int, interpret: bool) -> FP8LinearConfig:
    """``fp8_linear.fp8_linear_kernel`` (and ``sum_splits_kernel``) for ``tokens`` rows, ``n`` output
    columns and ``k`` input channels."""
    k_blocks = cdiv(k, FP8_BLOCK)
    if interpret:
        # the interpreter's cost is per program: a whole (small) output per program, but two splits, which
        # keeps split-K and its sum covered by the CPU tests
        return FP8LinearConfig(min(max(16, next_pow2(tokens)), 64), min(next_pow2(n), 128), min(k_blocks, 2), 0,
                               1, 1, max(16, min(next_pow2(tokens * n), 4096)))
    block_m = max(16, next_pow2(tokens))
    if block_m not in FP8_LINEAR_GPU_DECODE:
        p = FP8_LINEAR_GPU_PREFILL
        return FP8LinearConfig(p["block_m"], p["block_n"], 1, 0, p["num_warps"], p["num_stages"], FP8_SUM_BLOCK)
    d = FP8_LINEAR_GPU_DECODE[block_m]
    splits = min(cdiv(FP8_LINEAR_TARGET_PROGRAMS, cdiv(n, d["block_n"])), k_blocks // FP8_LINEAR_MIN_SPLIT_BLOCKS)
    return FP8LinearConfig(block_m, d["block_n"], max(splits, 1), d["prefetch_blocks"], d["num_warps"],
                           d["num_stages"], FP8_SUM_BLOCK)


# GPU tiles (BLOCK_N, num_warps, num_stages) of the FP8 MoE GEMMs by the block rows ``moe`` picks (16:
# decode-sized calls, 64: prefill-sized). gate_up's BLOCK_N is the format's 128 (its epilogue quantizes
# whole groups). Per stage, e4m3 tiles take (BLOCK_M + 2 * 128) * 128 bytes in gate_up (36 KiB at
# BLOCK_M = 16) and (BLOCK_M + BLOCK_N) * 128 in down. Not yet swept on a GPU.
FP8_MOE_GPU = {16: dict(gate_up=(128, 4, 4), down=(64, 4, 4)),
               64: dict(gate_up=(128, 8, 3), down=(128, 4, 3))}


def fp8_moe(*, pairs: int, experts: int, hidden: int, inter: int, interpret: bool) -> MoEConfig:
    """``moe.align_kernel``, ``fp8_moe.fp8_gate_up_kernel``, ``fp8_moe.fp8_down_kernel`` and
    ``moe.sum_kernel``: ``moe``'s block rows, align and sum, with the FP8 GEMMs' tiles."""
    base = moe(pairs=pairs, experts=experts, hidden=hidden, inter=inter, itemsize=1, interpret=interpret)
    if interpret:
        gate_up, down = (128, 1, 1), (min(next_pow2(hidden), 256), 1, 1)
    else:
        gate_up, down = FP8_MOE_GPU[base.block_m]["gate_up"], FP8_MOE_GPU[base.block_m]["down"]
    return dataclasses.replace(base, gate_up=GemmConfig(gate_up[0], FP8_BLOCK, *gate_up[1:]),
                               down=GemmConfig(down[0], FP8_BLOCK, *down[1:]))


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    block_r: int          # rows per program
    block_v: int          # chunk of the first and the last pass
    block_s: int          # chunk of the search passes
    pivots: int           # thresholds tried per search pass
    num_warps: int
    num_stages: int


def sample(*, rows: int, vocab: int, interpret: bool) -> SampleConfig:
    """``sampling.sample_kernel`` for ``rows`` rows of ``vocab`` logits."""
    if interpret:
        # the interpreter's cost is per program and per operation, not per element: many rows and
        # wide chunks per program, up to ~2^16 elements per [BLOCK_R, BLOCK_V] and 2^20 per search step;
        # a chunk is whole bitmask words (a multiple of 32 tokens)
        block_v = max(32, min(next_pow2(vocab), 4096))
        block_r = max(1, min(next_pow2(max(rows, 1)), (1 << 16) // block_v))
        return SampleConfig(block_r, block_v, max(16, min(block_v, (1 << 20) // (block_r * 16))), 16, 1, 1)
    return SampleConfig(1, 4096, 512, 16, 8, 2)
