"""The MSA indexer's per-block causal max scores in CuTeDSL (``backend="cutedsl"``, Hopper sm_90+).

Imports ``cutlass`` (nvidia-cutlass-dsl) and nothing of torch or jax: the
framework glue (``m3_torch.cute_ops``, ``m3_jax.cute_call``) imports this
module lazily, only when a caller asks for the CuTeDSL backend, so nothing
else needs the package. Same contract as ``index.index_scores_kernel``
(SPEC.md, ``index_scores``)::

    scores[i, t, b] = max over pos in block b, pos <= p_t, of dot(idx_q[t, i], index_k[pos])

float32 accumulation, no scale, ``-inf`` past the token's visible blocks; a
row whose query holds NaN/Inf scores NaN on the blocks it sees.

Work split, as the Triton kernel's (and from the same tile maps, so decode,
MTP, prefill and the spans of a mixed step all run through it): a CTA owns
one row tile of ``tile_map`` (query tokens of ONE request x all
index heads, packed as the MMA's M rows: ``block_m`` = 16..128) and a chunk
of ``blocks_per_program`` logical blocks (the chunking of
``tuning.index_scores``: about ``target_programs`` CTAs). Each 128-token
index-K page is therefore read once for all heads and MTP tokens of the tile.

One CTA = 4 warps (128 threads), all of them MMA consumers; warp 0 also
produces:

* **loads**: one TMA box per page, ``[128, Di]`` at the page id the block
  table names (the gmem tensor is ``(token, dim, page)``, so the page is a
  TMA coordinate and any 16-byte-aligned page/token strides work: HND pool
  views included), into a ``stages``-deep ring of 128B-swizzled smem
  buffers guarded by mbarriers (``PipelineTmaAsync``). Page ids are read
  ahead of their TMA so the table read's latency is hidden (the first
  ``stages`` by the lanes of warp 0 at once, without waiting for
  ``seq_lens``: entries inside the request's row and the CTA's chunk only);
  only the ids of blocks some token of the tile sees are used (the others
  may be garbage), and only those pages are loaded.
* **MMA**: ``mma.sync`` m16n8k16 (bf16/fp16 in, fp32 accumulate; e4m3 pages: below), 4 warps
  along the page's 128 tokens (2 n8 atoms x 4 warps x 2), ``ldmatrix``
  from smem. The query tile sits in smem (loaded once, element by element,
  so any idx_q strides work; rows past the tile are zeros) and, for small
  tiles, in registers.
* **epilogue** per page: the causal mask by position (token ``n`` of block
  ``b`` is seen by row ``m`` iff ``b * 128 + n <= p_m``; a select, so stale
  NaN/Inf rows of the page never reach a score), the row max in registers,
  across the 4 lanes of a quad by shuffles, and across the 4 warps through
  a double-buffered smem array (one CTA barrier per page); then one thread
  per row stores ``scores[head, token, block]`` through arbitrary strides.
  Blocks of the chunk that no token of the tile sees get ``-inf`` without a
  load.

**e4m3 index caches** (``float8_e4m3fn``, unscaled: SPEC.md, "FP8 caches"), as
``index.index_scores_kernel`` computes them: the TMA boxes are ``[128, Di]``
bytes (128-byte swizzled rows at Di = 128, 64-byte ones at Di = 64); the MMA is
the same f16 ``mma.sync`` with every key widened exactly to float16 in
registers (``cvt.rn.f16x2.e4m3x2``, one per register pair; NaN codes stay
NaN) against a float16 query tile: a bf16 query row is moved there by the
power of two of ``common.fp16_operand`` (``e = ceil(log2(amax)) - 15`` from its
largest finite magnitude, at least -100, 0 for a zero row; computed on the
exponent bits), exact, and its scores are multiplied by ``2^e`` after the row
max; fp16 queries are used as they are, e4m3 queries (with an e4m3 cache)
widened. B fragments are not read by ``ldmatrix`` (it moves 16-bit pairs of a
row, not the k pairs an 8-bit row holds): each lane reads one 32-bit word of
its token's row per k block and n8 atom, with the TMA's swizzle applied to the
address by hand, and widens its low and high half-words into the fragment's
two registers. For that, the MMA's k index runs over the row's bytes in a
permuted order (``_k_byte``: the words of a 16-byte chunk go to the 4 lanes of
a quad, so a warp's 32 loads hit 32 banks), and the query tile is stored into
shared memory permuted the same way: each dot is the same sum, accumulated in
another order inside each k block of 16 (float32 reordering only). The bf16 /
fp16 path is untouched (compile-time branches: its PTX is unchanged).

Compiled once per shape class (dtype, Hi, its row tile, Di, stages, cache dtype):
lengths, tables, batch sizes, strides and pointers are runtime values, so
nothing recompiles as lengths change, and a captured CUDA graph / jitted
JAX step replays.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warp

PAGE_SIZE = 128          # tokens per block and per index-K page (maps.PAGE_SIZE)
NUM_WARPS = 4            # all MMA consumers; warp 0 also issues the TMA loads
NUM_THREADS = 32 * NUM_WARPS
# The query tile (block_m x Di elements; block_m <= 128, Di in {64, 128}: backends.py checks)
# stays in registers up to this size (32 x 128: 64 registers a thread), else it is re-read
# from smem for every page.
Q_IN_REGS_MAX = 32 * 128


def dtype_of(name: str):
    """A dtype name ("bfloat16", "float16", "float8_e4m3fn") -> the cutlass type."""
    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float8_e4m3fn": cutlass.Float8E4M3FN}[name]


def _swizzle_bytes(dtype, head_dim: int) -> int:
    """The swizzle span of a ``[rows, head_dim]`` tile: its row's bytes, at most 128."""
    return min(128, head_dim * dtype.width // 8)


def _smem_layout(dtype, rows: int, head_dim: int, stages: int | None = None):
    """``[rows, head_dim]`` (x stages) K-major, swizzled as the TMA writes it: 16-bit tiles and e4m3
    pages of Di = 128 in 128-byte rows (Swizzle<3,4,3> over 8 x 128 B atoms: conflict-free
    ``ldmatrix`` / word loads), e4m3 pages of Di = 64 in 64-byte rows (Swizzle<2,4,3>, 8 x 64 B)."""
    row_bytes = _swizzle_bytes(dtype, head_dim)
    elems = row_bytes * 8 // dtype.width
    atom = cute.make_composed_layout(cute.make_swizzle({128: 3, 64: 2}[row_bytes], 4, 3), 0,
                                     cute.make_layout((8, elems), stride=(elems, 1)))
    if stages is None:
        return cute.tile_to_shape(atom, (rows, head_dim), (0, 1))
    return cute.tile_to_shape(atom, (rows, head_dim, stages), (0, 1, 2))


def _k_byte(k):
    """FP8 pages: the byte (dimension) of an index-K row that the MMA's k index ``k`` reads.

    ``k = 16 kb + 8 h + 2 q + e`` (k block, half, the lane's index in its quad, element) ->
    byte ``16 kb + 4 q + 2 h + e``: a B fragment's two registers of k block ``kb`` (halves h = 0, 1)
    are the low and high half-words of ONE 32-bit word of the token's row, word ``q`` of its 16-byte
    chunk ``kb``. The 8 tokens x 4 lanes of a warp's load then hit 32 different banks (the chunk
    index is XOR-swizzled by the token's row, the word is the lane's). The query tile is stored
    permuted the same way (column ``k`` of sQ holds dimension ``_k_byte(k)``): the dot is the same
    sum, in another order inside each k block of 16."""
    return (k // 16) * 16 + (k // 2 % 4) * 4 + (k // 8 % 2) * 2 + k % 2


def _e4m3x2_to_f16x2(word: Int32):
    """A word of four e4m3 bytes -> (f16x2 of bytes 0-1, f16x2 of bytes 2-3), exactly
    (``cvt.rn.f16x2.e4m3x2``; every e4m3 value is a float16, NaN codes become NaN)."""
    return cute.arch.inline_ptx(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, {$r0}; "
        "cvt.rn.f16x2.e4m3x2 {$w0}, lo; cvt.rn.f16x2.e4m3x2 {$w1}, hi; }",
        write_only_types=[Int32, Int32], read_only_args=[word])


def _f32_bits(x: Float32) -> Int32:
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Int32], read_only_args=[x])


def _pow2(e: Int32) -> Float32:
    """2^e for e in [-126, 127], exactly."""
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Float32],
                                read_only_args=[(e + 127) << 23])


def _mn_view(t: cute.Tensor) -> cute.Tensor:
    """An mma.sync accumulator partition ``((2, 2), MMA_M, MMA_N)`` viewed as (rows, cols)."""
    cm = cute.make_layout(t.layout.shape)
    mn = cute.make_layout(((cm.shape[0][1], cm.shape[1]), (cm.shape[0][0], cm.shape[2])),
                          stride=((cm.stride[0][1], cm.stride[1]), (cm.stride[0][0], cm.stride[2])))
    return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))


@cute.jit
def index_scores_launch(
    q_ptr: cute.Pointer,          # idx_q      [T, Hi, Di]            bf16/fp16 (e4m3 with an e4m3 cache), any strides
    k_ptr: cute.Pointer,          # index_k    [pages, 128, Di]       q's dtype or e4m3, rows contiguous, 16 B aligned
    table_ptr: cute.Pointer,      # block_table [R, max_blocks]       int32
    lens_ptr: cute.Pointer,       # seq_lens   [R]                    int32
    tile_map_ptr: cute.Pointer,   # tile_map   [num_tiles, 4]         int32, contiguous
    scores_ptr: cute.Pointer,     # scores     [Hi, T, max_blocks]    fp32, any strides
    num_tokens: Int32,
    num_requests: Int32,
    max_blocks: Int32,
    num_pages: Int32,
    num_tiles: Int32,
    stride_qt: Int64, stride_qh: Int64, stride_qd: Int64,
    stride_kp: Int64, stride_kn: Int64,
    stride_br: Int64, stride_bb: Int64,
    stride_l: Int64,
    stride_si: Int64, stride_st: Int64, stride_sb: Int64,
    stream: cuda.CUstream,
    num_heads: cutlass.Constexpr,
    heads_pad: cutlass.Constexpr,
    block_m: cutlass.Constexpr,
    head_dim: cutlass.Constexpr,
    stages: cutlass.Constexpr,
    target_programs: cutlass.Constexpr,
):
    """Host side: views, the TMA descriptor, the grid; launches ``index_scores_kernel``."""
    q_dtype = q_ptr.value_type
    k_dtype = k_ptr.value_type
    fp8 = k_dtype.width == 8                       # an e4m3 cache: f16 MMAs on widened pages
    q_scaled = fp8 and q_dtype == cutlass.BFloat16   # a bf16 query moves to f16 (fp16_operand)
    dtype = cutlass.Float16 if fp8 else q_dtype    # the MMA's operand type (sQ's elements)
    mQ = cute.make_tensor(q_ptr, cute.make_layout((num_tokens, num_heads, head_dim),
                                                  stride=(stride_qt, stride_qh, stride_qd)))
    # (token, dim, page): a page is one TMA box, its id a TMA coordinate
    mK = cute.make_tensor(k_ptr, cute.make_layout((PAGE_SIZE, head_dim, num_pages),
                                                  stride=(stride_kn, 1, stride_kp)))
    mTable = cute.make_tensor(table_ptr, cute.make_layout((num_requests, max_blocks), stride=(stride_br, stride_bb)))
    mLens = cute.make_tensor(lens_ptr, cute.make_layout((num_requests,), stride=(stride_l,)))
    mTileMap = cute.make_tensor(tile_map_ptr, cute.make_layout((num_tiles, 4), stride=(4, 1)))
    mScores = cute.make_tensor(scores_ptr, cute.make_layout((num_heads, num_tokens, max_blocks),
                                                            stride=(stride_si, stride_st, stride_sb)))

    sQ_layout = _smem_layout(dtype, block_m, head_dim)
    sK_layout = _smem_layout(k_dtype, PAGE_SIZE, head_dim, stages)
    tma_atom, tma_k = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mK,
                                                  cute.slice_(sK_layout, (None, None, 0)), (PAGE_SIZE, head_dim))
    page_bytes = cute.size_in_bytes(k_dtype, cute.slice_(sK_layout, (None, None, 0)))

    # rows: block_m (tokens x heads); columns: the page's 128 tokens = 2 x (4 warps x 2 n8 atoms)
    tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)), (1, NUM_WARPS, 1),
                                    permutation_mnk=(16, 16 * NUM_WARPS, 16))

    if const_expr(q_scaled):
        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[Int64, stages * 2]
            red: cute.struct.MemRange[Float32, 2 * NUM_WARPS * block_m]   # per-warp row maxima, 2 buffers
            bad: cute.struct.MemRange[Int32, block_m]                     # row's query holds NaN/Inf
            unscale: cute.struct.MemRange[Float32, block_m]               # row's 2^e (fp16_operand)
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[k_dtype, cute.cosize(sK_layout)], 1024]
    else:
        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[Int64, stages * 2]
            red: cute.struct.MemRange[Float32, 2 * NUM_WARPS * block_m]   # per-warp row maxima, 2 buffers
            bad: cute.struct.MemRange[Int32, block_m]                     # row's query holds NaN/Inf
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[k_dtype, cute.cosize(sK_layout)], 1024]

    # the block chunking of tuning.index_scores, from runtime sizes (one compiled kernel per shape class)
    chunks = cutlass.max(cutlass.min((target_programs + cutlass.max(num_tiles, 1) - 1) // cutlass.max(num_tiles, 1),
                                     max_blocks), 1)
    blocks_per_program = cutlass.max((max_blocks + chunks - 1) // chunks, 1)
    num_chunks = (max_blocks + blocks_per_program - 1) // blocks_per_program

    index_scores_kernel(tma_atom, tma_k, mQ, mTable, mLens, mTileMap, mScores, max_blocks, blocks_per_program,
                        sQ_layout, sK_layout, tiled_mma, SharedStorage, page_bytes, num_heads, heads_pad, block_m,
                        head_dim, stages, fp8, q_scaled).launch(
        grid=[num_chunks, num_tiles, 1], block=[NUM_THREADS, 1, 1], smem=SharedStorage.size_in_bytes(),
        stream=stream)


@cute.kernel
def index_scores_kernel(
    tma_atom: cute.CopyAtom,
    tma_k: cute.Tensor,           # (128, Di, pages) TMA coordinates of index_k
    mQ: cute.Tensor,              # (T, Hi, Di)
    mTable: cute.Tensor,          # (R, max_blocks) int32
    mLens: cute.Tensor,           # (R,) int32
    mTileMap: cute.Tensor,        # (num_tiles, 4) int32: request, first token, its position - seq_len, tokens
    mScores: cute.Tensor,         # (Hi, T, max_blocks) fp32
    max_blocks: Int32,
    blocks_per_program: Int32,
    sQ_layout: cute.ComposedLayout,
    sK_layout: cute.ComposedLayout,
    tiled_mma: cute.TiledMma,
    SharedStorage: cutlass.Constexpr,
    page_bytes: cutlass.Constexpr,
    num_heads: cutlass.Constexpr,
    heads_pad: cutlass.Constexpr,
    block_m: cutlass.Constexpr,
    head_dim: cutlass.Constexpr,
    stages: cutlass.Constexpr,
    fp8: cutlass.Constexpr,          # e4m3 pages, widened to f16 in registers
    q_scaled: cutlass.Constexpr,     # ... with a bf16 query moved to f16 by a power of two per row
):
    tidx, _, _ = cute.arch.thread_idx()
    chunk, tile, _ = cute.arch.block_idx()
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    lane = cute.arch.lane_idx()

    # -- the tile: request, tokens, positions; the chunk's blocks
    req = mTileMap[tile, 0]
    tok0 = mTileMap[tile, 1]
    pos0_minus_len = mTileMap[tile, 2]
    ntok = mTileMap[tile, 3]
    # a length past the table behaves as its width, a negative one as 0 (SPEC.md)
    seq_len = cutlass.min(cutlass.max(mLens[req], 0), max_blocks * PAGE_SIZE)
    pos0 = seq_len + pos0_minus_len                      # position of the tile's first token
    tile_blocks = (cutlass.max(pos0 + ntok, 0) + PAGE_SIZE - 1) // PAGE_SIZE   # blocks some token sees
    b_begin = chunk * blocks_per_program
    b_end = cutlass.min(b_begin + blocks_per_program, max_blocks)
    seen_end = cutlass.min(b_end, tile_blocks)
    n_pages = cutlass.max(seen_end - b_begin, 0)

    # -- shared memory, the TMA ring
    smem = cutlass.memory.SmemAllocator()
    storage = smem.allocate(SharedStorage)
    sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)     # (block_m, Di)
    sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)     # (128, Di, stages)
    sRed = storage.red.get_tensor(cute.make_layout((block_m, NUM_WARPS, 2)))
    sBad = storage.bad.get_tensor(cute.make_layout((block_m,)))
    if const_expr(q_scaled):
        sUnscale = storage.unscale.get_tensor(cute.make_layout((block_m,)))

    ring = pipeline.PipelineTmaAsync.create(
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, NUM_WARPS),  # lane 0 of each warp
        tx_count=page_bytes,
        barrier_storage=storage.mbar.data_ptr(),
    )
    gK = cute.local_tile(tma_k, (PAGE_SIZE, head_dim), (0, 0, None))               # (128, Di, pages)
    tKsK, tKgK = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                       cute.group_modes(gK, 0, 2))                 # (TMA, stages), (TMA, pages)

    produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)

    # -- prologue (warp 0): the first `stages` pages. Their page ids are gathered by the lanes at
    # once, and before the length is known (entries of the request's own row inside this chunk,
    # used only for the blocks the tile sees), so the table read does not wait for seq_lens.
    next_page = Int32(0)
    if warp_idx == 0:
        cpasync.prefetch_descriptor(tma_atom)
        lane_page = Int32(0)
        if lane < cutlass.min(b_end - b_begin, stages):
            lane_page = mTable[req, b_begin + lane]
        if stages < b_end - b_begin:
            next_page = mTable[req, b_begin + stages]
        for i in cutlass.range(cutlass.min(n_pages, stages), unroll=1):
            page = cute.arch.shuffle_sync(lane_page, i)
            ring.producer_acquire(produce)
            cute.copy(tma_atom, tKgK[(None, page)], tKsK[(None, produce.index)],
                      tma_bar_ptr=ring.producer_get_barrier(produce))
            ring.producer_commit(produce)
            produce.advance()

    # -- the query tile -> smem (zeros past the tile), and which rows hold NaN/Inf: the
    # NUM_THREADS // block_m consecutive lanes of a row read its elements interleaved
    lanes_per_row = NUM_THREADS // block_m
    m_ld = tidx // lanes_per_row
    d_ld = tidx % lanes_per_row
    tok_ld = m_ld // heads_pad
    head_ld = m_ld % heads_pad
    valid_ld = (tok_ld < ntok) & (head_ld < num_heads)
    bad_ld = Int32(0)
    if const_expr(not fp8):
        for j in cutlass.range(head_dim // lanes_per_row, unroll=8):
            d = d_ld + j * lanes_per_row
            v = mQ.element_type(0)
            if valid_ld:
                v = mQ[tok0 + tok_ld, head_ld, d]
            sQ[m_ld, d] = v
            f = Float32(v)
            if (f != f) | (f == Float32.inf) | (f == -Float32.inf):
                bad_ld = Int32(1)
    else:
        # FP8 pages: the tile in f16, its columns permuted as the pages' bytes are read (_k_byte).
        # A bf16 query row is scaled by 2^-e as common.fp16_operand does (e from the row's largest
        # finite magnitude: ceil(log2(amax)) - 15, at least -100; 0 for an all-zero row), exactly;
        # its scores are multiplied by 2^e after the max. fp16 and e4m3 queries: as they are.
        scale = Float32(1.0)
        if const_expr(q_scaled):
            amax = Float32(0.0)
            for j in cutlass.range(head_dim // lanes_per_row, unroll=8):
                a = Float32(0.0)
                if valid_ld:
                    a = Float32(mQ[tok0 + tok_ld, head_ld, d_ld + j * lanes_per_row])
                    a = cute.arch.fmax(a, -a)
                if a < Float32.inf:      # finite (NaN compares false)
                    amax = cute.arch.fmax(amax, a)
            for s in cutlass.range_constexpr(lanes_per_row.bit_length() - 1):   # max over the row's lanes
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << s))
            e = Int32(0)
            if amax > Float32(0.0):
                bits = _f32_bits(amax)
                ceil_log2 = (bits >> 23) - 127          # amax < 2^-126: clamped to -100 below
                if (bits & 0x7FFFFF) != 0:
                    ceil_log2 = ceil_log2 + 1
                e = cutlass.max(ceil_log2 - 15, -100)
            scale = _pow2(-e)
            if d_ld == 0:
                sUnscale[m_ld] = _pow2(e)
        for j in cutlass.range(head_dim // lanes_per_row, unroll=8):
            d = d_ld + j * lanes_per_row
            f = Float32(0.0)
            if valid_ld:
                f = Float32(mQ[tok0 + tok_ld, head_ld, _k_byte(d)])
            if const_expr(q_scaled):
                sQ[m_ld, d] = cutlass.Float16(f * scale)
            else:
                sQ[m_ld, d] = cutlass.Float16(f)
            if (f != f) | (f == Float32.inf) | (f == -Float32.inf):
                bad_ld = Int32(1)
    for s in cutlass.range_constexpr(lanes_per_row.bit_length() - 1):   # OR over the row's lanes
        bad_ld = bad_ld | cute.arch.shuffle_sync_bfly(bad_ld, offset=1 << s)
    if d_ld == 0:
        sBad[m_ld] = bad_ld
    cute.arch.sync_threads()

    # -- MMA partitions: Q and K from smem through ldmatrix (FP8 pages: K through 32-bit words)
    thr_mma = tiled_mma.get_slice(tidx)
    tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
    ldm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), sQ.element_type)
    thr_copy_q = cute.make_tiled_copy_A(ldm, tiled_mma).get_slice(tidx)
    tSsQ = thr_copy_q.partition_S(sQ)
    tSrQ_view = thr_copy_q.retile(tSrQ)
    k_blocks = cute.size(tSsQ.shape[2])
    if const_expr(not fp8):
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
        thr_copy_k = cute.make_tiled_copy_B(ldm, tiled_mma).get_slice(tidx)
        tSsK = thr_copy_k.partition_S(sK)                   # (CPY, N, K, stages)
        tSrK_view = thr_copy_k.retile(tSrK)
    else:
        # B fragments (f16) filled from the e4m3 stages: per k block and n8 atom one 32-bit word of
        # the token's row (bytes _k_byte(k0) .. + 3, k0 the register pair's first k), the 128 B (64 B
        # at Di = 64) swizzle of the TMA applied by hand, widened to the fragment's two registers
        tSrK = cute.make_rmem_tensor(thr_mma.partition_shape_B((PAGE_SIZE, head_dim)), cutlass.Float16)
        tSrK_w = cute.recast_tensor(tSrK, Int32)          # (2 registers, N, K)
        tScK = thr_mma.partition_B(cute.make_identity_tensor((PAGE_SIZE, head_dim)))   # (n, k) of each element
        sKw = cute.make_tensor(cute.recast_ptr(storage.sK.data_ptr(), dtype=Int32),
                               cute.make_layout((PAGE_SIZE * head_dim // 4, stages)))  # unswizzled words
        swizzle_rows = const_expr(_swizzle_bytes(cutlass.Float8E4M3FN, head_dim) // 16 - 1)   # 7 or 3
    q_in_regs = const_expr(block_m * head_dim <= Q_IN_REGS_MAX)
    if const_expr(q_in_regs):
        for k in cutlass.range_constexpr(k_blocks):
            cute.copy(thr_copy_q, tSsQ[None, None, k], tSrQ_view[None, None, k])

    acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((block_m, PAGE_SIZE)), Float32)
    acc_mn = _mn_view(acc)
    tScS_mn = _mn_view(thr_mma.partition_C(cute.make_identity_tensor((block_m, PAGE_SIZE))))

    # this thread's row of the final store (threads < block_m)
    m_st = tidx % block_m
    tok_st = m_st // heads_pad
    head_st = m_st % heads_pad
    valid_st = (tidx < block_m) & (tok_st < ntok) & (head_st < num_heads)
    pos_st = pos0 + tok_st
    bad_st = sBad[m_st]
    if const_expr(q_scaled):
        unscale_st = sUnscale[m_st]

    for i in cutlass.range(n_pages, unroll=1):
        block = b_begin + i
        # -- S = Q K^T over the page
        ring.consumer_wait(consume)
        stage = consume.index
        acc.fill(0.0)
        for k in cutlass.range_constexpr(k_blocks):
            if const_expr(not q_in_regs):
                cute.copy(thr_copy_q, tSsQ[None, None, k], tSrQ_view[None, None, k])
            if const_expr(not fp8):
                cute.copy(thr_copy_k, tSsK[None, None, k, stage], tSrK_view[None, None, k])
            else:
                for j in cutlass.range_constexpr(cute.size(tSrK.shape[1])):
                    n = tScK[0, j, k][0]
                    byte = n * head_dim + _k_byte(tScK[0, j, k][1])
                    byte = byte ^ (((byte >> 7) & swizzle_rows) << 4)
                    lo, hi = _e4m3x2_to_f16x2(sKw[byte >> 2, stage])
                    tSrK_w[0, j, k] = lo
                    tSrK_w[1, j, k] = hi
            cute.gemm(tiled_mma, acc, tSrQ[None, None, k], tSrK[None, None, k], acc)
        ring.consumer_release(consume)
        consume.advance()

        # -- warp 0 refills the freed stage with the page `stages` ahead (its id read one page earlier)
        if warp_idx == 0:
            if produce.count < n_pages:
                page = next_page
                if produce.count + 1 < n_pages:
                    next_page = mTable[req, b_begin + produce.count + 1]
                ring.producer_acquire(produce)
                cute.copy(tma_atom, tKgK[(None, page)], tKsK[(None, produce.index)],
                          tma_bar_ptr=ring.producer_get_barrier(produce))
                ring.producer_commit(produce)
                produce.advance()

        # -- causal row max: registers, the quad's lanes, then the 4 warps through smem
        buf = i % 2
        for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
            m = tScS_mn[r, 0][0]
            limit = pos0 + m // heads_pad - block * PAGE_SIZE   # the row sees the page's tokens <= limit
            best = -Float32.inf
            for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                s = acc_mn[r, c]
                if tScS_mn[r, c][1] > limit:
                    s = -Float32.inf
                best = cute.arch.fmax(best, s)
            best = cute.arch.fmax(best, cute.arch.shuffle_sync_bfly(best, offset=2))
            best = cute.arch.fmax(best, cute.arch.shuffle_sync_bfly(best, offset=1))
            if lane % 4 == 0:
                sRed[m, warp_idx, buf] = best
        cute.arch.sync_threads()
        if valid_st:
            best = sRed[m_st, 0, buf]
            for w in cutlass.range_constexpr(1, NUM_WARPS):
                best = cute.arch.fmax(best, sRed[m_st, w, buf])
            if const_expr(q_scaled):
                best = best * unscale_st
            if (bad_st != 0) & (block * PAGE_SIZE <= pos_st):
                best = Float32(float("nan"))
            mScores[head_st, tok0 + tok_st, block] = best

    # -- blocks no token of the tile sees: -inf, nothing loaded
    fill_begin = cutlass.max(b_begin, tile_blocks)
    fill_count = cutlass.max(b_end - fill_begin, 0)
    for idx in cutlass.range(tidx, fill_count * block_m, NUM_THREADS, unroll=1):
        m = idx % block_m
        tok = m // heads_pad
        head = m % heads_pad
        if (tok < ntok) & (head < num_heads):
            mScores[head, tok0 + tok, fill_begin + idx // block_m] = -Float32.inf


@cute.jit
def index_scores_xla(
    stream: cuda.CUstream,
    idx_q: cute.Tensor,           # [T, Hi, Di] row-major
    index_k: cute.Tensor,         # the flat buffer holding the index-K cache (a PagedView's buffer, any dtype)
    block_table: cute.Tensor,     # [R, max_blocks] int32 row-major
    seq_lens: cute.Tensor,        # [R] int32
    tile_map: cute.Tensor,        # [num_tiles, 4] int32
    scores: cute.Tensor,          # [Hi, T, max_blocks] fp32 row-major (output)
    *,
    k_dtype: cutlass.Constexpr,   # the cache's element type name (the view's: a byte pool's e4m3 sub-pages)
    k_offset: cutlass.Constexpr,
    k_stride_page: cutlass.Constexpr,
    k_stride_token: cutlass.Constexpr,
    num_pages: cutlass.Constexpr,
    num_heads: cutlass.Constexpr,
    heads_pad: cutlass.Constexpr,
    block_m: cutlass.Constexpr,
    head_dim: cutlass.Constexpr,
    stages: cutlass.Constexpr,
    target_programs: cutlass.Constexpr,
):
    """``cutlass.jax.cutlass_call`` entry: dense row-major arrays (sizes from their runtime shapes)
    and the index-K cache as (flat buffer, static offset/strides in ``k_dtype`` elements) ->
    ``index_scores_launch``."""
    k_iter = index_k.iterator
    if const_expr(index_k.element_type != dtype_of(k_dtype)):
        k_iter = cute.recast_ptr(k_iter, dtype=dtype_of(k_dtype))
    index_scores_launch(
        idx_q.iterator, k_iter + k_offset, block_table.iterator, seq_lens.iterator, tile_map.iterator,
        scores.iterator,
        idx_q.shape[0], block_table.shape[0], block_table.shape[1], num_pages, tile_map.shape[0],
        idx_q.layout.stride[0], idx_q.layout.stride[1], idx_q.layout.stride[2],
        k_stride_page, k_stride_token,
        block_table.layout.stride[0], block_table.layout.stride[1],
        seq_lens.layout.stride[0],
        scores.layout.stride[0], scores.layout.stride[1], scores.layout.stride[2],
        stream,
        num_heads, heads_pad, block_m, head_dim, stages, target_programs)
