"""Block-scaled FP8 weights (JAX launchers of ``m3_kernels.fp8_linear`` and ``m3_kernels.fp8_moe``).

The same format, kernels and launch parameters as ``m3_torch.fp8``: compiled through jax-triton on a GPU
backend, interpreted inside ``jax.pure_callback`` on a CPU backend; every op works under ``jax.jit``.
Identical inputs give torch's bits (``quantize_weight`` included).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from m3_kernels import fp8_linear as _linear
from m3_kernels import fp8_moe as _fp8_moe
from m3_kernels.launches import TRITON_DTYPES

from ._triton_call import on_gpu, triton_call

__all__ = ["quantize_weight", "quantize_activation", "fp8_linear", "fused_moe_fp8"]

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = _linear.FP8_BLOCK


@jax.jit
def quantize_weight(weight):
    """``weight [..., N, K]`` (any float dtype) -> (codes ``[..., N, K]`` float8_e4m3fn, scale
    ``[..., ceil(N / 128), ceil(K / 128)]`` float32): ``m3_torch.fp8.quantize_weight``'s formula. XLA computes
    a float32 division as a multiplication by the reciprocal, so a scale may differ from torch's in its
    last bit, and a code by one e4m3 step at a rounding boundary (either is a valid quantization; the
    kernels give the same bits for the same codes and scales)."""
    *lead, n, k = weight.shape
    nb, kb = _linear.scale_blocks(n), _linear.scale_blocks(k)
    pad = [(0, 0)] * len(lead) + [(0, nb * BLOCK - n), (0, kb * BLOCK - k)]
    blocks = jnp.pad(weight.astype(jnp.float32), pad).reshape(*lead, nb, BLOCK, kb, BLOCK)
    scale = jnp.maximum(jnp.abs(blocks).max(axis=(-3, -1)), jnp.float32(_linear.AMAX_FLOOR.value)) / E4M3_MAX
    codes = jnp.clip(blocks / scale[..., :, None, :, None], -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return codes.reshape(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k], scale


def quantize_activation(x):
    """``x [T, K]`` bfloat16 / float16 / float32 -> (codes ``[T, K]`` float8_e4m3fn, scale ``[T, ceil(K / 128)]``
    float32): as ``m3_torch.quantize_activation``."""
    from m3_kernels.validate import FLOAT_DTYPES, check_dtype, check_rank

    check_rank("x", x, 2, "[T, K]")
    check_dtype("x", x, FLOAT_DTYPES)
    return _quantize(x, interpret=not on_gpu())


def fp8_linear(x, weight, weight_scale):
    """``x @ W^T`` with ``W = weight * weight_scale`` (per 128 x 128 block) -> ``[T, N]`` in x's dtype.

    Arguments and semantics as ``m3_torch.fp8_linear`` (x [T, K] bfloat16 / float16 / float32;
    weight [N, K] float8_e4m3fn; weight_scale [ceil(N / 128), ceil(K / 128)] float32).
    """
    tokens, n, _ = _linear.check_linear_call(x, weight, weight_scale)
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
    tokens, _, _, hidden, _ = _fp8_moe.check_fp8_moe_call(
        x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, shared_gate_up,
        shared_gate_up_scale, shared_down, shared_down_scale)
    if tokens == 0:
        return jnp.zeros((0, hidden), x.dtype)
    return _fused_moe_fp8(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights,
                          shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale,
                          alpha=float(swiglu_alpha), limit=float(swiglu_limit), scale=float(routed_scaling_factor),
                          interpret=not on_gpu())


def _launch(module, fn, config, *args, out_shape):
    """``triton_call`` of ``m3_kernels.<module>.<fn>`` with ``config`` (grid, warps, stages and constexprs)."""
    config = dict(config)
    grid, num_warps, num_stages = config.pop("grid"), config.pop("num_warps"), config.pop("num_stages")
    return triton_call(*args, kernel=(module, fn), out_shape=out_shape, grid=grid, num_warps=num_warps,
                       num_stages=num_stages, **config)


def _step(step):
    """A ``moe.KernelLaunch`` as a config for ``_launch``."""
    return dict(grid=step.grid, num_warps=step.num_warps, num_stages=step.num_stages, **step.constexprs)


def _quantize(x, *, interpret):
    tokens, k = x.shape
    out_shape = [jax.ShapeDtypeStruct((tokens, k), E4M3),
                 jax.ShapeDtypeStruct((tokens, _linear.scale_blocks(k)), jnp.float32)]
    if tokens == 0:
        return tuple(jnp.zeros(s.shape, s.dtype) for s in out_shape)
    return tuple(_launch("fp8_linear", "quantize_act_kernel", _linear.quantize_block_sizes(tokens, k, interpret), x,
                         out_shape=out_shape))


@functools.partial(jax.jit, static_argnames=("interpret",))
def _fp8_linear(x, weight, weight_scale, *, interpret):
    (tokens, k), n = x.shape, weight.shape[0]
    xq, x_scale = _quantize(x, interpret=interpret)
    return _launch("fp8_linear", "fp8_linear_kernel", _linear.block_sizes(tokens, n, k, interpret),
                   xq, x_scale, weight, weight_scale, tokens, out_shape=jax.ShapeDtypeStruct((tokens, n), x.dtype))


@functools.partial(jax.jit, static_argnames=("alpha", "limit", "scale", "interpret"))
def _fused_moe_fp8(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, shared_gate_up,
                   shared_gate_up_scale, shared_down, shared_down_scale, *, alpha, limit, scale, interpret):
    (tokens, hidden), (experts, two_inter, _), top_k = x.shape, w_gate_up.shape, topk_ids.shape[1]
    inter, shared = two_inter // 2, shared_gate_up is not None
    plan = _fp8_moe.plan(tokens, experts, top_k, shared, hidden, inter, TRITON_DTYPES[str(x.dtype)], interpret)
    base = plan.moe
    act_shape, act_scale_shape = _fp8_moe.act_shapes(plan, inter)
    i32 = jnp.int32
    xq, x_scale = _quantize(x, interpret=interpret)
    routing = _launch("moe", "align_kernel", _step(base.align), topk_ids, tokens,
                      out_shape=[jax.ShapeDtypeStruct((base.num_rows,), i32),
                                 jax.ShapeDtypeStruct((base.num_blocks,), i32),
                                 jax.ShapeDtypeStruct((base.num_blocks,), i32)])
    act, act_scale = _launch(
        "fp8_moe", "fp8_gate_up_kernel", _step(plan.gate_up), xq, x_scale, w_gate_up, w_gate_up_scale,
        shared_gate_up if shared else w_gate_up, shared_gate_up_scale if shared else w_gate_up_scale, *routing,
        alpha, limit, out_shape=[jax.ShapeDtypeStruct(act_shape, E4M3),
                                 jax.ShapeDtypeStruct(act_scale_shape, jnp.float32)])
    weighted = _launch(
        "fp8_moe", "fp8_down_kernel", _step(plan.down), act, act_scale, w_down, w_down_scale,
        shared_down if shared else w_down, shared_down_scale if shared else w_down_scale, *routing, topk_weights,
        out_shape=jax.ShapeDtypeStruct((base.num_pairs, hidden), jnp.float32))
    return _launch("moe", "sum_kernel", _step(base.sum), weighted, scale,
                   out_shape=jax.ShapeDtypeStruct((tokens, hidden), x.dtype))
