"""The JAX side of the CuTeDSL kernels (``backend="cutedsl"``): ``cutlass.jax.cutlass_call``.

The same kernels as ``m3_torch.cute_ops``: the indexer scorer
(``m3_kernels.cute_index``, entered through ``cute_index.index_scores_xla``)
and the dense and sparse prefill attention (``m3_kernels.cute_prefill``, through
``cute_prefill.dense_prefill_xla`` and ``sparse_prefill_xla``). Dense row-major arrays whose sizes reach
the kernel at run time (one compiled kernel per shape class, as with torch);
each cache as the flat buffer of its PagedView with the view's dtype, offset
and strides as compile-time constants (a byte pool's e4m3 or bf16 sub-pages:
the kernel reads the buffer as the view's dtype). Works under ``jax.jit`` (an
XLA FFI custom call; XLA may put it in its command buffers). GPU only: the
public ops refuse ``backend="cutedsl"`` on a CPU backend before this runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from m3_kernels import backends, maps, tuning

from .views import PagedView

# Extra ``cute.compile`` flags (tests compile for Hopper without a GPU: "--gpu-arch sm_90a").
COMPILE_OPTIONS: str | None = None
# Names the kernel for cutlass_call's compile cache (which adds the shapes, dtypes and keyword
# constants itself), so a cache hit under a new trace skips regenerating the kernel's IR.
_COMPILE_KEY = ("m3_kernels.cute_index.index_scores_xla", 2)
_PREFILL_COMPILE_KEY = ("m3_kernels.cute_prefill.dense_prefill_xla", 2)
_SPARSE_PREFILL_COMPILE_KEY = ("m3_kernels.cute_prefill.sparse_prefill_xla", 2)


def index_scores(idx_q, index_k: PagedView, block_table, seq_lens, tile_map, tile: maps.RowTile):
    """``scores [Hi, T, max_blocks]`` float32 of ``tile_map``'s row tiles, with the CuTeDSL kernel."""
    num_tokens, num_heads, head_dim = (int(s) for s in idx_q.shape)
    max_blocks = int(block_table.shape[1])
    shape = (num_heads, num_tokens, max_blocks)
    if num_tokens == 0 or int(tile_map.shape[0]) == 0 or max_blocks == 0:
        return jnp.zeros(shape, jnp.float32)
    if index_k.strides[-1] != 1 or index_k.offset % 16 or any(s % 16 for s in index_k.strides[:-1]):
        raise ValueError("index_k_cache: backend='cutedsl' needs contiguous rows (last stride 1) and an offset and "
                         f"page/token strides that are multiples of 16 elements, got offset {index_k.offset}, "
                         f"strides {index_k.strides}; use backend='triton'")
    ci = backends.cutedsl_module()
    from cutlass.jax import cutlass_call

    cfg = tuning.cutedsl_index_scores(head_dim=head_dim)
    call = cutlass_call(ci.index_scores_xla, output_shape_dtype=jax.ShapeDtypeStruct(shape, jnp.float32),
                        k_dtype=jnp.dtype(index_k.dtype).name, k_offset=index_k.offset,
                        k_stride_page=index_k.strides[0], k_stride_token=index_k.strides[1],
                        num_pages=index_k.shape[0], num_heads=num_heads, heads_pad=tile.heads_pad,
                        block_m=tile.block_m, head_dim=head_dim, stages=cfg.stages,
                        target_programs=cfg.target_programs, compile_options=COMPILE_OPTIONS,
                        compile_key=_COMPILE_KEY)
    return call(idx_q, jnp.reshape(index_k.buffer, (-1,)), block_table, seq_lens, jnp.asarray(tile_map, jnp.int32))


def _check_kv(q, k_cache: PagedView, v_cache: PagedView):
    """TMA reads whole 128 x D pages of one head: rows contiguous, page/head/token strides and the
    offset multiples of 16 bytes."""
    itemsize = jnp.dtype(q.dtype).itemsize
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (cache.strides[-1] != 1 or cache.offset * itemsize % 16
                or any(s * itemsize % 16 for s in cache.strides[:-1])):
            raise ValueError(f"{name}: backend='cutedsl' needs contiguous rows (last stride 1), page/head/token "
                             f"strides that are multiples of 16 bytes and a 16-byte aligned start, got strides "
                             f"{cache.strides} at element offset {cache.offset}; use backend='triton'")


def sm_count() -> int:
    """The streaming multiprocessors of the GPU JAX computes on (its default device): the prefill
    kernel's persistent grid has at most one CTA on each."""
    device = jax.config.jax_default_device
    device = device if device is not None and not isinstance(device, str) else jax.devices()[0]
    count = getattr(device, "core_count", None)
    if not count:
        raise RuntimeError(f"backend='cutedsl': the prefill kernel's grid needs the GPU's SM count, JAX's device "
                           f"{device} gives core_count={count!r}")
    return int(count)


def _prefill_constants(q, k_cache: PagedView, v_cache: PagedView, tile: maps.RowTile, sm_scale: float) -> dict:
    """The keyword constants both prefill entries of ``cute_prefill`` take."""
    num_heads, head_dim = int(q.shape[1]), int(q.shape[2])
    num_kv_heads = int(k_cache.shape[1])
    return dict(sm_scale=float(sm_scale), k_offset=k_cache.offset, k_strides=k_cache.strides[:3],
                v_offset=v_cache.offset, v_strides=v_cache.strides[:3], num_pages=int(k_cache.shape[0]),
                num_kv_heads=num_kv_heads, group=num_heads // num_kv_heads, heads_pad=tile.heads_pad,
                head_dim=head_dim, stages=tuning.CUTEDSL_PREFILL_STAGES[head_dim], num_sms=sm_count())


def dense_prefill(q, k_cache: PagedView, v_cache: PagedView, block_table, seq_lens, tile_map, tile: maps.RowTile,
                  sm_scale: float):
    """``out [T, Hq, D]`` in q's dtype of ``tile_map``'s row tiles (``maps.index_tile`` of the group: up to
    128 rows of tokens x heads) with the CuTeDSL kernel; k_cache/v_cache: HND views ``[pages, Hk, 128, D]``."""
    if int(q.shape[0]) == 0 or int(tile_map.shape[0]) == 0:
        return jnp.zeros(q.shape, q.dtype)
    _check_kv(q, k_cache, v_cache)
    cp = backends.cutedsl_prefill_module()
    from cutlass.jax import cutlass_call

    call = cutlass_call(cp.dense_prefill_xla, output_shape_dtype=jax.ShapeDtypeStruct(q.shape, q.dtype),
                        **_prefill_constants(q, k_cache, v_cache, tile, sm_scale),
                        compile_options=COMPILE_OPTIONS, compile_key=_PREFILL_COMPILE_KEY)
    return call(q, jnp.reshape(k_cache.buffer, (-1,)), jnp.reshape(v_cache.buffer, (-1,)), block_table, seq_lens,
                jnp.asarray(tile_map, jnp.int32))


def sparse_prefill(q, k_cache: PagedView, v_cache: PagedView, block_ids, block_table, seq_lens, tile_map,
                   tile: maps.RowTile, sm_scale: float):
    """``out [T, Hq, D]`` in q's dtype of ``tile_map``'s row tiles (``maps.index_tile`` of the group),
    each row over its token's ``block_ids [Hk, T, topk]``, with the CuTeDSL kernel's sparse mode."""
    if int(q.shape[0]) == 0 or int(tile_map.shape[0]) == 0:
        return jnp.zeros(q.shape, q.dtype)
    _check_kv(q, k_cache, v_cache)
    cp = backends.cutedsl_prefill_module()
    from cutlass.jax import cutlass_call

    call = cutlass_call(cp.sparse_prefill_xla, output_shape_dtype=jax.ShapeDtypeStruct(q.shape, q.dtype),
                        **_prefill_constants(q, k_cache, v_cache, tile, sm_scale), topk=int(block_ids.shape[2]),
                        compile_options=COMPILE_OPTIONS, compile_key=_SPARSE_PREFILL_COMPILE_KEY)
    return call(q, jnp.reshape(k_cache.buffer, (-1,)), jnp.reshape(v_cache.buffer, (-1,)), block_ids, block_table,
                seq_lens, jnp.asarray(tile_map, jnp.int32))
