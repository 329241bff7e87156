"""m3_jax decode ops vs the jnp and float64 references, and bit-identical to m3_torch.

On this CPU-only machine both frameworks run the same kernels through Triton's
interpreter (JAX: inside ``jax.pure_callback``); the ``gpu`` tests at the end
repeat the cross-framework checks at MiniMax-M3 shapes on a GPU with jax-triton.
Inputs come from the shared case list (tests/cases.py) as torch tensors and
reach JAX through numpy, so both frameworks see the same bits.
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
from m3_jax import PagedView
from m3_jax import reference as jref
from m3_torch import reference as tref

from cases import CASES, PAGE, TOLERANCE, Case, make_inputs, random_block_ids, rel_err
from jax_helpers import _jax_device, assert_bit_identical, jax_gpu_ready, jax_inputs, to_jax, to_torch  # noqa: F401


def check_scores(scores, expected, tol=1e-4):
    scores = to_torch(scores).double()
    expected = (expected if isinstance(expected, torch.Tensor) else to_torch(expected)).double()
    assert not torch.isnan(scores).any()
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(scores), finite), "-inf pattern differs from the reference"
    assert (scores[~finite] == -math.inf).all()
    torch.testing.assert_close(scores[finite], expected[finite], rtol=tol, atol=tol)


def check_padding_rows(case, out, ids=None):
    out = np.asarray(out.astype(jnp.float32))
    for r, s in enumerate(case.seq_lens):
        if s == 0:
            rows = slice(r * case.n, (r + 1) * case.n)
            assert (out[rows] == 0).all()
            if ids is not None:
                assert (np.asarray(ids)[:, rows] == -1).all()


def check_attention(case, out, jnp_expected, f64_expected):
    """JAX output vs the jnp reference and the float64 torch reference (relative norm, NaN fails)."""
    tol = TOLERANCE[case.dtype]
    got = to_torch(out.astype(jnp.float32))
    assert rel_err(got, to_torch(jnp_expected)) < tol
    assert rel_err(got, f64_expected) < tol
    # the jnp reference itself is float32-exact against float64
    assert rel_err(to_torch(jnp_expected), f64_expected) < 1e-5


# -- ops vs references and vs torch ------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=str)
def test_index_scores(case):
    x = make_inputs(case, seed=11)
    j = jax_inputs(case, x)
    got = m3_jax.index_scores(j["idx_q"], j["index_k_cache"], j["block_table"], j["seq_lens"],
                              decode_query_len=case.n)
    assert got.shape == (case.hk, x["q"].shape[0], x["block_table"].shape[1]) and got.dtype == jnp.float32
    want = m3_torch.index_scores(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"],
                                 decode_query_len=case.n)
    assert_bit_identical(got, want)
    expected = tref.index_scores_ref(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"], case.q_lens)
    check_scores(got, expected)
    check_scores(jref.index_scores_ref(j["idx_q"], j["index_k_cache"], j["block_table"], j["seq_lens"],
                                       case.q_lens), expected)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_select_blocks(case):
    x = make_inputs(case, seed=12)
    T, max_blocks = x["q"].shape[0], x["block_table"].shape[1]
    scores = torch.randn(case.hk, T, max_blocks)  # random floats: no ties
    kw = dict(topk=case.topk, init_blocks=case.init_blocks, local_blocks=case.local_blocks)
    got = m3_jax.select_blocks(to_jax(scores), to_jax(x["seq_lens"]), decode_query_len=case.n, **kw)
    assert got.shape == (case.hk, T, case.topk) and got.dtype == jnp.int32
    want = m3_torch.select_blocks(scores, x["seq_lens"], decode_query_len=case.n, **kw)
    assert_bit_identical(got, want)
    expected = tref.select_blocks_ref(scores, x["seq_lens"], case.q_lens, case.topk, case.init_blocks,
                                      case.local_blocks)
    assert torch.equal(to_torch(got), expected)
    assert torch.equal(to_torch(jref.select_blocks_ref(to_jax(scores), to_jax(x["seq_lens"]), case.q_lens,
                                                       **kw)), expected)


def test_select_blocks_ties_nan_and_forced():
    seq_lens = jnp.asarray([10 * 128, 3 * 128 + 1], jnp.int32)
    scores = np.full((1, 2, 11), 0.5, np.float32)
    scores[0, 0, [2, 7]] = 2.0          # tie at the top: both win
    scores[0, 0, 4] = math.nan          # NaN loses to everything
    scores[0, 0, 5] = 1.0
    scores[0, 0, 10] = 99.0             # invisible (past the 10 blocks): never chosen
    scores[0, 1, :] = math.nan          # all NaN, nb = 4: all chosen
    kw = dict(decode_query_len=1, topk=5, init_blocks=1, local_blocks=1)
    ids = m3_jax.select_blocks(jnp.asarray(scores), seq_lens, **kw)
    assert np.asarray(ids).tolist() == [[[0, 2, 5, 7, 9], [0, 1, 2, 3, -1]]]
    assert np.array_equal(ids, jref.select_blocks_ref(scores, seq_lens, [1, 1], 5, 1, 1))
    assert_bit_identical(ids, m3_torch.select_blocks(torch.from_numpy(scores), to_torch(seq_lens), **kw))
    # equal scores: the lower ids win (forced local block 9 aside)
    flat = jnp.zeros((1, 1, 10), jnp.float32)
    ids = m3_jax.select_blocks(flat, seq_lens[:1], decode_query_len=1, topk=4)
    assert np.asarray(ids).tolist() == [[[0, 1, 2, 9]]]
    assert np.array_equal(ids, jref.select_blocks_ref(flat, seq_lens[:1], [1], 4))


# mtp8 is left to test_msa_decode (sparse over its selection): the interpreter is slow
@pytest.mark.parametrize("case", [c for c in CASES if c.name != "mtp8_g4_fp32"], ids=str)
def test_sparse_decode(case):
    x = make_inputs(case, seed=13)
    j = jax_inputs(case, x)
    ids = random_block_ids(case, x["seq_lens"], seed=13)
    got = m3_jax.sparse_decode(j["q"], j["k_cache"], j["v_cache"], to_jax(ids), j["block_table"], j["seq_lens"],
                               decode_query_len=case.n, kv_layout=j["kv_layout"])
    assert got.shape == j["q"].shape and got.dtype == j["q"].dtype
    want = m3_torch.sparse_decode(x["q"], x["k_cache"], x["v_cache"], ids, x["block_table"], x["seq_lens"],
                                  decode_query_len=case.n)
    assert_bit_identical(got, want)
    check_attention(case, got,
                    jref.attention_ref(j["q"], j["k_cache"], j["v_cache"], j["block_table"], j["seq_lens"],
                                       case.q_lens, to_jax(ids), kv_layout=j["kv_layout"]),
                    tref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                       case.q_lens, ids))
    check_padding_rows(case, got)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_dense_decode(case):
    x = make_inputs(case, seed=14)
    j = jax_inputs(case, x)
    got = m3_jax.dense_decode(j["q"], j["k_cache"], j["v_cache"], j["block_table"], j["seq_lens"],
                              decode_query_len=case.n, sm_scale=0.3, kv_layout=j["kv_layout"])
    want = m3_torch.dense_decode(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                 decode_query_len=case.n, sm_scale=0.3)
    assert_bit_identical(got, want)
    check_attention(case, got,
                    jref.attention_ref(j["q"], j["k_cache"], j["v_cache"], j["block_table"], j["seq_lens"],
                                       case.q_lens, sm_scale=0.3, kv_layout=j["kv_layout"]),
                    tref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                       case.q_lens, sm_scale=0.3))
    check_padding_rows(case, got)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_msa_decode(case):
    x = make_inputs(case, seed=15)
    j = jax_inputs(case, x)
    kw = dict(decode_query_len=case.n, topk=case.topk, init_blocks=case.init_blocks, local_blocks=case.local_blocks)
    out, ids = m3_jax.msa_decode(j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"],
                                 j["block_table"], j["seq_lens"], kv_layout=j["kv_layout"], **kw)
    want_out, want_ids = m3_torch.msa_decode(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                             x["block_table"], x["seq_lens"], **kw)
    assert_bit_identical(out, want_out)
    assert_bit_identical(ids, want_ids)
    # selection: the reference selection of the reference scores (random data: no near-ties at these sizes)
    scores = tref.index_scores_ref(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"], case.q_lens)
    expected_ids = tref.select_blocks_ref(scores, x["seq_lens"], case.q_lens, case.topk, case.init_blocks,
                                          case.local_blocks)
    assert torch.equal(to_torch(ids), expected_ids)
    jnp_out, jnp_ids = jref.msa_decode_ref(j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"],
                                           j["block_table"], j["seq_lens"], case.q_lens, case.topk,
                                           case.init_blocks, case.local_blocks, kv_layout=j["kv_layout"])
    assert torch.equal(to_torch(jnp_ids), expected_ids)
    check_attention(case, out, jnp_out,
                    tref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                       case.q_lens, expected_ids))
    check_padding_rows(case, out, ids)


# -- pool views and jit ---------------------------------------------------------------------

def _pool_views(x, case, num_layers=2, layer=1, seed=0, lead=16):
    """Copy the caches into ``layer`` of a flat sub-page pool -> (pool, k, v, index_k PagedViews).

    A slot holds, per layer, a K sub-page [Hk, 128, D] (HND), a V sub-page
    [128, Hk, D] (NHD) and an index-K sub-page [128, Di]; slot ids = page ids.
    Everything outside the layer's sub-pages is random garbage; the pool
    starts ``lead`` garbage elements in (the kernels need multiples of 16).
    """
    num_pages = x["k_cache"].shape[0]
    kv_elems, idx_elems = case.hk * PAGE * case.d, PAGE * case.di
    layer_elems = 2 * kv_elems + idx_elems
    slot = num_layers * layer_elems
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal(num_pages * slot + lead).astype(np.float32)
    base = lead + layer * layer_elems
    k_off, v_off, i_off = base, base + kv_elems, base + 2 * kv_elems
    cols = pool[lead:].reshape(num_pages, slot)
    k = x["k_cache"].cpu().float().numpy().reshape(num_pages, -1)                     # HND
    v = x["v_cache"].cpu().permute(0, 2, 1, 3).float().numpy().reshape(num_pages, -1)  # NHD
    cols[:, k_off - lead:k_off - lead + kv_elems] = k
    cols[:, v_off - lead:v_off - lead + kv_elems] = v
    cols[:, i_off - lead:i_off - lead + idx_elems] = x["index_k_cache"].cpu().float().numpy().reshape(num_pages, -1)
    pool = jnp.asarray(pool).astype(jnp.bfloat16)  # exact: the caches are bf16
    shape = (num_pages, case.hk, PAGE, case.d)
    k_view = PagedView(pool, k_off, shape, (slot, PAGE * case.d, case.d, 1))
    v_view = PagedView(pool, v_off, shape, (slot, case.d, case.hk * case.d, 1))
    i_view = PagedView(pool, i_off, (num_pages, PAGE, case.di), (slot, case.di, 1))
    return pool, k_view, v_view, i_view


def test_pool_views_under_jit_match_dense_caches():
    """PagedViews into one flat pool (with offsets, HND K, NHD V) pass through jit, no copy, same bits."""
    case = Case("pool", (300, 129, 0), n=2, hq=4, hk=2, topk=2)
    x = make_inputs(case, seed=16)
    j = jax_inputs(case, x)
    _, k_view, v_view, i_view = _pool_views(x, case)
    assert np.array_equal(k_view.to_array(), j["k_cache"]) and np.array_equal(i_view.to_array(), j["index_k_cache"])
    kw = dict(decode_query_len=2, topk=2, init_blocks=0, local_blocks=1)
    msa = jax.jit(m3_jax.msa_decode, static_argnames=tuple(kw) + ("sm_scale", "kv_layout"))
    out, ids = msa(j["q"], j["idx_q"], k_view, v_view, i_view, j["block_table"], j["seq_lens"], **kw)
    want_out, want_ids = m3_torch.msa_decode(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                             x["block_table"], x["seq_lens"], **kw)
    assert_bit_identical(out, want_out)
    assert_bit_identical(ids, want_ids)
    check_padding_rows(case, out, ids)
    # the view's layout is static aux data, its buffer the only leaf
    assert jax.tree_util.tree_leaves(k_view) == [k_view.buffer]


def test_unaligned_pool_offset_is_an_error():
    case = Case("pool_odd", (300,), hq=4, hk=2, topk=2)
    x = make_inputs(case, seed=17)
    j = jax_inputs(case, x)
    _, k_view, v_view, i_view = _pool_views(x, case, lead=5)
    with pytest.raises(ValueError, match="index_k_cache: element offset"):
        m3_jax.msa_decode(j["q"], j["idx_q"], k_view, v_view, i_view, j["block_table"], j["seq_lens"],
                          decode_query_len=1, topk=2)


def test_jit_does_not_recompile_on_new_values():
    """New seq_lens / block_table / q values under one jit: one trace, results still correct."""
    case = Case("jit", (260, 260), n=2, hq=4, hk=2, topk=2)  # 3 valid pages per request
    traces = []

    def step(q, idx_q, k, v, index_k, block_table, seq_lens):
        traces.append(1)  # runs once per trace
        out, ids = m3_jax.msa_decode(q, idx_q, k, v, index_k, block_table, seq_lens, decode_query_len=2, topk=2)
        dense = m3_jax.dense_decode(q, k, v, block_table, seq_lens, decode_query_len=2, sm_scale=0.5)
        return out, ids, dense

    jitted = jax.jit(step)
    for seed, lens in ((17, (260, 7)), (18, (0, 129)), (19, (131, 256))):
        y = make_inputs(case, seed=seed)  # fresh values, same shapes; new shuffled page table
        y["seq_lens"] = torch.tensor(lens, dtype=torch.int32)
        for r, s in enumerate(lens):  # garbage past each request's blocks
            y["block_table"][r, -(-s // PAGE):] = -1 if seed % 2 else 2**30
        j = jax_inputs(case, y)
        out, ids, dense = jitted(j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"],
                                 j["block_table"], j["seq_lens"])
        q_lens = [2, 2]
        expected_ids = tref.select_blocks_ref(
            tref.index_scores_ref(y["idx_q"], y["index_k_cache"], y["block_table"], y["seq_lens"], q_lens),
            y["seq_lens"], q_lens, 2)
        assert torch.equal(to_torch(ids), expected_ids)
        expected = tref.attention_ref(y["q"], y["k_cache"], y["v_cache"], y["block_table"], y["seq_lens"], q_lens,
                                      expected_ids)
        assert rel_err(to_torch(out.astype(jnp.float32)), expected) < TOLERANCE["bfloat16"]
        expected = tref.attention_ref(y["q"], y["k_cache"], y["v_cache"], y["block_table"], y["seq_lens"], q_lens,
                                      sm_scale=0.5)
        assert rel_err(to_torch(dense.astype(jnp.float32)), expected) < TOLERANCE["bfloat16"]
    assert len(traces) == 1
    assert jitted._cache_size() == 1


def test_references_run_under_jit():
    case = Case("refjit", (200, 0), hq=4, hk=2, topk=2)
    x = make_inputs(case, seed=20)
    j = jax_inputs(case, x)
    f = jax.jit(jref.msa_decode_ref, static_argnames=("q_lens", "topk", "init_blocks", "local_blocks",
                                                      "sm_scale", "kv_layout"))
    out, ids = f(j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"], j["block_table"],
                 j["seq_lens"], q_lens=(1, 1), topk=2)
    want_out, want_ids = tref.msa_decode_ref(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                             x["block_table"], x["seq_lens"], [1, 1], 2)
    assert torch.equal(to_torch(ids), want_ids)
    assert rel_err(to_torch(out), want_out) < 1e-5


# -- errors ------------------------------------------------------------------------------

def _err_inputs():
    case = Case("err", (130, 5), hq=4, hk=2)
    x = make_inputs(case, seed=21)
    j = jax_inputs(case, x)
    j["block_ids"] = to_jax(random_block_ids(case, x["seq_lens"], seed=21))
    return j


def _sparse(j, **over):
    a = {**j, **over}
    return m3_jax.sparse_decode(a["q"], a["k_cache"], a["v_cache"], a["block_ids"], a["block_table"],
                                a["seq_lens"], decode_query_len=a.get("n", 1), kv_layout=a["kv_layout"])


@pytest.mark.parametrize("over, exc, words", [
    (lambda j: dict(block_table=np.asarray(j["block_table"], np.int64)), TypeError, "block_table"),
    (lambda j: dict(seq_lens=j["seq_lens"].astype(jnp.float32)), TypeError, "seq_lens"),
    (lambda j: dict(seq_lens=j["seq_lens"][:1]), ValueError, "seq_lens"),
    (lambda j: dict(q=j["q"][0]), ValueError, "q"),
    (lambda j: dict(q=j["q"][:, :3]), ValueError, "Hq=3"),
    (lambda j: dict(k_cache=j["k_cache"][:, :, :64]), ValueError, "page size"),
    (lambda j: dict(v_cache=j["v_cache"].astype(jnp.float32)), TypeError, "v_cache"),
    (lambda j: dict(k_cache=j["k_cache"].tolist()), TypeError, "k_cache"),
    (lambda j: dict(k_cache=j["k_cache"][0]), ValueError, "k_cache"),
    (lambda j: dict(kv_layout="NDH"), ValueError, "kv_layout"),
    (lambda j: dict(kv_layout="NHD"), ValueError, "k_cache"),  # an HND store read as NHD: page size 2
    (lambda j: dict(n=2), ValueError, "decode_query_len"),
    (lambda j: dict(block_ids=j["block_ids"][:1]), ValueError, "block_ids"),
    (lambda j: dict(block_ids=j["block_ids"].astype(jnp.float32)), TypeError, "block_ids"),
])
def test_sparse_decode_errors(over, exc, words):
    j = _err_inputs()
    with pytest.raises(exc, match=words):
        _sparse(j, **over(j))


def test_index_select_msa_and_view_errors():
    j = _err_inputs()
    with pytest.raises(ValueError, match="Di"):
        m3_jax.index_scores(j["idx_q"], j["index_k_cache"][..., :32], j["block_table"], j["seq_lens"],
                            decode_query_len=1)
    with pytest.raises(ValueError, match="index_k_cache"):
        m3_jax.index_scores(j["idx_q"], j["index_k_cache"][:, :64], j["block_table"], j["seq_lens"],
                            decode_query_len=1)
    with pytest.raises(ValueError, match="init_blocks"):
        m3_jax.select_blocks(jnp.ones((2, 2, 3)), j["seq_lens"], decode_query_len=1, topk=2, init_blocks=2)
    with pytest.raises(TypeError, match="scores"):
        m3_jax.select_blocks(jnp.ones((2, 2, 3), jnp.bfloat16), j["seq_lens"], decode_query_len=1, topk=2)
    with pytest.raises(ValueError, match="Hi=1"):
        m3_jax.msa_decode(j["q"], j["idx_q"][:, :1], j["k_cache"], j["v_cache"], j["index_k_cache"],
                          j["block_table"], j["seq_lens"], decode_query_len=1)
    with pytest.raises(ValueError, match="PagedView"):
        PagedView(jnp.zeros(100), 10, (10, 10), (10, 1))
    with pytest.raises(ValueError, match="PagedView"):
        PagedView(jnp.zeros(100), 0, (10, 10), (10,))
    with pytest.raises(TypeError, match="index_k_cache"):
        m3_jax.index_scores(j["idx_q"], None, j["block_table"], j["seq_lens"], decode_query_len=1)


# -- GPU: MiniMax-M3 shapes, JAX (jax-triton) vs torch ---------------------------------------

M3 = dict(hq=64, hk=4, d=128, di=128, topk=16)


@pytest.mark.gpu
@pytest.mark.skipif(not jax_gpu_ready(), reason="needs a JAX GPU backend and jax_triton")
@pytest.mark.parametrize("n, nhd", [(1, False), (2, True), (8, False)])
def test_gpu_m3_shapes_jax_matches_torch(n, nhd):
    case = Case("m3", (1, 127, 128, 129, 3000, 0, 2049, 5000), n=n, nhd=nhd, **M3)
    x = make_inputs(case, seed=30 + n, device="cuda")
    j = {k: to_jax(v) for k, v in x.items()}  # jax arrays on the default (GPU) device
    if nhd:
        j["k_cache"] = to_jax(x["k_cache"].permute(0, 2, 1, 3))
        j["v_cache"] = to_jax(x["v_cache"].permute(0, 2, 1, 3))
    layout = "NHD" if nhd else "HND"
    q_lens = case.q_lens
    kw = dict(decode_query_len=n, topk=16, init_blocks=0, local_blocks=1)

    # index_scores: bit-identical, close to float64
    scores = jax.jit(m3_jax.index_scores, static_argnames="decode_query_len")(
        j["idx_q"], j["index_k_cache"], j["block_table"], j["seq_lens"], decode_query_len=n)
    t_scores = m3_torch.index_scores(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"],
                                     decode_query_len=n)
    assert_bit_identical(scores, t_scores)
    check_scores(scores, tref.index_scores_ref(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"],
                                               q_lens), tol=1e-3)

    # msa_decode: bit-identical; ids = reference selection of the kernel's own scores
    msa = jax.jit(m3_jax.msa_decode, static_argnames=tuple(kw) + ("sm_scale", "kv_layout"))
    out, ids = msa(j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"], j["block_table"],
                   j["seq_lens"], kv_layout=layout, **kw)
    t_out, t_ids = m3_torch.msa_decode(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                       x["block_table"], x["seq_lens"], **kw)
    assert_bit_identical(out, t_out)
    assert_bit_identical(ids, t_ids)
    expected_ids = tref.select_blocks_ref(t_scores.cpu(), x["seq_lens"].cpu(), q_lens, 16)
    assert torch.equal(to_torch(ids), expected_ids)
    expected = tref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], q_lens,
                                  expected_ids)
    assert rel_err(to_torch(out.astype(jnp.float32)), expected) < TOLERANCE["bfloat16"]
    check_padding_rows(case, out, ids)

    # select_blocks and sparse_decode on their own, dense_decode
    sel = m3_jax.select_blocks(scores, j["seq_lens"], **kw)
    assert_bit_identical(sel, t_ids)
    sparse = m3_jax.sparse_decode(j["q"], j["k_cache"], j["v_cache"], ids, j["block_table"], j["seq_lens"],
                                  decode_query_len=n, kv_layout=layout)
    assert_bit_identical(sparse, t_out)
    dense = m3_jax.dense_decode(j["q"], j["k_cache"], j["v_cache"], j["block_table"], j["seq_lens"],
                                decode_query_len=n, kv_layout=layout)
    t_dense = m3_torch.dense_decode(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                    decode_query_len=n)
    assert_bit_identical(dense, t_dense)
    expected = tref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], q_lens)
    assert rel_err(to_torch(dense.astype(jnp.float32)), expected) < TOLERANCE["bfloat16"]
    # the jnp reference on the GPU agrees too (over the kernel's selection)
    jnp_out = jref.attention_ref(j["q"], j["k_cache"], j["v_cache"], j["block_table"], j["seq_lens"], q_lens, ids,
                                 kv_layout=layout)
    assert rel_err(to_torch(out.astype(jnp.float32)), to_torch(jnp_out)) < TOLERANCE["bfloat16"]


@pytest.mark.gpu
@pytest.mark.skipif(not jax_gpu_ready(), reason="needs a JAX GPU backend and jax_triton")
def test_gpu_pool_views_match_torch():
    """M3 shapes read through PagedViews into one flat pool (offsets, HND K, NHD V) under jit."""
    case = Case("m3pool", (3000, 129, 0, 700), n=2, **M3)
    x = make_inputs(case, seed=40, device="cuda")
    j = {k: to_jax(v) for k, v in x.items()}
    _, k_view, v_view, i_view = _pool_views(x, case)
    kw = dict(decode_query_len=2, topk=16, init_blocks=0, local_blocks=1)
    msa = jax.jit(m3_jax.msa_decode, static_argnames=tuple(kw) + ("sm_scale", "kv_layout"))
    out, ids = msa(j["q"], j["idx_q"], k_view, v_view, i_view, j["block_table"], j["seq_lens"], **kw)
    t_out, t_ids = m3_torch.msa_decode(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                       x["block_table"], x["seq_lens"], **kw)
    assert_bit_identical(out, t_out)
    assert_bit_identical(ids, t_ids)
    check_padding_rows(case, out, ids)
