"""m3_torch decode ops vs the float64 references (CPU: Triton interpreter)."""

import math

import pytest
import torch

import m3_torch
from m3_kernels import geometry
from m3_torch import reference as ref

from cases import CASES, TOLERANCE, Case, make_inputs, random_block_ids, rel_err


def nan_like(x, shape=None, dtype=None):
    return torch.full(shape or x.shape, math.nan, dtype=dtype or x.dtype, device=x.device)


def check_scores(scores, expected):
    assert not torch.isnan(scores).any()
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(scores), finite), "-inf pattern differs from the reference"
    assert (scores[~finite] == -math.inf).all()
    torch.testing.assert_close(scores[finite].double(), expected[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_index_scores(case):
    x = make_inputs(case, seed=1)
    T, max_blocks = x["q"].shape[0], x["block_table"].shape[1]
    # written through a transposed view of a [Hi, max_blocks, T] buffer
    buf = torch.full((case.hk, max_blocks, T), math.nan)
    out = buf.transpose(1, 2)
    got = m3_torch.index_scores(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"],
                                decode_query_len=case.n, out=out)
    assert got is out
    check_scores(out, ref.index_scores_ref(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"],
                                           case.q_lens))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_select_blocks(case):
    x = make_inputs(case, seed=2)
    T, max_blocks = x["q"].shape[0], x["block_table"].shape[1]
    scores = torch.randn(case.hk, T, max_blocks)  # random floats: no ties
    out = torch.full((case.hk, T, case.topk), 12345, dtype=torch.int32)
    m3_torch.select_blocks(scores, x["seq_lens"], decode_query_len=case.n, topk=case.topk,
                           init_blocks=case.init_blocks, local_blocks=case.local_blocks, out=out)
    expected = ref.select_blocks_ref(scores, x["seq_lens"], case.q_lens, case.topk, case.init_blocks,
                                     case.local_blocks)
    assert torch.equal(out, expected)


def test_select_blocks_ties_nan_and_forced():
    seq_lens = torch.tensor([10 * 128, 3 * 128 + 1], dtype=torch.int32)
    scores = torch.full((1, 2, 11), 0.5)
    scores[0, 0, [2, 7]] = 2.0          # tie at the top: both win
    scores[0, 0, 4] = math.nan          # NaN loses to everything
    scores[0, 0, 5] = 1.0
    scores[0, 0, 10] = 99.0             # invisible (past the 10 blocks): never chosen
    scores[0, 1, :] = math.nan          # all NaN, nb = 4: all chosen
    ids = m3_torch.select_blocks(scores, seq_lens, decode_query_len=1, topk=5, init_blocks=1, local_blocks=1)
    # forced 0 and 9; then 2, 7 (tie, both); then 5
    assert ids[0, 0].tolist() == [0, 2, 5, 7, 9]
    assert ids[0, 1].tolist() == [0, 1, 2, 3, -1]
    # equal scores: the lower ids win
    flat = torch.zeros((1, 1, 10))
    ids = m3_torch.select_blocks(flat, seq_lens[:1], decode_query_len=1, topk=4)
    assert ids[0, 0].tolist() == [0, 1, 2, 9]
    expected = ref.select_blocks_ref(flat, seq_lens[:1], [1], 4)
    assert torch.equal(ids, expected)
    # -0.0 == +0.0: a tie, so the lower id wins whichever sign it carries
    signed = torch.tensor([[[-1.0, 0.0, -0.0, -1.0, 0.0, 5.0]]])
    ids = m3_torch.select_blocks(signed, torch.tensor([6 * 128], dtype=torch.int32), decode_query_len=1, topk=3)
    assert ids[0, 0].tolist() == [1, 2, 5]


@pytest.mark.parametrize("max_blocks", [600, 1500])
def test_select_blocks_long_rows(max_blocks):
    """Rows past geometry.SELECT_TWO_LEVEL_BLOCKS: best chunks first, then blocks."""
    assert geometry.select_constexprs(topk=16, init_blocks=0, local_blocks=1, max_blocks=max_blocks)["CHUNK"] > 0
    g = torch.Generator().manual_seed(max_blocks)
    seq_lens = torch.tensor([max_blocks * 128, 40 * 128 + 3, 15 * 128, (max_blocks - 3) * 128 - 5, 1],
                            dtype=torch.int32)
    scores = torch.randn(2, 5, max_blocks, generator=g)
    scores[0, 0, 100:140] = 3.0             # a tie spread over three chunks
    scores[1, 3, ::7] = math.nan
    scores[1, 0, 17::16] = 5.0              # one winner in each of many chunks
    for init_blocks in (0, 2):
        ids = m3_torch.select_blocks(scores, seq_lens, decode_query_len=1, init_blocks=init_blocks)
        expected = ref.select_blocks_ref(scores, seq_lens, [1] * 5, 16, init_blocks, 1)
        assert torch.equal(ids, expected)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sparse_decode(case):
    x = make_inputs(case, seed=3)
    ids = random_block_ids(case, x["seq_lens"], seed=3)
    out = nan_like(x["q"])
    m3_torch.sparse_decode(x["q"], x["k_cache"], x["v_cache"], ids, x["block_table"], x["seq_lens"],
                           decode_query_len=case.n, out=out)
    expected = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                 case.q_lens, ids)
    assert rel_err(out, expected) < TOLERANCE[case.dtype]
    _check_padding_rows(case, x, out)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_dense_decode(case):
    x = make_inputs(case, seed=4)
    out = nan_like(x["q"])
    m3_torch.dense_decode(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                          decode_query_len=case.n, sm_scale=0.3, out=out)
    expected = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                 case.q_lens, sm_scale=0.3)
    assert rel_err(out, expected) < TOLERANCE[case.dtype]
    _check_padding_rows(case, x, out)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_msa_decode(case):
    x = make_inputs(case, seed=5)
    out = nan_like(x["q"])
    got, ids = m3_torch.msa_decode(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                                   x["block_table"], x["seq_lens"], decode_query_len=case.n, topk=case.topk,
                                   init_blocks=case.init_blocks, local_blocks=case.local_blocks, out=out)
    assert got is out
    # the selection must be the reference selection of the reference scores (random data: no near-ties
    # at these sizes), and the attention the reference attention over it
    scores = ref.index_scores_ref(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"], case.q_lens)
    expected_ids = ref.select_blocks_ref(scores, x["seq_lens"], case.q_lens, case.topk, case.init_blocks,
                                         case.local_blocks)
    assert torch.equal(ids, expected_ids)
    expected = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                 case.q_lens, expected_ids)
    assert rel_err(out, expected) < TOLERANCE[case.dtype]
    _check_padding_rows(case, x, out, ids)


def _check_padding_rows(case, x, out, ids=None):
    for r, s in enumerate(case.seq_lens):
        if s == 0:
            rows = slice(r * case.n, (r + 1) * case.n)
            assert (out[rows] == 0).all()
            if ids is not None:
                assert (ids[:, rows] == -1).all()


def test_non_contiguous_q_and_out():
    case = Case("views", (200, 129), hq=4, hk=2)
    x = make_inputs(case, seed=6)
    ids = random_block_ids(case, x["seq_lens"], seed=6)
    q_wide = torch.randn(x["q"].shape[0], case.hq, 2 * case.d).to(torch.bfloat16)
    q = q_wide[..., ::2]                       # stride 2 along D
    out_wide = torch.full((case.hq, x["q"].shape[0], case.d), math.nan, dtype=torch.bfloat16)
    out = out_wide.transpose(0, 1)             # [T, Hq, D] view with permuted strides
    m3_torch.sparse_decode(q, x["k_cache"], x["v_cache"], ids, x["block_table"], x["seq_lens"],
                           decode_query_len=1, out=out)
    expected = ref.attention_ref(q, x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], case.q_lens, ids)
    assert rel_err(out, expected) < TOLERANCE["bfloat16"]


def test_workspace_reuse_across_calls():
    """Consecutive calls with new lengths reuse the workspaces and stay correct."""
    case = Case("reuse", (700, 700), hq=4, hk=1)
    x = make_inputs(case, seed=7)
    for seq in ([700, 5], [129, 600], [0, 1]):
        seq_lens = torch.tensor(seq, dtype=torch.int32)
        ids = random_block_ids(case, seq_lens, seed=sum(seq))
        out = m3_torch.sparse_decode(x["q"], x["k_cache"], x["v_cache"], ids, x["block_table"], seq_lens,
                                     decode_query_len=1)
        expected = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], seq_lens, [1, 1], ids)
        assert rel_err(out, expected) < TOLERANCE["bfloat16"]


# -- errors ------------------------------------------------------------------------------

def _err_inputs():
    case = Case("err", (130, 5), hq=4, hk=2)
    x = make_inputs(case, seed=8)
    x["block_ids"] = random_block_ids(case, x["seq_lens"], seed=8)
    return x


def _sparse(x, **over):
    a = {**x, **over}
    return m3_torch.sparse_decode(a["q"], a["k_cache"], a["v_cache"], a["block_ids"], a["block_table"],
                                  a["seq_lens"], decode_query_len=a.get("n", 1), out=a.get("out"))


@pytest.mark.parametrize("over, exc, words", [
    (lambda x: dict(block_table=x["block_table"].long()), TypeError, "block_table"),
    (lambda x: dict(seq_lens=x["seq_lens"].float()), TypeError, "seq_lens"),
    (lambda x: dict(q=x["q"][0]), ValueError, "q"),
    (lambda x: dict(q=x["q"][:, :3]), ValueError, "Hq=3"),
    (lambda x: dict(k_cache=x["k_cache"][:, :, :64]), ValueError, "page size"),
    (lambda x: dict(v_cache=x["v_cache"].float()), TypeError, "v_cache"),
    (lambda x: dict(n=2), ValueError, "decode_query_len"),
    (lambda x: dict(block_ids=x["block_ids"][:1]), ValueError, "block_ids"),
    (lambda x: dict(out=torch.empty(1, 4, 64, dtype=torch.bfloat16)), ValueError, "out"),
    (lambda x: dict(out=torch.empty_like(x["q"], dtype=torch.float32)), TypeError, "out"),
    # rows 65 elements apart: the kernels need cache strides that are multiples of 16
    (lambda x: dict(k_cache=torch.randn(x["k_cache"].numel() * 2).to(torch.bfloat16).as_strided(
        x["k_cache"].shape, (2 * 128 * 65, 128 * 65, 65, 1))), ValueError, "k_cache: element offset and strides"),
])
def test_sparse_decode_errors(over, exc, words):
    x = _err_inputs()
    with pytest.raises(exc, match=words):
        _sparse(x, **over(x))


def test_index_and_select_errors():
    x = _err_inputs()
    with pytest.raises(ValueError, match="Di"):
        m3_torch.index_scores(x["idx_q"], x["index_k_cache"][..., :32], x["block_table"], x["seq_lens"],
                              decode_query_len=1)
    with pytest.raises(ValueError, match="init_blocks"):
        m3_torch.select_blocks(torch.randn(2, 2, 3), x["seq_lens"], decode_query_len=1, topk=2, init_blocks=2)
    with pytest.raises(ValueError, match="Hi=1"):
        m3_torch.msa_decode(x["q"], x["idx_q"][:, :1], x["k_cache"], x["v_cache"], x["index_k_cache"],
                            x["block_table"], x["seq_lens"], decode_query_len=1)
    with pytest.raises(ValueError, match="device"):
        m3_torch.dense_decode(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                              decode_query_len=1, out=torch.empty_like(x["q"], device="meta"))
