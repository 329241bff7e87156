"""Where a test runs: framework {torch, jax} x device {interpreter, gpu}, and the ops run on a case.

``grid(cases)`` parametrizes a test over cases and targets (gpu targets carry
``pytest.mark.gpu``; GPU-only cases get no interpreter target). ``run(target,
op, case)`` runs one public op on a case's inputs (tests/helpers/cases.py) and returns
the outputs as CPU torch tensors; it is memoized, so the float64 references,
and the torch run that a JAX run must equal bit for bit, are computed once per
session whichever test asks first.

torch runs write into NaN-poisoned ``out`` buffers (transposed views for
``strided`` cases, whose q / idx_q are non-contiguous too); JAX runs get the
same bits through numpy (NHD stores as ``kv_layout="NHD"``, pool views as
``PagedView``s of the same flat pool).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import m3_jax
import m3_torch
from m3_kernels import tuning
from m3_torch import reference as ref

from cases import E4M3, TOLERANCE, Case, make_inputs, pool_layout, rel_err

FRAMEWORKS = ("torch", "jax")
DEVICES = ("interpreter", "gpu")


def jax_gpu_ready() -> bool:
    return jax.default_backend() == "gpu" and importlib.util.find_spec("jax_triton") is not None


@dataclasses.dataclass(frozen=True)
class Target:
    framework: str   # "torch" | "jax"
    device: str      # "interpreter" (CPU, Triton's interpreter) | "gpu"

    def __str__(self):
        return f"{self.framework}-{self.device}"

    @property
    def torch_device(self) -> str:
        return "cuda" if self.device == "gpu" else "cpu"

    @property
    def twin(self) -> "Target":
        """The torch target on the same device (what a JAX run must equal bit for bit)."""
        return Target("torch", self.device)

    @property
    def marks(self) -> list:
        if self.device == "interpreter":
            return []
        marks = [pytest.mark.gpu]
        if self.framework == "jax":
            marks.append(pytest.mark.skipif(not jax_gpu_ready(), reason="needs a JAX GPU backend and jax_triton"))
        return marks

    @contextlib.contextmanager
    def active(self, case: Case | None = None):
        """JAX on its CPU device for the interpreter (also on a GPU machine); the case's
        program target (one program per row tile) on the interpreter."""
        with contextlib.ExitStack() as stack:
            if self.framework == "jax" and self.device == "interpreter":
                stack.enter_context(jax.default_device(jax.devices("cpu")[0]))
            if case is not None and case.one_program and self.device == "interpreter":
                stack.enter_context(tuning.override(target_programs=1, sparse_target_programs=1))
            yield


TARGETS = [Target(f, d) for d in DEVICES for f in FRAMEWORKS]


def targets(frameworks=FRAMEWORKS) -> list:
    """``pytest.param(target)`` for every target of ``frameworks``."""
    return [pytest.param(t, id=str(t), marks=t.marks) for t in TARGETS if t.framework in frameworks]


def grid(cases, frameworks=FRAMEWORKS) -> list:
    """``pytest.param(case, target)`` for every case and target (GPU-only cases: GPU targets only;
    slow cases: marked ``slow`` on the interpreter, and ``long`` for JAX there: its interpreted
    launches run the same kernel source on the same CPU tensors as torch's, which ``make test`` runs)."""
    params = []
    for c in cases:
        for t in TARGETS:
            if t.framework not in frameworks or (c.gpu_only and t.device == "interpreter"):
                continue
            slow = []
            if c.slow and t.device == "interpreter":
                slow = [pytest.mark.slow] + ([pytest.mark.long] if t.framework == "jax" else [])
            params.append(pytest.param(c, t, id=f"{c}-{t}", marks=[*t.marks, *slow]))
    return params


# -- torch <-> jax, same bits ---------------------------------------------------------------

# dtypes numpy knows only through ml_dtypes, moved as ints of their width: (torch, torch int, numpy int, jax)
_INT_VIEWS = [(torch.bfloat16, torch.int16, np.int16, jnp.bfloat16),
              (torch.float8_e4m3fn, torch.uint8, np.uint8, jnp.float8_e4m3fn),
              (torch.float8_e5m2, torch.uint8, np.uint8, jnp.float8_e5m2)]


def to_jax(t: torch.Tensor) -> jax.Array:
    """A torch tensor -> a jax array (default device) with the same bits (bf16 / FP8 through ints)."""
    t = t.detach().cpu().contiguous()
    for dtype, as_int, _, jdtype in _INT_VIEWS:
        if t.dtype == dtype:
            return jnp.asarray(t.view(as_int).numpy().view(jdtype))
    return jnp.asarray(t.numpy())


def to_torch(a) -> torch.Tensor:
    """A jax array -> a CPU torch tensor with the same bits."""
    a = np.asarray(a)
    for dtype, _, np_int, jdtype in _INT_VIEWS:
        if a.dtype == jdtype:
            return torch.from_numpy(a.view(np_int).copy()).view(dtype)
    return torch.from_numpy(a.copy())


def assert_same_bits(got: torch.Tensor, want: torch.Tensor):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), \
        "JAX and torch launches of the same kernel differ"


@functools.cache
def jax_inputs(case: Case, device: str) -> dict:
    """A case's inputs as jax arrays (made under ``Target("jax", device).active()``)."""
    x = make_inputs(case, "cpu")
    j = {k: to_jax(x[k]) for k in ("q", "idx_q", "block_table", "seq_lens")}
    j["cu_seqlens_q"] = np.asarray(case.cu_seqlens, np.int32)  # host offsets: read once, never traced
    if case.kv_layout == "pool":
        pool = to_jax(x["pool"])
        kv_dtype, index_dtype = case.cache_dtypes
        _, *views = pool_layout(x["k_cache"].shape[0], case.hk, case.d, case.di, kv_dtype=kv_dtype,
                                index_dtype=index_dtype)
        for name, view in zip(("k_cache", "v_cache", "index_k_cache"), views):
            j[name] = m3_jax.PagedView(pool, view.offset, view.shape, view.strides, view.dtype)
        j["kv_layout"] = "HND"   # views carry their own strides
    else:
        nhd = case.kv_layout == "NHD"  # x holds the HND permutation of a [pages, 128, Hk, D] store
        for name in ("k_cache", "v_cache"):
            j[name] = to_jax(x[name].permute(0, 2, 1, 3) if nhd else x[name])
        j["index_k_cache"] = to_jax(x["index_k_cache"])
        j["kv_layout"] = case.kv_layout
    return j


# -- the ops on a case ---------------------------------------------------------------------

def kv_scales(case: Case, framework: str, device: str = "cpu") -> dict:
    """The ``k_scale``/``v_scale`` keywords of a case's attention calls: none for non-FP8 caches or
    default scales; else float32 tensors of shape [] (torch) or arrays of shape [1] (JAX)."""
    if case.kv_dtype != E4M3 or case.kv_scales is None:
        return {}
    if framework == "torch":
        return {n: torch.tensor(s, dtype=torch.float32, device=device) for n, s in zip(("k_scale", "v_scale"),
                                                                                        case.kv_scales)}
    return {n: jnp.asarray([s], jnp.float32) for n, s in zip(("k_scale", "v_scale"), case.kv_scales)}


@functools.cache
def selected_blocks(case: Case) -> torch.Tensor:
    """What sparse attention attends over: the reference selection [Hk, T, topk] of the float64
    index scores (random data: different blocks per token), which msa must choose too, so both
    share one float64 attention reference."""
    x = make_inputs(case)
    return ref.select_blocks_ref(reference("index_scores", case), x["seq_lens"], case.q_lens, case.topk,
                                 case.init_blocks, case.local_blocks)


@functools.cache
def random_scores(case: Case) -> torch.Tensor:
    """Scores [Hi, T, max_blocks] float32 for select_blocks: random floats (no ties)."""
    g = torch.Generator().manual_seed(case.seed + 1)
    max_blocks = make_inputs(case)["block_table"].shape[1]
    return torch.randn(case.hk, case.num_tokens, max_blocks, generator=g)


def _strided(x: torch.Tensor) -> torch.Tensor:
    """The same values with stride 2 along the last axis."""
    wide = torch.full((*x.shape[:-1], 2 * x.shape[-1]), math.nan, dtype=x.dtype, device=x.device)
    wide[..., ::2] = x
    return wide[..., ::2]


def _poisoned_out(shape, dtype, device, strided: bool) -> torch.Tensor:
    """A NaN-filled (int: 12345) output buffer; ``strided``: the transpose of a buffer with its
    first two axes swapped."""
    fill = math.nan if dtype.is_floating_point else 12345
    if not strided:
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.full((shape[1], shape[0], *shape[2:]), fill, dtype=dtype, device=device).transpose(0, 1)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy (workspace-backed outputs get overwritten by later calls)."""
    return t.detach().to("cpu", copy=True)


def _run_torch(op: str, case: Case, device: str):
    x = dict(make_inputs(case, device))
    if case.strided:
        x["q"], x["idx_q"] = _strided(x["q"]), _strided(x["idx_q"])
    meta = dict(decode_query_len=case.n) if case.decode else dict(cu_seqlens_q=x["cu_seqlens_q"])
    sel = dict(topk=case.topk, init_blocks=case.init_blocks, local_blocks=case.local_blocks)
    table = (x["block_table"], x["seq_lens"])
    scales = kv_scales(case, "torch", device)
    attn_out = _poisoned_out(x["q"].shape, x["q"].dtype, device, case.strided)
    if op == "index_scores":
        shape = (case.hk, case.num_tokens, x["block_table"].shape[1])
        out = _poisoned_out(shape, torch.float32, device, case.strided)
        fn = m3_torch.index_scores if case.decode else m3_torch.index_scores_prefill
        got = fn(x["idx_q"], x["index_k_cache"], *table, out=out, **meta)
    elif op == "select_blocks":
        out = _poisoned_out((case.hk, case.num_tokens, case.topk), torch.int32, device, case.strided)
        fn = m3_torch.select_blocks if case.decode else m3_torch.select_blocks_prefill
        got = fn(random_scores(case).to(device), x["seq_lens"], out=out, **meta, **sel)
    elif op == "sparse":
        out = attn_out
        fn = m3_torch.sparse_decode if case.decode else m3_torch.sparse_prefill
        got = fn(x["q"], x["k_cache"], x["v_cache"], selected_blocks(case).to(device), *table, out=out, **meta,
                 **scales)
    elif op == "dense":
        out = attn_out
        fn = m3_torch.dense_decode if case.decode else m3_torch.dense_prefill
        got = fn(x["q"], x["k_cache"], x["v_cache"], *table, sm_scale=0.3, out=out, **meta, **scales)
    elif op == "msa":
        out = attn_out
        fn = m3_torch.msa_decode if case.decode else m3_torch.msa_prefill
        got, ids = fn(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"], *table, out=out,
                      **meta, **sel, **scales)
        assert got is out
        return _copy(got), _copy(ids)
    else:
        raise ValueError(op)
    assert got is out
    return _copy(got)


def _run_jax(op: str, case: Case, device: str):
    j = jax_inputs(case, device)
    meta = dict(decode_query_len=case.n) if case.decode else dict(cu_seqlens_q=j["cu_seqlens_q"])
    sel = dict(topk=case.topk, init_blocks=case.init_blocks, local_blocks=case.local_blocks)
    table = (j["block_table"], j["seq_lens"])
    kv = dict(kv_layout=j["kv_layout"], **kv_scales(case, "jax"))
    if op == "index_scores":
        fn = m3_jax.index_scores if case.decode else m3_jax.index_scores_prefill
        got = fn(j["idx_q"], j["index_k_cache"], *table, **meta)
    elif op == "select_blocks":
        fn = m3_jax.select_blocks if case.decode else m3_jax.select_blocks_prefill
        got = fn(to_jax(random_scores(case)), j["seq_lens"], **meta, **sel)
    elif op == "sparse":
        fn = m3_jax.sparse_decode if case.decode else m3_jax.sparse_prefill
        got = fn(j["q"], j["k_cache"], j["v_cache"], to_jax(selected_blocks(case)), *table, **meta, **kv)
    elif op == "dense":
        fn = m3_jax.dense_decode if case.decode else m3_jax.dense_prefill
        got = fn(j["q"], j["k_cache"], j["v_cache"], *table, sm_scale=0.3, **meta, **kv)
    elif op == "msa":
        fn = m3_jax.msa_decode if case.decode else m3_jax.msa_prefill
        out, ids = fn(j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"], *table, **meta, **sel,
                      **kv)
        return to_torch(out), to_torch(ids)
    else:
        raise ValueError(op)
    return to_torch(got)


@functools.cache
def run(target: Target, op: str, case: Case):
    """``op`` in {index_scores, select_blocks, sparse, dense, msa} on ``case`` through ``target``
    -> CPU torch tensor(s); the decode op for decode cases, the prefill op otherwise. sparse
    attends over ``selected_blocks(case)``, dense uses ``sm_scale=0.3``, select_blocks reads
    ``random_scores(case)``, msa returns ``(out, block_ids)``."""
    with target.active(case):
        if target.framework == "torch":
            return _run_torch(op, case, target.torch_device)
        return _run_jax(op, case, target.device)


def check_twin(target: Target, op: str, case: Case):
    """A JAX run equals the torch run of the same kernel on the same device, bit for bit."""
    if target.framework == "jax":
        got, want = run(target, op, case), run(target.twin, op, case)
        for a, b in zip(*((got, want) if isinstance(got, tuple) else ((got,), (want,)))):
            assert_same_bits(a, b)


# -- float64 references --------------------------------------------------------------------

@functools.cache
def reference(op: str, case: Case):
    """The float64 reference of ``op`` on the case's inputs (CPU)."""
    x = make_inputs(case)
    table = (x["block_table"], x["seq_lens"])
    if op == "index_scores":
        return ref.index_scores_ref(x["idx_q"], x["index_k_cache"], *table, case.q_lens)
    if op == "select_blocks":
        return ref.select_blocks_ref(random_scores(case), x["seq_lens"], case.q_lens, case.topk, case.init_blocks,
                                     case.local_blocks)
    if op == "sparse":
        return attention_reference(case, selected_blocks(case))
    if op == "dense":
        k_scale, v_scale = case.scales
        return ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], *table, case.q_lens, sm_scale=0.3,
                                 k_scale=k_scale, v_scale=v_scale)
    raise ValueError(op)


def attention_reference(case: Case, block_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 attention (default sm_scale) over ``block_ids``, or every visible block when None;
    memoized by value, so torch and JAX runs share it."""
    return _attention_reference(case, None if block_ids is None else block_ids.numpy().tobytes())


@functools.cache
def _attention_reference(case: Case, ids_bytes: bytes | None) -> torch.Tensor:
    x = make_inputs(case)
    ids = None
    if ids_bytes is not None:
        ids = torch.frombuffer(bytearray(ids_bytes), dtype=torch.int32).reshape(case.hk, case.num_tokens, case.topk)
    k_scale, v_scale = case.scales
    return ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], case.q_lens, ids,
                             k_scale=k_scale, v_scale=v_scale)


def check_attention(case: Case, out: torch.Tensor, expected: torch.Tensor):
    """Relative error under the dtype's tolerance (NaN fails); tokens that see nothing are exact zeros."""
    assert out.dtype == make_inputs(case)["q"].dtype
    assert rel_err(out, expected) < TOLERANCE[case.dtype]
    assert (out[case.empty_tokens] == 0).all()


def check_empty_ids(case: Case, block_ids: torch.Tensor):
    assert (block_ids[:, case.empty_tokens] == -1).all()
