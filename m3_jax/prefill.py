"""JAX launchers of the shared kernels for prefill (mirror of ``m3_torch/prefill.py``).

Same kernels and geometry as ``m3_torch.prefill`` (so the two frameworks give
bit-identical results), launched through :func:`triton_call`. The row maps
come from the framework-neutral planner (``m3_kernels.planner``, numpy, host
side) and reach the kernels as int32 arrays:

* ``cu_seqlens_q=`` host offsets ``[R + 1]`` (numpy, a list, or a concrete jax
  array; never a tracer), read once into a :class:`PrefillPlan`; or
* ``plan=`` a :class:`m3_kernels.planner.PrefillPlan` (its maps become
  constants; cached on the plan), or a :class:`PrefillMaps` (below): the maps
  as pytree leaves, so under ``jax.jit`` a new batch with the same padded
  shapes (T, R, tile geometry) reuses the compiled step.

JAX style as in ``m3_jax.decode``: no ``out=``; K/V caches are arrays in
``kv_layout`` or PagedViews; the index-K cache an array or a PagedView.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from m3_kernels import geometry, planner, validate

from .decode import launch_attention, launch_index_scores, launch_select_blocks
from .views import as_index_k_view, as_kv_view

__all__ = ["PrefillMaps", "prefill_maps", "index_scores_prefill", "select_blocks_prefill", "sparse_prefill",
           "dense_prefill", "msa_prefill"]

@jax.tree_util.register_pytree_node_class
class PrefillMaps:
    """A prefill plan's maps as pytree leaves + their static geometry.

    token_map:  [T, 2] int32 (select_blocks).
    tile_maps:  one [num_tiles, 4] int32 per head count in ``heads`` (GROUP for
                attention, Hi for the indexer), padded to the planner's bound.
    Static: ``num_rows``, ``num_tokens``, ``heads`` and each one's RowTile.
    :func:`prefill_maps` gives host (numpy) leaves: as a ``jit`` argument they
    are traced; ``jax.device_put(maps)`` once per step keeps them on the device
    for eager calls.
    """

    __slots__ = ("token_map", "tile_maps", "num_rows", "num_tokens", "heads", "row_tiles")

    def __init__(self, token_map, tile_maps, *, num_rows, num_tokens, heads, row_tiles):
        self.token_map, self.tile_maps = token_map, tuple(tile_maps)
        self.num_rows, self.num_tokens = int(num_rows), int(num_tokens)
        self.heads, self.row_tiles = tuple(heads), tuple(row_tiles)

    def tile(self, heads):
        """-> (RowTile, tile_map) for ``heads`` heads per token."""
        if heads not in self.heads:
            raise ValueError(f"plan: these PrefillMaps hold tiles for {self.heads} heads per token, not {heads}; "
                             f"build them with prefill_maps(..., heads=(..., {heads}))")
        i = self.heads.index(heads)
        return self.row_tiles[i], self.tile_maps[i]

    def tree_flatten(self):
        return (self.token_map, *self.tile_maps), (self.num_rows, self.num_tokens, self.heads, self.row_tiles)

    @classmethod
    def tree_unflatten(cls, aux, children):
        num_rows, num_tokens, heads, row_tiles = aux
        return cls(children[0], children[1:], num_rows=num_rows, num_tokens=num_tokens, heads=heads,
                   row_tiles=row_tiles)


def prefill_maps(plan, heads) -> PrefillMaps:
    """PrefillMaps of ``plan`` (a PrefillPlan, or host ``cu_seqlens_q``) for the head counts ``heads``.

    Built once per (plan, heads) and cached on the plan. The leaves are numpy
    arrays, never jax arrays: a cached jax array made while tracing would leak
    the tracer into later calls.
    """
    if not isinstance(plan, planner.PrefillPlan):
        plan = _plan_from_cu(plan)
    heads = tuple(sorted({int(h) for h in heads}))

    def build():
        tiles = [plan.tiles(h) for h in heads]
        return PrefillMaps(plan.token_map, [m for _, m in tiles], num_rows=plan.num_rows,
                           num_tokens=plan.num_tokens, heads=heads, row_tiles=[t for t, _ in tiles])

    return plan.memo(("jax", heads), build)


def _plan_from_cu(cu_seqlens_q) -> planner.PrefillPlan:
    if isinstance(cu_seqlens_q, jax.core.Tracer):
        raise TypeError("cu_seqlens_q: a traced array cannot be read on the host; under jax.jit pass "
                        "plan=prefill_maps(planner.prefill_plan(cu_host), heads) as an argument instead")
    return planner.prefill_plan(np.asarray(cu_seqlens_q))


def _maps(cu_seqlens_q, plan, heads) -> PrefillMaps:
    if isinstance(plan, PrefillMaps):
        return plan
    if plan is None:
        if cu_seqlens_q is None:
            raise ValueError("cu_seqlens_q: required unless plan= is given")
        plan = _plan_from_cu(cu_seqlens_q)
    return prefill_maps(plan, heads)


def _check_cu(cu_seqlens_q, num_requests):
    """cu_seqlens_q: [R + 1] int32 array, or a host sequence of R + 1 ints."""
    if cu_seqlens_q is None:
        return
    if not hasattr(cu_seqlens_q, "shape"):
        cu_seqlens_q = np.asarray(cu_seqlens_q, np.int32)
    validate.check_rank("cu_seqlens_q", cu_seqlens_q, 1, "[R + 1]")
    validate.check_dtype("cu_seqlens_q", cu_seqlens_q, "int32")
    validate.check_dim("cu_seqlens_q", cu_seqlens_q, 0, num_requests + 1, "R + 1 (rows of block_table + 1)")


# -- launches (inputs validated) -------------------------------------------------------

def launch_varlen_attention(q, k, v, block_ids, block_table, seq_lens, *, tile_map, tile, sm_scale, sparse):
    """Paged attention over prefill row tiles -> out [T, Hq, D] in q's dtype (zeros for an empty map)."""
    if tile_map.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    return launch_attention(q, k, v, block_ids, block_table, seq_lens, tile_map=tile_map, tile=tile,
                            sm_scale=sm_scale, sparse=sparse)


# -- public ops ------------------------------------------------------------------------

def _check_plan(name, x, maps, num_requests, axis=0):
    validate.check_prefill_plan(name, x, maps, num_requests, axis)


def index_scores_prefill(idx_q, index_k_cache, block_table, seq_lens, *, cu_seqlens_q=None, plan=None):
    """Per-block causal max of ``idx_q . index_k`` for every query token -> ``[Hi, T, max_blocks]`` float32.

    idx_q [T, Hi, Di]; index_k_cache [pages, 128, Di] (array or PagedView);
    block_table [R, max_blocks] int32; seq_lens [R] int32; cu_seqlens_q
    [R + 1] host ints (or ``plan``). ``-inf`` past each token's visible blocks.
    """
    index_k = as_index_k_view(index_k_cache)
    num_requests, _ = validate.check_metadata(block_table, seq_lens)
    _check_cu(cu_seqlens_q, num_requests)
    num_heads, _ = validate.check_index_inputs(idx_q, index_k)
    maps = _maps(cu_seqlens_q, plan, (num_heads,))
    _check_plan("idx_q", idx_q, maps, num_requests)
    tile, tile_map = maps.tile(num_heads)
    return launch_index_scores(idx_q, index_k, block_table, seq_lens, tile_map=tile_map, tile=tile)


def select_blocks_prefill(scores, seq_lens, *, cu_seqlens_q=None, topk=16, init_blocks=0, local_blocks=1, plan=None):
    """Top-``topk`` blocks per (index head, token) -> ``[Hi, T, topk]`` int32; decode's rules per token."""
    validate.check_selection_args(topk, init_blocks, local_blocks)
    validate.check_rank("seq_lens", seq_lens, 1, "[R]")
    validate.check_dtype("seq_lens", seq_lens, "int32")
    num_requests = int(seq_lens.shape[0])
    _check_cu(cu_seqlens_q, num_requests)
    validate.check_rank("scores", scores, 3, "[Hi, T, max_blocks]")
    validate.check_dtype("scores", scores, "float32")
    maps = _maps(cu_seqlens_q, plan, ())
    _check_plan("scores", scores, maps, num_requests, axis=1)
    return launch_select_blocks(scores, seq_lens, token_map=maps.token_map, topk=topk, init_blocks=init_blocks,
                                local_blocks=local_blocks)


def _check_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, plan, kv_layout, block_ids=None):
    """-> (k view, v view, head_dim, maps)."""
    k = as_kv_view(k_cache, kv_layout, "k_cache")
    v = as_kv_view(v_cache, kv_layout, "v_cache")
    num_requests, _ = validate.check_metadata(block_table, seq_lens)
    _check_cu(cu_seqlens_q, num_requests)
    num_q_heads, num_kv_heads, head_dim = validate.check_kv_caches(q, k, v)
    if block_ids is not None:
        validate.check_block_ids(block_ids, num_kv_heads, q.shape[0])
    maps = _maps(cu_seqlens_q, plan, (num_q_heads // num_kv_heads,))
    _check_plan("q", q, maps, num_requests)
    return k, v, head_dim, maps


def _scale(sm_scale, head_dim):
    return head_dim ** -0.5 if sm_scale is None else float(sm_scale)


def _attention(q, k, v, block_ids, block_table, seq_lens, maps, sm_scale, sparse):
    tile, tile_map = maps.tile(q.shape[1] // k.shape[1])
    return launch_varlen_attention(q, k, v, block_ids, block_table, seq_lens, tile_map=tile_map, tile=tile,
                                   sm_scale=sm_scale, sparse=sparse)


def sparse_prefill(q, k_cache, v_cache, block_ids, block_table, seq_lens, *, cu_seqlens_q=None, sm_scale=None,
                   plan=None, kv_layout="HND"):
    """Block-sparse GQA attention, each token over its own blocks -> ``[T, Hq, D]`` in q's dtype.

    Causal inside every block (the diagonal one included). Arguments as in
    ``m3_torch.sparse_prefill``; K/V arrays in ``kv_layout`` or PagedViews.
    """
    k, v, head_dim, maps = _check_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, plan,
                                            kv_layout, block_ids)
    return _attention(q, k, v, block_ids, block_table, seq_lens, maps, _scale(sm_scale, head_dim), sparse=True)


def dense_prefill(q, k_cache, v_cache, block_table, seq_lens, *, cu_seqlens_q=None, sm_scale=None, plan=None,
                  kv_layout="HND"):
    """Causal paged GQA attention over every visible block (layers 0-2) -> ``[T, Hq, D]``."""
    k, v, head_dim, maps = _check_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, plan,
                                            kv_layout)
    return _attention(q, k, v, None, block_table, seq_lens, maps, _scale(sm_scale, head_dim), sparse=False)


def msa_prefill(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, *, cu_seqlens_q=None, topk=16,
                init_blocks=0, local_blocks=1, sm_scale=None, plan=None, kv_layout="HND"):
    """``index_scores_prefill`` -> ``select_blocks_prefill`` -> ``sparse_prefill``; returns ``(out, block_ids)``."""
    validate.check_selection_args(topk, init_blocks, local_blocks)
    index_k = as_index_k_view(index_k_cache)
    num_index_heads, _ = validate.check_index_inputs(idx_q, index_k)
    k, v = as_kv_view(k_cache, kv_layout, "k_cache"), as_kv_view(v_cache, kv_layout, "v_cache")
    num_q_heads, num_kv_heads, _ = validate.check_kv_caches(q, k, v)
    validate.check_index_heads(num_index_heads, num_kv_heads)
    _check_cu(cu_seqlens_q, int(block_table.shape[0]))
    maps = _maps(cu_seqlens_q, plan, (num_q_heads // num_kv_heads, num_index_heads))
    k, v, head_dim, maps = _check_attention(q, k, v, block_table, seq_lens, None, maps, kv_layout)
    _check_plan("idx_q", idx_q, maps, int(block_table.shape[0]))
    tile, tile_map = maps.tile(num_index_heads)
    scores = launch_index_scores(idx_q, index_k, block_table, seq_lens, tile_map=tile_map, tile=tile)
    block_ids = launch_select_blocks(scores, seq_lens, token_map=maps.token_map, topk=topk,
                                     init_blocks=init_blocks, local_blocks=local_blocks)
    out = _attention(q, k, v, block_ids, block_table, seq_lens, maps, _scale(sm_scale, head_dim), sparse=True)
    return out, block_ids
