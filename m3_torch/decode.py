"""PyTorch launchers of the shared decode kernels, as torch custom ops.

Public functions validate (shapes and dtypes only), allocate ``out`` when it is
not given, and call a ``torch.ops.m3.*`` custom op that launches the kernels
and writes ``out`` in place. CUDA tensors run the compiled kernels, CPU tensors
the same kernels in Triton's interpreter.
"""

from __future__ import annotations

import math

import torch

from m3_kernels import geometry, validate

from ._launch import check_devices, decode_maps, kernel, launch, workspace

_ATTN = "attention"
_INDEX = "index"


# -- index_scores ------------------------------------------------------------------

def launch_index_scores(idx_q, index_k_cache, block_table, seq_lens, out, *, tile_map, tile):
    """Launch the indexer over ``tile_map``'s row tiles (decode or prefill) into ``out``."""
    max_blocks = block_table.shape[1]
    num_heads, head_dim = idx_q.shape[1], idx_q.shape[2]
    plan = geometry.index_plan(tile=tile, num_tiles=tile_map.shape[0], head_dim=head_dim, max_blocks=max_blocks)
    args = geometry.index_scores_args(
        idx_q=idx_q, index_k=index_k_cache, block_table=block_table, seq_lens=seq_lens, tile_map=tile_map,
        k_off=0, q_strides=idx_q.stride(), k_strides=index_k_cache.stride(), bt_strides=block_table.stride(),
        scores_strides=out.stride(), max_blocks=max_blocks, blocks_per_program=plan.blocks_per_program)
    launch(kernel(_INDEX, "index_scores_kernel", idx_q.device), (plan.num_chunks, plan.num_tiles),
           [*args, out], num_warps=plan.num_warps, num_stages=plan.num_stages,
           **plan.constexprs(num_heads=num_heads, head_dim=head_dim))


@torch.library.custom_op("m3::index_scores", mutates_args=("out",))
def _index_scores_op(idx_q: torch.Tensor, index_k_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, out: torch.Tensor, decode_query_len: int) -> None:
    tile = geometry.row_tile(idx_q.shape[1], decode_query_len)
    tile_map, _ = decode_maps(idx_q.device, block_table.shape[0], decode_query_len, tile.tokens_per_tile)
    launch_index_scores(idx_q, index_k_cache, block_table, seq_lens, out, tile_map=tile_map, tile=tile)


@_index_scores_op.register_fake
def _(idx_q, index_k_cache, block_table, seq_lens, out, decode_query_len):
    return None


def index_scores(idx_q, index_k_cache, block_table, seq_lens, *, decode_query_len, out=None):
    """Per-block causal max of ``idx_q . index_k`` -> scores ``[Hi, T, max_blocks]`` float32.

    idx_q [T, Hi, Di]; index_k_cache [pages, 128, Di]; block_table [R, max_blocks]
    int32; seq_lens [R] int32. ``-inf`` past each token's visible blocks.
    ``out`` may be any strided view of the output shape.
    """
    num_requests, max_blocks = validate.check_metadata(block_table, seq_lens)
    num_heads, _ = validate.check_index_inputs(idx_q, index_k_cache)
    validate.check_tokens("idx_q", idx_q, num_requests, decode_query_len)
    shape = (num_heads, idx_q.shape[0], max_blocks)
    validate.check_out(out, shape, "float32")
    device = check_devices(idx_q=idx_q, index_k_cache=index_k_cache, block_table=block_table,
                           seq_lens=seq_lens, out=out)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=device)
    _index_scores_op(idx_q, index_k_cache, block_table, seq_lens, out, decode_query_len)
    return out


# -- select_blocks -----------------------------------------------------------------

def launch_select_blocks(scores, seq_lens, out, *, token_map, topk, init_blocks, local_blocks):
    """Launch the selection, one program per (token, index head), into ``out``."""
    num_heads, num_tokens, max_blocks = scores.shape
    args = geometry.select_args(scores=scores, seq_lens=seq_lens, token_map=token_map,
                                scores_strides=scores.stride(), ids_strides=out.stride(), max_blocks=max_blocks)
    launch(kernel(_INDEX, "select_blocks_kernel", scores.device), (num_tokens, num_heads), [*args, out],
           num_warps=geometry.select_num_warps(num_tokens * num_heads, max_blocks), num_stages=1,
           **geometry.select_constexprs(topk=topk, init_blocks=init_blocks, local_blocks=local_blocks,
                                        max_blocks=max_blocks))


@torch.library.custom_op("m3::select_blocks", mutates_args=("out",))
def _select_blocks_op(scores: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, decode_query_len: int,
                      topk: int, init_blocks: int, local_blocks: int) -> None:
    _, token_map = decode_maps(scores.device, seq_lens.shape[0], decode_query_len, 1)
    launch_select_blocks(scores, seq_lens, out, token_map=token_map, topk=topk, init_blocks=init_blocks,
                         local_blocks=local_blocks)


@_select_blocks_op.register_fake
def _(scores, seq_lens, out, decode_query_len, topk, init_blocks, local_blocks):
    return None


def select_blocks(scores, seq_lens, *, decode_query_len, topk=16, init_blocks=0, local_blocks=1, out=None):
    """Top-``topk`` blocks per (index head, token) -> ``[Hi, T, topk]`` int32.

    Forced: the first ``init_blocks`` and last ``local_blocks`` visible blocks;
    the rest by score (ties: lower id; NaN loses). Ids ascending, then -1.
    """
    num_heads = validate.check_select_inputs(scores, seq_lens, decode_query_len, topk, init_blocks, local_blocks)
    shape = (num_heads, scores.shape[1], topk)
    validate.check_out(out, shape, "int32")
    device = check_devices(scores=scores, seq_lens=seq_lens, out=out)
    if out is None:
        out = torch.empty(shape, dtype=torch.int32, device=device)
    _select_blocks_op(scores, seq_lens, out, decode_query_len, topk, init_blocks, local_blocks)
    return out


# -- sparse_decode / dense_decode --------------------------------------------------

def launch_attention(q, k_cache, v_cache, block_ids, block_table, seq_lens, out, *, tile_map, tile,
                     sm_scale, sparse, allow_split=True, partials=None):
    """Launch the paged attention kernel (+ split merge) over ``tile_map``'s rows.

    ``partials``: optional flat float32 buffers ``(partial_out, partial_lse)``
    for the split-K workspaces (a step's arena); default: per-device workspaces.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, max_blocks = k_cache.shape[1], block_table.shape[1]
    topk = block_ids.shape[2] if sparse else 0
    plan = geometry.attention_plan(tile=tile, num_tiles=tile_map.shape[0], num_kv_heads=num_kv_heads,
                                   head_dim=head_dim, topk=topk, max_blocks=max_blocks, sparse=sparse,
                                   allow_split=allow_split)
    partial_shapes = plan.partial_shapes(num_tokens, num_q_heads, head_dim)
    if partial_shapes is None:
        target, lse = out, out  # lse unused with one split
        o_strides = (*out.stride()[:2], 0, out.stride()[2])
    else:
        if partials is None:
            target = workspace(q.device, "attention_partial_out", partial_shapes[0])
            lse = workspace(q.device, "attention_partial_lse", partial_shapes[1])
        else:
            target, lse = (buf[:math.prod(shape)].view(shape) for buf, shape in zip(partials, partial_shapes))
        o_strides = geometry.partial_out_strides(num_q_heads, plan.num_splits, head_dim)
    ids = block_ids if sparse else block_table  # dense: never read
    args = geometry.attention_args(
        q=q, k=k_cache, v=v_cache, block_ids=ids, block_table=block_table, seq_lens=seq_lens, tile_map=tile_map,
        sm_scale=sm_scale, k_off=0, v_off=0, q_strides=q.stride(), k_strides=k_cache.stride(),
        v_strides=v_cache.stride(), ids_strides=ids.stride() if sparse else (0, 0, 0),
        bt_strides=block_table.stride(), o_strides=o_strides)
    launch(kernel(_ATTN, "paged_attention_kernel", q.device), (plan.num_splits, plan.num_tiles, num_kv_heads),
           [*args, target, lse], num_warps=plan.num_warps, num_stages=plan.num_stages,
           **plan.constexprs(num_q_heads=num_q_heads, head_dim=head_dim, topk=topk, sparse=sparse))
    if partial_shapes is not None:
        launch(kernel(_ATTN, "merge_splits_kernel", q.device), (num_tokens, num_q_heads),
               [target, lse, *out.stride(), out], num_warps=4, num_stages=1,
               **geometry.merge_constexprs(num_q_heads, head_dim, plan.num_splits))


def _decode_attention(q, k_cache, v_cache, block_ids, block_table, seq_lens, out, decode_query_len, sm_scale,
                      sparse):
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    tile = geometry.decode_tile(num_q_heads // num_kv_heads, decode_query_len, sparse,
                                max_blocks=block_table.shape[1], topk=block_ids.shape[2] if sparse else 0)
    tile_map, _ = decode_maps(q.device, block_table.shape[0], decode_query_len, tile.tokens_per_tile)
    launch_attention(q, k_cache, v_cache, block_ids, block_table, seq_lens, out, tile_map=tile_map, tile=tile,
                     sm_scale=sm_scale, sparse=sparse)


@torch.library.custom_op("m3::sparse_decode", mutates_args=("out",))
def _sparse_decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                      block_table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, decode_query_len: int,
                      sm_scale: float) -> None:
    _decode_attention(q, k_cache, v_cache, block_ids, block_table, seq_lens, out, decode_query_len, sm_scale,
                      sparse=True)


@_sparse_decode_op.register_fake
def _(q, k_cache, v_cache, block_ids, block_table, seq_lens, out, decode_query_len, sm_scale):
    return None


@torch.library.custom_op("m3::dense_decode", mutates_args=("out",))
def _dense_decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, out: torch.Tensor, decode_query_len: int, sm_scale: float) -> None:
    _decode_attention(q, k_cache, v_cache, None, block_table, seq_lens, out, decode_query_len, sm_scale,
                      sparse=False)


@_dense_decode_op.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, out, decode_query_len, sm_scale):
    return None


def _check_attention(q, k_cache, v_cache, block_table, seq_lens, decode_query_len, out, block_ids=None):
    num_requests, _ = validate.check_metadata(block_table, seq_lens)
    _, num_kv_heads, head_dim = validate.check_kv_caches(q, k_cache, v_cache)
    validate.check_tokens("q", q, num_requests, decode_query_len)
    if block_ids is not None:
        validate.check_block_ids(block_ids, num_kv_heads, q.shape[0])
    validate.check_out(out, q.shape, validate.dtype_name(q))
    device = check_devices(q=q, k_cache=k_cache, v_cache=v_cache, block_ids=block_ids, block_table=block_table,
                           seq_lens=seq_lens, out=out)
    return out if out is not None else torch.empty_like(q, memory_format=torch.contiguous_format), head_dim, device


def sparse_decode(q, k_cache, v_cache, block_ids, block_table, seq_lens, *, decode_query_len, sm_scale=None,
                  out=None):
    """Block-sparse GQA decode attention -> ``[T, Hq, D]`` in q's dtype.

    q [T, Hq, D]; k_cache/v_cache [pages, Hk, 128, D] (any strides: pass an NHD
    store as ``cache.permute(0, 2, 1, 3)``); block_ids [Hk, T, topk] int32 (-1
    skipped; the ids of one row must be distinct, as ``select_blocks`` writes
    them); block_table [R, max_blocks] int32; seq_lens [R] int32.
    """
    out, head_dim, _ = _check_attention(q, k_cache, v_cache, block_table, seq_lens, decode_query_len, out,
                                        block_ids)
    scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    _sparse_decode_op(q, k_cache, v_cache, block_ids, block_table, seq_lens, out, decode_query_len, scale)
    return out


def dense_decode(q, k_cache, v_cache, block_table, seq_lens, *, decode_query_len, sm_scale=None, out=None):
    """Paged GQA decode attention over every visible block -> ``[T, Hq, D]``."""
    out, head_dim, _ = _check_attention(q, k_cache, v_cache, block_table, seq_lens, decode_query_len, out)
    scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    _dense_decode_op(q, k_cache, v_cache, block_table, seq_lens, out, decode_query_len, scale)
    return out


# -- msa_decode -----------------------------------------------------------------------

def msa_decode(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, *, decode_query_len, topk=16,
               init_blocks=0, local_blocks=1, sm_scale=None, out=None):
    """``index_scores`` -> ``select_blocks`` -> ``sparse_decode``; returns ``(out, block_ids)``.

    The scores live in a persistent per-device workspace, reused across calls.
    """
    validate.check_selection_args(topk, init_blocks, local_blocks)
    num_requests, max_blocks = validate.check_metadata(block_table, seq_lens)
    num_index_heads, _ = validate.check_index_inputs(idx_q, index_k_cache)
    validate.check_tokens("idx_q", idx_q, num_requests, decode_query_len)
    out, _, device = _check_attention(q, k_cache, v_cache, block_table, seq_lens, decode_query_len, out)
    validate.check_index_heads(num_index_heads, k_cache.shape[1])
    check_devices(q=q, idx_q=idx_q, index_k_cache=index_k_cache)
    scores = workspace(device, "index_scores", (num_index_heads, q.shape[0], max_blocks))
    index_scores(idx_q, index_k_cache, block_table, seq_lens, decode_query_len=decode_query_len, out=scores)
    block_ids = select_blocks(scores, seq_lens, decode_query_len=decode_query_len, topk=topk,
                              init_blocks=init_blocks, local_blocks=local_blocks)
    sparse_decode(q, k_cache, v_cache, block_ids, block_table, seq_lens, decode_query_len=decode_query_len,
                  sm_scale=sm_scale, out=out)
    return out, block_ids
