"""msa_attention_step: mixed steps (context rows first, generation rows last) through the step
planner, vs each request run alone and vs the float64 references; JAX bit-identical to torch."""

import dataclasses
import functools
import math

import jax
import pytest
import torch

import m3_jax
import m3_torch
from m3_kernels import planner
from m3_torch import reference as ref

from cases import STEP_CASES, TOLERANCE, Case, make_inputs, rel_err, step
from targets import (assert_same_bits, attention_reference, check_attention, check_empty_ids, grid, jax_inputs,
                     kv_scales, selected_blocks, targets, to_jax, to_torch)


def step_planner(case: Case, **over) -> planner.StepPlanner:
    x = make_inputs(case)
    cfg = planner.StepConfig(num_q_heads=case.hq, num_kv_heads=case.hk, head_dim=case.d,
                             max_batch=max(8, len(case.q_lens)), max_num_tokens=max(64, case.num_tokens),
                             max_blocks=x["block_table"].shape[1], topk=case.topk, **over)
    return planner.StepPlanner(cfg)


def plan_of(case: Case) -> planner.StepPlan:
    return step_planner(case).plan(case.seq_lens, q_lens=case.q_lens, num_context=case.num_context)


def run_step(target, case: Case, plan, sparse: bool, over=None):
    """One msa_attention_step on the case's inputs (``over``: CPU torch tensors replacing some)
    through ``target`` -> (out, block_ids | None) as CPU torch tensors."""
    over = over or {}
    with target.active(case):
        if target.framework == "torch":
            x = dict(make_inputs(case, target.torch_device), **{k: v.to(target.torch_device) for k, v in over.items()})
            out, ids = m3_torch.msa_attention_step(
                x["q"], x["idx_q"] if sparse else None, x["k_cache"], x["v_cache"],
                x["index_k_cache"] if sparse else None, x["block_table"], x["seq_lens"], plan=plan, sparse=sparse,
                out=torch.full_like(x["q"], math.nan), **kv_scales(case, "torch", target.torch_device))
            return out.cpu(), None if ids is None else ids.to("cpu", copy=True)  # ids: a view of the arena
        j = dict(jax_inputs(case, target.device), **{k: to_jax(v) for k, v in over.items()})
        out, ids = m3_jax.msa_attention_step(j["q"], j["idx_q"] if sparse else None, j["k_cache"], j["v_cache"],
                                             j["index_k_cache"] if sparse else None, j["block_table"],
                                             j["seq_lens"], plan=plan, sparse=sparse, kv_layout=j["kv_layout"],
                                             **kv_scales(case, "jax"))
        return to_torch(out), None if ids is None else to_torch(ids)


@functools.cache
def planned_step(target, case: Case, sparse: bool):
    return run_step(target, case, plan_of(case), sparse)


def alone(case: Case, r: int, sparse: bool, device: str):
    """Request r by itself through the public prefill (context row) or decode (generation row) ops."""
    x = make_inputs(case, device)
    t0 = sum(case.q_lens[:r])
    toks, rows = slice(t0, t0 + case.q_lens[r]), slice(r, r + 1)
    q, idx_q = x["q"][toks], x["idx_q"][toks]
    caches, meta = (x["k_cache"], x["v_cache"]), (x["block_table"][rows], x["seq_lens"][rows])
    if r < case.num_context:
        kw = dict(cu_seqlens_q=torch.tensor([0, case.q_lens[r]], dtype=torch.int32, device=device))
        msa, dense = m3_torch.msa_prefill, m3_torch.dense_prefill
    else:
        kw = dict(decode_query_len=case.q_lens[r])
        msa, dense = m3_torch.msa_decode, m3_torch.dense_decode
    kw.update(kv_scales(case, "torch", device))
    if sparse:
        return msa(q, idx_q, *caches, x["index_k_cache"], *meta, topk=case.topk, **kw)
    return dense(q, *caches, *meta, **kw), None


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize("case, target", grid(STEP_CASES))
def test_step(case, target, sparse):
    out, ids = planned_step(target, case, sparse)
    assert (ids is None) != sparse
    if target.framework == "jax":
        twin_out, twin_ids = planned_step(target.twin, case, sparse)
        assert_same_bits(out, twin_out)
        if sparse:
            assert_same_bits(ids, twin_ids)
        return
    # torch: each request alone through the public prefill / decode ops gives the same
    t0 = 0
    for r, q_len in enumerate(case.q_lens):
        toks = slice(t0, t0 + q_len)
        want, want_ids = alone(case, r, sparse, target.torch_device)
        # alone, a request may get another split-K geometry: equal up to the dtype's rounding
        tol = 1e-5 if case.dtype == "float32" else TOLERANCE[case.dtype]
        torch.testing.assert_close(out[toks], want.cpu(), rtol=tol, atol=tol)
        if sparse:
            assert torch.equal(ids[:, toks], want_ids.cpu())
        t0 += q_len
    # and the whole step the float64 reference
    if sparse:
        check_empty_ids(case, ids)
        if target.device == "interpreter":   # random data, small sizes: no near-ties
            assert torch.equal(ids, selected_blocks(case))
    check_attention(case, out, attention_reference(case, ids if sparse else None))


def test_step_plan_bounds_each_span():
    """Each span gets its own block bound: a long context row does not widen the decode launches."""
    plan = plan_of(STEP_CASES[0])
    assert (plan.context.max_blocks, plan.generation.max_blocks) == (8, 4)


@pytest.mark.parametrize("target", targets())
def test_prefill_then_decode_equals_one_longer_prefill(target):
    """Position rule across a chunk boundary: a 20-token chunk then an MTP step of 3 tokens give
    what one 23-token chunk gives (the cache already holds all 623 tokens)."""
    full = step("boundary", (23,), (623,), num_context=1, hq=2, d=16, di=16, dtype="float32", topk=3)
    p = step_planner(full)
    x = make_inputs(full)

    def part(toks, seq_len, num_context):
        n = toks.stop - toks.start
        plan = p.plan([seq_len], q_lens=[n], num_context=num_context)
        over = dict(q=x["q"][toks], idx_q=x["idx_q"][toks], seq_lens=torch.tensor([seq_len], dtype=torch.int32))
        return run_step(target, full, plan, sparse=True, over=over)

    chunk_out, chunk_ids = part(slice(0, 20), 620, num_context=1)   # prefill chunk
    dec_out, dec_ids = part(slice(20, 23), 623, num_context=0)      # generation, n = 3
    full_out, full_ids = part(slice(0, 23), 623, num_context=1)     # one longer prefill
    assert torch.equal(torch.cat([chunk_ids, dec_ids], 1), full_ids)
    torch.testing.assert_close(torch.cat([chunk_out, dec_out]), full_out, rtol=1e-5, atol=1e-5)
    exp, exp_ids = ref.msa_decode_ref(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                      x["block_table"], x["seq_lens"], [23], full.topk)
    assert torch.equal(full_ids, exp_ids)
    assert rel_err(full_out, exp) < TOLERANCE[full.dtype]


@pytest.mark.parametrize("target", targets(["torch"]))
def test_graph_padded_step_keeps_arena_addresses(target):
    """A pure generation step padded to a graph batch size; the next step reuses the arena's addresses."""
    case = step("graph_pad", (1, 1, 1, 1), (701, 129, 6, 0), num_context=0, hq=4, d=16, di=16, dtype="float32",
                topk=3)
    p = step_planner(case, graph_batch_sizes=(2, 4))
    plan = p.plan([701, 129, 6], q_lens=[1, 1, 1], num_context=0)
    assert plan.cuda_graph and plan.num_rows == 4 and plan.generation.num_padding_rows == 1
    x = make_inputs(case, target.torch_device)
    args = (x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"], x["block_table"])
    out, ids = m3_torch.msa_attention_step(*args, x["seq_lens"], plan=plan)
    assert (out[3] == 0).all() and (ids[:, 3] == -1).all()
    exp, exp_ids = ref.msa_decode_ref(*(make_inputs(case)[k] for k in ("q", "idx_q", "k_cache", "v_cache",
                                                                       "index_k_cache", "block_table", "seq_lens")),
                                      [1] * 4, case.topk)
    assert torch.equal(ids.cpu(), exp_ids) and rel_err(out, exp) < TOLERANCE[case.dtype]
    ptr = ids.data_ptr()
    plan2 = p.plan([650, 5, 6], q_lens=[1, 1, 1], num_context=0)
    seq_lens = torch.tensor([650, 5, 6, 0], dtype=torch.int32, device=target.torch_device)
    _, ids2 = m3_torch.msa_attention_step(*args, seq_lens, plan=plan2)
    assert ids2.data_ptr() == ptr


@pytest.mark.parametrize("target", targets(["jax"]))
def test_jax_step_under_jit_compiles_once(target):
    """StepSpec static, context maps traced: two batches of the same shapes compile once, both
    bit-identical to torch."""
    traces = []

    def fn(q, idx_q, k, v, index_k, block_table, seq_lens, maps, spec):
        traces.append(1)
        return m3_jax.msa_attention_step(q, idx_q, k, v, index_k, block_table, seq_lens, plan=spec, maps=maps)

    jitted = jax.jit(fn, static_argnames="spec")
    other = dataclasses.replace(STEP_CASES[0], name="mixed_n2_b", q_lens=(17, 8, 2, 2, 2, 2),
                                seq_lens=(167, 1008, 302, 3, 7, 0))
    specs = set()
    for case in (STEP_CASES[0], other):
        plan = plan_of(case)
        spec, maps = m3_jax.step_inputs(plan)
        specs.add(spec)
        with target.active():
            j = jax_inputs(case, target.device)
            out, ids = jitted(j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"], j["block_table"],
                              j["seq_lens"], maps, spec=spec)
        want_out, want_ids = planned_step(target.twin, case, True)
        assert_same_bits(to_torch(out), want_out)
        assert_same_bits(to_torch(ids), want_ids)
    assert len(specs) == 1 and len(traces) == 1


@pytest.mark.gpu
def test_cuda_graph_generation_step_replays_like_eager():
    """A pure generation step (M3 shapes) captured once replays the next step's lengths and values
    (same buffers, same arena addresses) and equals an eager run bit for bit."""
    case = step("m3_graph", (1,) * 8, (701, 129, 6, 3001, 1001, 65, 0, 0), num_context=0, hq=64, hk=4, d=128,
                di=128, topk=16, gpu_only=True)
    x = {k: v.clone() for k, v in make_inputs(case, "cuda").items()}  # refilled below
    p = step_planner(case, graph_batch_sizes=(4, 8))
    plan = p.plan(case.seq_lens[:6], q_lens=[1] * 6, num_context=0)
    assert plan.cuda_graph and plan.num_rows == 8
    out = torch.empty_like(x["q"])
    args = lambda: (x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"], x["block_table"],
                    x["seq_lens"])

    m3_torch.msa_attention_step(*args(), plan=plan, out=out)  # warm-up: compiles, allocates the arena
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, ids = m3_torch.msa_attention_step(*args(), plan=plan, out=out)
    lens = [650, 200, 100, 2900, 1024, 120]
    plan2 = p.plan(lens, q_lens=[1] * 6, num_context=0)
    assert plan2.generation == dataclasses.replace(plan.generation, max_kv_len=2900)  # same launches
    g = torch.Generator().manual_seed(34)
    x["q"].copy_(torch.randn(x["q"].shape, generator=g))
    x["idx_q"].copy_(torch.randn(x["idx_q"].shape, generator=g))
    x["seq_lens"].copy_(torch.tensor(lens + [0, 0], dtype=torch.int32))
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    replayed, replayed_ids = out.clone(), ids.clone()
    eager, eager_ids = m3_torch.msa_attention_step(*args(), plan=plan2)
    assert torch.equal(replayed_ids, eager_ids)
    assert torch.equal(replayed, eager)
    exp = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], [1] * 8,
                            eager_ids.cpu())
    assert rel_err(replayed, exp) < TOLERANCE["bfloat16"]
    assert (replayed[-2:] == 0).all()
