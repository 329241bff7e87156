"""For test files that are not parametrized over targets (tests/helpers/targets.py): JAX on its CPU device.

Import ``_jax_device`` (an autouse fixture) into a test module and its tests not
marked ``gpu`` run JAX on the CPU device, also on a GPU machine (where torch's
CPU tensors run the interpreter too).
"""

from __future__ import annotations

import jax
import pytest

from targets import jax_gpu_ready  # noqa: F401  (re-exported)


@pytest.fixture(autouse=True)
def _jax_device(request):
    if "gpu" in request.keywords:
        yield
    else:
        with jax.default_device(jax.devices("cpu")[0]):
            yield


class FakeTritonKernels:
    """Stands in for jaxlib's ``gpu_triton`` module as jax-triton calls it (for the wrappers that m3_jax and
    the benchmarks put around it): records the arguments of each ``TritonKernel`` call in ``calls`` and
    returns "kernel"; ``other`` stands for every other attribute, which a wrapper must pass through."""

    other = 7

    def __init__(self):
        self.calls = []

    def TritonKernel(self, *args):  # noqa: N802 (jaxlib's name)
        self.calls.append(args)
        return "kernel"
