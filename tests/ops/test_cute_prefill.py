"""backend="cutedsl" of ``dense_prefill`` (the CuTeDSL kernel of ``cute_prefill.py``).

CPU: the backend switch and its errors, and (when nvidia-cutlass-dsl is
importable) compiling the kernel for sm_90a through the torch path, no GPU
needed.

GPU (``-m gpu``; skipped with a reason when the package is missing or the GPU
is not sm_90): against the float64 reference within the dtype's tolerance and
against the Triton backend, at odd lengths (1, 127, 128, 129, 3000 tokens),
several requests with shuffled page tables whose unused entries are garbage,
NaN in every cache row past each request's length, NaN-poisoned outputs, a
prompt longer than its KV length (tokens that see nothing: zeros), M3's 64/4
heads at D = 128 and a small 8/2 case at D = 64 in fp16; q and out whose rows
are not aligned (the kernel's element-by-element load and store) give the same
bits as contiguous ones (its 16-byte loads and 4-byte stores).
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

import m3_torch
from m3_kernels import backends

from cases import PAGE, TOLERANCE, make_inputs, prefill, rel_err
from targets import attention_reference, check_attention

HAVE_CUTEDSL = importlib.util.find_spec("cutlass") is not None
GPU_CAPABILITY = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
if GPU_CAPABILITY is None:
    # no GPU to detect: the compile test targets Hopper (read when cutlass is first imported)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
needs_cutedsl = pytest.mark.skipif(not HAVE_CUTEDSL, reason="nvidia-cutlass-dsl is not installed (pip install -e "
                                                            "'.[cutedsl]'; README: CuteDSL indexer backend)")


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


def test_cpu_call_refused():
    """The public op refuses backend='cutedsl' on CPU tensors before any work, naming the fix."""
    case = prefill("cute_cpu", (3,), (5,), hq=4, hk=2, d=64)
    x = make_inputs(case)
    with pytest.raises(RuntimeError, match="use backend='triton'"):
        m3_torch.dense_prefill(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                               cu_seqlens_q=x["cu_seqlens_q"], backend="cutedsl")


@needs_cutedsl
def test_compiles_for_hopper_torch_path():
    """The kernel (TMA ring, warp specialization, both wgmmas) lowers through CuTeDSL and ptxas for sm_90a."""
    from m3_torch import cute_ops
    key = cute_ops.prefill_shape_class("bfloat16", 16, 128)
    assert cute_ops.compile_dense_prefill(key, arch="sm_90a") is not None


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
