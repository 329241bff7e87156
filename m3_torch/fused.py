"""Fused elementwise ops of the model step (PyTorch launchers of ``m3_kernels.norm``, ``.router`` and
``.qk_rope``).

CUDA tensors run the compiled kernels, CPU tensors the same kernels in Triton's
interpreter. No host synchronisation (a decode step stays graph-capturable).
The JAX twins (``m3_jax.fused``) launch the same kernels and give the same bits.
"""

from __future__ import annotations

import torch

from m3_kernels import kernel_module, validate
from m3_kernels.common import aligned
from m3_kernels.launches import TRITON_DTYPES
from m3_kernels import norm as _norm
from m3_kernels import qk_rope as _qk_rope
from m3_kernels import router as _router

from . import guards, ops
from .api import _kv_scales
from .cache import _storage_bytes

__all__ = ["add_rms_norm", "rms_norm", "moe_route", "qk_norm_rope"]


def add_rms_norm(x, residual_in, weight, eps):
    """``residual_out = x + residual_in``, then ``rms_norm(residual_out, weight, eps)``
    -> (residual_out, normed), both ``[T, H]`` in x's dtype.

    x, residual_in: [T, H] bfloat16 / float16 / float32 (the same dtype), any strides.
    weight:         [H], any float dtype: the norm scales by ``1 + weight`` (Gemma style).
    eps:            float.

    ``residual_out`` is the float32 sum rounded once to x's dtype (torch's add); ``normed`` is the
    models' ``rms_norm`` of it (m3_torch/model.py), its mean of squares summed exactly
    (``m3_kernels.norm``).
    """
    return _launch_norm(x, residual_in, weight, eps)


def rms_norm(x, weight, eps):
    """The models' Gemma-style RMSNorm of the rows of ``x [T, H]`` -> ``[T, H]`` in x's dtype
    (``add_rms_norm`` without the residual: the same kernel and rounding)."""
    return _launch_norm(x, None, weight, eps)[1]


def _launch_norm(x, residual_in, weight, eps):
    rows, hidden, eps = _norm.check_norm_call(x, residual_in, weight, eps)
    _check_devices(x=x, residual_in=residual_in, weight=weight)
    normed = _new_output((rows, hidden), x.dtype, x.device)
    residual_out = normed if residual_in is None else _new_output((rows, hidden), x.dtype, x.device)
    if rows == 0:
        return residual_out, normed
    residual = x if residual_in is None else residual_in   # never read without a residual
    config = _norm.block_sizes(rows, hidden, x.device.type != "cuda")
    _run("norm", "rms_norm_kernel", config, x, residual, weight.contiguous(), rows, eps, *x.stride(),
         *residual.stride(), normed, residual_out, HIDDEN=hidden, HAS_RESIDUAL=residual_in is not None,
         ALIGNED=aligned(x.stride(0), residual.stride(0)))
    return residual_out, normed


def moe_route(x, router_weight, bias, top_k):
    """The MoE router's choice for each token -> (ids int32 ``[T, top_k]``, weights float32 ``[T, top_k]``).

    x:             [T, H] bfloat16 / float16 / float32, any strides.
    router_weight: [E, H] x's dtype, any strides; E <= 256.
    bias:          [E] float32 (or another float dtype, widened exactly): e_score_correction_bias.
    top_k:         int in [1, min(8, E)].

    ``probs = sigmoid(x @ router_weight.T)`` (float32 accumulation, the logits rounded to x's dtype
    as ``F.linear`` rounds them); the ``top_k`` experts of ``probs + bias``, best first, equal scores
    to the lowest id, NaN scores last; ``weights``: their ``probs`` over the sum of them (without
    ``routed_scaling_factor``). See ``m3_kernels.router``.
    """
    tokens, hidden, experts, top_k = _router.check_route_call(x, router_weight, bias, top_k)
    device = _check_devices(x=x, router_weight=router_weight, bias=bias)
    ids = _new_output((tokens, top_k), torch.int32, device)
    weights = _new_output((tokens, top_k), torch.float32, device)
    if tokens == 0:
        return ids, weights
    logits, topk = _router.block_sizes(tokens, hidden, experts, top_k, device.type != "cuda")
    partial = torch.empty((logits["grid"][2], tokens, logits["EXPERTS_PAD"]), dtype=torch.float32, device=device)
    _run("router", "router_logits_kernel", logits, x, router_weight, tokens, *x.stride(), *router_weight.stride(),
         partial, HIDDEN=hidden, NUM_EXPERTS=experts, ALIGNED=aligned(x.stride(0), router_weight.stride(0)))
    _run("router", "router_topk_kernel", topk, partial, bias.contiguous(), tokens, ids, weights,
         LOGIT_DTYPE=TRITON_DTYPES[validate.dtype_name(x)], NUM_EXPERTS=experts, TOP_K=top_k)
    return ids, weights


def qk_norm_rope(qkv, positions, inv_freq, q_norm, k_norm, k_cache, v_cache, slot_mapping, *, num_q_heads, eps,
                 index_q_norm=None, index_k_norm=None, index_k_cache=None, k_scale=None, v_scale=None):
    """One attention layer's q/k norms and RoPE from the fused projection, k/v/index-k written to the caches
    -> (q ``[T, Hq, D]``, idx_q ``[T, Hi, Di]`` or None on a dense layer), in qkv's dtype.

    qkv:          [T, Hq*D + 2*Hk*D (+ Hi*Di + Di)] bfloat16 / float16 / float32, any strides: the models'
                  fused projection (q heads, k heads, v heads, then on a sparse layer Hi = Hk index-q heads
                  and the one index-k head).
    positions:    [T] int32 / int64.
    inv_freq:     [rotary_dim / 2] float32, the model's RoPE frequencies (rotary_dim <= D).
    q_norm, k_norm: [D]; index_q_norm, index_k_norm: [Di] (sparse layers): norm weights, any float dtype.
    k_cache, v_cache: [slots, Hk, 128, D]; index_k_cache: [slots, 128, Di] (sparse layers): qkv's dtype or
                  float8_e4m3fn, views of ONE buffer (a layer of the pool, ``m3_torch.layer_caches``).
    slot_mapping: [T] int32 / int64: token t goes to row ``% 128`` of page ``// 128``; -1 skips it.
    num_q_heads:  Hq. eps: the norms' epsilon.
    k_scale, v_scale: FP8 K/V caches only, as in ``write_cache`` (None: 1.0).

    q and k: ``rms_norm`` (the models' Gemma RMSNorm) then RoPE on the first rotary_dim channels; idx_q and
    idx_k the same with the index norms on the first ``min(rotary_dim, Di)`` channels; v as it is. Rounded
    as the unfused model except where ``m3_kernels.qk_rope`` says. The caches are updated in place.
    """
    call = _qk_rope.check_qk_rope_call(qkv, positions, inv_freq, q_norm, k_norm, k_cache, v_cache, slot_mapping,
                                       num_q_heads=num_q_heads, eps=eps, index_q_norm=index_q_norm,
                                       index_k_norm=index_k_norm, index_k_cache=index_k_cache, k_scale=k_scale,
                                       v_scale=v_scale)
    guards.check_call("qk_norm_rope", qkv=qkv, k_cache=k_cache, v_cache=v_cache, index_k_cache=index_k_cache,
                      slot_mapping=slot_mapping)
    device = _check_devices(qkv=qkv, positions=positions, inv_freq=inv_freq, q_norm=q_norm, k_norm=k_norm,
                            k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, index_q_norm=index_q_norm,
                            index_k_norm=index_k_norm, index_k_cache=index_k_cache, k_scale=k_scale, v_scale=v_scale)
    caches = {"k_cache": k_cache, "v_cache": v_cache, "index_k_cache": index_k_cache}
    caches = {name: c for name, c in caches.items() if c is not None}
    if len({c.untyped_storage().data_ptr() for c in caches.values()}) != 1:
        raise ValueError(f"{', '.join(caches)}: expected views of one buffer (a layer of the pool: "
                         "m3_torch.layer_caches), got separate buffers")
    q = _new_output((call.num_tokens, call.num_q_heads, call.head_dim), qkv.dtype, device)
    idx_q = None
    if call.sparse:
        idx_q = _new_output((call.num_tokens, call.num_kv_heads, call.index_head_dim), qkv.dtype, device)
    if call.num_tokens == 0:
        return q, idx_q
    k_scale, v_scale = _kv_scales(k_cache, k_scale, v_scale, device)
    pool = _storage_bytes(k_cache)
    index_cache = index_k_cache if call.sparse else k_cache   # never touched on a dense layer
    index_norms = (index_q_norm, index_k_norm) if call.sparse else (q_norm, k_norm)
    config = _qk_rope.launch_config(call, validate.dtype_name(k_cache), validate.dtype_name(index_cache),
                                    device.type != "cuda")
    offsets = (k_cache.storage_offset(), v_cache.storage_offset(), index_cache.storage_offset() if call.sparse else 0)
    strides = (*k_cache.stride(), *v_cache.stride(), *(index_cache.stride() if call.sparse else (0, 0, 0)))
    _run("qk_rope", "qk_norm_rope_kernel", config,
         qkv, positions.contiguous(), inv_freq.contiguous(), q_norm.contiguous(), k_norm.contiguous(),
         *(w.contiguous() for w in index_norms), slot_mapping.contiguous(),
         slot_mapping if k_scale is None else k_scale, slot_mapping if v_scale is None else v_scale, pool,
         *offsets, *strides, *qkv.stride(), call.num_tokens, call.eps, q, q if idx_q is None else idx_q, pool,
         ALIGNED=_qk_rope.aligned_layout(qkv.stride(0), offsets, strides))
    return q, idx_q


# -- shared -------------------------------------------------------------------------------

def _new_output(shape, dtype, device) -> torch.Tensor:
    """A new output tensor (the kernels write every element; the tests poison these with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check_devices(**tensors) -> torch.device:
    """All given tensors on the device of the first -> that device."""
    given = {name: t for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    first_name, first = next(iter(given.items()))
    for name, t in given.items():
        if t.device != first.device:
            raise ValueError(f"{name}: expected a tensor on {first.device} (the device of {first_name}), "
                             f"got {t.device}")
    return first.device


def _run(module: str, fn: str, config: dict, *args, **constexprs):
    """Launch ``m3_kernels.<module>.<fn>`` with ``config`` (``block_sizes``: grid, warps, stages, block
    constexprs) on the device of the first tensor argument."""
    config = dict(config)
    grid, num_warps, num_stages = config.pop("grid"), config.pop("num_warps"), config.pop("num_stages")
    device = next(a for a in args if isinstance(a, torch.Tensor)).device
    pdl = ops._grid_dependency(device)
    kernel = getattr(kernel_module(module, device.type != "cuda"), fn)
    kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl["PDL"], **config, **constexprs,
                 **pdl)
