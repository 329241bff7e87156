"""Block-scaled FP8 weights (PyTorch launchers of ``m3_kernels.fp8_linear`` and ``m3_kernels.fp8_moe``).

A weight ``[N, K]`` is held as ``float8_e4m3fn`` codes and float32 scales ``[ceil(N / 128), ceil(K / 128)]``,
one per 128 x 128 block (DeepSeek-V3 / vLLM ``weight_block_size: [128, 128]``; a checkpoint's
``weight_scale_inv``): ``W ~ codes * scale``. ``quantize_weight`` makes that pair from a bf16 weight;
``fp8_linear`` and ``fused_moe_fp8`` quantize their activations per token and 128 channels on the fly
and run FP8 tensor-core GEMMs. CUDA tensors run the compiled kernels, CPU tensors the same kernels in
Triton's interpreter. No host synchronisation (a decode step stays graph-capturable). The JAX twins
(``m3_jax.fp8``) launch the same kernels and give the same bits.
"""

from __future__ import annotations

import torch

from m3_kernels import step_launches, validate
from m3_kernels.common import E4M3_MAX
from m3_kernels.fp8_linear import AMAX_FLOOR
from m3_kernels.maps import FP8_BLOCK, MX_BLOCK, cdiv

from . import guards
from .ops import compiled, operand, run


__all__ = ["quantize_weight", "dequantize_mxfp8", "quantize_activation", "fp8_linear", "fused_moe_fp8"]


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., N, K]`` (any float dtype) -> (codes ``[..., N, K]`` float8_e4m3fn, scale
    ``[..., ceil(N / 128), ceil(K / 128)]`` float32), on weight's device.

    Per 128 x 128 block (the last one of a dimension may be partial): ``scale = max(amax, 1e-12) / 448``
    and ``codes = saturate(w / scale)`` rounded to nearest even (float32 math), so the block's largest
    magnitude maps to 448. Memory: a float32 copy of ``weight``; quantize a layer (or an expert) at a time.
    """
    if weight.dim() < 2 or not weight.is_floating_point():
        raise ValueError(f"weight: expected a float tensor [..., N, K], got {weight.dtype} of shape "
                         f"{tuple(weight.shape)}")
    *lead, n, k = weight.shape
    nb, kb, block, e4m3_max = cdiv(n, FP8_BLOCK), cdiv(k, FP8_BLOCK), FP8_BLOCK, E4M3_MAX.value
    w = torch.nn.functional.pad(weight.float(), (0, kb * block - k, 0, nb * block - n))   # zeros: amax unchanged
    blocks = w.reshape(*lead, nb, block, kb, block)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(AMAX_FLOOR.value) / e4m3_max
    codes = (blocks / scale[..., :, None, :, None]).clamp(-e4m3_max, e4m3_max).to(torch.float8_e4m3fn)
    return codes.reshape(*lead, nb * block, kb * block)[..., :n, :k].contiguous(), scale


def dequantize_mxfp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An MXFP8 weight -> float32 ``[..., N, K]`` (exact): ``codes [..., N, K]`` float8_e4m3fn times
    ``2 ** (scale - 127)``, ``scale [..., N, ceil(K / 32)]`` uint8 (UE8M0) one per 1 x 32 block along K.
    ``quantize_weight`` of the result is the engine's 128 x 128 format (``m3_engine.quantization``)."""
    validate.check_mxfp8(codes, scale)
    k = codes.shape[-1]
    factor = torch.exp2(scale.float() - 127.0).repeat_interleave(MX_BLOCK, dim=-1)[..., :k]
    return codes.float() * factor


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` bfloat16 / float16 / float32 -> (codes ``[T, K]`` float8_e4m3fn, scale
    ``[T, ceil(K / 128)]`` float32): per token and 128 channels, ``scale = max(amax, 1e-12) / 448`` (NaN left
    out of amax), ``codes = saturate(x / scale)`` rounded to nearest even (``m3_kernels.fp8_linear``)."""
    validate.check_quantize_call(x)
    found = run(step_launches.quantize_activation(x=operand(x.contiguous()), interpret=not compiled(x.device)))
    return found["xq"], found["x_scale"]


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` with ``W = weight * weight_scale`` (per 128 x 128 block) -> ``[T, N]`` in x's dtype.

    x:            [T, K] bfloat16 / float16 / float32 (quantized per token and 128 channels first).
    weight:       [N, K] float8_e4m3fn, contiguous.
    weight_scale: [ceil(N / 128), ceil(K / 128)] float32.

    Each output is ``sum_kb (xq . wq) * x_scale * w_scale`` over the K blocks in float32, rounded once.
    """
    tokens, n, _ = validate.check_fp8_linear_call(x, weight, weight_scale)
    device = guards.check_devices(x=x, weight=weight, weight_scale=weight_scale)
    guards.check_contiguous(weight=weight)
    out = torch.empty((tokens, n), dtype=x.dtype, device=device)
    if tokens == 0:
        return out
    launch = step_launches.fp8_linear(x=operand(x.contiguous()), weight=operand(weight),
                                      weight_scale=weight_scale.contiguous(), interpret=not compiled(device))
    run(launch, {"out": out})
    return out


def fused_moe_fp8(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, *,
                  swiglu_alpha: float, swiglu_limit: float, routed_scaling_factor: float = 1.0,
                  shared_gate_up=None, shared_gate_up_scale=None, shared_down=None,
                  shared_down_scale=None) -> torch.Tensor:
    """``m3_torch.fused_moe`` with block-scaled FP8 expert weights -> [T, H] in x's dtype.

    x:               [T, H] bfloat16 / float16 / float32; H a multiple of 128.
    w_gate_up:       [E, 2I, H] float8_e4m3fn (gate rows, then up rows; I a multiple of 128), contiguous;
    w_gate_up_scale: [E, 2I / 128, H / 128] float32.
    w_down:          [E, H, I] float8_e4m3fn, contiguous; w_down_scale: [E, H / 128, I / 128] float32.
    topk_ids:        [T, k] int32 expert ids in [0, E); topk_weights: [T, k] float32.
    shared_*:        None, or all four: the shared expert's [2I, H], [2I / 128, H / 128], [H, I],
                     [H / 128, I / 128] (run as one more expert of every token, weight 1, unscaled).

    Roundings as ``fused_moe`` (each GEMM's output to x's dtype, SwiGLU-OAI in float32 then rounded, the
    weighted sum in float32, ``* scale`` and ``+ shared`` each rounded), plus the FP8 quantization of x
    and of the SwiGLU output per token and 128 channels (``m3_kernels.fp8_moe``).
    """
    tokens, _, _, hidden, _ = validate.check_fp8_moe_call(
        x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, shared_gate_up,
        shared_gate_up_scale, shared_down, shared_down_scale)
    weights = dict(w_gate_up=w_gate_up, w_gate_up_scale=w_gate_up_scale, w_down=w_down, w_down_scale=w_down_scale,
                   shared_gate_up=shared_gate_up, shared_gate_up_scale=shared_gate_up_scale,
                   shared_down=shared_down, shared_down_scale=shared_down_scale)
    device = guards.check_devices(x=x, **weights, topk_ids=topk_ids, topk_weights=topk_weights)
    guards.check_contiguous(**weights)
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=device)
    if tokens == 0:
        return out
    codes = {name: None if w is None else operand(w) for name, w in weights.items() if not name.endswith("_scale")}
    scales = {name: w for name, w in weights.items() if name.endswith("_scale")}
    launch = step_launches.fused_moe_fp8(
        x=operand(x.contiguous()), **codes, **scales, topk_ids=operand(topk_ids.contiguous()),
        topk_weights=topk_weights.contiguous(), swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
        routed_scaling_factor=routed_scaling_factor, interpret=not compiled(device))
    run(launch, {"out": out})
    return out
