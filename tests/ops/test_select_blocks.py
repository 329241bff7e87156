"""select_blocks / select_blocks_prefill vs the reference selection; JAX bit-identical to torch."""

import math

import pytest
import torch

import m3_jax
import m3_torch
from m3_torch import reference as ref

from cases import ALL_CASES
from targets import check_twin, grid, reference, run, targets, to_jax, to_torch


@pytest.mark.parametrize("case, target", grid([c for c in ALL_CASES if not c.fp8]))   # selection reads no cache
def test_select_blocks(case, target):
    ids = run(target, "select_blocks", case)   # random scores: no ties
    assert ids.dtype == torch.int32
    assert torch.equal(ids, reference("select_blocks", case))
    check_twin(target, "select_blocks", case)


def select(target, scores, seq_lens, **kw):
    """select_blocks (decode, n = 1) through ``target`` on CPU torch inputs -> CPU torch ids."""
    with target.active():
        if target.framework == "torch":
            dev = target.torch_device
            return m3_torch.select_blocks(scores.to(dev), seq_lens.to(dev), decode_query_len=1, **kw).cpu()
        return to_torch(m3_jax.select_blocks(to_jax(scores), to_jax(seq_lens), decode_query_len=1, **kw))


@pytest.mark.parametrize("target", targets())
def test_ties_nan_and_forced_blocks(target):
    seq_lens = torch.tensor([10 * 128, 3 * 128 + 1], dtype=torch.int32)
    scores = torch.full((1, 2, 11), 0.5)
    scores[0, 0, [2, 7]] = 2.0          # tie at the top: both win
    scores[0, 0, 4] = math.nan          # NaN loses to everything
    scores[0, 0, 5] = 1.0
    scores[0, 0, 10] = 99.0             # invisible (past the 10 blocks): never chosen
    scores[0, 1, :] = math.nan          # all NaN, nb = 4: all chosen
    ids = select(target, scores, seq_lens, topk=5, init_blocks=1, local_blocks=1)
    # forced 0 and 9; then 2, 7 (tie, both); then 5
    assert ids.tolist() == [[[0, 2, 5, 7, 9], [0, 1, 2, 3, -1]]]
    assert torch.equal(ids, ref.select_blocks_ref(scores, seq_lens, [1, 1], 5, 1, 1))
    # equal scores: the lower ids win (the forced local block 9 aside)
    flat = torch.zeros((1, 1, 10))
    ids = select(target, flat, seq_lens[:1], topk=4)
    assert ids.tolist() == [[[0, 1, 2, 9]]]
    assert torch.equal(ids, ref.select_blocks_ref(flat, seq_lens[:1], [1], 4))
    # -0.0 == +0.0: a tie, so the lower id wins whichever sign it carries
    signed = torch.tensor([[[-1.0, 0.0, -0.0, -1.0, 0.0, 5.0]]])
    ids = select(target, signed, torch.tensor([6 * 128], dtype=torch.int32), topk=3)
    assert ids.tolist() == [[[1, 2, 5]]]


@pytest.mark.parametrize("target", targets())
def test_long_rows(target):
    """Rows of 1500 blocks (two-level selection: best chunks first, then blocks)."""
    max_blocks = 1500
    g = torch.Generator().manual_seed(max_blocks)
    seq_lens = torch.tensor([max_blocks * 128, 40 * 128 + 3, 15 * 128, (max_blocks - 3) * 128 - 5, max_blocks * 128, 1],
                            dtype=torch.int32)
    scores = torch.randn(1, 6, max_blocks, generator=g)
    scores[0, 0, 100:140] = 3.0             # a tie spread over three chunks
    scores[0, 3, ::7] = math.nan
    scores[0, 4, 17::16] = 5.0              # one winner in each of many chunks
    for init_blocks in (0, 2):
        ids = select(target, scores, seq_lens, init_blocks=init_blocks)
        assert torch.equal(ids, ref.select_blocks_ref(scores, seq_lens, [1] * 6, 16, init_blocks, 1))
