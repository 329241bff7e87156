"""Flat sub-page pool: where each layer's caches live inside one buffer.

A pool is ONE flat buffer of one dtype, ``num_slots`` slots long. A slot holds,
for every layer of a layer group, in layer order:

    K sub-page        [Hk, 128, D]  (HND)  or  [128, Hk, D]  (NHD)
    V sub-page        same shape as K
    index-K sub-page  [128, Di]            (sparse layers only)

so one slot id (what ``block_table`` holds) addresses the 128 tokens of one
page in every layer at once. A layer's cache is then a strided view of the
buffer: element offset of slot 0's sub-page plus the logical strides of
``k_cache`` / ``v_cache`` ``[num_slots, Hk, 128, D]`` (HND order whatever the
storage order) and ``index_k_cache`` ``[num_slots, 128, Di]``. Torch builds
``as_strided`` views from them; JAX hands the whole buffer plus offset and
strides to the kernels (``k_off``/``v_off``), so no layer is ever sliced out.

Pure Python, framework-neutral: dtypes are names (``"bfloat16"``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .maps import PAGE_SIZE, next_pow2

KV_LAYOUTS = ("HND", "NHD")
ITEM_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


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
    """One cache of one layer: ``buffer[offset + sum(i * s for i, s in zip(idx, strides))]``."""
    offset: int                 # element offset of slot 0's sub-page in the flat buffer
    shape: tuple[int, ...]      # logical shape, slot first
    strides: tuple[int, ...]    # logical strides in elements


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
    """
    num_slots: int
    layers: tuple[LayerSpec, ...]
    kv_layout: str = "HND"
    dtype: str = "bfloat16"

    def __post_init__(self):
        if not isinstance(self.num_slots, int) or self.num_slots < 1:
            raise ValueError(f"num_slots: expected an int >= 1, got {self.num_slots!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout: expected one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if self.dtype not in ITEM_SIZE:
            raise TypeError(f"dtype: expected one of {tuple(ITEM_SIZE)}, got {self.dtype!r}")
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
               index_head_dim: int | None = None, kv_layout: str = "HND", dtype: str = "bfloat16") -> "PoolLayout":
        """A group of ``len(sparse)`` layers sharing one head config; ``sparse[i]``
        says whether layer ``i`` has an index-K sub-page (``index_head_dim``,
        default ``head_dim``)."""
        di = head_dim if index_head_dim is None else index_head_dim
        layers = tuple(LayerSpec(num_kv_heads, head_dim, di if s else None) for s in sparse)
        return cls(num_slots, layers, kv_layout, dtype)

    # -- sizes ------------------------------------------------------------------

    @staticmethod
    def _layer_numels(spec: LayerSpec):
        kv = spec.num_kv_heads * PAGE_SIZE * spec.head_dim
        return kv, (PAGE_SIZE * spec.index_head_dim if spec.sparse else 0)

    @property
    def slot_numel(self) -> int:
        """Elements of one slot (every layer's sub-pages)."""
        return sum(2 * kv + ik for kv, ik in map(self._layer_numels, self.layers))

    @property
    def numel(self) -> int:
        """Elements of the whole buffer."""
        return self.num_slots * self.slot_numel

    @property
    def nbytes(self) -> int:
        return self.numel * ITEM_SIZE[self.dtype]

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
        offset = sum(2 * kv + ik for kv, ik in map(self._layer_numels, self.layers[:i]))
        spec = self.layers[i]
        kv_numel, _ = self._layer_numels(spec)
        hk, d, slot = spec.num_kv_heads, spec.head_dim, self.slot_numel
        shape = (self.num_slots, hk, PAGE_SIZE, d)
        if self.kv_layout == "HND":   # sub-page [Hk, 128, D]
            strides = (slot, PAGE_SIZE * d, d, 1)
        else:                         # sub-page [128, Hk, D]
            strides = (slot, d, hk * d, 1)
        k = SubPageView(offset, shape, strides)
        v = SubPageView(offset + kv_numel, shape, strides)
        index_k = None
        if spec.sparse:
            di = spec.index_head_dim
            index_k = SubPageView(offset + 2 * kv_numel, (self.num_slots, PAGE_SIZE, di), (slot, di, 1))
        return LayerView(k, v, index_k)

    def views(self) -> list[LayerView]:
        return [self.layer(i) for i in range(self.num_layers)]
