"""m3_jax prefill ops and mixed steps: bit-identical to m3_torch, close to the jnp / float64 references.

On this CPU-only machine both frameworks run the same kernels through Triton's
interpreter (JAX inside ``jax.pure_callback``) with the same geometry, so every
output must match torch bit for bit. Inputs come from tests/prefill_cases.py
as torch tensors and reach JAX through numpy (same bits). The ``gpu`` test at
the end repeats the cross-framework checks at MiniMax-M3 shapes with jax-triton.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import m3_jax
import m3_torch
from m3_jax import reference as jref
from m3_kernels import planner
from m3_torch import reference as tref

from cases import TOLERANCE, rel_err
from prefill_cases import GQA, PrefillCase, make_prefill_inputs
from jax_helpers import _jax_device, assert_bit_identical, jax_gpu_ready, jax_inputs, to_jax, to_torch  # noqa: F401


# -- ops ----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [GQA], ids=str)  # FP16 and the 300-token case: torch suite only (CPU time)
def test_prefill_ops_match_torch_and_references(case):
    x = make_prefill_inputs(case, seed=41)
    j = jax_inputs(case, x)
    cu = np.asarray(case.cu_seqlens, np.int32)  # host offsets: read once, never traced
    meta = (j["block_table"], j["seq_lens"])

    scores = m3_jax.index_scores_prefill(j["idx_q"], j["index_k_cache"], *meta, cu_seqlens_q=cu)
    t_scores = m3_torch.index_scores_prefill(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"],
                                             cu_seqlens_q=x["cu_seqlens_q"])
    assert_bit_identical(scores, t_scores)
    expected = jref.index_scores_ref(j["idx_q"], j["index_k_cache"], *meta, case.q_lens)
    finite = np.isfinite(np.asarray(expected))
    assert (np.isfinite(np.asarray(scores)) == finite).all()
    np.testing.assert_allclose(np.asarray(scores)[finite], np.asarray(expected)[finite], rtol=1e-4, atol=1e-4)

    kw = dict(topk=case.topk, init_blocks=case.init_blocks, local_blocks=case.local_blocks)
    ids = m3_jax.select_blocks_prefill(scores, j["seq_lens"], cu_seqlens_q=cu, **kw)
    t_ids = m3_torch.select_blocks_prefill(t_scores, x["seq_lens"], cu_seqlens_q=x["cu_seqlens_q"], **kw)
    assert_bit_identical(ids, t_ids)

    out, msa_ids = m3_jax.msa_prefill(j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"], *meta,
                                      cu_seqlens_q=cu, kv_layout=j["kv_layout"], **kw)
    assert_bit_identical(msa_ids, t_ids)
    t_out = m3_torch.sparse_prefill(x["q"], x["k_cache"], x["v_cache"], t_ids, x["block_table"], x["seq_lens"],
                                    cu_seqlens_q=x["cu_seqlens_q"])
    assert_bit_identical(out, t_out)
    want, want_ids = jref.msa_decode_ref(j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"], *meta,
                                         case.q_lens, kv_layout=j["kv_layout"], **kw)
    assert (np.asarray(msa_ids) == np.asarray(want_ids)).all()
    assert rel_err(to_torch(out.astype(jnp.float32)), to_torch(want)) < TOLERANCE[case.dtype]

    if case is GQA:
        dense = m3_jax.dense_prefill(j["q"], j["k_cache"], j["v_cache"], *meta, cu_seqlens_q=cu, sm_scale=0.3,
                                     kv_layout=j["kv_layout"])
        t_dense = m3_torch.dense_prefill(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                         cu_seqlens_q=x["cu_seqlens_q"], sm_scale=0.3)
        assert_bit_identical(dense, t_dense)
        want = tref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], case.q_lens,
                                  sm_scale=0.3)
        assert rel_err(to_torch(dense.astype(jnp.float32)), want) < TOLERANCE[case.dtype]


def test_sparse_prefill_under_jit_with_traced_maps():
    """PrefillMaps are pytree leaves: a new batch with the same padded shapes does not retrace."""
    traces = []

    @jax.jit
    def run(q, k, v, ids, block_table, seq_lens, maps):
        traces.append(1)
        return m3_jax.sparse_prefill(q, k, v, ids, block_table, seq_lens, plan=maps)

    for seed, (q_lens, prefixes) in enumerate((((9, 3), (140, 0)), ((10, 2), (0, 141)))):
        case = PrefillCase("jit", q_lens, prefixes, topk=2)
        x = make_prefill_inputs(case, seed=50 + seed)
        j = jax_inputs(case, x)
        maps = m3_jax.prefill_maps(planner.prefill_plan(case.cu_seqlens), heads=(case.hq // case.hk,))
        ids = m3_torch.select_blocks_prefill(torch.randn(1, case.num_tokens, x["block_table"].shape[1]),
                                             x["seq_lens"], cu_seqlens_q=x["cu_seqlens_q"], topk=2)
        got = run(j["q"], j["k_cache"], j["v_cache"], to_jax(ids), j["block_table"], j["seq_lens"], maps)
        want = m3_torch.sparse_prefill(x["q"], x["k_cache"], x["v_cache"], ids, x["block_table"], x["seq_lens"],
                                       cu_seqlens_q=x["cu_seqlens_q"])
        assert_bit_identical(got, want)
    assert len(traces) == 1


# -- mixed steps ----------------------------------------------------------------------------

def _step_case(q_lens, prefixes):
    return PrefillCase("step", q_lens, prefixes, topk=3)


def _planned(case, seed, num_context=2):
    x = make_prefill_inputs(case, seed=seed)
    x["seq_lens"][-1] = 0  # a padding row
    cfg = planner.StepConfig(num_q_heads=case.hq, num_kv_heads=case.hk, head_dim=case.d, max_batch=8,
                             max_num_tokens=64, max_blocks=x["block_table"].shape[1], topk=case.topk)
    plan = planner.StepPlanner(cfg).plan(x["seq_lens"].tolist(), q_lens=case.q_lens, num_context=num_context)
    return x, plan


def _torch_step(x, plan, sparse):
    out, ids = m3_torch.msa_attention_step(x["q"], x["idx_q"] if sparse else None, x["k_cache"], x["v_cache"],
                                           x["index_k_cache"] if sparse else None, x["block_table"], x["seq_lens"],
                                           plan=plan, sparse=sparse, out=torch.full_like(x["q"], math.nan))
    return out, None if ids is None else ids.clone()


def test_sparse_step_matches_torch_under_jit():
    """Context prefix + generation suffix (n = 2, one padding row), jitted with the StepSpec static and
    the context maps traced: two batches of the same shapes compile once, both bit-identical to torch."""
    traces = []

    def step(q, idx_q, k, v, index_k, block_table, seq_lens, maps, spec):
        traces.append(1)
        return m3_jax.msa_attention_step(q, idx_q, k, v, index_k, block_table, seq_lens, plan=spec, maps=maps)

    jitted = jax.jit(step, static_argnames="spec")
    specs = set()
    for seed, (q_lens, prefixes) in enumerate((((20, 5, 2, 2, 2, 2), (200, 1000, 298, 127, 0, 0)),
                                               ((17, 8, 2, 2, 2, 2), (150, 1000, 300, 1, 5, 0)))):
        case = _step_case(q_lens, prefixes)
        x, plan = _planned(case, seed=60 + seed)
        j = jax_inputs(case, x)
        spec, maps = m3_jax.step_inputs(plan)
        specs.add(spec)
        out, ids = jitted(j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"], j["block_table"],
                          j["seq_lens"], maps, spec=spec)
        t_out, t_ids = _torch_step(x, plan, sparse=True)
        assert_bit_identical(out, t_out)
        assert_bit_identical(ids, t_ids)
        assert (np.asarray(out)[-2:] == 0).all() and (np.asarray(ids)[:, -2:] == -1).all()
    assert len(specs) == 1 and len(traces) == 1


def test_dense_step_matches_torch():
    case = _step_case((20, 5, 2, 2, 2, 2), (200, 1000, 298, 127, 0, 0))
    x, plan = _planned(case, seed=62)
    j = jax_inputs(case, x)
    out, ids = m3_jax.msa_attention_step(j["q"], None, j["k_cache"], j["v_cache"], None, j["block_table"],
                                         j["seq_lens"], plan=plan, sparse=False)
    assert ids is None
    t_out, _ = _torch_step(x, plan, sparse=False)
    assert_bit_identical(out, t_out)
    want = jref.attention_ref(j["q"], j["k_cache"], j["v_cache"], j["block_table"], j["seq_lens"], case.q_lens)
    assert rel_err(to_torch(out), to_torch(want)) < TOLERANCE[case.dtype]


def test_context_only_and_generation_only_steps():
    for q_lens, seed, num_context in (((3, 4, 1), 63, 3), ((1, 1, 1), 64, 0)):
        case = _step_case(q_lens, (130, 0, 5))
        x, plan = _planned(case, seed=seed, num_context=num_context)
        j = jax_inputs(case, x)
        args = (j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"], j["block_table"], j["seq_lens"])
        out, ids = m3_jax.msa_attention_step(*args, plan=plan)
        t_out, t_ids = _torch_step(x, plan, sparse=True)
        assert_bit_identical(out, t_out)
        assert_bit_identical(ids, t_ids)


def test_errors():
    case = PrefillCase("err", (3, 2), (5, 130))
    x = make_prefill_inputs(case, seed=65)
    j = jax_inputs(case, x)

    @jax.jit
    def traced(q, k, v, bt, sl, cu):
        return m3_jax.dense_prefill(q, k, v, bt, sl, cu_seqlens_q=cu)

    with pytest.raises(TypeError, match="traced"):
        traced(j["q"], j["k_cache"], j["v_cache"], j["block_table"], j["seq_lens"], j["cu_seqlens_q"])
    maps = m3_jax.prefill_maps(case.cu_seqlens, heads=(1,))
    with pytest.raises(ValueError, match="heads"):
        m3_jax.dense_prefill(j["q"], j["k_cache"], j["v_cache"], j["block_table"], j["seq_lens"], plan=maps)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        m3_jax.dense_prefill(j["q"], j["k_cache"], j["v_cache"], j["block_table"], j["seq_lens"],
                             cu_seqlens_q=np.asarray(case.cu_seqlens, np.int64))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        m3_jax.dense_prefill(j["q"][:-1], j["k_cache"], j["v_cache"], j["block_table"], j["seq_lens"],
                             cu_seqlens_q=case.cu_seqlens)
    step_case = _step_case((20, 5, 2, 2), (200, 1000, 298, 0))
    y, plan = _planned(step_case, seed=66)
    k = jax_inputs(step_case, y)
    spec, _ = m3_jax.step_inputs(plan)
    with pytest.raises(ValueError, match="maps"):
        m3_jax.msa_attention_step(k["q"], k["idx_q"], k["k_cache"], k["v_cache"], k["index_k_cache"],
                                  k["block_table"], k["seq_lens"], plan=spec)


# -- GPU, at MiniMax-M3 shapes ----------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not jax_gpu_ready(), reason="needs a JAX GPU backend and jax_triton")
def test_gpu_m3_prefill_and_step_jax_matches_torch():
    M3 = dict(hq=64, hk=4, d=128, di=128, topk=16, dtype="bfloat16")
    case = PrefillCase("m3", (300, 128, 5, 1, 0, 64), (1000, 1, 200, 0, 0, 3000), nhd=True, **M3)
    x = make_prefill_inputs(case, seed=70, device="cuda")
    j = {k: to_jax(v) for k, v in x.items()}
    j["k_cache"] = to_jax(x["k_cache"].permute(0, 2, 1, 3))
    j["v_cache"] = to_jax(x["v_cache"].permute(0, 2, 1, 3))
    cu = np.asarray(case.cu_seqlens, np.int32)
    out, ids = m3_jax.msa_prefill(j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"],
                                  j["block_table"], j["seq_lens"], cu_seqlens_q=cu, topk=16, kv_layout="NHD")
    t_out, t_ids = m3_torch.msa_prefill(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                        x["block_table"], x["seq_lens"], cu_seqlens_q=x["cu_seqlens_q"], topk=16)
    assert_bit_identical(out, t_out)
    assert_bit_identical(ids, t_ids)
    dense = m3_jax.dense_prefill(j["q"], j["k_cache"], j["v_cache"], j["block_table"], j["seq_lens"],
                                 cu_seqlens_q=cu, kv_layout="NHD")
    t_dense = m3_torch.dense_prefill(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                     cu_seqlens_q=x["cu_seqlens_q"])
    assert_bit_identical(dense, t_dense)
    expected = tref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], case.q_lens)
    assert rel_err(to_torch(dense.astype(jnp.float32)), expected) < TOLERANCE["bfloat16"]

    # a mixed step: two context rows, three generation rows (n = 2) and a padding row
    step_case = PrefillCase("m3_step", (300, 64, 2, 2, 2, 2), (1000, 0, 5000, 127, 1, 0), **M3)
    x = make_prefill_inputs(step_case, seed=71, device="cuda")
    x["seq_lens"][-1] = 0
    j = {k: to_jax(v) for k, v in x.items()}
    cfg = planner.StepConfig(num_q_heads=64, num_kv_heads=4, head_dim=128, max_batch=16, max_num_tokens=512,
                             max_blocks=x["block_table"].shape[1], topk=16)
    plan = planner.StepPlanner(cfg).plan(x["seq_lens"].tolist(), q_lens=step_case.q_lens, num_context=2)
    spec, maps = m3_jax.step_inputs(plan)
    step = jax.jit(m3_jax.msa_attention_step, static_argnames=("plan", "sparse"))
    for sparse in (True, False):
        out, ids = step(j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"], j["block_table"],
                        j["seq_lens"], plan=spec, maps=maps, sparse=sparse)
        t_out, t_ids = m3_torch.msa_attention_step(x["q"], x["idx_q"], x["k_cache"], x["v_cache"],
                                                   x["index_k_cache"], x["block_table"], x["seq_lens"], plan=plan,
                                                   sparse=sparse)
        assert_bit_identical(out, t_out)
        if sparse:
            assert_bit_identical(ids, t_ids)
