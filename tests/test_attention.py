"""sparse / dense attention, decode and prefill, vs the float64 reference; JAX bit-identical to torch.

sparse attends over the reference selection of each case (``targets.selected_blocks``),
dense over every visible block with ``sm_scale=0.3``.
"""

import pytest
import torch

import m3_torch
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
