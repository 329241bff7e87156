"""sparse / dense attention, decode and prefill, vs the float64 reference; JAX bit-identical to torch.

sparse attends over the reference selection of each case (``targets.selected_blocks``),
dense over every visible block with ``sm_scale=0.3``.
"""

import pytest
import torch

import m3_torch
from m3_kernels import launches, maps, tuning
from m3_torch import ops
from m3_torch import reference as ref

from cases import ALL_CASES, TOLERANCE, decode, make_inputs, prefill, random_block_ids, rel_err
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


@pytest.mark.parametrize("topk, splits", [(6, 1), (6, 6), (21, 1), (21, 3), (40, 2)])
@pytest.mark.parametrize("target", targets(["torch"]))
def test_sparse_decode_skips_empty_and_out_of_range_slots_anywhere(target, topk, splits):
    """Valid ids need not come first: -1 and out-of-range ids scattered among them are skipped
    (a split visits only its valid slots, 16 slots a group) and the output is the reference over
    the valid ones; one split, one slot per split, and splits ending inside a group."""
    case = decode("scattered", (300, 129, 5400, 5), hq=4, hk=2, d=16, di=16, topk=topk)
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
    # 4 tiles x 2 KV heads: a target of 8 * splits programs gives `splits` splits
    with tuning.override(sparse_target_programs=8 * splits):
        tile = maps.decode_tile(2, 1, True, max_blocks=x["block_table"].shape[1], topk=topk, num_requests=4,
                                num_kv_heads=2, interpret=target.device == "interpreter")
        launch_splits = tuning.attention(tile=tile,
                                         num_tiles=4, num_kv_heads=2, head_dim=16, topk=topk, max_blocks=1,
                                         sparse=True, interpret=target.device == "interpreter").num_splits
        assert launch_splits == splits
        out = torch.full_like(x["q"], float("nan"))
        m3_torch.sparse_decode(x["q"], x["k_cache"], x["v_cache"], ids.to(dev), x["block_table"],
                               x["seq_lens"], decode_query_len=1, out=out)
    assert rel_err(out, expected) < TOLERANCE["bfloat16"]


@pytest.mark.parametrize("packs", [True, False])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("target", targets(["torch"]))
def test_sparse_prefill_tiles_of_several_tokens_or_one(target, packs, splits, monkeypatch):
    """Sparse prefill packs up to 8 tokens a tile (each distinct chosen block read once for all of
    them) or gives each token its own tile (``maps.prefill_tile_kind``, by the table width): both
    equal the reference, on 1 and 3 splits, with -1 and out-of-range ids anywhere and a NaN query
    row (NaN out, the other heads of its token unharmed)."""
    case = prefill("tile_kinds", (13, 1, 9), (3000, 129, 700), hq=4, hk=2, d=16, di=16, topk=6)
    dev = target.torch_device
    x = make_inputs(case, dev)
    ids = random_block_ids(case)
    g = torch.Generator().manual_seed(5)
    for h in range(case.hk):
        for t in range(case.num_tokens):
            ids[h, t] = ids[h, t, torch.randperm(case.topk, generator=g)]   # -1 anywhere
    ids[0, 3, 0] = 10 ** 6                                                  # past the table
    q = x["q"].clone()
    q[4, 1, 3] = float("nan")
    lens = x["seq_lens"].cpu()
    expected = ref.attention_ref(q, x["k_cache"], x["v_cache"], x["block_table"], lens, case.q_lens, ids)
    monkeypatch.setattr(maps, "packs_sparse_decode", lambda *args: packs)
    kind = maps.prefill_tile_kind(True, x["block_table"].shape[1], case.topk)
    cu = torch.tensor(case.cu_seqlens, dtype=torch.int32)
    plan = m3_torch.prefill_plan(cu)
    tile, tile_map = plan.tiles(case.hq // case.hk, kind)
    assert tile.tokens_per_tile == (8 if packs else 1)
    with tuning.override(sparse_target_programs=tile_map.shape[0] * case.hk * splits):
        out = torch.full_like(q, float("nan"))
        m3_torch.sparse_prefill(q, x["k_cache"], x["v_cache"], ids.to(dev), x["block_table"], x["seq_lens"],
                                cu_seqlens_q=cu.to(dev), plan=plan, out=out)
    assert torch.isnan(out[4, 1]).all()
    out[4, 1], expected[4, 1] = 0, 0
    assert rel_err(out, expected) < TOLERANCE["bfloat16"]


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("target", targets(["torch"]))
def test_dense_prefill_tiles_of_64_rows_run_whole_blocks_unmasked(target, splits):
    """Dense prefill tiles of 64+ rows (8 tokens x a group of 8: the GPU's M3 tiles; the case list's
    groups give 32 rows at most) run the blocks that end before their first token without the causal
    mask, the rest with it. Tiles whose first token sits one row before a block's last (position 126),
    on its last (127), its first (128) or inside it (135, 387, 395), on 1 and 2 splits: the float64
    reference."""
    case = prefill("whole_blocks", (4, 10, 2, 13), (130, 137, 130, 400), hq=8, hk=1, d=16, di=16, dtype="float32")
    dev = target.torch_device
    x = make_inputs(case, dev)
    cu = torch.tensor(case.cu_seqlens, dtype=torch.int32)
    plan = m3_torch.prefill_plan(cu)
    tile, tile_map = plan.tiles(case.hq // case.hk)
    assert tile.block_m >= 64
    with tuning.override(target_programs=tile_map.shape[0] * case.hk * splits):
        out = torch.full_like(x["q"], float("nan"))
        m3_torch.dense_prefill(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                               cu_seqlens_q=cu.to(dev), plan=plan, out=out)
    expected = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"].cpu(),
                                 case.q_lens)
    assert rel_err(out, expected) < TOLERANCE["float32"]


def test_mtp_decode_packs_only_with_enough_programs_on_a_gpu():
    """Several query tokens per request share a tile where that at least halves the block visits,
    and, on a GPU, the packed launch still has SPARSE_PACK_MIN_PROGRAMS (request, KV head) programs;
    the interpreter (cost per program) packs whenever the ratio says so."""
    def tpt(n, max_blocks, num_requests, interpret=False, sparse=True):
        return maps.decode_tile(16, n, sparse, max_blocks=max_blocks, topk=16, num_requests=num_requests,
                                num_kv_heads=4, interpret=interpret).tokens_per_tile
    assert maps.SPARSE_PACK_MIN_PROGRAMS == 32
    assert tpt(8, 36, 8) == 8 and tpt(8, 36, 4) == 1           # 32 / 16 programs at 4k
    assert tpt(8, 36, 1, interpret=True) == 8
    assert tpt(8, 141, 64) == 1                                 # 16k: the union is too wide to share
    assert tpt(8, 141, 1, sparse=False) == 8                    # dense decode always packs


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("target", targets(["torch"]))
def test_mtp_sparse_decode_packed_or_one_token_per_tile(target, packed, monkeypatch):
    """Both MTP decode layouts (``maps.decode_tile``) equal the reference, split and unsplit."""
    monkeypatch.setattr(maps, "SPARSE_PACK_RATIO", 0 if packed else 1 << 30)
    monkeypatch.setattr(maps, "SPARSE_PACK_MIN_PROGRAMS", 0)
    case = decode("mtp_layouts", (1000, 129, 700), n=4, hq=4, hk=2, d=16, di=16, topk=6)
    dev = target.torch_device
    x = make_inputs(case, dev)
    ids = random_block_ids(case)
    expected = ref.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"].cpu(),
                                 case.q_lens, ids)
    for splits in (1, 3):
        with tuning.override(sparse_target_programs=(3 if packed else 12) * case.hk * splits):
            tile = maps.decode_tile(2, 4, True, max_blocks=x["block_table"].shape[1], topk=case.topk, num_requests=3,
                                    num_kv_heads=case.hk, interpret=target.device == "interpreter")
            assert tile.tokens_per_tile == (4 if packed else 1)
            out = torch.full_like(x["q"], float("nan"))
            m3_torch.sparse_decode(x["q"], x["k_cache"], x["v_cache"], ids.to(dev), x["block_table"],
                                   x["seq_lens"], decode_query_len=4, out=out)
        assert rel_err(out, expected) < TOLERANCE["bfloat16"], (packed, splits)


@pytest.mark.parametrize("target", targets(["torch"]))
def test_row_tiles_on_grid_axis_0(target, monkeypatch):
    """Launches of more row tiles than a CUDA grid's axis 1 holds (65535: a long prompt) put them on
    axis 0; forced here on a small prompt, attention (2 splits) and the indexer give the same bits."""
    case = prefill("axis0", (13, 1, 9), (3000, 129, 700), hq=4, hk=2, d=16, di=16, topk=6)
    dev = target.torch_device
    x = make_inputs(case, dev)
    cu = torch.tensor(case.cu_seqlens, dtype=torch.int32)
    plan = m3_torch.prefill_plan(cu)
    kw = dict(cu_seqlens_q=cu.to(dev), plan=plan)

    def both():
        with tuning.override(target_programs=2 * 5 * case.hk):   # 5 attention tiles x 2 KV heads: 2 splits
            out = m3_torch.dense_prefill(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], **kw)
        scores = m3_torch.index_scores_prefill(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"], **kw)
        return out, scores

    out, scores = both()
    monkeypatch.setattr(launches, "MAX_GRID_Y", 1)
    launch = launches.index_scores(idx_q=ops.operand(x["idx_q"]), index_k=ops.operand(x["index_k_cache"]),
                                   block_table=ops.operand(x["block_table"]), seq_lens=None,
                                   tile_map=plan.tiles(case.hk, "index")[1], tile=plan.tiles(case.hk, "index")[0],
                                   out_strides=(1, 1, 1), dtype="bfloat16", interpret=True, skip_blocks=0)
    assert launch.constexprs["TILES_ON_AXIS_0"] and launch.grid[0] == plan.tiles(case.hk, "index")[1].shape[0]
    out0, scores0 = both()
    assert torch.equal(out0, out) and torch.equal(scores0.nan_to_num(), scores.nan_to_num())
