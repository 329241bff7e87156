"""``fused_moe``: the routed experts of an MoE layer (PyTorch launcher of ``m3_kernels.moe``).

CUDA tensors run the compiled kernels, CPU tensors the same kernels in Triton's
interpreter. No host synchronisation (a decode step stays graph-capturable).
"""

from __future__ import annotations

import torch

from m3_kernels import step_launches, validate

from . import guards
from .ops import compiled, operand, run

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
    tokens, experts, top_k, hidden, inter = validate.check_moe_call(x, w_gate_up, w_down, topk_ids, topk_weights,
                                                                    shared_gate_up, shared_down)
    weights = {"w_gate_up": w_gate_up, "w_down": w_down, "shared_gate_up": shared_gate_up,
               "shared_down": shared_down}
    guards.check_call("fused_moe", x=x, **weights, topk_ids=topk_ids, topk_weights=topk_weights)
    device = guards.check_devices(x=x, **weights, topk_ids=topk_ids, topk_weights=topk_weights)
    guards.check_contiguous(**weights)
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=device)
    if tokens == 0:
        return out
    shared = {name: None if w is None else operand(w) for name, w in weights.items() if name.startswith("shared")}
    launch = step_launches.fused_moe(
        x=operand(x.contiguous()), w_gate_up=operand(w_gate_up), w_down=operand(w_down),
        topk_ids=operand(topk_ids.contiguous()), topk_weights=topk_weights.contiguous(), **shared,
        swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, routed_scaling_factor=routed_scaling_factor,
        interpret=not compiled(device))
    run(launch, {"out": out})
    return out
