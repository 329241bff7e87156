"""The JAX side of the launch layer: ``run(launch)`` and the maps as device constants.

``run`` executes an ``m3_kernels.launches.Launch`` (and the launches chained
after it), every kernel of the package: through ``jax_triton.triton_call`` on
a GPU backend, through the same kernel in Triton's interpreter inside
``jax.pure_callback`` on a CPU backend (``m3_jax._triton_call``). Outputs are new arrays (an aliased input
is updated in place when donated under ``jax.jit``). Geometry depends on
shapes only, so new lengths, tables or queries never recompile a jitted step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from m3_kernels import launches, maps, planner, validate
from m3_kernels.launches import Operand, Prev

from ._triton_call import cpu_call, gpu_call, on_gpu
from .views import PagedView


def operand(x) -> Operand:
    """A jax array (dense, row-major) or a PagedView as the kernels read it."""
    if isinstance(x, PagedView):
        return Operand(x.buffer, x.offset, x.shape, x.strides, x.dtype.name)
    return Operand(x, 0, tuple(x.shape), maps.contiguous_strides(x.shape), jnp.dtype(x.dtype).name)


def check_kv_layout(k_cache, v_cache) -> None:
    """The K/V caches' (arrays or PagedViews) offset and stride rule (``validate.check_cache_layout``), for the
    MSA ops to check before their first launch: their attention launch checks it too, but only after the
    indexer's launches."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        kv = operand(cache)
        validate.check_cache_layout(name, kv.offset, kv.strides)


def strides(shape) -> tuple:
    """Strides of the dense row-major outputs JAX allocates."""
    return maps.contiguous_strides(shape)


def kv_scales(k_cache, k_scale, v_scale):
    """(k_scale, v_scale) as the kernels read them: float32 arrays for an FP8 K/V cache
    (None is 1.0), (None, None) for any other."""
    if validate.dtype_name(k_cache) != validate.FP8:
        return None, None
    return tuple(jnp.ones((), jnp.float32) if s is None else jnp.asarray(s, jnp.float32) for s in (k_scale, v_scale))


def run(launch: launches.Launch) -> dict:
    """-> ``{output name: array}`` of ``launch`` and the launches chained after it (unused outputs omitted)."""
    results, done = {}, []   # done: each earlier launch's outputs, for Prev
    call = gpu_call if on_gpu() else cpu_call
    while launch is not None:
        shapes = [jax.ShapeDtypeStruct(o.shape, jnp.dtype(o.dtype)) for o in launch.outputs]
        args = [done[-a.back][a.index] if isinstance(a, Prev) else a for a in launch.args]
        if launch.empty:
            outs = [jnp.zeros(s.shape, s.dtype) for s in shapes]
        else:
            module, fn = launch.kernel.split(".")
            outs = call(args, module, fn, shapes, launch.grid, launch.num_warps, launch.num_stages,
                        dict(launch.aliases), launch.constexprs)
        results.update((o.name, x) for o, x in zip(launch.outputs, outs) if not o.unused)
        done.append(outs)
        launch = launch.then
    return results


@functools.lru_cache(maxsize=256)
def decode_maps(num_requests: int, decode_query_len: int, tokens_per_tile: int):
    """(tile_map, token_map) of a decode batch: numpy constants, embedded once per shape."""
    return maps.decode_maps(num_requests, decode_query_len, tokens_per_tile)


@jax.tree_util.register_pytree_node_class
class PrefillMaps:
    """A prefill plan's maps as pytree leaves + their static geometry.

    token_map:  [T, 2] int32 (select_blocks).
    tile_maps:  one [num_tiles, 4] int32 per head count in ``heads`` (GROUP for
                attention, Hi for the indexer) and tile kind (``planner.TILE_KINDS``),
                padded to the planner's bounds.
    Static: ``num_rows``, ``num_tokens``, ``heads`` and each one's RowTile, so a
    new batch with the same padded shapes reuses a jitted step.
    :func:`prefill_maps` gives host (numpy) leaves: as a ``jit`` argument they
    are traced; ``jax.device_put(maps)`` once per step keeps them on the device
    for eager calls.
    """
    __slots__ = ("token_map", "tile_maps", "num_rows", "num_tokens", "heads", "row_tiles")

    def __init__(self, token_map, tile_maps, *, num_rows, num_tokens, heads, row_tiles):
        self.token_map, self.tile_maps = token_map, tuple(tile_maps)
        self.num_rows, self.num_tokens = int(num_rows), int(num_tokens)
        self.heads, self.row_tiles = tuple(heads), tuple(row_tiles)

    def tile(self, heads, kind="attention"):
        """-> (RowTile, tile_map) for ``heads`` heads per token (``kind``: of ``PrefillPlan.tiles``)."""
        if heads not in self.heads:
            raise ValueError(f"plan: these PrefillMaps hold tiles for {self.heads} heads per token, not {heads}; "
                             f"build them with prefill_maps(..., heads=(..., {heads}))")
        i = len(planner.TILE_KINDS) * self.heads.index(heads) + planner.TILE_KINDS.index(kind)
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
        if isinstance(plan, jax.core.Tracer):
            raise TypeError("cu_seqlens_q: a traced array cannot be read on the host; under jax.jit pass "
                            "plan=prefill_maps(planner.prefill_plan(cu_host), heads) as an argument instead")
        plan = planner.prefill_plan(np.asarray(plan))
    heads = tuple(sorted({int(h) for h in heads}))

    def build():
        tiles = [plan.tiles(h, kind) for h in heads for kind in planner.TILE_KINDS]
        return PrefillMaps(plan.token_map, [m for _, m in tiles], num_rows=plan.num_rows,
                           num_tokens=plan.num_tokens, heads=heads, row_tiles=[t for t, _ in tiles])
    return plan.memo(("jax", heads), build)
