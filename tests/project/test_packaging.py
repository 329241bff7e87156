"""Packaging: the CPU path under any numpy, and which framework each package imports.

* Triton 3.6's interpreter holds scalars as 1-element numpy arrays and converts
  them with ``int()``, which numpy deprecated in 1.25 and refuses from 2.4 on;
  ``m3_kernels.interpreter`` reads the element instead, so the project pins no
  numpy. The launch test below runs with that conversion made an error on any
  numpy (on numpy < 2.4 by turning its DeprecationWarning into an error, which
  is what 2.4 did; numpy's own types cannot be monkeypatched), and checks that
  without the workaround the same launch does fail, so the test proves it.
* ``pip install 'm3-msa-kernels[torch]'`` brings no JAX and ``[jax]`` no torch:
  a missing framework is an ImportError naming the extra to install (which
  framework each package imports: test_imports.py).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
# numpy < 2.4 warns on int() of an array with ndim > 0 (this message); numpy >= 2.4 raises TypeError
ARRAY_TO_SCALAR = "Conversion of an array with ndim > 0"


def _dense_decode_case():
    """One request of 3 tokens (one page), 2 query heads over 1 KV head, float32, on the CPU."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 64, generator=g)
    k_cache = torch.randn(2, 1, 128, 64, generator=g)
    v_cache = torch.randn(2, 1, 128, 64, generator=g)
    block_table = torch.tensor([[1]], dtype=torch.int32)
    seq_lens = torch.tensor([3], dtype=torch.int32)
    scores = torch.einsum("hd,nd->hn", q[0].double(), k_cache[1, 0, :3].double()) * 64 ** -0.5
    ref = (scores.softmax(-1) @ v_cache[1, 0, :3].double())[None]
    return (q, k_cache, v_cache, block_table, seq_lens), ref


@contextlib.contextmanager
def _array_to_scalar_is_an_error():
    """numpy's int()/float() of a 1-element array raises inside, whatever numpy is installed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=ARRAY_TO_SCALAR, category=DeprecationWarning)
        yield


def test_interpreted_launch_under_installed_numpy():
    """A dense decode launch loops over ``range(lo, hi)`` with bounds the kernel loaded: the
    interpreter turns them into ints, which raised on numpy >= 2.4 before the workaround."""
    m3_torch = pytest.importorskip("m3_torch")
    args, ref = _dense_decode_case()
    with _array_to_scalar_is_an_error():
        out = m3_torch.dense_decode(*args, decode_query_len=1)
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < 1e-3, f"relative error {err} (numpy {np.__version__})"


def test_launch_fails_without_the_workaround(monkeypatch):
    """The same launch with Triton's own ``__index__`` (``int(array)``) fails under the same rule,
    so the test above exercises the conversion the workaround replaces (numpy 2.4's TypeError, or
    numpy < 2.4's DeprecationWarning made an error as 2.4 made it)."""
    m3_torch = pytest.importorskip("m3_torch")
    from triton.runtime import interpreter

    from m3_kernels import interpreter as m3_interpreter

    m3_interpreter.load("attention")   # installs the workaround (once per process)
    patched = interpreter._patch_lang_tensor
    assert getattr(patched, "_m3_scalar_index", False), "m3_kernels.interpreter did not install its __index__"
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched.__wrapped__)
    args, _ = _dense_decode_case()
    with _array_to_scalar_is_an_error(), pytest.raises(Exception, match="0-dimensional arrays|ndim > 0"):
        m3_torch.dense_decode(*args, decode_query_len=1)


# -- a missing framework ----------------------------------------------------------------------

def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


# a module finder that makes `import <framework>` fail as in an environment without it
_WITHOUT = """
import sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Missing())
try:
    import {module}
except ImportError as e:
    print(type(e).__name__ + ": " + str(e))
else:
    print("imported")
"""


def test_missing_torch_names_the_extra():
    out = _python(_WITHOUT.format(blocked={"torch"}, module="m3_torch")).stdout
    assert out.startswith(("ImportError", "ModuleNotFoundError")) and "m3-msa-kernels[torch]" in out, out


def test_missing_jax_names_the_extra():
    out = _python(_WITHOUT.format(blocked={"jax", "jaxlib"}, module="m3_jax")).stdout
    assert out.startswith(("ImportError", "ModuleNotFoundError")) and "m3-msa-kernels[jax]" in out, out


# -- the declared dependencies ------------------------------------------------------------------

def test_dependencies_leave_the_framework_to_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {req.split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip().lower()
             for req in project["dependencies"]}
    assert not names & {"torch", "jax", "jaxlib"}, names
    assert not any("<" in req for req in project["dependencies"] if req.startswith("numpy")), \
        "numpy must not be capped: m3_kernels.interpreter works on numpy >= 2.4"
    extras = project["optional-dependencies"]
    assert not any(r.startswith("jax") for r in extras["torch"]) and not any(r.startswith("torch")
                                                                              for r in extras["jax"])
    assert project["scripts"]["m3-generate"] == "m3_engine.cli:main"
    assert project["scripts"]["m3-serve"] == "m3_engine.server.cli:main"
