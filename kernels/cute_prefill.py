"""Causal GQA prefill attention in CuTeDSL, dense and block-sparse (``backend="cutedsl"`` of
``dense_prefill`` and ``sparse_prefill``, Hopper sm_90a).

Imports ``cutlass`` (nvidia-cutlass-dsl) and nothing of torch or jax: the
framework glue (``m3_torch.cute_ops``) imports this module lazily, only when a
caller asks for the CuTeDSL backend. Same contract as the Triton kernel's
dense mode (SPEC.md, ``dense_prefill``)::

    out[t, h] = softmax_p(sm_scale * q[t, h] . k[p]) . v[p]   over positions p <= pos_t

for the KV head ``h // group`` of the paged caches ``[pages, Hk, 128, D]``,
float32 accumulation, the output in q's dtype; a row that sees no position is
zeros, and cache rows past ``seq_len`` (which may hold NaN/Inf) never reach it.

Work split. A work item is one row tile of ``tile_map`` for one KV head. The
128 rows of the tile are (tokens x the ``group`` query heads of that KV head,
padded to ``heads_pad``): 8 tokens x 16 heads at M3's 64/4 heads, 64 tokens x 2
heads at 8/2. That keeps the MMA's M dimension at 128 whatever the group, and
reads each K/V page once per tile for all the heads that share it (the
alternative, 128 tokens of one head, reads every page once per query head, 16x
the K/V traffic at group 16, with the same MMA work). The tiles are the
indexer's (``maps.index_tile``: as many tokens as 128 rows hold, one request
per tile), so a tile holds consecutive positions and the causal mask touches
at most its last two blocks.

Persistent schedule. The grid is ``G = min(num_tiles x Hk, SMs)`` CTAs (one
CTA per SM: its shared memory is over half an SM's, its registers all of
them); each CTA loops over work items. Item ``w`` is tile ``num_tiles - 1 - w
// Hk`` of KV head ``w % Hk``: the tiles from last to first, the KV heads of a
tile together (within a request a later tile sees more blocks, so one
prompt's items come longest first). CTA ``c`` takes, in round ``r``, item
``r G + c`` when ``r`` is even and ``r G + G - 1 - c`` when it is odd (a
serpentine stride; the last round is partial). Serpentine rather than ``r G +
c``: with items longest first, a plain stride gives CTA 0 the longest item of
every round and on one prompt (lengths falling linearly) it finishes about one
longest item after CTA ``G - 1`` (63 blocks of its 1040 at 8k); the
serpentine pairs a round's longest with the next round's shortest, leaving at
most one round's spread of lengths (``G`` items' decline: 1 block at 8k).
Static: no counter in global memory to reset between launches, so a captured
CUDA graph replays as is. The roles carry their state across a CTA's items: the producer runs
ahead into the next item's pages (the ring's stage and phase go on) while the
consumers finish the current one, so the next item's first loads overlap the
current item's last blocks and its epilogue. A tile's arithmetic is the same
whichever CTA runs it: the output depends neither on the grid nor on the SM
count the framework glue reads (``m3_torch.cute_ops``, ``m3_jax.cute_call``).

FA3's design, warp specialized (384 threads, 3 warpgroups):

* **producer** (warpgroup 0, its first warp; its registers given back with
  ``setmaxnreg``): per item and visible block, the K and V pages as one TMA
  box each, ``[128, D]`` at (0, 0, kv head, page id) of the caches viewed as
  (token, dim, head, page), the page id read from ``block_table`` (only the
  ids of blocks the tile sees: the rest may be garbage), both into one stage
  of a ``stages``-deep ring of 128B-swizzled smem buffers guarded by one
  mbarrier per stage (``PipelineTmaAsync``), stage and phase continuing from
  one item to the next.
* **consumers** (warpgroups 1 and 2, 64 rows each): per item, each
  warpgroup loads its own 64 rows of the query tile into swizzled smem
  (16-byte loads when q's rows are contiguous and 16-byte aligned, element by
  element through other strides; zeros on padding rows), its stores behind a
  barrier of its 128 threads (its previous item's wgmmas, the only readers of
  those rows, are complete in all four warps); per block ``S = Q K^T`` by
  ``wgmma`` (both operands from smem), the causal mask by position (a select,
  only on blocks that reach past the tile's first position), the online
  softmax in registers (exp2 with ``sm_scale * log2(e)`` folded in, running
  max and sum per row, the row max across the 4 lanes of a quad by
  shuffles), ``P`` converted to q's dtype in registers and ``O += P V`` by
  ``wgmma`` with A from registers and V read transposed from the same smem
  stage. FA3's intra-warpgroup overlap: block ``j`` issues ``S_j`` and
  ``P_{j-1} V_{j-1}`` back to back and runs the softmax of ``S_j`` while
  ``P V`` is in flight (O rescaled after it lands; a stage is released one
  block after its ``S``), and FA3's pingpong: the two consumer warpgroups
  take turns issuing their GEMMs (named barriers), one turn per block in one
  sequence over all the CTA's items, so one's softmax (or epilogue) runs under
  the other's wgmmas. Stale rows past ``seq_len`` in the sequence's last
  page: their scores are masked (a select, so NaN/Inf never enter the sum)
  and their V rows are zeroed in smem before any ``P V`` reads them (a zero
  probability times NaN would be NaN), by each consumer warpgroup for itself
  (same zeros, a barrier of its own 128 threads). Epilogue: ``O / l`` (0
  where ``l`` is 0: rows that see nothing), stored as pairs of adjacent
  columns (4-byte stores) when the output's rows are contiguous and 4-byte
  aligned, element by element through other strides.

Sparse mode (``sparse_prefill_launch``, the same kernel with ``mIds``): each
token sees only the blocks it chose, ``block_ids [Hk, T, topk]`` (-1 = empty
slot, distinct per row; ids past the request's blocks are skipped), causal
inside each block (SPEC.md, ``sparse_prefill``). The tile is the same, 8
tokens x 16 heads at M3: the 16 query heads of a KV head share its choices,
so one token's heads alone fill 16 MMA rows and a tile of 8 tokens computes
its 128 rows against the union of their blocks, each block's K/V pages read
once per tile. The price is score and P V work over the union where each
row needs topk blocks, while the K/V pages read drop from ``tokens x topk``
(one token per tile) to ``union``. Measured unions of 8 tokens (H200
benchmark of 2026-12-04, M3, topk 16): 31 / 72 / 101 blocks at 8k / 32k /
128k with random index queries, 23.5 / 37 / 46.5 with neighbouring tokens
sharing their queries. So each consumer warpgroup (64 rows: 4 tokens x 16
heads, the wgmma's M) computes only the blocks its own tokens chose and
passes over the others: the union of 4 tokens, 33 / 48 (random) and 25 / 31
(shared) blocks at 8k / 32k against the 8 tokens' 39 / 76 and 29 / 39 in a
CPU simulation of the benchmark's selections (tokens past the first 16
blocks), i.e. 1.2-1.6x less MMA work, while the producer loads the 8 tokens'
union once for both.

* **the block list**: per item, the producer warpgroup (all 128 threads)
  builds the tile's distinct valid blocks (``_tile_block_list``: the ids of
  its tokens x topk entries, -1 where invalid; each entry's first occurrence
  and the tokens choosing its block as an int32 bit mask by a scan of all
  entries; each first occurrence's rank by a scan of the flags before it),
  into a list, its masks and its length in one of two list slots in shared
  memory (the slot is also the scratch), four syncs of the warpgroup's own
  named barrier in all. The two slots are a two-stage mbarrier pipeline
  (``PipelineAsync``) from the producer warpgroup to the consumers: it takes
  the slot of item ``k + 2`` once both consumer warpgroups are done with item
  ``k``'s list, and its 128 threads arrive when the list is built; a consumer
  warpgroup waits for its item's slot before its query rows and releases it
  after its last block. So the list of the next item is built while the
  consumers still read the current one. The producer walks the list instead
  of ``0 .. n - 1`` (page id ``block_table[req, block]``), the consumers the
  same list in the same order (the pipeline's stage order is unchanged).
  Blocks after the tile's last token are skipped (no row sees them). At most
  32 tokens per tile (``Hq / Hk >= 4``: the masks are int32) and 128 entries
  (tokens x topk): at D = 128 the query tile and the ring take 224 of the 227
  KiB, the barriers and two lists of 128 blocks another 2.1 KiB after them
  (the query tile first, at the 1 KiB-aligned start: 226.1 KiB, rounded up
  to the storage's 1 KiB alignment 227 KiB, the most a CTA may have).
* **per-warpgroup blocks**: both consumer warpgroups walk the whole list (the
  ring's stages are released by both); a warpgroup whose tokens did not
  choose a block waits for its stage, takes an empty turn of the pingpong
  and releases the stage. Between its own blocks the intra-warpgroup overlap
  is dense mode's; the P V of its last own block is issued under its next
  own block's S, or earlier, outside the turns, when the next list block
  needs that P V's stage (the producer refills it only once released).
* **the mask**: row ``m`` (token ``t``) sees token ``n`` of list block ``b``
  iff bit ``t`` of its mask is set and ``b * 128 + n <= pos0 + t``, applied
  to every block (rows differ in their choices); a row that chose nothing
  visible is zeros, stale V rows are zeroed as in dense mode, the softmax is
  unchanged.

Compiled once per shape class (dtype, D, group, heads_pad, stages; sparse: and topk): lengths,
head counts, tables, tiles, strides, pointers and the SM count are runtime values, so nothing
recompiles as lengths change and a captured CUDA graph replays.
"""

from __future__ import annotations

import math
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

PAGE_SIZE = 128          # tokens per block and per K/V page (maps.PAGE_SIZE)
TILE_M = 128             # rows of a tile: tokens x heads_pad
NUM_MMA_WARPGROUPS = 2   # consumer warpgroups, each owns half the tile's rows
NUM_THREADS = 128 * (1 + NUM_MMA_WARPGROUPS)   # warpgroup 0 produces
NUM_MMA_THREADS = 128 * NUM_MMA_WARPGROUPS
PRODUCER_REGS = 24       # setmaxnreg: 24 x 128 + 240 x 256 <= 64k registers
MMA_REGS = 240
NUM_PRODUCER_THREADS = 128  # warpgroup 0: its first warp loads K/V, all four build a sparse block list
PRODUCER_BARRIER_ID = 1  # the producer warpgroup's named barrier (0 is __syncthreads): the block list
WARPGROUP_BARRIER_ID = 2  # + consumer warpgroup (2, 3): syncs of its own threads (query rows, stale V rows)
SCHEDULER_BARRIER_ID = 4  # + consumer warpgroup (4, 5): its turn to issue GEMMs (pingpong)
LIST_SLOTS = 2           # sparse: block lists in shared memory, the consumers' current item's and the next
SPARSE_MAX_TOKENS = 32   # sparse: a block's choosing tokens are one int32 bit mask (Hq / Hk >= 4)
SPARSE_MAX_ENTRIES = 128  # sparse: tokens x topk, the block list's room in shared memory (M3: 8 x 16)
LOG2_E = math.log2(math.e)


def dtype_of(name: str):
    """A dtype name ("bfloat16", "float16") -> the cutlass type."""
    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[name]


def _smem_layout(dtype, rows: int, head_dim: int, stages: int | None = None):
    """``[rows, head_dim]`` (x stages), head_dim contiguous, in the swizzled atoms wgmma reads
    (128-byte rows at D = 64 and 128) and the TMA writes."""
    atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, head_dim),
                                           dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, head_dim), (0, 1))
    return cute.tile_to_shape(atom, (rows, head_dim, stages), (0, 1, 2))


def _transpose_view(t: cute.Tensor) -> cute.Tensor:
    """A (rows, cols, stages) smem tensor viewed as (cols, rows, stages)."""
    return cute.composition(t, cute.make_ordered_layout((t.shape[1], t.shape[0], t.shape[2]), order=(1, 0, 2)))


def _acc_mn(acc: cute.Tensor) -> cute.Tensor:
    """A wgmma accumulator ``((2, 2, N/8), MMA_M, MMA_N)`` viewed as (rows, cols) of this thread:
    rows ``(2, MMA_M)``, cols ``(2, N/8, MMA_N)``."""
    c = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(((c.shape[0][1], c.shape[1]), (c.shape[0][0], c.shape[0][2], c.shape[2])),
                          stride=((c.stride[0][1], c.stride[1]), (c.stride[0][0], c.stride[0][2], c.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def _acc_as_a(acc: cute.Tensor) -> cute.Tensor:
    """The S accumulator ``((2, 2, N/8), MMA_M, MMA_N)`` viewed as the A fragment of the P V
    wgmma ``((2, 2, 2), MMA_M, (N/16, MMA_N))``: the k = 16 slices of A are pairs of n8 column
    groups of S, held by the same threads in the same order (both are the m64nNk16 layouts)."""
    l = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    a = cute.make_layout(((l.shape[0][0], l.shape[0][1], l.shape[0][2][0]), l.shape[1], (l.shape[0][2][1], l.shape[2])),
                         stride=((l.stride[0][0], l.stride[0][1], l.stride[0][2][0]), l.stride[1],
                                 (l.stride[0][2][1], l.stride[2])))
    return cute.make_tensor(acc.iterator, a)


def _gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, accumulate: bool):
    """Issues ``acc (+)= a b`` over the k blocks of the fragments as one wgmma group; does not wait
    (the caller's ``warpgroup.wait_group(n)``: groups complete in the order they were committed)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, accumulate)
    for k in range(cute.size(a.shape[2])):
        cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


@cute.jit
def _online_softmax(
    s_mn: cute.Tensor,            # (rows, cols) of this thread: S of the block, -> P = exp2(S * scale - max)
    tScS_mn: cute.Tensor,         # (rows, cols): (row m of the tile, token n of the block)
    row_max: cute.Tensor,         # (rows,) running max of S * scale_log2
    row_sum: cute.Tensor,         # (rows,) running sum of exp2, this thread's columns
    row_scale: cute.Tensor,       # (rows,) out: exp2(old max - new max), the factor O is rescaled by
    block: Int32,
    chosen,                       # sparse: bit t set iff the tile's token t chose this block
    pos0: Int32,                  # position of the tile's first token
    scale_log2: Float32,          # sm_scale * log2(e)
    heads_pad: cutlass.Constexpr,
    sparse: cutlass.Constexpr,
):
    """The mask (causal, and in sparse mode each row's own choice) and the online softmax of one
    block, in registers."""
    if const_expr(sparse):
        # -- token n of the block is seen by row m iff m's token chose the block and
        # block * 128 + n <= pos0 + m // heads_pad; on every block (rows differ in their choices)
        for r in cutlass.range_constexpr(cute.size(s_mn.shape[0])):
            tok = tScS_mn[r, 0][0] // heads_pad
            limit = pos0 + tok - block * PAGE_SIZE
            if ((chosen >> tok) & 1) == 0:
                limit = Int32(-1)
            for c in cutlass.range_constexpr(cute.size(s_mn.shape[1])):
                if tScS_mn[r, c][1] > limit:
                    s_mn[r, c] = -Float32.inf
    else:
        # -- causal mask by position (token n of the block is seen by row m iff
        # block * 128 + n <= pos0 + m // heads_pad), on blocks reaching past the first position
        if (block + 1) * PAGE_SIZE - 1 > pos0:
            for r in cutlass.range_constexpr(cute.size(s_mn.shape[0])):
                limit = pos0 + tScS_mn[r, 0][0] // heads_pad - block * PAGE_SIZE
                for c in cutlass.range_constexpr(cute.size(s_mn.shape[1])):
                    if tScS_mn[r, c][1] > limit:
                        s_mn[r, c] = -Float32.inf

    # -- online softmax (rows are held by the 4 lanes of a quad)
    for r in cutlass.range_constexpr(cute.size(s_mn.shape[0])):
        m_blk = -Float32.inf
        for c in cutlass.range_constexpr(cute.size(s_mn.shape[1])):
            m_blk = cute.arch.fmax(m_blk, s_mn[r, c])
        m_blk = cute.arch.fmax(m_blk, cute.arch.shuffle_sync_bfly(m_blk, offset=2))
        m_blk = cute.arch.fmax(m_blk, cute.arch.shuffle_sync_bfly(m_blk, offset=1))
        m_new = cute.arch.fmax(row_max[r], m_blk * scale_log2)
        m_use = m_new
        if m_new == -Float32.inf:        # nothing seen yet: exp2(-inf - 0) = 0
            m_use = Float32(0.0)
        correction = cute.math.exp2(row_max[r] - m_use, fastmath=True)
        row_max[r] = m_new
        s_sum = Float32(0.0)
        for c in cutlass.range_constexpr(cute.size(s_mn.shape[1])):
            p = cute.math.exp2(s_mn[r, c] * scale_log2 - m_use, fastmath=True)
            s_mn[r, c] = p
            s_sum = s_sum + p
        row_sum[r] = row_sum[r] * correction + s_sum
        row_scale[r] = correction


@cute.jit
def _tile_block_list(
    mIds: cute.Tensor,            # (Hk, T, topk) int32: each token's chosen blocks, -1 = empty slot
    sBlocks: cute.Tensor,         # (entries,) int32 smem, out: the tile's distinct valid blocks
    sChosen: cute.Tensor,         # (entries,) int32 smem, out: bit t set iff the tile's token t chose that block
    sCount: cute.Tensor,          # (1,) int32 smem, out: how many
    kv_head: Int32,
    tok0: Int32,
    ntok: Int32,
    tile_blocks: Int32,           # blocks the tile's last token sees
    tidx: Int32,                  # 0 .. NUM_PRODUCER_THREADS - 1
    topk: cutlass.Constexpr,
):
    """The blocks a sparse tile visits, by the producer warpgroup alone (four syncs of its named
    barrier; after the last one the list is visible to all of its threads). The outputs are the
    scratch until the last step: the entries' ids in ``sBlocks``, their first-occurrence flags in
    ``sChosen``, each thread keeping its own entries' ids, masks, flags and ranks in registers.

    Entry ``e`` is slot ``e % topk`` of tile token ``e // topk``; it is valid when its id is in
    ``[0, tile_blocks)`` (-1, ids past the request's blocks and blocks after the tile's last token,
    which no row could see, are skipped). The list holds each valid id once, at its first
    occurrence, in entry order (the Triton kernel's ``distinct_blocks``), with the tokens that chose
    it as a bit mask."""
    entries = const_expr(cute.size(sBlocks))
    per_thread = const_expr((entries + NUM_PRODUCER_THREADS - 1) // NUM_PRODUCER_THREADS)
    ids = cute.make_rmem_tensor((per_thread,), Int32)
    masks = cute.make_rmem_tensor((per_thread,), Int32)
    firsts = cute.make_rmem_tensor((per_thread,), Int32)
    ranks = cute.make_rmem_tensor((per_thread,), Int32)
    # -- 1: the entries' ids (-1 where invalid) -> sBlocks
    for i in cutlass.range_constexpr(per_thread):
        e = tidx + i * NUM_PRODUCER_THREADS
        b = Int32(-1)
        if e < entries:
            tok = e // topk
            if tok < ntok:
                b = mIds[kv_head, tok0 + tok, e % topk]
                if (b < 0) | (b >= tile_blocks):
                    b = Int32(-1)
            sBlocks[e] = b
        ids[i] = b
    cute.arch.barrier(barrier_id=PRODUCER_BARRIER_ID, number_of_threads=NUM_PRODUCER_THREADS)
    # -- 2: first occurrences (-> sChosen) and the tokens choosing each entry's block
    for i in cutlass.range_constexpr(per_thread):
        e = tidx + i * NUM_PRODUCER_THREADS
        mask = Int32(0)
        first = Int32(0)
        if e < entries:
            b = ids[i]
            if b >= 0:
                first = Int32(1)
                for e2 in cutlass.range(entries, unroll=4):
                    if sBlocks[e2] == b:
                        mask = mask | (Int32(1) << (e2 // topk))
                        if e2 < e:
                            first = Int32(0)
            sChosen[e] = first
        masks[i] = mask
        firsts[i] = first
    cute.arch.barrier(barrier_id=PRODUCER_BARRIER_ID, number_of_threads=NUM_PRODUCER_THREADS)
    # -- 3: a first occurrence's rank among them is its place in the list
    for i in cutlass.range_constexpr(per_thread):
        e = tidx + i * NUM_PRODUCER_THREADS
        rank = Int32(0)
        if e < entries:
            for e2 in cutlass.range(e, unroll=4):
                rank = rank + sChosen[e2]
        ranks[i] = rank
    cute.arch.barrier(barrier_id=PRODUCER_BARRIER_ID, number_of_threads=NUM_PRODUCER_THREADS)
    # -- 4: the list over the scratch (every read of it is done)
    for i in cutlass.range_constexpr(per_thread):
        e = tidx + i * NUM_PRODUCER_THREADS
        if e < entries:
            if firsts[i] == 1:
                sBlocks[ranks[i]] = ids[i]
                sChosen[ranks[i]] = masks[i]
            if e == entries - 1:
                sCount[0] = ranks[i] + firsts[i]
    cute.arch.barrier(barrier_id=PRODUCER_BARRIER_ID, number_of_threads=NUM_PRODUCER_THREADS)


@cute.jit
def _zero_stale_v(
    sV: cute.Tensor,              # (128, D) one stage of the V ring, swizzled smem
    valid_rows: Int32,            # rows of the page below seq_len
    wg_tidx: Int32,               # 0 .. 127, the thread in its warpgroup
    barrier_id: Int32,            # the warpgroup's own named barrier
    head_dim: cutlass.Constexpr,
):
    """Rows ``valid_rows ..`` of a V page -> 0 (P is 0 there, but 0 x NaN is NaN), by one
    warpgroup alone: each consumer warpgroup zeroes the whole region itself (both write the same
    zeros, so no barrier across warpgroups is needed), then fences its stores for the async proxy
    and syncs its own 128 threads, so its P V wgmma reads the zeros. Uniform across the warpgroup
    (``valid_rows`` is), so the barrier is reached by all of its threads or none."""
    if valid_rows < PAGE_SIZE:
        vec = const_expr(128 // sV.element_type.width)
        chunks = const_expr(head_dim // vec)              # chunks of vec elements (16 bytes) per row
        sV_chunks = cute.zipped_divide(sV, (1, vec))      # ((1, vec), (128, chunks))
        zeros = cute.make_rmem_tensor((1, vec), sV.element_type)
        zeros.fill(0)
        for i in cutlass.range(((PAGE_SIZE - valid_rows) * chunks + 127) // 128, unroll=1):
            idx = wg_tidx + i * 128
            n = valid_rows + idx // chunks
            if n < PAGE_SIZE:
                cute.autovec_copy(zeros, sV_chunks[None, (n, idx % chunks)])
        cute.arch.fence_view_async_shared()           # generic-proxy stores -> visible to wgmma
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)


@cute.jit
def _load_query_rows(
    mQ: cute.Tensor,              # (T, Hq, D)
    sQ: cute.Tensor,              # (128, D) swizzled smem
    tok0: Int32,
    ntok: Int32,
    kv_head: Int32,
    row0: Int32,                  # the warpgroup's first row: 0 or 64
    wg_tidx: Int32,               # 0 .. 127, the thread in its warpgroup
    barrier_id: Int32,            # the warpgroup's own named barrier
    group: cutlass.Constexpr,
    heads_pad: cutlass.Constexpr,
    head_dim: cutlass.Constexpr,
):
    """One consumer warpgroup's 64 rows of the tile's queries -> ``sQ``, ready for its wgmmas: row
    ``m`` is token ``m // heads_pad``, query head ``kv_head * group + m % heads_pad``; zeros on
    padding rows (past ``ntok`` or ``group``).

    The rows are the warpgroup's alone (its wgmmas read only them), but its previous item's
    wgmmas may still read them until all four of its warps have waited for those: the smem stores
    wait behind a barrier of its 128 threads. When q's rows are contiguous and every row starts
    16-byte aligned (q from a projection), 16-byte loads (8 x bf16), all issued before that
    barrier; otherwise element by element through any strides, after it. Then a fence for the
    async proxy and a second barrier: the wgmmas read the stores of every thread."""
    dtype = mQ.element_type
    rows = const_expr(TILE_M // NUM_MMA_WARPGROUPS)
    vec = const_expr(128 // dtype.width)                 # elements per 16-byte load
    base = mQ.iterator.toint()
    if (mQ.stride[2] == 1) & (base % 16 == 0) & (mQ.stride[0] % vec == 0) & (mQ.stride[1] % vec == 0):
        chunks = const_expr(head_dim // vec)             # chunks of vec elements (16 bytes) per row
        per_thread = const_expr(rows * chunks // 128)
        # ((1, vec), (128, chunks)): the 128B swizzle permutes whole 16-byte chunks, so a chunk
        # stays contiguous in smem (one 16-byte store)
        sQ_chunks = cute.zipped_divide(sQ, (1, vec))
        frag = cute.make_rmem_tensor((1, vec, per_thread), dtype)
        frag.fill(0)
        for i in cutlass.range_constexpr(per_thread):    # consecutive threads: consecutive chunks
            idx = wg_tidx + i * 128
            m = row0 + idx // chunks
            tok = m // heads_pad
            head = m % heads_pad
            if (tok < ntok) & (head < group):
                offset = ((tok0 + tok) * mQ.stride[0] + (kv_head * group + head) * mQ.stride[1]
                          + (idx % chunks) * vec)
                src = cute.make_tensor(cute.make_ptr(dtype, base + offset * (dtype.width // 8), cute.AddressSpace.gmem,
                                                     assumed_align=16), cute.make_layout((1, vec)))
                cute.autovec_copy(src, frag[None, None, i])
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)
        for i in cutlass.range_constexpr(per_thread):
            idx = wg_tidx + i * 128
            cute.autovec_copy(frag[None, None, i], sQ_chunks[None, (row0 + idx // chunks, idx % chunks)])
    else:
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)
        for i in cutlass.range(rows * head_dim // 128, unroll=8):
            idx = wg_tidx + i * 128
            m = row0 + idx // head_dim
            d = idx % head_dim
            tok = m // heads_pad
            head = m % heads_pad
            v = dtype(0)
            if (tok < ntok) & (head < group):
                v = mQ[tok0 + tok, kv_head * group + head, d]
            sQ[m, d] = v
    cute.arch.fence_view_async_shared()           # generic-proxy stores -> visible to wgmma
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)


@cute.jit
def dense_prefill_launch(
    q_ptr: cute.Pointer,          # q           [T, Hq, D]             bf16/fp16, any strides
    k_ptr: cute.Pointer,          # k_cache     [pages, Hk, 128, D]    q's dtype, rows contiguous, 16 B aligned
    v_ptr: cute.Pointer,          # v_cache     [pages, Hk, 128, D]    as k_cache
    table_ptr: cute.Pointer,      # block_table [R, max_blocks]        int32
    lens_ptr: cute.Pointer,       # seq_lens    [R]                    int32
    tile_map_ptr: cute.Pointer,   # tile_map    [num_tiles, 4]         int32, contiguous
    out_ptr: cute.Pointer,        # out         [T, Hq, D]             q's dtype, any strides
    num_tokens: Int32,
    num_requests: Int32,
    max_blocks: Int32,
    num_pages: Int32,
    num_tiles: Int32,
    num_kv_heads: Int32,
    num_sms: Int32,               # the GPU's streaming multiprocessors: at most one CTA each
    sm_scale: Float32,
    stride_qt: Int64, stride_qh: Int64, stride_qd: Int64,
    stride_kp: Int64, stride_kh: Int64, stride_kn: Int64,
    stride_vp: Int64, stride_vh: Int64, stride_vn: Int64,
    stride_br: Int64, stride_bb: Int64,
    stride_l: Int64,
    stride_ot: Int64, stride_oh: Int64, stride_od: Int64,
    stream: cuda.CUstream,
    group: cutlass.Constexpr,
    heads_pad: cutlass.Constexpr,
    head_dim: cutlass.Constexpr,
    stages: cutlass.Constexpr,
):
    """Host side of ``dense_prefill``: every visible block of each tile (:func:`_prefill_launch`)."""
    _prefill_launch(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, tile_map_ptr, out_ptr, None, num_tokens, num_requests,
                    max_blocks, num_pages, num_tiles, num_kv_heads, num_sms, sm_scale, stride_qt, stride_qh, stride_qd,
                    stride_kp, stride_kh, stride_kn, stride_vp, stride_vh, stride_vn, stride_br, stride_bb, stride_l,
                    stride_ot, stride_oh, stride_od, stream, group, heads_pad, head_dim, stages, 0)


@cute.jit
def sparse_prefill_launch(
    q_ptr: cute.Pointer,          # q           [T, Hq, D]             bf16/fp16, any strides
    k_ptr: cute.Pointer,          # k_cache     [pages, Hk, 128, D]    q's dtype, rows contiguous, 16 B aligned
    v_ptr: cute.Pointer,          # v_cache     [pages, Hk, 128, D]    as k_cache
    table_ptr: cute.Pointer,      # block_table [R, max_blocks]        int32
    lens_ptr: cute.Pointer,       # seq_lens    [R]                    int32
    tile_map_ptr: cute.Pointer,   # tile_map    [num_tiles, 4]         int32, contiguous
    out_ptr: cute.Pointer,        # out         [T, Hq, D]             q's dtype, any strides
    ids_ptr: cute.Pointer,        # block_ids   [Hk, T, topk]          int32, any strides
    num_tokens: Int32,
    num_requests: Int32,
    max_blocks: Int32,
    num_pages: Int32,
    num_tiles: Int32,
    num_kv_heads: Int32,
    num_sms: Int32,               # the GPU's streaming multiprocessors: at most one CTA each
    sm_scale: Float32,
    stride_qt: Int64, stride_qh: Int64, stride_qd: Int64,
    stride_kp: Int64, stride_kh: Int64, stride_kn: Int64,
    stride_vp: Int64, stride_vh: Int64, stride_vn: Int64,
    stride_br: Int64, stride_bb: Int64,
    stride_l: Int64,
    stride_ot: Int64, stride_oh: Int64, stride_od: Int64,
    stride_ih: Int64, stride_it: Int64, stride_is: Int64,
    stream: cuda.CUstream,
    group: cutlass.Constexpr,
    heads_pad: cutlass.Constexpr,
    head_dim: cutlass.Constexpr,
    stages: cutlass.Constexpr,
    topk: cutlass.Constexpr,
):
    """Host side of ``sparse_prefill``: each tile's distinct chosen blocks (:func:`_prefill_launch`)."""
    tokens = const_expr(TILE_M // heads_pad)
    if const_expr(tokens > SPARSE_MAX_TOKENS or tokens * topk > SPARSE_MAX_ENTRIES):
        raise ValueError(f"sparse prefill: tiles of at most {SPARSE_MAX_TOKENS} tokens and tokens x topk <= "
                         f"{SPARSE_MAX_ENTRIES}, got {tokens} tokens (heads_pad {heads_pad}) x topk {topk}")
    mIds = cute.make_tensor(ids_ptr, cute.make_layout((num_kv_heads, num_tokens, topk),
                                                      stride=(stride_ih, stride_it, stride_is)))
    _prefill_launch(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, tile_map_ptr, out_ptr, mIds, num_tokens, num_requests,
                    max_blocks, num_pages, num_tiles, num_kv_heads, num_sms, sm_scale, stride_qt, stride_qh, stride_qd,
                    stride_kp, stride_kh, stride_kn, stride_vp, stride_vh, stride_vn, stride_br, stride_bb, stride_l,
                    stride_ot, stride_oh, stride_od, stream, group, heads_pad, head_dim, stages, topk)


def _shared_storage(dtype, sQ_layout, sKV_layout, stages: int, entries: int):
    """The kernel's shared memory: the query tile (at the 1 KiB-aligned start), the K/V ring, the
    ring's barriers, in sparse mode (``entries`` > 0) the block lists' barriers and their slots
    (after the swizzled buffers: no alignment padding before them)."""
    fields = dict(sQ=cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024],
                  sK=cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sKV_layout)], 1024],
                  sV=cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sKV_layout)], 1024],
                  mbar=cute.struct.MemRange[Int64, stages * 2])
    if entries:
        fields.update(list_mbar=cute.struct.MemRange[Int64, LIST_SLOTS * 2],
                      blocks=cute.struct.MemRange[Int32, entries * LIST_SLOTS],
                      chosen=cute.struct.MemRange[Int32, entries * LIST_SLOTS],
                      count=cute.struct.MemRange[Int32, LIST_SLOTS])
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


@cute.jit
def _prefill_launch(
    q_ptr: cute.Pointer,          # q           [T, Hq, D]             bf16/fp16, any strides
    k_ptr: cute.Pointer,          # k_cache     [pages, Hk, 128, D]    q's dtype, rows contiguous, 16 B aligned
    v_ptr: cute.Pointer,          # v_cache     [pages, Hk, 128, D]    as k_cache
    table_ptr: cute.Pointer,      # block_table [R, max_blocks]        int32
    lens_ptr: cute.Pointer,       # seq_lens    [R]                    int32
    tile_map_ptr: cute.Pointer,   # tile_map    [num_tiles, 4]         int32, contiguous
    out_ptr: cute.Pointer,        # out         [T, Hq, D]             q's dtype, any strides
    mIds,                         # sparse: block_ids (Hk, T, topk) int32; dense: None
    num_tokens: Int32,
    num_requests: Int32,
    max_blocks: Int32,
    num_pages: Int32,
    num_tiles: Int32,
    num_kv_heads: Int32,
    num_sms: Int32,               # the GPU's streaming multiprocessors: at most one CTA each
    sm_scale: Float32,
    stride_qt: Int64, stride_qh: Int64, stride_qd: Int64,
    stride_kp: Int64, stride_kh: Int64, stride_kn: Int64,
    stride_vp: Int64, stride_vh: Int64, stride_vn: Int64,
    stride_br: Int64, stride_bb: Int64,
    stride_l: Int64,
    stride_ot: Int64, stride_oh: Int64, stride_od: Int64,
    stream: cuda.CUstream,
    group: cutlass.Constexpr,
    heads_pad: cutlass.Constexpr,
    head_dim: cutlass.Constexpr,
    stages: cutlass.Constexpr,
    topk: cutlass.Constexpr,      # sparse: slots per token; dense: 0
):
    """Host side: views, the TMA descriptors, the MMAs, the persistent grid (one CTA per SM, at most
    one per work item); launches :func:`prefill_kernel`."""
    dtype = q_ptr.value_type
    num_heads = num_kv_heads * group
    mQ = cute.make_tensor(q_ptr, cute.make_layout((num_tokens, num_heads, head_dim),
                                                  stride=(stride_qt, stride_qh, stride_qd)))
    mO = cute.make_tensor(out_ptr, cute.make_layout((num_tokens, num_heads, head_dim),
                                                    stride=(stride_ot, stride_oh, stride_od)))
    # (token, dim, kv head, page): a page of one head is one TMA box at (0, 0, head, page id)
    mK = cute.make_tensor(k_ptr, cute.make_layout((PAGE_SIZE, head_dim, num_kv_heads, num_pages),
                                                  stride=(stride_kn, 1, stride_kh, stride_kp)))
    mV = cute.make_tensor(v_ptr, cute.make_layout((PAGE_SIZE, head_dim, num_kv_heads, num_pages),
                                                  stride=(stride_vn, 1, stride_vh, stride_vp)))
    mTable = cute.make_tensor(table_ptr, cute.make_layout((num_requests, max_blocks), stride=(stride_br, stride_bb)))
    mLens = cute.make_tensor(lens_ptr, cute.make_layout((num_requests,), stride=(stride_l,)))
    mTileMap = cute.make_tensor(tile_map_ptr, cute.make_layout((num_tiles, 4), stride=(4, 1)))

    sQ_layout = _smem_layout(dtype, TILE_M, head_dim)
    sKV_layout = _smem_layout(dtype, PAGE_SIZE, head_dim, stages)
    page_layout = cute.slice_(sKV_layout, (None, None, 0))
    tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mK, page_layout,
                                                    (PAGE_SIZE, head_dim))
    tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mV, page_layout,
                                                    (PAGE_SIZE, head_dim))
    page_bytes = cute.size_in_bytes(dtype, page_layout)

    # S = Q K^T: (128 rows, 128 tokens, D), both K-major in smem; O = P V: (128 rows, D, 128 tokens),
    # P from registers, V MN-major (its smem stage read transposed). One warpgroup per 64 rows.
    mma_qk = sm90_utils.make_trivial_tiled_mma(dtype, dtype, cute.nvgpu.OperandMajorMode.K,
                                               cute.nvgpu.OperandMajorMode.K, Float32,
                                               atom_layout_mnk=(NUM_MMA_WARPGROUPS, 1, 1), tiler_mn=(64, PAGE_SIZE))
    mma_pv = sm90_utils.make_trivial_tiled_mma(dtype, dtype, cute.nvgpu.OperandMajorMode.K,
                                               cute.nvgpu.OperandMajorMode.MN, Float32,
                                               atom_layout_mnk=(NUM_MMA_WARPGROUPS, 1, 1), tiler_mn=(64, head_dim),
                                               a_source=warpgroup.OperandSource.RMEM)

    SharedStorage = _shared_storage(dtype, sQ_layout, sKV_layout, stages, (TILE_M // heads_pad) * topk)
    num_ctas = cutlass.min(num_tiles * num_kv_heads, num_sms)
    prefill_kernel(tma_atom_k, tma_k, tma_atom_v, tma_v, mQ, mO, mTable, mLens, mTileMap, mIds, max_blocks,
                   num_kv_heads, sm_scale * LOG2_E, sQ_layout, sKV_layout, mma_qk, mma_pv, SharedStorage, page_bytes,
                   group, heads_pad, head_dim, stages, topk).launch(
        grid=[num_ctas, 1, 1], block=[NUM_THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)


def _work_item(k: Int32, cta: Int32, num_ctas: Int32) -> Int32:
    """The work item of CTA ``cta`` in round ``k``: ``k G + cta`` in even rounds, ``k G + G - 1 - cta``
    in odd ones (the serpentine stride of the module docstring); may be past the last item."""
    return k * num_ctas + cta + (k % 2) * (num_ctas - 1 - 2 * cta)


def _item_tile(mTileMap: cute.Tensor, mLens: cute.Tensor, max_blocks: Int32, num_kv_heads: Int32, item: Int32):
    """Work item ``item`` (tile ``num_tiles - 1 - item // Hk``: the last tiles see the most blocks, they
    come first) -> (kv head, request, first token, tokens, seq_len, position of the first token,
    blocks its last token sees)."""
    tile = mTileMap.shape[0] - 1 - item // num_kv_heads
    req = mTileMap[tile, 0]
    tok0 = mTileMap[tile, 1]
    ntok = mTileMap[tile, 3]
    # a length past the table behaves as its width, a negative one as 0 (SPEC.md)
    seq_len = cutlass.min(cutlass.max(mLens[req], 0), max_blocks * PAGE_SIZE)
    pos0 = seq_len + mTileMap[tile, 2]                  # tile_map holds position - seq_len
    n_blocks = (cutlass.max(pos0 + ntok, 0) + PAGE_SIZE - 1) // PAGE_SIZE
    return item % num_kv_heads, req, tok0, ntok, seq_len, pos0, n_blocks


@cute.kernel
def prefill_kernel(
    tma_atom_k: cute.CopyAtom,
    tma_k: cute.Tensor,           # (128, D, Hk, pages) TMA coordinates of k_cache
    tma_atom_v: cute.CopyAtom,
    tma_v: cute.Tensor,           # (128, D, Hk, pages) of v_cache
    mQ: cute.Tensor,              # (T, Hq, D)
    mO: cute.Tensor,              # (T, Hq, D)
    mTable: cute.Tensor,          # (R, max_blocks) int32
    mLens: cute.Tensor,           # (R,) int32
    mTileMap: cute.Tensor,        # (num_tiles, 4) int32: request, first token, its position - seq_len, tokens
    mIds: Optional[cute.Tensor],  # sparse: (Hk, T, topk) int32 block ids; dense: None
    max_blocks: Int32,
    num_kv_heads: Int32,
    scale_log2: Float32,          # sm_scale * log2(e)
    sQ_layout: cute.ComposedLayout,
    sKV_layout: cute.ComposedLayout,
    mma_qk: cute.TiledMma,
    mma_pv: cute.TiledMma,
    SharedStorage: cutlass.Constexpr,
    page_bytes: cutlass.Constexpr,
    group: cutlass.Constexpr,
    heads_pad: cutlass.Constexpr,
    head_dim: cutlass.Constexpr,
    stages: cutlass.Constexpr,
    topk: cutlass.Constexpr,
):
    sparse = const_expr(mIds is not None)
    if const_expr(stages < 2):
        # a consumer holds stage j - 1 (V_{j-1}) while it waits for stage j
        raise ValueError(f"stages: expected at least 2 (the intra-warpgroup overlap), got {stages}")
    tidx, _, _ = cute.arch.thread_idx()
    cta, _, _ = cute.arch.block_idx()
    num_ctas, _, _ = cute.arch.grid_dim()
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    warpgroup_idx = cute.arch.make_warp_uniform(tidx // 128)
    # -- shared memory, the TMA ring (K and V pages of a block share a stage and its barrier)
    smem = cutlass.memory.SmemAllocator()
    storage = smem.allocate(SharedStorage)
    sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)     # (128, D)
    sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)   # (128, D, stages)
    sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)   # (128, D, stages)
    sVt = _transpose_view(sV)                                                # (D, 128, stages)

    ring = pipeline.PipelineTmaAsync.create(
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, NUM_MMA_THREADS // 32),  # lane 0 of a warp
        tx_count=2 * page_bytes,
        barrier_storage=storage.mbar.data_ptr(),
        defer_sync=True,
    )
    # -- sparse: an item's blocks (list index j -> block sBlocks[j, slot], chosen by the tokens of bit
    # mask sChosen[j, slot], sCount[0, slot] of them), built by the producer warpgroup into slot
    # ``slot`` of a two-slot pipeline (every producer thread arrives when built, every consumer
    # thread when done with it); dense: blocks 0 .. n - 1
    if const_expr(sparse):
        entries = const_expr((TILE_M // heads_pad) * topk)
        sBlocks = storage.blocks.get_tensor(cute.make_layout((entries, LIST_SLOTS)))
        sChosen = storage.chosen.get_tensor(cute.make_layout((entries, LIST_SLOTS)))
        sCount = storage.count.get_tensor(cute.make_layout((1, LIST_SLOTS)))
        lists = pipeline.PipelineAsync.create(
            num_stages=LIST_SLOTS,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, NUM_PRODUCER_THREADS),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, NUM_MMA_THREADS),
            barrier_storage=storage.list_mbar.data_ptr(),
            defer_sync=True,
        )
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()                  # the barriers are initialized before any role uses them

    if warpgroup_idx == 0:
        # ---- producer: warp 0 streams the K/V pages of the items' blocks (in sparse mode the whole
        # warpgroup builds each item's block list first)
        cute.arch.setmaxregister_decrease(PRODUCER_REGS)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_k)
            cpasync.prefetch_descriptor(tma_atom_v)
        gK = cute.local_tile(tma_k, (PAGE_SIZE, head_dim), (0, 0, None, None))   # (128, D, Hk, pages)
        gV = cute.local_tile(tma_v, (PAGE_SIZE, head_dim), (0, 0, None, None))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))         # (TMA, stages), (TMA, Hk, pages)
        tVsV, tVgV = cpasync.tma_partition(tma_atom_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
        if const_expr(sparse):
            list_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, LIST_SLOTS)
        producer_warps = const_expr(NUM_PRODUCER_THREADS // 32 if sparse else 1)
        if warp_idx < producer_warps:
            # the CTA's work items, as the consumers walk them (counted after setmaxnreg in each role:
            # a value live across it would spill)
            num_items = mTileMap.shape[0] * num_kv_heads
            for k in cutlass.range((num_items + num_ctas - 1) // num_ctas, unroll=1):
                item = _work_item(k, cta, num_ctas)
                if item < num_items:
                    kv_head, req, tok0, ntok, seq_len, pos0, n_blocks = _item_tile(mTileMap, mLens, max_blocks,
                                                                                    num_kv_heads, item)
                    slot = 0
                    if const_expr(sparse):
                        # the slot of the item two back: free once both consumer warpgroups are done with it
                        lists.producer_acquire(list_state)
                        slot = list_state.index
                        _tile_block_list(mIds, sBlocks[None, slot], sChosen[None, slot], sCount[None, slot],
                                         kv_head, tok0, ntok, n_blocks, tidx, topk)
                        n_blocks = sCount[0, slot]
                        lists.producer_commit(list_state)
                        list_state.advance()
                    if warp_idx == 0:
                        for j in cutlass.range(n_blocks, unroll=1):
                            block = j
                            if const_expr(sparse):
                                block = sBlocks[j, slot]
                            page = mTable[req, block]
                            ring.producer_acquire(produce)
                            cute.copy(tma_atom_k, tKgK[(None, kv_head, page)], tKsK[(None, produce.index)],
                                      tma_bar_ptr=ring.producer_get_barrier(produce))
                            cute.copy(tma_atom_v, tVgV[(None, kv_head, page)], tVsV[(None, produce.index)],
                                      tma_bar_ptr=ring.producer_get_barrier(produce))
                            ring.producer_commit(produce)
                            produce.advance()
    else:
        # ---- consumers: warpgroups 1 and 2, rows 64 * (warpgroup - 1) ..
        cute.arch.setmaxregister_increase(MMA_REGS)
        mma_tidx = tidx - 128
        mma_wg = warpgroup_idx - 1
        wg_tidx = mma_tidx % 128
        wg_barrier = WARPGROUP_BARRIER_ID + mma_wg

        # MMA partitions: this warpgroup's 64 rows (smem descriptors), this thread's accumulators
        wg_layout = cute.make_layout(NUM_MMA_WARPGROUPS, stride=128)
        wg_qk = mma_qk.get_slice(wg_layout(mma_wg))
        wg_pv = mma_pv.get_slice(wg_layout(mma_wg))
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))              # (MMA, N, K, stages)
        tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))            # (MMA, N, K, stages)
        thr_qk = mma_qk.get_slice(mma_tidx)
        thr_pv = mma_pv.get_slice(mma_tidx)
        o_shape = thr_pv.partition_shape_C((TILE_M, head_dim))
        s_shape = thr_qk.partition_shape_C((TILE_M, PAGE_SIZE))
        tScS_mn = _acc_mn(thr_qk.partition_C(cute.make_identity_tensor((TILE_M, PAGE_SIZE))))
        tOcO_mn = _acc_mn(thr_pv.partition_C(cute.make_identity_tensor((TILE_M, head_dim))))
        rows = const_expr(cute.size(tScS_mn.shape[0]))
        # sparse: its tokens' mask bits (heads_pad 128: the tile's one token spans both warpgroups)
        tokens_per_wg = const_expr(max(1, (TILE_M // NUM_MMA_WARPGROUPS) // heads_pad))
        # the epilogue's store: a thread holds pairs of adjacent columns (2c, 2c + 1), one 4-byte store
        # per pair when the output's rows are contiguous and every row starts 4-byte aligned
        elem_bytes = const_expr(mO.element_type.width // 8)
        pairs = ((mO.stride[2] == 1) & (mO.iterator.toint() % 4 == 0)
                 & (mO.stride[0] % 2 == 0) & (mO.stride[1] % 2 == 0))

        # FA3's pingpong: the consumer warpgroups take turns issuing their GEMMs, so one's softmax
        # (or epilogue, or query rows) runs under the other's wgmmas. A turn is one block of one item;
        # both warpgroups walk the same items, so the same turns, as one sequence over all the CTA's
        # items. Turn barrier w (256 threads) completes when warpgroup w syncs on it (128) and the
        # other warpgroup has arrived (128) after issuing its GEMMs of its previous turn; warpgroup
        # 0's first turn takes its own arrive, made once below, and after its last turn it syncs once
        # more, taking warpgroup 1's arrive after its last turn. With N turns, barrier 0 gets (1 + N +
        # 1 + N) x 128 arrivals and barrier 1 (N + N) x 128: whole phases of 2 x 128 threads, nothing
        # left pending at exit (N may be 0). Turns strictly alternate (w0 t0, w1 t0, w0 t1, w1 t1, ..,
        # across items too), so an arrive never lands in the wrong phase. Between two turns a
        # warpgroup waits only on its own wgmmas, on its own barrier, on the TMA ring and (sparse)
        # on the block list of its next item: block g + 1 of the CTA's sequence needs block g + 1 -
        # stages <= g - 1 released, which each warpgroup does in its turn g, or before it, right
        # after its own P V; the list of item k needs both warpgroups done with item k - 2's list,
        # which each releases after its last turn of item k - 2, needing no turn of a later item. So
        # no cycle can form. An item's last P V is issued outside the turns.
        my_turn = SCHEDULER_BARRIER_ID + mma_wg
        other_turn = SCHEDULER_BARRIER_ID + 1 - mma_wg
        if mma_wg == 0:
            cute.arch.barrier_arrive(barrier_id=my_turn, number_of_threads=2 * 128)   # warpgroup 0 starts

        consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)   # the next block's
        if const_expr(sparse):
            list_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, LIST_SLOTS)
        num_items = mTileMap.shape[0] * num_kv_heads               # the CTA's work items, as the producer's
        for k in cutlass.range((num_items + num_ctas - 1) // num_ctas, unroll=1):
            item = _work_item(k, cta, num_ctas)
            if item < num_items:
                kv_head, req, tok0, ntok, seq_len, pos0, n_blocks = _item_tile(mTileMap, mLens, max_blocks,
                                                                                num_kv_heads, item)
                slot = 0
                if const_expr(sparse):
                    lists.consumer_wait(list_state)
                    slot = list_state.index
                    n_blocks = sCount[0, slot]
                _load_query_rows(mQ, sQ, tok0, ntok, kv_head, mma_wg * (TILE_M // NUM_MMA_WARPGROUPS), wg_tidx,
                                 wg_barrier, group, heads_pad, head_dim)
                acc_o = cute.make_rmem_tensor(o_shape, Float32)
                acc_o.fill(0.0)
                o_mn = _acc_mn(acc_o)
                row_max = cute.make_rmem_tensor((rows,), Float32)    # running max of S * scale_log2
                row_sum = cute.make_rmem_tensor((rows,), Float32)    # running sum of exp2, this thread's columns
                row_scale = cute.make_rmem_tensor((rows,), Float32)  # the block's correction for O
                row_max.fill(-Float32.inf)
                row_sum.fill(0.0)

                # FA3's intra-warpgroup overlap: block j issues S_j = Q K_j^T and O += P_{j-1} V_{j-1}
                # back to back, waits for S_j only (wait_group(1)), masks and softmaxes it while P V
                # runs, then waits for P V (wait_group(0)), releases stage j-1, rescales O and keeps
                # P_j in registers for block j + 1. K_j and V_j share stage j: it is released after
                # P_j V_j, one block later than its S. A stage's stale V rows are zeroed right after
                # its wait, before any P V that reads it is issued. S is a fresh fragment per block
                # (its registers are dead between blocks: nothing keeps the last P alive into the next
                # S's wgmma). ``consume`` is the ring's next stage, carried from item to item.
                if const_expr(sparse):
                    # -- sparse: a warpgroup computes only the blocks its own tokens chose (``own``: their
                    # bits of the mask), the list's other blocks are empty turns: it waits for the block's
                    # stage (so its release lands in the stage's current phase), takes its turn without
                    # GEMMs (the turns stay in step) and releases the stage at once. The intra-warpgroup
                    # overlap is FA3's as in dense mode, between the warpgroup's own blocks: the P of its
                    # last block (``held``, its stage ``previous``) waits for its P V under the next own
                    # block's S. Before waiting for list block j it finishes that P V if block j takes the
                    # held stage (j - held >= stages), which the producer can only refill once released.
                    own = ((1 << tokens_per_wg) - 1) << ((mma_wg * (TILE_M // NUM_MMA_WARPGROUPS)) // heads_pad)
                    pending = Int32(0)            # 1: block ``held``'s P waits for its P V
                    held = Int32(0)
                    previous = consume.clone()
                    tOrP = cute.make_rmem_tensor_like(_acc_as_a(cute.make_rmem_tensor(s_shape, Float32)),
                                                      mQ.element_type)
                    tOrP.fill(0.0)   # defined before any wgmma reads it (else ptxas serializes them)
                    for j in cutlass.range(n_blocks, unroll=1):
                        block = sBlocks[j, slot]
                        chosen = sChosen[j, slot]
                        if (pending != 0) & (j - held >= stages):
                            _gemm(mma_pv, acc_o, tOrP, tOrVt[None, None, None, previous.index], True)
                            warpgroup.wait_group(0)
                            ring.consumer_release(previous)
                            pending = Int32(0)
                        ring.consumer_wait(consume)
                        if (chosen & own) != 0:
                            _zero_stale_v(sV[None, None, consume.index], seq_len - block * PAGE_SIZE, wg_tidx,
                                          wg_barrier, head_dim)
                            acc_s = cute.make_rmem_tensor(s_shape, Float32)
                            cute.arch.barrier(barrier_id=my_turn, number_of_threads=2 * 128)
                            _gemm(mma_qk, acc_s, tSrQ, tSrK[None, None, None, consume.index], False)    # S_j
                            # each branch issues, waits and softmaxes on its own: ptxas follows no path
                            # through separate ifs, and a wait it cannot prove makes it serialize every wgmma
                            if pending != 0:
                                _gemm(mma_pv, acc_o, tOrP, tOrVt[None, None, None, previous.index], True)
                                cute.arch.barrier_arrive(barrier_id=other_turn, number_of_threads=2 * 128)
                                warpgroup.wait_group(1)   # S_j is in; P V may still run
                                _online_softmax(_acc_mn(acc_s), tScS_mn, row_max, row_sum, row_scale, block, chosen,
                                                pos0, scale_log2, heads_pad, sparse)
                                warpgroup.wait_group(0)   # P V is done: O, tOrP and the held stage are free
                                ring.consumer_release(previous)
                            else:
                                cute.arch.barrier_arrive(barrier_id=other_turn, number_of_threads=2 * 128)
                                warpgroup.wait_group(0)
                                _online_softmax(_acc_mn(acc_s), tScS_mn, row_max, row_sum, row_scale, block, chosen,
                                                pos0, scale_log2, heads_pad, sparse)
                            for r in cutlass.range_constexpr(rows):   # O to the new max (0 x 0 before any P V)
                                for c in cutlass.range_constexpr(cute.size(o_mn.shape[1])):
                                    o_mn[r, c] = o_mn[r, c] * row_scale[r]
                            tOrP.store(_acc_as_a(acc_s).load().to(mQ.element_type))
                            previous = consume.clone()
                            held = j
                            pending = Int32(1)
                        else:
                            cute.arch.barrier(barrier_id=my_turn, number_of_threads=2 * 128)
                            cute.arch.barrier_arrive(barrier_id=other_turn, number_of_threads=2 * 128)
                            ring.consumer_release(consume)
                        consume.advance()
                    if pending != 0:   # the last own block's P V, outside the turns
                        _gemm(mma_pv, acc_o, tOrP, tOrVt[None, None, None, previous.index], True)
                        warpgroup.wait_group(0)
                        ring.consumer_release(previous)
                elif n_blocks > 0:
                    # -- block 0: S_0 and its softmax (O is 0: nothing to rescale)
                    block = 0
                    ring.consumer_wait(consume)
                    _zero_stale_v(sV[None, None, consume.index], seq_len - block * PAGE_SIZE, wg_tidx, wg_barrier,
                                  head_dim)
                    acc_s = cute.make_rmem_tensor(s_shape, Float32)
                    cute.arch.barrier(barrier_id=my_turn, number_of_threads=2 * 128)
                    _gemm(mma_qk, acc_s, tSrQ, tSrK[None, None, None, consume.index], False)
                    cute.arch.barrier_arrive(barrier_id=other_turn, number_of_threads=2 * 128)
                    warpgroup.wait_group(0)
                    _online_softmax(_acc_mn(acc_s), tScS_mn, row_max, row_sum, row_scale, block, 0, pos0,
                                    scale_log2, heads_pad, sparse)
                    tOrP = cute.make_rmem_tensor_like(_acc_as_a(acc_s), mQ.element_type)   # P in q's dtype
                    tOrP.store(_acc_as_a(acc_s).load().to(mQ.element_type))

                    for j in cutlass.range(1, n_blocks, unroll=1):
                        block = j
                        previous = consume.clone()
                        consume.advance()
                        ring.consumer_wait(consume)
                        _zero_stale_v(sV[None, None, consume.index], seq_len - block * PAGE_SIZE, wg_tidx,
                                      wg_barrier, head_dim)
                        acc_s = cute.make_rmem_tensor(s_shape, Float32)
                        cute.arch.barrier(barrier_id=my_turn, number_of_threads=2 * 128)
                        _gemm(mma_qk, acc_s, tSrQ, tSrK[None, None, None, consume.index], False)    # S_j
                        _gemm(mma_pv, acc_o, tOrP, tOrVt[None, None, None, previous.index], True)   # += P V
                        cute.arch.barrier_arrive(barrier_id=other_turn, number_of_threads=2 * 128)
                        warpgroup.wait_group(1)                   # S_j is in; P V may still run
                        _online_softmax(_acc_mn(acc_s), tScS_mn, row_max, row_sum, row_scale, block, 0,
                                        pos0, scale_log2, heads_pad, sparse)
                        warpgroup.wait_group(0)                   # P V is done: O, tOrP and stage j-1 are free
                        ring.consumer_release(previous)
                        for r in cutlass.range_constexpr(rows):
                            for c in cutlass.range_constexpr(cute.size(o_mn.shape[1])):
                                o_mn[r, c] = o_mn[r, c] * row_scale[r]
                        tOrP.store(_acc_as_a(acc_s).load().to(mQ.element_type))

                    # -- the last block's P V
                    _gemm(mma_pv, acc_o, tOrP, tOrVt[None, None, None, consume.index], True)
                    warpgroup.wait_group(0)
                    ring.consumer_release(consume)
                    consume.advance()
                if const_expr(sparse):
                    lists.consumer_release(list_state)       # this warpgroup is done with the item's list
                    list_state.advance()

                # -- epilogue: O / l (0 for rows that see nothing), stored through the output's strides:
                # one 4-byte store per pair of columns (``pairs``), else element by element
                for r in cutlass.range_constexpr(rows):
                    total = row_sum[r]
                    total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
                    total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
                    inv = Float32(0.0)
                    if total > Float32(0.0):
                        inv = Float32(1.0) / total
                    m = tOcO_mn[r, 0][0]
                    tok = m // heads_pad
                    head = m % heads_pad
                    if (tok < ntok) & (head < group):
                        row = mO[tok0 + tok, kv_head * group + head, None]                         # (D,)
                        if pairs:
                            row_base = row.iterator.toint()
                            for c in cutlass.range_constexpr(0, cute.size(o_mn.shape[1]), 2):
                                pair = cute.make_rmem_tensor((2,), Float32)
                                pair[0] = o_mn[r, c] * inv
                                pair[1] = o_mn[r, c + 1] * inv
                                dst = cute.make_tensor(cute.make_ptr(mO.element_type,
                                                                     row_base + tOcO_mn[r, c][1] * elem_bytes,
                                                                     cute.AddressSpace.gmem, assumed_align=4),
                                                       cute.make_layout(2))
                                dst.store(pair.load().to(mO.element_type))
                        else:
                            for c in cutlass.range_constexpr(cute.size(o_mn.shape[1])):
                                row[tOcO_mn[r, c][1]] = mO.element_type(o_mn[r, c] * inv)
        if mma_wg == 0:
            # the turn after the last: takes warpgroup 1's arrive after its last turn
            cute.arch.barrier(barrier_id=my_turn, number_of_threads=2 * 128)


def _as_element_type(ptr: cute.Pointer, element_type) -> cute.Pointer:
    """``ptr`` read as ``element_type`` (a byte pool's sub-pages are read as q's dtype)."""
    if ptr.value_type != element_type:
        return cute.recast_ptr(ptr, dtype=element_type)
    return ptr


@cute.jit
def dense_prefill_xla(
    stream: cuda.CUstream,
    q: cute.Tensor,               # [T, Hq, D] row-major
    k_cache: cute.Tensor,         # the flat buffer holding k_cache (a PagedView's buffer, any dtype)
    v_cache: cute.Tensor,         # the flat buffer holding v_cache (may be k_cache's buffer)
    block_table: cute.Tensor,     # [R, max_blocks] int32 row-major
    seq_lens: cute.Tensor,        # [R] int32
    tile_map: cute.Tensor,        # [num_tiles, 4] int32
    out: cute.Tensor,             # [T, Hq, D] q's dtype row-major (output)
    *,
    sm_scale: cutlass.Constexpr,
    k_offset: cutlass.Constexpr,
    k_strides: cutlass.Constexpr,   # (page, head, token) in elements of q's dtype
    v_offset: cutlass.Constexpr,
    v_strides: cutlass.Constexpr,
    num_pages: cutlass.Constexpr,
    num_kv_heads: cutlass.Constexpr,
    group: cutlass.Constexpr,
    heads_pad: cutlass.Constexpr,
    head_dim: cutlass.Constexpr,
    stages: cutlass.Constexpr,
    num_sms: cutlass.Constexpr,
):
    """``cutlass.jax.cutlass_call`` entry: dense row-major arrays (sizes from their runtime shapes)
    and each K/V cache as (flat buffer, static offset/strides in elements of q's dtype: a byte
    pool's sub-pages are read as that dtype), the GPU's SM count -> ``dense_prefill_launch``."""
    dense_prefill_launch(
        q.iterator, _as_element_type(k_cache.iterator, q.element_type) + k_offset,
        _as_element_type(v_cache.iterator, q.element_type) + v_offset, block_table.iterator, seq_lens.iterator,
        tile_map.iterator, out.iterator,
        q.shape[0], block_table.shape[0], block_table.shape[1], num_pages, tile_map.shape[0], num_kv_heads,
        Int32(num_sms), Float32(sm_scale),
        q.layout.stride[0], q.layout.stride[1], q.layout.stride[2],
        *k_strides, *v_strides,
        block_table.layout.stride[0], block_table.layout.stride[1],
        seq_lens.layout.stride[0],
        out.layout.stride[0], out.layout.stride[1], out.layout.stride[2],
        stream,
        group, heads_pad, head_dim, stages)


@cute.jit
def sparse_prefill_xla(
    stream: cuda.CUstream,
    q: cute.Tensor,               # [T, Hq, D] row-major
    k_cache: cute.Tensor,         # as in dense_prefill_xla
    v_cache: cute.Tensor,
    block_ids: cute.Tensor,       # [Hk, T, topk] int32 row-major
    block_table: cute.Tensor,     # [R, max_blocks] int32 row-major
    seq_lens: cute.Tensor,        # [R] int32
    tile_map: cute.Tensor,        # [num_tiles, 4] int32
    out: cute.Tensor,             # [T, Hq, D] q's dtype row-major (output)
    *,
    sm_scale: cutlass.Constexpr,
    k_offset: cutlass.Constexpr,
    k_strides: cutlass.Constexpr,
    v_offset: cutlass.Constexpr,
    v_strides: cutlass.Constexpr,
    num_pages: cutlass.Constexpr,
    num_kv_heads: cutlass.Constexpr,
    group: cutlass.Constexpr,
    heads_pad: cutlass.Constexpr,
    head_dim: cutlass.Constexpr,
    stages: cutlass.Constexpr,
    topk: cutlass.Constexpr,
    num_sms: cutlass.Constexpr,
):
    """``cutlass.jax.cutlass_call`` entry of the sparse mode: as :func:`dense_prefill_xla`, with the
    block ids -> ``sparse_prefill_launch``."""
    sparse_prefill_launch(
        q.iterator, _as_element_type(k_cache.iterator, q.element_type) + k_offset,
        _as_element_type(v_cache.iterator, q.element_type) + v_offset, block_table.iterator, seq_lens.iterator,
        tile_map.iterator, out.iterator, block_ids.iterator,
        q.shape[0], block_table.shape[0], block_table.shape[1], num_pages, tile_map.shape[0], num_kv_heads,
        Int32(num_sms), Float32(sm_scale),
        q.layout.stride[0], q.layout.stride[1], q.layout.stride[2],
        *k_strides, *v_strides,
        block_table.layout.stride[0], block_table.layout.stride[1],
        seq_lens.layout.stride[0],
        out.layout.stride[0], out.layout.stride[1], out.layout.stride[2],
        block_ids.layout.stride[0], block_ids.layout.stride[1], block_ids.layout.stride[2],
        stream,
        group, heads_pad, head_dim, stages, topk)
