"""``load_format="dummy"`` in JAX: the random weights of ``m3_engine.dummy_weights``, drawn on the device.

Each tensor is ``jax.random.normal`` (float32, scaled, cast to the model
dtype) of a threefry key made from the tensor's seed, in one jitted call
whose output lives where the engine keeps it: on the engine's device, or,
with tensor parallelism, laid out as ``m3_jax.tp.load_params`` lays out the
checkpoint's tensors (a sharded tensor is its ranks' slices, each drawn on
its rank's device from that slice's seed; a replicated one is drawn with the
same key on every device). Nothing goes through the host; the cost is one
compilation per distinct tensor shape (~15 for an M3 model of any depth,
seconds on a CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from m3_engine.dummy_weights import DummyTensor, dummy_tensors
from m3_engine.tp import TPPlan

from .tp import AXIS, param_spec

__all__ = ["dummy_params"]


def dummy_params(plan: TPPlan, *, dtype: str, seed: int, mesh: Mesh | None = None) -> dict:
    """Canonical name -> random array of ``dtype`` for ``plan.config`` (tied ``lm_head`` left out).

    mesh: None: every array on JAX's default device (the caller's ``jax.default_device``);
          else global arrays sharded by ``m3_jax.tp.param_spec`` over the mesh's "tp" axis.
    """
    if mesh is None:
        return {t.name: _draw(t, dtype) for t in dummy_tensors(plan.config, seed)}
    ranks = [dummy_tensors(plan.config, seed, shard=plan.rank(r)) for r in range(plan.size)]
    devices = list(mesh.devices.flat)
    params = {}
    for tensors in zip(*ranks):
        name = tensors[0].name
        spec = param_spec(plan, name, len(tensors[0].shape))
        sharding = NamedSharding(mesh, spec)
        if plan.slice(name, 0) is None:   # replicated
            params[name] = _draw(tensors[0], dtype, sharding)
        else:
            shape = list(tensors[0].shape)
            shape[list(spec).index(AXIS)] *= plan.size
            params[name] = jax.make_array_from_single_device_arrays(
                tuple(shape), sharding, [_draw(t, dtype, device) for t, device in zip(tensors, devices)])
    return params


def _draw(t: DummyTensor, dtype: str, placement=None) -> jax.Array:
    """``t`` drawn by ``jax.random`` from its seed, on ``placement`` (a device or a sharding; None: the
    default device)."""
    key = jax.random.wrap_key_data(np.array([t.seed >> 32, t.seed & 0xFFFFFFFF], np.uint32), impl="threefry2x32")
    if placement is not None and not isinstance(placement, jax.sharding.Sharding):
        placement = jax.sharding.SingleDeviceSharding(placement)
    return _normal(placement)(key, np.float32(t.std), shape=t.shape, dtype=jnp.dtype(dtype))


@functools.lru_cache(maxsize=None)
def _normal(sharding):
    """The jitted draw whose output has ``sharding`` (None: the default device's). A tensor with an
    experts axis (3-D) is drawn one expert at a time, so the generator's temporaries (its counters and
    bits, which XLA may materialize) stay the size of one expert, not of the tensor (~5e9 values in M3)."""
    def normal(key, std, *, shape, dtype):
        def draw(k, s):
            return (jax.random.normal(k, s, jnp.float32) * std).astype(dtype)

        if len(shape) < 3:
            return draw(key, shape)
        return jax.lax.map(lambda k: draw(k, shape[1:]), jax.random.split(key, shape[0]))

    return jax.jit(normal, static_argnames=("shape", "dtype"), out_shardings=sharding)
