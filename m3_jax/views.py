"""Strided views into flat JAX buffers, so caches reach the kernels without a copy.

JAX arrays are dense and row-major: they have no strides and no offset. The
kernels take every cache as (pointer, element offset, strides), so a
:class:`PagedView` carries exactly that next to the buffer it points into:

    element (i0, i1, ...) of the view = buffer.reshape(-1)[offset + i0*s0 + i1*s1 + ...]

Uses:

* a plain K/V cache stored HND ``[pages, Hk, 128, D]`` or NHD
  ``[pages, 128, Hk, D]``: :func:`kv_cache_view` gives the logical HND view
  ``[pages, Hk, 128, D]`` (for NHD: strides of the permuted store);
* the index-K cache ``[pages, 128, Di]``: :func:`index_k_view`;
* a flat sub-page pool (one buffer, every layer's K/V/index-K sub-pages at
  their own offsets and strides): build a ``PagedView(pool, offset, shape,
  strides)`` per layer; ``block_table`` then holds slot ids.

A view may read its buffer as another dtype (``dtype=``): a pool with FP8
caches is a byte (uint8) buffer holding bf16 and float8_e4m3fn sub-pages, and
each view counts its offset and strides in its own elements; the kernels
reinterpret the buffer's pointer, nothing is converted or copied.

A PagedView is a pytree whose only leaf is ``buffer``; ``offset``, ``shape``,
``strides`` and ``dtype`` are static aux data. It passes through ``jax.jit``
(changing the buffer's values never recompiles; changing the layout does), and
it exposes the logical ``.shape``/``.dtype`` that ``m3_kernels.validate`` reads.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from m3_kernels.maps import contiguous_strides

__all__ = ["PagedView", "kv_cache_view", "index_k_view", "as_kv_view", "as_index_k_view", "KV_LAYOUTS"]

KV_LAYOUTS = ("HND", "NHD")


@jax.tree_util.register_pytree_node_class
class PagedView:
    """A logical strided view of ``shape`` into the flat elements of ``buffer``.

    buffer:  any jax array (numpy arrays are converted); read as its flat,
             row-major elements, whatever its own shape.
    offset:  element offset of the view's element (0, ..., 0) in the flat buffer.
    shape:   logical shape of the view.
    strides: element strides of the view, one per axis (>= 0).
    dtype:   the view's element type (default: the buffer's); offset and strides
             count its elements, in the buffer's bytes read as that type.
    """

    __slots__ = ("buffer", "offset", "shape", "strides", "dtype")

    def __init__(self, buffer, offset, shape, strides, dtype=None):
        if not hasattr(buffer, "shape") or not hasattr(buffer, "dtype"):
            raise TypeError(f"PagedView: buffer must be an array, got {type(buffer).__name__}")
        shape = tuple(int(s) for s in shape)
        strides = tuple(int(s) for s in strides)
        offset = int(offset)
        dtype = jnp.dtype(buffer.dtype if dtype is None else dtype)
        if len(shape) != len(strides):
            raise ValueError(f"PagedView: shape {shape} and strides {strides} differ in rank")
        if offset < 0 or any(s < 0 for s in shape) or any(s < 0 for s in strides):
            raise ValueError(f"PagedView: offset, shape and strides must be >= 0, got {offset}, {shape}, {strides}")
        nbytes = math.prod(int(s) for s in buffer.shape) * jnp.dtype(buffer.dtype).itemsize
        size = nbytes // dtype.itemsize   # the buffer's elements, read as dtype
        if math.prod(shape) > 0:
            last = offset + sum((n - 1) * s for n, s in zip(shape, strides))
            if last >= size:
                raise ValueError(f"PagedView: view (offset {offset}, shape {shape}, strides {strides}) reaches "
                                 f"element {last}, past the buffer's {size} elements of {dtype.name}")
        self.buffer = jnp.asarray(buffer) if isinstance(buffer, np.ndarray) else buffer
        self.offset, self.shape, self.strides, self.dtype = offset, shape, strides, dtype

    # -- array-like metadata (what m3_kernels.validate reads: .shape, .dtype) --
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self):
        return (f"PagedView(buffer={getattr(self.buffer, 'shape', '?')} {getattr(self.buffer, 'dtype', '?')}, "
                f"offset={self.offset}, shape={self.shape}, strides={self.strides}, dtype={self.dtype.name})")

    # -- pytree: the buffer is the only leaf --
    def tree_flatten(self):
        return (self.buffer,), (self.offset, self.shape, self.strides, self.dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        view = object.__new__(cls)  # no checks: jax may rebuild it around placeholders
        view.buffer, = children
        view.offset, view.shape, view.strides, view.dtype = aux
        return view

    # -- helpers --
    @classmethod
    def of_array(cls, x):
        """The whole of a dense array, as a view (offset 0, row-major strides)."""
        return cls(x, 0, x.shape, contiguous_strides(x.shape))

    def to_array(self):
        """Gather the view into a dense jax array of ``shape`` (a copy; for references and tests)."""
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.strides))
        if last >= 2**31:
            raise ValueError(f"PagedView.to_array: element {last} is past int32 indexing")
        # built from iotas (no large host constant under jit)
        index = jnp.full(self.shape, self.offset, dtype=jnp.int32)
        for axis, (n, s) in enumerate(zip(self.shape, self.strides)):
            index = index + jax.lax.broadcasted_iota(jnp.int32, self.shape, axis) * s
        return _flat_as(self.buffer, self.dtype)[index]


def _flat_as(buffer, dtype):
    """The flat elements of ``buffer``, its bytes read as ``dtype`` (a bitcast, no conversion)."""
    flat = jnp.reshape(buffer, (-1,))
    if flat.dtype == dtype:
        return flat
    ratio = dtype.itemsize // flat.dtype.itemsize
    if ratio > 1:   # e.g. bytes -> bfloat16: pairs of bytes become one element
        flat = flat[:flat.shape[0] - flat.shape[0] % ratio].reshape(-1, ratio)
    return jnp.reshape(jax.lax.bitcast_convert_type(flat, dtype), (-1,))


def kv_cache_view(cache, kv_layout: str = "HND", name: str = "k_cache") -> PagedView:
    """A K or V cache array -> its logical HND view ``[pages, Hk, 128, D]``.

    ``kv_layout="HND"``: ``cache`` is ``[pages, Hk, 128, D]`` (the view is the array);
    ``kv_layout="NHD"``: ``cache`` is ``[pages, 128, Hk, D]`` (the view permutes strides).
    """
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected one of {KV_LAYOUTS}, got {kv_layout!r}")
    if len(cache.shape) != 4:
        layout = "[pages, Hk, 128, D]" if kv_layout == "HND" else "[pages, 128, Hk, D]"
        raise ValueError(f"{name}: expected rank 4 {layout} ({kv_layout}), got shape {tuple(cache.shape)}")
    strides = contiguous_strides(cache.shape)
    if kv_layout == "HND":
        return PagedView(cache, 0, cache.shape, strides)
    pages, page, heads, dim = cache.shape
    sp, sn, sh, sd = strides
    return PagedView(cache, 0, (pages, heads, page, dim), (sp, sh, sn, sd))


def index_k_view(cache) -> PagedView:
    """The index-K cache ``[pages, 128, Di]`` as a view (offset 0, row-major)."""
    return PagedView.of_array(cache)


def _check_array(name, x):
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise TypeError(f"{name}: expected a jax array or PagedView, got {type(x).__name__}")


def as_kv_view(cache, kv_layout: str = "HND", name: str = "k_cache") -> PagedView:
    """What the ops accept as a K/V cache -> a logical HND PagedView.

    A PagedView passes through unchanged (it is already logical HND;
    ``kv_layout`` describes plain arrays only).
    """
    if isinstance(cache, PagedView):
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout: expected one of {KV_LAYOUTS}, got {kv_layout!r}")
        return cache
    _check_array(name, cache)
    return kv_cache_view(cache, kv_layout, name)


def as_index_k_view(cache, name: str = "index_k_cache") -> PagedView:
    """A PagedView or a dense ``[pages, 128, Di]`` array -> PagedView."""
    if isinstance(cache, PagedView):
        return cache
    _check_array(name, cache)
    return index_k_view(cache)
