"""The entry guard every public torch op calls once, before it launches anything.

* Inference only: the ops have no backward. An input that requires grad
  while grad mode is on raises (rather than returning an output silently cut
  off from the graph); so does a call under a ``torch.func`` transform
  (``vmap``, ``grad``, ...), which the custom ops do not support.
* ``M3_VALIDATE=1``: the metadata (``seq_lens``, ``block_table``,
  ``block_ids``, ``slot_mapping``) is copied to the host and checked by
  ``m3_kernels.validate.check_values`` (a device sync, so it refuses under
  CUDA-graph capture). Off by default, and then the guard reads no values.
"""

from __future__ import annotations

import torch

from m3_kernels import validate

__all__ = ["check_call", "check_devices", "check_contiguous"]


def check_call(op: str, **tensors) -> None:
    """Guard one call of ``m3_torch.<op>``; ``tensors``: its tensor arguments by name (None allowed)."""
    given = {name: t for name, t in tensors.items() if t is not None}
    for name, t in given.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"m3_torch.{op}: {name}: expected a torch.Tensor, got {type(t).__name__}")
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            raise TypeError(f"m3_torch.{op}: {name} comes from a torch.func transform (vmap, grad, ...), "
                               f"which m3 ops do not support; call the op on plain tensors")
    if torch.is_grad_enabled():
        for name, t in given.items():
            if t.requires_grad:
                raise RuntimeError(f"m3_torch.{op} is inference-only (no backward), but {name} requires grad; "
                                   f"call it under torch.no_grad() or torch.inference_mode(), or pass "
                                   f"{name}.detach()")
    if validate.values_enabled() and any(name in given for name in validate.VALUE_CHECKED):
        _check_values(op, given)


def check_devices(**tensors) -> torch.device:
    """All given tensors (None and non-tensors skipped) on the device of the first -> that device."""
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    first = next(iter(devices.values()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{name}: expected device {first} (as {next(iter(devices))}), got {device}")
    return first


def check_contiguous(**tensors) -> None:
    """Each given tensor (None skipped) is contiguous (weights the kernels read with fixed strides)."""
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")


def _check_values(op, tensors):
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"m3_torch.{op}: M3_VALIDATE=1 reads metadata on the host, which a CUDA-graph capture "
                           f"cannot do; capture with M3_VALIDATE unset (validate the eager warm-up call instead)")
    host = {name: tensors[name].detach().cpu().numpy() for name in validate.VALUE_CHECKED if name in tensors}
    try:
        validate.check_values(host, **validate.value_check_bounds(tensors))
    except ValueError as e:
        raise ValueError(f"m3_torch.{op}: {e}") from None
