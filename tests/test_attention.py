"""sparse / dense attention, decode and prefill, vs the float64 reference; JAX bit-identical to torch.

sparse attends over the reference selection of each case (``targets.selected_blocks``),
dense over every visible block with ``sm_scale=0.3``.
"""

import pytest
import torch

import m3_torch
from m3_kernels import tuning
from m3_torch import reference as ref

from cases import ALL_CASES, TOLERANCE, decode, make_inputs, random_block_ids, rel_err
from targets import check_attention, check_twin, grid, reference, run, targets


@pytest.mark.parametrize("op", ["sparse", "dense"])
# an FP8 index-K cache alone changes nothing attention reads
@pytest.mark.parametrize("case, target", grid([c for c in ALL_CASES if c.kv_dtype != "auto" or not c.fp8]))
def test_attention(case, target, op):
    check_attention(case, run(target, op, case), reference(op, case))
    check_twin(target, op, case)


@pytest.mark.parametrize("target", targets(["torch"]))
def test_workspace_reuse_across_calls(target):
    """Consecutive calls with new lengths (same shapes) reuse the split-K workspaces and stay correct."""
    dev = target.torch_device
    x = make_inputs(decode("reuse", (700, 700)), dev)
    for lens in ((700, 5), (129, 600), (0, 1)):
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        ids = random_block_ids(decode("reuse", lens))
        out = m3_torch.sparse_decode(x["q"], x["k_cache"], x["v_cache"], ids.to(dev), x["block_table"],
                                     seq_lens.to(dev), decode_query_len=1)
        expected = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], seq_lens, [1, 1], ids)
        assert rel_err(out, expected) < TOLERANCE["bfloat16"]


@pytest.mark.parametrize("splits", ["one", "several"])
@pytest.mark.parametrize("target", targets(["torch"]))
def test_sparse_decode_skips_empty_and_out_of_range_slots_anywhere(target, splits):
    """Valid ids need not come first: -1 and out-of-range ids scattered among them are skipped
    (a split visits only its valid slots) and the output is the reference over the valid ones."""
    case = decode("scattered", (300, 129, 1000, 5), hq=4, hk=2, d=16, di=16, topk=6)
    dev = target.torch_device
    x = make_inputs(case, dev)
    ids = random_block_ids(case)                           # valid ids first, then -1
    g = torch.Generator().manual_seed(3)
    for h in range(case.hk):
        for t in range(case.num_tokens):
            ids[h, t] = ids[h, t, torch.randperm(case.topk, generator=g)]   # -1 anywhere
    ids[0, 3, (ids[0, 3] == -1).nonzero()[0]] = 10 ** 6    # past the table: skipped like -1
    ids[1, 0, (ids[1, 0] == -1).nonzero()[0]] = 8          # past request 0's 3 blocks
    lens = x["seq_lens"].cpu()
    expected = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], lens, [1] * 4, ids)
    with tuning.override(sparse_target_programs=1 if splits == "one" else 64):
        out = torch.full_like(x["q"], float("nan"))
        m3_torch.sparse_decode(x["q"], x["k_cache"], x["v_cache"], ids.to(dev), x["block_table"],
                               x["seq_lens"], decode_query_len=1, out=out)
    assert rel_err(out, expected) < TOLERANCE["bfloat16"]
