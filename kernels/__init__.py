"""Shared MiniMax-M3 MSA kernels (import name ``m3_kernels``).

Everything here is framework-neutral: the ``@triton.jit`` kernels (one file per
op family) and the host-side pieces both launchers share (validation, launch
descriptions, maps, tuning, pool layout, step planner). Nothing in this package
imports torch or jax.

Each kernel module exists twice in a process:

* compiled, ``m3_kernels.<module>``: ``triton.jit`` kernels for GPU tensors;
* interpreted, ``m3_kernels.interpreted.<module>``: the same source run by
  Triton's interpreter, for CPU tensors (CI, laptops), its launches serialized
  so that concurrent callers are safe (``interpreter.py``).

``kernel_module(name, interpret)`` hands out the right one, so a caller never
sets ``TRITON_INTERPRET`` and a GPU process can still run CPU tensors.
"""

import importlib


def kernel_module(name: str, interpret: bool):
    """The kernel module ``name`` (e.g. ``"attention"``), compiled or interpreted."""
    if interpret:
        from . import interpreter

        return interpreter.load(name)
    return importlib.import_module(f"{__name__}.{name}")
