"""Fused elementwise ops of the model step (JAX launchers of ``m3_kernels.norm``, ``.router`` and
``.qk_rope``).

The same kernels as ``m3_torch.fused``: compiled through jax-triton on a GPU
backend, interpreted inside ``jax.pure_callback`` on a CPU backend; every op
works under ``jax.jit``. Identical inputs give torch's bits.
"""

from __future__ import annotations

import jax.numpy as jnp

from m3_kernels import step_launches, validate

from . import guards
from ._triton_call import on_gpu
from .ops import kv_scales, operand, run
from .views import PagedView

__all__ = ["add_rms_norm", "rms_norm", "moe_route", "qk_norm_rope"]


def add_rms_norm(x, residual_in, weight, eps):
    """``residual_out = x + residual_in``, then ``rms_norm(residual_out, weight, eps)``
    -> (residual_out, normed), both ``[T, H]`` in x's dtype.

    Arguments and rounding as ``m3_torch.add_rms_norm`` (x, residual_in [T, H] bfloat16 / float16 /
    float32 of one dtype; weight [H] any float dtype; eps a Python float, static under ``jax.jit``).
    """
    return _launch_norm("add_rms_norm", x, residual_in, weight, eps)


def rms_norm(x, weight, eps):
    """The models' Gemma-style RMSNorm of the rows of ``x [T, H]`` -> ``[T, H]`` in x's dtype
    (``add_rms_norm`` without the residual: the same kernel and rounding)."""
    return _launch_norm("rms_norm", x, None, weight, eps)[1]


def _launch_norm(op, x, residual_in, weight, eps):
    rows, hidden, eps = validate.check_norm_call(x, residual_in, weight, eps)
    guards.check_call(op, x=x, residual_in=residual_in, weight=weight)
    has_residual = residual_in is not None
    if rows == 0:
        zeros = jnp.zeros((rows, hidden), x.dtype)
        return (zeros if has_residual else None), zeros
    out = run(step_launches.rms_norm(x=operand(x), residual=operand(residual_in) if has_residual else None,
                                     weight=weight, eps=eps, interpret=not on_gpu()))
    return out.get("residual_out"), out["normed"]


def moe_route(x, router_weight, bias, top_k):
    """The MoE router's choice for each token -> (ids int32 ``[T, top_k]``, weights float32 ``[T, top_k]``).

    Arguments and semantics as ``m3_torch.moe_route`` (x [T, H] bfloat16 / float16 / float32;
    router_weight [E, H] x's dtype, E <= 256; bias [E] float32 or another float dtype; top_k a Python
    int in [1, min(8, E)], static under ``jax.jit``): ids best first, weights renormalised, no
    ``routed_scaling_factor``.
    """
    tokens, hidden, experts, top_k = validate.check_route_call(x, router_weight, bias, top_k)
    guards.check_call("moe_route", x=x, router_weight=router_weight, bias=bias)
    if tokens == 0:
        return jnp.zeros((0, top_k), jnp.int32), jnp.zeros((0, top_k), jnp.float32)
    out = run(step_launches.moe_route(x=operand(x), router_weight=operand(router_weight), bias=bias, top_k=top_k,
                                      interpret=not on_gpu()))
    return out["ids"], out["weights"]


def qk_norm_rope(qkv, positions, inv_freq, q_norm, k_norm, k_cache, v_cache, slot_mapping, *, num_q_heads, eps,
                 index_q_norm=None, index_k_norm=None, index_k_cache=None, k_scale=None, v_scale=None):
    """One attention layer's q/k norms and RoPE from the fused projection, k/v/index-k written to the caches
    -> (q ``[T, Hq, D]``, idx_q ``[T, Hi, Di]`` or None, k_cache, v_cache, index_k_cache).

    Arguments and semantics as ``m3_torch.qk_norm_rope``; the caches are PagedViews of one buffer (a layer
    of the pool: ``m3_jax.layer_views``) and come back over the new buffer (the same memory under
    ``jax.jit`` with the pool donated); num_q_heads and eps are static.
    """
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache), ("index_k_cache", index_k_cache)):
        if cache is not None and not isinstance(cache, PagedView):
            raise TypeError(f"{name}: expected a PagedView of the pool (m3_jax.layer_views), got "
                            f"{type(cache).__name__}")
    call = validate.check_qk_rope_call(qkv, positions, inv_freq, q_norm, k_norm, k_cache, v_cache, slot_mapping,
                                       num_q_heads=num_q_heads, eps=eps, index_q_norm=index_q_norm,
                                       index_k_norm=index_k_norm, index_k_cache=index_k_cache, k_scale=k_scale,
                                       v_scale=v_scale)
    slot_mapping = guards.check_call("qk_norm_rope", qkv=qkv, k_cache=k_cache, v_cache=v_cache,
                                     index_k_cache=index_k_cache, slot_mapping=slot_mapping)
    caches = {"k_cache": k_cache, "v_cache": v_cache, "index_k_cache": index_k_cache}
    caches = {name: c for name, c in caches.items() if c is not None}
    buffer = k_cache.buffer
    if any(c.buffer is not buffer for c in caches.values()):
        raise ValueError(f"{', '.join(caches)}: expected views of one buffer (a layer of the pool: "
                         "m3_jax.layer_views), got separate buffers")
    if call.num_tokens == 0:
        q = jnp.zeros((0, call.num_q_heads, call.head_dim), qkv.dtype)
        idx_q = jnp.zeros((0, call.num_kv_heads, call.index_head_dim), qkv.dtype) if call.sparse else None
        return q, idx_q, k_cache, v_cache, index_k_cache
    k_scale, v_scale = kv_scales(k_cache, k_scale, v_scale)
    out = run(step_launches.qk_norm_rope(
        call=call, qkv=operand(qkv), positions=positions, inv_freq=inv_freq, q_norm=q_norm, k_norm=k_norm,
        index_q_norm=index_q_norm, index_k_norm=index_k_norm, slot_mapping=slot_mapping, k_cache=operand(k_cache),
        v_cache=operand(v_cache), index_k_cache=None if index_k_cache is None else operand(index_k_cache),
        pool=operand(buffer), interpret=not on_gpu(), k_scale=k_scale, v_scale=v_scale))
    new = [None if c is None else PagedView(out["pool"], c.offset, c.shape, c.strides, c.dtype)
           for c in (k_cache, v_cache, index_k_cache)]
    return (out["q"], out.get("idx_q"), *new)
