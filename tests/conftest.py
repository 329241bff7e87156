import os

# JAX must not grab most of the GPU memory when torch shares the process (DEVICE.md);
# set before any test module imports jax.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# the engines' compile caches (m3_engine.compile_cache) in a folder of this run, not the user's ~/.cache
if "M3_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["M3_CACHE_DIR"] = tempfile.mkdtemp(prefix="m3-compile-cache-")
    atexit.register(shutil.rmtree, os.environ["M3_CACHE_DIR"], ignore_errors=True)

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """``M3_FAILURE_LOG=FILE``: each failure's traceback appended to FILE when it happens, so a run cut
    short by a time limit still leaves them (xdist: each worker writes ``FILE.<worker>``)."""
    path = os.environ.get("M3_FAILURE_LOG")
    if path and report.failed and not hasattr(report, "node"):
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        path = f"{path}.{worker}" if worker else path
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


# The GPU suite runs in several pytest-xdist workers on ONE GPU. An engine's defaults are a server's
# (the KV pool from gpu_memory_utilization=0.9 of the GPU, every step shape compiled at start): one
# worker's first engine would take the memory every other worker needs, and each engine would spend
# minutes compiling. A test's engine takes a worker's share and compiles on first use unless the
# test passes these options itself (tests/engine/test_warm_start.py does, for precompile).
GPU_TEST_ENGINE_DEFAULTS = dict(gpu_memory_utilization=0.05, precompile=False)


@pytest.fixture(autouse=True)
def _gpu_test_engine_defaults(monkeypatch):
    if not torch.cuda.is_available():
        yield
        return
    from m3_engine.args import EngineArgs

    init = EngineArgs.__init__

    def shared_gpu_init(self, *args, **options):
        for name, value in GPU_TEST_ENGINE_DEFAULTS.items():
            options.setdefault(name, value)
        torch.cuda.empty_cache()   # the pool is sized from this process's reserved memory
        init(self, *args, **options)

    monkeypatch.setattr(EngineArgs, "__init__", shared_gpu_init)
    yield
