"""Block-scaled FP8 weights (JAX launchers of ``m3_kernels.fp8_linear`` and ``m3_kernels.fp8_moe``).

The same format, kernels and launch parameters as ``m3_torch.fp8``: compiled through jax-triton on a GPU
backend, interpreted inside ``jax.pure_callback`` on a CPU backend; every op works under ``jax.jit``.
Identical inputs give torch's bits (``quantize_weight`` included).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from m3_kernels import step_launches, validate
from m3_kernels.common import E4M3_MAX
from m3_kernels.fp8_linear import AMAX_FLOOR
from m3_kernels.maps import FP8_BLOCK, MX_BLOCK, cdiv

from ._triton_call import on_gpu
from .ops import operand, run


__all__ = ["quantize_weight", "dequantize_mxfp8", "quantize_activation", "fp8_linear", "fused_moe_fp8"]


@jax.jit
def quantize_weight(weight):
    """``weight [..., N, K]`` (any float dtype) -> (codes ``[..., N, K]`` float8_e4m3fn, scale
    ``[..., ceil(N / 128), ceil(K / 128)]`` float32): ``m3_torch.fp8.quantize_weight``'s formula. XLA computes
    a float32 division as a multiplication by the reciprocal, so a scale may differ from torch's in its
    last bit, and a code by one e4m3 step at a rounding boundary (either is a valid quantization; the
    kernels give the same bits for the same codes and scales)."""
    *lead, n, k = weight.shape
    nb, kb, block, e4m3_max = cdiv(n, FP8_BLOCK), cdiv(k, FP8_BLOCK), FP8_BLOCK, E4M3_MAX.value
    pad = [(0, 0)] * len(lead) + [(0, nb * block - n), (0, kb * block - k)]
    blocks = jnp.pad(weight.astype(jnp.float32), pad).reshape(*lead, nb, block, kb, block)
    scale = jnp.maximum(jnp.abs(blocks).max(axis=(-3, -1)), jnp.float32(AMAX_FLOOR.value)) / e4m3_max
    codes = jnp.clip(blocks / scale[..., :, None, :, None], -e4m3_max, e4m3_max).astype(jnp.float8_e4m3fn)
    return codes.reshape(*lead, nb * block, kb * block)[..., :n, :k], scale


def dequantize_mxfp8(codes, scale):
    """An MXFP8 weight -> float32 ``[..., N, K]`` (exact): as ``m3_torch.fp8.dequantize_mxfp8`` (codes
    float8_e4m3fn, scale ``[..., N, ceil(K / 32)]`` uint8 UE8M0)."""
    validate.check_mxfp8(codes, scale)
    return _dequantize_mxfp8(codes, scale)


@jax.jit
def _dequantize_mxfp8(codes, scale):
    k = codes.shape[-1]
    factor = jnp.repeat(jnp.exp2(scale.astype(jnp.float32) - 127.0), MX_BLOCK, axis=-1)[..., :k]
    return codes.astype(jnp.float32) * factor


def quantize_activation(x):
    """``x [T, K]`` bfloat16 / float16 / float32 -> (codes ``[T, K]`` float8_e4m3fn, scale ``[T, ceil(K / 128)]``
    float32): as ``m3_torch.quantize_activation``."""
    validate.check_quantize_call(x)
    return _quantize_activation(x, interpret=not on_gpu())


def fp8_linear(x, weight, weight_scale):
    """``x @ W^T`` with ``W = weight * weight_scale`` (per 128 x 128 block) -> ``[T, N]`` in x's dtype.

    Arguments and semantics as ``m3_torch.fp8_linear`` (x [T, K] bfloat16 / float16 / float32;
    weight [N, K] float8_e4m3fn; weight_scale [ceil(N / 128), ceil(K / 128)] float32).
    """
    tokens, n, _ = validate.check_fp8_linear_call(x, weight, weight_scale)
    if tokens == 0:
        return jnp.zeros((0, n), x.dtype)
    return _fp8_linear(x, weight, weight_scale, interpret=not on_gpu())


def fused_moe_fp8(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, *,
                  swiglu_alpha: float, swiglu_limit: float, routed_scaling_factor: float = 1.0,
                  shared_gate_up=None, shared_gate_up_scale=None, shared_down=None, shared_down_scale=None):
    """``fused_moe`` with block-scaled FP8 expert weights -> [T, H] in x's dtype.

    Arguments and semantics as ``m3_torch.fused_moe_fp8`` (weights float8_e4m3fn with float32 scales per
    128 x 128 block; H and I multiples of 128; the shared expert's four arrays, or none).
    """
    tokens, _, _, hidden, _ = validate.check_fp8_moe_call(
        x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, shared_gate_up,
        shared_gate_up_scale, shared_down, shared_down_scale)
    if tokens == 0:
        return jnp.zeros((0, hidden), x.dtype)
    return _fused_moe_fp8(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights,
                          shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale,
                          alpha=float(swiglu_alpha), limit=float(swiglu_limit), scale=float(routed_scaling_factor),
                          interpret=not on_gpu())


@functools.partial(jax.jit, static_argnames=("interpret",))
def _quantize_activation(x, *, interpret):
    found = run(step_launches.quantize_activation(x=operand(x), interpret=interpret))
    return found["xq"], found["x_scale"]


@functools.partial(jax.jit, static_argnames=("interpret",))
def _fp8_linear(x, weight, weight_scale, *, interpret):
    """The checked call, one jitted function (eager callers compile its two launches once per shape)."""
    return run(step_launches.fp8_linear(x=operand(x), weight=operand(weight), weight_scale=weight_scale,
                                        interpret=interpret))["out"]


@functools.partial(jax.jit, static_argnames=("alpha", "limit", "scale", "interpret"))
def _fused_moe_fp8(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, shared_gate_up,
                   shared_gate_up_scale, shared_down, shared_down_scale, *, alpha, limit, scale, interpret):
    """The checked call, one jitted function (eager callers compile its five launches once per shape)."""
    shared = shared_gate_up is not None
    launch = step_launches.fused_moe_fp8(
        x=operand(x), w_gate_up=operand(w_gate_up), w_gate_up_scale=w_gate_up_scale, w_down=operand(w_down),
        w_down_scale=w_down_scale, topk_ids=operand(topk_ids), topk_weights=topk_weights,
        shared_gate_up=operand(shared_gate_up) if shared else None, shared_gate_up_scale=shared_gate_up_scale,
        shared_down=operand(shared_down) if shared else None, shared_down_scale=shared_down_scale,
        swiglu_alpha=alpha, swiglu_limit=limit, routed_scaling_factor=scale, interpret=interpret)
    return run(launch)["out"]
