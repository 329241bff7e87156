"""Running the kernels in Triton's interpreter (CPU tensors), safely and without setup.

``load(name)`` imports kernel module ``name`` a second time, as
``m3_kernels.interpreted.<name>``, with the interpreter switched on while its
``@triton.jit`` decorators run, so a caller never sets ``TRITON_INTERPRET``
and a GPU process can still run CPU tensors. Each of the module's jitted
functions is then wrapped (:class:`Interpreted`):

* Launches (``kernel[grid](...)``) run one at a time. The interpreter keeps a
  launch's state in process globals (the program id, a patched
  ``triton.language``); XLA runs the JAX CPU path's host callbacks
  concurrently, and torch CPU ops may come from several threads. Every launch
  holds the process-wide re-entrant :data:`INTERPRETER_LOCK`, which costs
  nothing: the interpreter holds the GIL anyway.
* ``triton.language`` and ``triton.language.core`` are patched once per
  launch, and restored after it (kernels compiled later in the process see
  the real language). Device-function calls inside the launch (our helpers
  such as ``mma``, Triton's ``tl.cdiv``/``tl.sum``/...) run the interpreted
  code directly instead of re-patching the language for every call.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types

import triton
import triton.language as tl

INTERPRETER_LOCK = threading.RLock()

_PACKAGE = __package__ + ".interpreted"
_modules: dict = {}                 # name -> interpreted module, wrapped
_launch_thread = None               # the thread running a launch (under INTERPRETER_LOCK), else None
# what _patch_lang patches for a function that sees both language modules
_LANGUAGE = types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core})


class Interpreted:
    """One ``@triton.jit`` function of an interpreted kernel module.

    ``fn[grid](*args)`` launches it (serialized, see the module docstring);
    ``fn(*args)`` is a device-function call from inside a running launch.
    """

    def __init__(self, fn):
        self.fn = fn   # triton's InterpretedFunction

    def __getitem__(self, grid):
        return functools.partial(_launch, self.fn, grid)

    def __call__(self, *args, **kwargs):
        return self.fn.rewrite()(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.fn, name)


def _launch(fn, grid, *args, **kwargs):
    global _launch_thread
    from triton.runtime.interpreter import _patch_lang

    with INTERPRETER_LOCK:
        if _launch_thread is not None:   # a launch inside a launch: the language is patched already
            return fn.run(*args, grid=grid, warmup=False, **kwargs)
        scope = _patch_lang(_LANGUAGE)
        _launch_thread = threading.get_ident()
        try:
            return fn.run(*args, grid=grid, warmup=False, **kwargs)
        finally:
            _launch_thread = None
            scope.restore()


def _let_interpreted_kernels_call_triton_helpers():
    """Triton decorates its own @jit helpers (tl.cdiv, tl.sum, tl.max, ...) once,
    when it is imported. Unless TRITON_INTERPRET was set before that, they are
    compiler-only JITFunctions, whose ``__call__`` just raises. Our interpreted
    kernels call them as plain Python, so route such calls through the
    interpreter. Compiled kernels never call ``__call__`` (the code generator
    inlines helpers), so they are unaffected.

    Inside a launch the language is patched already. A call from anywhere else
    patches it for the call and restores it afterwards, like a launch.
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
        if _launch_thread == threading.get_ident():
            return fn.rewrite()(*args, **kwargs)
        scope = _patch_lang(self.fn)
        try:
            return fn.rewrite()(*args, **kwargs)
        finally:
            scope.restore()

    call_interpreted._m3_interpreted = True
    JITFunction.__call__ = call_interpreted


def _package():
    pkg = sys.modules.get(_PACKAGE)
    if pkg is None:
        parent = sys.modules[__package__]
        spec = importlib.machinery.ModuleSpec(_PACKAGE, None, is_package=True)
        pkg = importlib.util.module_from_spec(spec)
        pkg.__path__ = list(parent.__path__)  # same source files, separate module objects
        sys.modules[_PACKAGE] = pkg
    return pkg


def load(name: str):
    """The interpreted kernel module ``name`` (e.g. ``"attention"``), loaded once per process."""
    from triton.runtime.interpreter import InterpretedFunction

    module = _modules.get(name)
    if module is not None:
        return module
    with INTERPRETER_LOCK:
        if name not in _modules:
            _package()
            _let_interpreted_kernels_call_triton_helpers()
            # triton.jit reads the knob when it decorates: every @triton.jit executed
            # while this module (and anything it imports relatively) loads becomes an
            # InterpretedFunction.
            with triton.knobs.runtime.scope():
                triton.knobs.runtime.interpret = True
                module = importlib.import_module(f"{_PACKAGE}.{name}")
            for attr, value in list(vars(module).items()):
                if isinstance(value, InterpretedFunction):
                    setattr(module, attr, Interpreted(value))
            _modules[name] = module
        return _modules[name]
