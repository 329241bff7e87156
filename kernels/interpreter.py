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
* float8_e4m3fn conversions (the FP8 caches) are exact, as on an sm_90 GPU:
  Triton 3.6's interpreter rounds to fp8 half-up without carrying into the
  exponent (127.99 became 64) and reads the NaN code as 480; and float32 ->
  bfloat16 casts round to nearest even, as GPUs and torch do (the interpreter
  truncates) (:func:`_exact_float_conversions`).
* Any numpy, 2.4 and later included: the interpreter holds a scalar as a
  1-element array and converts it with ``int(array)`` when a kernel uses a
  tensor as a Python integer (``range(lo, hi)`` over loaded bounds), which
  numpy deprecated in 1.25 and made a ``TypeError`` in 2.4. During a launch
  that conversion reads the one element instead (:func:`_scalar_index`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types

import numpy as np
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


# float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN
_E4M3_MAX = 448.0
_E4M3_MIN_NORMAL = 2.0 ** -6


def _e4m3_values() -> np.ndarray:
    """The 256 codes of float8_e4m3fn as float64 values (the NaN codes as NaN)."""
    code = np.arange(256)
    exp, man = (code >> 3) & 15, (code & 7).astype(np.float64)
    mag = np.where(exp == 0, man * 2.0 ** -9, (1 + man / 8) * np.exp2(exp - 7.0))
    mag = np.where((exp == 15) & (man == 7), np.nan, mag)
    return np.where(code >> 7, -mag, mag)


def _to_e4m3(x: np.ndarray, toward_zero: bool) -> np.ndarray:
    """float64 values -> float8_e4m3fn codes (uint8) as sm_90's ``cvt.rn.satfinite``: round to
    nearest even (or toward zero), finite overflow and +-inf to +-448, NaN to NaN."""
    nan = np.isnan(x)
    mag = np.minimum(np.abs(np.where(nan, 0.0, x)), _E4M3_MAX)
    # the spacing of the e4m3 grid around mag: 2^(exponent - 3); subnormals share 2^-6's
    _, exp = np.frexp(np.maximum(mag, _E4M3_MIN_NORMAL))
    ulp = np.exp2(exp - 4.0)
    mag = (np.trunc if toward_zero else np.rint)(mag / ulp) * ulp   # np.rint: halves to even
    _, exp = np.frexp(np.maximum(mag, _E4M3_MIN_NORMAL))
    normal = mag >= _E4M3_MIN_NORMAL
    exp_field = np.where(normal, exp + 6, 0)
    man_field = np.where(normal, mag / np.exp2(exp - 4.0) - 8, mag / 2.0 ** -9)
    code = (exp_field.astype(np.int64) << 3) | man_field.astype(np.int64)
    code = np.where(nan, 0x7F, code) | (np.signbit(x).astype(np.int64) << 7)
    return code.astype(np.uint8)


def _exact_float_conversions():
    """Route the interpreter's float conversions from and to float8e4nv, and its float32 -> bfloat16
    casts, through exact ones."""
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "_m3_exact_e4m3", False):
        return
    e4m3_values = _e4m3_values()

    def as_float64(data, dtype):
        if dtype == tl.float8e4nv:
            return e4m3_values[data.view(np.uint8)]
        if dtype == tl.bfloat16:
            return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return data.astype(np.float64)

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if (input_dtype, output_dtype) == (tl.float32, tl.bfloat16) and rounding_mode != interpreter._ir.ROUNDING_MODE.RTZ:
            return _to_bfloat16(np.asarray(data, np.float32))
        if tl.float8e4nv not in (input_dtype, output_dtype) or input_dtype == output_dtype:
            return original(data, input_dtype, output_dtype, rounding_mode)
        x = as_float64(np.asarray(data), input_dtype)
        if output_dtype == tl.float8e4nv:
            return _to_e4m3(x, rounding_mode == interpreter._ir.ROUNDING_MODE.RTZ)
        # every e4m3 value (NaN aside) is exact in float16, bfloat16 and float32
        if output_dtype == tl.bfloat16:
            return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        np_dtype = {tl.float16: np.float16, tl.float32: np.float32, tl.float64: np.float64}[output_dtype]
        return x.astype(np_dtype).view(getattr(np, f"uint{output_dtype.primitive_bitwidth}"))

    convert._m3_exact_e4m3 = True
    interpreter._convert_float = convert


def _to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even; NaN stays a (quiet) NaN."""
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), ((bits >> 16) | 0x40).astype(np.uint16), rounded)


def _tensor_index(self):
    """``tl.tensor.__index__`` in the interpreter: the value of a one-element tensor as an int."""
    data = self.handle.data
    if data.size != 1:
        raise TypeError(f"only one-element tensors can be used as an index, not shape {data.shape}")
    return int(data.reshape(()))


def _scalar_index():
    """Make the interpreter's ``tl.tensor.__index__`` read the element of its 1-element array.

    Triton 3.6 sets ``tl.tensor.__index__`` to ``int(self.handle.data)`` for the duration of each
    launch (``_patch_lang_tensor``; the scope restores it afterwards). ``data`` has shape ``(1,)``
    for a scalar, and numpy >= 2.4 refuses ``int()`` of an array with ndim > 0 (older numpy
    warns). This keeps Triton's patch and overrides only ``__index__``, in the same scope, so
    outside a launch ``tl.tensor`` is untouched. ``bool()`` of a 1-element array, the interpreter's
    ``__bool__``, is still allowed by numpy and left alone.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_m3_scalar_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _tensor_index)

    patch_lang_tensor._m3_scalar_index = True
    patch_lang_tensor.__wrapped__ = original   # Triton's own (tests/project/test_packaging.py restores it)
    interpreter._patch_lang_tensor = patch_lang_tensor


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
            _exact_float_conversions()
            _scalar_index()
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
