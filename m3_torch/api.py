"""The public torch ops (SPEC.md): validate once, pick the maps, call the kernels' custom ops.

Decode, prefill and the mixed step are siblings over the same four custom ops
(``m3_torch.ops``); they differ only in the tile/token maps they hand them:
decode maps from ``(R, decode_query_len)``, prefill maps from a
:class:`~m3_kernels.planner.PrefillPlan` (``cu_seqlens_q`` read on the host
once; pass ``plan=`` to share one read across layers), and a step's spans from
its :class:`~m3_kernels.planner.StepPlan`. Every op takes ``out=`` (any
strides) and, for caches, any strides whose offsets are multiples of 16
elements (an NHD store is ``cache.permute(0, 2, 1, 3)``).

FP8 caches (SPEC.md, "FP8 caches"): any cache may be ``torch.float8_e4m3fn``.
The ops that read K/V take ``k_scale=``/``v_scale=`` (K = stored K * k_scale):
None (1.0), a Python float, or a float32 tensor of shape [] or [1] on the
caches' device, which the kernels read from memory (a captured graph takes new
values written into it). The index-K cache is unscaled.
"""

from __future__ import annotations

import functools

import torch

from m3_kernels import backends, maps, planner, validate

from . import cute_ops, guards, ops

__all__ = ["index_scores", "select_blocks", "sparse_decode", "dense_decode", "msa_decode", "index_scores_prefill",
           "select_blocks_prefill", "sparse_prefill", "dense_prefill", "msa_prefill", "msa_attention_step",
           "prefill_plan"]


def _empty(shape, dtype, device, out):
    return out if out is not None else torch.empty(shape, dtype=dtype, device=device)


def _scorer(backend, idx_q, index_k_cache, skip_blocks: int = 0):
    """The indexer op of ``backend`` (None: ``$M3_INDEXER_SCORE``, else "triton") for these shapes,
    dtypes and device: ``ops.index_scores`` or ``cute_ops.index_scores`` (m3_kernels.backends).
    ``skip_blocks``: the MSA ops pass ``topk``; the Triton scorer then leaves tiles that see at most
    that many blocks unscored (selection takes all their blocks unread); the CuTeDSL one scores all."""
    device = idx_q.device
    name = backends.check_indexer_backend(
        backend, num_heads=int(idx_q.shape[1]), head_dim=int(idx_q.shape[2]), dtype=validate.dtype_name(idx_q),
        cache_dtype=validate.dtype_name(index_k_cache), device=device.type,
        capability=ops.device_capability(device))
    return functools.partial(ops.index_scores, skip_blocks=skip_blocks) if name == "triton" else cute_ops.index_scores


def _dense_prefill_backend(backend, q, k_cache) -> str:
    """The dense prefill backend of one call (None: ``$M3_DENSE_PREFILL``, else "triton"), checked
    against the shapes, the dtypes and the device (m3_kernels.backends)."""
    return backends.check_dense_prefill_backend(
        backend, group=int(q.shape[1]) // int(k_cache.shape[1]), head_dim=int(q.shape[2]),
        dtype=validate.dtype_name(q), cache_dtype=validate.dtype_name(k_cache), device=q.device.type,
        capability=ops.device_capability(q.device))


def _sparse_prefill_backend(backend, q, k_cache, topk: int) -> str:
    """The sparse prefill backend of one call with ``topk`` block ids per token (None:
    ``$M3_SPARSE_PREFILL``, else "triton"), checked against the shapes, the dtypes and the device
    (m3_kernels.backends)."""
    return backends.check_sparse_prefill_backend(
        backend, group=int(q.shape[1]) // int(k_cache.shape[1]), head_dim=int(q.shape[2]), topk=int(topk),
        dtype=validate.dtype_name(q), cache_dtype=validate.dtype_name(k_cache), device=q.device.type,
        capability=ops.device_capability(q.device))


def prefill_plan(cu_seqlens_q=None, plan=None) -> planner.PrefillPlan:
    """``plan`` if given, else the plan of ``cu_seqlens_q`` (one host read: syncs a CUDA tensor)."""
    if plan is not None:
        return plan
    if cu_seqlens_q is None:
        raise ValueError("cu_seqlens_q: required unless plan= is given")
    if not isinstance(cu_seqlens_q, torch.Tensor):
        raise TypeError(f"cu_seqlens_q: expected an int32 tensor [R + 1], got {type(cu_seqlens_q).__name__}")
    return planner.prefill_plan(cu_seqlens_q.tolist())


# -- decode ---------------------------------------------------------------------------------

def index_scores(idx_q, index_k_cache, block_table, seq_lens, *, decode_query_len, out=None, backend=None):
    """Per-block causal max of ``idx_q . index_k`` -> scores ``[Hi, T, max_blocks]`` float32.

    idx_q [T, Hi, Di]; index_k_cache [pages, 128, Di]; block_table [R, max_blocks]
    int32; seq_lens [R] int32. ``-inf`` past each token's visible blocks.
    ``out`` may be any strided view of the output shape. ``backend``: "triton"
    or "cutedsl" (Hopper+, optional package); None: ``$M3_INDEXER_SCORE``, else "triton".
    """
    call = validate.check_index_call(idx_q, index_k_cache, block_table, seq_lens, decode_query_len=decode_query_len,
                                     out=out)
    guards.check_call("index_scores", idx_q=idx_q, index_k_cache=index_k_cache, block_table=block_table,
                      seq_lens=seq_lens)
    device = guards.check_devices(idx_q=idx_q, index_k_cache=index_k_cache, block_table=block_table, seq_lens=seq_lens,
                                  out=out)
    scorer = _scorer(backend, idx_q, index_k_cache)
    out = _empty((call.num_index_heads, call.num_tokens, call.max_blocks), torch.float32, device, out)
    tile = maps.index_tile(call.num_index_heads, int(decode_query_len))
    tile_map, _ = ops.decode_maps(device, call.num_requests, int(decode_query_len), tile.tokens_per_tile)
    scorer(idx_q, index_k_cache, block_table, seq_lens, tile_map, out, tile.tokens_per_tile)
    return out


def select_blocks(scores, seq_lens, *, decode_query_len, topk=16, init_blocks=0, local_blocks=1, out=None):
    """Top-``topk`` blocks per (index head, token) -> ``[Hi, T, topk]`` int32.

    Forced: the first ``init_blocks`` and last ``local_blocks`` visible blocks;
    the rest by score (ties: lower id; NaN loses). Ids ascending, then -1.
    """
    call = validate.check_select_call(scores, seq_lens, topk=topk, init_blocks=init_blocks,
                                      local_blocks=local_blocks, decode_query_len=decode_query_len, out=out)
    guards.check_call("select_blocks", scores=scores, seq_lens=seq_lens)
    device = guards.check_devices(scores=scores, seq_lens=seq_lens, out=out)
    out = _empty((call.num_index_heads, call.num_tokens, int(topk)), torch.int32, device, out)
    _, token_map = ops.decode_maps(device, call.num_requests, int(decode_query_len), 1)
    ops.select_blocks(scores, seq_lens, token_map, out, int(topk), int(init_blocks), int(local_blocks))
    return out


def _decode_attention(op, q, k_cache, v_cache, block_ids, block_table, seq_lens, decode_query_len, sm_scale, out,
                      k_scale, v_scale):
    """Validate a decode attention call -> (out, tile_map, tokens_per_tile, sm_scale, (k_scale, v_scale))."""
    call = validate.check_attention_call(q, k_cache, v_cache, block_table, seq_lens, block_ids=block_ids,
                                         sm_scale=sm_scale, decode_query_len=decode_query_len, out=out,
                                         k_scale=k_scale, v_scale=v_scale)
    guards.check_call(op, q=q, k_cache=k_cache, v_cache=v_cache, block_ids=block_ids, block_table=block_table,
                      seq_lens=seq_lens)
    device = guards.check_devices(q=q, k_cache=k_cache, v_cache=v_cache, block_ids=block_ids, block_table=block_table,
                                  seq_lens=seq_lens, out=out, k_scale=k_scale, v_scale=v_scale)
    out = _empty(q.shape, q.dtype, device, out)
    n = int(decode_query_len)
    tile = maps.decode_tile(call.group, n, block_ids is not None, max_blocks=call.max_blocks,
                            topk=0 if block_ids is None else block_ids.shape[2], num_requests=call.num_requests,
                            num_kv_heads=call.num_kv_heads, interpret=not ops.compiled(device))
    tile_map, _ = ops.decode_maps(device, call.num_requests, n, tile.tokens_per_tile)
    return out, tile_map, tile.tokens_per_tile, call.sm_scale, ops.kv_scales(k_cache, k_scale, v_scale, device)


def sparse_decode(q, k_cache, v_cache, block_ids, block_table, seq_lens, *, decode_query_len, sm_scale=None,
                  out=None, k_scale=None, v_scale=None):
    """Block-sparse GQA decode attention -> ``[T, Hq, D]`` in q's dtype.

    q [T, Hq, D]; k_cache/v_cache [pages, Hk, 128, D] (q's dtype or float8_e4m3fn,
    then scaled by k_scale/v_scale); block_ids [Hk, T, topk] int32 (-1 skipped;
    the ids of one row distinct, as ``select_blocks`` writes them); block_table
    [R, max_blocks] int32; seq_lens [R] int32.
    """
    out, tile_map, tokens_per_tile, scale, kv_scales = _decode_attention(
        "sparse_decode", q, k_cache, v_cache, block_ids, block_table, seq_lens, decode_query_len, sm_scale, out,
        k_scale, v_scale)
    ops.paged_attention(q, k_cache, v_cache, block_ids, block_table, seq_lens, tile_map, out, None, None,
                        tokens_per_tile, scale, *kv_scales)
    return out


def dense_decode(q, k_cache, v_cache, block_table, seq_lens, *, decode_query_len, sm_scale=None, out=None,
                 k_scale=None, v_scale=None):
    """Paged GQA decode attention over every visible block (layers 0-2) -> ``[T, Hq, D]``."""
    out, tile_map, tokens_per_tile, scale, kv_scales = _decode_attention(
        "dense_decode", q, k_cache, v_cache, None, block_table, seq_lens, decode_query_len, sm_scale, out,
        k_scale, v_scale)
    ops.paged_attention(q, k_cache, v_cache, None, block_table, seq_lens, tile_map, out, None, None, tokens_per_tile,
                        scale, *kv_scales)
    return out


def msa_decode(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, *, decode_query_len, topk=16,
               init_blocks=0, local_blocks=1, sm_scale=None, out=None, k_scale=None, v_scale=None, backend=None):
    """``index_scores`` -> ``select_blocks`` -> ``sparse_decode``; returns ``(out, block_ids)``
    (selection inside the attention launch when it has one split: ``launches.Selection``).

    The scores live in a persistent per-device workspace, reused across calls.
    ``backend``: the indexer's, as in ``index_scores``.
    """
    call = validate.check_msa_call(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, topk=topk,
                                   init_blocks=init_blocks, local_blocks=local_blocks, sm_scale=sm_scale,
                                   decode_query_len=decode_query_len, out=out, k_scale=k_scale, v_scale=v_scale)
    guards.check_call("msa_decode", q=q, idx_q=idx_q, k_cache=k_cache, v_cache=v_cache, index_k_cache=index_k_cache,
                      block_table=block_table, seq_lens=seq_lens)
    ops.check_kv_layout(k_cache, v_cache)
    device = guards.check_devices(q=q, idx_q=idx_q, k_cache=k_cache, v_cache=v_cache, index_k_cache=index_k_cache,
                                  block_table=block_table, seq_lens=seq_lens, out=out, k_scale=k_scale, v_scale=v_scale)
    scorer = _scorer(backend, idx_q, index_k_cache, skip_blocks=int(topk))
    n, topk = int(decode_query_len), int(topk)
    out = _empty(q.shape, q.dtype, device, out)
    scores = ops.workspace(device, "index_scores", (call.num_kv_heads, call.num_tokens, call.max_blocks))
    block_ids = torch.empty((call.num_kv_heads, call.num_tokens, topk), dtype=torch.int32, device=device)
    tile = maps.index_tile(call.num_index_heads, n)
    tile_map, token_map = ops.decode_maps(device, call.num_requests, n, tile.tokens_per_tile)
    scorer(idx_q, index_k_cache, block_table, seq_lens, tile_map, scores, tile.tokens_per_tile)
    tile = maps.decode_tile(call.group, n, True, max_blocks=call.max_blocks, topk=topk,
                            num_requests=call.num_requests, num_kv_heads=call.num_kv_heads,
                            interpret=not ops.compiled(device))
    tile_map, _ = ops.decode_maps(device, call.num_requests, n, tile.tokens_per_tile)
    # selection and sparse attention: selecting inside the attention kernel or before it (launches.Selection)
    ops.paged_attention(q, k_cache, v_cache, None, block_table, seq_lens, tile_map, out, None, None,
                        tile.tokens_per_tile, call.sm_scale, *ops.kv_scales(k_cache, k_scale, v_scale, device), scores,
                        token_map, [topk, int(init_blocks), int(local_blocks)], block_ids)
    return out, block_ids


# -- prefill --------------------------------------------------------------------------------

def index_scores_prefill(idx_q, index_k_cache, block_table, seq_lens, *, cu_seqlens_q, plan=None, out=None,
                         backend=None):
    """Per-block causal max of ``idx_q . index_k`` for every query token -> ``[Hi, T, max_blocks]`` float32.

    As ``index_scores`` with cu_seqlens_q [R + 1] int32 (read on the host once,
    or not at all with ``plan``) instead of ``decode_query_len``.
    """
    plan = prefill_plan(cu_seqlens_q, plan)
    call = validate.check_index_call(idx_q, index_k_cache, block_table, seq_lens, prefill=plan,
                                     cu_seqlens_q=cu_seqlens_q, out=out)
    guards.check_call("index_scores_prefill", idx_q=idx_q, index_k_cache=index_k_cache, block_table=block_table,
                      seq_lens=seq_lens)
    device = guards.check_devices(idx_q=idx_q, index_k_cache=index_k_cache, block_table=block_table, seq_lens=seq_lens,
                                  out=out)
    scorer = _scorer(backend, idx_q, index_k_cache)
    out = _empty((call.num_index_heads, call.num_tokens, call.max_blocks), torch.float32, device, out)
    tile, tile_map, _ = ops.prefill_maps(plan, device, call.num_index_heads, "index")
    scorer(idx_q, index_k_cache, block_table, seq_lens, tile_map, out, tile.tokens_per_tile)
    return out


def select_blocks_prefill(scores, seq_lens, *, cu_seqlens_q, topk=16, init_blocks=0, local_blocks=1, plan=None,
                          out=None):
    """Top-``topk`` blocks per (index head, token) -> ``[Hi, T, topk]`` int32; decode's rules per token."""
    plan = prefill_plan(cu_seqlens_q, plan)
    call = validate.check_select_call(scores, seq_lens, topk=topk, init_blocks=init_blocks,
                                      local_blocks=local_blocks, prefill=plan, cu_seqlens_q=cu_seqlens_q, out=out)
    guards.check_call("select_blocks_prefill", scores=scores, seq_lens=seq_lens)
    device = guards.check_devices(scores=scores, seq_lens=seq_lens, out=out)
    out = _empty((call.num_index_heads, call.num_tokens, int(topk)), torch.int32, device, out)
    token_map = ops.prefill_token_map(plan, device)
    ops.select_blocks(scores, seq_lens, token_map, out, int(topk), int(init_blocks), int(local_blocks))
    return out


def _check_prefill_attention(op, q, k_cache, v_cache, block_ids, block_table, seq_lens, cu_seqlens_q, plan,
                             sm_scale, out, k_scale, v_scale):
    """Validate a prefill attention call -> (its plan, the checked call, its device, out)."""
    plan = prefill_plan(cu_seqlens_q, plan)
    call = validate.check_attention_call(q, k_cache, v_cache, block_table, seq_lens, block_ids=block_ids,
                                         sm_scale=sm_scale, prefill=plan, cu_seqlens_q=cu_seqlens_q, out=out,
                                         k_scale=k_scale, v_scale=v_scale)
    guards.check_call(op, q=q, k_cache=k_cache, v_cache=v_cache, block_ids=block_ids, block_table=block_table,
                      seq_lens=seq_lens)
    device = guards.check_devices(q=q, k_cache=k_cache, v_cache=v_cache, block_ids=block_ids, block_table=block_table,
                                  seq_lens=seq_lens, out=out, k_scale=k_scale, v_scale=v_scale)
    return plan, call, device, _empty(q.shape, q.dtype, device, out)


def _triton_prefill_tiles(plan, call, device, block_ids):
    """The Triton kernel's row tiles of a checked prefill call -> (tokens per tile, tile_map on ``device``)."""
    sparse = block_ids is not None
    kind = maps.prefill_tile_kind(sparse, call.max_blocks, block_ids.shape[2] if sparse else 0)
    tile, tile_map, _ = ops.prefill_maps(plan, device, call.group, kind)
    return tile.tokens_per_tile, tile_map


def sparse_prefill(q, k_cache, v_cache, block_ids, block_table, seq_lens, *, cu_seqlens_q, sm_scale=None, plan=None,
                   out=None, k_scale=None, v_scale=None, backend=None):
    """Block-sparse GQA attention, each token over its own blocks -> ``[T, Hq, D]`` in q's dtype.

    Causal inside every block (the diagonal one included): the token at position
    p sees positions <= p. Arguments as in ``sparse_decode``, with cu_seqlens_q.
    ``backend``: "triton" (``attention.paged_attention_kernel``), "cutedsl" (``cute_prefill``'s
    sparse mode, Hopper sm_90a, bf16/fp16 caches, Hq // Hk >= 4) or None for ``$M3_SPARSE_PREFILL``
    (default "triton"); a backend that cannot run this call is an error (``m3_kernels.backends``).
    """
    plan, call, device, out = _check_prefill_attention("sparse_prefill", q, k_cache, v_cache, block_ids, block_table,
                                                       seq_lens, cu_seqlens_q, plan, sm_scale, out, k_scale, v_scale)
    if _sparse_prefill_backend(backend, q, k_cache, block_ids.shape[2]) == "cutedsl":
        # the kernel's tiles fill its 128 MMA rows: the indexer's (as many tokens as 128 rows hold)
        _, tile_map, _ = ops.prefill_maps(plan, device, call.group, "index")
        cute_ops.sparse_prefill(q, k_cache, v_cache, block_ids, block_table, seq_lens, tile_map, out, call.sm_scale)
        return out
    tokens_per_tile, tile_map = _triton_prefill_tiles(plan, call, device, block_ids)
    ops.paged_attention(q, k_cache, v_cache, block_ids, block_table, seq_lens, tile_map, out, None, None,
                        tokens_per_tile, call.sm_scale, *ops.kv_scales(k_cache, k_scale, v_scale, device))
    return out


def dense_prefill(q, k_cache, v_cache, block_table, seq_lens, *, cu_seqlens_q, sm_scale=None, plan=None, out=None,
                  k_scale=None, v_scale=None, backend=None):
    """Causal paged GQA attention over every visible block (layers 0-2) -> ``[T, Hq, D]``.

    ``backend``: "triton" (``attention.paged_attention_kernel``), "cutedsl" (``cute_prefill``,
    Hopper sm_90a, bf16/fp16 caches) or None for ``$M3_DENSE_PREFILL`` (default "triton");
    a backend that cannot run this call is an error (``m3_kernels.backends``).
    """
    plan, call, device, out = _check_prefill_attention("dense_prefill", q, k_cache, v_cache, None, block_table,
                                                       seq_lens, cu_seqlens_q, plan, sm_scale, out, k_scale, v_scale)
    if _dense_prefill_backend(backend, q, k_cache) == "cutedsl":
        # the kernel's tiles fill its 128 MMA rows: the indexer's (as many tokens as 128 rows hold)
        _, tile_map, _ = ops.prefill_maps(plan, device, call.group, "index")
        cute_ops.dense_prefill(q, k_cache, v_cache, block_table, seq_lens, tile_map, out, call.sm_scale)
        return out
    tokens_per_tile, tile_map = _triton_prefill_tiles(plan, call, device, None)
    ops.paged_attention(q, k_cache, v_cache, None, block_table, seq_lens, tile_map, out, None, None, tokens_per_tile,
                        call.sm_scale, *ops.kv_scales(k_cache, k_scale, v_scale, device))
    return out


def msa_prefill(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, *, cu_seqlens_q, topk=16,
                init_blocks=0, local_blocks=1, sm_scale=None, plan=None, out=None, k_scale=None, v_scale=None,
                backend=None):
    """``index_scores_prefill`` -> ``select_blocks_prefill`` -> ``sparse_prefill``; returns ``(out, block_ids)``
    (selection inside the attention launch when it has one split: ``launches.Selection``).

    ``backend``: the indexer's, as in ``index_scores``. The attention runs with the backend of
    ``$M3_SPARSE_PREFILL`` (as ``sparse_prefill(backend=None)``); with "cutedsl" the selection is a
    launch of its own, then the CuTeDSL kernel attends over its ``block_ids``.
    """
    plan = prefill_plan(cu_seqlens_q, plan)
    call = validate.check_msa_call(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, topk=topk,
                                   init_blocks=init_blocks, local_blocks=local_blocks, sm_scale=sm_scale,
                                   prefill=plan, cu_seqlens_q=cu_seqlens_q, out=out, k_scale=k_scale,
                                   v_scale=v_scale)
    guards.check_call("msa_prefill", q=q, idx_q=idx_q, k_cache=k_cache, v_cache=v_cache, index_k_cache=index_k_cache,
                      block_table=block_table, seq_lens=seq_lens)
    ops.check_kv_layout(k_cache, v_cache)
    device = guards.check_devices(q=q, idx_q=idx_q, k_cache=k_cache, v_cache=v_cache, index_k_cache=index_k_cache,
                                  block_table=block_table, seq_lens=seq_lens, out=out, k_scale=k_scale, v_scale=v_scale)
    scorer = _scorer(backend, idx_q, index_k_cache, skip_blocks=int(topk))
    cute_prefill = _sparse_prefill_backend(None, q, k_cache, topk) == "cutedsl"
    topk = int(topk)
    out = _empty(q.shape, q.dtype, device, out)
    scores = torch.empty((call.num_kv_heads, call.num_tokens, call.max_blocks), dtype=torch.float32, device=device)
    block_ids = torch.empty((call.num_kv_heads, call.num_tokens, topk), dtype=torch.int32, device=device)
    tile, tile_map, token_map = ops.prefill_maps(plan, device, call.num_index_heads, "index")
    scorer(idx_q, index_k_cache, block_table, seq_lens, tile_map, scores, tile.tokens_per_tile)
    if cute_prefill:
        # CuTeDSL sparse prefill: selection first, then the kernel over tiles filling its 128 MMA rows
        # (the indexer's, as in sparse_prefill)
        ops.select_blocks(scores, seq_lens, token_map, block_ids, topk, int(init_blocks), int(local_blocks))
        _, tile_map, _ = ops.prefill_maps(plan, device, call.group, "index")
        cute_ops.sparse_prefill(q, k_cache, v_cache, block_ids, block_table, seq_lens, tile_map, out, call.sm_scale)
        return out, block_ids
    tile, tile_map, _ = ops.prefill_maps(plan, device, call.group, maps.prefill_tile_kind(True, call.max_blocks, topk))
    ops.paged_attention(q, k_cache, v_cache, None, block_table, seq_lens, tile_map, out, None, None,
                        tile.tokens_per_tile, call.sm_scale, *ops.kv_scales(k_cache, k_scale, v_scale, device), scores,
                        token_map, [topk, int(init_blocks), int(local_blocks)], block_ids)
    return out, block_ids


# -- mixed step -----------------------------------------------------------------------------

def msa_attention_step(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, *, plan, sparse=True,
                       init_blocks=0, local_blocks=1, sm_scale=None, out=None, arena=None, k_scale=None,
                       v_scale=None, backend=None):
    """Attention of one layer for a whole mixed step -> ``(out, block_ids)``.

    q [T, Hq, D]; idx_q [T, Hi, Di] and index_k_cache [pages, 128, Di] (sparse
    layers; ``None`` for dense ones); k_cache/v_cache [pages, Hk, 128, D];
    block_table [R, max_blocks] int32; seq_lens [R] int32 (device). R and T are
    the plan's (``plan.num_rows``, ``plan.num_tokens``: context rows first, then
    generation rows, padding rows last with ``seq_len = 0``).

    plan:   the step's :class:`m3_kernels.planner.StepPlan` (``topk`` from its config).
    sparse: True for MSA layers (indexer + top-k + block-sparse attention),
            False for dense layers 0-2 (``block_ids`` is then None).
    arena:  optional :class:`m3_torch.ops.StepArena` (default: one per layout and device).
    backend: the indexer's (sparse layers), as in ``index_scores``. The context span's attention runs
            with the backend of ``$M3_SPARSE_PREFILL`` on sparse layers (as ``msa_prefill``) and of
            ``$M3_DENSE_PREFILL`` on dense ones (as ``dense_prefill(backend=None)``).
    k_scale, v_scale: for FP8 K/V caches, as in ``sparse_decode``.

    Context rows run over the plan's prefill maps, generation rows over decode
    maps with the span's ``decode_query_len``, each span bounded by its own
    rows' longest KV length. ``block_ids`` ``[Hk, T, topk]`` int32 is a view
    into the arena, valid until the next call that uses it.
    """
    cfg = plan.config
    call = validate.check_step_call(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, config=cfg,
                                    num_rows=plan.num_rows, num_tokens=plan.num_tokens, block_bound=plan.block_bound,
                                    sparse=sparse, init_blocks=init_blocks, local_blocks=local_blocks,
                                    sm_scale=sm_scale, out=out, k_scale=k_scale, v_scale=v_scale)
    guards.check_call("msa_attention_step", q=q, idx_q=idx_q, k_cache=k_cache, v_cache=v_cache,
                      index_k_cache=index_k_cache, block_table=block_table, seq_lens=seq_lens)
    ops.check_kv_layout(k_cache, v_cache)
    device = guards.check_devices(q=q, idx_q=idx_q if sparse else None, k_cache=k_cache, v_cache=v_cache,
                                  index_k_cache=index_k_cache if sparse else None, block_table=block_table,
                                  seq_lens=seq_lens, out=out, k_scale=k_scale, v_scale=v_scale)
    scorer = _scorer(backend, idx_q, index_k_cache, skip_blocks=cfg.topk) if sparse else None
    cute_prefill = (_sparse_prefill_backend(None, q, k_cache, cfg.topk) if sparse
                    else _dense_prefill_backend(None, q, k_cache)) == "cutedsl"
    out = _empty(q.shape, q.dtype, device, out)
    kv_scales = ops.kv_scales(k_cache, k_scale, v_scale, device)
    arena = arena if arena is not None else ops.step_arena(plan.layout, device)
    partials = (arena.region("partial_out"), arena.region("partial_lse"))
    block_ids = arena.region("block_ids", (cfg.num_kv_heads, plan.num_tokens, cfg.topk)) if sparse else None
    for span in plan.spans:
        rows, toks = span.rows, span.tokens
        table, lens = block_table[rows, :span.max_blocks], seq_lens[rows]
        if span.prefill is not None:
            index_maps = ops.prefill_maps(span.prefill, device, cfg.num_kv_heads, "index")
            # CuTeDSL prefill: its tiles fill the 128 MMA rows (the indexer's, as in dense_prefill and
            # sparse_prefill)
            kind = "index" if cute_prefill else maps.prefill_tile_kind(sparse, span.max_blocks, cfg.topk)
            attention_maps = ops.prefill_maps(span.prefill, device, cfg.group, kind)
        else:
            n = span.decode_query_len
            tile = maps.index_tile(cfg.num_kv_heads, n)
            index_maps = (tile, *ops.decode_maps(device, span.num_rows, n, tile.tokens_per_tile))
            tile = maps.decode_tile(cfg.group, n, sparse, max_blocks=span.max_blocks, topk=cfg.topk,
                                    num_requests=span.num_rows, num_kv_heads=cfg.num_kv_heads,
                                    interpret=not ops.compiled(device))
            attention_maps = (tile, *ops.decode_maps(device, span.num_rows, n, tile.tokens_per_tile))
        selection = ()
        if sparse:
            scores = arena.region("scores", (cfg.num_kv_heads, span.num_tokens, span.max_blocks))
            tile, tile_map, token_map = index_maps
            scorer(idx_q[toks], index_k_cache, table, lens, tile_map, scores, tile.tokens_per_tile)
            selection = (scores, token_map, [cfg.topk, int(init_blocks), int(local_blocks)], block_ids[:, toks])
        tile, tile_map, _ = attention_maps
        if cute_prefill and span.prefill is not None:
            if sparse:   # selection first, then the kernel over the chosen blocks (as in msa_prefill)
                ops.select_blocks(scores, lens, token_map, block_ids[:, toks], cfg.topk, int(init_blocks),
                                  int(local_blocks))
                cute_ops.sparse_prefill(q[toks], k_cache, v_cache, block_ids[:, toks], table, lens, tile_map,
                                        out[toks], call.sm_scale)
            else:
                cute_ops.dense_prefill(q[toks], k_cache, v_cache, table, lens, tile_map, out[toks], call.sm_scale)
            continue
        ops.paged_attention(q[toks], k_cache, v_cache, None, table, lens, tile_map, out[toks], *partials,
                            tile.tokens_per_tile, call.sm_scale, *kv_scales, *selection)
    return out, block_ids
