"""The launch layer's shape: every public op reaches its kernel launch within three of our
own Python frames, in both frameworks, and validates its arguments once per call.

Kernels are replaced by recorders here (nothing is computed), so this runs in
a second; what the kernels compute is the other test files' business.
"""

import inspect
import os

import numpy as np
import pytest
import torch

import m3_jax
import m3_torch
from m3_kernels import validate

from public_ops import inputs, public_calls

ROOTS = tuple(os.path.dirname(m.__file__) + os.sep for m in (m3_torch, m3_jax, validate))


def our_frames():
    """Frames of the project's own packages on the current stack (this recorder excluded)."""
    return [f for f in inspect.stack()[2:] if f.filename.startswith(ROOTS)]


@pytest.fixture
def record(monkeypatch):
    """-> {"launches": [(kernel, our frames)], "checks": count}; kernels and JAX calls are recorders."""
    seen = {"launches": [], "checks": 0, "depth": 0}

    class FakeKernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen["launches"].append((self.name, our_frames()))
            return launch

    class FakeModule:
        def __getattr__(self, name):
            return FakeKernel(name)

    def fake_jax_call(args, module, fn, shapes, *rest):
        seen["launches"].append((fn, our_frames()))
        return [np.zeros(s.shape, s.dtype) for s in shapes]

    monkeypatch.setattr(m3_torch.ops, "kernel_module", lambda module, interpret: FakeModule())
    monkeypatch.setattr(m3_jax.ops, "cpu_call", fake_jax_call)
    for name in dir(validate):
        if name.startswith("check_") and (name.endswith("_call") or name == "check_cache_write"):
            original = getattr(validate, name)

            def counted(*args, _original=original, **kwargs):
                seen["checks"] += seen["depth"] == 0   # a check composed of others counts once
                seen["depth"] += 1
                try:
                    return _original(*args, **kwargs)
                finally:
                    seen["depth"] -= 1
            monkeypatch.setattr(validate, name, counted)
    return seen


def to_jax(x):
    return {n: np.asarray(t) for n, t in x.items()}


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_three_frames_to_a_launch_and_one_validation_per_call(record, framework):
    m = m3_torch if framework == "torch" else m3_jax
    x = inputs() if framework == "torch" else to_jax(inputs())
    for name, call in public_calls(m, x):
        record["launches"].clear()
        record["checks"] = 0
        call()
        assert record["launches"], f"{framework} {name}: launched no kernel"
        for kernel, frames in record["launches"]:
            where = [f"{os.path.relpath(f.filename)}:{f.function}" for f in frames]
            assert len(frames) <= 3, f"{framework} {name} -> {kernel}: {len(frames)} frames of ours: {where}"
        assert record["checks"] == 1, f"{framework} {name}: {record['checks']} validations"
