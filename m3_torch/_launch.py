"""Torch-side plumbing: kernel lookup by device, cached maps, workspaces."""

from __future__ import annotations

import threading

import torch

import m3_kernels
from m3_kernels import geometry

_lock = threading.Lock()
_maps: dict = {}
_workspaces: dict = {}


def kernel(module: str, name: str, device: torch.device):
    """The compiled kernel for CUDA tensors, the interpreted one for CPU tensors."""
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"m3_torch runs on CUDA or CPU tensors, got device {device}")
    return getattr(m3_kernels.kernel_module(module, interpret=device.type == "cpu"), name)


def check_devices(**tensors):
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(f"{name}: expected device {first} (the device of {first_name}), got {dev}")
    return first


def decode_maps(device, num_requests, decode_query_len, tokens_per_tile):
    """(tile_map, token_map) device tensors, built once per shape and device.

    Cached so that a CUDA-graph capture after one eager call copies nothing.
    """
    key = (str(device), num_requests, decode_query_len, tokens_per_tile)
    maps = _maps.get(key)
    if maps is None:
        tile_map, token_map = geometry.decode_maps(num_requests, decode_query_len, tokens_per_tile)
        maps = (torch.from_numpy(tile_map).to(device), torch.from_numpy(token_map).to(device))
        with _lock:
            _maps[key] = maps
    return maps


def workspace(device, tag: str, shape, dtype=torch.float32):
    """A persistent buffer per (device, tag), grown on demand and never freed.

    Decode steps reuse the same addresses call after call, so a CUDA graph
    captured after one eager warm-up call replays against valid memory. Calls
    on one device share it: run them on one stream (as a decode step does).
    """
    numel = 1
    for s in shape:
        numel *= int(s)
    key = (str(device), tag, dtype)
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
        with _lock:
            _workspaces[key] = buf
    return buf[:numel].view(shape)


def launch(kernel_fn, grid, args, *, num_warps, num_stages, **constexprs):
    kernel_fn[grid](*args, num_warps=num_warps, num_stages=num_stages, **constexprs)
