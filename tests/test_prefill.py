"""m3_torch prefill ops and mixed steps vs the float64 references (CPU: Triton interpreter).

CPU budget: the interpreter runs one Python pass per program, and the default
geometry aims at ~1024 programs per launch (GPU occupancy). Cases marked
``few_programs`` run with ``geometry.TARGET_PROGRAMS`` and
``SPARSE_TARGET_PROGRAMS`` set to 1 (one program per row tile, no split-K);
the others, and every step test, keep the default geometry, so split-K +
merge is covered at small token counts.
"""

import dataclasses
import math

import pytest
import torch

import m3_torch
from m3_kernels import geometry, planner
from m3_torch import reference as ref

from cases import TOLERANCE, rel_err
from prefill_cases import GQA, MSA_CASES, PREFILL_CASES, PrefillCase, make_prefill_inputs, random_block_ids


@pytest.fixture
def geometry_for(monkeypatch):
    def apply(case):
        if case.few_programs:
            monkeypatch.setattr(geometry, "TARGET_PROGRAMS", 1)
            monkeypatch.setattr(geometry, "SPARSE_TARGET_PROGRAMS", 1)
    return apply


def nan_like(x, shape=None, dtype=None):
    return torch.full(shape or x.shape, math.nan, dtype=dtype or x.dtype, device=x.device)


def check_scores(scores, expected):
    assert not torch.isnan(scores).any()
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(scores.cpu()), finite), "-inf pattern differs from the reference"
    assert (scores.cpu()[~finite] == -math.inf).all()
    torch.testing.assert_close(scores.cpu()[finite].double(), expected[finite], rtol=1e-4, atol=1e-4)


def check_padding(case, out, ids=None):
    """Tokens that see nothing (kv_len 0) get zeros and all -1 ids."""
    t = 0
    for q_len, s in zip(case.q_lens, case.seq_lens):
        for j in range(q_len):
            if s - q_len + j + 1 <= 0:
                assert (out[t] == 0).all()
                if ids is not None:
                    assert (ids[:, t] == -1).all()
            t += 1


# -- each op vs its reference ------------------------------------------------------------

@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_index_scores_prefill(case, geometry_for):
    geometry_for(case)
    x = make_prefill_inputs(case, seed=11)
    T, max_blocks = case.num_tokens, x["block_table"].shape[1]
    out = torch.full((case.hk, max_blocks, T), math.nan).transpose(1, 2)  # a strided view
    got = m3_torch.index_scores_prefill(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"],
                                        cu_seqlens_q=x["cu_seqlens_q"], out=out)
    assert got is out
    check_scores(out, ref.index_scores_ref(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"],
                                           case.q_lens))


@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_select_blocks_prefill(case):
    x = make_prefill_inputs(case, seed=12)
    scores = torch.randn(case.hk, case.num_tokens, x["block_table"].shape[1])  # random floats: no ties
    out = torch.full((case.hk, case.num_tokens, case.topk), 12345, dtype=torch.int32)
    m3_torch.select_blocks_prefill(scores, x["seq_lens"], cu_seqlens_q=x["cu_seqlens_q"], topk=case.topk,
                                   init_blocks=case.init_blocks, local_blocks=case.local_blocks, out=out)
    expected = ref.select_blocks_ref(scores, x["seq_lens"], case.q_lens, case.topk, case.init_blocks,
                                     case.local_blocks)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_sparse_prefill(case, geometry_for):
    geometry_for(case)
    x = make_prefill_inputs(case, seed=13)
    ids = random_block_ids(case.hk, case.topk, case.seq_lens, case.q_lens, seed=13)
    out = nan_like(x["q"])
    m3_torch.sparse_prefill(x["q"], x["k_cache"], x["v_cache"], ids, x["block_table"], x["seq_lens"],
                            cu_seqlens_q=x["cu_seqlens_q"], out=out)
    expected = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], case.q_lens,
                                 ids)
    assert rel_err(out, expected) < TOLERANCE[case.dtype]
    check_padding(case, out)


@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_dense_prefill(case, geometry_for):
    geometry_for(case)
    x = make_prefill_inputs(case, seed=14)
    out = nan_like(x["q"])
    m3_torch.dense_prefill(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                           cu_seqlens_q=x["cu_seqlens_q"], sm_scale=0.3, out=out)
    expected = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], case.q_lens,
                                 sm_scale=0.3)
    assert rel_err(out, expected) < TOLERANCE[case.dtype]
    check_padding(case, out)


@pytest.mark.parametrize("case", MSA_CASES, ids=str)
def test_msa_prefill(case):
    x = make_prefill_inputs(case, seed=15)
    out = nan_like(x["q"])
    got, ids = m3_torch.msa_prefill(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                    x["block_table"], x["seq_lens"], cu_seqlens_q=x["cu_seqlens_q"],
                                    topk=case.topk, init_blocks=case.init_blocks, local_blocks=case.local_blocks,
                                    out=out)
    assert got is out
    expected, expected_ids = ref.msa_decode_ref(x["q"], x["idx_q"], x["k_cache"], x["v_cache"],
                                                x["index_k_cache"], x["block_table"], x["seq_lens"], case.q_lens,
                                                case.topk, case.init_blocks, case.local_blocks)
    assert torch.equal(ids, expected_ids)
    assert rel_err(out, expected) < TOLERANCE[case.dtype]
    check_padding(case, out, ids)


def test_plan_reuse_reads_no_cu_seqlens():
    """With plan=, cu_seqlens_q is never read (a meta tensor, or None, works)."""
    case = PrefillCase("tiny", (3, 2), (5, 130))
    x = make_prefill_inputs(case, seed=16)
    plan = m3_torch.prefill.prefill_plan(x["cu_seqlens_q"])
    ids = random_block_ids(case.hk, case.topk, case.seq_lens, case.q_lens, seed=16)
    a = m3_torch.sparse_prefill(x["q"], x["k_cache"], x["v_cache"], ids, x["block_table"], x["seq_lens"],
                                cu_seqlens_q=x["cu_seqlens_q"].to("meta"), plan=plan)
    b = m3_torch.sparse_prefill(x["q"], x["k_cache"], x["v_cache"], ids, x["block_table"], x["seq_lens"],
                                cu_seqlens_q=None, plan=plan)
    assert torch.equal(a, b)
    assert any(k[0] == "torch" for k in plan._cache)  # device maps cached on the plan


@pytest.mark.parametrize("over, exc, words", [
    (lambda x: dict(cu_seqlens_q=x["cu_seqlens_q"].long()), TypeError, "cu_seqlens_q"),
    (lambda x: dict(cu_seqlens_q=x["cu_seqlens_q"][:-1]), ValueError, "cu_seqlens_q"),
    (lambda x: dict(cu_seqlens_q=x["cu_seqlens_q"] + 1), ValueError, "starting at 0"),
    (lambda x: dict(q=x["q"][:-1], ids=x["ids"][:, :-1]), ValueError, "cu_seqlens_q"),
    (lambda x: dict(cu_seqlens_q=None), ValueError, "cu_seqlens_q"),
    (lambda x: dict(plan=planner.prefill_plan([0, 5])), ValueError, "plan"),
])
def test_prefill_errors(over, exc, words):
    case = GQA
    x = make_prefill_inputs(case, seed=17)
    x["ids"] = random_block_ids(case.hk, case.topk, case.seq_lens, case.q_lens, seed=17)
    a = {**x, "plan": None, **over(x)}
    with pytest.raises(exc, match=words):
        m3_torch.sparse_prefill(a["q"], a["k_cache"], a["v_cache"], a["ids"], a["block_table"], a["seq_lens"],
                                cu_seqlens_q=a["cu_seqlens_q"], plan=a["plan"])


# -- mixed steps ---------------------------------------------------------------------------

# context rows first (a 1000-token prefix among them), generation rows (n = 2) last, one padding row
# (the last row is made a padding row by setting its seq_len to 0)
STEP = PrefillCase("step", q_lens=(20, 5, 2, 2, 2, 2), prefixes=(200, 1000, 298, 127, 0, 0), topk=3)
STEP_CONTEXT = 2


def step_planner(case, table_width, **over):
    cfg = planner.StepConfig(num_q_heads=case.hq, num_kv_heads=case.hk, head_dim=case.d,
                             max_batch=8, max_num_tokens=64, max_blocks=table_width, topk=case.topk, **over)
    return planner.StepPlanner(cfg)


def run_step(x, plan, sparse, **kw):
    return m3_torch.msa_attention_step(x["q"], x["idx_q"] if sparse else None, x["k_cache"], x["v_cache"],
                                       x["index_k_cache"] if sparse else None, x["block_table"], x["seq_lens"],
                                       plan=plan, sparse=sparse, out=nan_like(x["q"]), **kw)


def alone(x, case, r, sparse, num_context):
    """Request r run by itself through the public prefill (context) or decode (generation) ops."""
    t0 = sum(case.q_lens[:r])
    toks = slice(t0, t0 + case.q_lens[r])
    rows = slice(r, r + 1)
    args = (x["q"][toks], x["k_cache"], x["v_cache"])
    meta = (x["block_table"][rows], x["seq_lens"][rows])
    if r < num_context:
        cu = torch.tensor([0, case.q_lens[r]], dtype=torch.int32)
        if sparse:
            return m3_torch.msa_prefill(args[0], x["idx_q"][toks], *args[1:], x["index_k_cache"], *meta,
                                        cu_seqlens_q=cu, topk=case.topk)
        return m3_torch.dense_prefill(*args, *meta, cu_seqlens_q=cu), None
    n = case.q_lens[r]
    if sparse:
        return m3_torch.msa_decode(args[0], x["idx_q"][toks], *args[1:], x["index_k_cache"], *meta,
                                   decode_query_len=n, topk=case.topk)
    return m3_torch.dense_decode(*args, *meta, decode_query_len=n), None


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_mixed_step_equals_each_request_alone(sparse):
    case = STEP
    x = make_prefill_inputs(case, seed=21)
    x["seq_lens"][-1] = 0  # padding row
    seq_lens = x["seq_lens"].tolist()
    plan = step_planner(case, x["block_table"].shape[1]).plan(seq_lens, q_lens=case.q_lens, num_context=STEP_CONTEXT)
    assert plan.generation.max_blocks == 4 and plan.context.max_blocks == 8  # own bounds per span
    out, ids = run_step(x, plan, sparse)
    assert (ids is None) != sparse
    q_lens = list(case.q_lens)
    t0 = 0
    for r, q_len in enumerate(q_lens):
        toks = slice(t0, t0 + q_len)
        want, want_ids = alone(x, case, r, sparse, STEP_CONTEXT)
        torch.testing.assert_close(out[toks], want, rtol=1e-5, atol=1e-5)
        if sparse:
            assert torch.equal(ids[:, toks], want_ids)
        t0 += q_len
    assert (out[-2:] == 0).all()
    # and the whole step against the float64 reference
    if sparse:
        exp, exp_ids = ref.msa_decode_ref(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                          x["block_table"], x["seq_lens"], q_lens, case.topk)
        assert torch.equal(ids, exp_ids)
    else:
        exp = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], q_lens)
    assert rel_err(out, exp) < TOLERANCE[case.dtype]


def test_prefill_then_decode_equals_one_longer_prefill():
    """Position rule across the chunk boundary: a 20-token chunk (prefix 600) then an MTP decode
    of 3 tokens gives what one 23-token chunk gives, through the step planner both ways."""
    case = PrefillCase("boundary", q_lens=(23,), prefixes=(600,), topk=3)
    x = make_prefill_inputs(case, seed=22)   # the cache already holds all 623 tokens
    p = step_planner(case, x["block_table"].shape[1])

    def step(toks, seq_len, num_context):
        y = dict(x, q=x["q"][toks], idx_q=x["idx_q"][toks], seq_lens=torch.tensor([seq_len], dtype=torch.int32))
        n = toks.stop - toks.start
        plan = p.plan([seq_len], q_lens=[n], num_context=num_context)
        out, ids = run_step(y, plan, sparse=True)
        return out, ids.clone()

    chunk_out, chunk_ids = step(slice(0, 20), 620, num_context=1)   # prefill chunk
    dec_out, dec_ids = step(slice(20, 23), 623, num_context=0)      # generation, n = 3
    full_out, full_ids = step(slice(0, 23), 623, num_context=1)     # one longer prefill
    assert torch.equal(torch.cat([chunk_ids, dec_ids], 1), full_ids)
    torch.testing.assert_close(torch.cat([chunk_out, dec_out]), full_out, rtol=1e-5, atol=1e-5)
    exp, exp_ids = ref.msa_decode_ref(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                      x["block_table"], x["seq_lens"], [23], case.topk)
    assert torch.equal(full_ids, exp_ids)
    assert rel_err(full_out, exp) < TOLERANCE[case.dtype]


def test_step_padding_rows_and_stable_arena():
    """A pure generation step padded to a graph batch size; the arena keeps its addresses."""
    case = PrefillCase("graph", q_lens=(1, 1, 1, 1), prefixes=(700, 128, 5, 0), hq=4, topk=3)
    x = make_prefill_inputs(case, seed=23)
    x["seq_lens"][-1] = 0  # the row the planner adds
    p = step_planner(case, x["block_table"].shape[1], graph_batch_sizes=(2, 4))
    plan = p.plan([701, 129, 6], q_lens=[1, 1, 1], num_context=0)
    assert plan.cuda_graph and plan.num_rows == 4 and plan.generation.num_padding_rows == 1
    out, ids = run_step(x, plan, sparse=True)
    assert (out[3] == 0).all() and (ids[:, 3] == -1).all()
    exp, exp_ids = ref.msa_decode_ref(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                      x["block_table"], x["seq_lens"], [1] * 4, case.topk)
    assert torch.equal(ids, exp_ids) and rel_err(out, exp) < TOLERANCE[case.dtype]
    # next step: other lengths, same workspaces
    ptr = ids.data_ptr()
    plan2 = p.plan([650, 5, 6], q_lens=[1, 1, 1], num_context=0)
    y = dict(x, seq_lens=torch.tensor([650, 5, 6, 0], dtype=torch.int32))
    _, ids2 = run_step(y, plan2, sparse=True)
    assert ids2.data_ptr() == ptr
    arena = m3_torch.step.step_arena(plan.layout, "cpu")
    assert arena is m3_torch.step.step_arena(plan2.layout, "cpu")


def test_step_errors():
    case = STEP
    x = make_prefill_inputs(case, seed=24)
    p = step_planner(case, x["block_table"].shape[1])
    plan = p.plan(x["seq_lens"].tolist(), q_lens=case.q_lens, num_context=STEP_CONTEXT)
    with pytest.raises(ValueError, match="rows"):
        run_step(dict(x, block_table=x["block_table"][:-1], seq_lens=x["seq_lens"][:-1]), plan, True)
    with pytest.raises(ValueError, match="tokens"):
        run_step(dict(x, q=x["q"][:-1]), plan, False)
    with pytest.raises(ValueError, match="columns"):
        run_step(dict(x, block_table=x["block_table"][:, :3]), plan, True)
    with pytest.raises(ValueError, match="idx_q"):
        m3_torch.msa_attention_step(x["q"], None, x["k_cache"], x["v_cache"], None, x["block_table"],
                                    x["seq_lens"], plan=plan)
    with pytest.raises(ValueError, match="planned"):
        run_step(dict(x, q=x["q"][:, :1]), plan, False)


# -- GPU, at MiniMax-M3 shapes ----------------------------------------------------------

M3 = dict(hq=64, hk=4, d=128, di=128, topk=16, dtype="bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_prefill_m3_shapes(dtype):
    # (kept moderate: the float64 references gather every token's pages on the host)
    case = PrefillCase("m3", (300, 128, 5, 1, 0, 64), (1000, 1, 200, 0, 0, 3000), **{**M3, "dtype": dtype})
    x = make_prefill_inputs(case, seed=31, device="cuda")
    cu = x["cu_seqlens_q"]
    scores = m3_torch.index_scores_prefill(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"],
                                           cu_seqlens_q=cu,
                                           out=torch.full((4, case.num_tokens, x["block_table"].shape[1]),
                                                          math.nan, device="cuda"))
    exp_scores = ref.index_scores_ref(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"],
                                      case.q_lens)
    finite = torch.isfinite(exp_scores)
    assert torch.equal(torch.isfinite(scores).cpu(), finite)
    torch.testing.assert_close(scores.cpu().double()[finite], exp_scores[finite], rtol=2e-2, atol=2e-2)
    out = nan_like(x["q"])
    got, ids = m3_torch.msa_prefill(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                    x["block_table"], x["seq_lens"], cu_seqlens_q=cu, topk=16, out=out)
    # the selection is exactly the reference selection of the kernel's own scores
    kernel_scores = m3_torch.index_scores_prefill(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"],
                                                  cu_seqlens_q=cu)
    assert torch.equal(ids.cpu(), ref.select_blocks_ref(kernel_scores.cpu(), x["seq_lens"].cpu(), case.q_lens, 16))
    exp = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], case.q_lens,
                            ids.cpu())
    assert rel_err(out, exp) < TOLERANCE[dtype]
    check_padding(case, out, ids)
    dense = m3_torch.dense_prefill(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                   cu_seqlens_q=cu, out=nan_like(x["q"]))
    exp = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], case.q_lens)
    assert rel_err(dense, exp) < TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_gpu_mixed_step_m3_shapes(sparse):
    # two context rows (one long chunk), three generation rows with n = 2, one padding row
    case = PrefillCase("m3_step", (300, 64, 2, 2, 2, 2), (1000, 0, 5000, 127, 1, 0), **M3)
    x = make_prefill_inputs(case, seed=32, device="cuda")
    x["seq_lens"][-1] = 0
    cfg = planner.StepConfig(num_q_heads=64, num_kv_heads=4, head_dim=128, max_batch=16, max_num_tokens=512,
                             max_blocks=x["block_table"].shape[1], topk=16)
    plan = planner.StepPlanner(cfg).plan(x["seq_lens"].tolist(), q_lens=case.q_lens, num_context=2)
    out, ids = run_step(x, plan, sparse)
    t0 = 0
    for r, q_len in enumerate(case.q_lens):
        toks = slice(t0, t0 + q_len)
        want, want_ids = alone(x, case, r, sparse, 2)
        assert rel_err(out[toks], want) < 1e-2
        if sparse:
            assert torch.equal(ids[:, toks], want_ids)
        t0 += q_len
    assert (out[-2:] == 0).all()
    exp = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], list(case.q_lens),
                            ids.cpu() if sparse else None)
    assert rel_err(out, exp) < TOLERANCE["bfloat16"]


@pytest.mark.gpu
def test_gpu_generation_step_cuda_graph_replay():
    """A pure generation step captured once replays for the next step's lengths and values
    (same buffers, same arena addresses) and matches an eager run bit for bit."""
    case = PrefillCase("graph", (1,) * 8, (700, 128, 5, 3000, 1000, 64, 0, 0), **M3)
    x = make_prefill_inputs(case, seed=33, device="cuda")
    x["seq_lens"][-2:] = 0
    cfg = planner.StepConfig(num_q_heads=64, num_kv_heads=4, head_dim=128, max_batch=8, max_num_tokens=64,
                             max_blocks=x["block_table"].shape[1], topk=16, graph_batch_sizes=(4, 8))
    p = planner.StepPlanner(cfg)
    plan = p.plan([701, 129, 6, 3001, 1001, 65], q_lens=[1] * 6, num_context=0)
    assert plan.cuda_graph and plan.num_rows == 8
    out = torch.empty_like(x["q"])

    def step(plan):
        return m3_torch.msa_attention_step(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                           x["block_table"], x["seq_lens"], plan=plan, out=out)

    step(plan)  # warm-up: compiles the kernels, allocates the arena, caches the maps
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, ids = step(plan)
    # next step: new values and lengths in the same buffers, same spans and block bound
    lens = [650, 200, 100, 2900, 1024, 120]
    plan2 = p.plan(lens, q_lens=[1] * 6, num_context=0)
    assert plan2.generation == dataclasses.replace(plan.generation, max_kv_len=2900)
    g = torch.Generator().manual_seed(34)
    x["q"].copy_(torch.randn(x["q"].shape, generator=g))
    x["idx_q"].copy_(torch.randn(x["idx_q"].shape, generator=g))
    x["seq_lens"].copy_(torch.tensor(lens + [0, 0], dtype=torch.int32))
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    replayed, replayed_ids = out.clone(), ids.clone()
    eager, eager_ids = m3_torch.msa_attention_step(x["q"], x["idx_q"], x["k_cache"], x["v_cache"],
                                                   x["index_k_cache"], x["block_table"], x["seq_lens"], plan=plan2)
    assert torch.equal(replayed_ids, eager_ids)
    assert torch.equal(replayed, eager)
    exp = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], [1] * 8,
                            eager_ids.cpu())
    assert rel_err(replayed, exp) < TOLERANCE["bfloat16"]
    assert (replayed[-2:] == 0).all()
