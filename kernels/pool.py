"""Flat sub-page pool: where each layer's caches live inside one buffer.

A pool is ONE flat buffer, ``num_slots`` slots long. A slot holds, for every
layer of a layer group, in layer order:

    K sub-page        [Hk, 128, D]  (HND)  or  [128, Hk, D]  (NHD)
    V sub-page        same shape as K
    index-K sub-page  [128, Di]            (sparse layers only)

so one slot id (what ``block_table`` holds) addresses the 128 tokens of one
page in every layer at once. A layer's cache is then a strided view of the
buffer: offset of slot 0's sub-page plus the logical strides of ``k_cache`` /
``v_cache`` ``[num_slots, Hk, 128, D]`` (HND order whatever the storage order)
and ``index_k_cache`` ``[num_slots, 128, Di]``. Torch builds ``as_strided``
views from them; JAX hands the whole buffer plus offset and strides to the
kernels (``k_off``/``v_off``), so no layer is ever sliced out.

Cache dtypes: K/V sub-pages hold ``kv_cache_dtype``, index-K sub-pages
``index_cache_dtype``; each is ``"auto"`` (the model's ``dtype``) or FP8
(``"float8_e4m3fn"``, alias ``"fp8"``). A pool without FP8 caches is a buffer of
the model's dtype, as before FP8; a pool with any FP8 cache is a BYTE buffer
(``uint8``) and each view reads it as its own dtype (``SubPageView.dtype``),
its offset and strides counted in its own elements. Sub-page sizes are
multiples of 2 KiB, so every view stays aligned to 16 of its elements.

Pure Python, framework-neutral: dtypes are names (``"bfloat16"``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .maps import PAGE_SIZE

KV_LAYOUTS = ("HND", "NHD")
MODEL_DTYPES = ("bfloat16", "float16", "float32")
FP8 = "float8_e4m3fn"
CACHE_DTYPE_ALIASES = {"fp8": FP8, "fp8_e4m3": FP8, FP8: FP8}
ITEM_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4, FP8: 1, "uint8": 1}


def cache_dtype(name: str, option: str, model_dtype: str) -> str:
    """A pool's ``kv_cache_dtype`` / ``index_cache_dtype`` option -> the dtype name its sub-pages hold."""
    if option in ("auto", model_dtype):
        return model_dtype
    if option in CACHE_DTYPE_ALIASES:
        return CACHE_DTYPE_ALIASES[option]
    raise TypeError(f"{name}: expected 'auto' (the model's {model_dtype}) or {FP8!r} ('fp8'), got {option!r}"
                    + (" (the only FP8 cache format is float8_e4m3fn)" if "8" in str(option) else ""))


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer of a layer group: KV heads, head dim, index head dim (None: dense layer)."""
    num_kv_heads: int
    head_dim: int
    index_head_dim: int | None = None

    @property
    def sparse(self) -> bool:
        return self.index_head_dim is not None


@dataclasses.dataclass(frozen=True)
class SubPageView:
    """One cache of one layer: ``buffer.view(dtype)[offset + sum(i * s for i, s in zip(idx, strides))]``."""
    offset: int                 # offset of slot 0's sub-page in the flat buffer, in elements of dtype
    shape: tuple[int, ...]      # logical shape, slot first
    strides: tuple[int, ...]    # logical strides, in elements of dtype
    dtype: str                  # what the cache holds (the buffer may be bytes)


@dataclasses.dataclass(frozen=True)
class LayerView:
    """A layer's caches in the pool; ``index_k`` is None for a dense layer."""
    k: SubPageView              # [num_slots, Hk, 128, D]
    v: SubPageView              # [num_slots, Hk, 128, D]
    index_k: SubPageView | None  # [num_slots, 128, Di]


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Where every layer's sub-pages sit in a flat pool of ``num_slots`` slots.

    Build with ``PoolLayout.create`` (one head config, a sparse flag per layer)
    or directly from ``LayerSpec``s. ``layer(i)`` gives layer ``i``'s views.
    ``dtype`` is the model's; ``kv_cache_dtype`` / ``index_cache_dtype`` pick
    the caches' (``"auto"``: the model's; ``"float8_e4m3fn"`` or ``"fp8"``).
    """
    num_slots: int
    layers: tuple[LayerSpec, ...]
    kv_layout: str = "HND"
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    index_cache_dtype: str = "auto"

    def __post_init__(self):
        if not isinstance(self.num_slots, int) or self.num_slots < 1:
            raise ValueError(f"num_slots: expected an int >= 1, got {self.num_slots!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout: expected one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if self.dtype not in MODEL_DTYPES:
            raise TypeError(f"dtype: expected one of {MODEL_DTYPES}, got {self.dtype!r}")
        for name in ("kv_cache_dtype", "index_cache_dtype"):   # resolved: "auto" -> the model's dtype
            object.__setattr__(self, name, cache_dtype(name, getattr(self, name), self.dtype))
        if not self.layers:
            raise ValueError("layers: a pool needs at least one layer")
        object.__setattr__(self, "layers", tuple(self.layers))
        for i, spec in enumerate(self.layers):
            if spec.num_kv_heads < 1:
                raise ValueError(f"layers[{i}].num_kv_heads: expected >= 1, got {spec.num_kv_heads}")
            for name in ("head_dim", "index_head_dim"):
                d = getattr(spec, name)
                if d is not None and (d < 16 or d > 256 or d & (d - 1)):
                    raise ValueError(f"layers[{i}].{name}: expected a power of two in [16, 256], got {d}")

    @classmethod
    def create(cls, num_slots: int, *, sparse: Sequence[bool], num_kv_heads: int, head_dim: int,
               index_head_dim: int | None = None, kv_layout: str = "HND", dtype: str = "bfloat16",
               kv_cache_dtype: str = "auto", index_cache_dtype: str = "auto") -> "PoolLayout":
        """A group of ``len(sparse)`` layers sharing one head config; ``sparse[i]``
        says whether layer ``i`` has an index-K sub-page (``index_head_dim``,
        default ``head_dim``)."""
        di = head_dim if index_head_dim is None else index_head_dim
        layers = tuple(LayerSpec(num_kv_heads, head_dim, di if s else None) for s in sparse)
        return cls(num_slots, layers, kv_layout, dtype, kv_cache_dtype, index_cache_dtype)

    # -- sizes ------------------------------------------------------------------

    @property
    def buffer_dtype(self) -> str:
        """The flat buffer's dtype: the model's, or ``"uint8"`` (bytes) when any cache is FP8."""
        return "uint8" if FP8 in (self.kv_cache_dtype, self.index_cache_dtype) else self.dtype

    def _layer_nbytes(self, spec: LayerSpec):
        """-> (bytes of a K (or V) sub-page, bytes of the index-K sub-page or 0)."""
        kv = spec.num_kv_heads * PAGE_SIZE * spec.head_dim * ITEM_SIZE[self.kv_cache_dtype]
        return kv, (PAGE_SIZE * spec.index_head_dim * ITEM_SIZE[self.index_cache_dtype] if spec.sparse else 0)

    @property
    def slot_nbytes(self) -> int:
        return sum(2 * kv + ik for kv, ik in map(self._layer_nbytes, self.layers))

    @property
    def slot_numel(self) -> int:
        """Buffer elements (of ``buffer_dtype``) of one slot (every layer's sub-pages)."""
        return self.slot_nbytes // ITEM_SIZE[self.buffer_dtype]

    @property
    def numel(self) -> int:
        """Elements (of ``buffer_dtype``) of the whole buffer."""
        return self.num_slots * self.slot_numel

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_nbytes

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def shape(self) -> tuple[int]:
        """The buffer's shape: one flat, dense, row-major axis (what DLPack moves)."""
        return (self.numel,)

    # -- views ------------------------------------------------------------------

    def layer(self, i: int) -> LayerView:
        if not -self.num_layers <= i < self.num_layers:
            raise IndexError(f"layer: {i} is out of range for a group of {self.num_layers} layers")
        i %= self.num_layers
        start = sum(2 * kv + ik for kv, ik in map(self._layer_nbytes, self.layers[:i]))   # bytes
        spec = self.layers[i]
        kv_nbytes, _ = self._layer_nbytes(spec)
        hk, d = spec.num_kv_heads, spec.head_dim
        kv_size = ITEM_SIZE[self.kv_cache_dtype]
        slot = self.slot_nbytes // kv_size   # in K/V elements
        shape = (self.num_slots, hk, PAGE_SIZE, d)
        if self.kv_layout == "HND":   # sub-page [Hk, 128, D]
            strides = (slot, PAGE_SIZE * d, d, 1)
        else:                         # sub-page [128, Hk, D]
            strides = (slot, d, hk * d, 1)
        k = SubPageView(start // kv_size, shape, strides, self.kv_cache_dtype)
        v = SubPageView((start + kv_nbytes) // kv_size, shape, strides, self.kv_cache_dtype)
        index_k = None
        if spec.sparse:
            di, ik_size = spec.index_head_dim, ITEM_SIZE[self.index_cache_dtype]
            index_k = SubPageView((start + 2 * kv_nbytes) // ik_size, (self.num_slots, PAGE_SIZE, di),
                                  (self.slot_nbytes // ik_size, di, 1), self.index_cache_dtype)
        return LayerView(k, v, index_k)

    def views(self) -> list[LayerView]:
        return [self.layer(i) for i in range(self.num_layers)]
