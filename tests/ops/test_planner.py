"""The step planner (m3_kernels.planner): spans, bounds, padding, maps, workspaces, errors. Host only."""

import itertools

import numpy as np
import pytest

from m3_kernels import maps, planner

CFG = dict(num_q_heads=16, num_kv_heads=2, head_dim=64, max_batch=64, max_num_tokens=2048, max_blocks=64, topk=8)


def make(**over):
    return planner.StepPlanner(planner.StepConfig(**{**CFG, **over}))


def cu(q_lens):
    return np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)


def test_mixed_batch_spans_and_bounds():
    p = make()
    # one long context row (5000 tokens of KV) must not widen the generation bound
    seq_lens, q_lens = [5000, 37, 300, 129, 0], [300, 37, 2, 2, 2]
    plan = p.plan(seq_lens, cu_seqlens_q=cu(q_lens), num_context=2)
    ctx, gen = plan.context, plan.generation
    assert (ctx.num_rows, ctx.num_tokens, ctx.max_kv_len) == (2, 337, 5000)
    assert ctx.max_blocks == 64                      # ceil(5000/128)=40 -> 64
    assert (gen.row_start, gen.num_rows, gen.token_start, gen.decode_query_len) == (2, 3, 337, 2)
    assert (gen.num_tokens, gen.max_kv_len, gen.max_blocks, gen.num_padding_rows) == (6, 300, 4, 0)
    assert (plan.num_rows, plan.num_tokens) == (5, 343)
    assert not plan.cuda_graph
    assert ctx.prefill.q_lens == (300, 37)
    np.testing.assert_array_equal(ctx.prefill.cu_seqlens, [0, 300, 337])
    # same result from q_lens
    plan2 = p.plan(seq_lens, q_lens=q_lens, num_context=2)
    assert plan2.generation == gen and plan2.context.prefill.q_lens == ctx.prefill.q_lens


def test_generation_only_padded_for_graphs():
    p = make(graph_batch_sizes=(1, 2, 4, 8, 16))
    plan = p.plan([700, 9, 1], q_lens=[1, 1, 1], num_context=0)
    gen = plan.generation
    assert (gen.num_rows, gen.num_padding_rows, gen.decode_query_len, gen.num_tokens) == (4, 1, 1, 4)
    assert plan.padded_batch_size == 4 and plan.cuda_graph
    assert gen.max_kv_len == 700 and gen.max_blocks == 8
    assert plan.context.num_rows == 0 and plan.context.num_tokens == 0
    assert plan.context.prefill.q_lens == () and plan.context.prefill.token_map.shape == (0, 2)
    # MTP: n = 3, padding rows already in the batch (seq_len 0) count as generation rows
    plan = p.plan([50, 0, 0], q_lens=[3, 3, 3], num_context=0)
    assert (plan.generation.num_rows, plan.generation.num_padding_rows, plan.num_tokens) == (4, 1, 12)
    assert plan.generation.max_kv_len == 50 and plan.generation.max_blocks == 1
    # past the largest graph: eager, no padding
    plan = p.plan([5] * 17, q_lens=[1] * 17, num_context=0)
    assert plan.generation.num_rows == 17 and not plan.cuda_graph
    # a mixed step is never captured, so never padded
    plan = p.plan([5, 5, 5], q_lens=[4, 1, 1], num_context=1)
    assert plan.generation.num_padding_rows == 0 and not plan.cuda_graph


def test_context_only_and_empty():
    p = make()
    plan = p.plan([1000, 5, 0], cu_seqlens_q=cu([300, 5, 0]), num_context=3)
    assert plan.generation.num_rows == 0 and plan.generation.decode_query_len == 0 and plan.generation.num_tokens == 0
    assert plan.generation.token_start == 305
    assert plan.context.num_tokens == 305 and plan.context.max_blocks == 8
    plan = p.plan([], q_lens=[], num_context=0)
    assert plan.num_rows == 0 and plan.num_tokens == 0
    assert plan.workspace_use()["scores"] == 0


def test_prefill_maps_are_varlen_maps():
    p = make()
    q_lens = [300, 1, 0, 17]
    plan = p.plan([1300, 1, 0, 17, 40], q_lens=q_lens + [1], num_context=4)
    pre = plan.context.prefill
    for heads, kind in itertools.product((CFG["num_q_heads"] // CFG["num_kv_heads"], CFG["num_kv_heads"]),
                                         planner.TILE_KINDS):
        tile, tile_map = pre.tiles(heads, kind)
        assert tile == dict(attention=maps.row_tile(heads, 300), token=maps.row_tile(heads, 1),
                            index=maps.index_tile(heads, 300))[kind]
        exact, token_map = maps.varlen_maps(q_lens, tile.tokens_per_tile)
        # padded to the bound with empty tiles that read nothing
        assert tile_map.shape[0] == pre.max_tiles(heads, kind) == maps.max_row_tiles(318, 4, tile.tokens_per_tile)
        np.testing.assert_array_equal(tile_map[:len(exact)], exact)
        assert (tile_map[len(exact):, 3] == 0).all() and (tile_map[len(exact):, 2] < -(1 << 20)).all()
        np.testing.assert_array_equal(pre.token_map, token_map)
        assert pre.tiles(heads, kind)[1] is tile_map       # built once
    # the indexer's tiles fill 128 rows (2 heads x 64 tokens); attention's stop at 8 tokens
    assert pre.tiles(2, "index")[0].tokens_per_tile == 64 and pre.tiles(2)[0].tokens_per_tile == 8
    with pytest.raises(ValueError, match="tile kind"):
        pre.tiles(2, "sparse")
    assert pre.token_map.shape == (318, 2)
    assert pre.token_map[0].tolist() == [0, -300] and pre.token_map[-1].tolist() == [3, -1]
    assert pre.memo("k", lambda: object()) is pre.memo("k", lambda: None)


def test_varlen_maps_match_their_definition():
    """maps.varlen_maps (vectorised) against the maps written out request by request, tile by tile."""
    def by_loops(q_lens, tpt, num_tiles):
        tiles, tokens, t0 = [], [], 0
        for r, q_len in enumerate(q_lens):
            tiles += [(r, t0 + j0, j0 - q_len, min(tpt, q_len - j0)) for j0 in range(0, q_len, tpt)]
            tokens += [(r, j - q_len) for j in range(q_len)]
            t0 += q_len
        tiles += [(0, 0, maps.EMPTY_TILE_POSITION, 0)] * (num_tiles - len(tiles))
        return np.asarray(tiles, np.int32).reshape(-1, 4), np.asarray(tokens, np.int32).reshape(-1, 2)

    rng = np.random.default_rng(1)
    for _ in range(300):
        q_lens = [int(x) for x in rng.integers(0, 40, int(rng.integers(0, 7)))]
        tpt = int(rng.choice([1, 2, 8, 32]))
        pad = maps.max_row_tiles(sum(q_lens), len(q_lens), tpt) + int(rng.integers(0, 3))
        for got, want in zip(maps.varlen_maps(q_lens, tpt, pad), by_loops(q_lens, tpt, pad)):
            assert got.dtype == want.dtype and got.shape == want.shape and (got == want).all(), (q_lens, tpt)
    with pytest.raises(ValueError, match="do not fit"):
        maps.varlen_maps([5, 9], 4, num_tiles=3)


def test_max_row_tiles_is_an_upper_bound():
    rng = np.random.default_rng(0)
    for _ in range(300):
        R = int(rng.integers(1, 9))
        q_lens = rng.integers(0, 300, R)
        for tpt in (1, 2, 8, 64, 128):
            tiles, _ = maps.varlen_maps(q_lens, tpt)
            assert tiles.shape[0] <= maps.max_row_tiles(int(q_lens.sum()), R, tpt)
    assert maps.max_row_tiles(300, 1, 64) == 5


def test_workspace_layout_fits_every_step():
    """The arena is sized once, at the max batch; every step's use fits it."""
    rng = np.random.default_rng(1)
    for over in ({}, dict(num_q_heads=64, num_kv_heads=4, head_dim=128, topk=16), dict(num_q_heads=2, num_kv_heads=2),
                 dict(num_q_heads=8, num_kv_heads=1, max_num_tokens=300)):
        p = make(graph_batch_sizes=(1, 2, 4, 8), **over)
        layout = p.layout
        regions = [r for _, r in layout.regions]
        assert all(r.offset % planner.ARENA_ALIGN == 0 for r in regions)
        assert all(a.offset + a.nbytes <= b.offset for a, b in zip(regions, regions[1:]))
        assert regions[-1].offset + regions[-1].nbytes <= layout.nbytes
        for _ in range(200):
            R = int(rng.integers(0, 20))
            Rc = int(rng.integers(0, R + 1))
            n = int(rng.integers(1, 9))
            q_lens = [int(x) for x in rng.integers(0, rng.choice([8, 64, 400]), Rc)] + [n] * (R - Rc)
            if sum(q_lens) + 8 * n > p.config.max_num_tokens:
                continue
            seq_lens = [q + int(rng.integers(0, 4000)) for q in q_lens]
            plan = p.plan(seq_lens, q_lens=q_lens, num_context=Rc)
            assert plan.layout is layout                  # same arena every step
            for name, used in plan.workspace_use().items():
                assert used <= layout[name].numel, (name, q_lens)


def test_block_bound():
    assert planner.block_bound(0, 64) == 1
    assert planner.block_bound(128, 64) == 1
    assert planner.block_bound(129, 64) == 2
    assert planner.block_bound(5 * 128 + 1, 64) == 8
    assert planner.block_bound(64 * 128, 64) == 64
    assert planner.block_bound(40 * 128, 48) == 48   # never past the table


@pytest.mark.parametrize("kwargs, words", [
    # generation rows must be the suffix, with one query length
    (dict(seq_lens=[10, 300, 20], q_lens=[1, 300, 1], num_context=0), "share one query length"),
    (dict(seq_lens=[300, 10, 20], q_lens=[300, 1, 2], num_context=1), "row 2 has 2"),
    (dict(seq_lens=[10, 0], q_lens=[0, 0], num_context=0), "generation rows need >= 1"),
    (dict(seq_lens=[10], q_lens=[1], num_context=2), "num_context"),
    (dict(seq_lens=[10], q_lens=[1], num_context=-1), "num_context"),
    (dict(seq_lens=[10, 5], q_lens=[1], num_context=0), "one per row"),
    (dict(seq_lens=[10], cu_seqlens_q=[1, 2], num_context=1), "starting at 0"),
    (dict(seq_lens=[10, 10], cu_seqlens_q=[0, 5, 4], num_context=2), "non-decreasing"),
    (dict(seq_lens=[10], num_context=1), "exactly one"),
    (dict(seq_lens=[10], q_lens=[1], cu_seqlens_q=[0, 1], num_context=1), "exactly one"),
    (dict(seq_lens=[-1], q_lens=[1], num_context=1), ">= 0"),
    (dict(seq_lens=[3000], q_lens=[3000], num_context=1), "max_num_tokens"),
    (dict(seq_lens=[1] * 65, q_lens=[1] * 65, num_context=0), "max_batch"),
    (dict(seq_lens=[64 * 128 + 1], q_lens=[1], num_context=0), "max_blocks"),
    (dict(seq_lens=[[10]], q_lens=[1], num_context=0), "1-D"),
    (dict(seq_lens=[10.5], q_lens=[1], num_context=0), "integers"),
])
def test_errors(kwargs, words):
    with pytest.raises((ValueError, TypeError), match=words):
        make().plan(**kwargs)


@pytest.mark.parametrize("over, words", [
    (dict(num_q_heads=6, num_kv_heads=4), "multiple"),
    (dict(max_batch=0), "max_batch"),
    (dict(graph_batch_sizes=(1, 128)), "graph_batch_sizes"),
])
def test_config_errors(over, words):
    with pytest.raises(ValueError, match=words):
        make(**over)


def test_graph_padding_past_token_budget_is_an_error():
    p = make(max_num_tokens=16, graph_batch_sizes=(8,))
    with pytest.raises(ValueError, match="max_num_tokens"):
        p.plan([5] * 5, q_lens=[3] * 5, num_context=0)   # 8 rows * 3 tokens > 16
