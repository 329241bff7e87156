"""JAX side of the flat sub-page pool: allocation, per-layer views, cache writes.

A pool is a 1-D jax array of ``layout.numel`` elements
(``m3_kernels.pool.PoolLayout``). ``layer_views`` describes a layer's caches as
:class:`~m3_jax.views.PagedView` objects over that one buffer (offset +
strides, nothing sliced or copied); every decode op accepts them, and
``block_table`` holds slot ids. A pool with FP8 caches is a byte (uint8)
buffer; each view reads it as its cache's dtype (``PagedView.dtype``).

``write_cache`` appends a step's new rows through the shared
``cache_write_kernel``, with the pool as an input aliased to the kernel's
output. Under ``jax.jit`` with the pool donated (``donate_argnums``) XLA
writes the rows into the same buffer in place; without donation it first
copies the pool (JAX semantics are functional either way). A buffer that a
DLPack consumer (e.g. a torch tensor from ``m3_jax.interop.to_torch``) still
references, or one imported from torch, is never donated: JAX silently copies
it. Write a torch-owned pool from torch (``m3_torch.write_cache``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from m3_kernels import launches, validate
from m3_kernels.pool import PoolLayout, SubPageView

from . import guards
from ._triton_call import on_gpu
from .ops import kv_scales, operand, run
from .views import PagedView, as_index_k_view, as_kv_view

__all__ = ["LayerViews", "allocate_pool", "check_pool", "sub_page_view", "layer_views", "write_cache",
           "write_layer"]

class LayerViews(NamedTuple):
    k_cache: PagedView                   # [num_slots, Hk, 128, D]
    v_cache: PagedView                   # [num_slots, Hk, 128, D]
    index_k_cache: Optional[PagedView]   # [num_slots, 128, Di]; None for a dense layer


def allocate_pool(layout: PoolLayout, device=None) -> jax.Array:
    """A zero-filled pool: 1-D ``[layout.numel]`` of ``layout.buffer_dtype`` (on ``device`` if given)."""
    pool = jnp.zeros(layout.shape, dtype=jnp.dtype(layout.buffer_dtype))
    return pool if device is None else jax.device_put(pool, device)


def check_pool(pool, layout: PoolLayout):
    if tuple(pool.shape) != layout.shape:
        raise ValueError(f"pool: expected shape {layout.shape} from the layout, got {tuple(pool.shape)}")
    if jnp.dtype(pool.dtype) != jnp.dtype(layout.buffer_dtype):
        raise TypeError(f"pool: expected dtype {layout.buffer_dtype} from the layout, got {pool.dtype}")


def sub_page_view(pool, view: SubPageView) -> PagedView:
    return PagedView(pool, view.offset, view.shape, view.strides, view.dtype)


def layer_views(pool, layout: PoolLayout, layer: int) -> LayerViews:
    """Layer ``layer``'s caches as PagedViews of ``pool`` (1-D, ``layout.numel`` elements)."""
    check_pool(pool, layout)
    lv = layout.layer(layer)
    index_k = None if lv.index_k is None else sub_page_view(pool, lv.index_k)
    return LayerViews(sub_page_view(pool, lv.k), sub_page_view(pool, lv.v), index_k)


def _launch(k, v, index_k, slot_mapping, buffer, views, scales):
    """One kernel launch writing the caches in ``views`` (name -> PagedView, all over ``buffer``)."""
    launch = launches.write_cache(
        k=operand(k), v=operand(v), index_k=None if index_k is None else operand(index_k),
        slot_mapping=slot_mapping, pool=buffer, pool_shape=buffer.shape, pool_dtype=str(buffer.dtype),
        **{f"{name}_cache": operand(views[key]) if key in views else None
           for name, key in (("k", "k"), ("v", "v"), ("index_k", "index"))}, interpret=not on_gpu(),
        k_scale=scales[0], v_scale=scales[1])
    return run(launch)["pool"]


def write_cache(k, v, index_k, k_cache, v_cache, index_k_cache, slot_mapping, *, kv_layout="HND", k_scale=None,
                v_scale=None):
    """Write token ``t``'s rows to row ``slot_mapping[t] % 128`` of page ``slot_mapping[t] // 128``.

    k, v [T, Hk, D] and index_k [T, Di] (None for a dense layer) in the model's
    dtype; k_cache/v_cache: PagedViews (``layer_views``) or arrays in
    ``kv_layout``; index_k_cache: PagedView or ``[slots, 128, Di]`` array (None
    for a dense layer); caches of k's dtype or float8_e4m3fn; slot_mapping [T]
    int32, ``-1`` skips a token. FP8 caches store ``saturate(x / scale)``
    rounded to nearest even: K/V with ``k_scale``/``v_scale`` (None: 1.0, a
    float, or a float32 scalar array), index-K unscaled.

    Returns ``(k_cache, v_cache, index_k_cache)`` updated, each of the kind it
    was given: PagedViews over the new buffer, or arrays. Views over one buffer
    (a pool layer) take one kernel launch; the new pool is ``.buffer`` of any
    returned view. Nothing else in the buffers changes.
    """
    given = {"k": k_cache, "v": v_cache, "index": index_k_cache}
    views = {"k": as_kv_view(k_cache, kv_layout, "k_cache"), "v": as_kv_view(v_cache, kv_layout, "v_cache")}
    if index_k_cache is not None:
        views["index"] = as_index_k_view(index_k_cache)
    num_tokens = validate.check_cache_write(k, v, index_k, views["k"], views["v"], views.get("index"),
                                            slot_mapping, k_scale, v_scale)
    slot_mapping = guards.check_call("write_cache", k=k, v=v, index_k=index_k, k_cache=views["k"], v_cache=views["v"],
                                     index_k_cache=views.get("index"), slot_mapping=slot_mapping)
    if num_tokens == 0:
        return k_cache, v_cache, index_k_cache
    groups: list = []   # [(buffer, {name: view})], one per distinct buffer object
    for name, view in views.items():
        for buffer, members in groups:
            if buffer is view.buffer:
                members[name] = view
                break
        else:
            groups.append((view.buffer, {name: view}))
    scales = kv_scales(views["k"], k_scale, v_scale)
    new = {}
    for buffer, members in groups:
        out = _launch(k, v, index_k, slot_mapping, buffer, members, scales)
        for name, view in members.items():
            new[name] = (PagedView(out, view.offset, view.shape, view.strides, view.dtype)
                         if isinstance(given[name], PagedView) else out)
    return new["k"], new["v"], new.get("index")


def write_layer(pool, layout: PoolLayout, layer: int, k, v, index_k, slot_mapping, *, k_scale=None, v_scale=None):
    """``write_cache`` into layer ``layer`` of ``pool`` -> the new pool (same buffer when donated under jit)."""
    views = layer_views(pool, layout, layer)
    new_k, _, _ = write_cache(k, v, index_k, *views, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return new_k.buffer
