"""One attention call per layer for a mixed prefill/decode step (JAX; mirror of ``m3_torch/step.py``).

The step planner (:mod:`m3_kernels.planner`) resolves the batch once per step
on the host. :func:`msa_attention_step` then runs the context rows (prefix)
through the prefill launches over the planner's maps and the generation rows
(suffix) through the ``m3_jax.decode`` launches, each span with its own
block-table bound and its own indexer launch. The spans' results are
concatenated (XLA owns the workspaces: no arena on this side).

Under ``jax.jit``: split a plan with :func:`step_inputs` into a hashable
:class:`StepSpec` (a static argument: recompiles only when the spans' shapes
change) and the context maps (a :class:`~m3_jax.prefill.PrefillMaps` pytree of
int32 arrays, a traced argument).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from m3_kernels import geometry, planner, validate

from . import decode
from .prefill import PrefillMaps, launch_index_scores, launch_select_blocks, launch_varlen_attention, prefill_maps
from .views import as_index_k_view, as_kv_view

__all__ = ["StepSpec", "step_inputs", "msa_attention_step"]


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What of a :class:`~m3_kernels.planner.StepPlan` shapes the launches, hashable by value.

    No lengths: two steps with the same spans and block bounds share one spec
    (and one compiled step). Context rows ``[0, context_rows)``, tokens
    ``[0, context_tokens)``; generation rows and tokens follow them.
    """
    config: planner.StepConfig
    context_rows: int
    context_tokens: int
    context_max_blocks: int
    generation_rows: int        # padding rows included
    generation_query_len: int
    generation_max_blocks: int

    @property
    def num_rows(self) -> int:
        return self.context_rows + self.generation_rows

    @property
    def num_tokens(self) -> int:
        return self.context_tokens + self.generation_rows * self.generation_query_len


def step_inputs(plan: planner.StepPlan):
    """-> ``(StepSpec, PrefillMaps | None)``: the plan's static part and its context maps (cached on the plan)."""
    ctx, gen, cfg = plan.context, plan.generation, plan.config
    spec = StepSpec(cfg, ctx.num_rows, ctx.num_tokens, ctx.max_blocks, gen.num_rows, gen.query_len, gen.max_blocks)
    maps = prefill_maps(ctx.prefill, (cfg.group, cfg.num_kv_heads)) if ctx.num_tokens else None
    return spec, maps


def _check_step(q, idx_q, k, v, index_k, block_table, seq_lens, spec, maps, sparse):
    bound = max((b for rows, b in ((spec.context_rows, spec.context_max_blocks),
                                   (spec.generation_rows, spec.generation_max_blocks)) if rows), default=0)
    validate.check_step_inputs(q, idx_q, k, v, index_k, block_table, seq_lens, config=spec.config,
                               num_rows=spec.num_rows, num_tokens=spec.num_tokens, block_bound=bound, sparse=sparse)
    if spec.context_tokens:
        if not isinstance(maps, PrefillMaps):
            raise ValueError("maps: a step with context tokens needs its PrefillMaps (from step_inputs(plan))")
        if (maps.num_rows, maps.num_tokens) != (spec.context_rows, spec.context_tokens):
            raise ValueError(f"maps: built for {maps.num_rows} rows / {maps.num_tokens} tokens, the plan's context "
                             f"span has {spec.context_rows} / {spec.context_tokens}")


def msa_attention_step(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, *, plan, maps=None,
                       sparse=True, init_blocks=0, local_blocks=1, sm_scale=None, kv_layout="HND"):
    """Attention of one layer for a whole mixed step -> ``(out [T, Hq, D], block_ids [Hk, T, topk] | None)``.

    Arguments as in ``m3_torch.msa_attention_step`` (no ``out``/``arena``); K/V
    arrays in ``kv_layout`` or PagedViews, index-K an array or a PagedView.
    plan: a StepPlan, or a StepSpec together with ``maps`` (see :func:`step_inputs`).
    """
    if isinstance(plan, planner.StepPlan):
        spec, plan_maps = step_inputs(plan)
        maps = plan_maps if maps is None else maps
    else:
        spec = plan
    cfg = spec.config
    if sparse:
        validate.check_selection_args(cfg.topk, init_blocks, local_blocks)
    k, v = as_kv_view(k_cache, kv_layout, "k_cache"), as_kv_view(v_cache, kv_layout, "v_cache")
    index_k = as_index_k_view(index_k_cache) if sparse and index_k_cache is not None else None
    _check_step(q, idx_q, k, v, index_k, block_table, seq_lens, spec, maps, sparse)
    num_kv_heads, group, topk = cfg.num_kv_heads, cfg.group, cfg.topk
    scale = cfg.head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    outs, ids = [], []

    # -- context rows: prefill launches over the planner's maps
    if spec.context_tokens:
        toks = slice(0, spec.context_tokens)
        table = block_table[:spec.context_rows, :spec.context_max_blocks]
        lens = seq_lens[:spec.context_rows]
        block_ids = None
        if sparse:
            tile, tile_map = maps.tile(num_kv_heads)
            scores = launch_index_scores(idx_q[toks], index_k, table, lens, tile_map=tile_map, tile=tile)
            block_ids = launch_select_blocks(scores, lens, token_map=maps.token_map, topk=topk,
                                             init_blocks=init_blocks, local_blocks=local_blocks)
            ids.append(block_ids)
        tile, tile_map = maps.tile(group)
        outs.append(launch_varlen_attention(q[toks], k, v, block_ids, table, lens, tile_map=tile_map, tile=tile,
                                            sm_scale=scale, sparse=sparse))

    # -- generation rows: decode launches, bounded by the generation rows alone
    if spec.generation_rows:
        num_rows, n = spec.generation_rows, spec.generation_query_len
        rows = slice(spec.context_rows, spec.num_rows)
        toks = slice(spec.context_tokens, spec.num_tokens)
        table, lens = block_table[rows, :spec.generation_max_blocks], seq_lens[rows]
        block_ids = None
        if sparse:
            scores = decode.index_scores(idx_q[toks], index_k, table, lens, decode_query_len=n)
            block_ids = decode.select_blocks(scores, lens, decode_query_len=n, topk=topk, init_blocks=init_blocks,
                                             local_blocks=local_blocks)
            ids.append(block_ids)
        tile = geometry.decode_tile(group, n, sparse, max_blocks=spec.generation_max_blocks, topk=topk)
        tile_map, _ = decode.decode_maps(num_rows, n, tile.tokens_per_tile)
        outs.append(decode.launch_attention(q[toks], k, v, block_ids, table, lens, tile_map=tile_map, tile=tile,
                                            sm_scale=scale, sparse=sparse))

    out = jnp.concatenate(outs, axis=0) if outs else jnp.zeros(q.shape, q.dtype)
    if not sparse:
        return out, None
    block_ids = jnp.concatenate(ids, axis=1) if ids else jnp.full((num_kv_heads, q.shape[0], topk), -1, jnp.int32)
    return out, block_ids
