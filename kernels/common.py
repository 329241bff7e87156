"""Constants and tiny @triton.jit helpers shared by the kernel files."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .maps import PAGE_SIZE as _PAGE_SIZE

# Tokens per sparse block and per KV page (maps.PAGE_SIZE, as a kernel constant).
PAGE_SIZE = tl.constexpr(_PAGE_SIZE)

# Triton 3.6-3.9's interpreter computes tl.dot on two bf16 operands wrongly on
# CPU. This module is loaded once per mode (see __init__.py), so the flag is
# True exactly in the interpreted copy, where dot operands are widened to fp32.
WIDEN_DOT_OPERANDS = tl.constexpr(bool(triton.knobs.runtime.interpret))


# float8_e4m3fn (Triton's float8e4nv), the FP8 cache format: its largest finite value.
E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def typed(ptr, DTYPE: tl.constexpr):
    """``ptr`` as a pointer to ``DTYPE``: a cache's element type, which its buffer's need
    not be (the sub-pages of a byte pool; JAX passes the whole pool). A no-op when equal."""
    return ptr.to(tl.pointer_type(DTYPE), bitcast=True)


@triton.jit
def to_e4m3(x, scale):
    """``x / scale`` as float8_e4m3fn, saturating: the float32 quotient rounded as IEEE
    division, then clamped to +-448 (inf included; NaN stays NaN) and rounded to nearest
    even. Every GPU and the interpreter write the bytes of torch's
    ``(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)``."""
    x = tl.div_rn(x.to(tl.float32), scale + tl.zeros(x.shape, tl.float32))   # `/` is approximate on GPUs
    x = tl.where(x != x, x, tl.minimum(tl.maximum(x, -E4M3_MAX), E4M3_MAX))
    return x.to(tl.float8e4nv)


@triton.jit
def fp16_operand(x):
    """``x`` (bfloat16, ``[rows, cols]``) as float16, for MMAs with FP8 tiles: e4m3
    widens to float16 in one instruction per pair, to bfloat16 in one more per element (sm_90; the
    FP8 kernels were ALU-bound on it). -> (x16, unscale ``[rows]``), ``x[r] == x16[r] * unscale[r]``:
    each row is scaled by a power of two (exact) that brings its largest finite magnitude into
    [2^14, 2^15], so nothing overflows, and every element of at least 2^-28 of that magnitude stays
    a normal float16 (exact for bfloat16 values; smaller ones round within 2^-39 of the row's
    magnitude; rows below 2^-85, where the scale stops at 2^100, keep less). The caller multiplies each row's dot by its ``unscale``. NaN and Inf stay NaN and
    Inf (the kernels' NaN rules apply unchanged); an all-zero row is left as it is."""
    x32 = x.to(tl.float32)
    finite = tl.abs(x32) < float("inf")   # false for NaN
    amax = tl.max(tl.where(finite, tl.abs(x32), 0.0), axis=1)
    e = tl.where(amax > 0, tl.ceil(tl.log2(tl.where(amax > 0, amax, 1.0))) - 15.0, 0.0)
    e = tl.maximum(e, -100.0)   # 2^100 stays finite in float32 (bfloat16 subnormals reach 2^-133)
    return (x32 * tl.exp2(-e)[:, None]).to(tl.float16), tl.exp2(e)


@triton.jit
def mma(a, b):
    """a @ b with float32 accumulation.

    float32 operands use 3xTF32 (near-fp32 accuracy: SPEC asks fp32 inputs to
    land under 1e-3, which plain TF32 misses after two chained products).
    """
    if WIDEN_DOT_OPERANDS:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:
        out = tl.dot(a, b, input_precision="tf32x3")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def multiple_of_16(x):
    """``x``, a multiple of 16 (``validate.check_cache_layout``), stated so the compiler sees it.

    Triton learns divisibility from the ints torch passes, but jax-triton passes
    integer scalars without it, and then no K/V load vectorizes or pipelines
    (~2x slower steps). ``(x // 16) * 16`` is exact here and visible to the
    compiler (``tl.multiple_of`` cannot annotate a kernel argument).
    """
    return (x // 16) * 16


def aligned(*values) -> bool:
    """The ``ALIGNED`` constexpr of a launch (host side of ``multiple_of_16``): every one of ``values`` (row
    strides, cache offsets and strides) is a multiple of 16 elements. The kernel then states it: torch's
    launches tell the compiler so themselves, jax-triton's do not, and without it neither loads nor stores
    vectorize (the sparse attention's 8-token tiles: 144 global loads and 64 stores under jax-triton against
    82 and 16 under torch). Both launchers derive it from the same strides, so they compile the same variant."""
    return all(int(v) % 16 == 0 for v in values)


@triton.jit
def release_next_grid(PDL: tl.constexpr):
    """Every kernel's first statement. ``PDL`` (the launcher passes True on sm_90+ GPUs): kernels
    are launched as programmatic dependents of the stream's previous kernel (torch launches with
    ``launch_pdl``); this lets the next kernel of the stream be launched, and its programs placed,
    as soon as all of this kernel's programs are running. It orders nothing: each kernel still
    waits (``wait_for_previous_grid``) before it reads what an earlier kernel may have written."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous_grid(PDL: tl.constexpr):
    """Wait until the stream's previous kernel has finished and its writes are visible
    (``griddepcontrol.wait``). Before it a kernel reads only its row of the tile or token map:
    the launch layer's own device constants (uploaded by copy once per shape or plan; no kernel
    writes them). Everything else is read, and everything written, after it: queries, caches,
    scores, block ids, partials, scales, and also ``seq_lens`` and ``slot_mapping``, which the
    caller may have just computed with a kernel whose writes only this wait makes visible. The
    map's load thus overlaps the previous kernel's tail instead of starting the chain after it.
    (``fp8_linear_kernel`` also sends its first weight lines to L2 before the wait: a prefetch hint,
    which reads nothing into the program, of weights no kernel writes.)
    Without PDL (older GPUs, the interpreter, jax-triton's launches) neither instruction is
    emitted or both pass at once."""
    if PDL:
        gdc_wait()


@triton.jit
def tile_program(TILES_ON_AXIS_0: tl.constexpr):
    """-> (row tile, the other of the grid's first two axes: split or block chunk). Grids put the
    row tiles on axis 1, or, past 65535 of them (``launches.tile_grid``), on axis 0, the only axis
    that holds more."""
    if TILES_ON_AXIS_0:
        tile, other = tl.program_id(0), tl.program_id(1)
    else:
        other, tile = tl.program_id(0), tl.program_id(1)
    return tile, other


@triton.jit
def tile_row(tile_map_ptr, tile):
    """Row ``tile`` of a tile map -> (request, first token, first token's position - seq_len, tokens)."""
    row = tile_map_ptr + tile * 4
    return tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)


@triton.jit
def visible_len(seq_lens_ptr, req, max_blocks):
    """``seq_lens[req]`` clamped to ``[0, max_blocks * PAGE_SIZE]``: a length past the table
    behaves as its width (no request reads past its row of block_table), a negative one as 0."""
    return tl.minimum(tl.maximum(tl.load(seq_lens_ptr + req), 0), max_blocks * PAGE_SIZE)


@triton.jit
def whole_blocks_end(first_pos, lo, hi):
    """The end of the blocks of ``[lo, hi)`` that every row of a tile sees in full: those ending at or
    before its first token's position ``first_pos`` (clamped to ``[lo, hi]``). They need no causal mask."""
    return tl.minimum(tl.maximum(tl.maximum(first_pos + 1, 0) // PAGE_SIZE, lo), hi)


@triton.jit
def pick(vec, offs, j):
    """Element ``j`` of the register vector ``vec`` (indexed by ``offs``), as a scalar."""
    return tl.sum(tl.where(offs == j, vec, 0), axis=0)
