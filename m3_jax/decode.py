"""JAX launchers of the shared decode kernels (mirror of ``m3_torch/decode.py``).

Each op validates shapes and dtypes (``m3_kernels.validate``, never values),
takes its launch geometry from ``m3_kernels.geometry`` exactly as the torch
launcher does (so both frameworks compile the same kernel variant and give
bit-identical results) and launches through :func:`triton_call` (jax-triton on
a GPU backend, the interpreted kernel in a ``pure_callback`` on CPU).

JAX style: no ``out=``; results are returned. K/V caches are jax arrays with
``kv_layout="HND"`` (``[pages, Hk, 128, D]``) or ``"NHD"``
(``[pages, 128, Hk, D]``), or :class:`~m3_jax.views.PagedView` objects (logical
HND views into a flat pool; ``kv_layout`` is then ignored). The index-K cache
is a ``[pages, 128, Di]`` array or a PagedView.

Every op works under ``jax.jit`` with ``decode_query_len``, ``topk``,
``init_blocks``, ``local_blocks``, ``sm_scale`` and ``kv_layout`` static: the
geometry depends on shapes only, so new ``seq_lens`` / ``block_table`` / ``q``
values never recompile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from m3_kernels import geometry, validate

from ._triton_call import triton_call
from .views import as_index_k_view, as_kv_view

__all__ = ["index_scores", "select_blocks", "sparse_decode", "dense_decode", "msa_decode"]

_INDEX_SCORES = ("index", "index_scores_kernel")
_SELECT_BLOCKS = ("index", "select_blocks_kernel")
_ATTENTION = ("attention", "paged_attention_kernel")
_MERGE = ("attention", "merge_splits_kernel")

_strides = geometry.contiguous_strides  # JAX arrays are dense row-major


@functools.lru_cache(maxsize=None)
def _decode_maps_np(num_requests, decode_query_len, tokens_per_tile):
    return geometry.decode_maps(num_requests, decode_query_len, tokens_per_tile)


def decode_maps(num_requests, decode_query_len, tokens_per_tile):
    """(tile_map [num_tiles, 4], token_map [T, 2]) int32 jnp constants, built once per shape."""
    tile_map, token_map = _decode_maps_np(num_requests, decode_query_len, tokens_per_tile)
    return jnp.asarray(tile_map), jnp.asarray(token_map)


# -- index_scores ------------------------------------------------------------------

def launch_index_scores(idx_q, index_k, block_table, seq_lens, *, tile_map, tile):
    """Index-scores kernel over ``tile_map``'s row tiles -> scores [Hi, T, max_blocks] f32."""
    num_tokens, num_heads, head_dim = idx_q.shape
    max_blocks = block_table.shape[1]
    shape = (num_heads, num_tokens, max_blocks)
    if tile_map.shape[0] == 0:
        return jnp.full(shape, -jnp.inf, jnp.float32)
    plan = geometry.index_plan(tile=tile, num_tiles=tile_map.shape[0], head_dim=head_dim, max_blocks=max_blocks)
    args = geometry.index_scores_args(
        idx_q=idx_q, index_k=index_k.buffer, block_table=block_table, seq_lens=seq_lens, tile_map=tile_map,
        k_off=index_k.offset, q_strides=_strides(idx_q.shape), k_strides=index_k.strides,
        bt_strides=_strides(block_table.shape), scores_strides=_strides(shape), max_blocks=max_blocks,
        blocks_per_program=plan.blocks_per_program)
    return triton_call(*args, kernel=_INDEX_SCORES, out_shape=jax.ShapeDtypeStruct(shape, jnp.float32),
                       grid=(plan.num_chunks, plan.num_tiles), num_warps=plan.num_warps,
                       num_stages=plan.num_stages, **plan.constexprs(num_heads=num_heads, head_dim=head_dim))


def launch_select_blocks(scores, seq_lens, *, token_map, topk, init_blocks, local_blocks):
    """Selection kernel, one program per (token, head) -> block ids [Hi, T, topk] int32."""
    num_heads, num_tokens, max_blocks = scores.shape
    shape = (num_heads, num_tokens, topk)
    if num_tokens == 0:
        return jnp.full(shape, -1, jnp.int32)
    args = geometry.select_args(scores=scores, seq_lens=seq_lens, token_map=token_map,
                                scores_strides=_strides(scores.shape), ids_strides=_strides(shape),
                                max_blocks=max_blocks)
    return triton_call(*args, kernel=_SELECT_BLOCKS, out_shape=jax.ShapeDtypeStruct(shape, jnp.int32),
                       grid=(num_tokens, num_heads),
                       num_warps=geometry.select_num_warps(num_tokens * num_heads, max_blocks), num_stages=1,
                       **geometry.select_constexprs(topk=topk, init_blocks=init_blocks, local_blocks=local_blocks,
                                                    max_blocks=max_blocks))


def _index_scores(idx_q, index_k, block_table, seq_lens, decode_query_len):
    """Launch only (inputs validated); ``index_k`` is a PagedView -> scores [Hi, T, max_blocks] f32."""
    tile = geometry.row_tile(idx_q.shape[1], decode_query_len)
    tile_map, _ = decode_maps(block_table.shape[0], decode_query_len, tile.tokens_per_tile)
    return launch_index_scores(idx_q, index_k, block_table, seq_lens, tile_map=tile_map, tile=tile)


def index_scores(idx_q, index_k_cache, block_table, seq_lens, *, decode_query_len):
    """Per-block causal max of ``idx_q . index_k`` -> scores ``[Hi, T, max_blocks]`` float32.

    idx_q [T, Hi, Di]; index_k_cache [pages, 128, Di] (array or PagedView);
    block_table [R, max_blocks] int32; seq_lens [R] int32. ``-inf`` past each
    token's visible blocks.
    """
    index_k = as_index_k_view(index_k_cache)
    num_requests, _ = validate.check_metadata(block_table, seq_lens)
    validate.check_index_inputs(idx_q, index_k)
    validate.check_tokens("idx_q", idx_q, num_requests, decode_query_len)
    return _index_scores(idx_q, index_k, block_table, seq_lens, decode_query_len)


# -- select_blocks -----------------------------------------------------------------

def _select_blocks(scores, seq_lens, decode_query_len, topk, init_blocks, local_blocks):
    _, token_map = decode_maps(seq_lens.shape[0], decode_query_len, 1)
    return launch_select_blocks(scores, seq_lens, token_map=token_map, topk=topk, init_blocks=init_blocks,
                                local_blocks=local_blocks)


def select_blocks(scores, seq_lens, *, decode_query_len, topk=16, init_blocks=0, local_blocks=1):
    """Top-``topk`` blocks per (index head, token) -> ``[Hi, T, topk]`` int32.

    Forced: the first ``init_blocks`` and last ``local_blocks`` visible blocks;
    the rest by score (ties: lower id; NaN loses). Ids ascending, then -1.
    """
    validate.check_select_inputs(scores, seq_lens, decode_query_len, topk, init_blocks, local_blocks)
    return _select_blocks(scores, seq_lens, decode_query_len, topk, init_blocks, local_blocks)


# -- sparse_decode / dense_decode --------------------------------------------------

def launch_attention(q, k, v, block_ids, block_table, seq_lens, *, tile_map, tile, sm_scale, sparse,
                     allow_split=True):
    """Paged attention kernel (+ split merge) over ``tile_map``'s rows -> out [T, Hq, D] in q's dtype.

    ``k``/``v``: logical HND PagedViews. Split-K partials are extra outputs of
    the attention call that feed the merge call.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, max_blocks = k.shape[1], block_table.shape[1]
    topk = block_ids.shape[2] if sparse else 0
    plan = geometry.attention_plan(tile=tile, num_tiles=tile_map.shape[0], num_kv_heads=num_kv_heads,
                                   head_dim=head_dim, topk=topk, max_blocks=max_blocks, sparse=sparse,
                                   allow_split=allow_split)
    out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    out_strides = _strides(q.shape)
    partial_shapes = plan.partial_shapes(num_tokens, num_q_heads, head_dim)
    if partial_shapes is None:
        # the kernel writes out itself; its lse output is never touched (torch passes out again)
        outs = [out_shape, jax.ShapeDtypeStruct((1,), q.dtype)]
        o_strides = (*out_strides[:2], 0, out_strides[2])
    else:
        outs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in partial_shapes]  # partial out, lse
        o_strides = geometry.partial_out_strides(num_q_heads, plan.num_splits, head_dim)
    ids = block_ids if sparse else block_table  # dense: never read
    args = geometry.attention_args(
        q=q, k=k.buffer, v=v.buffer, block_ids=ids, block_table=block_table, seq_lens=seq_lens, tile_map=tile_map,
        sm_scale=sm_scale, k_off=k.offset, v_off=v.offset, q_strides=_strides(q.shape), k_strides=k.strides,
        v_strides=v.strides, ids_strides=_strides(ids.shape) if sparse else (0, 0, 0),
        bt_strides=_strides(block_table.shape), o_strides=o_strides)
    target, lse = triton_call(*args, kernel=_ATTENTION, out_shape=outs,
                              grid=(plan.num_splits, plan.num_tiles, num_kv_heads), num_warps=plan.num_warps,
                              num_stages=plan.num_stages,
                              **plan.constexprs(num_q_heads=num_q_heads, head_dim=head_dim, topk=topk,
                                                sparse=sparse))
    if partial_shapes is None:
        return target
    return triton_call(target, lse, *out_strides, kernel=_MERGE, out_shape=out_shape,
                       grid=(num_tokens, num_q_heads), num_warps=4, num_stages=1,
                       **geometry.merge_constexprs(num_q_heads, head_dim, plan.num_splits))


def _decode_attention(q, k, v, block_ids, block_table, seq_lens, decode_query_len, sm_scale, sparse):
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    tile = geometry.decode_tile(num_q_heads // num_kv_heads, decode_query_len, sparse,
                                max_blocks=block_table.shape[1], topk=block_ids.shape[2] if sparse else 0)
    tile_map, _ = decode_maps(block_table.shape[0], decode_query_len, tile.tokens_per_tile)
    return launch_attention(q, k, v, block_ids, block_table, seq_lens, tile_map=tile_map, tile=tile,
                            sm_scale=sm_scale, sparse=sparse)


def _check_attention(q, k_cache, v_cache, block_table, seq_lens, decode_query_len, kv_layout, block_ids=None):
    """-> (k view, v view, head_dim)."""
    k = as_kv_view(k_cache, kv_layout, "k_cache")
    v = as_kv_view(v_cache, kv_layout, "v_cache")
    num_requests, _ = validate.check_metadata(block_table, seq_lens)
    _, num_kv_heads, head_dim = validate.check_kv_caches(q, k, v)
    validate.check_tokens("q", q, num_requests, decode_query_len)
    if block_ids is not None:
        validate.check_block_ids(block_ids, num_kv_heads, q.shape[0])
    return k, v, head_dim


def _scale(sm_scale, head_dim):
    return head_dim ** -0.5 if sm_scale is None else float(sm_scale)


def sparse_decode(q, k_cache, v_cache, block_ids, block_table, seq_lens, *, decode_query_len, sm_scale=None,
                  kv_layout="HND"):
    """Block-sparse GQA decode attention -> ``[T, Hq, D]`` in q's dtype.

    q [T, Hq, D]; k_cache/v_cache: arrays in ``kv_layout`` or PagedViews;
    block_ids [Hk, T, topk] int32 (-1 skipped, distinct per row); block_table [R, max_blocks]
    int32; seq_lens [R] int32.
    """
    k, v, head_dim = _check_attention(q, k_cache, v_cache, block_table, seq_lens, decode_query_len, kv_layout,
                                      block_ids)
    return _decode_attention(q, k, v, block_ids, block_table, seq_lens, decode_query_len,
                             _scale(sm_scale, head_dim), sparse=True)


def dense_decode(q, k_cache, v_cache, block_table, seq_lens, *, decode_query_len, sm_scale=None, kv_layout="HND"):
    """Paged GQA decode attention over every visible block -> ``[T, Hq, D]``."""
    k, v, head_dim = _check_attention(q, k_cache, v_cache, block_table, seq_lens, decode_query_len, kv_layout)
    return _decode_attention(q, k, v, None, block_table, seq_lens, decode_query_len, _scale(sm_scale, head_dim),
                             sparse=False)


# -- msa_decode -----------------------------------------------------------------------

def msa_decode(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, *, decode_query_len, topk=16,
               init_blocks=0, local_blocks=1, sm_scale=None, kv_layout="HND"):
    """``index_scores`` -> ``select_blocks`` -> ``sparse_decode``; returns ``(out, block_ids)``.

    out [T, Hq, D] in q's dtype; block_ids [Hk, T, topk] int32. The scores are
    an intermediate of the jitted computation (XLA reuses its buffer).
    """
    validate.check_selection_args(topk, init_blocks, local_blocks)
    index_k = as_index_k_view(index_k_cache)
    num_requests, _ = validate.check_metadata(block_table, seq_lens)
    num_index_heads, _ = validate.check_index_inputs(idx_q, index_k)
    validate.check_tokens("idx_q", idx_q, num_requests, decode_query_len)
    k, v, head_dim = _check_attention(q, k_cache, v_cache, block_table, seq_lens, decode_query_len, kv_layout)
    validate.check_index_heads(num_index_heads, k.shape[1])
    scores = _index_scores(idx_q, index_k, block_table, seq_lens, decode_query_len)
    block_ids = _select_blocks(scores, seq_lens, decode_query_len, topk, init_blocks, local_blocks)
    out = _decode_attention(q, k, v, block_ids, block_table, seq_lens, decode_query_len,
                            _scale(sm_scale, head_dim), sparse=True)
    return out, block_ids
