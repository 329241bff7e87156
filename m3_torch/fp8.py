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

from m3_kernels import fp8_linear as _linear
from m3_kernels import fp8_moe as _fp8_moe
from m3_kernels import kernel_module
from m3_kernels.launches import TRITON_DTYPES

from . import ops

__all__ = ["quantize_weight", "quantize_activation", "fp8_linear", "fused_moe_fp8"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = _linear.FP8_BLOCK


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
    nb, kb = _linear.scale_blocks(n), _linear.scale_blocks(k)
    w = torch.nn.functional.pad(weight.float(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))   # zeros: amax unchanged
    blocks = w.reshape(*lead, nb, BLOCK, kb, BLOCK)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(_linear.AMAX_FLOOR.value) / E4M3_MAX
    codes = (blocks / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return codes.reshape(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k].contiguous(), scale


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` bfloat16 / float16 / float32 -> (codes ``[T, K]`` float8_e4m3fn, scale
    ``[T, ceil(K / 128)]`` float32): per token and 128 channels, ``scale = max(amax, 1e-12) / 448`` (NaN left
    out of amax), ``codes = saturate(x / scale)`` rounded to nearest even (``m3_kernels.fp8_linear``)."""
    from m3_kernels.validate import FLOAT_DTYPES, check_dtype, check_rank

    check_rank("x", x, 2, "[T, K]")
    check_dtype("x", x, FLOAT_DTYPES)
    return _quantize(x.contiguous())


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` with ``W = weight * weight_scale`` (per 128 x 128 block) -> ``[T, N]`` in x's dtype.

    x:            [T, K] bfloat16 / float16 / float32 (quantized per token and 128 channels first).
    weight:       [N, K] float8_e4m3fn, contiguous.
    weight_scale: [ceil(N / 128), ceil(K / 128)] float32.

    Each output is ``sum_kb (xq . wq) * x_scale * w_scale`` over the K blocks in float32, rounded once.
    """
    tokens, n, k = _linear.check_linear_call(x, weight, weight_scale)
    _check_devices(x=x, weight=weight, weight_scale=weight_scale)
    _check_contiguous(weight=weight)
    out = _new_output((tokens, n), x.dtype, x.device)
    if tokens == 0:
        return out
    xq, x_scale = _quantize(x.contiguous())
    config = _linear.block_sizes(tokens, n, k, x.device.type != "cuda")
    _run("fp8_linear", "fp8_linear_kernel", config, xq, x_scale, weight, weight_scale.contiguous(), tokens, out)
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
    tokens, experts, top_k, hidden, inter = _fp8_moe.check_fp8_moe_call(
        x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights, shared_gate_up,
        shared_gate_up_scale, shared_down, shared_down_scale)
    weights = dict(w_gate_up=w_gate_up, w_gate_up_scale=w_gate_up_scale, w_down=w_down, w_down_scale=w_down_scale,
                   shared_gate_up=shared_gate_up, shared_gate_up_scale=shared_gate_up_scale,
                   shared_down=shared_down, shared_down_scale=shared_down_scale)
    device = _check_devices(x=x, **weights, topk_ids=topk_ids, topk_weights=topk_weights)
    _check_contiguous(**weights)
    out = _new_output((tokens, hidden), x.dtype, device)
    if tokens == 0:
        return out
    shared = shared_gate_up is not None
    interpret = device.type != "cuda"
    plan = _fp8_moe.plan(tokens, experts, top_k, shared, hidden, inter, TRITON_DTYPES[str(x.dtype).removeprefix(
        "torch.")], interpret)
    base = plan.moe
    act_shape, act_scale_shape = _fp8_moe.act_shapes(plan, inter)
    xq, x_scale = _quantize(x.contiguous())
    routing = (torch.empty(base.num_rows, dtype=torch.int32, device=device),
               torch.empty(base.num_blocks, dtype=torch.int32, device=device),
               torch.empty(base.num_blocks, dtype=torch.int32, device=device))
    act = torch.empty(act_shape, dtype=E4M3, device=device)
    act_scale = torch.empty(act_scale_shape, dtype=torch.float32, device=device)
    weighted = torch.empty((base.num_pairs, hidden), dtype=torch.float32, device=device)
    _launch("moe", "align_kernel", base.align, topk_ids.contiguous(), tokens, *routing)
    _launch("fp8_moe", "fp8_gate_up_kernel", plan.gate_up, xq, x_scale, w_gate_up, w_gate_up_scale,
            shared_gate_up if shared else w_gate_up, shared_gate_up_scale if shared else w_gate_up_scale, *routing,
            float(swiglu_alpha), float(swiglu_limit), act, act_scale)
    _launch("fp8_moe", "fp8_down_kernel", plan.down, act, act_scale, w_down, w_down_scale,
            shared_down if shared else w_down, shared_down_scale if shared else w_down_scale, *routing,
            topk_weights.contiguous(), weighted)
    _launch("moe", "sum_kernel", base.sum, weighted, float(routed_scaling_factor), out)
    return out


# -- shared -------------------------------------------------------------------------------

def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_act_kernel`` on a contiguous ``x [T, K]``."""
    tokens, k = x.shape
    xq = _new_output((tokens, k), E4M3, x.device)
    x_scale = _new_output((tokens, _linear.scale_blocks(k)), torch.float32, x.device)
    if tokens:
        config = _linear.quantize_block_sizes(tokens, k, x.device.type != "cuda")
        _run("fp8_linear", "quantize_act_kernel", config, x, xq, x_scale)
    return xq, x_scale


def _new_output(shape, dtype, device) -> torch.Tensor:
    """A new output tensor (the kernels write every element; the tests poison these with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check_devices(**tensors) -> torch.device:
    """All given tensors (None skipped) on the device of the first -> that device."""
    given = {name: t for name, t in tensors.items() if t is not None}
    first_name, first = next(iter(given.items()))
    for name, t in given.items():
        if t.device != first.device:
            raise ValueError(f"{name}: expected a tensor on {first.device} (the device of {first_name}), "
                             f"got {t.device}")
    return first.device


def _check_contiguous(**tensors):
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")


def _run(module: str, fn: str, config: dict, *args):
    """Launch ``m3_kernels.<module>.<fn>`` with ``config`` (grid, warps, stages and constexprs) on the device
    of the first tensor argument."""
    config = dict(config)
    grid, num_warps, num_stages = config.pop("grid"), config.pop("num_warps"), config.pop("num_stages")
    device = next(a for a in args if isinstance(a, torch.Tensor)).device
    pdl = ops._grid_dependency(device)
    kernel = getattr(kernel_module(module, device.type != "cuda"), fn)
    kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl["PDL"], **config, **pdl)


def _launch(module: str, fn: str, step, *args):
    """Launch ``m3_kernels.<module>.<fn>`` as a ``moe.KernelLaunch`` describes it."""
    _run(module, fn, dict(grid=step.grid, num_warps=step.num_warps, num_stages=step.num_stages, **step.constexprs),
         *args)
