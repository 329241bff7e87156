"""PyTorch side of the flat sub-page pool: allocation, per-layer views, cache writes.

A pool is a 1-D tensor of ``layout.numel`` elements (``m3_kernels.pool.PoolLayout``);
``layer_caches`` returns a layer's caches as ``as_strided`` views of it, which
every decode op accepts as they are (``block_table`` then holds slot ids).
A pool with FP8 caches is a byte (uint8) tensor; each view then reinterprets
its bytes as the cache's dtype (``pool.view(dtype)``, no copy).
``write_cache`` appends a step's new rows to a layer's caches in place
(quantising into FP8 caches); it takes pool views or standalone caches alike.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from m3_kernels import validate
from m3_kernels.pool import PoolLayout, SubPageView

from . import guards, ops

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "float8_e4m3fn": torch.float8_e4m3fn, "uint8": torch.uint8}


class LayerCaches(NamedTuple):
    k_cache: torch.Tensor                   # [num_slots, Hk, 128, D]
    v_cache: torch.Tensor                   # [num_slots, Hk, 128, D]
    index_k_cache: Optional[torch.Tensor]   # [num_slots, 128, Di]; None for a dense layer


def allocate_pool(layout: PoolLayout, device="cpu") -> torch.Tensor:
    """A zero-filled pool (as JAX's): 1-D ``[layout.numel]`` of ``layout.buffer_dtype`` on ``device``."""
    return torch.zeros(layout.numel, dtype=TORCH_DTYPES[layout.buffer_dtype], device=device)


def check_pool(pool: torch.Tensor, layout: PoolLayout):
    if pool.dim() != 1 or pool.numel() != layout.numel:
        raise ValueError(f"pool: expected shape ({layout.numel},) from the layout, got {tuple(pool.shape)}")
    if pool.dtype != TORCH_DTYPES[layout.buffer_dtype]:
        raise TypeError(f"pool: expected dtype {layout.buffer_dtype} from the layout, got {pool.dtype}")
    if pool.stride(0) != 1:
        raise ValueError(f"pool: expected a dense buffer (stride 1), got stride {pool.stride(0)}")


def sub_page_view(pool: torch.Tensor, view: SubPageView) -> torch.Tensor:
    """The strided tensor of ``view.dtype`` that ``view`` describes inside ``pool`` (no copy)."""
    typed = pool.view(TORCH_DTYPES[view.dtype])   # a byte pool, read as the cache's dtype
    return typed.as_strided(view.shape, view.strides, typed.storage_offset() + view.offset)


def layer_caches(pool: torch.Tensor, layout: PoolLayout, layer: int) -> LayerCaches:
    """Layer ``layer``'s caches as views of ``pool`` (1-D, ``layout.numel`` elements)."""
    check_pool(pool, layout)
    lv = layout.layer(layer)
    index_k = None if lv.index_k is None else sub_page_view(pool, lv.index_k)
    return LayerCaches(sub_page_view(pool, lv.k), sub_page_view(pool, lv.v), index_k)


# -- write_cache ---------------------------------------------------------------------

def storage_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``cache`` as a 1-D byte tensor (the kernel reads each cache as its own dtype)."""
    storage = cache.untyped_storage()
    return cache.as_strided((storage.nbytes() // cache.element_size(),), (1,), 0).view(torch.uint8)


def write_cache(k, v, index_k, k_cache, v_cache, index_k_cache, slot_mapping, *, k_scale=None, v_scale=None):
    """Write token ``t``'s rows to row ``slot_mapping[t] % 128`` of page ``slot_mapping[t] // 128``.

    k, v [T, Hk, D] and index_k [T, Di] (None for a dense layer) in the model's
    dtype; k_cache/v_cache [slots, Hk, 128, D] and index_k_cache [slots, 128, Di]
    (None for a dense layer) of k's dtype or ``torch.float8_e4m3fn``, any strides:
    pool views (``layer_caches``) or standalone caches; slot_mapping [T] int32 or
    int64, ``-1`` skips a token. Updates the caches in place, one kernel launch
    per distinct buffer (one for a pool). Nothing else in the caches' buffers is
    touched. FP8 caches store ``saturate(x / scale)`` rounded to nearest even:
    K/V with ``k_scale``/``v_scale`` (as in ``m3_torch.sparse_decode``; None is
    1.0), index-K unscaled.
    """
    num_tokens = validate.check_cache_write(k, v, index_k, k_cache, v_cache, index_k_cache, slot_mapping,
                                            k_scale, v_scale)
    guards.check_call("write_cache", k=k, v=v, index_k=index_k, k_cache=k_cache, v_cache=v_cache,
                      index_k_cache=index_k_cache, slot_mapping=slot_mapping)
    device = guards.check_devices(k=k, v=v, index_k=index_k, k_cache=k_cache, v_cache=v_cache,
                                  index_k_cache=index_k_cache, slot_mapping=slot_mapping, k_scale=k_scale,
                                  v_scale=v_scale)
    if num_tokens == 0:
        return
    scales = ops.kv_scales(k_cache, k_scale, v_scale, device)
    dtypes = (k_cache.dtype, k.dtype if index_k_cache is None else index_k_cache.dtype)
    caches = {"k": k_cache, "v": v_cache, "index": index_k_cache}
    buffers: dict = {}   # storage address -> names of the caches in that storage
    for name, cache in caches.items():
        if cache is not None:
            buffers.setdefault(cache.untyped_storage().data_ptr(), []).append(name)
    for names in buffers.values():
        on = {name: name in names for name in caches}
        offsets = [caches[name].storage_offset() if on[name] else 0 for name in caches]
        strides = [list(caches[name].stride()) if on[name] else [] for name in caches]
        ops.write_cache(k, v, index_k, slot_mapping, storage_bytes(caches[names[0]]), offsets, *strides, *dtypes,
                        *scales)
