"""backend="cutedsl" (the CuTeDSL indexer scorer).

CPU: the backend switch and its errors in both frameworks, one backend check
per scoring call, and (when nvidia-cutlass-dsl is importable) compiling the
kernel for sm_90a through both launch paths, no GPU needed.

GPU (``-m gpu``; skipped with a reason when the package is missing or the GPU
is older than sm_90): scores equal the Triton backend's within float32
rounding of the accumulation order on decode, MTP and prefill shapes, padding
rows, shuffled tables with garbage past the visible blocks, strided idx_q and
transposed outputs, pool views; NaN/Inf rules; selected ids equal wherever the
top-k margin exceeds that rounding; torch and JAX launches bit-identical;
CUDA-graph replay with new lengths equals eager; the msa ops with either
backend agree. e4m3 (float8_e4m3fn) index caches with bf16, fp16 and e4m3
queries run through all of these (the ``fp8`` cases), plus NaN codes in stale
cache rows and bf16 query rows far outside float16's range (the per-row
power-of-two scaling of ``common.fp16_operand``).
"""

from __future__ import annotations

import functools
import math
import sys

import jax
import numpy as np
import pytest
import torch

import m3_jax
import m3_torch
from m3_kernels import backends, maps, planner, tuning

from cases import E4M3, GPU_CASES, CASES, TOLERANCE, Case, decode, make_inputs, prefill, rel_err, step
from cutedsl_marks import GPU_CAPABILITY, HAVE_CUTEDSL, needs_cutedsl
from targets import (Target, _poisoned_out, _strided, assert_same_bits, jax_inputs, targets, to_jax,
                     to_torch)
from m3_torch import reference as ref



def on_gpu(fn):
    """A device test: -m gpu, skipped (with the reason) without the package or on a GPU older than sm_90."""
    for mark in (pytest.mark.gpu, needs_cutedsl,
                 pytest.mark.skipif(GPU_CAPABILITY is not None and GPU_CAPABILITY < (9, 0),
                                    reason=f"backend='cutedsl' needs sm_90+, this GPU is sm_{GPU_CAPABILITY}")):
        fn = mark(fn)
    return fn

SMALL = decode("cute_small", (130, 5), hq=4, hk=2, d=64, di=64)


@pytest.fixture(autouse=True)
def no_env_default(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)


# -- the switch (framework-neutral) ------------------------------------------------------------

def test_backend_names_and_env_default(monkeypatch):
    assert backends.indexer_backend() == "triton"
    assert backends.indexer_backend("cutedsl") == "cutedsl"
    with pytest.raises(ValueError, match="backend: expected one of 'triton', 'cutedsl'"):
        backends.indexer_backend("cute")
    monkeypatch.setenv(backends.ENV_VAR, "cutedsl")
    assert backends.indexer_backend() == "cutedsl"
    assert backends.indexer_backend("triton") == "triton"          # an argument wins
    monkeypatch.setenv(backends.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="M3_INDEXER_SCORE"):
        backends.indexer_backend()
    assert backends.indexer_backend("triton") == "triton"          # ... even over a bad variable
    monkeypatch.setenv(backends.ENV_VAR, "")
    assert backends.indexer_backend() == "triton"


def check(backend="cutedsl", *, num_heads=4, head_dim=128, dtype="bfloat16", device="cuda", capability=(9, 0),
          cache_dtype=None):
    return backends.check_indexer_backend(backend, num_heads=num_heads, head_dim=head_dim, dtype=dtype,
                                          device=device, capability=capability, cache_dtype=cache_dtype)


def test_cutedsl_requirements_in_order(monkeypatch):
    """Argument errors first (they hold on any machine), then the device, then the package."""
    assert check("triton", head_dim=256, dtype="float32", device="cpu", capability=None) == "triton"
    with pytest.raises(ValueError, match="Di=256"):
        check(head_dim=256, device="cpu")
    with pytest.raises(TypeError, match="float32"):
        check(dtype="float32", device="cpu")
    # e4m3 index caches pass the dtype check (then fail on the device here), with any supported query
    for dtype in ("bfloat16", "float16", E4M3):
        with pytest.raises(RuntimeError, match="runs on cpu"):
            check(dtype=dtype, cache_dtype=E4M3, device="cpu", capability=None)
    # ... other pairs do not: another FP8 format, a float32 query, an e4m3 query on a 16-bit cache, mixed 16-bit
    for dtype, cache_dtype in (("bfloat16", "float8_e5m2"), ("float32", E4M3), (E4M3, "bfloat16"),
                               ("bfloat16", "float16"), ("float8_e5m2", "float8_e5m2"), ("float32", "float32")):
        with pytest.raises(TypeError, match=f"idx_q {dtype} and index_k_cache {cache_dtype}; use backend='triton'"):
            check(dtype=dtype, cache_dtype=cache_dtype, device="cpu", capability=None)
    with pytest.raises(ValueError, match="Hi=200"):
        check(num_heads=200)
    with pytest.raises(RuntimeError, match="runs on cpu"):
        check(device="cpu", capability=None)
    with pytest.raises(RuntimeError, match="this GPU has 8.0"):
        check(capability=(8, 0))
    monkeypatch.setitem(sys.modules, "m3_kernels.cute_index", None)   # as if nvidia-cutlass-dsl were missing
    with pytest.raises(ImportError, match=r"pip install -e \"\.\[cutedsl\]\""):
        check()
    for head_dim, dtype in ((64, "float16"), (128, "bfloat16")):
        with pytest.raises(ImportError):
            check(head_dim=head_dim, dtype=dtype, capability=(10, 0))


@needs_cutedsl
def test_cutedsl_accepted_where_it_can_run():
    assert check() == "cutedsl" and check(head_dim=64, dtype="float16", capability=(12, 0)) == "cutedsl"
    for dtype in ("bfloat16", "float16", E4M3):
        assert check(dtype=dtype, cache_dtype=E4M3) == "cutedsl"


# -- the switch on every op that scores, both frameworks (CPU) -----------------------------------

def scoring_calls(m, x, case: Case):
    """(name, call(backend)) for every public op that scores, on ``x`` (``case``'s inputs)."""
    kv = {} if m is m3_torch else dict(kv_layout="HND")
    dec = dict(decode_query_len=case.n)
    cu = x["cu_seqlens_q"] if m is m3_torch else np.asarray(case.cu_seqlens, np.int32)
    cfg = planner.StepConfig(num_q_heads=case.hq, num_kv_heads=case.hk, head_dim=case.d, max_batch=4,
                             max_num_tokens=16, max_blocks=x["block_table"].shape[1], topk=case.topk)
    plan = planner.StepPlanner(cfg).plan(list(case.seq_lens), q_lens=list(case.q_lens), num_context=1)
    iq, ik, bt, sl = x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"]
    attn = (x["q"], iq, x["k_cache"], x["v_cache"], ik, bt, sl)
    return [
        ("index_scores", lambda b: m.index_scores(iq, ik, bt, sl, backend=b, **dec)),
        ("index_scores_prefill", lambda b: m.index_scores_prefill(iq, ik, bt, sl, cu_seqlens_q=cu, backend=b)),
        ("msa_decode", lambda b: m.msa_decode(*attn, topk=case.topk, backend=b, **dec, **kv)),
        ("msa_prefill", lambda b: m.msa_prefill(*attn, cu_seqlens_q=cu, topk=case.topk, backend=b, **kv)),
        ("msa_attention_step", lambda b: m.msa_attention_step(*attn, plan=plan, backend=b, **kv)),
    ]


def framework_inputs(target, case):
    x = make_inputs(case)
    if target.framework == "torch":
        return m3_torch, dict(x)
    j = dict(jax_inputs(case, target.device))
    j["cu_seqlens_q"] = np.asarray(case.cu_seqlens, np.int32)
    return m3_jax, j


@pytest.mark.parametrize("target", targets())
def test_every_scoring_op_takes_the_switch(target, monkeypatch):
    if target.device == "gpu":
        pytest.skip("the CPU side of the switch")
    with target.active():
        m, x = framework_inputs(target, SMALL)
        for name, call in scoring_calls(m, x, SMALL):
            with pytest.raises(ValueError, match="backend: expected one of"):
                call("cuda")
            with pytest.raises(RuntimeError, match="backend='cutedsl' runs on NVIDIA GPUs"):
                call("cutedsl")
            monkeypatch.setenv(backends.ENV_VAR, "cutedsl")
            with pytest.raises(RuntimeError, match="runs on cpu"):
                call(None)                     # the variable's default reaches every op
            monkeypatch.setenv(backends.ENV_VAR, "nope")
            with pytest.raises(ValueError, match="M3_INDEXER_SCORE"):
                call(None)
            monkeypatch.delenv(backends.ENV_VAR)


@pytest.mark.parametrize("target", targets())
def test_argument_wins_over_the_environment(target, monkeypatch):
    """M3_INDEXER_SCORE=cutedsl, backend="triton": the Triton scorer runs (here: on the CPU)."""
    if target.device == "gpu":
        pytest.skip("the CPU side of the switch")
    with target.active():
        m, x = framework_inputs(target, SMALL)
        call = dict(scoring_calls(m, x, SMALL))["index_scores"]
        want = call(None)
        monkeypatch.setenv(backends.ENV_VAR, "cutedsl")
        got = call("triton")
    got, want = (t if isinstance(t, torch.Tensor) else to_torch(t) for t in (got, want))
    assert torch.equal(got, want)


@pytest.mark.parametrize("target", targets())
def test_cutedsl_argument_errors_come_before_the_device(target):
    """Di = 256 or float32 with cutedsl: the argument error, on any machine."""
    if target.device == "gpu":
        pytest.skip("the CPU side of the switch")
    for case, exc, words in ((decode("cute_d256", (130, 5), hq=4, hk=2, d=64, di=256), ValueError, "Di=256"),
                             (decode("cute_fp32", (130, 5), hq=4, hk=2, d=64, di=64, dtype="float32"), TypeError,
                              "float32")):
        with target.active():
            m, x = framework_inputs(target, case)
            for name, call in scoring_calls(m, x, case):
                with pytest.raises(exc, match=words):
                    call("cutedsl")


def test_one_backend_check_per_scoring_call(monkeypatch):
    """Each public op resolves the backend once (ops that do not score: never)."""
    from public_ops import inputs, public_calls

    calls = []
    original = backends.check_indexer_backend
    monkeypatch.setattr(backends, "check_indexer_backend", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setattr(m3_torch.ops, "kernel_module", lambda module, interpret: _NoKernels())
    scoring = {"index_scores", "index_scores_prefill", "msa_decode", "msa_prefill", "msa_attention_step"}
    for name, call in public_calls(m3_torch, inputs()):
        calls.clear()
        call()
        assert len(calls) == (name in scoring), f"{name}: {len(calls)} backend checks"


class _NoKernels:
    def __getattr__(self, name):
        return _NoKernels()

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


# -- compiling for Hopper without a GPU ---------------------------------------------------------

SHAPE_CLASSES = [  # (dtype, Hi, tokens per tile, Di[, cache dtype]): decode, MTP, prefill tiles, a TP rank, 16 heads
    ("bfloat16", 4, 1, 128), ("bfloat16", 4, 8, 128), ("float16", 1, 1, 64), ("bfloat16", 16, 8, 128),
    ("float16", 3, 2, 64),
    # e4m3 index caches: bf16 queries (scaled to f16), fp16 and e4m3 ones; 128 B and 64 B page rows
    ("bfloat16", 4, 1, 128, E4M3), ("bfloat16", 4, 8, 128, E4M3), ("float16", 1, 1, 64, E4M3),
    ("bfloat16", 16, 8, 128, E4M3), ("bfloat16", 3, 2, 64, E4M3), (E4M3, 4, 8, 128, E4M3), (E4M3, 2, 1, 64, E4M3),
]


@needs_cutedsl
@pytest.mark.parametrize("shape", SHAPE_CLASSES, ids=lambda s: "-".join(map(str, s)))
def test_compiles_for_hopper_torch_path(shape):
    """The kernel, its TMA descriptor and pipeline lower through CuTeDSL and ptxas for sm_90a."""
    from m3_torch import cute_ops
    key = cute_ops.shape_class(*shape)
    assert cute_ops.compile_index_scores(key, arch="sm_90a") is not None


@needs_cutedsl
@pytest.mark.parametrize("cache", ["bfloat16", E4M3])
def test_compiles_for_hopper_jax_path(monkeypatch, cache):
    """``cutlass_call`` lowers the same kernel for a CUDA platform (no GPU: cross-platform lowering);
    an e4m3 index cache as the float8_e4m3fn view of a byte (uint8) pool."""
    import cutlass.jax
    if not cutlass.jax.is_available():
        pytest.skip("cutlass.jax (CuTeDSL's JAX extension) is not available with this jax")
    from m3_jax import cute_call
    from m3_jax.views import PagedView
    monkeypatch.setattr(cute_call, "COMPILE_OPTIONS", "--gpu-arch sm_90a")
    T, Hi, Di, R, MB, pages = 8, 4, 128, 8, 10, 100
    tile = maps.index_tile(Hi, 1)
    pool_dtype = jax.numpy.uint8 if cache == E4M3 else jax.numpy.bfloat16

    def f(idx_q, pool, table, lens, tile_map):   # index-K: layer 1 of a two-layer pool, 16 elements in
        view = PagedView(pool, 16 + 128 * Di, (pages, 128, Di), (2 * 128 * Di, Di, 1), dtype=cache)
        return cute_call.index_scores(idx_q, view, table, lens, tile_map, tile)

    shapes = [jax.ShapeDtypeStruct((T, Hi, Di), jax.numpy.bfloat16),
              jax.ShapeDtypeStruct((16 + pages * 2 * 128 * Di,), pool_dtype),
              jax.ShapeDtypeStruct((R, MB), jax.numpy.int32), jax.ShapeDtypeStruct((R,), jax.numpy.int32),
              jax.ShapeDtypeStruct((R, 4), jax.numpy.int32)]
    text = jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "CuteDSLRT" in text and "4x8x10xf32" in text


# -- the kernel on the GPU -------------------------------------------------------------------------

def _eligible(c: Case) -> bool:
    return c.di in backends.CUTEDSL_HEAD_DIMS and c.dtype in backends.CUTEDSL_DTYPES and c.num_context < 0


M3 = dict(hq=64, hk=4, d=128, di=128, topk=16)
CUTE_CASES = [c for c in CASES + GPU_CASES if _eligible(c)] + [
    decode("cute_mtp8_h16", (1000, 8, 0, 129), n=8, hq=16, hk=16, d=64, di=128, dtype="float16"),
    decode("cute_h3_n2", (700, 129, 1, 0), n=2, hq=6, hk=3, d=64, di=64, strided=True),
    decode("cute_m3_b32_n1", tuple(range(100, 32 * 511, 511)), **M3),
    prefill("cute_prefill_chunks", (300, 5, 1, 0, 17), (557, 205, 1, 0, 1000), hq=8, hk=2, d=64, di=64, strided=True),
    prefill("cute_prefill_h16", (40, 9, 3), (600, 9, 2), hq=16, hk=16, d=64, di=128, dtype="float16"),
    prefill("cute_prefill_kv0_pool", (7, 2, 3), (4, 131, 0), hq=2, hk=2, d=64, di=64, kv_layout="pool"),
    # e4m3 index caches (GPU_CASES add M3 shapes: bf16 q in a byte pool, fp16 q on a TP rank, an e4m3 q in prefill)
    decode("cute_fp8_m3_b32_n1", tuple(range(100, 32 * 511, 511)), index_dtype=E4M3, **M3),
    decode("cute_fp8_di64_n1", (1, 127, 128, 129, 3000, 0, 2049), hq=4, hk=2, d=64, di=64, index_dtype=E4M3),
    decode("cute_fp8_mtp8_h16_fp16", (1000, 8, 0, 129), n=8, hq=16, hk=16, d=64, di=128, dtype="float16",
           index_dtype=E4M3),
    decode("cute_fp8_h3_n2_di64_strided", (700, 129, 1, 0), n=2, hq=6, hk=3, d=64, di=64, strided=True,
           index_dtype=E4M3),
    decode("cute_fp8_q_n4_di64", (900, 3, 0, 260), n=4, hq=4, hk=2, d=64, di=64, index_dtype=E4M3, fp8_idx_q=True),
    prefill("cute_fp8_prefill_chunks_di64", (300, 5, 1, 0, 17), (557, 205, 1, 0, 1000), hq=8, hk=2, d=64, di=64,
            strided=True, index_dtype=E4M3),
    prefill("cute_fp8_prefill_h16_fp16", (40, 9, 3), (600, 9, 2), hq=16, hk=16, d=64, di=128, dtype="float16",
            index_dtype=E4M3),
    prefill("cute_fp8_prefill_kv0_pool", (7, 2, 3), (4, 131, 0), hq=2, hk=2, d=64, di=64, kv_layout="pool",
            index_dtype=E4M3),
]
CUTE_IDS = [c.name for c in CUTE_CASES]
FP8_CASES = [c for c in CUTE_CASES if c.index_dtype == E4M3]


def _gpu_inputs(case: Case) -> dict:
    return make_inputs(case, "cuda")


def torch_scores(case: Case, backend: str, over: dict | None = None) -> torch.Tensor:
    """index_scores(_prefill) with ``backend`` into a NaN-poisoned output (transposed for strided cases)."""
    x = dict(_gpu_inputs(case), **(over or {}))
    idx_q = _strided(x["idx_q"]) if case.strided else x["idx_q"]
    out = _poisoned_out((case.hk, case.num_tokens, x["block_table"].shape[1]), torch.float32, "cuda", case.strided)
    table = (x["block_table"], x["seq_lens"])
    if case.decode:
        got = m3_torch.index_scores(idx_q, x["index_k_cache"], *table, decode_query_len=case.n, out=out,
                                    backend=backend)
    else:
        got = m3_torch.index_scores_prefill(idx_q, x["index_k_cache"], *table, cu_seqlens_q=x["cu_seqlens_q"],
                                            out=out, backend=backend)
    assert got is out
    return got.cpu()


@functools.cache
def rounding_bound(case: Case) -> torch.Tensor:
    """Per score: 8 * Di * 2^-24 * max over the block of sum |q_d k_d| (float32 reordering error bound)."""
    x = make_inputs(case)
    return _bound(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"], case)


def _bound(idx_q, index_k, block_table, seq_lens, case: Case) -> torch.Tensor:
    absmax = ref.index_scores_ref(idx_q.float().abs(), index_k.float().abs(), block_table, seq_lens, case.q_lens)
    return (8 * case.di * 2.0 ** -24 * absmax.clamp(min=1.0)).float()


def assert_scores_match(got: torch.Tensor, want: torch.Tensor, case: Case, bound: torch.Tensor | None = None):
    """Same -inf/NaN pattern, finite entries within the rounding bound (default: of the case's inputs)."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN pattern differs"
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "-inf pattern differs"
    finite = torch.isfinite(want)
    assert torch.isfinite(got[finite]).all()
    err = (got - want).abs()[finite]
    bound = (rounding_bound(case) if bound is None else bound)[finite]
    assert (err <= bound).all(), f"max error {err.max():.3g} (bound there {bound[err.argmax()]:.3g})"


@pytest.mark.parametrize("case", CUTE_CASES, ids=CUTE_IDS)
@on_gpu
def test_scores_equal_triton(case):
    got, want = torch_scores(case, "cutedsl"), torch_scores(case, "triton")
    assert_scores_match(got, want, case)
    # and the float64 reference, as the Triton backend's tests check it
    expected = ref.index_scores_ref(make_inputs(case)["idx_q"], make_inputs(case)["index_k_cache"],
                                    make_inputs(case)["block_table"], make_inputs(case)["seq_lens"], case.q_lens)
    finite = torch.isfinite(expected)
    torch.testing.assert_close(got[finite].double(), expected[finite], rtol=1e-3, atol=1e-3)


def _top_margin_rows(scores: torch.Tensor, case: Case, bound: torch.Tensor):
    """[Hi, T] bool: rows whose top-k cutoff gap exceeds twice the rounding bound (selection is then exact)."""
    s = scores.double().clone()
    s[~torch.isfinite(s)] = -math.inf
    k = case.topk
    ordered = s.sort(dim=-1, descending=True).values
    if ordered.shape[-1] <= k:
        return torch.ones(s.shape[:2], dtype=torch.bool)
    gap = ordered[..., k - 1] - ordered[..., k]
    return (gap > 2 * bound.max(dim=-1).values.double()) | ~torch.isfinite(gap)


@pytest.mark.parametrize("case", CUTE_CASES, ids=CUTE_IDS)
@on_gpu
def test_selection_equal_where_the_margin_allows(case):
    x = _gpu_inputs(case)
    kw = dict(topk=case.topk, init_blocks=case.init_blocks, local_blocks=case.local_blocks)
    meta = dict(decode_query_len=case.n) if case.decode else dict(cu_seqlens_q=x["cu_seqlens_q"])
    select = m3_torch.select_blocks if case.decode else m3_torch.select_blocks_prefill
    triton_scores, cute_scores = torch_scores(case, "triton"), torch_scores(case, "cutedsl")
    ids = [select(s.cuda(), x["seq_lens"], **meta, **kw).cpu() for s in (triton_scores, cute_scores)]
    rows = _top_margin_rows(triton_scores, case, rounding_bound(case))
    assert rows.float().mean() > 0.5, "too few rows with a clear top-k margin to compare"
    assert torch.equal(ids[0][rows], ids[1][rows])


def _nan_fill(t: torch.Tensor, index, inf: bool = False):
    """``t[index] = NaN`` (or +Inf) in place; e4m3: the NaN code 0x7F (e4m3 has no Inf: the largest
    value, 448, instead)."""
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8)[index] = 0x7E if inf else 0x7F
    else:
        t[index] = math.inf if inf else math.nan


POISON_CASES = [CUTE_CASES[0], GPU_CASES[2]] + [c for c in FP8_CASES if c.name in (
    "cute_fp8_di64_n1", "cute_fp8_mtp8_h16_fp16", "cute_fp8_q_n4_di64")] + [
    c for c in GPU_CASES if c.name == "m3_fp8_both_n2_pool"]


@pytest.mark.parametrize("case", POISON_CASES, ids=lambda c: c.name)
@on_gpu
def test_poisoned_cache_rows_and_nan_queries(case):
    """Invisible index-K rows (past seq_len in a used page, unused pages) hold NaN (e4m3 caches: the
    NaN code): no score sees them. A NaN or Inf in a query row (an e4m3 query: a NaN code): NaN on its
    visible blocks, -inf past them, as the Triton backend."""
    x = _gpu_inputs(case)
    ik = x["index_k_cache"].clone()
    table = x["block_table"].cpu()
    used = torch.zeros(ik.shape[0], dtype=torch.bool)
    for r, s in enumerate(case.seq_lens):
        nb = -(-s // 128)
        pages = table[r, :nb].long()
        used[pages] = True
        if s % 128:
            _nan_fill(ik, (int(pages[-1]), slice(s % 128, None)))
    _nan_fill(ik, ~used.cuda())
    assert ik.float().isnan().any()
    clean = torch_scores(case, "cutedsl")
    poisoned = torch_scores(case, "cutedsl", dict(index_k_cache=ik))
    assert torch.equal(poisoned, clean)
    iq = x["idx_q"].clone()
    _nan_fill(iq, (0, 0, 3))
    if iq.dtype != torch.float8_e4m3fn:
        _nan_fill(iq, (-1, -1, 0), inf=True)
    got, want = (torch_scores(case, b, dict(idx_q=iq)) for b in ("cutedsl", "triton"))
    assert torch.isnan(got).any()
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.isneginf(got),
                                                                            torch.isneginf(want))


@pytest.mark.parametrize("dtype, di", [("bfloat16", 128), ("bfloat16", 64), ("float16", 128)])
@on_gpu
def test_fp8_cache_queries_of_any_magnitude(dtype, di):
    """e4m3 index cache: bf16 query rows past float16's range (2^17 x) and below its normal range
    (2^-20 x) in the same tiles as ordinary rows; an all-zero row. The CuTeDSL scorer moves a bf16
    row to float16 by the power of two of common.fp16_operand (exactly), so every row equals the
    Triton backend's within the rounding bound of its own scale. fp16 queries: used as they are."""
    case = decode(f"cute_fp8_q_range_{dtype}_{di}", (300, 129, 4000, 1), n=2, hq=8, hk=4, d=64, di=di,
                  dtype=dtype, index_dtype=E4M3)
    x = _gpu_inputs(case)
    iq = x["idx_q"].float().clone()
    big, small = (2.0 ** 17, 2.0 ** -20) if dtype == "bfloat16" else (2.0 ** 6, 2.0 ** -6)
    iq[0, 0] *= big
    iq[0, 1] *= small
    iq[3, 2] *= big
    iq[5, 3] = 0.0
    iq = iq.to(x["idx_q"].dtype)
    if dtype == "bfloat16":
        assert iq[0, 0].float().abs().max() > 65504 and iq[0, 1].float().abs().max() < 2 ** -14
    got, want = (torch_scores(case, b, dict(idx_q=iq)) for b in ("cutedsl", "triton"))
    bound = _bound(iq.cpu(), x["index_k_cache"].cpu(), x["block_table"].cpu(), x["seq_lens"].cpu(), case)
    assert_scores_match(got, want, case, bound)
    zero_row = want[3, 5][torch.isfinite(want[3, 5])]
    assert zero_row.numel() and (zero_row == 0).all()


@pytest.mark.parametrize("backend", ["triton", "cutedsl"])
@on_gpu
def test_lengths_past_the_table_are_clamped(backend):
    """seq_lens > max_blocks * 128 behaves as max_blocks * 128 (no read outside the row)."""
    case = GPU_CASES[0]
    x = _gpu_inputs(case)
    table = x["block_table"]
    longer = torch.full_like(x["seq_lens"], table.shape[1] * 128 + 1000)
    clamped = torch.full_like(x["seq_lens"], table.shape[1] * 128)
    garbage_free = table.clone()
    garbage_free[garbage_free < 0] = 0
    garbage_free[garbage_free >= x["index_k_cache"].shape[0]] = 0
    got = torch_scores(case, backend, dict(seq_lens=longer, block_table=garbage_free))
    want = torch_scores(case, backend, dict(seq_lens=clamped, block_table=garbage_free))
    assert torch.equal(got, want)


def _jax_cute_ready() -> bool:
    if not (HAVE_CUTEDSL and jax.default_backend() == "gpu"):
        return False
    import cutlass.jax
    return cutlass.jax.is_available()


@pytest.mark.parametrize("case", CUTE_CASES, ids=CUTE_IDS)
@on_gpu
def test_torch_and_jax_bit_identical(case):
    if not _jax_cute_ready():
        pytest.skip("needs a JAX GPU backend with cutlass.jax")
    with Target("jax", "gpu").active():
        j = jax_inputs(case, "gpu")
        if case.decode:
            fn = jax.jit(functools.partial(m3_jax.index_scores, decode_query_len=case.n, backend="cutedsl"))
            got = fn(j["idx_q"], j["index_k_cache"], j["block_table"], j["seq_lens"])
        else:
            got = m3_jax.index_scores_prefill(j["idx_q"], j["index_k_cache"], j["block_table"], j["seq_lens"],
                                              cu_seqlens_q=j["cu_seqlens_q"], backend="cutedsl")
    assert_same_bits(to_torch(got), torch_scores(case, "cutedsl").contiguous())


@pytest.mark.parametrize("index_dtype", ["auto", E4M3])
@on_gpu
def test_graph_replay_with_new_lengths_equals_eager(index_dtype):
    """Capture index_scores and msa_decode (cutedsl) once; new lengths and tables replay as eager calls."""
    case = decode("cute_graph" if index_dtype == "auto" else "cute_graph_fp8", (3000, 129, 0, 700), n=2,
                  index_dtype=index_dtype, **M3)
    x = {k: v.clone() for k, v in _gpu_inputs(case).items()}
    # every entry a valid page, so any new length up to the table's width reads real pages
    pages = x["index_k_cache"].shape[0]
    x["block_table"].copy_(torch.randperm(pages, device="cuda")[:x["block_table"].numel()].view_as(
        x["block_table"]).int())
    scores = torch.empty(case.hk, case.num_tokens, x["block_table"].shape[1], device="cuda")
    out = torch.empty_like(x["q"])

    def step():
        m3_torch.index_scores(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"],
                              decode_query_len=case.n, out=scores, backend="cutedsl")
        return m3_torch.msa_decode(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                   x["block_table"], x["seq_lens"], decode_query_len=case.n, topk=case.topk,
                                   out=out, backend="cutedsl")[1]

    step()                                   # eager warm-up: compiles and loads
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids = step()
    for new_lens in ((2000, 1, 300, 0), (3000, 129, 0, 700), (129, 128, 3001, 5)):
        x["seq_lens"].copy_(torch.tensor(new_lens, dtype=torch.int32))
        x["block_table"].copy_(x["block_table"][torch.randperm(x["block_table"].shape[0])])
        graph.replay()
        torch.cuda.synchronize()
        replayed = (scores.clone(), out.clone(), ids.clone())
        eager_ids = step()
        torch.cuda.synchronize()
        for a, b in zip(replayed, (scores, out, eager_ids)):
            assert torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point else a,
                               b.view(torch.uint8) if b.dtype.is_floating_point else b)


@on_gpu
def test_first_call_inside_a_capture_is_refused(monkeypatch):
    """Compiling inside a CUDA-graph capture is refused with a clear error (warm up eagerly first)."""
    case = CUTE_CASES[0]
    x = _gpu_inputs(case)
    out = torch.empty(case.hk, case.num_tokens, x["block_table"].shape[1], device="cuda")
    args = (x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"])
    m3_torch.index_scores(*args, decode_query_len=case.n, out=out)   # uploads this batch shape's tile map
    torch.cuda.synchronize()
    monkeypatch.setattr(tuning, "CUTEDSL_TARGET_PROGRAMS", 777)   # a shape class nothing compiled yet
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="eager call"):
        with torch.cuda.graph(graph):
            m3_torch.index_scores(*args, decode_query_len=case.n, out=out, backend="cutedsl")


MSA_CASES = [GPU_CASES[0], GPU_CASES[2], GPU_CASES[5]] + [c for c in CUTE_CASES if c.name in (
    "cute_prefill_chunks", "m3_fp8_both_n2_pool", "m3_fp8_prefill_nhd", "cute_fp8_prefill_chunks_di64")]


@pytest.mark.parametrize("case", MSA_CASES, ids=lambda c: c.name)
@on_gpu
def test_msa_ops_agree_across_backends(case):
    """msa_decode / msa_prefill with either indexer: the same blocks (random data: clear margins) and
    outputs within the attention tolerance of each other."""
    x = _gpu_inputs(case)
    meta = dict(decode_query_len=case.n) if case.decode else dict(cu_seqlens_q=x["cu_seqlens_q"])
    fn = m3_torch.msa_decode if case.decode else m3_torch.msa_prefill
    if case.kv_dtype == E4M3:
        meta.update(k_scale=torch.tensor(case.scales[0], device="cuda"),
                    v_scale=torch.tensor(case.scales[1], device="cuda"))
    results = [fn(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"], x["block_table"],
                  x["seq_lens"], topk=case.topk, backend=b, **meta) for b in ("triton", "cutedsl")]
    (out_t, ids_t), (out_c, ids_c) = ((o.cpu(), i.cpu()) for o, i in results)
    assert torch.equal(ids_t, ids_c)
    assert rel_err(out_c, out_t.double()) < TOLERANCE[case.dtype] / 4


@on_gpu
def test_msa_attention_step_agrees_across_backends():
    case = step("cute_step", (300, 64, 2, 2, 2, 2), (1300, 64, 5002, 129, 3, 0), num_context=2, **M3)
    x = _gpu_inputs(case)
    cfg = planner.StepConfig(num_q_heads=case.hq, num_kv_heads=case.hk, head_dim=case.d, max_batch=8,
                             max_num_tokens=512, max_blocks=x["block_table"].shape[1], topk=case.topk)
    plan = planner.StepPlanner(cfg).plan(case.seq_lens, q_lens=case.q_lens, num_context=case.num_context)
    results = []
    for b in ("triton", "cutedsl"):
        out, ids = m3_torch.msa_attention_step(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                               x["block_table"], x["seq_lens"], plan=plan, backend=b)
        results.append((out.cpu(), ids.to("cpu", copy=True)))
    assert torch.equal(results[0][1], results[1][1])
    assert rel_err(results[1][0], results[0][0].double()) < TOLERANCE[case.dtype] / 4
    if _jax_cute_ready():
        with Target("jax", "gpu").active():
            j = jax_inputs(case, "gpu")
            out, ids = m3_jax.msa_attention_step(j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"],
                                                 j["block_table"], j["seq_lens"], plan=plan, backend="cutedsl",
                                                 kv_layout=j["kv_layout"])
        assert torch.equal(to_torch(ids), results[1][1])


@on_gpu
def test_jax_msa_decode_under_jit():
    if not _jax_cute_ready():
        pytest.skip("needs a JAX GPU backend with cutlass.jax")
    case = GPU_CASES[0]
    with Target("jax", "gpu").active():
        j = jax_inputs(case, "gpu")
        fn = jax.jit(functools.partial(m3_jax.msa_decode, decode_query_len=case.n, topk=case.topk,
                                       backend="cutedsl"))
        out, ids = fn(j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"], j["block_table"],
                      j["seq_lens"])
    x = _gpu_inputs(case)
    _, want_ids = m3_torch.msa_decode(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                      x["block_table"], x["seq_lens"], decode_query_len=case.n, topk=case.topk,
                                      backend="cutedsl")
    assert torch.equal(to_torch(ids), want_ids.cpu())


