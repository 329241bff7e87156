"""Fused elementwise ops of the model step (PyTorch launchers of ``m3_kernels.norm``, ``.router`` and
``.qk_rope``).

CUDA tensors run the compiled kernels, CPU tensors the same kernels in Triton's
interpreter. No host synchronisation (a decode step stays graph-capturable).
The JAX twins (``m3_jax.fused``) launch the same kernels and give the same bits.
"""

from __future__ import annotations

import torch

from m3_kernels import step_launches, validate
from m3_kernels.launches import Operand

from . import guards, ops
from .cache import storage_bytes
from .ops import compiled, operand, run

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
    return _launch_norm("add_rms_norm", x, residual_in, weight, eps)


def rms_norm(x, weight, eps):
    """The models' Gemma-style RMSNorm of the rows of ``x [T, H]`` -> ``[T, H]`` in x's dtype
    (``add_rms_norm`` without the residual: the same kernel and rounding)."""
    return _launch_norm("rms_norm", x, None, weight, eps)[1]


def _launch_norm(op, x, residual_in, weight, eps):
    rows, hidden, eps = validate.check_norm_call(x, residual_in, weight, eps)
    guards.check_call(op, x=x, residual_in=residual_in, weight=weight)
    guards.check_devices(x=x, residual_in=residual_in, weight=weight)
    normed = _new_output((rows, hidden), x.dtype, x.device)
    residual_out = normed if residual_in is None else _new_output((rows, hidden), x.dtype, x.device)
    if rows == 0:
        return residual_out, normed
    outputs = {"normed": normed} if residual_in is None else {"normed": normed, "residual_out": residual_out}
    run(step_launches.rms_norm(x=operand(x), residual=None if residual_in is None else operand(residual_in),
                               weight=weight.contiguous(), eps=eps, interpret=not compiled(x.device)),
        outputs)
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
    tokens, hidden, experts, top_k = validate.check_route_call(x, router_weight, bias, top_k)
    guards.check_call("moe_route", x=x, router_weight=router_weight, bias=bias)
    device = guards.check_devices(x=x, router_weight=router_weight, bias=bias)
    ids = _new_output((tokens, top_k), torch.int32, device)
    weights = _new_output((tokens, top_k), torch.float32, device)
    if tokens == 0:
        return ids, weights
    run(step_launches.moe_route(x=operand(x), router_weight=operand(router_weight), bias=bias.contiguous(),
                                top_k=top_k, interpret=not compiled(device)),
        {"ids": ids, "weights": weights})
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
    call = validate.check_qk_rope_call(qkv, positions, inv_freq, q_norm, k_norm, k_cache, v_cache, slot_mapping,
                                       num_q_heads=num_q_heads, eps=eps, index_q_norm=index_q_norm,
                                       index_k_norm=index_k_norm, index_k_cache=index_k_cache, k_scale=k_scale,
                                       v_scale=v_scale)
    guards.check_call("qk_norm_rope", qkv=qkv, k_cache=k_cache, v_cache=v_cache, index_k_cache=index_k_cache,
                      slot_mapping=slot_mapping)
    device = guards.check_devices(qkv=qkv, positions=positions, inv_freq=inv_freq, q_norm=q_norm, k_norm=k_norm,
                                  k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
                                  index_q_norm=index_q_norm, index_k_norm=index_k_norm, index_k_cache=index_k_cache,
                                  k_scale=k_scale, v_scale=v_scale)
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
    k_scale, v_scale = ops.kv_scales(k_cache, k_scale, v_scale, device)
    pool = storage_bytes(k_cache)

    def view(cache):   # a cache as the kernel reads it: its offset and strides in its own elements
        return None if cache is None else Operand(pool, cache.storage_offset(), tuple(cache.shape), cache.stride(),
                                                  validate.dtype_name(cache))

    launch = step_launches.qk_norm_rope(
        call=call, qkv=operand(qkv), positions=positions.contiguous(), inv_freq=inv_freq.contiguous(),
        q_norm=q_norm.contiguous(), k_norm=k_norm.contiguous(),
        index_q_norm=None if index_q_norm is None else index_q_norm.contiguous(),
        index_k_norm=None if index_k_norm is None else index_k_norm.contiguous(),
        slot_mapping=slot_mapping.contiguous(), k_cache=view(k_cache), v_cache=view(v_cache),
        index_k_cache=view(index_k_cache), pool=operand(pool), interpret=not compiled(device), k_scale=k_scale,
        v_scale=v_scale)
    run(launch, {"q": q} if idx_q is None else {"q": q, "idx_q": idx_q})
    return q, idx_q


# -- shared -------------------------------------------------------------------------------

def _new_output(shape, dtype, device) -> torch.Tensor:
    """A new output tensor (the kernels write every element; the tests poison these with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)
