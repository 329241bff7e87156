"""GPU-only checks of the torch decode ops at MiniMax-M3 shapes (run on the device machine)."""

import math

import pytest
import torch

import m3_torch
from m3_torch import reference as ref

from cases import PAGE, rel_err

pytestmark = pytest.mark.gpu

M3 = dict(hq=64, hk=4, d=128, di=128, topk=16)


def m3_inputs(seq_lens, n, seed, dtype=torch.bfloat16, hq=64, hk=4, d=128, di=128):
    g = torch.Generator().manual_seed(seed)
    num_req = len(seq_lens)
    max_blocks = max(-(-s // PAGE) for s in seq_lens) + 2
    num_pages = num_req * max_blocks + 7
    block_table = torch.randperm(num_pages, generator=g)[:num_req * max_blocks].reshape(num_req, max_blocks).int()
    for r, s in enumerate(seq_lens):
        block_table[r, -(-s // PAGE):] = -7  # poison: never read
    dev = "cuda"
    T = num_req * n
    x = dict(
        q=torch.randn(T, hq, d, generator=g), idx_q=torch.randn(T, hk, di, generator=g),
        k_cache=torch.randn(num_pages, hk, PAGE, d, generator=g),
        v_cache=torch.randn(num_pages, hk, PAGE, d, generator=g),
        index_k_cache=torch.randn(num_pages, PAGE, di, generator=g),
    )
    x = {k: v.to(dev, dtype) for k, v in x.items()}
    x["block_table"] = block_table.to(dev)
    x["seq_lens"] = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return x


def msa(x, n, out=None):
    return m3_torch.msa_decode(x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"],
                               x["block_table"], x["seq_lens"], decode_query_len=n, topk=16, out=out)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_m3_shapes_match_reference(n):
    seq_lens = [1, 127, 128, 129, 3000, 0, 2049, 5000]
    x = m3_inputs(seq_lens, n, seed=n)
    q_lens = [n] * len(seq_lens)
    out = torch.full_like(x["q"], math.nan)
    scores = m3_torch.index_scores(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"],
                                   decode_query_len=n)
    expected_scores = ref.index_scores_ref(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"], q_lens)
    finite = torch.isfinite(expected_scores)
    assert torch.equal(torch.isfinite(scores).cpu(), finite)
    torch.testing.assert_close(scores.cpu().double()[finite], expected_scores[finite], rtol=1e-3, atol=1e-3)

    got, ids = msa(x, n, out)
    # selection: exactly the reference selection of the kernel's own scores
    assert torch.equal(ids.cpu(), ref.select_blocks_ref(scores.cpu(), x["seq_lens"].cpu(), q_lens, 16))
    expected = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], q_lens,
                                 ids.cpu())
    assert rel_err(out, expected) < 1e-2
    assert (out[5 * n:6 * n] == 0).all() and (ids[:, 5 * n:6 * n] == -1).all()

    dense = m3_torch.dense_decode(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                  decode_query_len=n, out=torch.full_like(x["q"], math.nan))
    expected = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], q_lens)
    assert rel_err(dense, expected) < 1e-2


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-3), (torch.float32, 1e-3)])
def test_tp_slice_dtypes(dtype, tol):
    """TP8 slice: 8 query heads, 1 KV head, 1 index head."""
    seq_lens = [700, 129, 4000]
    x = m3_inputs(seq_lens, 1, seed=11, dtype=dtype, hq=8, hk=1)
    ids_out = torch.full((1, 3, 16), 99, dtype=torch.int32, device="cuda")
    out = torch.full_like(x["q"], math.nan)
    scores = m3_torch.index_scores(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"],
                                   decode_query_len=1)
    m3_torch.select_blocks(scores, x["seq_lens"], decode_query_len=1, out=ids_out)
    m3_torch.sparse_decode(x["q"], x["k_cache"], x["v_cache"], ids_out, x["block_table"], x["seq_lens"],
                           decode_query_len=1, out=out)
    expected = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], [1] * 3,
                                 ids_out.cpu())
    assert rel_err(out, expected) < tol


def test_cuda_graph_replay_matches_eager():
    n = 2
    capacity = [4000, 4000, 4000, 4000]
    x = m3_inputs(capacity, n, seed=3)
    out = torch.empty_like(x["q"])
    msa(x, n, out)  # warm-up: compiles kernels, creates workspaces and maps
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, graph_ids = msa(x, n, out)
    for lens in ([4000, 1, 129, 128], [0, 3999, 2, 257], [0, 0, 0, 0]):
        x["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        x["q"].copy_(torch.randn_like(x["q"]))
        x["idx_q"].copy_(torch.randn_like(x["idx_q"]))
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_ids = msa(x, n, torch.full_like(out, math.nan))
        assert not torch.isnan(out).any()
        assert torch.equal(graph_ids, eager_ids)
        assert torch.equal(out, eager_out)
        if lens == [0, 0, 0, 0]:
            assert (out == 0).all() and (graph_ids == -1).all()
