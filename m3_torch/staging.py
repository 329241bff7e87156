"""Host metadata to the device in ONE copy: :func:`upload`.

A step's small numpy arrays (its token ids, positions, block table, its sampling
parameters) each copied on their own cost one pinned-memory allocation and one
copy call apiece on the host. :func:`upload` packs them all into one host byte
buffer, copies that to the device with one ``non_blocking`` copy, and returns
typed views of the device copy, one per array. Each view starts at a 16-byte
aligned offset of a fresh device buffer (itself aligned): Triton specialises a
kernel on whether each pointer is a multiple of 16, so a view runs the kernel
variants a tensor of its own would.

On a GPU the host buffers come from a :class:`HostRing` per device: pinned
buffers used in turn, each guarded by the CUDA event recorded after the copy out
of it, which is synchronized before the buffer is packed again (``SLOTS`` uploads
later: that copy has long run, so the wait costs nothing). On the CPU and on
the meta device (``m3_torch.ops.record_variants``) each call packs a fresh
buffer (nothing copies asynchronously there).
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

import numpy as np
import torch

__all__ = ["upload", "packed_layout", "HostRing", "ALIGN", "SLOTS"]

ALIGN = 16   # bytes: where each array starts in the buffer
SLOTS = 8    # host buffers in a device's ring: uploads before one is packed again

TORCH_DTYPES = {np.dtype(n): getattr(torch, t) for n, t in (
    ("bool", "bool"), ("uint8", "uint8"), ("int8", "int8"), ("int16", "int16"), ("int32", "int32"),
    ("int64", "int64"), ("float16", "float16"), ("float32", "float32"), ("float64", "float64"))}

_rings: dict = {}
_lock = threading.Lock()


def packed_layout(arrays: Sequence[Optional[np.ndarray]]) -> tuple:
    """``(offsets, total)``: the byte offset of each array in the packed buffer (None for None; each a
    multiple of ``ALIGN``) and the buffer's size in bytes (a multiple of ``ALIGN``)."""
    offsets, total = [], 0
    for i, a in enumerate(arrays):
        if a is None:
            offsets.append(None)
            continue
        if not isinstance(a, np.ndarray):
            raise TypeError(f"arrays[{i}]: expected a numpy array or None, got {type(a).__name__}")
        if a.dtype not in TORCH_DTYPES:
            raise TypeError(f"arrays[{i}]: expected one of the dtypes {sorted(map(str, TORCH_DTYPES))}, "
                            f"got {a.dtype}")
        offsets.append(total)
        total += -(-a.nbytes // ALIGN) * ALIGN
    return offsets, total


def upload(arrays: Sequence[Optional[np.ndarray]], device) -> list:
    """``arrays`` (numpy arrays or None) on ``device`` through ONE host-to-device copy, queued without
    waiting for the device -> a list of tensors (None for None), each a view, of the array's dtype
    and shape, of one new device buffer at a 16-byte aligned offset. The arrays may be read-only,
    non-contiguous or empty; the caller may change them as soon as this returns."""
    device = torch.device(device)
    offsets, total = packed_layout(arrays)
    if device.type == "cuda":
        with _lock:
            ring = _rings.get(device)
            if ring is None:
                ring = _rings[device] = HostRing(SLOTS, pin_memory=True, new_event=torch.cuda.Event)
        with ring.lock:   # packed, copied and guarded before another thread takes a buffer
            host, host_bytes, copied = ring.take(total)
            pack(host_bytes, arrays, offsets)
            buffer = host[:total].to(device, non_blocking=True)
            copied.record(torch.cuda.current_stream(device))
    else:
        host = torch.empty(total, dtype=torch.uint8)
        pack(host.numpy(), arrays, offsets)
        buffer = host.to(device)   # the CPU: this very buffer
    return views(buffer, arrays, offsets)


def pack(host_bytes: np.ndarray, arrays: Sequence[Optional[np.ndarray]], offsets: list) -> None:
    """Copy each array into ``host_bytes`` (uint8) at its offset (``packed_layout``)."""
    for a, o in zip(arrays, offsets):
        if a is not None and a.size:
            host_bytes[o:o + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a


def views(buffer: torch.Tensor, arrays: Sequence[Optional[np.ndarray]], offsets: list) -> list:
    """Each array's view of the uint8 ``buffer`` it was packed into (None for None): the buffer seen as
    the array's dtype (its size is a multiple of ``ALIGN``), sliced at the offset, shaped."""
    typed, out = {}, []
    for a, o in zip(arrays, offsets):
        if a is None:
            out.append(None)
            continue
        dtype = TORCH_DTYPES[a.dtype]
        if dtype not in typed:
            typed[dtype] = buffer.view(dtype)
        start = o // a.itemsize
        t = typed[dtype][start:start + a.size]
        out.append(t if a.ndim == 1 else t.view(a.shape))
    return out


class HostRing:
    """``slots`` host byte buffers handed out in turn (:meth:`take`), each grown on demand, each with an
    event: the caller records it after queuing the copy out of the buffer, and :meth:`take`
    synchronizes it before handing the buffer out again, so a buffer is never packed while a copy
    from it may still be in flight. ``pin_memory``: page-locked buffers (a GPU's; a copy from
    pageable memory may wait for the work already queued on the stream). ``new_event``: makes a
    slot's event (``torch.cuda.Event``). ``lock``: held by the caller from :meth:`take` until the
    event is recorded."""

    def __init__(self, slots: int, pin_memory: bool, new_event: Callable):
        if slots < 1:
            raise ValueError(f"slots: expected at least 1, got {slots}")
        self.pin_memory = pin_memory
        self.buffers: list = [None] * slots   # (uint8 tensor, its numpy view) per slot
        self.events = [new_event() for _ in range(slots)]
        self.turn = 0
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> tuple:
        """The next slot -> ``(host uint8 tensor, its numpy view, event)``: at least ``nbytes`` bytes,
        the copy recorded on the event last time done."""
        i = self.turn
        self.turn = (i + 1) % len(self.buffers)
        self.events[i].synchronize()
        if self.buffers[i] is None or self.buffers[i][0].numel() < nbytes:
            size = max(4096, 1 << (nbytes - 1).bit_length())
            host = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
            self.buffers[i] = (host, host.numpy())
        return (*self.buffers[i], self.events[i])
