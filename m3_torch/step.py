"""One attention call per layer for a mixed prefill/decode step (torch).

The step planner (:mod:`m3_kernels.planner`) resolves the batch once per step
on the host; :func:`msa_attention_step` then runs, per layer:

* context rows (the prefix): the prefill launches over the planner's varlen
  maps, block-table columns bounded by the context rows' max KV length;
* generation rows (the suffix): the decode launches (``m3_torch.decode``) with
  the span's uniform ``decode_query_len``, bounded by the generation rows'
  own max KV length, so a long prompt in the same step does not widen them.

Each span is scored by its own indexer launch. Workspaces (scores, block ids,
split-K partials) are views of ONE persistent arena per (layout, device),
allocated at the planner's max batch: the generation launches of a
pure-generation step see the same addresses every step (CUDA-graph replay).
"""

from __future__ import annotations

import threading

import torch

from m3_kernels import geometry, planner, validate

from . import decode
from ._launch import check_devices, decode_maps
from .prefill import _attention_op, _index_scores_op, _select_blocks_op, device_tiles, device_token_map

__all__ = ["StepArena", "step_arena", "msa_attention_step"]

_lock = threading.Lock()
_arenas: dict = {}
_DTYPES = {"float32": torch.float32, "int32": torch.int32}


class StepArena:
    """One byte buffer laid out by a :class:`~m3_kernels.planner.WorkspaceLayout`."""

    def __init__(self, layout: planner.WorkspaceLayout, device):
        self.layout = layout
        self.buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)

    def region(self, name: str, shape=None) -> torch.Tensor:
        """Region ``name`` as a flat tensor of its dtype, or its first elements viewed as ``shape``."""
        r = self.layout[name]
        flat = self.buffer[r.offset:r.offset + r.nbytes].view(_DTYPES[r.dtype])
        if shape is None:
            return flat
        numel = 1
        for s in shape:
            numel *= int(s)
        if numel > r.numel:
            raise ValueError(f"workspace {name}: {tuple(shape)} needs {numel} elements, the arena holds {r.numel}")
        return flat[:numel].view(tuple(shape))


def step_arena(layout: planner.WorkspaceLayout, device) -> StepArena:
    """The arena for ``layout`` on ``device``, allocated on first use and kept (stable addresses)."""
    key = (layout, str(torch.device(device)))
    arena = _arenas.get(key)
    if arena is None:
        with _lock:
            arena = _arenas.setdefault(key, StepArena(layout, device))
    return arena


def _check_step(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, plan, sparse, out):
    bound = max((s.max_blocks for s in (plan.context, plan.generation) if s.num_rows), default=0)
    validate.check_step_inputs(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, config=plan.config,
                               num_rows=plan.num_rows, num_tokens=plan.num_tokens, block_bound=bound, sparse=sparse)
    validate.check_out(out, q.shape, validate.dtype_name(q))
    return check_devices(q=q, idx_q=idx_q if sparse else None, k_cache=k_cache, v_cache=v_cache,
                         index_k_cache=index_k_cache if sparse else None, block_table=block_table,
                         seq_lens=seq_lens, out=out)


def msa_attention_step(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, *, plan, sparse=True,
                       init_blocks=0, local_blocks=1, sm_scale=None, out=None, arena=None):
    """Attention of one layer for a whole mixed step -> ``(out, block_ids)``.

    q [T, Hq, D]; idx_q [T, Hi, Di] and index_k_cache [pages, 128, Di] (sparse
    layers; ``None`` for dense ones); k_cache/v_cache [pages, Hk, 128, D] (any
    strides); block_table [R, max_blocks] int32; seq_lens [R] int32 (device).
    R and T are the plan's (``plan.num_rows``, ``plan.num_tokens``: context
    rows first, then generation rows, padding rows last with ``seq_len = 0``).

    plan:   :class:`m3_kernels.planner.StepPlan` of this step (``topk`` from its config).
    sparse: True for MSA layers (indexer + top-k + block-sparse attention),
            False for dense layers 0-2 (``block_ids`` is then None).
    out:    optional ``[T, Hq, D]`` in q's dtype.
    arena:  optional :class:`StepArena` (default: one per layout and device).

    ``block_ids`` ``[Hk, T, topk]`` int32 is a view into the arena, valid until
    the next call that uses the arena; clone it to keep it.
    """
    cfg = plan.config
    if sparse:
        validate.check_selection_args(cfg.topk, init_blocks, local_blocks)
    device = _check_step(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, plan, sparse, out)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    arena = arena if arena is not None else step_arena(plan.layout, device)
    num_kv_heads, group, topk = cfg.num_kv_heads, cfg.group, cfg.topk
    scale = cfg.head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    partials = (arena.region("partial_out"), arena.region("partial_lse"))
    block_ids = arena.region("block_ids", (num_kv_heads, plan.num_tokens, topk)) if sparse else None

    # -- context rows: prefill kernels over the planner's maps
    ctx = plan.context
    if ctx.num_tokens:
        rows, toks = slice(0, ctx.num_rows), slice(0, ctx.num_tokens)
        table, lens = block_table[rows, :ctx.max_blocks], seq_lens[rows]
        ids = None
        if sparse:
            ids = block_ids[:, toks]
            scores = arena.region("scores", (num_kv_heads, ctx.num_tokens, ctx.max_blocks))
            tile, tile_map = device_tiles(ctx.prefill, num_kv_heads, device)
            _index_scores_op(idx_q[toks], index_k_cache, table, lens, tile_map, scores, tile.tokens_per_tile)
            _select_blocks_op(scores, lens, device_token_map(ctx.prefill, device), ids, topk, init_blocks,
                              local_blocks)
        tile, tile_map = device_tiles(ctx.prefill, group, device)
        _attention_op(q[toks], k_cache, v_cache, ids, table, lens, tile_map, out[toks], *partials,
                      tile.tokens_per_tile, scale, sparse)

    # -- generation rows: decode kernels, bounded by the generation rows alone
    gen = plan.generation
    if gen.num_rows:
        rows = slice(gen.row_start, gen.row_start + gen.num_rows)
        toks = slice(gen.token_start, gen.token_start + gen.num_tokens)
        table, lens, n = block_table[rows, :gen.max_blocks], seq_lens[rows], gen.query_len
        ids = None
        if sparse:
            ids = block_ids[:, toks]
            scores = arena.region("scores", (num_kv_heads, gen.num_tokens, gen.max_blocks))
            decode.index_scores(idx_q[toks], index_k_cache, table, lens, decode_query_len=n, out=scores)
            decode.select_blocks(scores, lens, decode_query_len=n, topk=topk, init_blocks=init_blocks,
                                 local_blocks=local_blocks, out=ids)
        tile = geometry.decode_tile(group, n, sparse, max_blocks=gen.max_blocks, topk=topk)
        tile_map, _ = decode_maps(device, gen.num_rows, n, tile.tokens_per_tile)
        _attention_op(q[toks], k_cache, v_cache, ids, table, lens, tile_map, out[toks], *partials,
                      tile.tokens_per_tile, scale, sparse)
    return out, block_ids
