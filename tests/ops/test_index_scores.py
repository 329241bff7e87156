"""index_scores / index_scores_prefill vs the float64 reference; JAX bit-identical to torch."""

import math

import pytest
import torch

from cases import ALL_CASES
from targets import check_twin, grid, reference, run


def check_scores(scores, expected, tol):
    """Finite entries close to the reference, -inf exactly where the reference has it, no NaN."""
    assert scores.dtype == torch.float32 and scores.shape == expected.shape
    assert not torch.isnan(scores).any()
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(scores), finite), "-inf pattern differs from the reference"
    assert (scores[~finite] == -math.inf).all()
    torch.testing.assert_close(scores[finite].double(), expected[finite], rtol=tol, atol=tol)


@pytest.mark.parametrize("case, target", grid(ALL_CASES))
def test_index_scores(case, target):
    scores = run(target, "index_scores", case)
    # float32 accumulation; on the GPU fp32 inputs go through tf32 dots
    tol = 1e-4 if target.device == "interpreter" else (2e-2 if case.dtype == "float32" else 1e-3)
    check_scores(scores, reference("index_scores", case), tol)
    check_twin(target, "index_scores", case)


@pytest.mark.parametrize("decode_query_len", [1, 2])
def test_msa_scorer_skips_tiles_that_select_every_block(decode_query_len):
    """The scorer variant of the MSA ops (skip_blocks=topk): a tile whose tokens all see at most topk
    blocks is left unwritten (selection takes all of them unread); every other tile is scored exactly as
    by the public op. Lengths around 16 blocks (2048 tokens), with MTP tokens straddling it."""
    from m3_kernels import maps
    from m3_torch import ops

    g = torch.Generator().manual_seed(7)
    lens = [1, 127, 129, 2048, 2049, 3000]
    n, heads, dim, topk = decode_query_len, 2, 64, 16
    width = -(-max(lens) // 128)
    pages = len(lens) * width
    table = torch.randperm(pages, generator=g).view(len(lens), width).to(torch.int32)
    index_k = torch.randn(pages, 128, dim, generator=g).to(torch.bfloat16)
    idx_q = torch.randn(len(lens) * n, heads, dim, generator=g).to(torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    tile = maps.index_tile(heads, n)
    tile_map, _ = ops.decode_maps(torch.device("cpu"), len(lens), n, tile.tokens_per_tile)
    got = torch.full((heads, len(lens) * n, width), math.nan)
    ops.index_scores(idx_q, index_k, table, seq_lens, tile_map, got, tile.tokens_per_tile, skip_blocks=topk)
    want = torch.full_like(got, math.nan)
    ops.index_scores(idx_q, index_k, table, seq_lens, tile_map, want, tile.tokens_per_tile)
    assert not torch.isnan(want).any()
    skipped = [-(-length // 128) <= topk for length in lens]   # the request's last token sees the most blocks
    for r, skip in enumerate(skipped):
        rows = slice(r * n, (r + 1) * n)
        if skip:
            assert torch.isnan(got[:, rows]).all(), f"request {r} (length {lens[r]}) was scored"
        else:
            assert torch.equal(got[:, rows], want[:, rows]), f"request {r} (length {lens[r]})"
    assert skipped == [True, True, True, True, False, False]
