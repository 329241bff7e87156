"""The public JAX ops (SPEC.md): validate once, pick the maps, run the kernels' launches.

The same launch descriptions as ``m3_torch`` (``m3_kernels.launches``), so
both frameworks run the same kernel variants with the same arguments
(bit-identical results). JAX style: no ``out=``; results are returned. K/V
caches are arrays with ``kv_layout="HND"`` (``[pages, Hk, 128, D]``) or
``"NHD"`` (``[pages, 128, Hk, D]``), or :class:`~m3_jax.views.PagedView`
objects (logical HND views into a flat pool; ``kv_layout`` is then ignored);
the index-K cache is a ``[pages, 128, Di]`` array or a PagedView.

Every op works under ``jax.jit`` with ``decode_query_len``, ``topk``,
``init_blocks``, ``local_blocks``, ``sm_scale`` and ``kv_layout`` static.

FP8 caches (SPEC.md, "FP8 caches"): any cache may be ``float8_e4m3fn`` (an
array, or a PagedView into a byte pool). The ops that read K/V take
``k_scale=``/``v_scale=``: None (1.0), a Python float, or a float32 scalar
array, which the kernels read at run time (a jitted step takes new values
without recompiling). The index-K cache is unscaled.
Prefill ops take host ``cu_seqlens_q`` (read once into a PrefillPlan) or
``plan=`` (a PrefillPlan, or :class:`~m3_jax.ops.PrefillMaps` whose leaves
may be traced, so a jitted prefill recompiles per padded shape only).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from m3_kernels import backends, launches, planner, validate
from m3_kernels import maps as _maps

from . import cute_call, guards, ops
from .ops import PrefillMaps, operand, prefill_maps, run, strides
from .views import as_index_k_view, as_kv_view

__all__ = ["index_scores", "select_blocks", "sparse_decode", "dense_decode", "msa_decode", "index_scores_prefill",
           "select_blocks_prefill", "sparse_prefill", "dense_prefill", "msa_prefill", "msa_attention_step",
           "StepSpec", "step_inputs"]


# -- the launches, shared by decode, prefill and the mixed step (each public op runs them) ----

def _index_scores(idx_q, index_k, block_table, seq_lens, tile_map, tile, skip_blocks) -> launches.Launch:
    shape = (idx_q.shape[1], idx_q.shape[0], block_table.shape[1])
    return launches.index_scores(idx_q=operand(idx_q), index_k=operand(index_k), block_table=operand(block_table),
                                 seq_lens=seq_lens, tile_map=tile_map, tile=tile, out_strides=strides(shape),
                                 dtype=str(idx_q.dtype), interpret=not ops.on_gpu(), skip_blocks=skip_blocks)


def _device() -> dict:
    """Where JAX computes, as m3_kernels.backends reads it: ``device`` ("cuda" or "cpu") and the
    GPU's ``capability`` (None off a GPU)."""
    if not ops.on_gpu():
        return dict(device="cpu", capability=None)
    device = jax.config.jax_default_device
    device = device if device is not None and not isinstance(device, str) else jax.devices()[0]
    capability = tuple(int(x) for x in str(getattr(device, "compute_capability", "0.0")).split(".")[:2])
    return dict(device="cuda", capability=capability)


def _backend(backend, idx_q, index_k) -> str:
    """The indexer backend of one call (None: ``$M3_INDEXER_SCORE``, else "triton"), checked against
    the shapes, the dtypes and the device JAX computes on (m3_kernels.backends)."""
    return backends.check_indexer_backend(backend, num_heads=int(idx_q.shape[1]), head_dim=int(idx_q.shape[2]),
                                          dtype=validate.dtype_name(idx_q), cache_dtype=validate.dtype_name(index_k),
                                          **_device())


def _dense_prefill_backend(backend, q, k) -> str:
    """The dense prefill backend of one call (None: ``$M3_DENSE_PREFILL``, else "triton"), checked as
    :func:`_backend` checks the indexer's."""
    return backends.check_dense_prefill_backend(backend, group=int(q.shape[1]) // int(k.shape[1]),
                                                head_dim=int(q.shape[2]), dtype=validate.dtype_name(q),
                                                cache_dtype=validate.dtype_name(k), **_device())


def _sparse_prefill_backend(backend, q, k, topk: int) -> str:
    """The sparse prefill backend of one call with ``topk`` block ids per token (None:
    ``$M3_SPARSE_PREFILL``, else "triton"), checked as :func:`_backend` checks the indexer's."""
    return backends.check_sparse_prefill_backend(backend, group=int(q.shape[1]) // int(k.shape[1]),
                                                 head_dim=int(q.shape[2]), topk=int(topk),
                                                 dtype=validate.dtype_name(q), cache_dtype=validate.dtype_name(k),
                                                 **_device())


def _scores(backend, idx_q, index_k, block_table, seq_lens, tile_map, tile, skip_blocks=0):
    """scores [Hi, T, max_blocks] with the resolved ``backend``'s kernel. ``skip_blocks``: the MSA ops
    pass ``topk``; the Triton scorer then leaves tiles that see at most that many blocks unscored
    (selection takes all their blocks unread); the CuTeDSL one scores all."""
    if backend == "cutedsl":
        return cute_call.index_scores(idx_q, index_k, block_table, seq_lens, tile_map, tile)
    return run(_index_scores(idx_q, index_k, block_table, seq_lens, tile_map, tile, skip_blocks))["scores"]


def _select_blocks(scores, seq_lens, token_map, topk, init_blocks, local_blocks) -> launches.Launch:
    return launches.select_blocks(scores=operand(scores), seq_lens=seq_lens, token_map=token_map, topk=topk,
                                  init_blocks=init_blocks, local_blocks=local_blocks,
                                  out_strides=strides((scores.shape[0], scores.shape[1], topk)),
                                  interpret=not ops.on_gpu())


def _attention(q, k, v, block_ids, block_table, seq_lens, tile_map, tile, sm_scale, kv_scales,
               select=None) -> launches.Launch:
    return launches.paged_attention(
        q=operand(q), k=operand(k), v=operand(v), block_ids=None if block_ids is None else operand(block_ids),
        block_table=operand(block_table), seq_lens=seq_lens, tile_map=tile_map, tile=tile, sm_scale=sm_scale,
        out_dtype=str(q.dtype), out_strides=strides(q.shape), interpret=not ops.on_gpu(), k_scale=kv_scales[0],
        v_scale=kv_scales[1], select=select)


def _select_and_attend(q, k, v, scores, block_table, seq_lens, token_map, tile, tile_map, sm_scale, kv_scales,
                       topk, init_blocks, local_blocks):
    """The MSA ops' selection and sparse attention -> (out, block_ids): selection inside the attention
    kernel or before it (``launches.Selection``)."""
    select = launches.Selection(operand(scores), token_map, topk, init_blocks, local_blocks,
                                strides((scores.shape[0], scores.shape[1], topk)))
    result = run(_attention(q, k, v, None, block_table, seq_lens, tile_map, tile, sm_scale, kv_scales, select))
    return result["out"], result["block_ids"]


def _select_and_attend_cutedsl(q, k, v, scores, block_table, seq_lens, token_map, tile, tile_map, sm_scale, topk,
                               init_blocks, local_blocks):
    """The MSA ops' selection and sparse attention on the CuTeDSL prefill backend -> (out, block_ids):
    a selection launch, then the CuTeDSL kernel over its block ids (``tile``/``tile_map``: the
    indexer's tiles of the group, filling the kernel's 128 MMA rows)."""
    block_ids = run(_select_blocks(scores, seq_lens, token_map, topk, init_blocks, local_blocks))["block_ids"]
    return cute_call.sparse_prefill(q, k, v, block_ids, block_table, seq_lens, tile_map, tile, sm_scale), block_ids


def _kv(k_cache, v_cache, kv_layout):
    return as_kv_view(k_cache, kv_layout, "k_cache"), as_kv_view(v_cache, kv_layout, "v_cache")


# -- decode ---------------------------------------------------------------------------------

def index_scores(idx_q, index_k_cache, block_table, seq_lens, *, decode_query_len, backend=None):
    """Per-block causal max of ``idx_q . index_k`` -> scores ``[Hi, T, max_blocks]`` float32.

    idx_q [T, Hi, Di]; index_k_cache [pages, 128, Di] (array or PagedView);
    block_table [R, max_blocks] int32; seq_lens [R] int32. ``-inf`` past each
    token's visible blocks. ``backend`` (static): "triton" or "cutedsl" (Hopper+,
    optional package); None: ``$M3_INDEXER_SCORE``, else "triton".
    """
    index_k = as_index_k_view(index_k_cache)
    call = validate.check_index_call(idx_q, index_k, block_table, seq_lens, decode_query_len=decode_query_len)
    seq_lens = guards.check_call("index_scores", idx_q=idx_q, index_k_cache=index_k, block_table=block_table,
                                 seq_lens=seq_lens)
    backend = _backend(backend, idx_q, index_k)
    tile = _maps.index_tile(call.num_index_heads, int(decode_query_len))
    tile_map, _ = ops.decode_maps(call.num_requests, int(decode_query_len), tile.tokens_per_tile)
    return _scores(backend, idx_q, index_k, block_table, seq_lens, tile_map, tile)


def select_blocks(scores, seq_lens, *, decode_query_len, topk=16, init_blocks=0, local_blocks=1):
    """Top-``topk`` blocks per (index head, token) -> ``[Hi, T, topk]`` int32.

    Forced: the first ``init_blocks`` and last ``local_blocks`` visible blocks;
    the rest by score (ties: lower id; NaN loses). Ids ascending, then -1.
    """
    call = validate.check_select_call(scores, seq_lens, topk=topk, init_blocks=init_blocks,
                                      local_blocks=local_blocks, decode_query_len=decode_query_len)
    seq_lens = guards.check_call("select_blocks", scores=scores, seq_lens=seq_lens)
    _, token_map = ops.decode_maps(call.num_requests, int(decode_query_len), 1)
    return run(_select_blocks(scores, seq_lens, token_map, int(topk), int(init_blocks), int(local_blocks)))["block_ids"]


def _decode_attention(op, q, k_cache, v_cache, block_ids, block_table, seq_lens, decode_query_len, sm_scale, kv_layout,
                      k_scale, v_scale):
    """Validate a decode attention call -> its launch."""
    k, v = _kv(k_cache, v_cache, kv_layout)
    call = validate.check_attention_call(q, k, v, block_table, seq_lens, block_ids=block_ids, sm_scale=sm_scale,
                                         decode_query_len=decode_query_len, k_scale=k_scale, v_scale=v_scale)
    seq_lens = guards.check_call(op, q=q, k_cache=k, v_cache=v, block_ids=block_ids, block_table=block_table,
                                 seq_lens=seq_lens)
    n = int(decode_query_len)
    tile = _maps.decode_tile(call.group, n, block_ids is not None, max_blocks=call.max_blocks,
                             topk=0 if block_ids is None else block_ids.shape[2], num_requests=call.num_requests,
                             num_kv_heads=call.num_kv_heads, interpret=not ops.on_gpu())
    tile_map, _ = ops.decode_maps(call.num_requests, n, tile.tokens_per_tile)
    return _attention(q, k, v, block_ids, block_table, seq_lens, tile_map, tile, call.sm_scale,
                      ops.kv_scales(k, k_scale, v_scale))  # the launch


def sparse_decode(q, k_cache, v_cache, block_ids, block_table, seq_lens, *, decode_query_len, sm_scale=None,
                  kv_layout="HND", k_scale=None, v_scale=None):
    """Block-sparse GQA decode attention -> ``[T, Hq, D]`` in q's dtype.

    q [T, Hq, D]; k_cache/v_cache: arrays in ``kv_layout`` or PagedViews (q's
    dtype or float8_e4m3fn, then scaled by k_scale/v_scale); block_ids [Hk, T,
    topk] int32 (-1 skipped, distinct per row); block_table [R, max_blocks]
    int32; seq_lens [R] int32.
    """
    return run(_decode_attention("sparse_decode", q, k_cache, v_cache, block_ids, block_table, seq_lens,
                                 decode_query_len, sm_scale, kv_layout, k_scale, v_scale))["out"]


def dense_decode(q, k_cache, v_cache, block_table, seq_lens, *, decode_query_len, sm_scale=None, kv_layout="HND",
                 k_scale=None, v_scale=None):
    """Paged GQA decode attention over every visible block (layers 0-2) -> ``[T, Hq, D]``."""
    return run(_decode_attention("dense_decode", q, k_cache, v_cache, None, block_table, seq_lens, decode_query_len,
                                 sm_scale, kv_layout, k_scale, v_scale))["out"]


def msa_decode(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, *, decode_query_len, topk=16,
               init_blocks=0, local_blocks=1, sm_scale=None, kv_layout="HND", k_scale=None, v_scale=None,
               backend=None):
    """``index_scores`` -> ``select_blocks`` -> ``sparse_decode``; returns ``(out, block_ids)``
    (selection inside the attention launch when it has one split: ``launches.Selection``).

    out [T, Hq, D] in q's dtype; block_ids [Hk, T, topk] int32. The scores are
    an intermediate of the jitted computation (XLA reuses its buffer).
    ``backend``: the indexer's, as in ``index_scores``.
    """
    k, v = _kv(k_cache, v_cache, kv_layout)
    index_k = as_index_k_view(index_k_cache)
    call = validate.check_msa_call(q, idx_q, k, v, index_k, block_table, seq_lens, topk=topk,
                                   init_blocks=init_blocks, local_blocks=local_blocks, sm_scale=sm_scale,
                                   decode_query_len=decode_query_len, k_scale=k_scale, v_scale=v_scale)
    seq_lens = guards.check_call("msa_decode", q=q, idx_q=idx_q, k_cache=k, v_cache=v, index_k_cache=index_k,
                                 block_table=block_table, seq_lens=seq_lens)
    ops.check_kv_layout(k, v)
    backend = _backend(backend, idx_q, index_k)
    n, topk = int(decode_query_len), int(topk)
    tile = _maps.index_tile(call.num_index_heads, n)
    tile_map, token_map = ops.decode_maps(call.num_requests, n, tile.tokens_per_tile)
    scores = _scores(backend, idx_q, index_k, block_table, seq_lens, tile_map, tile, topk)
    tile = _maps.decode_tile(call.group, n, True, max_blocks=call.max_blocks, topk=topk,
                             num_requests=call.num_requests, num_kv_heads=call.num_kv_heads,
                             interpret=not ops.on_gpu())
    tile_map, _ = ops.decode_maps(call.num_requests, n, tile.tokens_per_tile)
    return _select_and_attend(q, k, v, scores, block_table, seq_lens, token_map, tile, tile_map, call.sm_scale,
                              ops.kv_scales(k, k_scale, v_scale), topk, int(init_blocks), int(local_blocks))


# -- prefill --------------------------------------------------------------------------------

def _prefill_maps(cu_seqlens_q, plan, heads) -> PrefillMaps:
    if isinstance(plan, PrefillMaps):
        return plan
    if plan is None and cu_seqlens_q is None:
        raise ValueError("cu_seqlens_q: required unless plan= is given")
    return prefill_maps(plan if plan is not None else cu_seqlens_q, heads)


def index_scores_prefill(idx_q, index_k_cache, block_table, seq_lens, *, cu_seqlens_q=None, plan=None, backend=None):
    """Per-block causal max of ``idx_q . index_k`` for every query token -> ``[Hi, T, max_blocks]`` float32.

    As ``index_scores`` with host ``cu_seqlens_q`` [R + 1] (or ``plan``) instead of ``decode_query_len``.
    """
    index_k = as_index_k_view(index_k_cache)
    maps_ = _prefill_maps(cu_seqlens_q, plan, (int(idx_q.shape[1]),) if len(idx_q.shape) == 3 else ())
    call = validate.check_index_call(idx_q, index_k, block_table, seq_lens, prefill=maps_, cu_seqlens_q=cu_seqlens_q)
    seq_lens = guards.check_call("index_scores_prefill", idx_q=idx_q, index_k_cache=index_k, block_table=block_table,
                                 seq_lens=seq_lens)
    backend = _backend(backend, idx_q, index_k)
    tile, tile_map = maps_.tile(call.num_index_heads, "index")
    return _scores(backend, idx_q, index_k, block_table, seq_lens, tile_map, tile)


def select_blocks_prefill(scores, seq_lens, *, cu_seqlens_q=None, topk=16, init_blocks=0, local_blocks=1, plan=None):
    """Top-``topk`` blocks per (index head, token) -> ``[Hi, T, topk]`` int32; decode's rules per token."""
    maps_ = _prefill_maps(cu_seqlens_q, plan, ())
    validate.check_select_call(scores, seq_lens, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks,
                               prefill=maps_, cu_seqlens_q=cu_seqlens_q)
    seq_lens = guards.check_call("select_blocks_prefill", scores=scores, seq_lens=seq_lens)
    launch = _select_blocks(scores, seq_lens, maps_.token_map, int(topk), int(init_blocks), int(local_blocks))
    return run(launch)["block_ids"]


def _group(q, k):
    return (int(q.shape[1]) // int(k.shape[1]),) if len(q.shape) == 3 and len(k.shape) == 4 and k.shape[1] else ()


def _check_prefill_attention(op, q, k_cache, v_cache, block_ids, block_table, seq_lens, cu_seqlens_q, plan,
                             sm_scale, kv_layout, k_scale, v_scale):
    """Validate a prefill attention call -> (k, v views, its PrefillMaps, the checked call, seq_lens)."""
    k, v = _kv(k_cache, v_cache, kv_layout)
    maps_ = _prefill_maps(cu_seqlens_q, plan, _group(q, k))
    call = validate.check_attention_call(q, k, v, block_table, seq_lens, block_ids=block_ids, sm_scale=sm_scale,
                                         prefill=maps_, cu_seqlens_q=cu_seqlens_q, k_scale=k_scale, v_scale=v_scale)
    seq_lens = guards.check_call(op, q=q, k_cache=k, v_cache=v, block_ids=block_ids, block_table=block_table,
                                 seq_lens=seq_lens)
    return k, v, maps_, call, seq_lens


def sparse_prefill(q, k_cache, v_cache, block_ids, block_table, seq_lens, *, cu_seqlens_q=None, sm_scale=None,
                   plan=None, kv_layout="HND", k_scale=None, v_scale=None, backend=None):
    """Block-sparse GQA attention, each token over its own blocks -> ``[T, Hq, D]`` in q's dtype.

    Causal inside every block (the diagonal one included). Arguments as in
    ``m3_torch.sparse_prefill``; K/V arrays in ``kv_layout`` or PagedViews. ``backend`` (static): as
    in ``m3_torch.sparse_prefill``: "triton", "cutedsl" or None for ``$M3_SPARSE_PREFILL``.
    """
    k, v, maps_, call, seq_lens = _check_prefill_attention("sparse_prefill", q, k_cache, v_cache, block_ids,
                                                           block_table, seq_lens, cu_seqlens_q, plan, sm_scale,
                                                           kv_layout, k_scale, v_scale)
    if _sparse_prefill_backend(backend, q, k, block_ids.shape[2]) == "cutedsl":
        # the kernel's tiles fill its 128 MMA rows: the indexer's (as many tokens as 128 rows hold)
        tile, tile_map = maps_.tile(call.group, "index")
        return cute_call.sparse_prefill(q, k, v, block_ids, block_table, seq_lens, tile_map, tile, call.sm_scale)
    tile, tile_map = maps_.tile(call.group, _maps.prefill_tile_kind(True, call.max_blocks, int(block_ids.shape[2])))
    return run(_attention(q, k, v, block_ids, block_table, seq_lens, tile_map, tile, call.sm_scale,
                          ops.kv_scales(k, k_scale, v_scale)))["out"]


def dense_prefill(q, k_cache, v_cache, block_table, seq_lens, *, cu_seqlens_q=None, sm_scale=None, plan=None,
                  kv_layout="HND", k_scale=None, v_scale=None, backend=None):
    """Causal paged GQA attention over every visible block (layers 0-2) -> ``[T, Hq, D]``.

    ``backend`` (static): as in ``m3_torch.dense_prefill``: "triton", "cutedsl" (Hopper sm_90a,
    bf16/fp16 caches) or None for ``$M3_DENSE_PREFILL`` (default "triton").
    """
    k, v, maps_, call, seq_lens = _check_prefill_attention("dense_prefill", q, k_cache, v_cache, None, block_table,
                                                           seq_lens, cu_seqlens_q, plan, sm_scale, kv_layout,
                                                           k_scale, v_scale)
    if _dense_prefill_backend(backend, q, k) == "cutedsl":
        # the kernel's tiles fill its 128 MMA rows: the indexer's (as many tokens as 128 rows hold)
        tile, tile_map = maps_.tile(call.group, "index")
        return cute_call.dense_prefill(q, k, v, block_table, seq_lens, tile_map, tile, call.sm_scale)
    tile, tile_map = maps_.tile(call.group, _maps.prefill_tile_kind(False, call.max_blocks, 0))
    return run(_attention(q, k, v, None, block_table, seq_lens, tile_map, tile, call.sm_scale,
                          ops.kv_scales(k, k_scale, v_scale)))["out"]


def msa_prefill(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, *, cu_seqlens_q=None, topk=16,
                init_blocks=0, local_blocks=1, sm_scale=None, plan=None, kv_layout="HND", k_scale=None,
                v_scale=None, backend=None):
    """``index_scores_prefill`` -> ``select_blocks_prefill`` -> ``sparse_prefill``; returns ``(out, block_ids)``
    (selection inside the attention launch when it has one split: ``launches.Selection``).

    ``backend``: the indexer's, as in ``index_scores``. The attention runs with the backend of
    ``$M3_SPARSE_PREFILL``, as in ``m3_torch.msa_prefill``.
    """
    k, v = _kv(k_cache, v_cache, kv_layout)
    index_k = as_index_k_view(index_k_cache)
    heads = _group(q, k) + ((int(idx_q.shape[1]),) if len(idx_q.shape) == 3 else ())
    maps_ = _prefill_maps(cu_seqlens_q, plan, heads)
    call = validate.check_msa_call(q, idx_q, k, v, index_k, block_table, seq_lens, topk=topk,
                                   init_blocks=init_blocks, local_blocks=local_blocks, sm_scale=sm_scale,
                                   prefill=maps_, cu_seqlens_q=cu_seqlens_q, k_scale=k_scale, v_scale=v_scale)
    seq_lens = guards.check_call("msa_prefill", q=q, idx_q=idx_q, k_cache=k, v_cache=v, index_k_cache=index_k,
                                 block_table=block_table, seq_lens=seq_lens)
    ops.check_kv_layout(k, v)
    backend = _backend(backend, idx_q, index_k)
    cute_prefill = _sparse_prefill_backend(None, q, k, topk) == "cutedsl"
    tile, tile_map = maps_.tile(call.num_index_heads, "index")
    scores = _scores(backend, idx_q, index_k, block_table, seq_lens, tile_map, tile, int(topk))
    if cute_prefill:
        tile, tile_map = maps_.tile(call.group, "index")
        return _select_and_attend_cutedsl(q, k, v, scores, block_table, seq_lens, maps_.token_map, tile, tile_map,
                                          call.sm_scale, int(topk), int(init_blocks), int(local_blocks))
    tile, tile_map = maps_.tile(call.group, _maps.prefill_tile_kind(True, call.max_blocks, int(topk)))
    return _select_and_attend(q, k, v, scores, block_table, seq_lens, maps_.token_map, tile, tile_map, call.sm_scale,
                              ops.kv_scales(k, k_scale, v_scale), int(topk), int(init_blocks), int(local_blocks))


# -- mixed step -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What of a :class:`~m3_kernels.planner.StepPlan` shapes the launches, hashable by value.

    No lengths: two steps with the same spans and block bounds share one spec
    (and one compiled step). Context rows ``[0, context_rows)``, tokens
    ``[0, context_tokens)``; the generation span follows them.
    """
    config: planner.StepConfig
    context_rows: int
    context_tokens: int
    context_max_blocks: int
    generation_rows: int        # padding rows included
    decode_query_len: int
    generation_max_blocks: int

    @property
    def num_rows(self) -> int:
        return self.context_rows + self.generation_rows

    @property
    def num_tokens(self) -> int:
        return self.context_tokens + self.generation_rows * self.decode_query_len

    @property
    def block_bound(self) -> int:
        return max((b for rows, b in ((self.context_rows, self.context_max_blocks),
                                      (self.generation_rows, self.generation_max_blocks)) if rows), default=0)


def step_inputs(plan: planner.StepPlan):
    """-> ``(StepSpec, PrefillMaps | None)``: the plan's static part and its context maps (cached on the plan)."""
    ctx, gen, cfg = plan.context, plan.generation, plan.config
    spec = StepSpec(cfg, ctx.num_rows, ctx.num_tokens, ctx.max_blocks, gen.num_rows, gen.decode_query_len,
                    gen.max_blocks)
    maps_ = prefill_maps(ctx.prefill, (cfg.group, cfg.num_kv_heads)) if ctx.num_tokens else None
    return spec, maps_


def msa_attention_step(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, *, plan, maps=None,
                       sparse=True, init_blocks=0, local_blocks=1, sm_scale=None, kv_layout="HND", k_scale=None,
                       v_scale=None, backend=None):
    """Attention of one layer for a whole mixed step -> ``(out [T, Hq, D], block_ids [Hk, T, topk] | None)``.

    Arguments as in ``m3_torch.msa_attention_step`` (no ``out``/``arena``); K/V
    arrays in ``kv_layout`` or PagedViews, index-K an array or a PagedView.
    plan: a StepPlan, or a StepSpec together with ``maps`` (see :func:`step_inputs`).
    backend: the indexer's (sparse layers), as in ``index_scores``. The context span's attention runs
    with the backend of ``$M3_SPARSE_PREFILL`` on sparse layers (as ``msa_prefill``) and of
    ``$M3_DENSE_PREFILL`` on dense ones (as ``dense_prefill(backend=None)``).
    """
    if isinstance(plan, planner.StepPlan):
        spec, plan_maps = step_inputs(plan)
        maps = plan_maps if maps is None else maps
    else:
        spec = plan
    cfg = spec.config
    k, v = _kv(k_cache, v_cache, kv_layout)
    index_k = as_index_k_view(index_k_cache) if sparse and index_k_cache is not None else None
    call = validate.check_step_call(q, idx_q, k, v, index_k, block_table, seq_lens, config=cfg,
                                    num_rows=spec.num_rows, num_tokens=spec.num_tokens, block_bound=spec.block_bound,
                                    sparse=sparse, init_blocks=init_blocks, local_blocks=local_blocks,
                                    sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)
    seq_lens = guards.check_call("msa_attention_step", q=q, idx_q=idx_q, k_cache=k, v_cache=v, index_k_cache=index_k,
                                 block_table=block_table, seq_lens=seq_lens)
    ops.check_kv_layout(k, v)
    backend = _backend(backend, idx_q, index_k) if sparse else None
    cute_prefill = (_sparse_prefill_backend(None, q, k, cfg.topk) if sparse
                    else _dense_prefill_backend(None, q, k)) == "cutedsl"
    if spec.context_tokens and (not isinstance(maps, PrefillMaps) or (maps.num_rows, maps.num_tokens)
                                != (spec.context_rows, spec.context_tokens)):
        raise ValueError("maps: a step with context tokens needs the PrefillMaps of its context span "
                         f"({spec.context_rows} rows / {spec.context_tokens} tokens, from step_inputs(plan))")
    # (rows, tokens, max_blocks, index (tile, tile_map, token_map), attention (tile, tile_map), CuTeDSL attention)
    spans = []
    if spec.context_tokens:
        # CuTeDSL prefill: its tiles fill the 128 MMA rows (the indexer's, as in dense_prefill and
        # sparse_prefill)
        kind = "index" if cute_prefill else _maps.prefill_tile_kind(sparse, spec.context_max_blocks, cfg.topk)
        spans.append((slice(0, spec.context_rows), slice(0, spec.context_tokens), spec.context_max_blocks,
                      (*maps.tile(cfg.num_kv_heads, "index"), maps.token_map), maps.tile(cfg.group, kind),
                      cute_prefill))
    if spec.generation_rows:
        rows, n, bound = spec.generation_rows, spec.decode_query_len, spec.generation_max_blocks
        index_tile = _maps.index_tile(cfg.num_kv_heads, n)
        attention_tile = _maps.decode_tile(cfg.group, n, sparse, max_blocks=bound, topk=cfg.topk, num_requests=rows,
                                           num_kv_heads=cfg.num_kv_heads, interpret=not ops.on_gpu())
        spans.append((slice(spec.context_rows, spec.num_rows), slice(spec.context_tokens, spec.num_tokens), bound,
                      (index_tile, *ops.decode_maps(rows, n, index_tile.tokens_per_tile)),
                      (attention_tile, ops.decode_maps(rows, n, attention_tile.tokens_per_tile)[0]), False))
    scales = ops.kv_scales(k, k_scale, v_scale)
    outs, ids = [], []
    for rows, toks, bound, index_maps, attention_maps, cute in spans:
        table, lens = block_table[rows, :bound], seq_lens[rows]
        if sparse:
            tile, tile_map, token_map = index_maps
            scores = _scores(backend, idx_q[toks], index_k, table, lens, tile_map, tile, cfg.topk)
            tile, tile_map = attention_maps
            if cute:
                out, block_ids = _select_and_attend_cutedsl(q[toks], k, v, scores, table, lens, token_map, tile,
                                                            tile_map, call.sm_scale, cfg.topk, int(init_blocks),
                                                            int(local_blocks))
            else:
                out, block_ids = _select_and_attend(q[toks], k, v, scores, table, lens, token_map, tile, tile_map,
                                                    call.sm_scale, scales, cfg.topk, int(init_blocks),
                                                    int(local_blocks))
            outs.append(out)
            ids.append(block_ids)
        elif cute:
            tile, tile_map = attention_maps
            outs.append(cute_call.dense_prefill(q[toks], k, v, table, lens, tile_map, tile, call.sm_scale))
        else:
            tile, tile_map = attention_maps
            outs.append(run(_attention(q[toks], k, v, None, table, lens, tile_map, tile, call.sm_scale,
                                       scales))["out"])
    out = jnp.concatenate(outs, axis=0) if outs else jnp.zeros(q.shape, q.dtype)
    if not sparse:
        return out, None
    block_ids = jnp.concatenate(ids, axis=1) if ids else jnp.full((cfg.num_kv_heads, q.shape[0], cfg.topk), -1,
                                                                  jnp.int32)
    return out, block_ids

