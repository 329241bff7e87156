"""msa_decode / msa_prefill (index -> select -> sparse attention in one call) vs the float64
references; JAX bit-identical to torch; plans, workspaces, jit and CUDA graphs."""

import dataclasses
import math
import os
import subprocess
import sys

import jax
import pytest
import torch

import m3_jax
import m3_torch
from m3_kernels import maps, planner, tuning
from m3_torch import reference as ref

from cases import ALL_CASES, ONE_SPLIT_CASES, TOLERANCE, decode, make_inputs, prefill, random_block_ids, rel_err
from targets import (assert_same_bits, attention_reference, check_attention, check_empty_ids, check_twin, grid,
                     jax_gpu_ready, jax_inputs, kv_scales, run, selected_blocks, targets, to_jax, to_torch)


@pytest.mark.parametrize("case, target", grid(ALL_CASES + ONE_SPLIT_CASES))
def test_msa(case, target):
    out, ids = run(target, "msa", case)
    # the selection is the reference selection of the float64 scores (random data: no near-ties at the
    # interpreter's sizes); at 16k contexts, of the kernel's own float32 scores
    if target.device == "interpreter":
        expected_ids = selected_blocks(case)
    else:
        expected_ids = ref.select_blocks_ref(run(target, "index_scores", case), make_inputs(case)["seq_lens"],
                                             case.q_lens, case.topk, case.init_blocks, case.local_blocks)
    assert torch.equal(ids, expected_ids)
    check_empty_ids(case, ids)
    check_attention(case, out, attention_reference(case, ids))
    check_twin(target, "msa", case)


@pytest.mark.parametrize("case, target", grid(ONE_SPLIT_CASES))
def test_msa_selects_inside_the_attention_launch_when_it_has_one_split(case, target, monkeypatch):
    """launches.Selection: when the MSA op's attention launch has one-token tiles and one split, that
    launch chooses the blocks (the attention kernel's SELECT variant writes block_ids) and no
    select_blocks launch runs; with several splits select_blocks runs first. Both choose the same
    ids (and test_msa checks both against the references)."""
    launched = []

    def spy(real):
        def run_and_record(launch, *args):
            chain = launch
            while chain is not None:
                launched.append((chain.kernel.split(".")[1], chain.constexprs.get("SELECT")))
                chain = chain.then
            return real(launch, *args)
        return run_and_record

    monkeypatch.setattr(m3_torch.ops, "run", spy(m3_torch.ops.run))
    monkeypatch.setattr(m3_jax.api, "run", spy(m3_jax.api.run))
    ids = {}
    for splits, programs in (("one", 1), ("several", 1 << 12)):
        launched.clear()
        with tuning.override(sparse_target_programs=programs):
            _, ids[splits] = run.__wrapped__(target, "msa", dataclasses.replace(case, one_program=False))
        attention = [select for kernel, select in launched if kernel == "paged_attention_kernel"]
        if splits == "one":
            assert attention == [True] and "select_blocks_kernel" not in dict(launched), launched
        else:
            assert attention == [False] and "select_blocks_kernel" in dict(launched), launched
            assert "merge_splits_kernel" in dict(launched), launched
    assert torch.equal(ids["one"], ids["several"])


@pytest.mark.parametrize("target", targets())
def test_selection_inside_attention_equals_select_blocks_then_sparse_attention(target):
    """The attention kernel's SELECT variant (one split) on rows of 1500 blocks (select_rows' two-level
    top-k) with random scores: the same ids as select_blocks and the same output, bit for bit, as
    sparse_decode over them with one split; ids written through a transposed view (torch)."""
    g = torch.Generator().manual_seed(1500)
    hq, hk, d, max_blocks, topk, pages = 4, 2, 16, 1500, 16, 1600
    seq_lens = torch.tensor([max_blocks * 128, 40 * 128 + 3, 1, 0], dtype=torch.int32)
    q = torch.randn(4, hq, d, generator=g).bfloat16()
    k, v = (torch.randn(pages, hk, 128, d, generator=g).bfloat16() for _ in range(2))
    table = torch.randint(0, pages, (4, max_blocks), generator=g, dtype=torch.int32)
    scores = torch.randn(hk, 4, max_blocks, generator=g)
    scores[1, 0, 100:140] = 3.0   # a tie spread over three chunks
    sel = dict(topk=topk, init_blocks=1, local_blocks=1)
    with target.active(), tuning.override(sparse_target_programs=1):
        if target.framework == "torch":
            dev = target.torch_device
            q, k, v, table, seq_lens, scores = (x.to(dev) for x in (q, k, v, table, seq_lens, scores))
            ids = m3_torch.select_blocks(scores, seq_lens, decode_query_len=1, **sel)
            want = m3_torch.sparse_decode(q, k, v, ids, table, seq_lens, decode_query_len=1)
            out = torch.full_like(q, math.nan)
            chosen = torch.full((4, hk, topk), -7, dtype=torch.int32, device=dev).transpose(0, 1)
            tile_map, token_map = m3_torch.ops.decode_maps(dev, 4, 1, 1)
            m3_torch.ops.paged_attention(q, k, v, None, table, seq_lens, tile_map, out, None, None, 1, d ** -0.5,
                                         None, None, scores, token_map, [topk, 1, 1], chosen)
            ids, out, chosen, want = (x.cpu() for x in (ids, out, chosen, want))
        else:
            j = [to_jax(x) for x in (q, k, v, table, seq_lens, scores)]
            ids = to_torch(m3_jax.select_blocks(j[5], j[4], decode_query_len=1, **sel))
            want = to_torch(m3_jax.sparse_decode(*j[:3], to_jax(ids), j[3], j[4], decode_query_len=1))
            tile_map, token_map = m3_jax.ops.decode_maps(4, 1, 1)
            got = m3_jax.api._select_and_attend(j[0], *(m3_jax.api.as_kv_view(x, "HND", "kv") for x in j[1:3]),
                                                j[5], j[3], j[4], token_map, maps.row_tile(hq // hk, 1), tile_map,
                                                d ** -0.5, (None, None), topk, 1, 1)
            out, chosen = (to_torch(x) for x in got)
    assert torch.equal(chosen, ids) and (ids[:, :2] >= 0).all() and (ids[:, 3] == -1).all()
    assert_same_bits(out, want)


def test_torch_ops_trace_under_torch_compile():
    """The torch.ops.m3 schemas and fakes (m3_torch.ops.define): torch.compile (aot_eager, one graph) traces
    msa_decode's two ops, selection inside the attention launch, and gives the eager bits (without a fake
    the trace fails)."""
    g = torch.Generator().manual_seed(7)
    hq, hk, d, max_blocks, pages = 4, 2, 16, 20, 24
    seq_lens = torch.tensor([20 * 128, 300, 1], dtype=torch.int32)
    q = torch.randn(3, hq, d, generator=g).bfloat16()
    idx_q = torch.randn(3, hk, d, generator=g).bfloat16()
    k, v = (torch.randn(pages, hk, 128, d, generator=g).bfloat16() for _ in range(2))
    index_k = torch.randn(pages, 128, d, generator=g).bfloat16()
    table = torch.randperm(pages, generator=g)[:max_blocks].repeat(3, 1).to(torch.int32)
    index_tile = maps.index_tile(hk, 1)
    index_map, token_map = m3_torch.ops.decode_maps("cpu", 3, 1, index_tile.tokens_per_tile)
    tile_map, _ = m3_torch.ops.decode_maps("cpu", 3, 1, 1)

    def step(q, idx_q, k, v, index_k, table, seq_lens):
        scores = torch.full((hk, 3, max_blocks), math.nan)
        ids = torch.full((hk, 3, 4), -7, dtype=torch.int32)
        out = torch.full_like(q, math.nan)
        torch.ops.m3.index_scores(idx_q, index_k, table, seq_lens, index_map, scores, index_tile.tokens_per_tile)
        torch.ops.m3.paged_attention(q, k, v, None, table, seq_lens, tile_map, out, None, None, 1, d ** -0.5,
                                     None, None, scores, token_map, [4, 0, 1], ids)
        return out, ids

    args = (q, idx_q, k, v, index_k, table, seq_lens)
    with tuning.override(sparse_target_programs=1):   # one split: selection inside the attention launch
        want_out, want_ids = step(*args)
        torch._dynamo.reset()
        got_out, got_ids = torch.compile(step, backend="aot_eager", fullgraph=True)(*args)
    assert (want_ids[:, 0] >= 0).all() and (want_ids[:, 2, 1:] == -1).all() and not want_out.isnan().any()
    assert torch.equal(got_ids, want_ids)
    assert_same_bits(got_out, want_out)


def _msa_args(j):
    return (j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"], j["block_table"], j["seq_lens"])


POOL_DECODE = [c for c in ALL_CASES if c.kv_layout == "pool" and c.decode]


@pytest.mark.parametrize("case, target", grid(POOL_DECODE, ["jax"]))
def test_jax_pool_views_under_jit(case, target):
    """PagedViews into one flat pool (offsets, HND K, NHD V) pass through jit as the buffer alone."""
    kw = dict(decode_query_len=case.n, topk=case.topk, init_blocks=case.init_blocks, local_blocks=case.local_blocks)
    with target.active(case):
        j = jax_inputs(case, target.device)
        assert jax.tree_util.tree_leaves(j["k_cache"]) == [j["k_cache"].buffer]
        msa = jax.jit(m3_jax.msa_decode, static_argnames=tuple(kw) + ("sm_scale", "kv_layout"))
        out, ids = msa(*_msa_args(j), **kw, **kv_scales(case, "jax"))
    for got, want in zip((out, ids), run(target.twin, "msa", case)):
        assert_same_bits(to_torch(got), want)


@pytest.mark.parametrize("target", targets(["jax"]))
def test_jax_jit_does_not_recompile_on_new_values(target):
    """New seq_lens / block_table / q values under one jit: one trace, results still correct."""
    traces = []

    def step(q, idx_q, k, v, index_k, block_table, seq_lens):
        traces.append(1)  # runs once per trace
        out, ids = m3_jax.msa_decode(q, idx_q, k, v, index_k, block_table, seq_lens, decode_query_len=2, topk=2)
        dense = m3_jax.dense_decode(q, k, v, block_table, seq_lens, decode_query_len=2, sm_scale=0.5)
        return out, ids, dense

    jitted = jax.jit(step)
    case = decode("jit", (384, 384), n=2, hq=4, hk=2, topk=2)   # 3 pages per request + a garbage column
    for i, lens in enumerate(((260, 7), (0, 129), (131, 256))):
        x = dict(make_inputs(case), seq_lens=torch.tensor(lens, dtype=torch.int32))
        x["block_table"] = x["block_table"].clone()
        for r, s in enumerate(lens):   # new garbage past each request's blocks
            x["block_table"][r, -(-s // 128):] = -1 if i % 2 else 2**30
        with target.active():
            out, ids, dense = jitted(*(to_jax(x[k]) for k in ("q", "idx_q", "k_cache", "v_cache", "index_k_cache",
                                                             "block_table", "seq_lens")))
        table = (x["block_table"], x["seq_lens"])
        scores = ref.index_scores_ref(x["idx_q"], x["index_k_cache"], *table, case.q_lens)
        expected_ids = ref.select_blocks_ref(scores, x["seq_lens"], case.q_lens, 2)
        assert torch.equal(to_torch(ids), expected_ids)
        expected = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], *table, case.q_lens, expected_ids)
        assert rel_err(to_torch(out), expected) < TOLERANCE["bfloat16"]
        expected = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], *table, case.q_lens, sm_scale=0.5)
        assert rel_err(to_torch(dense), expected) < TOLERANCE["bfloat16"]
    assert len(traces) == 1
    assert jitted._cache_size() == 1


@pytest.mark.parametrize("target", targets(["jax"]))
def test_jax_prefill_under_jit_with_traced_maps(target):
    """PrefillMaps are pytree leaves: a new batch with the same padded shapes does not retrace."""
    traces = []

    @jax.jit
    def run_jit(q, k, v, ids, block_table, seq_lens, maps):
        traces.append(1)
        return m3_jax.sparse_prefill(q, k, v, ids, block_table, seq_lens, plan=maps)

    for q_lens, seq_lens in (((9, 3), (149, 3)), ((10, 2), (10, 143))):
        case = prefill(f"jit_{q_lens}", q_lens, seq_lens, hq=2, d=16, di=16, dtype="float32", topk=2)
        maps = m3_jax.prefill_maps(planner.prefill_plan(case.cu_seqlens), heads=(case.hq // case.hk,))
        with target.active():
            j = jax_inputs(case, target.device)
            got = run_jit(j["q"], j["k_cache"], j["v_cache"], to_jax(random_block_ids(case)), j["block_table"],
                          j["seq_lens"], maps)
        assert_same_bits(to_torch(got), run(target.twin, "sparse", case))
    assert len(traces) == 1


@pytest.mark.parametrize("target", targets())
def test_prefill_plan_replaces_cu_seqlens(target):
    """With plan=, cu_seqlens_q is never read (None, or a meta tensor in torch, works)."""
    case = prefill("plan_reuse", (3, 2), (5, 130), hq=2, d=16, di=16, dtype="float32")
    plan = planner.prefill_plan(case.cu_seqlens)
    want_out, want_ids = run(target, "msa", case)
    kw = dict(topk=case.topk, plan=plan)
    with target.active():
        if target.framework == "torch":
            x = make_inputs(case, target.torch_device)
            for cu in (None, x["cu_seqlens_q"].to("meta")):
                out, ids = m3_torch.msa_prefill(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                                x["block_table"], x["seq_lens"], cu_seqlens_q=cu, **kw)
                assert_same_bits(out.cpu(), want_out)
                assert_same_bits(ids.cpu(), want_ids)
        else:
            out, ids = m3_jax.msa_prefill(*_msa_args(jax_inputs(case, target.device)), cu_seqlens_q=None, **kw)
            assert_same_bits(to_torch(out), want_out)
            assert_same_bits(to_torch(ids), want_ids)


@pytest.mark.gpu
@pytest.mark.parametrize("n, batch, hq, hk", [(2, 4, 64, 4), (8, 128, 8, 1)])   # M3; a TP8 rank
def test_cuda_graph_capture_after_jax_ran(n, batch, hq, hk):
    """A regression: captures of our steps failed (cudaErrorStreamCaptureInvalidated) in processes that had run
    JAX, at these shapes with 1k contexts. JAX runs our kernels on the GPU first (its runtime threads stay
    alive), then msa_decode is captured as the engine captures (capture_error_mode="thread_local") and
    replays new lengths like an eager call."""
    if not jax_gpu_ready():
        pytest.skip("needs JAX on the GPU with jax_triton")
    case = decode("graph_after_jax", (1000,) * batch, n=n, hq=hq, hk=hk, d=128, di=128, topk=16, gpu_only=True)
    x = {k: v.clone() for k, v in make_inputs(case, "cuda").items()}
    jax_out, _ = m3_jax.msa_decode(*_msa_args(jax_inputs(case, "gpu")), decode_query_len=n, topk=16)
    jax_out.block_until_ready()
    out = torch.empty_like(x["q"])

    def msa():
        return m3_torch.msa_decode(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                   x["block_table"], x["seq_lens"], decode_query_len=n, topk=16, out=out)

    msa()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        msa()
    x["seq_lens"].copy_(torch.randint(1, 1001, (batch,), dtype=torch.int32))
    x["q"].copy_(torch.randn_like(x["q"]))
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    eager, _ = m3_torch.msa_decode(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                   x["block_table"], x["seq_lens"], decode_query_len=n, topk=16)
    assert not torch.isnan(replayed).any()
    assert torch.equal(replayed, eager)


COMMAND_BUFFER_PROBE = """
import sys
sys.path.insert(0, "tests/helpers")
import jax
import m3_jax
from m3_jax import _triton_call
from cases import decode
from targets import jax_inputs
_triton_call.LAUNCH_TARGET = "triton_kernel_call_ffi"
case = decode("command_buffers", (3000, 1, 129, 0), hq=16, hk=2, d=128, di=128, topk=16, gpu_only=True)
j = jax_inputs(case, "gpu")
q, *rest = (j[k] for k in ("q", "idx_q", "k_cache", "v_cache", "index_k_cache", "block_table", "seq_lens"))
step = jax.jit(lambda q, *rest: [m3_jax.msa_decode(s * q, *rest, decode_query_len=1, topk=16)[0] for s in (1, -1)])
jax.block_until_ready(step(q, *rest))
"""


@pytest.mark.gpu
def test_jax_ffi_launch_runs_inside_xla_command_buffers(monkeypatch):
    """The measured alternative launch path (``m3_jax._triton_call.LAUNCH_TARGET``): the JAX
    kernels lowered to jaxlib's command-buffer-compatible FFI custom call (``triton_kernel_call_ffi``)
    are recorded by XLA into a command buffer (a CUDA graph) instead of being launched one by one from
    the host: a child process jits two msa_decode calls with XLA's command-buffer pass logging, and the
    buffer it creates lists the kernel calls. The outputs equal torch's bit for bit, also on a second
    call with new inputs (new buffers: XLA updates the commands)."""
    if not jax_gpu_ready():
        pytest.skip("needs JAX on the GPU with jax_triton")
    from m3_jax import _triton_call
    monkeypatch.setattr(_triton_call, "LAUNCH_TARGET", "triton_kernel_call_ffi")
    case = decode("command_buffers", (3000, 1, 129, 0), hq=16, hk=2, d=128, di=128, topk=16, gpu_only=True)
    x = make_inputs(case, "cuda")
    j = _msa_args(jax_inputs(case, "gpu"))
    step = jax.jit(lambda q, *rest: (m3_jax.msa_decode(q, *rest, decode_query_len=1, topk=16)[0],
                                     m3_jax.msa_decode(-q, *rest, decode_query_len=1, topk=16)[0]))
    hlo = step.lower(*j).compile().as_text()
    kernels = hlo.count('custom_call_target="triton_kernel_call_ffi"')
    assert kernels >= 6                                  # 2 x (index, select, attention[, merge])
    assert 'custom_call_target="triton_kernel_call"' not in hlo
    for q in (x["q"], torch.randn_like(x["q"])):
        outs = step(to_jax(q), *j[1:])
        for got, sign in zip(outs, (1, -1)):
            want, _ = m3_torch.msa_decode(sign * q, x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                          x["block_table"], x["seq_lens"], decode_query_len=1, topk=16)
            assert_same_bits(to_torch(got), want.cpu())
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="command_buffer_conversion_pass=3")
    probe = subprocess.run([sys.executable, "-c", COMMAND_BUFFER_PROBE], env=env, capture_output=True, text=True,
                           timeout=240, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert probe.returncode == 0, probe.stderr[-3000:]
    created = [line for line in probe.stderr.splitlines() if "Creating command buffer thunk" in line]
    assert sum(line.count("m3_triton_kernel_call") for line in created) == kernels, probe.stderr[-3000:]


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager():
    """msa_decode captured once (M3 shapes, n = 2) replays new lengths and values like an eager call."""
    n = 2
    case = decode("graph", (4000, 4000, 4000, 4000), n=n, hq=64, hk=4, d=128, di=128, topk=16, gpu_only=True)
    x = {k: v.clone() for k, v in make_inputs(case, "cuda").items()}  # refilled below: not the memoized ones
    out = torch.empty_like(x["q"])

    def msa():
        return m3_torch.msa_decode(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                   x["block_table"], x["seq_lens"], decode_query_len=n, topk=16, out=out)

    msa()  # warm-up: compiles the kernels, creates workspaces and maps
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, graph_ids = msa()
    for lens in ([4000, 1, 129, 128], [0, 3999, 2, 257], [0, 0, 0, 0]):
        x["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        x["q"].copy_(torch.randn_like(x["q"]))
        x["idx_q"].copy_(torch.randn_like(x["idx_q"]))
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        replayed, replayed_ids = out.clone(), graph_ids.clone()
        eager_out, eager_ids = m3_torch.msa_decode(x["q"], x["idx_q"], x["k_cache"], x["v_cache"],
                                                   x["index_k_cache"], x["block_table"], x["seq_lens"],
                                                   decode_query_len=n, topk=16)
        assert not torch.isnan(replayed).any()
        assert torch.equal(replayed_ids, eager_ids)
        assert torch.equal(replayed, eager_out)
        if lens == [0, 0, 0, 0]:
            assert (replayed == 0).all() and (replayed_ids == -1).all()
