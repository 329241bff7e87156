"""``fused_moe``: the routed experts of an MoE layer (JAX launcher of ``m3_kernels.moe``).

The same four kernels and launch parameters as ``m3_torch.fused_moe``: compiled through jax-triton on a
GPU backend, interpreted inside ``jax.pure_callback`` on a CPU backend; works under ``jax.jit``.
Identical inputs give torch's bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from m3_kernels import moe as _moe

from ._triton_call import on_gpu, triton_call

__all__ = ["fused_moe"]


def fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights, *, swiglu_alpha: float, swiglu_limit: float,
              routed_scaling_factor: float = 1.0, shared_gate_up=None, shared_down=None):
    """``scale * sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) (+ shared_expert(x[t]))`` -> [T, H]
    in x's dtype.

    Arguments and semantics as ``m3_torch.fused_moe`` (x [T, H]; w_gate_up [E, 2I, H]; w_down [E, H, I];
    topk_ids [T, k] int32; topk_weights [T, k] float32; shared_gate_up [2I, H] and shared_down [H, I], or
    neither).
    """
    tokens, experts, top_k, hidden, inter = _moe.check_moe_call(x, w_gate_up, w_down, topk_ids, topk_weights,
                                                                shared_gate_up, shared_down)
    if tokens == 0:
        return jnp.zeros((0, hidden), x.dtype)
    return _fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights, shared_gate_up, shared_down,
                      alpha=float(swiglu_alpha), limit=float(swiglu_limit), scale=float(routed_scaling_factor),
                      interpret=not on_gpu())


@functools.partial(jax.jit, static_argnames=("alpha", "limit", "scale", "interpret"))
def _fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights, shared_gate_up, shared_down, *, alpha, limit, scale,
               interpret):
    (tokens, hidden), (experts, two_inter, _), top_k = x.shape, w_gate_up.shape, topk_ids.shape[1]
    inter, shared = two_inter // 2, shared_gate_up is not None
    plan = _moe.plan(tokens, experts, top_k, shared, hidden, inter, x.dtype.itemsize, interpret)
    i32 = jnp.int32

    def launch(name, step, *args, out_shape):
        return triton_call(*args, kernel=("moe", name), out_shape=out_shape, grid=step.grid,
                           num_warps=step.num_warps, num_stages=step.num_stages, **step.constexprs)

    routing = launch("align_kernel", plan.align, topk_ids, tokens,
                     out_shape=[jax.ShapeDtypeStruct((plan.num_rows,), i32),
                                jax.ShapeDtypeStruct((plan.num_blocks,), i32),
                                jax.ShapeDtypeStruct((plan.num_blocks,), i32)])
    act = launch("gate_up_kernel", plan.gate_up, x, w_gate_up, shared_gate_up if shared else w_gate_up, *routing,
                 alpha, limit, out_shape=jax.ShapeDtypeStruct((plan.num_rows, inter), x.dtype))
    weighted = launch("down_kernel", plan.down, act, w_down, shared_down if shared else w_down, *routing,
                      topk_weights, out_shape=jax.ShapeDtypeStruct((plan.num_pairs, hidden), jnp.float32))
    return launch("sum_kernel", plan.sum, weighted, scale, out_shape=jax.ShapeDtypeStruct((tokens, hidden), x.dtype))
