"""Fused model-step ops (add_rms_norm / rms_norm, moe_route, qk_norm_rope) from torch and JAX.

CPU tests run the interpreted kernels (torch CPU tensors; JAX arrays eagerly and
under ``jax.jit``) against the models' own unfused functions and float64, on
random data drawn fresh per case, odd row counts, strided inputs, outputs
poisoned with NaN (torch) and caches poisoned around the rows written. The two
frameworks must give the same bits. ``gpu`` tests run the compiled kernels at
the real model's shapes.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import m3_jax
import m3_kernels
import m3_torch
from m3_kernels import step_launches, tuning, validate
from m3_kernels.pool import PoolLayout
from m3_torch import model as torch_model

from jax_helpers import _jax_device, jax_gpu_ready  # noqa: F401  (autouse: CPU tests run on JAX's CPU device)

DTYPES = ("float32", "bfloat16", "float16")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROWS = (1, 3, 127, 129)
EPS = 1e-6
# the float32 math of a norm differs from the exact value by a few roundings; the dtype's rounding adds half an ulp
F32_ERROR = 2.0 ** -21
HALF_ULP = {"float32": 0.0, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
# float16 subnormals are spaced 2^-24 apart
ATOL = {"float32": 1e-37, "bfloat16": 1e-37, "float16": 2.0 ** -25}


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    """Every output the torch launchers allocate starts as NaN, or -7 for ints (an element the kernel skips
    stays so)."""
    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=device)
    monkeypatch.setattr(m3_torch.fused, "_new_output", poisoned)


# -- helpers -------------------------------------------------------------------------------------

def rand(rng, shape, dtype, scale=1.0, device="cpu") -> torch.Tensor:
    """Normal random values (never all zeros) as a torch tensor of ``dtype``."""
    return torch.from_numpy(rng.standard_normal(shape) * scale).to(TORCH_DTYPES[dtype]).to(device)


def to_jax(t: torch.Tensor):
    """A CPU copy of ``t`` as a jax array of the same dtype (bf16 through ml_dtypes)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    return jnp.asarray(t.numpy())


def to_torch(a) -> torch.Tensor:
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    if a.dtype.name == "float8_e4m3fn":
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    return torch.from_numpy(a.copy())


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what=""):
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), what


def assert_rounded(got: torch.Tensor, ref: torch.Tensor, dtype: str, what=""):
    """``got`` (``dtype``) is the float64 ``ref`` after float32 math and the dtype's rounding:
    within half an ulp of the dtype plus the float32 error, elementwise."""
    err = (got.double() - ref).abs()
    bound = (HALF_ULP[dtype] + F32_ERROR) * ref.abs() + ATOL[dtype]
    bad = ~(err <= bound)
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, worst {float((err - bound).max()):.3g} over"


# -- add_rms_norm / rms_norm ---------------------------------------------------------------------

def norm_inputs(seed, rows, hidden, dtype):
    """x, residual_in, weight: rows of varied magnitude (1e-3 .. 1e3), a weight near 0 (Gemma's 1 + w)."""
    rng = np.random.default_rng(seed)
    magnitude = 10.0 ** rng.uniform(-3, 3, (rows, 1))
    x = rand(rng, (rows, hidden), dtype) * torch.from_numpy(magnitude).to(TORCH_DTYPES[dtype])
    residual = rand(rng, (rows, hidden), dtype) * torch.from_numpy(magnitude).to(TORCH_DTYPES[dtype])
    return x, residual, rand(rng, (hidden,), dtype, scale=0.3)


def norm_reference(r: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float64 Gemma RMSNorm of the (already rounded) rows ``r``."""
    r = r.double()
    return r / torch.sqrt(r.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + weight.double())


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_the_model(dtype, rows):
    hidden = 96 if rows > 3 else 6144 if dtype == "bfloat16" else 200   # the real width; not a multiple of 16
    x, residual_in, weight = norm_inputs(100 + 10 * rows + DTYPES.index(dtype), rows, hidden, dtype)
    residual_out, normed = m3_torch.add_rms_norm(x, residual_in, weight, EPS)
    assert_same_bits(residual_out, x + residual_in, "residual_out: torch's add")
    assert_rounded(normed, norm_reference(residual_out, weight), dtype, "normed")
    model = torch_model.rms_norm(residual_out, weight, EPS)
    # the model's float32 sum rounds differently: within its float32 error, and in bf16/fp16 rarely another value
    assert torch.allclose(normed.double(), model.double(), rtol=2 * (HALF_ULP[dtype] + F32_ERROR), atol=ATOL[dtype])
    if dtype != "float32":
        assert (normed != model).float().mean() < 0.01
    # rms_norm is the same kernel without the residual
    assert_same_bits(m3_torch.rms_norm(residual_out, weight, EPS), normed, "rms_norm")


@pytest.mark.parametrize("framework", ("jax", "jax-jit"))
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_norms_torch_and_jax_give_the_same_bits(framework, dtype):
    x, residual_in, weight = norm_inputs(7, 129, 200, dtype)
    want_res, want = m3_torch.add_rms_norm(x, residual_in, weight, EPS)
    want_plain = m3_torch.rms_norm(x, weight, EPS)
    add, plain = m3_jax.add_rms_norm, m3_jax.rms_norm
    if framework == "jax-jit":
        add, plain = jax.jit(add, static_argnums=3), jax.jit(plain, static_argnums=2)
    got_res, got = add(to_jax(x), to_jax(residual_in), to_jax(weight), EPS)
    assert_same_bits(to_torch(got_res), want_res, "residual_out")
    assert_same_bits(to_torch(got), want, "normed")
    assert_same_bits(to_torch(plain(to_jax(x), to_jax(weight), EPS)), want_plain, "rms_norm")


def test_norm_strided_inputs():
    x, residual_in, weight = norm_inputs(8, 5, 40, "bfloat16")
    want_res, want = m3_torch.add_rms_norm(x, residual_in, weight, EPS)
    wide = torch.full((5, 90), float("nan"), dtype=torch.bfloat16)
    wide[:, 3:83:2] = x                                          # column stride 2, row stride 90
    transposed = residual_in.t().contiguous().t()                # column-major
    weights = torch.full((80,), float("nan"), dtype=torch.bfloat16)
    weights[::2] = weight
    got_res, got = m3_torch.add_rms_norm(wide[:, 3:83:2], transposed, weights[::2], EPS)
    assert_same_bits(got_res, want_res, "residual_out")
    assert_same_bits(got, want, "normed")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")   # numpy, interpreting inf * 0
def test_norm_non_finite_rows_follow_the_model():
    x, residual_in, weight = norm_inputs(9, 4, 64, "float32")
    x[1, 5] = float("nan")          # the whole row NaN
    x[2, 7] = float("inf")          # inv_rms 0: zeros, NaN at the inf
    x[3, 9] = 3e19                  # its square overflows: as an inf
    residual_in[1:] = 0.0
    residual_out, normed = m3_torch.add_rms_norm(x, residual_in, weight, EPS)
    model = torch_model.rms_norm(residual_out, weight, EPS)
    assert normed[1].isnan().all()
    assert normed[2, 7].isnan() and (normed[2, :7] == 0).all() and (normed[3] == 0).all()
    assert torch.equal(normed[1:].isnan(), model[1:].isnan())
    assert torch.equal(normed[1:].nan_to_num(), model[1:].nan_to_num())


NORM_BAD = [
    ("x", lambda x, r, w: (x[0], r, w), ValueError, "x: expected rank 2"),
    ("x", lambda x, r, w: (x.int(), r, w), TypeError, "x: expected dtype"),
    ("residual_in", lambda x, r, w: (x, r.float(), w), TypeError, "residual_in: expected dtype bfloat16"),
    ("residual_in", lambda x, r, w: (x, r[:2], w), ValueError, "residual_in: expected T (rows of x) = 3"),
    ("weight", lambda x, r, w: (x, r, w[:-1]), ValueError, "weight: expected H (columns of x) = 16"),
    ("weight", lambda x, r, w: (x, r, w[None]), ValueError, "weight: expected rank 1"),
]


@pytest.mark.parametrize("framework", ("torch", "jax"))
@pytest.mark.parametrize("mutate,error,message", [b[1:] for b in NORM_BAD], ids=[b[0] for b in NORM_BAD])
def test_norm_bad_arguments_name_the_argument(framework, mutate, error, message):
    args = mutate(*norm_inputs(10, 3, 16, "bfloat16"))
    m = m3_torch if framework == "torch" else m3_jax
    if framework == "jax":
        args = [to_jax(a) for a in args]
    with pytest.raises(error, match=re.escape(message)):
        m.add_rms_norm(*args, EPS)


@pytest.mark.parametrize("eps,error", [("1e-6", TypeError), (-1.0, ValueError), (float("nan"), ValueError)])
def test_norm_eps_must_be_a_float(eps, error):
    x, _, weight = norm_inputs(11, 3, 16, "float32")
    with pytest.raises(error, match="eps: expected a float"):
        m3_torch.rms_norm(x, weight, eps)


# -- moe_route -----------------------------------------------------------------------------------

def route_reference(x, router_weight, bias, top_k):
    """The models' router (torch: the dtype's F.linear, float32 sigmoid) -> (ids best first with ties to the
    lowest id, NaN scores last; weights; the sorted scores)."""
    probs = torch.sigmoid(torch.nn.functional.linear(x, router_weight).float())
    score = (probs + bias.float()).nan_to_num(nan=float("-inf"))
    sorted_scores, order = torch.sort(score, dim=-1, descending=True, stable=True)
    ids = order[:, :top_k]
    top = probs.gather(1, ids)
    return ids.int(), top / top.sum(-1, keepdim=True), sorted_scores


def assert_route_where_apart(ids, weights, want_ids, want_weights, scores, *, gap, rtol, min_share=None):
    """The reference's ids and weights in every row whose 5 best (sorted) ``scores`` are more than ``gap``
    apart; ``min_share``: at least that share of the rows must be such rows."""
    apart = (scores[:, :4] - scores[:, 1:5]).min(-1).values > gap
    if min_share is not None:
        assert apart.float().mean() > min_share
    assert torch.equal(ids[apart], want_ids[apart])
    torch.testing.assert_close(weights[apart], want_weights[apart], rtol=rtol, atol=0)


def grid_route_inputs(seed, tokens, hidden, experts, dtype):
    """Router inputs whose logits are exact in float32 in any summation order (7-bit values, so ~14-bit sums:
    bf16 and fp16 round them; scaled by powers of two to logits of about +-2), so the kernel must find the
    reference's experts exactly; a random bias (distinct scores)."""
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.integers(-64, 65, (tokens, hidden)) / 64.0)
    w = torch.from_numpy(rng.integers(-64, 65, (experts, hidden)) / 2.0 ** (7 + round(np.log2(hidden / 48) / 2)))
    bias = torch.from_numpy(rng.standard_normal(experts) * 0.05).float()
    return x.to(TORCH_DTYPES[dtype]), w.to(TORCH_DTYPES[dtype]), bias


def test_moe_route_split_logits(monkeypatch):
    """The GPU's decode launch (the logits' partial sums over 8 ranges of H, 16 experts a program) in the
    interpreter: the same choice and weights as the reference (the logits are exact in any order)."""
    original = tuning.router
    monkeypatch.setattr(tuning, "router", lambda **kw: original(**dict(kw, interpret=False)))
    x, router_weight, bias = grid_route_inputs(5, 5, 200, 40, "bfloat16")
    launch = step_launches.moe_route(x=m3_torch.ops.operand(x), router_weight=m3_torch.ops.operand(router_weight),
                                     bias=bias, top_k=4, interpret=True)
    assert launch.grid == (1, 4, 8)
    ids, weights = m3_torch.moe_route(x, router_weight, bias, 4)
    want_ids, want_weights, _ = route_reference(x, router_weight, bias, 4)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)


ROUTE_CASES = [("float32", 1, 40, 4), ("bfloat16", 3, 128, 4), ("float16", 127, 256, 8), ("bfloat16", 129, 16, 1),
               ("float32", 129, 33, 8)]


@pytest.mark.parametrize("dtype,tokens,experts,top_k", ROUTE_CASES, ids=lambda v: str(v))
def test_moe_route_matches_the_model(dtype, tokens, experts, top_k):
    x, router_weight, bias = grid_route_inputs(tokens + experts, tokens, 48, experts, dtype)
    ids, weights = m3_torch.moe_route(x, router_weight, bias, top_k)
    want_ids, want_weights, _ = route_reference(x, router_weight, bias, top_k)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)
    torch.testing.assert_close(weights.double().sum(-1), torch.ones(tokens, dtype=torch.float64), rtol=1e-6, atol=0)


def test_moe_route_random_router_float32():
    rng = np.random.default_rng(20)
    x, router_weight = rand(rng, (127, 200), "float32"), rand(rng, (128, 200), "float32", scale=0.1)
    bias = rand(rng, (128,), "float32", scale=0.02)
    ids, weights = m3_torch.moe_route(x, router_weight, bias, 4)
    want_ids, want_weights, scores = route_reference(x, router_weight, bias, 4)
    # rows whose best 5 scores are apart by more than the logits' float32 rounding must agree exactly
    assert_route_where_apart(ids, weights, want_ids, want_weights, scores, gap=1e-5, rtol=1e-5, min_share=0.9)


def test_moe_route_ties_go_to_the_lowest_id_and_nan_loses():
    x, router_weight, bias = grid_route_inputs(21, 3, 32, 24, "bfloat16")
    router_weight[[2, 5, 9, 11]] = router_weight[7].clone()   # equal logits ...
    bias[[2, 5, 9, 7]] = 1.0                                   # ... and equal, dominant scores: 2, 5, 7, 9
    bias[11] = float("nan")                                    # a NaN score: never chosen
    ids, weights = m3_torch.moe_route(x, router_weight, bias, 3)
    assert ids.tolist() == [[2, 5, 7]] * 3
    torch.testing.assert_close(weights, torch.full((3, 3), 1 / 3), rtol=1e-6, atol=0)
    x[1] = float("nan")                              # every score NaN: the lowest ids, NaN weights
    ids, weights = m3_torch.moe_route(x, router_weight, bias, 5)
    assert ids[1].tolist() == [0, 1, 2, 3, 4] and weights[1].isnan().all()
    assert ids[0].tolist()[:4] == [2, 5, 7, 9] and not weights[[0, 2]].isnan().any()


@pytest.mark.parametrize("framework", ("jax", "jax-jit"))
def test_moe_route_torch_and_jax_give_the_same_bits(framework):
    rng = np.random.default_rng(22)
    x, router_weight = rand(rng, (129, 96), "bfloat16"), rand(rng, (128, 96), "bfloat16", scale=0.1)
    bias = rand(rng, (128,), "float32", scale=0.02)
    want = m3_torch.moe_route(x, router_weight, bias, 4)
    fn = jax.jit(m3_jax.moe_route, static_argnums=3) if framework == "jax-jit" else m3_jax.moe_route
    got = fn(to_jax(x), to_jax(router_weight), to_jax(bias), 4)
    for g, w in zip(got, want):
        assert_same_bits(to_torch(g), w, framework)


def test_moe_route_strided_inputs():
    x, router_weight, bias = grid_route_inputs(23, 5, 40, 20, "bfloat16")
    want = m3_torch.moe_route(x, router_weight, bias, 4)
    wide = torch.full((5, 100), float("nan"), dtype=torch.bfloat16)
    wide[:, 1:81:2] = x
    got = m3_torch.moe_route(wide[:, 1:81:2], router_weight.t().contiguous().t(), bias.expand(2, 20)[1], 4)
    for g, w in zip(got, want):
        assert_same_bits(g, w)


ROUTE_BAD = [
    ("x", lambda x, w, b, k: (x[0], w, b, k), ValueError, "x: expected rank 2"),
    ("x", lambda x, w, b, k: (x.int(), w, b, k), TypeError, "x: expected dtype"),
    ("router_weight", lambda x, w, b, k: (x, w.float(), b, k), TypeError, "router_weight: expected dtype bfloat16"),
    ("router_weight", lambda x, w, b, k: (x, w[:, 1:], b, k), ValueError, "router_weight: expected H (columns of x)"),
    ("router_weight", lambda x, w, b, k: (x, w.repeat(13, 1), b, k), ValueError,
     "router_weight: expected E in [1, 256]"),
    ("bias", lambda x, w, b, k: (x, w, b[1:], k), ValueError, "bias: expected E (rows of router_weight) = 20"),
    ("bias", lambda x, w, b, k: (x, w, b.int(), k), TypeError, "bias: expected dtype"),
    ("top_k", lambda x, w, b, k: (x, w, b, 9), ValueError, "top_k: expected 1 <= top_k <= min(8, E = 20)"),
    ("top_k", lambda x, w, b, k: (x, w, b, 0), ValueError, "top_k: expected 1 <= top_k"),
    ("top_k", lambda x, w, b, k: (x, w, b, 2.0), TypeError, "top_k: expected an int"),
]


@pytest.mark.parametrize("framework", ("torch", "jax"))
@pytest.mark.parametrize("mutate,error,message", [b[1:] for b in ROUTE_BAD], ids=[b[0] for b in ROUTE_BAD])
def test_moe_route_bad_arguments_name_the_argument(framework, mutate, error, message):
    x, w, b, k = mutate(*grid_route_inputs(24, 3, 16, 20, "bfloat16"), 4)
    m = m3_torch if framework == "torch" else m3_jax
    if framework == "jax":
        x, w, b = to_jax(x), to_jax(w), to_jax(b)
    with pytest.raises(error, match=re.escape(message)):
        m.moe_route(x, w, b, k)


# -- qk_norm_rope ----------------------------------------------------------------------------------

# head shapes: partial rotation with the index rotating all of Di; full rotation with Di wider than rotary_dim;
# three q heads and rotary_dim wider than Di (the index takes the table's first Di columns as they are); dense
QK_SHAPES = {"sparse": dict(hq=4, hk=2, d=32, rot=16, di=16), "wide_index": dict(hq=2, hk=1, d=16, rot=16, di=32),
             "narrow_index": dict(hq=3, hk=1, d=32, rot=24, di=16), "dense": dict(hq=4, hk=2, d=32, rot=32, di=0),
             "m3": dict(hq=64, hk=4, d=128, rot=64, di=128)}   # the real model (GPU tests)
SLOTS = 3   # pool slots: 384 rows


def qk_inputs(seed, tokens, shape, dtype, kv_cache_dtype="auto", index_cache_dtype="auto", slot_dtype=torch.int32):
    """The op's inputs as torch tensors, the pool (two layers; the op writes layer 1, at nonzero offsets) poisoned
    with 0xFF bytes (NaN in every cache dtype), and its layout."""
    rng = np.random.default_rng(seed)
    s = QK_SHAPES[shape]
    hq, hk, d, rot, di = s["hq"], s["hk"], s["d"], s["rot"], s["di"]
    width = (hq + 2 * hk) * d + ((hk + 1) * di if di else 0)
    x = dict(qkv=rand(rng, (tokens, width), dtype, scale=2.0),
             positions=torch.from_numpy(rng.integers(0, 500_000, tokens)),
             inv_freq=1.0 / (5e6 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)),
             q_norm=rand(rng, (d,), dtype, 0.3), k_norm=rand(rng, (d,), dtype, 0.3))
    slots = torch.from_numpy(rng.permutation(SLOTS * 128)[:tokens]).to(slot_dtype)
    slots[rng.random(tokens) < 0.2] = -1
    x["slot_mapping"] = slots
    layout = PoolLayout.create(SLOTS, sparse=(not di, bool(di)), num_kv_heads=hk, head_dim=d, index_head_dim=di or None,
                               dtype=dtype, kv_cache_dtype=kv_cache_dtype, index_cache_dtype=index_cache_dtype)
    if di:
        x.update(index_q_norm=rand(rng, (di,), dtype, 0.3), index_k_norm=rand(rng, (di,), dtype, 0.3))
    return x, new_pool(layout), layout


def new_pool(layout) -> torch.Tensor:
    nbytes = layout.numel * torch.empty((), dtype=getattr(torch, layout.buffer_dtype)).element_size()
    return torch.full((nbytes,), 0xFF, dtype=torch.uint8).view(getattr(torch, layout.buffer_dtype))


def run_qk_torch(x, pool, layout, **kw):
    k_cache, v_cache, index_k_cache = m3_torch.layer_caches(pool, layout, 1)
    return m3_torch.qk_norm_rope(x["qkv"], x["positions"], x["inv_freq"], x["q_norm"], x["k_norm"], k_cache, v_cache,
                                 x["slot_mapping"], num_q_heads=_q_heads(x, layout), eps=EPS,
                                 index_q_norm=x.get("index_q_norm"), index_k_norm=x.get("index_k_norm"),
                                 index_k_cache=index_k_cache, **kw)


def run_qk_jax(x, pool, layout, jit=False, **kw):
    """-> (q, idx_q, pool) as torch tensors."""
    j = {name: to_jax(t) for name, t in x.items()}
    kw = {name: to_jax(s) if isinstance(s, torch.Tensor) else s for name, s in kw.items()}

    def step(j, pool):
        k_cache, v_cache, index_k_cache = m3_jax.layer_views(pool, layout, 1)
        q, idx_q, k_cache, _, _ = m3_jax.qk_norm_rope(
            j["qkv"], j["positions"], j["inv_freq"], j["q_norm"], j["k_norm"], k_cache, v_cache, j["slot_mapping"],
            num_q_heads=_q_heads(x, layout), eps=EPS, index_q_norm=j.get("index_q_norm"),
            index_k_norm=j.get("index_k_norm"), index_k_cache=index_k_cache, **kw)
        return q, idx_q, k_cache.buffer
    if jit:
        step = jax.jit(step, donate_argnums=1)
    q, idx_q, pool = step(j, to_jax(pool))
    return to_torch(q), None if idx_q is None else to_torch(idx_q), to_torch(pool)


def _q_heads(x, layout) -> int:
    spec = layout.layers[1]
    index = (spec.num_kv_heads + 1) * spec.index_head_dim if spec.sparse else 0
    return (x["qkv"].shape[1] - index) // spec.head_dim - 2 * spec.num_kv_heads


def qk_reference(x, layout):
    """The unfused model (m3_torch.model's functions) -> q, k, v, idx_q, idx_k (None, None: dense)."""
    spec = layout.layers[1]
    qkv = x["qkv"]
    T, hk, d, di = qkv.shape[0], spec.num_kv_heads, spec.head_dim, spec.index_head_dim
    hq = _q_heads(x, layout)
    cos, sin = torch_model.rope_cos_sin(x["positions"], x["inv_freq"], qkv.dtype)
    sizes = [hq * d, hk * d, hk * d] + ([hk * di, di] if spec.sparse else [])
    parts = qkv.split(sizes, dim=-1)
    q = torch_model.apply_rope(torch_model.rms_norm(parts[0].reshape(T, hq, d), x["q_norm"], EPS), cos, sin)
    k = torch_model.apply_rope(torch_model.rms_norm(parts[1].reshape(T, hk, d), x["k_norm"], EPS), cos, sin)
    v = parts[2].reshape(T, hk, d)
    if not spec.sparse:
        return q, k, v, None, None
    rot = min(cos.shape[1], di)   # M3TextConfig.index_rotary_dim
    icos, isin = cos[:, :rot], sin[:, :rot]
    idx_q = torch_model.apply_rope(torch_model.rms_norm(parts[3].reshape(T, hk, di), x["index_q_norm"], EPS),
                                   icos, isin)
    idx_k = torch_model.apply_rope(torch_model.rms_norm(parts[4].reshape(T, 1, di), x["index_k_norm"], EPS),
                                   icos, isin)
    return q, k, v, idx_q, idx_k.reshape(T, di)


def assert_near_model(got, want, dtype, what):
    """Rounded as the model: mostly the same bits; the rest within 2 ulps of the dtype (float32: a few float32
    roundings) of the head's largest value (RoPE's sum may cancel)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN where the model has none, or the reverse"
    got, want = got.double().nan_to_num(), want.double().nan_to_num()
    scale = want.abs().amax(-1, keepdim=True)
    ulps = {"float32": 8 * 2.0 ** -23, "bfloat16": 2 * 2.0 ** -7, "float16": 2 * 2.0 ** -10}[dtype]
    err = (got - want).abs()
    assert (err <= ulps * scale).all(), f"{what}: off by {float((err / scale.clamp_min(1e-30)).max()):.3g} of scale"
    if dtype != "float32":
        assert (got != want).double().mean() < 0.01, f"{what}: {int((got != want).sum())} differ"


QK_CASES = [("bfloat16", 1, "sparse"), ("bfloat16", 129, "sparse"), ("float32", 3, "narrow_index"),
            ("float16", 127, "wide_index"), ("float32", 129, "dense"), ("bfloat16", 3, "dense")]


@pytest.mark.parametrize("dtype,tokens,shape", QK_CASES, ids=lambda v: str(v))
def test_qk_norm_rope_matches_the_model(dtype, tokens, shape):
    slot_dtype = torch.int64 if tokens == 3 else torch.int32
    x, pool, layout = qk_inputs(30 + tokens + DTYPES.index(dtype), tokens, shape, dtype, slot_dtype=slot_dtype)
    q, idx_q = run_qk_torch(x, pool, layout)
    want_q, k, v, want_idx_q, idx_k = qk_reference(x, layout)
    assert_near_model(q, want_q, dtype, "q")
    assert (idx_q is None) == (want_idx_q is None)
    if idx_q is not None:
        assert_near_model(idx_q, want_idx_q, dtype, "idx_q")
    # the caches: the model's rows through write_cache into an identically poisoned pool
    expected = new_pool(layout)
    m3_torch.write_cache(k, v, idx_k, *m3_torch.layer_caches(expected, layout, 1), x["slot_mapping"])
    for name, got_cache, want_cache in zip(("k_cache", "v_cache", "index_k_cache"),
                                           m3_torch.layer_caches(pool, layout, 1),
                                           m3_torch.layer_caches(expected, layout, 1)):
        if want_cache is not None:
            assert_near_model(got_cache, want_cache, dtype, name)
    assert_same_bits(outside_layer(pool, layout), outside_layer(new_pool(layout), layout), "the rest of the pool")


def outside_layer(pool, layout, layer=1) -> torch.Tensor:
    """``pool`` with layer ``layer``'s caches zeroed: what must not change when the op writes that layer."""
    pool = pool.clone()
    for cache in m3_torch.layer_caches(pool, layout, layer):
        if cache is not None:
            cache.zero_()
    return pool


@pytest.mark.parametrize("kv_cache_dtype,index_cache_dtype", [("fp8", "fp8"), ("fp8", "auto"), ("auto", "fp8")])
def test_qk_norm_rope_fp8_caches_hold_write_caches_bytes(kv_cache_dtype, index_cache_dtype):
    """FP8 caches get the bytes write_cache stores from the rows the op writes into a bf16 pool."""
    x, pool, layout = qk_inputs(40, 37, "sparse", "bfloat16")
    run_qk_torch(x, pool, layout)
    rows = torch.where(x["slot_mapping"] >= 0, x["slot_mapping"], 0).long()
    k, v, idx_k = (c[rows // 128, :, rows % 128] if c.dim() == 4 else c[rows // 128, rows % 128]
                   for c in m3_torch.layer_caches(pool, layout, 1))
    scales = dict(k_scale=torch.tensor(0.37), v_scale=torch.tensor([2.5])) if kv_cache_dtype == "fp8" else {}
    _, fp8_pool, fp8_layout = qk_inputs(40, 37, "sparse", "bfloat16", kv_cache_dtype, index_cache_dtype)
    run_qk_torch(x, fp8_pool, fp8_layout, **scales)
    expected = new_pool(fp8_layout)
    m3_torch.write_cache(k, v, idx_k, *m3_torch.layer_caches(expected, fp8_layout, 1), x["slot_mapping"], **scales)
    assert_same_bits(fp8_pool, expected)


@pytest.mark.parametrize("framework", ("jax", "jax-jit"))
@pytest.mark.parametrize("case", [("bfloat16", "sparse", "fp8", "auto"), ("float32", "dense", "auto", "auto")],
                         ids=lambda c: "-".join(c))
def test_qk_norm_rope_torch_and_jax_give_the_same_bits(framework, case):
    dtype, shape, kv_cache_dtype, index_cache_dtype = case
    x, pool, layout = qk_inputs(50, 129, shape, dtype, kv_cache_dtype, index_cache_dtype)
    scales = dict(k_scale=torch.tensor(0.5), v_scale=torch.tensor(1.5)) if kv_cache_dtype == "fp8" else {}
    got = run_qk_jax(x, pool.clone(), layout, jit=framework == "jax-jit", **scales)
    want = (*run_qk_torch(x, pool, layout, **scales), pool)
    for name, g, w in zip(("q", "idx_q", "pool"), got, want):
        if w is None:
            assert g is None
        else:
            assert_same_bits(g, w, name)


def test_qk_norm_rope_strided_qkv():
    x, pool, layout = qk_inputs(60, 5, "sparse", "bfloat16")
    want_pool = pool.clone()
    want = run_qk_torch(x, want_pool, layout)
    width = x["qkv"].shape[1]
    wide = torch.full((5, 2 * width + 10), float("nan"), dtype=torch.bfloat16)
    wide[:, 3:3 + 2 * width:2] = x["qkv"]
    got = run_qk_torch(dict(x, qkv=wide[:, 3:3 + 2 * width:2], positions=x["positions"].expand(2, 5)[1]), pool, layout)
    for g, w in zip(got, want):
        assert_same_bits(g, w)
    assert_same_bits(pool, want_pool, "pool")


def qk_arguments(x, pool, layout, framework) -> dict:
    """The keyword arguments of ``qk_norm_rope`` for ``framework``'s launcher (the caches: layer 1 of ``pool``)."""
    if framework == "jax":
        x = {name: to_jax(t) for name, t in x.items()}
        caches = m3_jax.layer_views(to_jax(pool), layout, 1)
    else:
        caches = m3_torch.layer_caches(pool, layout, 1)
    return dict(x, k_cache=caches[0], v_cache=caches[1], index_k_cache=caches[2], num_q_heads=_q_heads(x, layout),
                eps=EPS)


QK_BAD = [
    ("qkv", lambda a: dict(a, qkv=a["qkv"][:, :-16]), ValueError, "qkv: expected width (Hq + 2*Hk)*D + (Hi + 1)*Di"),
    ("qkv", lambda a: dict(a, qkv=a["qkv"][0]), ValueError, "qkv: expected rank 2"),
    ("num_q_heads", lambda a: dict(a, num_q_heads=5), ValueError, "qkv: expected width"),
    ("num_q_heads", lambda a: dict(a, num_q_heads=0), ValueError, "num_q_heads: expected an int >= 1"),
    ("positions", lambda a: dict(a, positions=a["positions"].astype("float32") if hasattr(a["positions"], "astype")
                                 else a["positions"].float()), TypeError, "positions: expected dtype int32 or int64"),
    ("slot_mapping", lambda a: dict(a, slot_mapping=a["slot_mapping"][:-1]), ValueError,
     "slot_mapping: expected T (rows of qkv) = 5"),
    ("inv_freq", lambda a: dict(a, inv_freq=a["inv_freq"][None]), ValueError, "inv_freq: expected rank 1"),
    ("q_norm", lambda a: dict(a, q_norm=a["q_norm"][:-1]), ValueError, "q_norm: expected D (head dim of k_cache)"),
    ("index_k_norm", lambda a: dict(a, index_k_norm=None), ValueError, "index_k_norm: missing"),
    ("k_scale", lambda a: dict(a, k_scale=2.0), ValueError, "k_scale: scales apply to float8_e4m3fn"),
    ("eps", lambda a: dict(a, eps=None), TypeError, "eps: expected a float"),
]


@pytest.mark.parametrize("framework", ("torch", "jax"))
@pytest.mark.parametrize("mutate,error,message", [b[1:] for b in QK_BAD], ids=[b[0] for b in QK_BAD])
def test_qk_norm_rope_bad_arguments_name_the_argument(framework, mutate, error, message):
    x, pool, layout = qk_inputs(70, 5, "sparse", "bfloat16")
    args = mutate(qk_arguments(x, pool, layout, framework))
    m = m3_torch if framework == "torch" else m3_jax
    with pytest.raises(error, match=re.escape(message)):
        m.qk_norm_rope(**args)


def test_qk_norm_rope_wants_one_buffer():
    x, pool, layout = qk_inputs(71, 5, "sparse", "bfloat16")
    args = qk_arguments(x, pool, layout, "torch")
    with pytest.raises(ValueError, match="k_cache, v_cache, index_k_cache: expected views of one buffer"):
        m3_torch.qk_norm_rope(**dict(args, v_cache=args["v_cache"].clone()))
    args = qk_arguments(x, pool, layout, "jax")
    with pytest.raises(TypeError, match="v_cache: expected a PagedView"):
        m3_jax.qk_norm_rope(**dict(args, v_cache=jnp.zeros(args["v_cache"].shape, jnp.bfloat16)))
    other = m3_jax.layer_views(to_jax(pool), layout, 1)
    with pytest.raises(ValueError, match="expected views of one buffer"):
        m3_jax.qk_norm_rope(**dict(args, index_k_cache=other.index_k_cache))


@pytest.mark.parametrize("framework", ("torch", "jax"))
def test_qk_norm_rope_checks_slot_values_under_m3_validate(framework, monkeypatch):
    x, pool, layout = qk_inputs(72, 5, "sparse", "bfloat16")
    x["slot_mapping"][2] = SLOTS * 128   # one past the pool
    args = qk_arguments(x, pool, layout, framework)
    monkeypatch.setenv("M3_VALIDATE", "1")
    with pytest.raises(ValueError, match="qk_norm_rope: slot_mapping: token 2 is 384"):
        (m3_torch if framework == "torch" else m3_jax).qk_norm_rope(**args)


# -- no tokens -------------------------------------------------------------------------------------

@pytest.mark.parametrize("framework", ("torch", "jax"))
def test_no_tokens(framework):
    x, residual_in, weight = norm_inputs(110, 3, 16, "bfloat16")
    route = grid_route_inputs(111, 3, 16, 20, "bfloat16")
    qk, pool, layout = qk_inputs(112, 3, "sparse", "bfloat16")
    empty = {name: t[:0] for name, t in qk.items() if name in ("qkv", "positions", "slot_mapping")}
    if framework == "torch":
        residual_out, normed = m3_torch.add_rms_norm(x[:0], residual_in[:0], weight, EPS)
        ids, weights = m3_torch.moe_route(route[0][:0], *route[1:], 4)
        q, idx_q = run_qk_torch(dict(qk, **empty), pool, layout)
        assert_same_bits(pool, new_pool(layout), "pool")
    else:
        residual_out, normed = m3_jax.add_rms_norm(to_jax(x[:0]), to_jax(residual_in[:0]), to_jax(weight), EPS)
        ids, weights = m3_jax.moe_route(*(to_jax(t) for t in (route[0][:0], *route[1:])), 4)
        q, idx_q, got_pool = run_qk_jax(dict(qk, **empty), pool, layout)
        assert_same_bits(got_pool, pool, "pool")
    assert residual_out.shape == normed.shape == (0, 16) and ids.shape == weights.shape == (0, 4)
    assert q.shape == (0, 4, 32) and idx_q.shape == (0, 2, 16)
    assert str(ids.dtype).endswith("int32") and str(weights.dtype).endswith("float32")


# -- the GPU variants: they compile, and vectorize without the divisibility facts torch passes ------------

GPU_KERNELS = {"norm": "rms_norm_kernel", "router": "router_logits_kernel", "qk_rope": "qk_norm_rope_kernel"}


def hopper_build(kernel: str):
    """The compiled GPU variant of ``kernel`` at the real model's shapes, built as jax-triton builds it
    (integer arguments without divisibility facts; ``test_codegen.compile_for_hopper``)."""
    from test_codegen import compile_for_hopper, operand

    bf16 = "*bf16"
    if kernel == "norm":
        launch = step_launches.rms_norm(x=operand(4096, 6144), residual=operand(4096, 6144), weight=None, eps=EPS,
                                        interpret=False)
        constexprs = dict(stride_xh=1, stride_rh=1)
        pointers = dict(x_ptr=bf16, residual_ptr=bf16, weight_ptr=bf16, normed_ptr=bf16, residual_out_ptr=bf16)
    elif kernel == "router":
        launch = step_launches.moe_route(x=operand(8, 6144), router_weight=operand(128, 6144), bias=None, top_k=4,
                                         interpret=False)   # the decode split
        constexprs = dict(stride_xh=1, stride_rh=1)
        pointers = dict(x_ptr=bf16, router_ptr=bf16, partial_ptr="*fp32")
    else:
        call = validate.QKRopeCall(300, 64, 4, 128, 128, 64, 64, EPS)
        fp8 = "float8_e4m3fn"
        launch = step_launches.qk_norm_rope(
            call=call, qkv=operand(300, 9856), positions=None, inv_freq=None, q_norm=None, k_norm=None,
            index_q_norm=None, index_k_norm=None, slot_mapping=None, k_cache=operand(3, 4, 128, 128, dtype=fp8),
            v_cache=operand(3, 4, 128, 128, dtype=fp8), index_k_cache=operand(3, 128, 128), pool=operand(1, dtype="uint8"),
            interpret=False, k_scale="k_scale", v_scale="v_scale")
        constexprs = dict(stride_xc=1, stride_ckd=1, stride_cvd=1, stride_cid=1)
        pointers = dict(qkv_ptr=bf16, inv_freq_ptr="*fp32", q_norm_ptr=bf16, k_norm_ptr=bf16, index_q_norm_ptr=bf16,
                        index_k_norm_ptr=bf16, k_scale_ptr="*fp32", v_scale_ptr="*fp32", pool_in_ptr="*u8",
                        pool_ptr="*u8", q_ptr=bf16, index_q_ptr=bf16)
    config = dict(launch.constexprs, ALIGNED=True, **constexprs)
    fn = getattr(m3_kernels.kernel_module(kernel, False), GPU_KERNELS[kernel])
    return compile_for_hopper(fn, config, launch.num_warps, launch.num_stages, False, pointers)


@pytest.mark.parametrize("kernel", ("norm", "router", "qk_rope"))
def test_gpu_variants_compile_for_hopper_and_vectorize_under_jax_triton(kernel):
    ptx = hopper_build(kernel).asm["ptx"]
    loads = re.findall(r"ld\.global\S*", ptx)
    if kernel == "router":
        assert "cp.async" in ptx, "the router's loads lost their pipelining"
    elif kernel == "norm":
        assert all(".v" in op for op in loads), loads
    else:   # the heads' channels (the scalars: positions, slots, scales)
        assert sum(".v" in op for op in loads) >= 8, loads
    assert "cos.approx" not in ptx and "sin.approx" not in ptx
    if kernel == "qk_rope":   # RoPE's products rounded before their sum, as the model rounds them (libdevice's
        # float64 cos / sin call fma themselves)
        assert not re.search(r"fma\.\S*(bf16|f16|f32)", ptx), sorted(set(re.findall(r"fma\.\S+", ptx)))


# -- GPU: the real model's shapes --------------------------------------------------------------------

def _jax_on_gpu(fn, *args, **kwargs):
    with jax.default_device(jax.devices("gpu")[0]):
        return fn(*args, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", (1, 257, 4099))
def test_gpu_add_rms_norm_real_shapes(rows):
    x, residual_in, weight = (t.cuda() for t in norm_inputs(80 + rows, rows, 6144, "bfloat16"))
    residual_out, normed = m3_torch.add_rms_norm(x, residual_in, weight, EPS)
    assert_same_bits(residual_out, x + residual_in, "residual_out")
    assert_rounded(normed.cpu(), norm_reference(residual_out, weight).cpu(), "bfloat16", "normed")
    model = torch_model.rms_norm(residual_out, weight, EPS)
    assert (normed != model).float().mean() < 0.01
    plain = m3_torch.rms_norm(x, weight, EPS)
    if not jax_gpu_ready():
        pytest.skip("needs a JAX GPU backend and jax_triton for the JAX half")
    for jit in (False, True):
        add, norm = m3_jax.add_rms_norm, m3_jax.rms_norm
        if jit:
            add, norm = jax.jit(add, static_argnums=3), jax.jit(norm, static_argnums=2)
        got_res, got = _jax_on_gpu(add, to_jax(x), to_jax(residual_in), to_jax(weight), EPS)
        assert_same_bits(to_torch(got_res), residual_out, "residual_out")
        assert_same_bits(to_torch(got), normed, "normed")
        assert_same_bits(to_torch(_jax_on_gpu(norm, to_jax(x), to_jax(weight), EPS)), plain, "rms_norm")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", (1, 100, 4096))
def test_gpu_moe_route_real_shapes(tokens):
    x, router_weight, bias = (t.cuda() for t in grid_route_inputs(90, tokens, 6144, 128, "bfloat16"))
    ids, weights = m3_torch.moe_route(x, router_weight, bias, 4)
    want_ids, want_weights, scores = route_reference(x, router_weight, bias, 4)
    # the logits are exact; sigmoid is Triton's exp against torch's: rows whose 5 best scores lie within a few
    # float32 ulps may order them differently (at 4096 tokens some did on an H200)
    assert_route_where_apart(ids, weights, want_ids, want_weights, scores, gap=1e-6, rtol=1e-5, min_share=0.99)
    # normal random data: the model's choice wherever its 5 best scores are apart by more than a logit's rounding
    rng = np.random.default_rng(91)
    x, router_weight = rand(rng, (tokens, 6144), "bfloat16", device="cuda"), rand(rng, (128, 6144), "bfloat16", 0.02,
                                                                                 device="cuda")
    bias = rand(rng, (128,), "float32", 0.02, device="cuda")
    ids, weights = m3_torch.moe_route(x, router_weight, bias, 4)
    want_ids, want_weights, scores = route_reference(x, router_weight, bias, 4)
    # a logit's float32 sum may round to the neighbouring bf16 value (another summation order than cuBLAS's)
    assert_route_where_apart(ids, weights, want_ids, want_weights, scores, gap=0.01, rtol=2 ** -8)
    if not jax_gpu_ready():
        pytest.skip("needs a JAX GPU backend and jax_triton for the JAX half")
    for fn in (m3_jax.moe_route, jax.jit(m3_jax.moe_route, static_argnums=3)):
        got = _jax_on_gpu(fn, to_jax(x), to_jax(router_weight), to_jax(bias), 4)
        for g, w in zip(got, (ids, weights)):
            assert_same_bits(to_torch(g), w)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,kv_cache_dtype", [(1, "auto"), (300, "auto"), (300, "fp8")])
def test_gpu_qk_norm_rope_real_shapes(tokens, kv_cache_dtype):
    x, pool, layout = qk_inputs(100 + tokens, tokens, "m3", "bfloat16", kv_cache_dtype)
    x, pool = {name: t.cuda() for name, t in x.items()}, pool.cuda()
    scales = dict(k_scale=torch.tensor(0.25, device="cuda"), v_scale=torch.tensor(0.5, device="cuda")) \
        if kv_cache_dtype == "fp8" else {}
    start = pool.clone()
    q, idx_q = run_qk_torch(x, pool, layout, **scales)
    # the reference on the CPU: against the same functions on the GPU (torch's CUDA float32 ops) 12% of q's
    # bf16 values differed by an ulp on an H200
    want_q, k, v, want_idx_q, idx_k = (t.cuda() if t is not None else None
                                       for t in qk_reference({n: t.cpu() for n, t in x.items()}, layout))
    assert_near_model(q, want_q, "bfloat16", "q")
    assert_near_model(idx_q, want_idx_q, "bfloat16", "idx_q")
    expected = new_pool(layout).cuda()
    m3_torch.write_cache(k, v, idx_k, *m3_torch.layer_caches(expected, layout, 1), x["slot_mapping"], **scales)
    for name, got_cache, want_cache in zip(("k_cache", "v_cache", "index_k_cache"),
                                           m3_torch.layer_caches(pool, layout, 1),
                                           m3_torch.layer_caches(expected, layout, 1)):
        if got_cache.dtype == torch.float8_e4m3fn:   # one e4m3 step apart at most where k differs by a bf16 ulp
            torch.testing.assert_close(got_cache.float(), want_cache.float(), rtol=0.07, atol=2 ** -9, equal_nan=True)
        else:
            assert_near_model(got_cache, want_cache, "bfloat16", name)
    if not jax_gpu_ready():
        pytest.skip("needs a JAX GPU backend and jax_triton for the JAX half")
    x_cpu = {name: t.cpu() for name, t in x.items()}
    for jit in (False, True):
        got = _jax_on_gpu(run_qk_jax, x_cpu, start.cpu(), layout, jit=jit, **{n: s.cpu() for n, s in scales.items()})
        for name, g, w in zip(("q", "idx_q", "pool"), got, (q, idx_q, pool)):
            assert_same_bits(g, w, name)
