"""``fused_moe``: the routed experts of an MoE layer (PyTorch launcher of ``m3_kernels.moe``).

CUDA tensors run the compiled kernels, CPU tensors the same kernels in Triton's
interpreter. No host synchronisation (a decode step stays graph-capturable).
"""

from __future__ import annotations

import torch

from m3_kernels import kernel_module
from m3_kernels import moe as _moe

from . import ops

__all__ = ["fused_moe"]


def fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights, *, swiglu_alpha: float, swiglu_limit: float,
              routed_scaling_factor: float = 1.0, shared_gate_up=None, shared_down=None) -> torch.Tensor:
    """``scale * sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) (+ shared_expert(x[t]))`` -> [T, H]
    in x's dtype.

    x:              [T, H] bfloat16 / float16 / float32.
    w_gate_up:      [E, 2I, H] (each expert's gate rows, then its up rows), x's dtype, contiguous.
    w_down:         [E, H, I], x's dtype, contiguous.
    topk_ids:       [T, k] int32 expert ids in [0, E), distinct per row (the router's choice).
    topk_weights:   [T, k] float32 routing weights.
    shared_gate_up, shared_down: None, or the shared expert's [2I, H] and [H, I] (the experts' width),
                    x's dtype, contiguous: it runs as one more expert of every token, weight 1, unscaled.

    ``expert_e(x) = down_e(swiglu_oai(gate_up_e(x)))``; roundings as the unfused model's (each GEMM's
    output to x's dtype, SwiGLU-OAI in float32 then rounded, the weighted sum over j in float32, then
    ``* scale`` and ``+ shared`` each rounded): ``m3_kernels.moe``.
    """
    tokens, experts, top_k, hidden, inter = _moe.check_moe_call(x, w_gate_up, w_down, topk_ids, topk_weights,
                                                                shared_gate_up, shared_down)
    device = x.device
    shared = shared_gate_up is not None
    weights = {"w_gate_up": w_gate_up, "w_down": w_down, "shared_gate_up": shared_gate_up,
               "shared_down": shared_down}
    for name, t in (*weights.items(), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t is not None and t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the device of x), got {t.device}")
    for name, w in weights.items():
        if w is not None and not w.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(w.stride())}")
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=device)
    if tokens == 0:
        return out
    interpret = device.type != "cuda"
    plan = _moe.plan(tokens, experts, top_k, shared, hidden, inter, x.element_size(), interpret)
    kernels = kernel_module("moe", interpret)
    pdl = ops._grid_dependency(device)
    x, ids, routing_weights = x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
    sorted_pairs = torch.empty(plan.num_rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(plan.num_blocks, dtype=torch.int32, device=device)
    block_rows = torch.empty(plan.num_blocks, dtype=torch.int32, device=device)
    act = torch.empty((plan.num_rows, inter), dtype=x.dtype, device=device)
    weighted = torch.empty((plan.num_pairs, hidden), dtype=torch.float32, device=device)
    routing = (sorted_pairs, block_expert, block_rows)

    def launch(kernel, step, *args):
        kernel[step.grid](*args, num_warps=step.num_warps, num_stages=step.num_stages, launch_pdl=pdl["PDL"],
                          **step.constexprs, **pdl)

    launch(kernels.align_kernel, plan.align, ids, tokens, *routing)
    launch(kernels.gate_up_kernel, plan.gate_up, x, w_gate_up, shared_gate_up if shared else w_gate_up, *routing,
           float(swiglu_alpha), float(swiglu_limit), act)
    launch(kernels.down_kernel, plan.down, act, w_down, shared_down if shared else w_down, *routing, routing_weights,
           weighted)
    launch(kernels.sum_kernel, plan.sum, weighted, float(routed_scaling_factor), out)
    return out
