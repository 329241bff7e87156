"""Zero-copy exchange of pools and step metadata between torch and JAX (DLPack).

Whichever framework owns the engine allocates the flat sub-page pool, the block
table, the sequence lengths and the slot mapping once; the other one gets the
SAME memory through the DLPack protocol both implement (``__dlpack__`` /
``torch.from_dlpack`` / ``jax.dlpack.from_dlpack``; not the unrelated PyPI
package ``dlpack``):

    pool_j = to_jax(pool_t)                    # same address, no copy
    meta_j = StepMetadata(block_table, seq_lens, slot_mapping).to_jax()
    views = m3_jax.cache.layer_views(pool_j, layout, layer)

Rules:

* Only dense row-major buffers cross: JAX arrays have no strides and no
  offset. Exchange WHOLE buffers (a pool is 1-D) and describe views on the
  other side with offsets and strides (``PoolLayout`` -> ``PagedView`` /
  ``as_strided``). A non-contiguous tensor, a 64-bit dtype while JAX runs
  without x64 (JAX would narrow it: a copy), or a buffer JAX finds misaligned
  raises instead of being copied; every export checks that the address is
  unchanged.
* Streams: each export makes the consumer's current stream wait for the work
  the producer has queued on the buffer so far (the ``stream`` argument of
  ``__dlpack__``). Writes the producer queues AFTER an export are not ordered
  against the consumer: export again at every step boundary (it copies
  nothing), or call ``synchronize()``.
* The other direction has no protocol: JAX does not wait for torch work that
  READS a JAX-owned buffer (or torch for JAX reading a torch-owned one) before
  it is written again. Call ``synchronize()`` between the last foreign read
  and the owner's next write.
* A JAX buffer with a live DLPack consumer, or one imported from torch, is
  never donated by ``jax.jit``: an in-place JAX write (``m3_jax.cache.write_cache``
  with the pool donated) needs a JAX-owned pool with no torch tensor alive on
  it; otherwise JAX silently copies the pool. JAX arrays are immutable to JAX:
  torch may write a shared buffer only while no JAX computation reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax

__all__ = ["to_jax", "to_torch", "StepMetadata", "synchronize", "same_memory"]

_WIDE_DTYPES = ("int64", "uint64", "float64", "complex128")


def _torch():
    import torch  # imported on first use: m3_jax itself does not need torch on GPU

    return torch


def _is_torch(x) -> bool:
    torch = _torch()
    return isinstance(x, torch.Tensor)


def _jax_pointer(x) -> int:
    return x.addressable_data(0).unsafe_buffer_pointer()


def to_jax(x, name: str = "tensor") -> jax.Array:
    """A torch tensor -> a jax.Array over the same memory and device (never a copy).

    ``x`` must be dense and row-major (``x.is_contiguous()``). Raises
    ``ValueError``/``TypeError`` naming ``name`` where DLPack cannot be
    zero-copy. A jax.Array is returned as it is.
    """
    if isinstance(x, jax.Array):
        return x
    if not _is_torch(x):
        raise TypeError(f"{name}: expected a torch.Tensor or jax.Array, got {type(x).__name__}")
    dtype = str(x.dtype).removeprefix("torch.")
    if dtype in _WIDE_DTYPES and not jax.config.jax_enable_x64:
        raise TypeError(f"{name}: dtype {dtype} would be narrowed (copied) by JAX, which runs without x64; "
                        "use a 32-bit dtype (block tables, lengths and slot mappings are int32) or enable "
                        "jax_enable_x64")
    if not x.is_contiguous():
        raise ValueError(f"{name}: JAX takes only dense row-major buffers through DLPack, got shape "
                         f"{tuple(x.shape)} with strides {tuple(x.stride())}; export the whole buffer (e.g. the "
                         "1-D pool) and describe views with offsets and strides (m3_jax.views.PagedView)")
    x = x.detach()
    try:
        out = jax.dlpack.from_dlpack(x, copy=False)
    except ValueError as e:   # JAX's "would need a copy" (e.g. misaligned data pointer)
        raise ValueError(f"{name}: JAX cannot take this buffer without a copy ({e}); export a whole, "
                         "aligned allocation (a slice's data pointer must stay aligned)") from e
    if x.numel() and _jax_pointer(out) != x.data_ptr():
        raise BufferError(f"{name}: DLPack import into JAX copied the data (address changed)")
    return out


def to_torch(x, name: str = "array"):
    """A jax.Array -> a torch tensor over the same memory and device (never a copy).

    ``x`` must be concrete (not a tracer inside ``jax.jit``) and on a single
    device. Torch's current stream waits for JAX's pending writes to ``x``. A
    torch tensor is returned as it is.
    """
    torch = _torch()
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"{name}: a traced value inside jax.jit has no memory to share; export outside jit")
    if not isinstance(x, jax.Array):
        raise TypeError(f"{name}: expected a jax.Array or torch.Tensor, got {type(x).__name__}")
    if len(x.sharding.device_set) != 1:
        raise ValueError(f"{name}: DLPack moves single-device arrays, got one over "
                         f"{len(x.sharding.device_set)} devices")
    if x.is_deleted():
        raise ValueError(f"{name}: the array was deleted (donated to a jitted call?); export its successor")
    out = torch.from_dlpack(x)
    if out.numel() and out.data_ptr() != _jax_pointer(x):
        raise BufferError(f"{name}: DLPack import into torch copied the data (address changed)")
    return out


def same_memory(a, b) -> bool:
    """True when ``a`` and ``b`` (torch or JAX) start at the same device address."""
    def address(x):
        return x.data_ptr() if _is_torch(x) else _jax_pointer(x)
    return address(a) == address(b)


def synchronize(*arrays):
    """Wait (host side) for the given JAX arrays and for all torch work queued on
    the current CUDA stream: a barrier for the cases the export does not order
    (writes after an export, foreign reads before the owner's next write)."""
    torch = _torch()
    if arrays:
        jax.block_until_ready([a for a in arrays if isinstance(a, jax.Array)])
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


@dataclasses.dataclass(frozen=True)
class StepMetadata:
    """A step's metadata in one framework; ``to_jax()``/``to_torch()`` move it without copies.

    block_table [R, max_blocks] int32 (pool slot ids); seq_lens [R] int32;
    slot_mapping [T] int32 (``slot * 128 + offset``, -1 skips), optional.
    """
    block_table: Any
    seq_lens: Any
    slot_mapping: Optional[Any] = None

    def _map(self, fn):
        return StepMetadata(**{f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name), f.name)
                               for f in dataclasses.fields(self)})

    def to_jax(self) -> "StepMetadata":
        return self._map(to_jax)

    def to_torch(self) -> "StepMetadata":
        return self._map(to_torch)
