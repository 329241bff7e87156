"""backend="cutedsl" of ``dense_prefill`` and ``sparse_prefill`` (the CuTeDSL kernel of ``cute_prefill.py``).

CPU: the backend switch and its errors, both frameworks' refusal of a CPU
call (``dense_prefill``, and ``msa_attention_step`` on a dense layer, which
takes ``$M3_DENSE_PREFILL``), and (when nvidia-cutlass-dsl is importable)
compiling the kernel for sm_90a through the torch path and through the JAX
path (``cutlass_call``), no GPU needed.

GPU (``-m gpu``; skipped with a reason when the package is missing or the GPU
is not sm_90): against the float64 reference within the dtype's tolerance and
against the Triton backend, at odd lengths (1, 127, 128, 129, 3000 tokens),
several requests with shuffled page tables whose unused entries are garbage,
NaN in every cache row past each request's length, NaN-poisoned outputs, a
prompt longer than its KV length (tokens that see nothing: zeros), M3's 64/4
heads at D = 128 and a small 8/2 case at D = 64 in fp16; q and out whose rows
are not aligned (the kernel's element-by-element load and store) give the same
bits as contiguous ones (its 16-byte loads and 4-byte stores); JAX's launch of
the kernel bit-identical to torch's; a dense layer's step with
``M3_DENSE_PREFILL=cutedsl`` runs the kernel in both frameworks.

Sparse mode (``sparse_prefill``, switch ``M3_SPARSE_PREFILL``): the same CPU
checks (its own errors: tiles of more than 32 tokens, more than 128 ids per
tile), its sm_90a compile through both paths; on the GPU against the float64
reference and the Triton backend at the same odd lengths, with block ids whose
slots are shuffled, hold -1, ids past the request's blocks and blocks after the
token (seen by nothing), over the same poisoned caches and outputs; every token
choosing all its visible blocks gives the dense kernel's bits (same blocks, same
order); JAX's launch bit-identical to torch's.

``msa_prefill`` and the MSA layers' step (``msa_attention_step``, sparse=True) under
``M3_SPARSE_PREFILL``: on the CPU, both frameworks refuse cutedsl and name a bad value; with the
device checks passed and the CuTeDSL launch replaced by a recorder, both hand the selection launch's
ids (the reference selection) to one kernel launch over the indexer's tiles of the group. On the
GPU: msa_prefill's block ids equal the Triton route's, its output within tolerance of it and of the
reference, at the sparse cases' lengths and poisoning; JAX's msa_prefill gives torch's bits; the
MSA layers' step runs the kernel in both frameworks.

The persistent schedule (GPU, both modes): with the SM count forced down to
1, 2, 3 and 7, every CTA runs many work items of 0, 1 and up to 8 blocks in
turn, and the output is the full grid's bit for bit (the cases of one tile
have fewer work items than SMs).
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import m3_jax
import m3_torch
from m3_kernels import backends, maps, planner

from cases import PAGE, TOLERANCE, make_inputs, prefill, random_block_ids, rel_err
from cutedsl_marks import GPU_CAPABILITY, HAVE_CUTEDSL, needs_cutedsl
from targets import (Target, assert_same_bits, attention_reference, check_attention, jax_gpu_ready, jax_inputs,
                     selected_blocks, to_jax, to_torch)



def on_gpu(fn):
    """A device test: -m gpu, skipped (with the reason) without the package or off a Hopper GPU."""
    for mark in (pytest.mark.gpu, needs_cutedsl,
                 pytest.mark.skipif(GPU_CAPABILITY is not None and GPU_CAPABILITY[0] != 9,
                                    reason=f"dense_prefill backend='cutedsl' needs sm_90a, this GPU is "
                                           f"sm_{GPU_CAPABILITY}")):
        fn = mark(fn)
    return fn


# -- CPU: the switch, its errors, the sm_90a compile -------------------------------------------

def _check(backend, **kw):
    args = dict(group=16, head_dim=128, dtype="bfloat16", cache_dtype="bfloat16", device="cuda", capability=(9, 0))
    args.update(kw)
    return backends.check_dense_prefill_backend(backend, **args)


def test_backend_switch(monkeypatch):
    monkeypatch.delenv(backends.DENSE_PREFILL_ENV_VAR, raising=False)
    assert _check(None, device="cpu", capability=None) == "triton"
    monkeypatch.setenv(backends.DENSE_PREFILL_ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="M3_DENSE_PREFILL"):
        _check(None)
    with pytest.raises(ValueError, match="backend: expected one of"):
        _check("cute")
    with pytest.raises(ValueError, match="D=96"):
        _check("cutedsl", head_dim=96)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        _check("cutedsl", cache_dtype="float8_e4m3fn")
    with pytest.raises(RuntimeError, match="runs on cpu"):
        _check("cutedsl", device="cpu", capability=None)
    with pytest.raises(RuntimeError, match="wgmma"):
        _check("cutedsl", capability=(10, 0))


def _check_sparse(backend, **kw):
    args = dict(group=16, head_dim=128, topk=16, dtype="bfloat16", cache_dtype="bfloat16", device="cuda",
                capability=(9, 0))
    args.update(kw)
    return backends.check_sparse_prefill_backend(backend, **args)


def test_sparse_backend_switch(monkeypatch):
    """sparse_prefill's switch: its own variable, dense's errors, and its tile limits."""
    monkeypatch.delenv(backends.SPARSE_PREFILL_ENV_VAR, raising=False)
    monkeypatch.setenv(backends.DENSE_PREFILL_ENV_VAR, "cutedsl")   # not this op's variable
    assert _check_sparse(None, device="cpu", capability=None) == "triton"
    monkeypatch.setenv(backends.SPARSE_PREFILL_ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="M3_SPARSE_PREFILL"):
        _check_sparse(None)
    with pytest.raises(ValueError, match="backend: expected one of"):
        _check_sparse("cute")
    with pytest.raises(ValueError, match="64 tokens per tile"):
        _check_sparse("cutedsl", group=2, topk=1)
    with pytest.raises(ValueError, match="topk=32"):
        _check_sparse("cutedsl", topk=32)
    with pytest.raises(ValueError, match="topk >= 1"):
        _check_sparse("cutedsl", topk=0)
    with pytest.raises(ValueError, match="D=96"):
        _check_sparse("cutedsl", head_dim=96)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        _check_sparse("cutedsl", cache_dtype="float8_e4m3fn")
    with pytest.raises(RuntimeError, match="runs on cpu"):
        _check_sparse("cutedsl", device="cpu", capability=None)
    with pytest.raises(RuntimeError, match="sparse_prefill uses Hopper"):
        _check_sparse("cutedsl", capability=(10, 0))


CPU_CASE = prefill("cute_cpu", (3,), (5,), hq=4, hk=2, d=64)


def test_cpu_call_refused():
    """The public op refuses backend='cutedsl' on CPU tensors before any work, naming the fix."""
    x = make_inputs(CPU_CASE)
    with pytest.raises(RuntimeError, match="use backend='triton'"):
        m3_torch.dense_prefill(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                               cu_seqlens_q=x["cu_seqlens_q"], backend="cutedsl")


SPARSE_CPU_CASE = prefill("cute_sp_cpu", (3,), (5,), hq=8, hk=2, d=64)   # 32 tokens x topk 4 per tile


def test_sparse_cpu_call_refused():
    """Both frameworks' sparse_prefill refuse backend='cutedsl' off a GPU, naming the fix."""
    case = SPARSE_CPU_CASE
    x = make_inputs(case)
    with pytest.raises(RuntimeError, match="use backend='triton'"):
        m3_torch.sparse_prefill(x["q"], x["k_cache"], x["v_cache"], random_block_ids(case), x["block_table"],
                                x["seq_lens"], cu_seqlens_q=x["cu_seqlens_q"], backend="cutedsl")
    with Target("jax", "interpreter").active():
        j = jax_inputs(case, "interpreter")
        with pytest.raises(RuntimeError, match="use backend='triton'"):
            m3_jax.sparse_prefill(j["q"], j["k_cache"], j["v_cache"], jnp.asarray(random_block_ids(case).numpy()),
                                  j["block_table"], j["seq_lens"], cu_seqlens_q=j["cu_seqlens_q"],
                                  kv_layout=j["kv_layout"], backend="cutedsl")


def test_jax_cpu_call_refused():
    """JAX's op refuses backend='cutedsl' on a CPU backend before any work, naming the fix."""
    with Target("jax", "interpreter").active():
        j = jax_inputs(CPU_CASE, "interpreter")
        with pytest.raises(RuntimeError, match="use backend='triton'"):
            m3_jax.dense_prefill(j["q"], j["k_cache"], j["v_cache"], j["block_table"], j["seq_lens"],
                                 cu_seqlens_q=j["cu_seqlens_q"], kv_layout=j["kv_layout"], backend="cutedsl")


def _context_step(case, max_blocks: int):
    """A step of ``case``'s rows, all of them context rows (the plan of a prefill step)."""
    cfg = planner.StepConfig(num_q_heads=case.hq, num_kv_heads=case.hk, head_dim=case.d,
                             max_batch=len(case.q_lens), max_num_tokens=sum(case.q_lens), max_blocks=max_blocks,
                             topk=case.topk)
    return planner.StepPlanner(cfg).plan(list(case.seq_lens), q_lens=list(case.q_lens),
                                         num_context=len(case.q_lens))


def _dense_layer(framework, case, x):
    """``msa_attention_step(sparse=False)`` (what both models call on layers 0-2) on ``x`` -> out."""
    m, kv = (m3_torch, {}) if framework == "torch" else (m3_jax, dict(kv_layout=x["kv_layout"]))
    out, _ = m.msa_attention_step(x["q"], None, x["k_cache"], x["v_cache"], None, x["block_table"], x["seq_lens"],
                                  plan=_context_step(case, int(x["block_table"].shape[1])), sparse=False, **kv)
    return out


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_dense_layers_take_the_variable(framework, monkeypatch):
    """The models' dense layers (msa_attention_step, sparse=False) resolve $M3_DENSE_PREFILL: cutedsl on
    a CPU is refused there, a bad value names the variable."""
    with Target(framework, "interpreter").active():
        x = make_inputs(CPU_CASE) if framework == "torch" else jax_inputs(CPU_CASE, "interpreter")
        monkeypatch.setenv(backends.DENSE_PREFILL_ENV_VAR, "cutedsl")
        with pytest.raises(RuntimeError, match="runs on cpu"):
            _dense_layer(framework, CPU_CASE, x)
        monkeypatch.setenv(backends.DENSE_PREFILL_ENV_VAR, "bogus")
        with pytest.raises(ValueError, match="M3_DENSE_PREFILL"):
            _dense_layer(framework, CPU_CASE, x)


def _msa_layer(framework, case, x):
    """``msa_attention_step(sparse=True)`` (what both models call on their MSA layers) on ``x``
    -> (out, block_ids)."""
    m, kv = (m3_torch, {}) if framework == "torch" else (m3_jax, dict(kv_layout=x["kv_layout"]))
    plan = _context_step(case, int(x["block_table"].shape[1]))
    return m.msa_attention_step(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                x["block_table"], x["seq_lens"], plan=plan, **kv)


def _msa_prefill(framework, case, x, out=None):
    """``msa_prefill`` of ``case`` on ``x`` (torch: into ``out``) -> (out, block_ids)."""
    m = m3_torch
    kw = dict(topk=case.topk, init_blocks=case.init_blocks, local_blocks=case.local_blocks)
    if framework == "torch":
        kw["out"] = out
    else:
        m, kw["kv_layout"] = m3_jax, x["kv_layout"]
    return m.msa_prefill(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"], x["block_table"],
                         x["seq_lens"], cu_seqlens_q=x["cu_seqlens_q"], **kw)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_msa_ops_take_the_variable(framework, monkeypatch):
    """msa_prefill and the models' MSA layers (msa_attention_step, sparse=True) resolve
    $M3_SPARSE_PREFILL (their backend= is the indexer's): cutedsl on a CPU is refused there, a bad
    value names the variable."""
    case = SPARSE_CPU_CASE
    with Target(framework, "interpreter").active():
        x = make_inputs(case) if framework == "torch" else jax_inputs(case, "interpreter")
        for call in (lambda: _msa_prefill(framework, case, x), lambda: _msa_layer(framework, case, x)):
            monkeypatch.setenv(backends.SPARSE_PREFILL_ENV_VAR, "cutedsl")
            with pytest.raises(RuntimeError, match="runs on cpu"):
                call()
            monkeypatch.setenv(backends.SPARSE_PREFILL_ENV_VAR, "bogus")
            with pytest.raises(ValueError, match="M3_SPARSE_PREFILL"):
                call()


# 3 or 5 blocks per token, 2 chosen (the last by rule, one by score); request 0's 12 tokens fill one
# of the indexer's tiles of the group (the CuTeDSL kernel's), two of the Triton attention's
ROUTE_CASE = prefill("cute_sp_route", (12, 2), (600, 300), hq=8, hk=2, d=64, topk=2)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_msa_ops_route_to_the_sparse_kernel(framework, monkeypatch):
    """With M3_SPARSE_PREFILL=cutedsl (the device checks passed, the CuTeDSL launch a recorder that
    writes zeros), msa_prefill and an MSA layer's context step select the reference's blocks and
    hand exactly those ids to one CuTeDSL launch each, over the indexer's tiles of the group; its
    output is theirs."""
    from m3_jax import cute_call
    from m3_torch import cute_ops
    case = ROUTE_CASE
    calls = []

    def record(*args):
        calls.append(args)
        q = args[0]
        return args[7].zero_() if framework == "torch" else jnp.zeros(q.shape, q.dtype)

    monkeypatch.setattr(backends, "check_sparse_prefill_backend",
                        lambda backend, **kw: backends.sparse_prefill_backend(backend))
    monkeypatch.setattr(cute_ops if framework == "torch" else cute_call, "sparse_prefill", record)
    monkeypatch.setenv(backends.SPARSE_PREFILL_ENV_VAR, "cutedsl")
    with Target(framework, "interpreter").active():
        x = make_inputs(case) if framework == "torch" else jax_inputs(case, "interpreter")
        poisoned = torch.full_like(x["q"], math.nan) if framework == "torch" else None
        results = [_msa_prefill(framework, case, x, poisoned), _msa_layer(framework, case, x)]
    _, tile_map = planner.prefill_plan(case.cu_seqlens).tiles(case.hq // case.hk, "index")
    host = (lambda t: t) if framework == "torch" else to_torch
    assert len(calls) == 2
    for (out, ids), args in zip(results, calls):
        assert torch.equal(host(ids), selected_blocks(case))
        assert torch.equal(host(args[3]), host(ids))   # q, k, v, block_ids, block_table, seq_lens, tile_map, ...
        assert np.array_equal(np.asarray(host(args[6])), tile_map)
        assert (host(out) == 0).all()


@needs_cutedsl
def test_compiles_for_hopper_torch_path():
    """The kernel (TMA ring, warp specialization, both wgmmas) lowers through CuTeDSL and ptxas for sm_90a."""
    from m3_torch import cute_ops
    key = cute_ops.prefill_shape_class("bfloat16", 16, 128)
    assert cute_ops.compile_dense_prefill(key, arch="sm_90a") is not None


@needs_cutedsl
def test_sparse_compiles_for_hopper_torch_path():
    """The sparse mode (the block list in shared memory, the per-row choice mask) lowers for sm_90a,
    and the switch's limits are the kernel's."""
    from m3_kernels import cute_prefill
    from m3_torch import cute_ops
    assert (backends.CUTEDSL_SPARSE_MAX_TOKENS, backends.CUTEDSL_SPARSE_MAX_ENTRIES) == (
        cute_prefill.SPARSE_MAX_TOKENS, cute_prefill.SPARSE_MAX_ENTRIES)
    key = cute_ops.sparse_prefill_shape_class("bfloat16", 16, 128, 16)
    assert cute_ops.compile_sparse_prefill(key, arch="sm_90a") is not None


@needs_cutedsl
@pytest.mark.parametrize("sparse, group", [(False, 16), (True, 16), (True, 128)],
                         ids=["dense", "sparse", "sparse-group128"])
def test_wgmmas_are_not_serialized(sparse, group, tmp_path, monkeypatch):
    """ptxas waits after every wgmma (the whole FA3 overlap gone, silently) when it cannot prove where an
    accumulator or operand is complete, e.g. waits chosen in a different ``if`` than the wgmmas they wait
    for: the kernel's machine code keeps a handful of waits for its 32 wgmmas. At 128 heads per KV head
    (one token per tile, its rows in both consumer warpgroups) each warpgroup still computes its blocks."""
    import subprocess

    import cutlass.cute as cute
    from triton.backends.nvidia.compiler import get_ptxas

    from m3_torch import cute_ops

    real = cute.compile
    monkeypatch.setattr(cute, "compile", lambda *args, options="", **kw: real(
        *args, options=f"{options} --keep-cubin --dump-dir {tmp_path}", **kw))
    if sparse:
        fn = cute_ops.compile_sparse_prefill(cute_ops.sparse_prefill_shape_class("bfloat16", group, 128, 16),
                                             arch="sm_90a")
    else:
        fn = cute_ops.compile_dense_prefill(cute_ops.prefill_shape_class("bfloat16", group, 128), arch="sm_90a")
    (tmp_path / "k.cubin").write_bytes(fn.artifacts.CUBIN)
    cuobjdump = Path(get_ptxas(90).path).parent / "cuobjdump"
    sass = subprocess.run([str(cuobjdump), "-sass", str(tmp_path / "k.cubin")], capture_output=True, text=True,
                          check=True).stdout
    wgmmas, waits = sass.count("HGMMA"), sass.count("WARPGROUP.DEPBAR")
    assert wgmmas == 32 and 0 < waits <= 6, (wgmmas, waits)


@needs_cutedsl
def test_compiles_for_hopper_jax_path(monkeypatch):
    """``cutlass_call`` lowers the same kernel for a CUDA platform (no GPU: cross-platform lowering);
    K and V as bf16 views of layer 1 of a byte (uint8) pool, at their own offsets."""
    import cutlass.jax
    if not cutlass.jax.is_available():
        pytest.skip("cutlass.jax (CuTeDSL's JAX extension) is not available with this jax")
    from m3_jax import cute_call
    from m3_jax.views import PagedView
    monkeypatch.setattr(cute_call, "COMPILE_OPTIONS", "--gpu-arch sm_90a")
    monkeypatch.setattr(cute_call, "sm_count", lambda: 132)      # an H100's (no GPU to ask)
    T, Hq, Hk, D, R, MB, pages = 40, 64, 4, 128, 3, 10, 20
    tile = maps.index_tile(Hq // Hk, maps.MAX_TILE_ROWS)
    page = Hk * PAGE * D                          # elements of one K (or V) page of one layer
    strides = (4 * page, PAGE * D, D, 1)          # pool pages hold K and V of two layers

    def f(q, pool, table, lens, tile_map):
        k = PagedView(pool, 2 * page, (pages, Hk, PAGE, D), strides, dtype=jnp.bfloat16)
        v = PagedView(pool, 3 * page, (pages, Hk, PAGE, D), strides, dtype=jnp.bfloat16)
        return cute_call.dense_prefill(q, k, v, table, lens, tile_map, tile, 0.088)

    shapes = [jax.ShapeDtypeStruct((T, Hq, D), jnp.bfloat16), jax.ShapeDtypeStruct((pages * 4 * page * 2,), jnp.uint8),
              jax.ShapeDtypeStruct((R, MB), jnp.int32), jax.ShapeDtypeStruct((R,), jnp.int32),
              jax.ShapeDtypeStruct((5, 4), jnp.int32)]
    text = jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "CuteDSLRT" in text and "40x64x128xbf16" in text

    def g(q, pool, ids, table, lens, tile_map):
        k = PagedView(pool, 2 * page, (pages, Hk, PAGE, D), strides, dtype=jnp.bfloat16)
        v = PagedView(pool, 3 * page, (pages, Hk, PAGE, D), strides, dtype=jnp.bfloat16)
        return cute_call.sparse_prefill(q, k, v, ids, table, lens, tile_map, tile, 0.088)

    ids = jax.ShapeDtypeStruct((Hk, T, 16), jnp.int32)
    text = jax.jit(g).trace(shapes[0], shapes[1], ids, *shapes[2:]).lower(lowering_platforms=("cuda",)).as_text()
    assert "CuteDSLRT" in text and "4x40x16xi32" in text


# -- GPU ---------------------------------------------------------------------------------------

M3 = dict(hq=64, hk=4, d=128, gpu_only=True)
SMALL = dict(hq=8, hk=2, d=64, dtype="float16")
GPU_CASES = [
    prefill("cute_pf_1", (1,), (1,), **M3),
    prefill("cute_pf_127", (127,), (127,), **M3),
    prefill("cute_pf_128", (128,), (128,), **M3),
    prefill("cute_pf_129_ctx", (129,), (129 + 300,), **M3),
    prefill("cute_pf_3000", (3000,), (3000,), **M3),
    prefill("cute_pf_mixed", (1, 127, 129, 700), (5, 127, 1000, 700), **M3),
    prefill("cute_pf_empty", (9, 4), (5, 130), **M3),           # 4 tokens of request 0 see nothing
    prefill("cute_pf_small", (1, 127, 128, 129, 3000), (1, 200, 128, 129, 3000), **SMALL),
    prefill("cute_pf_small_bf16", (33, 129), (33, 1000), hq=8, hk=2, d=128),
]


def _poisoned(case):
    """The case's inputs on the GPU with NaN in every cache row past each request's length."""
    x = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in make_inputs(case).items()}
    k, v = x["k_cache"].clone(), x["v_cache"].clone()
    for r, s in enumerate(case.seq_lens):
        if s % PAGE:
            page = int(x["block_table"][r, s // PAGE])
            k[page, :, s % PAGE:] = math.nan
            v[page, :, s % PAGE:] = math.nan
    x["k_cache"], x["v_cache"] = k, v
    return x


def _run(x, backend):
    out = torch.full_like(x["q"], math.nan)
    return m3_torch.dense_prefill(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                  cu_seqlens_q=x["cu_seqlens_q"], out=out, backend=backend)


@on_gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_against_reference_and_triton(case):
    x = _poisoned(case)
    out = _run(x, "cutedsl")
    torch.cuda.synchronize()
    check_attention(case, out.cpu(), attention_reference(case))
    triton = _run(x, "triton")
    assert rel_err(out, triton) < TOLERANCE[case.dtype]


def _jax_cute_ready() -> bool:
    if not (HAVE_CUTEDSL and jax.default_backend() == "gpu"):
        return False
    import cutlass.jax
    return cutlass.jax.is_available()


def _jax_gpu(x):
    """``x`` (the GPU tensors of :func:`_poisoned`) as jax arrays on the GPU, same bits (HND arrays)."""
    j = {k: to_jax(x[k]) for k in ("q", "idx_q", "k_cache", "v_cache", "index_k_cache", "block_table", "seq_lens")}
    j["cu_seqlens_q"] = x["cu_seqlens_q"].cpu().numpy()   # host offsets: read once
    j["kv_layout"] = "HND"
    return j


BIT_CASES = [c for c in GPU_CASES if c.name in ("cute_pf_mixed", "cute_pf_small")]


@on_gpu
@pytest.mark.parametrize("case", BIT_CASES, ids=str)
def test_torch_and_jax_bit_identical(case):
    """One kernel for both frameworks: JAX's launch (cutlass_call) gives torch's bits."""
    if not _jax_cute_ready():
        pytest.skip("needs a JAX GPU backend with cutlass.jax")
    x = _poisoned(case)
    want = _run(x, "cutedsl").cpu()
    with Target("jax", "gpu").active():
        j = _jax_gpu(x)
        got = m3_jax.dense_prefill(j["q"], j["k_cache"], j["v_cache"], j["block_table"], j["seq_lens"],
                                   cu_seqlens_q=j["cu_seqlens_q"], backend="cutedsl")
    assert_same_bits(to_torch(got), want)


@on_gpu
def test_dense_layer_step_runs_the_kernel_in_both_frameworks(monkeypatch):
    """M3_DENSE_PREFILL=cutedsl reaches the models' dense-layer call (msa_attention_step, sparse=False):
    its context span runs the CuTeDSL kernel once, within the tolerance of the Triton step, and JAX's
    step gives torch's bits."""
    if not _jax_cute_ready():
        pytest.skip("needs a JAX GPU backend with cutlass.jax")
    from m3_jax import cute_call
    from m3_torch import cute_ops
    case = BIT_CASES[0]
    x = _poisoned(case)
    triton = _dense_layer("torch", case, x)
    calls = []
    monkeypatch.setenv(backends.DENSE_PREFILL_ENV_VAR, "cutedsl")
    for module in (cute_ops, cute_call):
        original = module.dense_prefill
        monkeypatch.setattr(module, "dense_prefill", lambda *a, _f=original, _m=module: calls.append(_m) or _f(*a))
    out = _dense_layer("torch", case, x)
    assert calls == [cute_ops]
    assert rel_err(out, triton) < TOLERANCE[case.dtype]
    with Target("jax", "gpu").active():
        got = _dense_layer("jax", case, _jax_gpu(x))
    assert calls == [cute_ops, cute_call]
    assert_same_bits(to_torch(got), out.cpu())


@on_gpu
def test_unaligned_q_and_out_match_contiguous():
    """q with stride 2 along D and an output one element into its buffer take the kernel's
    element-by-element load and store paths: the same bits as the vector paths of contiguous ones."""
    case = prefill("cute_pf_unaligned", (129, 700), (129 + 300, 700), **M3)
    x = _poisoned(case)
    contiguous = _run(x, "cutedsl")
    q = x["q"]
    wide = torch.full((*q.shape[:-1], 2 * q.shape[-1]), math.nan, dtype=q.dtype, device=q.device)
    wide[..., ::2] = q
    out = torch.full((q.numel() + 1,), math.nan, dtype=q.dtype, device=q.device)[1:].view(q.shape)
    m3_torch.dense_prefill(wide[..., ::2], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                           cu_seqlens_q=x["cu_seqlens_q"], out=out, backend="cutedsl")
    torch.cuda.synchronize()
    assert torch.equal(out, contiguous)


# -- GPU: the sparse mode ----------------------------------------------------------------------

SPARSE_M3 = dict(M3, topk=16)
SPARSE_CASES = [
    prefill("cute_sp_1", (1,), (1,), **SPARSE_M3),
    prefill("cute_sp_127", (127,), (127,), **SPARSE_M3),
    prefill("cute_sp_129_ctx", (129,), (129 + 300,), **SPARSE_M3),
    prefill("cute_sp_3000", (3000,), (3000,), **SPARSE_M3),
    prefill("cute_sp_mixed", (1, 127, 129, 700), (5, 127, 1000, 2100), **SPARSE_M3),
    prefill("cute_sp_empty", (9, 4), (5, 130), **SPARSE_M3),          # 4 tokens of request 0 see nothing
    # 16 tokens x topk 8 per tile (the switch's limit: 128 ids)
    prefill("cute_sp_small", (1, 127, 129, 3000), (1, 200, 129, 3000), hq=16, hk=2, d=64, dtype="float16", topk=8),
    # 32 tokens x topk 4 per tile: the choice masks' top bit (token 31) is the int32 sign bit
    prefill("cute_sp_32tok", (33, 127, 700), (33, 300, 1000), hq=8, hk=2, d=128, topk=4, gpu_only=True),
    # 128 heads of one KV head: one token per tile, its rows in both consumer warpgroups
    prefill("cute_sp_group128", (129, 300), (129, 700), hq=128, hk=1, d=64, topk=4, gpu_only=True),
]


def _sparse_ids(case, max_blocks: int) -> torch.Tensor:
    """``random_block_ids`` made harder, still distinct per row and below ``max_blocks`` (the
    contract): every other token's first two free slots get, where there is one, a block after the
    token's position (masked: seen by none of its rows), then ids at or past its request's blocks
    (skipped); then each row's slots are shuffled."""
    ids = random_block_ids(case).clone()
    g = torch.Generator().manual_seed(case.seed)
    req_blocks = [-(-s // PAGE) for q, s in zip(case.q_lens, case.seq_lens) for _ in range(q)]
    for t, kv_len in enumerate(case.kv_lens):
        free = (ids[:, t] == -1).nonzero()
        later = -(-kv_len // PAGE)            # the first block after the token's own
        extra = ([later] if later < req_blocks[t] else []) + list(range(req_blocks[t], max_blocks))
        for (h, slot), block in zip(free.tolist()[: 2 if t % 2 else 0], extra):
            ids[h, t, slot] = block
        for h in range(case.hk):
            ids[h, t] = ids[h, t, torch.randperm(case.topk, generator=g)]
    return ids


def _run_sparse(x, ids, backend):
    out = torch.full_like(x["q"], math.nan)
    return m3_torch.sparse_prefill(x["q"], x["k_cache"], x["v_cache"], ids.cuda(), x["block_table"], x["seq_lens"],
                                   cu_seqlens_q=x["cu_seqlens_q"], out=out, backend=backend)


@on_gpu
@pytest.mark.parametrize("case", SPARSE_CASES, ids=str)
def test_sparse_against_reference_and_triton(case):
    x = _poisoned(case)
    ids = _sparse_ids(case, x["block_table"].shape[1])
    out = _run_sparse(x, ids, "cutedsl")
    torch.cuda.synchronize()
    check_attention(case, out.cpu(), attention_reference(case, ids))
    triton = _run_sparse(x, ids, "triton")
    assert rel_err(out, triton) < TOLERANCE[case.dtype]


@on_gpu
def test_sparse_choosing_every_block_is_dense():
    """Every token choosing all its visible blocks (ascending): the sparse mode visits the dense
    mode's blocks in its order with the same arithmetic (the choice mask only adds selects that
    keep a value), so the bits are the dense kernel's."""
    case = prefill("cute_sp_all", (129, 700), (129 + 300, 1900), **SPARSE_M3)   # <= 15 blocks per request
    x = _poisoned(case)
    ids = torch.full((case.hk, case.num_tokens, case.topk), -1, dtype=torch.int32)
    for t, kv_len in enumerate(case.kv_lens):
        nb = -(-kv_len // PAGE)
        ids[:, t, :nb] = torch.arange(nb, dtype=torch.int32)
    assert torch.equal(_run_sparse(x, ids, "cutedsl"), _run(x, "cutedsl"))


SPARSE_BIT_CASES = [c for c in SPARSE_CASES if c.name in ("cute_sp_mixed", "cute_sp_small")]


@on_gpu
@pytest.mark.parametrize("case", SPARSE_BIT_CASES, ids=str)
def test_sparse_torch_and_jax_bit_identical(case):
    if not _jax_cute_ready():
        pytest.skip("needs a JAX GPU backend with cutlass.jax")
    x = _poisoned(case)
    ids = _sparse_ids(case, x["block_table"].shape[1])
    want = _run_sparse(x, ids, "cutedsl").cpu()
    with Target("jax", "gpu").active():
        j = _jax_gpu(x)
        got = m3_jax.sparse_prefill(j["q"], j["k_cache"], j["v_cache"], to_jax(ids.cuda()), j["block_table"],
                                    j["seq_lens"], cu_seqlens_q=j["cu_seqlens_q"], backend="cutedsl")
    assert_same_bits(to_torch(got), want)


# -- GPU: msa_prefill and the MSA layers' step on the sparse mode ------------------------------

def _run_msa(x, case, backend, monkeypatch):
    """``msa_prefill`` of ``case`` on ``x`` into a NaN-filled ``out`` with ``$M3_SPARSE_PREFILL=backend``
    -> (out, block_ids)."""
    monkeypatch.setenv(backends.SPARSE_PREFILL_ENV_VAR, backend)
    return _msa_prefill("torch", case, x, torch.full_like(x["q"], math.nan))


@on_gpu
@pytest.mark.parametrize("case", SPARSE_CASES, ids=str)
def test_msa_prefill_against_triton(case, monkeypatch):
    """M3_SPARSE_PREFILL=cutedsl: msa_prefill (indexer, selection launch, CuTeDSL kernel) chooses the
    Triton route's block ids exactly; its output is within the dtype's tolerance of the Triton route's
    and of the float64 reference over those ids (shuffled page tables with garbage past each request,
    NaN in the cache rows past each request's length, NaN-filled outputs)."""
    x = _poisoned(case)
    triton_out, triton_ids = _run_msa(x, case, "triton", monkeypatch)
    out, ids = _run_msa(x, case, "cutedsl", monkeypatch)
    torch.cuda.synchronize()
    assert torch.equal(ids, triton_ids)
    check_attention(case, out.cpu(), attention_reference(case, ids.cpu()))
    assert rel_err(out, triton_out) < TOLERANCE[case.dtype]


def _jax_msa_ready() -> bool:
    """JAX on the GPU with both launchers: jax_triton (indexer, selection) and cutlass.jax (the kernel)."""
    return jax_gpu_ready() and _jax_cute_ready()


@on_gpu
@pytest.mark.parametrize("case", SPARSE_BIT_CASES, ids=str)
def test_msa_prefill_torch_and_jax_bit_identical(case, monkeypatch):
    if not _jax_msa_ready():
        pytest.skip("needs a JAX GPU backend with jax_triton and cutlass.jax")
    x = _poisoned(case)
    want, want_ids = _run_msa(x, case, "cutedsl", monkeypatch)
    with Target("jax", "gpu").active():
        got, got_ids = _msa_prefill("jax", case, _jax_gpu(x))
    assert_same_bits(to_torch(got), want.cpu())
    assert torch.equal(to_torch(got_ids), want_ids.cpu())


@on_gpu
def test_msa_layer_step_runs_the_kernel_in_both_frameworks(monkeypatch):
    """M3_SPARSE_PREFILL=cutedsl reaches the models' MSA-layer call (msa_attention_step, sparse=True):
    its context span runs the CuTeDSL sparse kernel once, with the Triton step's block ids and within
    its tolerance, and JAX's step gives torch's bits."""
    if not _jax_msa_ready():
        pytest.skip("needs a JAX GPU backend with jax_triton and cutlass.jax")
    from m3_jax import cute_call
    from m3_torch import cute_ops
    case = SPARSE_BIT_CASES[0]
    x = _poisoned(case)
    monkeypatch.delenv(backends.SPARSE_PREFILL_ENV_VAR, raising=False)
    triton, triton_ids = (t.clone() for t in _msa_layer("torch", case, x))   # block_ids: a view into the arena
    calls = []
    monkeypatch.setenv(backends.SPARSE_PREFILL_ENV_VAR, "cutedsl")
    for module in (cute_ops, cute_call):
        original = module.sparse_prefill
        monkeypatch.setattr(module, "sparse_prefill", lambda *a, _f=original, _m=module: calls.append(_m) or _f(*a))
    out, ids = (t.clone() for t in _msa_layer("torch", case, x))
    assert calls == [cute_ops]
    assert torch.equal(ids, triton_ids)
    assert rel_err(out, triton) < TOLERANCE[case.dtype]
    with Target("jax", "gpu").active():
        got, got_ids = _msa_layer("jax", case, _jax_gpu(x))
    assert calls == [cute_ops, cute_call]
    assert_same_bits(to_torch(got), out.cpu())
    assert torch.equal(to_torch(got_ids), ids.cpu())

# -- GPU: the persistent schedule ----------------------------------------------------------------

# 126 tiles x 4 KV heads = 504 work items: tiles that see no block (request 0's first, all of request
# 5), of one block (shorter than the ring), up to 8 blocks
PERSISTENT_CASE = prefill("cute_persist", (17, 1, 127, 129, 700, 3), (5, 1, 127, 1000, 700, 0), **SPARSE_M3)


@on_gpu
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_few_ctas_give_the_full_grids_bits(sparse, monkeypatch):
    """The SM count forced down to 1, 2, 3 and 7 CTAs: each CTA runs many work items in turn (of 0, 1
    and up to 8 blocks), carrying the ring's stages and phases, the pingpong turns, its warpgroups'
    query rows and (sparse) the two block-list slots from one item to the next; the output is the
    full grid's (one CTA per SM: 132 on an H200, 3 or 4 items each), bit for bit, and that is within
    the tolerance of the reference. Fewer items than SMs: the one-tile cases above."""
    from m3_torch import cute_ops
    case = PERSISTENT_CASE
    x = _poisoned(case)
    ids = _sparse_ids(case, x["block_table"].shape[1]) if sparse else None

    def run():
        return _run_sparse(x, ids, "cutedsl") if sparse else _run(x, "cutedsl")

    want = run()
    torch.cuda.synchronize()
    check_attention(case, want.cpu(), attention_reference(case, ids))
    for ctas in (1, 2, 3, 7):
        monkeypatch.setattr(cute_ops, "sm_count", lambda device, n=ctas: n)
        assert torch.equal(run(), want), f"{ctas} CTAs"

