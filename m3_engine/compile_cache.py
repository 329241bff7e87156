"""Where an engine keeps what it compiles, across starts: one folder for both frameworks.

JAX's persistent compilation cache (the XLA executables of the jitted steps)
goes to ``<folder>/jax``, Triton's cache (the kernels' cubins, launched by torch
and, through jax-triton, by JAX) to ``<folder>/triton``. The folder is, first
found: the ``compile_cache_dir`` option (``--compile-cache-dir``), the
``M3_CACHE_DIR`` environment variable, ``$XDG_CACHE_HOME/m3-msa/compile``,
``~/.cache/m3-msa/compile``. Each runner points its framework at it once, when
it starts (``m3_jax.runner``, ``m3_torch.runner``); a second start of the same
model and options then loads its programs instead of compiling them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

__all__ = ["resolve_cache_dir", "ENV_VAR"]

ENV_VAR = "M3_CACHE_DIR"


def resolve_cache_dir(option=None, environ: Optional[dict] = None) -> Path:
    """The compile cache folder (absolute, not created): ``option`` (a path, or None), else
    ``$M3_CACHE_DIR``, else ``$XDG_CACHE_HOME/m3-msa/compile``, else ``~/.cache/m3-msa/compile``.
    ``environ``: the environment to read (``os.environ``)."""
    env = os.environ if environ is None else environ
    if option is not None:
        if not isinstance(option, (str, os.PathLike)) or not str(option):
            raise TypeError(f"compile_cache_dir: expected None or a folder path, got {option!r}")
        return Path(option).expanduser().absolute()
    if env.get(ENV_VAR):
        return Path(env[ENV_VAR]).expanduser().absolute()
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path(env.get("HOME", "~")) / ".cache"
    return (base / "m3-msa" / "compile").expanduser().absolute()
