"""Block-scaled FP8 weights: ``quantize_weight``, ``quantize_activation``, ``fp8_linear`` and ``fused_moe_fp8``
from torch and JAX (``m3_torch.fp8``, ``m3_jax.fp8``).

CPU tests run the interpreted kernels at small shapes (T = 1, 3, 17; N, K multiples of 128 and an N that is
not), outputs poisoned with NaN (torch). Against two references:

* the float64 product of the DEQUANTIZED operands (x quantized as the kernel does, bit for bit): only the
  order of the float32 sums differs, so the bound is tight (1e-5 of the output's scale in float32);
* the unquantized product: e4m3 keeps 3 mantissa bits, so each operand element is off by up to 2^-4
  (6%) of itself, about 2% RMS (uniform rounding error over an octave); a dot product of random data
  lands about 3-4% (RMS over the output) from the exact one: bounded at 6%.

torch and JAX must give the same bits. ``gpu`` tests run the compiled kernels at MiniMax-M3's shapes; the
compile test checks, on the CPU, that the GPU variants use FP8 tensor-core MMAs on sm_90 and fit its
shared memory.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import m3_jax.fp8 as jfp8
import m3_jax.reference as jref
import m3_torch.fp8 as tfp8
from m3_kernels import fp8_linear as linear_kernels
from m3_kernels import fp8_moe as moe_kernels
from m3_kernels import step_launches
from m3_torch import reference as ref
from m3_torch.model import swiglu_oai
from m3_torch.ops import operand, run

from jax_helpers import _jax_device  # noqa: F401  (autouse: CPU tests run on JAX's CPU device)

E4M3 = torch.float8_e4m3fn
ALPHA, LIMIT = 1.702, 7.0
QUANTIZATION_ERROR = 0.06   # relative (norm) error of a product of e4m3-quantized random operands


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    """Every float output of the torch launches (``out`` and the intermediates ``run`` would allocate) starts
    as NaN."""
    def poisoned_run(launch, outputs=None):
        outputs = dict(outputs or {})
        device = next(t for t in (*outputs.values(), *launch.args) if isinstance(t, torch.Tensor)).device
        step = launch
        while step is not None:
            for o in step.outputs:
                if o.dtype != "int32" and o.name not in outputs:
                    outputs[o.name] = torch.empty(o.shape, dtype=getattr(torch, o.dtype), device=device)
            step = step.then
        for t in outputs.values():
            t.fill_(float("nan"))
        return run(launch, outputs)

    monkeypatch.setattr(tfp8, "run", poisoned_run)


def to_jax(t: torch.Tensor):
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    if t.dtype == E4M3:
        return jnp.asarray(t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn))
    return jnp.asarray(t.numpy())


def to_torch(a) -> torch.Tensor:
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(a.view(np.uint8).copy()).view(E4M3)
    return torch.from_numpy(a.copy())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def rel(got, want) -> float:
    """Relative error in the norm: ||got - want|| / ||want||."""
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


def weight(g, n, k, device="cpu"):
    """A random [n, k] weight with rows of very different magnitudes (each 128-row block gets its own scale)."""
    rows = torch.logspace(-2, 1, n)[torch.randperm(n, generator=g)]
    return (torch.randn(n, k, generator=g) * rows[:, None] * k ** -0.5).to(device)


# -- quantization ----------------------------------------------------------------------------

def test_quantize_activation_bits():
    """The kernel's codes and scales are the reference's bits, also for a zero row, a NaN, huge and tiny
    values and a K with a partial last group; JAX's kernel gives the same bits."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 200, generator=g) * torch.tensor([1.0, 1e-30, 1e30, 3.0, 0.0])[:, None]
    x[3, 7] = float("nan")
    x[0, 130] = 1e4   # the second group of row 0: one large element, the others small (subnormal codes)
    codes, scale = tfp8.quantize_activation(x)
    want_codes, want_scale = ref.quantize_activation_ref(x)
    assert same_bits(codes, want_codes) and same_bits(scale, want_scale)
    assert torch.equal(scale[4], torch.full((2,), np.float32(1e-12) / np.float32(448.0)))   # zero row: the floor
    assert (codes[4].float() == 0).all() and codes[3, 7].float().isnan() and not codes[3, 8:].float().isnan().any()
    jax_codes, jax_scale = jfp8.quantize_activation(to_jax(x))
    assert same_bits(to_torch(jax_codes), codes) and same_bits(to_torch(jax_scale), scale)
    xb = x[:3, :128].to(torch.bfloat16)   # bf16 input
    assert same_bits(tfp8.quantize_activation(xb)[0], ref.quantize_activation_ref(xb)[0])


def test_quantize_weight():
    """Per 128 x 128 block: the largest magnitude maps to +-448, every element within e4m3's rounding
    (half a step: 2^-4 of a normal value, 2^-10 * scale below). JAX's agrees up to XLA's float32 division
    (it multiplies by the reciprocal): scales within an ulp, codes within a step."""
    g = torch.Generator().manual_seed(1)
    w = weight(g, 192, 300).to(torch.bfloat16)
    w[:128, 256:] = 0.0   # an all-zero block
    codes, scale = tfp8.quantize_weight(w)
    assert codes.dtype == E4M3 and codes.shape == (192, 300) and scale.shape == (2, 3)
    assert scale.dtype == torch.float32 and scale[0, 2] == np.float32(1e-12) / np.float32(448.0)
    assert (codes[:128, 256:].float() == 0).all()
    deq = ref.dequantize_fp8_ref(codes, scale)
    full = scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:192, :300]
    err = (deq - w.double()).abs()
    assert (err <= torch.maximum(w.double().abs() * 2.0 ** -4, full * 2.0 ** -10) * (1 + 1e-6)).all()
    blocks = codes.float().abs().reshape(192, 300)
    assert blocks[:128, :128].max() == 448 and blocks[128:, 256:].max() == 448
    jax_codes, jax_scale = (to_torch(a) for a in jfp8.quantize_weight(to_jax(w)))
    assert jax_codes.dtype == E4M3 and jax_scale.dtype == torch.float32
    assert ((jax_scale - scale).abs() <= scale * 2.0 ** -23).all()
    step = (codes.view(torch.uint8).int() - jax_codes.view(torch.uint8).int()).abs()
    assert step.max() <= 1 and step.float().mean() < 0.01
    stacked, stacked_scale = tfp8.quantize_weight(torch.stack([w, -w]))   # [E, N, K]: per expert
    assert same_bits(stacked[0], codes) and same_bits(stacked_scale[1], scale)


# -- fp8_linear ------------------------------------------------------------------------------

def launch_chain(launch) -> list:
    """``launch`` and the launches chained after it, in order."""
    found = []
    while launch is not None:
        found.append(launch)
        launch = launch.then
    return found


LINEAR_CASES = [   # (tokens, N, K, dtype); the interpreter splits K in two ranges where it has two blocks
    (1, 128, 256, torch.float32),
    (3, 256, 128, torch.float32),      # one K block: one split, no sum
    (17, 192, 384, torch.float32),     # N not a multiple of 128, T spanning two 16-row tiles, splits of 2 and 1 blocks
    (3, 128, 256, torch.bfloat16),
]


@pytest.mark.parametrize("tokens, n, k, dtype", LINEAR_CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_linear_matches_references_and_jax_bits(tokens, n, k, dtype):
    kernels = [launch.kernel for launch in launch_chain(step_launches.fp8_linear(
        x=operand(torch.empty(tokens, k, dtype=dtype)), weight=operand(torch.empty(n, k, dtype=E4M3)),
        weight_scale=None, interpret=True))]
    assert ("fp8_linear.sum_splits_kernel" in kernels) == (k > 128), kernels
    g = torch.Generator().manual_seed(tokens * n + k)
    x = (torch.randn(tokens, k, generator=g) * torch.logspace(-1, 1, tokens)[:, None]).to(dtype)
    w = weight(g, n, k)
    codes, scale = tfp8.quantize_weight(w)
    out = tfp8.fp8_linear(x, codes, scale)
    assert out.shape == (tokens, n) and out.dtype == dtype
    want = ref.fp8_linear_ref(x, codes, scale)
    # float32: the order of the sums; bf16: plus the output's rounding (half a step, at most 2^-8 of the value)
    bound = want.abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 0.0) + 1e-5 * want.abs().amax(1, keepdim=True)
    assert ((out.double() - want).abs() <= bound).all(), "fp8_linear vs the float64 product of its operands"
    exact = x.double() @ w.double().T
    assert rel(out, exact) <= QUANTIZATION_ERROR, "FP8 error vs the unquantized product"
    jax_out = (jax.jit(jfp8.fp8_linear) if tokens == 17 else jfp8.fp8_linear)(to_jax(x), to_jax(codes), to_jax(scale))
    assert same_bits(to_torch(jax_out), out), "JAX and torch launches differ in bits"
    jax_ref = to_torch(jref.fp8_linear_ref(to_jax(x), to_jax(codes), to_jax(scale)))
    assert rel(jax_ref, want) <= 1e-6, "the jnp reference vs the float64 one"


def test_linear_no_tokens():
    codes, scale = tfp8.quantize_weight(torch.ones(128, 128))
    assert tfp8.fp8_linear(torch.zeros(0, 128), codes, scale).shape == (0, 128)
    assert jfp8.fp8_linear(jnp.zeros((0, 128)), to_jax(codes), to_jax(scale)).shape == (0, 128)


@pytest.mark.parametrize("change, exc, words", [
    (lambda a: a.update(weight=a["weight"].float()), TypeError, "weight: expected dtype float8_e4m3fn"),
    (lambda a: a.update(weight_scale=a["weight_scale"][:1]), ValueError, "weight_scale: expected ceil"),
    (lambda a: a.update(weight_scale=a["weight_scale"].double()), TypeError, "weight_scale"),
    (lambda a: a.update(x=a["x"][:, :-1]), ValueError, "x: expected K"),
    (lambda a: a.update(x=a["x"].int()), TypeError, "x: expected dtype"),
    (lambda a: a.update(weight=a["weight"].t()), ValueError, "weight_scale: expected ceil"),
])
def test_linear_bad_input(change, exc, words):
    codes, scale = tfp8.quantize_weight(torch.ones(256, 128))
    args = dict(x=torch.ones(2, 128), weight=codes, weight_scale=scale)
    change(args)
    with pytest.raises(exc, match=words):
        tfp8.fp8_linear(**args)


# -- fused_moe_fp8 ---------------------------------------------------------------------------

def moe_inputs(seed, tokens, experts, top_k, hidden, inter, shared, device="cpu"):
    """Random x, expert weights quantized to the format (and their unquantized values), routing, on
    ``device``."""
    g = torch.Generator(device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)

    x = randn(tokens, hidden)
    ids = torch.stack([torch.randperm(experts, generator=g, device=device)[:top_k] for _ in range(tokens)]).int()
    inputs = dict(x=x, topk_ids=ids, topk_weights=torch.rand(tokens, top_k, generator=g, device=device) + 1e-3)
    dense = dict(w_gate_up=randn(experts, 2 * inter, hidden) * hidden ** -0.5 * 2,
                 w_down=randn(experts, hidden, inter) * inter ** -0.5)
    if shared:
        dense.update(shared_gate_up=randn(2 * inter, hidden) * hidden ** -0.5 * 2,
                     shared_down=randn(hidden, inter) * inter ** -0.5)
    for name, w in dense.items():
        # 16 experts at a time: quantize_weight takes a float32 copy
        parts = [tfp8.quantize_weight(chunk) for chunk in (w.split(16) if w.dim() == 3 else [w])]
        inputs[name] = torch.cat([codes for codes, _ in parts]) if w.dim() == 3 else parts[0][0]
        inputs[f"{name}_scale"] = torch.cat([scale for _, scale in parts]) if w.dim() == 3 else parts[0][1]
    return inputs, dense


def moe_reference(inputs, scale):
    """float64 on the CPU, one (token, expert) pair at a time, from the dequantized weights (of the chosen
    experts only): x quantized, the gate/up GEMM's output and SwiGLU-OAI's rounded to x's dtype (the model's)
    as the kernels do, the latter quantized per 128 channels."""
    x = ref.dequantize_activation_ref(*ref.quantize_activation_ref(inputs["x"]))
    dtype = inputs["x"].dtype

    def dequantized(name, e=None):
        codes, scale = inputs[name], inputs[f"{name}_scale"]
        return ref.dequantize_fp8_ref(codes, scale) if e is None else ref.dequantize_fp8_ref(codes[e], scale[e])

    def expert(gate_up, down, rows):
        act = swiglu_oai((rows @ gate_up.T).to(dtype).double(), ALPHA, LIMIT).to(dtype)
        return ref.dequantize_activation_ref(*ref.quantize_activation_ref(act)) @ down.T

    out = torch.zeros(x.shape, dtype=torch.float64)
    ids, weights = inputs["topk_ids"].cpu(), inputs["topk_weights"].cpu()
    experts = {}
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e not in experts:
                experts[e] = dequantized("w_gate_up", e), dequantized("w_down", e)
            out[t] += float(weights[t, j]) * expert(*experts[e], x[t:t + 1])[0]
    out *= scale
    if inputs.get("shared_gate_up") is not None:
        out += expert(dequantized("shared_gate_up"), dequantized("shared_down"), x)
    return out


def run_moe(framework, inputs, scale=2.0, jit=False):
    kwargs = dict(swiglu_alpha=ALPHA, swiglu_limit=LIMIT, routed_scaling_factor=scale)
    if framework == "torch":
        return tfp8.fused_moe_fp8(**inputs, **kwargs)
    fn = jax.jit(lambda **a: jfp8.fused_moe_fp8(**a, **kwargs)) if jit else \
        (lambda **a: jfp8.fused_moe_fp8(**a, **kwargs))
    return to_torch(fn(**{k: to_jax(v) for k, v in inputs.items()}))


MOE_CASES = {   # name: (tokens, experts, top_k, hidden, inter, shared)
    "one token, shared expert": (1, 4, 2, 256, 128, True),
    "17 tokens, 2 blocks of I": (17, 6, 3, 128, 256, False),
}


@pytest.mark.parametrize("name", MOE_CASES)
def test_moe_matches_reference_and_jax_bits(name):
    tokens, experts, top_k, hidden, inter, shared = MOE_CASES[name]
    inputs, dense = moe_inputs(len(name), tokens, experts, top_k, hidden, inter, shared)
    out = run_moe("torch", inputs)
    assert out.shape == (tokens, hidden) and out.dtype == torch.float32
    want = moe_reference(inputs, 2.0)
    # the order of float32 sums, and through it an occasional e4m3 step of one element of act
    assert rel(out, want) <= 1e-3, "fused_moe_fp8 vs the float64 reference of its quantized operands"
    unquantized = ref_unquantized_moe(inputs, dense, 2.0)
    assert rel(out, unquantized) <= 2 * QUANTIZATION_ERROR, "FP8 error vs the unquantized MoE (two GEMMs)"
    assert same_bits(run_moe("jax", inputs, jit=tokens > 1), out), "JAX and torch launches differ in bits"


def ref_unquantized_moe(inputs, dense, scale):
    """The float64 MoE of the unquantized weights."""
    x, ids, weights = inputs["x"].double(), inputs["topk_ids"], inputs["topk_weights"]
    w = {name: t.double() for name, t in dense.items()}
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            act = swiglu_oai(w["w_gate_up"][e] @ x[t], ALPHA, LIMIT)
            out[t] += float(weights[t, j]) * (w["w_down"][e] @ act)
    out *= scale
    if "shared_gate_up" in w:
        out += swiglu_oai(x @ w["shared_gate_up"].T, ALPHA, LIMIT) @ w["shared_down"].T
    return out


@pytest.mark.parametrize("change, exc, words", [
    (lambda a: a.update(w_down_scale=a["w_down_scale"].repeat(1, 1, 2)), ValueError, "w_down_scale"),
    (lambda a: a.update(w_gate_up=a["w_gate_up"].float()), TypeError, "w_gate_up"),
    (lambda a: a.update(shared_down_scale=None), ValueError, "all four"),
    (lambda a: a.update(x=a["x"][:, :64], w_gate_up=a["w_gate_up"][:, :, :64],
                        w_gate_up_scale=a["w_gate_up_scale"][:, :, :1]), ValueError, "multiples of 128"),
    (lambda a: a.update(topk_ids=a["topk_ids"].long()), TypeError, "topk_ids"),
])
def test_moe_bad_input(change, exc, words):
    inputs, _ = moe_inputs(0, 2, 4, 2, 128, 128, True)
    change(inputs)
    with pytest.raises(exc, match=words):
        run_moe("torch", inputs)


# -- the GPU variants, compiled for Hopper on the CPU --------------------------------------------

def test_gpu_variants_use_fp8_mma_and_fit_hopper():
    """fp8_linear's decode variants (T = 1 and 64, split over K) and the FP8 MoE gate_up's (T = 1) compile
    for sm_90 to e4m3 x e4m3 ``wgmma`` (16-token tiles would take ``mma.sync`` on float16 operands, widened
    one by one, were the weight rows not the MMA's 64-row side) within a block's 227 KiB of shared memory.
    The split linear launches fill the H200's 132 SMs at least twice over, and their partial sums are
    added by sum_splits_kernel without atomics. Before its grid wait the linear kernel only prefetches
    weights into L2: no load, copy or store."""
    from test_codegen import compile_for_hopper, operand

    fp8_pointers = ("xq_ptr", "w_ptr", "shared_w_ptr", "act_ptr")
    pointers = {p: "*fp8e4nv" if p in fp8_pointers else "*fp32" for p in (
        *fp8_pointers, "x_scale_ptr", "w_scale_ptr", "shared_w_scale_ptr", "act_scale_ptr", "partial_ptr")}
    e4m3 = dict(dtype="float8_e4m3fn")
    checks = []   # (kernel, launch, out_ptr type, the wgmma instruction)
    for tokens, n, k, instruction in ((1, 6144, 3072, "m64n16k32"), (64, 3072, 6144, "m64n64k32")):
        quantize, linear, sum_splits = launch_chain(step_launches.fp8_linear(
            x=operand(tokens, k), weight=operand(n, k, **e4m3), weight_scale=None, interpret=False))
        assert (quantize.kernel, linear.kernel, sum_splits.kernel) == (
            "fp8_linear.quantize_act_kernel", "fp8_linear.fp8_linear_kernel", "fp8_linear.sum_splits_kernel")
        assert math.prod(linear.grid) >= 2 * 132 and linear.grid[2] > 1, linear.grid
        checks.append((linear_kernels.fp8_linear_kernel, linear, "*fp32", instruction))
        checks.append((linear_kernels.sum_splits_kernel, sum_splits, "*bf16", None))
    gate_up = step_launches.fused_moe_fp8(
        x=operand(1, 6144), w_gate_up=operand(128, 6144, 6144, **e4m3), w_gate_up_scale=None,
        w_down=operand(128, 6144, 3072, **e4m3), w_down_scale=None, topk_ids=operand(1, 4, dtype="int32"),
        topk_weights=None, shared_gate_up=operand(6144, 6144, **e4m3), shared_gate_up_scale=None,
        shared_down=operand(6144, 3072, **e4m3), shared_down_scale=None, swiglu_alpha=ALPHA, swiglu_limit=LIMIT,
        routed_scaling_factor=1.0, interpret=False).then.then
    assert gate_up.kernel == "fp8_moe.fp8_gate_up_kernel"
    checks.append((moe_kernels.fp8_gate_up_kernel, gate_up, "*bf16", "m64n16k32"))
    for fn, launch, out_type, instruction in checks:
        compiled = compile_for_hopper(fn, launch.constexprs, launch.num_warps, launch.num_stages, True,
                                      dict(pointers, out_ptr=out_type))
        ptx = compiled.asm["ptx"]
        name = (fn.__name__, launch.constexprs.get("BLOCK_M"))
        assert compiled.metadata.shared <= 227 << 10, (name, compiled.metadata.shared)
        assert not re.search(r"\b(atom|red)\.", ptx), (name, "atomics")
        if instruction is None:
            continue
        assert f"wgmma.mma_async.sync.aligned.{instruction}.f32.e4m3.e4m3" in ptx, (name, "no FP8 wgmma")
        assert "mma.sync" not in ptx and "cvt.rn.f16x2.e4m3x2" not in ptx, (name, "FP8 operands widened")
        if fn is linear_kernels.fp8_linear_kernel:
            before_wait = ptx[ptx.index(".entry"):ptx.index("griddepcontrol.wait")]
            assert "prefetch.global.L2" in before_wait, name
            assert not any(op in before_wait for op in ("ld.global", "cp.async", "st.global")), name


# -- GPU: MiniMax-M3's shapes ---------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("n, k", [(6144, 3072), (3072, 6144)])
def test_gpu_linear_m3_shapes(tokens, n, k):
    g = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, k, generator=g)).to("cuda", torch.bfloat16)
    codes, scale = tfp8.quantize_weight(weight(g, n, k, "cuda"))
    xq, x_scale = tfp8.quantize_activation(x)
    want_codes, want_scale = ref.quantize_activation_ref(x)
    assert same_bits(xq, want_codes) and same_bits(x_scale, want_scale), "the GPU's quantization differs"
    out = tfp8.fp8_linear(x, codes, scale)
    assert not out.isnan().any()
    check = list(range(min(tokens, 4)))
    want = ref.fp8_linear_ref(x[check], codes, scale)
    # bf16 output rounding plus the tensor cores' FP8 accumulation within a 128-channel block
    assert ((out[check].double().cpu() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-3 * want.abs().amax()).all()
    with jax.default_device(jax.devices("gpu")[0]):
        import m3_jax

        jax_out = jfp8.fp8_linear(*(m3_jax.to_jax(t) for t in (x, codes, scale)))
        assert same_bits(m3_jax.to_torch(jax_out), out), "JAX and torch launches differ in bits"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64])
def test_gpu_moe_m3_shapes(tokens):
    experts, top_k, hidden, inter = 128, 4, 6144, 3072
    inputs, dense = moe_inputs(tokens, tokens, experts, top_k, hidden, inter, True, device="cuda")
    del dense
    inputs["x"] = inputs["x"].to(torch.bfloat16)
    out = run_moe("torch", inputs).float()
    assert not out.isnan().any()
    check = list(range(min(tokens, 3)))
    sub = {k: (v[check] if k in ("x", "topk_ids", "topk_weights") else v) for k, v in inputs.items()}
    want = moe_reference(sub, 2.0)
    # the reference rounds where the kernels do, except the down GEMM's output and the sums (bf16 steps)
    assert rel(out[check], want) <= 1e-2, "fused_moe_fp8 vs float64 reference"
    with jax.default_device(jax.devices("gpu")[0]):
        import m3_jax

        kwargs = dict(swiglu_alpha=ALPHA, swiglu_limit=LIMIT, routed_scaling_factor=2.0)
        jax_out = jfp8.fused_moe_fp8(**{k: m3_jax.to_jax(v) for k, v in inputs.items()}, **kwargs)
        assert same_bits(m3_jax.to_torch(jax_out).float(), out), "JAX and torch launches differ in bits"
