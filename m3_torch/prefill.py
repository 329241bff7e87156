"""PyTorch launchers of the shared kernels for prefill (varlen query rows), as torch custom ops.

The kernels are the decode ones (``m3_torch/decode.py``); only the row maps
differ. Request ``r`` owns query tokens ``cu_seqlens_q[r]:cu_seqlens_q[r+1]``
and, by the position rule, token ``j`` of it sits at
``seq_lens[r] - q_len_r + j`` (chunked prefill: ``seq_lens[r] > q_len_r``, the
prefix is already cached).

``cu_seqlens_q`` is read on the host ONCE (prefill is never graph-captured)
into a :class:`m3_kernels.planner.PrefillPlan` that holds the tile/token
maps; their device copies are cached on the plan. Pass ``plan=`` (from
:func:`prefill_plan`, or a step plan's ``context.prefill``) to share one host
read across layers; ``cu_seqlens_q`` may then be ``None`` (it is never read
again, on any device).
"""

from __future__ import annotations

from typing import Optional

import torch

from m3_kernels import geometry, planner, validate

from ._launch import check_devices
from .decode import launch_attention, launch_index_scores, launch_select_blocks

__all__ = ["prefill_plan", "index_scores_prefill", "select_blocks_prefill", "sparse_prefill", "dense_prefill",
           "msa_prefill"]

def prefill_plan(cu_seqlens_q=None, plan=None) -> planner.PrefillPlan:
    """``plan`` if given, else the plan of ``cu_seqlens_q`` (one host read; syncs a CUDA tensor)."""
    if plan is not None:
        return plan
    if cu_seqlens_q is None:
        raise ValueError("cu_seqlens_q: required unless plan= is given")
    return planner.prefill_plan(cu_seqlens_q.tolist())


def device_tiles(plan: planner.PrefillPlan, heads: int, device):
    """-> (RowTile, tile_map [num_tiles, 4] int32 on ``device``), uploaded once per plan."""
    tile, tile_map = plan.tiles(heads)
    return tile, plan.memo(("torch", str(device), "tile_map", heads), lambda: torch.from_numpy(tile_map).to(device))


def device_token_map(plan: planner.PrefillPlan, device):
    """-> token_map [T, 2] int32 on ``device``, uploaded once per plan."""
    return plan.memo(("torch", str(device), "token_map"), lambda: torch.from_numpy(plan.token_map).to(device))


# -- custom ops: launch only (inputs validated, maps on the device) ------------------

@torch.library.custom_op("m3::index_scores_prefill", mutates_args=("out",))
def _index_scores_op(idx_q: torch.Tensor, index_k_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, tile_map: torch.Tensor, out: torch.Tensor, tokens_per_tile: int) -> None:
    if tile_map.shape[0] == 0:
        return
    tile = geometry.row_tile(idx_q.shape[1], tokens_per_tile)
    launch_index_scores(idx_q, index_k_cache, block_table, seq_lens, out, tile_map=tile_map, tile=tile)


@_index_scores_op.register_fake
def _(idx_q, index_k_cache, block_table, seq_lens, tile_map, out, tokens_per_tile):
    return None


@torch.library.custom_op("m3::select_blocks_prefill", mutates_args=("out",))
def _select_blocks_op(scores: torch.Tensor, seq_lens: torch.Tensor, token_map: torch.Tensor, out: torch.Tensor,
                      topk: int, init_blocks: int, local_blocks: int) -> None:
    if scores.shape[1] == 0:
        return
    launch_select_blocks(scores, seq_lens, out, token_map=token_map, topk=topk, init_blocks=init_blocks,
                         local_blocks=local_blocks)


@_select_blocks_op.register_fake
def _(scores, seq_lens, token_map, out, topk, init_blocks, local_blocks):
    return None


@torch.library.custom_op("m3::paged_attention", mutates_args=("out", "part_out", "part_lse"))
def _attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: Optional[torch.Tensor],
                  block_table: torch.Tensor, seq_lens: torch.Tensor, tile_map: torch.Tensor, out: torch.Tensor,
                  part_out: Optional[torch.Tensor], part_lse: Optional[torch.Tensor], tokens_per_tile: int,
                  sm_scale: float, sparse: bool) -> None:
    """Paged attention over ``tile_map``'s row tiles (prefill maps, or decode maps for a step's
    generation span); ``part_out``/``part_lse``: flat float32 split-K buffers, or None."""
    if tile_map.shape[0] == 0:
        return
    tile = geometry.row_tile(q.shape[1] // k_cache.shape[1], tokens_per_tile)
    launch_attention(q, k_cache, v_cache, block_ids, block_table, seq_lens, out, tile_map=tile_map, tile=tile,
                     sm_scale=sm_scale, sparse=sparse,
                     partials=None if part_out is None else (part_out, part_lse))


@_attention_op.register_fake
def _(q, k_cache, v_cache, block_ids, block_table, seq_lens, tile_map, out, part_out, part_lse, tokens_per_tile,
      sm_scale, sparse):
    return None


# -- public ops ------------------------------------------------------------------------

def _metadata(block_table, seq_lens, cu_seqlens_q):
    num_requests, max_blocks = validate.check_metadata(block_table, seq_lens)
    if cu_seqlens_q is not None:
        validate.check_cu_seqlens(cu_seqlens_q, num_requests)
    return num_requests, max_blocks


def index_scores_prefill(idx_q, index_k_cache, block_table, seq_lens, *, cu_seqlens_q, plan=None, out=None):
    """Per-block causal max of ``idx_q . index_k`` for every query token -> ``[Hi, T, max_blocks]`` float32.

    idx_q [T, Hi, Di]; index_k_cache [pages, 128, Di]; block_table [R, max_blocks]
    int32; seq_lens [R] int32; cu_seqlens_q [R + 1] int32 (any device: read on
    the host once, or not at all with ``plan``). ``-inf`` past each token's
    visible blocks; ``out`` may be any strided view of the output shape.
    """
    num_requests, max_blocks = _metadata(block_table, seq_lens, cu_seqlens_q)
    num_heads, _ = validate.check_index_inputs(idx_q, index_k_cache)
    shape = (num_heads, idx_q.shape[0], max_blocks)
    validate.check_out(out, shape, "float32")
    device = check_devices(idx_q=idx_q, index_k_cache=index_k_cache, block_table=block_table,
                           seq_lens=seq_lens, out=out)
    plan = prefill_plan(cu_seqlens_q, plan)
    validate.check_prefill_plan("idx_q", idx_q, plan, num_requests)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=device)
    tile, tile_map = device_tiles(plan, num_heads, device)
    _index_scores_op(idx_q, index_k_cache, block_table, seq_lens, tile_map, out, tile.tokens_per_tile)
    return out


def select_blocks_prefill(scores, seq_lens, *, cu_seqlens_q, topk=16, init_blocks=0, local_blocks=1, plan=None,
                          out=None):
    """Top-``topk`` blocks per (index head, token) -> ``[Hi, T, topk]`` int32; decode's rules per token.

    Forced: the first ``init_blocks`` and last ``local_blocks`` blocks visible to
    the token; the rest by score (ties: lower id; NaN loses). Ids ascending, then -1.
    """
    validate.check_selection_args(topk, init_blocks, local_blocks)
    validate.check_rank("seq_lens", seq_lens, 1, "[R]")
    validate.check_dtype("seq_lens", seq_lens, "int32")
    num_requests = seq_lens.shape[0]
    if cu_seqlens_q is not None:
        validate.check_cu_seqlens(cu_seqlens_q, num_requests)
    validate.check_rank("scores", scores, 3, "[Hi, T, max_blocks]")
    validate.check_dtype("scores", scores, "float32")
    shape = (scores.shape[0], scores.shape[1], topk)
    validate.check_out(out, shape, "int32")
    device = check_devices(scores=scores, seq_lens=seq_lens, out=out)
    plan = prefill_plan(cu_seqlens_q, plan)
    validate.check_prefill_plan("scores", scores, plan, num_requests, axis=1)
    if out is None:
        out = torch.empty(shape, dtype=torch.int32, device=device)
    _select_blocks_op(scores, seq_lens, device_token_map(plan, device), out, topk, init_blocks, local_blocks)
    return out


def _check_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, plan, out, block_ids=None):
    """-> (plan, out, head_dim, device)."""
    num_requests, _ = _metadata(block_table, seq_lens, cu_seqlens_q)
    _, num_kv_heads, head_dim = validate.check_kv_caches(q, k_cache, v_cache)
    if block_ids is not None:
        validate.check_block_ids(block_ids, num_kv_heads, q.shape[0])
    validate.check_out(out, q.shape, validate.dtype_name(q))
    device = check_devices(q=q, k_cache=k_cache, v_cache=v_cache, block_ids=block_ids, block_table=block_table,
                           seq_lens=seq_lens, out=out)
    plan = prefill_plan(cu_seqlens_q, plan)
    validate.check_prefill_plan("q", q, plan, num_requests)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return plan, out, head_dim, device


def _attention(q, k_cache, v_cache, block_ids, block_table, seq_lens, out, plan, device, sm_scale, sparse):
    tile, tile_map = device_tiles(plan, q.shape[1] // k_cache.shape[1], device)
    _attention_op(q, k_cache, v_cache, block_ids, block_table, seq_lens, tile_map, out, None, None,
                  tile.tokens_per_tile, sm_scale, sparse)


def sparse_prefill(q, k_cache, v_cache, block_ids, block_table, seq_lens, *, cu_seqlens_q, sm_scale=None, plan=None,
                   out=None):
    """Block-sparse GQA attention, each token over its own blocks -> ``[T, Hq, D]`` in q's dtype.

    q [T, Hq, D]; k_cache/v_cache [pages, Hk, 128, D] (any strides); block_ids
    [Hk, T, topk] int32 (-1 skipped); block_table [R, max_blocks] int32;
    seq_lens [R] int32; cu_seqlens_q [R + 1] int32. Causal inside every block
    (the diagonal block included): token at position p sees positions <= p.
    """
    plan, out, head_dim, device = _check_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, plan,
                                                   out, block_ids)
    scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    _attention(q, k_cache, v_cache, block_ids, block_table, seq_lens, out, plan, device, scale, sparse=True)
    return out


def dense_prefill(q, k_cache, v_cache, block_table, seq_lens, *, cu_seqlens_q, sm_scale=None, plan=None, out=None):
    """Causal paged GQA attention over every visible block (layers 0-2) -> ``[T, Hq, D]``."""
    plan, out, head_dim, device = _check_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, plan,
                                                   out)
    scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    _attention(q, k_cache, v_cache, None, block_table, seq_lens, out, plan, device, scale, sparse=False)
    return out


def msa_prefill(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, *, cu_seqlens_q, topk=16,
                init_blocks=0, local_blocks=1, sm_scale=None, plan=None, out=None):
    """``index_scores_prefill`` -> ``select_blocks_prefill`` -> ``sparse_prefill``; returns ``(out, block_ids)``."""
    validate.check_selection_args(topk, init_blocks, local_blocks)
    validate.check_kv_caches(q, k_cache, v_cache)
    validate.check_index_inputs(idx_q, index_k_cache)
    validate.check_index_heads(idx_q.shape[1], k_cache.shape[1])
    plan = prefill_plan(cu_seqlens_q, plan)
    scores = index_scores_prefill(idx_q, index_k_cache, block_table, seq_lens, cu_seqlens_q=cu_seqlens_q, plan=plan)
    block_ids = select_blocks_prefill(scores, seq_lens, cu_seqlens_q=cu_seqlens_q, topk=topk,
                                      init_blocks=init_blocks, local_blocks=local_blocks, plan=plan)
    out = sparse_prefill(q, k_cache, v_cache, block_ids, block_table, seq_lens, cu_seqlens_q=cu_seqlens_q,
                         sm_scale=sm_scale, plan=plan, out=out)
    return out, block_ids
