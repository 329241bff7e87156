"""Tensor parallelism for ``m3_jax.LLM``: one process, a ``Mesh`` over local devices, ``shard_map``.

    llm = m3_jax.LLM(model_dir, tensor_parallel_size=2)   # the first 2 devices of the default backend

The split is ``m3_engine.tp`` (the same as ``m3_torch``'s). Here:

* **mesh**: ``Mesh(devices, ("tp",))``; shard ``r`` is rank ``r`` of the plan.
* **weights**: global arrays laid out with ``NamedSharding``: a sharded tensor
  is its ranks' slices concatenated along the split axis, sharded over "tp"
  on that axis, so shard ``r`` holds exactly rank ``r``'s slice (a packed
  gate/up slice ``[gate_r; up_r]``; a KV head replicated on several ranks
  appears once per rank). Each rank's slice is read from the checkpoint on
  its own (``checkpoint.iter_weights(shard=...)``) and put on its device;
  no device holds a whole sharded tensor. The rest is replicated, except
  ``lm_head``, split over the vocabulary when ``tp`` divides it (XLA runs
  the head's GEMM and the sampling on the shards; replicated otherwise).
* **pool**: ``[tp, layout.numel]`` sharded on axis 0: shard ``r``'s row is a
  whole flat pool laid out for ITS heads (``TPPlan.local_config``) with the
  full index-K, written and read by that shard's kernels only.
* **step**: :func:`forward` is ``shard_map`` over the mesh of the model's
  :func:`m3_jax.model.hidden_states` with the shard's weights, pool row and
  the replicated step metadata; the row-parallel partial sums go through
  ``jax.lax.psum(x, "tp")`` (an XLA all-reduce). The attention kernels run per
  shard inside it (jax-triton launches on GPUs, the interpreter's
  ``pure_callback`` on CPUs). Its output (the hidden rows to sample) is
  replicated; the head and the sampler run outside, under ``jax.jit``'s
  sharding propagation.

The scheduler, planner and step padding are the engine's, unchanged: every
shard sees the same step (the plans are made for one shard's heads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from m3_engine import checkpoint
from m3_kernels.pool import PoolLayout
from m3_engine.tp import TPPlan

from . import model

__all__ = ["AXIS", "make_mesh", "param_spec", "load_params", "allocate_pool", "forward", "replicated"]

AXIS = "tp"


def make_mesh(devices) -> Mesh:
    return Mesh(np.asarray(devices), (AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def param_spec(plan: TPPlan, name: str, ndim: int) -> P:
    """The PartitionSpec of canonical tensor ``name`` in the global (TP-layout) params."""
    if name == "lm_head.weight":
        return P(AXIS, None) if plan.config.vocab_size % plan.size == 0 else P()
    cut = plan.slice(name, 0)
    if cut is None:
        return P()
    return P(*[AXIS if d == cut.dim else None for d in range(ndim)])


def load_params(model_dir, plan: TPPlan, mesh: Mesh, dtype: str | None) -> tuple[dict, str]:
    """-> ``(params, dtype name)``: every tensor as a global array sharded by :func:`param_spec`.

    The ranks' checkpoint readers advance together, one tensor at a time, so
    the host holds one tensor's slices at a time; each slice goes straight to
    its device.
    """
    c = plan.config
    devices = list(mesh.devices.flat)
    readers = [checkpoint.iter_weights(model_dir, c, framework="numpy", shard=plan.rank(r),
                                       skip=("lm_head.weight",) if c.tie_word_embeddings else ())
               for r in range(plan.size)]
    params = {}
    for shards in zip(*readers):
        name = shards[0][0]
        dtype = dtype or c.dtype or np.dtype(shards[0][1].dtype).name
        locals_ = [np.asarray(w).astype(jnp.dtype(dtype)) for _, w in shards]
        spec = param_spec(plan, name, locals_[0].ndim)
        sharding = NamedSharding(mesh, spec)
        if plan.slice(name, 0) is None:   # replicated, or lm_head split over the vocabulary by device_put
            params[name] = jax.device_put(locals_[0], sharding)
        else:
            axis = list(spec).index(AXIS)
            shape = list(locals_[0].shape)
            shape[axis] *= plan.size
            params[name] = jax.make_array_from_single_device_arrays(
                tuple(shape), sharding, [jax.device_put(w, d) for w, d in zip(locals_, devices)])
    return params, dtype


def allocate_pool(layout: PoolLayout, mesh: Mesh) -> jax.Array:
    """A zero-filled ``[tp, layout.numel]`` pool, row ``r`` on shard ``r`` (never whole on one device)."""
    shape = (mesh.devices.size,) + layout.shape
    zeros = jax.jit(lambda: jnp.zeros(shape, jnp.dtype(layout.buffer_dtype)),
                    out_shardings=NamedSharding(mesh, P(AXIS)))
    return zeros()


def forward(params: dict, pool, batch: model.StepBatch, maps, *, plan: TPPlan, layout: PoolLayout, spec,
            mesh: Mesh):
    """One step on every shard -> ``(logits [L, vocab] float32, pool)``: :func:`model.forward` split over
    the mesh (``layout``: one shard's pool layout; ``spec``: the step's ``StepSpec`` for one shard's heads)."""
    local = plan.local_config
    body_params = {n: w for n, w in params.items() if n != "lm_head.weight"}
    param_specs = {n: param_spec(plan, n, w.ndim) for n, w in body_params.items()}

    def shard(params, pool, batch, maps):
        x, new_pool = model.hidden_states(params, pool[0], batch, maps, config=local, layout=layout, spec=spec,
                                          all_reduce=lambda t: jax.lax.psum(t, AXIS))
        return x[batch.logits_rows], new_pool[None]

    metadata = jax.tree.map(lambda _: P(), (batch, maps))
    x, pool = jax.shard_map(shard, mesh=mesh, in_specs=(param_specs, P(AXIS), *metadata),
                            out_specs=(P(), P(AXIS)))(body_params, pool, batch, maps)
    return model.logits(params, x, config=plan.config), pool
