"""Fused elementwise ops of the model step (JAX launchers of ``m3_kernels.norm``, ``.router`` and
``.qk_rope``).

The same kernels as ``m3_torch.fused``: compiled through jax-triton on a GPU
backend, interpreted inside ``jax.pure_callback`` on a CPU backend; every op
works under ``jax.jit``. Identical inputs give torch's bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from m3_kernels import norm as _norm
from m3_kernels.common import aligned
from m3_kernels.launches import TRITON_DTYPES
from m3_kernels import qk_rope as _qk_rope
from m3_kernels import router as _router

from . import guards
from ._triton_call import on_gpu, triton_call
from .api import _kv_scales
from .views import PagedView

__all__ = ["add_rms_norm", "rms_norm", "moe_route", "qk_norm_rope"]


def add_rms_norm(x, residual_in, weight, eps):
    """``residual_out = x + residual_in``, then ``rms_norm(residual_out, weight, eps)``
    -> (residual_out, normed), both ``[T, H]`` in x's dtype.

    Arguments and rounding as ``m3_torch.add_rms_norm`` (x, residual_in [T, H] bfloat16 / float16 /
    float32 of one dtype; weight [H] any float dtype; eps a Python float, static under ``jax.jit``).
    """
    return _launch_norm(x, residual_in, weight, eps)


def rms_norm(x, weight, eps):
    """The models' Gemma-style RMSNorm of the rows of ``x [T, H]`` -> ``[T, H]`` in x's dtype
    (``add_rms_norm`` without the residual: the same kernel and rounding)."""
    return _launch_norm(x, None, weight, eps)[1]


def _launch_norm(x, residual_in, weight, eps):
    rows, hidden, eps = _norm.check_norm_call(x, residual_in, weight, eps)
    out = jax.ShapeDtypeStruct((rows, hidden), x.dtype)
    has_residual = residual_in is not None
    if rows == 0:
        return jnp.zeros(out.shape, out.dtype) if has_residual else None, jnp.zeros(out.shape, out.dtype)
    # without a residual: x stands in for it and a one-element dummy for residual_out (neither is touched)
    residual = residual_in if has_residual else x
    residual_out = out if has_residual else jax.ShapeDtypeStruct((1,), x.dtype)
    config = _norm.block_sizes(rows, hidden, not on_gpu())
    grid, num_warps, num_stages = config.pop("grid"), config.pop("num_warps"), config.pop("num_stages")
    normed, residual_out = triton_call(
        x, residual, weight, rows, eps, hidden, 1, hidden, 1,
        kernel=("norm", "rms_norm_kernel"), out_shape=[out, residual_out], grid=grid, num_warps=num_warps,
        num_stages=num_stages, HIDDEN=hidden, HAS_RESIDUAL=has_residual, ALIGNED=aligned(hidden), **config)
    return (residual_out if has_residual else None), normed


def moe_route(x, router_weight, bias, top_k):
    """The MoE router's choice for each token -> (ids int32 ``[T, top_k]``, weights float32 ``[T, top_k]``).

    Arguments and semantics as ``m3_torch.moe_route`` (x [T, H] bfloat16 / float16 / float32;
    router_weight [E, H] x's dtype, E <= 256; bias [E] float32 or another float dtype; top_k a Python
    int in [1, min(8, E)], static under ``jax.jit``): ids best first, weights renormalised, no
    ``routed_scaling_factor``.
    """
    tokens, hidden, experts, top_k = _router.check_route_call(x, router_weight, bias, top_k)
    out_shape = [jax.ShapeDtypeStruct((tokens, top_k), jnp.int32), jax.ShapeDtypeStruct((tokens, top_k), jnp.float32)]
    if tokens == 0:
        return tuple(jnp.zeros(s.shape, s.dtype) for s in out_shape)
    logits, topk = _router.block_sizes(tokens, hidden, experts, top_k, not on_gpu())
    partial_shape = jax.ShapeDtypeStruct((logits["grid"][2], tokens, logits["EXPERTS_PAD"]), jnp.float32)
    partial = _launch("router_logits_kernel", logits, x, router_weight, tokens, hidden, 1, hidden, 1,
                      out_shape=partial_shape, HIDDEN=hidden, NUM_EXPERTS=experts, ALIGNED=aligned(hidden))
    ids, weights = _launch("router_topk_kernel", topk, partial, bias, tokens, out_shape=out_shape,
                           LOGIT_DTYPE=TRITON_DTYPES[str(x.dtype)], NUM_EXPERTS=experts, TOP_K=top_k)
    return ids, weights


def _launch(fn, config, *args, out_shape, **constexprs):
    """``triton_call`` of ``m3_kernels.router.<fn>`` with ``config`` (``block_sizes``': grid, warps, stages,
    block constexprs)."""
    config = dict(config)
    grid, num_warps, num_stages = config.pop("grid"), config.pop("num_warps"), config.pop("num_stages")
    return triton_call(*args, kernel=("router", fn), out_shape=out_shape, grid=grid, num_warps=num_warps,
                       num_stages=num_stages, **config, **constexprs)


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
    call = _qk_rope.check_qk_rope_call(qkv, positions, inv_freq, q_norm, k_norm, k_cache, v_cache, slot_mapping,
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
    dtype = qkv.dtype
    index_shape = (call.num_tokens, call.num_kv_heads, call.index_head_dim) if call.sparse else (1,)
    out_shape = [jax.ShapeDtypeStruct((call.num_tokens, call.num_q_heads, call.head_dim), dtype),
                 jax.ShapeDtypeStruct(index_shape, dtype), jax.ShapeDtypeStruct(buffer.shape, buffer.dtype)]
    if call.num_tokens == 0:
        q, idx_q = (jnp.zeros(s.shape, s.dtype) for s in out_shape[:2])
        return q, idx_q if call.sparse else None, k_cache, v_cache, index_k_cache
    scales = tuple(slot_mapping if s is None else s for s in _kv_scales(k_cache, k_scale, v_scale))
    index_cache = index_k_cache if call.sparse else k_cache   # never touched on a dense layer
    index_norms = (index_q_norm, index_k_norm) if call.sparse else (q_norm, k_norm)
    config = _qk_rope.launch_config(call, k_cache.dtype.name, index_cache.dtype.name, not on_gpu())
    grid, num_warps, num_stages = config.pop("grid"), config.pop("num_warps"), config.pop("num_stages")
    arrays = (qkv, positions, inv_freq, q_norm, k_norm, *index_norms, slot_mapping, *scales, buffer)
    offsets = (k_cache.offset, v_cache.offset, index_cache.offset if call.sparse else 0)
    strides = (*k_cache.strides, *v_cache.strides, *(index_cache.strides if call.sparse else (0, 0, 0)))
    width = int(qkv.shape[1])
    q, idx_q, buffer = triton_call(*arrays, *offsets, *strides, width, 1, call.num_tokens, call.eps,
                                   kernel=("qk_rope", "qk_norm_rope_kernel"), out_shape=out_shape, grid=grid,
                                   num_warps=num_warps, num_stages=num_stages,
                                   input_output_aliases={len(arrays) - 1: 2},   # the pool, in place
                                   ALIGNED=_qk_rope.aligned_layout(width, offsets, strides), **config)
    new = [None if c is None else PagedView(buffer, c.offset, c.shape, c.strides, c.dtype)
           for c in (k_cache, v_cache, index_k_cache)]
    return (q, idx_q if call.sparse else None, *new)
