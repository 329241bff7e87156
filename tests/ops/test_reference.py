"""m3_jax.reference (jnp, float32, jit-able) against the float64 torch references.

``msa_decode_ref`` runs the jnp index scores, selection and sparse attention in
one jitted call; its selection must be the float64 one, its output the float64
attention over it. ``attention_ref`` without ids covers dense attention. FP8
caches are dequantised by both with the case's scales.
"""

import jax
import pytest
import torch

from m3_jax import reference as jref

from cases import CASES, make_inputs, rel_err
from targets import attention_reference, grid, jax_inputs, kv_scales, reference, to_torch
from m3_torch import reference as ref


# of the FP8 cases, the ones with scaled K/V (what the references dequantise)
@pytest.mark.parametrize("case, target", grid([c for c in CASES if not c.fp8 or c.kv_scales], ["jax"]))
def test_jnp_references_match_float64(case, target):
    sel = dict(topk=case.topk, init_blocks=case.init_blocks, local_blocks=case.local_blocks)
    with target.active():
        j = jax_inputs(case, target.device)
        args = (j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"], j["block_table"], j["seq_lens"])
        scales = kv_scales(case, "jax")
        out, ids = jax.jit(jref.msa_decode_ref, static_argnames=("q_lens", *sel, "sm_scale", "kv_layout"))(
            *args, q_lens=case.q_lens, kv_layout=j["kv_layout"], **sel, **scales)
        dense = jref.attention_ref(j["q"], j["k_cache"], j["v_cache"], j["block_table"], j["seq_lens"],
                                   case.q_lens, sm_scale=0.3, kv_layout=j["kv_layout"], **scales)
    x = make_inputs(case)
    expected_ids = ref.select_blocks_ref(reference("index_scores", case), x["seq_lens"], case.q_lens, **sel)
    assert torch.equal(to_torch(ids), expected_ids)
    # float32 math with HIGHEST-precision dots: float32-exact against float64
    assert rel_err(to_torch(out), attention_reference(case, expected_ids)) < 1e-5
    assert rel_err(to_torch(dense), reference("dense", case)) < 1e-5
