"""``fused_moe``: the routed experts of an MoE layer (JAX launcher of ``m3_kernels.moe``).

The same four kernels and launch parameters as ``m3_torch.fused_moe``: compiled through jax-triton on a
GPU backend, interpreted inside ``jax.pure_callback`` on a CPU backend; works under ``jax.jit``.
Identical inputs give torch's bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from m3_kernels import step_launches, validate

from . import guards
from ._triton_call import on_gpu
from .ops import operand, run

__all__ = ["fused_moe"]


def fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights, *, swiglu_alpha: float, swiglu_limit: float,
              routed_scaling_factor: float = 1.0, shared_gate_up=None, shared_down=None):
    """``scale * sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) (+ shared_expert(x[t]))`` -> [T, H]
    in x's dtype.

    Arguments and semantics as ``m3_torch.fused_moe`` (x [T, H]; w_gate_up [E, 2I, H]; w_down [E, H, I];
    topk_ids [T, k] int32; topk_weights [T, k] float32; shared_gate_up [2I, H] and shared_down [H, I], or
    neither).
    """
    tokens, experts, top_k, hidden, inter = validate.check_moe_call(x, w_gate_up, w_down, topk_ids, topk_weights,
                                                                    shared_gate_up, shared_down)
    guards.check_call("fused_moe", x=x, w_gate_up=w_gate_up, w_down=w_down, topk_ids=topk_ids,
                      topk_weights=topk_weights, shared_gate_up=shared_gate_up, shared_down=shared_down)
    if tokens == 0:
        return jnp.zeros((0, hidden), x.dtype)
    return _fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights, shared_gate_up, shared_down,
                      alpha=float(swiglu_alpha), limit=float(swiglu_limit), scale=float(routed_scaling_factor),
                      interpret=not on_gpu())


@functools.partial(jax.jit, static_argnames=("alpha", "limit", "scale", "interpret"))
def _fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights, shared_gate_up, shared_down, *, alpha, limit, scale,
               interpret):
    """The checked call, one jitted function (eager callers compile its four launches once per shape)."""
    launch = step_launches.fused_moe(
        x=operand(x), w_gate_up=operand(w_gate_up), w_down=operand(w_down), topk_ids=operand(topk_ids),
        topk_weights=topk_weights, shared_gate_up=None if shared_gate_up is None else operand(shared_gate_up),
        shared_down=None if shared_down is None else operand(shared_down), swiglu_alpha=alpha, swiglu_limit=limit,
        routed_scaling_factor=scale, interpret=interpret)
    return run(launch)["out"]
