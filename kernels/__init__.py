"""Shared MiniMax-M3 MSA kernels (import name ``m3_kernels``).

Everything here is framework-neutral: the ``@triton.jit`` kernels (one file per
op family) and the host-side pieces both launchers share (validation, launch
geometry, pool layout, step planner). Nothing in this package imports torch or
jax.

Each kernel module exists twice in a process:

* compiled, ``m3_kernels.<module>``: ``triton.jit`` kernels for GPU tensors;
* interpreted, ``m3_kernels.interpreted.<module>``: the same source loaded with
  Triton's interpreter switched on, for CPU tensors (CI, laptops).

``kernel_module(name, interpret)`` hands out the right one, so a caller never
sets ``TRITON_INTERPRET`` and a GPU process can still run CPU tensors.
"""

import importlib
import importlib.machinery
import importlib.util
import sys
import threading

import triton

_INTERPRETED_PKG = __name__ + ".interpreted"
_lock = threading.Lock()


def _interpreted_package():
    pkg = sys.modules.get(_INTERPRETED_PKG)
    if pkg is None:
        spec = importlib.machinery.ModuleSpec(_INTERPRETED_PKG, None, is_package=True)
        pkg = importlib.util.module_from_spec(spec)
        pkg.__path__ = list(__path__)  # same source files, separate module objects
        sys.modules[_INTERPRETED_PKG] = pkg
    return pkg


def _let_interpreted_kernels_call_triton_helpers():
    """Triton decorates its own @jit helpers (tl.cdiv, tl.sum, tl.max, ...) once,
    when it is imported. Unless TRITON_INTERPRET was set before that, they are
    compiler-only JITFunctions, whose ``__call__`` just raises. Our interpreted
    kernels call them as plain Python, so route such calls through the
    interpreter too. Compiled kernels never call ``__call__`` (the code
    generator inlines helpers), so they are unaffected.

    Like ``InterpretedFunction.__call__``, this patches triton.language for the
    call; unlike it, it undoes the patch afterwards, so that kernels compiled
    later in the same process see the real language (the helpers' module,
    ``triton.language.core``, is not one the kernel-level run restores).
    """
    from triton.runtime.interpreter import InterpretedFunction, _patch_lang
    from triton.runtime.jit import JITFunction

    if getattr(JITFunction.__call__, "_m3_interpreted", False):
        return
    interpreted: dict = {}

    def call_interpreted(self, *args, **kwargs):
        fn = interpreted.get(id(self))  # JITFunction.__hash__ needs the compiler
        if fn is None:
            fn = interpreted.setdefault(id(self), InterpretedFunction(self.fn))
        scope = _patch_lang(self.fn)
        try:
            return fn.rewrite()(*args, **kwargs)
        finally:
            scope.restore()

    call_interpreted._m3_interpreted = True
    JITFunction.__call__ = call_interpreted


def kernel_module(name: str, interpret: bool):
    """The kernel module ``name`` (e.g. ``"attention"``), compiled or interpreted."""
    if not interpret:
        return importlib.import_module(f"{__name__}.{name}")
    full = f"{_INTERPRETED_PKG}.{name}"
    if full in sys.modules:
        return sys.modules[full]
    with _lock:
        _interpreted_package()
        _let_interpreted_kernels_call_triton_helpers()
        # triton.jit reads the knob when it decorates: every @triton.jit executed
        # while this module (and anything it imports relatively) loads becomes an
        # InterpretedFunction.
        with triton.knobs.runtime.scope():
            triton.knobs.runtime.interpret = True
            return importlib.import_module(full)
