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
