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
  no device holds a whole sharded tensor. The embedding and ``lm_head`` are
  split over the vocabulary (``TPPlan.vocab_rows`` rows a shard, the last
  shards' padded with zero rows); with expert parallelism the routed experts
  over their experts' axis (``E / tp`` whole experts a shard). The rest is
  replicated.
* **pool**: ``[tp, layout.numel]`` sharded on axis 0: shard ``r``'s row is a
  whole flat pool laid out for ITS heads (``TPPlan.local_config``) with the
  full index-K, written and read by that shard's kernels only.
* **step**: :func:`forward` is ``shard_map`` over the mesh of the model's
  :func:`m3_jax.model.hidden_states` with the shard's weights, pool row and
  the replicated step metadata and the shard's first vocabulary row and
  expert (from ``jax.lax.axis_index``: the embedding lookup and, under expert
  parallelism, the MoE run on the shard's rows and experts only); the
  row-parallel partial sums (and the embedding) go through
  ``jax.lax.psum(x, "tp")`` (an XLA all-reduce). The attention kernels run per
  shard inside it (jax-triton launches on GPUs, the interpreter's
  ``pure_callback`` on CPUs). Its output (the hidden rows to sample) is
  replicated; the vocab-sharded head (padding columns cut off) and the
  sampler run outside, under ``jax.jit``'s sharding propagation: XLA computes
  each shard's logits columns and gathers them.

The scheduler, planner and step padding are the engine's, unchanged: every
shard sees the same step (the plans are made for one shard's heads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from m3_engine import checkpoint
from m3_engine.quantization import is_quantized, is_scale, load_stream, weight_name
from m3_kernels.pool import PoolLayout
from m3_engine.tp import TPPlan

from . import fp8, model

__all__ = ["AXIS", "make_mesh", "param_spec", "load_params", "allocate_pool", "forward", "replicated"]

AXIS = "tp"


def make_mesh(devices) -> Mesh:
    return Mesh(np.asarray(devices), (AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def param_spec(plan: TPPlan, name: str, ndim: int) -> P:
    """The PartitionSpec of canonical tensor ``name`` in the global (TP-layout) params."""
    cut = plan.slice(weight_name(name), 0)   # an FP8 scale splits on its weight's axis
    if cut is None:
        return P()
    return P(*[AXIS if d == cut.dim else None for d in range(ndim)])


def load_params(model_dir, plan: TPPlan, mesh: Mesh, dtype: str | None, *, quantization: str | None = None,
                checkpoint_quantization: str | None = None) -> tuple[dict, str]:
    """-> ``(params, dtype name)``: every tensor as a global array sharded by :func:`param_spec`.

    The ranks' checkpoint readers advance together, one tensor at a time, so
    the host holds one tensor's slices at a time; each slice goes straight to
    its device. ``quantization="fp8"``: each rank's slice of a quantized weight is
    quantized (or converted from MXFP8) on its device (``m3_engine.quantization``).
    """
    c = plan.config
    devices = list(mesh.devices.flat)
    held = checkpoint.expected_shapes(c)

    def reader(r):
        put = functools.partial(jax.device_put, device=devices[r])
        return load_stream(checkpoint.iter_weights(model_dir, c, framework="numpy", shard=plan.rank(r),
                                                   skip=("lm_head.weight",) if c.tie_word_embeddings else ()),
                           checkpoint=checkpoint_quantization, quantization=quantization,
                           quantize=lambda w: fp8.quantize_weight(put(w)),
                           dequantize_mxfp8=lambda codes, scale: fp8.dequantize_mxfp8(put(codes), put(scale)))

    params = {}
    for shards in zip(*[reader(r) for r in range(plan.size)]):
        name = shards[0][0]
        dtype = dtype or c.dtype or np.dtype(shards[0][1].dtype).name
        fp8_part = quantization is not None and (is_quantized(name) or is_scale(name))   # kept as they are
        # the vocabulary tensors of the last ranks: padded with zero rows to the held shape
        locals_ = [w if fp8_part else
                   _pad_rows(np.asarray(w).astype(jnp.dtype(dtype)), plan.rank(r).shape(name, held[name])[0])
                   for r, (_, w) in enumerate(shards)]
        spec = param_spec(plan, name, locals_[0].ndim)
        sharding = NamedSharding(mesh, spec)
        if plan.slice(weight_name(name), 0) is None:   # replicated
            params[name] = jax.device_put(locals_[0], sharding)
        else:
            axis = list(spec).index(AXIS)
            shape = list(locals_[0].shape)
            shape[axis] *= plan.size
            params[name] = jax.make_array_from_single_device_arrays(
                tuple(shape), sharding, [jax.device_put(w, d) for w, d in zip(locals_, devices)])
    return params, dtype


def _pad_rows(w: np.ndarray, rows: int) -> np.ndarray:
    return w if w.shape[0] == rows else np.concatenate([w, np.zeros((rows - w.shape[0],) + w.shape[1:], w.dtype)])


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
        rank = jax.lax.axis_index(AXIS)
        x, new_pool = model.hidden_states(params, pool[0], batch, maps, config=local, layout=layout, spec=spec,
                                          all_reduce=lambda t: jax.lax.psum(t, AXIS),
                                          vocab_start=rank * plan.vocab_rows,
                                          expert_start=rank * plan.num_experts if plan.expert_parallel else None)
        return x[batch.logits_rows], new_pool[None]

    metadata = jax.tree.map(lambda _: P(), (batch, maps))
    x, pool = jax.shard_map(shard, mesh=mesh, in_specs=(param_specs, P(AXIS), *metadata),
                            out_specs=(P(), P(AXIS)))(body_params, pool, batch, maps)
    # the vocab-sharded head: XLA runs each shard's columns and gathers them for the sampler
    return model.logits(params, x, config=plan.config)[:, :plan.config.vocab_size], pool
