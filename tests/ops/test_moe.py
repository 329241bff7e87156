"""fused_moe: the shared fused-MoE kernels from torch and JAX, against a float64 reference.

CPU tests run the interpreted kernels (torch CPU tensors; JAX arrays eagerly and under ``jax.jit``) at
small shapes chosen to hit every path of the block structure: one token, experts with no tokens, one
expert taking every token (a group over many blocks), sizes that are no power of two (masked tiles).
The ``gpu`` tests run the compiled kernels at MiniMax-M3's expert shapes, decode- and prefill-sized.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import m3_jax
import m3_torch
from m3_kernels import step_launches
from m3_torch.model import swiglu_oai
from jax_helpers import _jax_device  # noqa: F401  (autouse: CPU tests run on JAX's CPU device)

ALPHA, LIMIT = 1.702, 7.0


def make_inputs(seed, tokens, experts, top_k, hidden, inter, *, dtype=torch.float32, ids=None, shared=True,
                device="cpu"):
    """Random x, weights (scaled to keep activations O(1)), routing (distinct experts per row unless ``ids``
    is given), weights in (0, 1], a shared expert's weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5 * 2
    w_down = torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5
    if ids is None:
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]) if tokens else \
            torch.zeros(0, top_k)
    weights = torch.rand(tokens, top_k, generator=g) + 1e-3
    out = dict(x=x, w_gate_up=w_gate_up, w_down=w_down, topk_ids=ids.to(torch.int32).reshape(tokens, top_k),
               topk_weights=weights, shared_gate_up=None, shared_down=None)
    if shared:
        out.update(shared_gate_up=torch.randn(2 * inter, hidden, generator=g) * hidden ** -0.5 * 2,
                   shared_down=torch.randn(hidden, inter, generator=g) * inter ** -0.5)
    return {k: (v.to(device) if k in ("topk_ids", "topk_weights") else v.to(device, dtype)) if v is not None else None
            for k, v in out.items()}


def reference(x, w_gate_up, w_down, topk_ids, topk_weights, shared_gate_up, shared_down, scale):
    """float64 on the CPU, one (token, expert) pair at a time (only the chosen experts' weights are copied)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    x = x.double().cpu()
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            act = swiglu_oai(w_gate_up[e].double().cpu() @ x[t], ALPHA, LIMIT)
            out[t] += float(topk_weights[t, j]) * (w_down[e].double().cpu() @ act)
    out *= scale
    if shared_gate_up is not None:
        act = swiglu_oai(x @ shared_gate_up.double().cpu().T, ALPHA, LIMIT)
        out += act @ shared_down.double().cpu().T
    return out


def run_torch(inputs, scale=2.0):
    return m3_torch.fused_moe(**inputs, swiglu_alpha=ALPHA, swiglu_limit=LIMIT, routed_scaling_factor=scale)


def run_jax(inputs, scale=2.0, jit=False):
    arrays = {k: None if v is None else jnp.asarray(v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy())
              for k, v in inputs.items()}
    if inputs["x"].dtype == torch.bfloat16:
        arrays = {k: None if v is None or k in ("topk_ids", "topk_weights") else v.astype(jnp.bfloat16)
                  for k, v in arrays.items()} | {k: arrays[k] for k in ("topk_ids", "topk_weights")}

    def call(**a):
        return m3_jax.fused_moe(**a, swiglu_alpha=ALPHA, swiglu_limit=LIMIT, routed_scaling_factor=scale)
    out = jax.jit(call)(**arrays) if jit else call(**arrays)
    return torch.from_numpy(np.asarray(out.astype(jnp.float32)))


CASES = {   # name: (tokens, experts, top_k, hidden, inter, ids)
    "one token": (1, 8, 2, 64, 32, None),
    "unused experts": (3, 16, 2, 64, 32, None),
    "odd sizes": (37, 6, 3, 72, 40, None),
    "one expert takes all": (40, 4, 2, 64, 32, torch.tensor([[1, 3]] * 40)),
}


@pytest.mark.parametrize("name", CASES)
def test_matches_reference_and_jax_bits(name):
    tokens, experts, top_k, hidden, inter, ids = CASES[name]
    inputs = make_inputs(len(name), tokens, experts, top_k, hidden, inter, ids=ids, shared=name != "odd sizes")
    out = run_torch(inputs)
    expected = reference(**inputs, scale=2.0)
    assert out.shape == (tokens, hidden) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(run_jax(inputs, jit=name == "odd sizes"), out), "JAX and torch launches differ in bits"


def test_bfloat16_rounds_like_the_model():
    """bf16: the fused result is as close to the float64 reference as the model's unfused math (bf16
    GEMM outputs, bf16 swiglu, float32 sum, bf16 scale and shared add), and JAX gives torch's bits."""
    inputs = make_inputs(7, 19, 8, 2, 64, 32, dtype=torch.bfloat16)
    out = run_torch(inputs)
    x, wgu, wd, ids, w = (inputs[k] for k in ("x", "w_gate_up", "w_down", "topk_ids", "topk_weights"))
    unfused = torch.zeros(out.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            act = swiglu_oai(x[t:t + 1] @ wgu[e].T, ALPHA, LIMIT)
            unfused[t] += (act @ wd[e].T)[0].float() * w[t, j]
    shared = swiglu_oai(x @ inputs["shared_gate_up"].T, ALPHA, LIMIT) @ inputs["shared_down"].T
    unfused = unfused.to(torch.bfloat16) * 2.0 + shared
    expected = reference(**inputs, scale=2.0)
    fused_err, unfused_err = ((y.double() - expected).abs().max().item() for y in (out, unfused))
    assert fused_err <= 1.5 * unfused_err, f"fused bf16 error {fused_err:.3g}, the unfused model's {unfused_err:.3g}"
    assert torch.equal(run_jax(inputs), out.float())


def moe_launch(tokens, experts, top_k, shared, hidden, inter, dtype, interpret):
    """The chained launches of a fused_moe call with these shapes (align_kernel's first), from shapes alone."""
    from test_codegen import operand

    return step_launches.fused_moe(
        x=operand(tokens, hidden, dtype=dtype), w_gate_up=operand(experts, 2 * inter, hidden, dtype=dtype),
        w_down=operand(experts, hidden, inter, dtype=dtype), topk_ids=operand(tokens, top_k, dtype="int32"),
        topk_weights=None, shared_gate_up=operand(2 * inter, hidden, dtype=dtype) if shared else None,
        shared_down=operand(hidden, inter, dtype=dtype) if shared else None, swiglu_alpha=ALPHA,
        swiglu_limit=LIMIT, routed_scaling_factor=1.0, interpret=interpret)


@pytest.mark.parametrize("shared", [False, True])
def test_block_structure(shared):
    """The align kernel's grouping: every pair once, grouped by expert in pair order, groups padded to
    BLOCK_M, block experts and row counts consistent, unused blocks marked -1; the shared expert's
    pairs (``j = k`` of each token) go to expert E."""
    from m3_kernels import kernel_module

    tokens, experts, top_k = 45, 8, 2
    ids = torch.stack([torch.randperm(experts, generator=torch.Generator().manual_seed(t))[:top_k]
                       for t in range(tokens)]).int()
    ids[:20] = torch.tensor([5, 2], dtype=torch.int32)    # expert 5 and 2: more than one block
    align = moe_launch(tokens, experts, top_k, shared, 64, 32, "float32", interpret=True)
    num_rows, num_blocks = align.outputs[0].shape[0], align.outputs[1].shape[0]
    sorted_pairs = torch.full((num_rows,), -7, dtype=torch.int32)
    block_expert = torch.full((num_blocks,), -7, dtype=torch.int32)
    block_rows = torch.full((num_blocks,), -7, dtype=torch.int32)
    kernel_module("moe", True).align_kernel[align.grid](ids, tokens, num_blocks, sorted_pairs, block_expert, block_rows,
                                                        **align.constexprs)
    flat = torch.cat([ids, torch.full((tokens, 1), experts, dtype=torch.int32)], 1) if shared else ids
    flat, seen, bm = flat.reshape(-1).tolist(), [], align.constexprs["BLOCK_M"]
    assert align.then.then.outputs[0].shape[0] == len(flat)   # down_kernel's weighted [pairs, H]
    for b in range(num_blocks):
        e, n = int(block_expert[b]), int(block_rows[b])
        if e < 0:
            assert n == 0
            continue
        assert 1 <= n <= bm
        pairs = sorted_pairs[b * bm: b * bm + n].tolist()
        assert all(flat[p] == e for p in pairs)
        seen += pairs
    assert seen == sorted(range(len(flat)), key=lambda p: (flat[p], p)), "not every pair once, grouped stably"
    assert int((block_expert >= 0).sum()) == sum(-(-flat.count(e) // bm) for e in range(experts + shared))


def test_model_moe_paths_agree():
    """The model's CPU MoE math (grouped GEMM experts, separate shared expert) and the fused kernels (the
    model's GPU path, shared expert inside) compute the same MoE block."""
    from m3_engine.model_config import M3TextConfig
    from m3_engine.tiny_model import tiny_text_config

    c = M3TextConfig.from_dict(tiny_text_config())
    inputs = make_inputs(3, 13, c.num_local_experts, c.num_experts_per_tok, c.hidden_size, c.intermediate_size)
    layer = m3_torch.model._Layer(
        sparse=True, moe=True, input_norm=None, post_attn_norm=None, qkv=None, q_norm=None, k_norm=None,
        o_proj=None, experts_gate_up=inputs["w_gate_up"], experts_down=inputs["w_down"],
        shared_gate_up=inputs["shared_gate_up"], shared_down=inputs["shared_down"])
    model = m3_torch.model.M3Model.__new__(m3_torch.model.M3Model)
    model.config = c
    x, ids, w = inputs["x"], inputs["topk_ids"], inputs["topk_weights"]
    unfused = model._experts(layer, x, ids.long(), w) * c.routed_scaling_factor + model._shared_expert(layer, x)
    fused = m3_torch.fused_moe(**inputs, swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit,
                               routed_scaling_factor=c.routed_scaling_factor)
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, exc, words", [
    (lambda a: a.update(topk_ids=a["topk_ids"].long()), TypeError, "topk_ids"),
    (lambda a: a.update(topk_weights=a["topk_weights"][:, :1]), ValueError, "topk_weights"),
    (lambda a: a.update(w_down=a["w_down"][:, :, :-1]), ValueError, "w_down"),
    (lambda a: a.update(w_gate_up=a["w_gate_up"][:, :-1]), ValueError, "w_gate_up"),
    (lambda a: a.update(w_gate_up=a["w_gate_up"].double()), TypeError, "w_gate_up"),
    (lambda a: a.update(shared_down=None), ValueError, "both"),
    (lambda a: a.update(shared_gate_up=a["shared_gate_up"][:-2]), ValueError, "shared_gate_up"),
    (lambda a: a.update(shared_down=a["shared_down"].half()), TypeError, "shared_down"),
    (lambda a: a.update(w_down=a["w_down"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "contiguous"),
])
def test_bad_input(change, exc, words):
    inputs = make_inputs(0, 3, 4, 2, 16, 16)
    change(inputs)
    with pytest.raises(exc, match=words):
        run_torch(inputs)


def test_no_tokens():
    inputs = make_inputs(0, 0, 4, 2, 16, 16)
    assert run_torch(inputs).shape == (0, 16)
    assert run_jax(inputs).shape == (0, 16)


# -- GPU: MiniMax-M3's expert shapes ---------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 1100])   # 1100 tokens: the prefill-sized blocks
def test_gpu_m3_shapes(tokens):
    experts, top_k, hidden, inter = 128, 4, 6144, 3072
    inputs = make_inputs(tokens, tokens, experts, top_k, hidden, inter, dtype=torch.bfloat16, device="cuda")
    out = run_torch(inputs).float()
    check = list(range(min(tokens, 6)))   # the float64 reference is slow: a few rows
    sub = {k: (v[check] if k in ("x", "topk_ids", "topk_weights") else v) for k, v in inputs.items()}
    expected = reference(**sub, scale=2.0).float()
    scale = expected.abs().max()
    assert (out[check].cpu() - expected).abs().max() <= 2e-2 * scale, "fused MoE vs float64 reference"
    assert not out.isnan().any()
    with jax.default_device(jax.devices("gpu")[0]):
        jax_out = m3_jax.fused_moe(**{k: m3_jax.to_jax(v) for k, v in inputs.items()}, swiglu_alpha=ALPHA,
                                   swiglu_limit=LIMIT, routed_scaling_factor=2.0)
        assert torch.equal(m3_jax.to_torch(jax_out).float(), out), "JAX and torch launches differ in bits"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", (21, 300))
def test_gpu_float32(tokens):
    """float32 (3xTF32 products) at a decode-sized call and a prefill-sized one (64-row blocks: their
    pipeline stages must fit shared memory with 4-byte tiles)."""
    inputs = make_inputs(5, tokens, 16, 4, 256, 96, device="cuda")
    out = run_torch(inputs)
    torch.testing.assert_close(out.double().cpu(), reference(**inputs, scale=2.0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype,name", (("bf16", "bfloat16"), ("fp32", "float32")))
@pytest.mark.parametrize("tokens", (8, 4096))
def test_plans_fit_hopper_shared_memory(dtype, name, tokens):
    """The GPU plans' GEMMs at M3's shapes (decode- and prefill-sized calls), compiled for Hopper on the CPU:
    their pipeline stages fit one block's shared memory (227 KiB on an H100 / H200) in both dtypes."""
    from test_codegen import compile_for_hopper
    from m3_kernels import kernel_module

    align = moe_launch(tokens, 128, 4, True, 6144, 3072, name, interpret=False)
    kernels = kernel_module("moe", False)
    for step in (align.then, align.then.then):   # gate_up_kernel, down_kernel
        pointers = {p: f"*{dtype}" for p in ("x_ptr", "w_ptr", "shared_w_ptr", "act_ptr")}
        pointers.update(weights_ptr="*fp32", weighted_ptr="*fp32")
        compiled = compile_for_hopper(getattr(kernels, step.kernel.split(".")[1]), dict(step.constexprs),
                                      step.num_warps, step.num_stages, True, pointers)
        assert compiled.metadata.shared <= 227 << 10, (step.kernel, step.num_stages, compiled.metadata.shared)
