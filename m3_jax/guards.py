"""The entry guard every public JAX op calls once, before it launches anything.

* Transforms: the ops work under ``jax.jit`` only. An input traced by
  ``jax.vmap``, ``jax.grad``/``jax.jvp`` or another transform raises a
  one-line error naming the op (instead of an error from deep inside JAX's
  callback or jax-triton machinery).
* ``M3_VALIDATE=1`` (read when the op is called; under ``jax.jit``: when it
  is traced): the metadata (``seq_lens``, ``block_table``, ``block_ids``,
  ``slot_mapping``) is checked by ``m3_kernels.validate.check_values``.
  Concrete arrays are checked right away and raise ``ValueError`` before any
  launch. Under ``jax.jit`` the check is a host callback whose result (a
  zero) is added to the ``seq_lens`` (``write_cache``: ``slot_mapping``) the
  kernels read, so it runs first and a bad value fails the call with an error
  naming the argument. Off by default, and then the guard adds nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters.partial_eval import DynamicJaxprTracer

from m3_kernels import validate

from .views import PagedView

__all__ = ["check_call"]

_DEPENDENT = ("seq_lens", "slot_mapping")   # the array a launch is made to depend on, first present


def check_call(op: str, **arrays):
    """Guard one call of ``m3_jax.<op>``; ``arrays``: its array arguments by name (None allowed).

    Returns the op's ``seq_lens`` (``write_cache``: ``slot_mapping``), to be
    used in its place: with ``M3_VALIDATE=1`` under ``jax.jit`` it depends on
    the host check. An op with neither (the model kernels: no metadata to
    check) gets None.
    """
    given = {name: x for name, x in arrays.items() if x is not None}
    for name, x in given.items():
        leaf = x.buffer if isinstance(x, PagedView) else x
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            raise TypeError(f"m3_jax.{op}: {name}: expected a jax array, got {type(leaf).__name__}")
        if isinstance(leaf, jax.core.Tracer) and not isinstance(leaf, DynamicJaxprTracer):
            raise TypeError(f"m3_jax.{op}: {name} is a {type(leaf).__name__} (from jax.vmap, jax.grad or another "
                            f"transform); m3 ops are inference kernels and support jax.jit only")
    dependent = next((name for name in _DEPENDENT if name in given), None)
    if dependent is None:
        return None
    if not validate.values_enabled():
        return given[dependent]
    bounds = validate.value_check_bounds(given)
    names = [name for name in validate.VALUE_CHECKED if name in given]

    def check(*values):
        try:
            validate.check_values({n: np.asarray(v) for n, v in zip(names, values)}, **bounds)
        except ValueError as e:
            raise ValueError(f"m3_jax.{op}: {e}") from None
        return np.zeros((), np.int32)

    values = [given[name] for name in names]
    if not any(isinstance(v, jax.core.Tracer) for v in values):
        check(*values)   # concrete: raise before any launch
        return given[dependent]
    token = jax.pure_callback(check, jax.ShapeDtypeStruct((), jnp.int32), *values)
    return given[dependent] + token.astype(given[dependent].dtype)
