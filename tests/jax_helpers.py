"""For test files that are not parametrized over targets (tests/targets.py): JAX on its CPU device.

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
