"""Launch descriptions of the model-step kernels: RMSNorm, the MoE router, the q/k norms with RoPE and
the cache write, the fused MoE experts, sampling.

The same :class:`~m3_kernels.launches.Launch` as the attention family's
(``launches.py``, whose docstring gives the conventions): a builder turns
operands (arrays as the kernel reads them), sizes the caller validated
(``validate.check_*_call``) and options into the kernel, its grid, its
arguments in signature order, its outputs, constexprs, warps and stages
(``tuning``), and the launches chained after it. ``m3_torch.ops.run`` and
``m3_jax.ops.run`` execute them, so both frameworks compile the same kernel
variants with the same arguments.

Pointers a kernel variant never reads get a stand-in array of the call (named
where it is chosen), so every launch passes real arrays only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from . import tuning
from .common import aligned
from .launches import TRITON_DTYPES, Launch, Operand, Output, Prev
from .maps import cdiv, contiguous_strides, next_pow2
from .validate import FP8, QKRopeCall

# bytes per element of the float dtypes the GEMMs read (tuning.moe sizes their pipeline stages by it)
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def dense(name: str, shape, dtype: str, **kind) -> Output:
    """An output in the contiguous row-major layout."""
    shape = tuple(int(s) for s in shape)
    return Output(name, shape, dtype, contiguous_strides(shape), **kind)


def unused(name: str, dtype: str) -> Output:
    """An output pointer the kernel variant never touches."""
    return Output(name, (1,), dtype, (1,), unused=True)


def chain(*launches: Launch) -> Launch:
    """``launches`` in order, each the ``then`` of the one before -> the first."""
    launch = launches[-1]
    for before in reversed(launches[:-1]):
        launch = dataclasses.replace(before, then=launch)
    return launch


# -- RMSNorm --------------------------------------------------------------------------------

def rms_norm(*, x: Operand, residual: Optional[Operand], weight, eps: float, interpret: bool) -> Launch:
    """``norm.rms_norm_kernel`` over the rows of ``x [T, H]`` -> ``normed`` (and, with ``residual``, the
    sum ``residual_out``), ``[T, H]`` in x's dtype, contiguous. ``weight``: ``[H]``, unit stride."""
    rows, hidden = x.shape
    cfg = tuning.norm(rows=rows, hidden=hidden, interpret=interpret)
    has_residual = residual is not None
    residual = residual if has_residual else x   # x stands in: never read without a residual
    outputs = (dense("normed", (rows, hidden), x.dtype),
               dense("residual_out", (rows, hidden), x.dtype) if has_residual else unused("residual_out", x.dtype))
    args = (x.ref, residual.ref, weight, rows, eps, *x.strides, *residual.strides)
    return Launch("norm.rms_norm_kernel", (cdiv(rows, cfg.block_r),), args, outputs,
                  dict(HIDDEN=hidden, HAS_RESIDUAL=has_residual, ALIGNED=aligned(x.strides[0], residual.strides[0]),
                       BLOCK_R=cfg.block_r, BLOCK_H=cfg.block_h),
                  cfg.num_warps, cfg.num_stages)


# -- the MoE router -------------------------------------------------------------------------

def moe_route(*, x: Operand, router_weight: Operand, bias, top_k: int, interpret: bool) -> Launch:
    """``router.router_logits_kernel`` (the logits' float32 partial sums over SPLITS ranges of H), then
    ``router.router_topk_kernel`` -> ``ids [T, top_k]`` int32 and ``weights [T, top_k]`` float32.
    ``bias``: ``[E]``, unit stride."""
    tokens, hidden = x.shape
    experts = router_weight.shape[0]
    cfg = tuning.router(tokens=tokens, hidden=hidden, experts=experts, interpret=interpret)
    chunk = cdiv(cdiv(hidden, cfg.splits), cfg.block_h) * cfg.block_h   # one program's range of H
    logits = Launch("router.router_logits_kernel",
                    (cdiv(tokens, cfg.block_t), cfg.experts_pad // cfg.block_e, cfg.splits),
                    (x.ref, router_weight.ref, tokens, *x.strides, *router_weight.strides),
                    (dense("partial", (cfg.splits, tokens, cfg.experts_pad), "float32"),),
                    dict(HIDDEN=hidden, NUM_EXPERTS=experts, EXPERTS_PAD=cfg.experts_pad, BLOCK_T=cfg.block_t,
                         BLOCK_E=cfg.block_e, BLOCK_H=cfg.block_h, CHUNK=chunk,
                         ALIGNED=aligned(x.strides[0], router_weight.strides[0])),
                    cfg.num_warps, cfg.num_stages)
    topk = Launch("router.router_topk_kernel", (cdiv(tokens, cfg.topk_block_t),), (Prev(0), bias, tokens),
                  (dense("ids", (tokens, top_k), "int32"), dense("weights", (tokens, top_k), "float32")),
                  dict(LOGIT_DTYPE=TRITON_DTYPES[x.dtype], NUM_EXPERTS=experts, EXPERTS_PAD=cfg.experts_pad,
                       TOP_K=top_k, TOP_K_PAD=next_pow2(top_k), BLOCK_T=cfg.topk_block_t, SPLITS=cfg.splits),
                  cfg.topk_num_warps, 1)
    return chain(logits, topk)


# -- q/k norms, RoPE and the cache write -------------------------------------------------------

def qk_rope_aligned(qkv_row_stride, cache_offsets, cache_strides) -> bool:
    """``qk_norm_rope_kernel``'s ``ALIGNED``: qkv's row stride, the three cache offsets and every cache
    stride but the channels' (the last of each cache) are multiples of 16 elements."""
    k, v, index = cache_strides[:4], cache_strides[4:8], cache_strides[8:]
    return aligned(qkv_row_stride, *cache_offsets, *k[:-1], *v[:-1], *index[:-1])


def qk_norm_rope(*, call: QKRopeCall, qkv: Operand, positions, inv_freq, q_norm, k_norm, index_q_norm, index_k_norm,
                 slot_mapping, k_cache: Operand, v_cache: Operand, index_k_cache: Optional[Operand], pool: Operand,
                 interpret: bool, k_scale=None, v_scale=None) -> Launch:
    """``qk_rope.qk_norm_rope_kernel`` of the call ``validate.check_qk_rope_call`` resolved -> ``q [T, Hq, D]``
    and (sparse layers) ``idx_q [T, Hk, Di]`` in qkv's dtype, and ``pool`` updated in place.

    The caches are views of ``pool`` (a flat buffer): their offsets and strides count their own
    elements from its start; their ``ref`` is not read. The pool is the kernel's last output, aliased
    to its input ``pool_in``. Norm weights, positions, ``inv_freq`` and ``slot_mapping``: unit stride.
    FP8 K/V caches read ``k_scale``/``v_scale`` (one-element float32 arrays)."""
    cfg = tuning.qk_rope(num_tokens=call.num_tokens, num_q_heads=call.num_q_heads, head_dim=call.head_dim,
                         interpret=interpret)
    if not call.sparse:   # the index heads' pointers, never read on a dense layer
        index_q_norm, index_k_norm = q_norm, k_norm
    if k_cache.dtype == FP8:
        if k_scale is None or v_scale is None:
            raise ValueError("k_scale, v_scale: an FP8 K/V cache needs both (one-element float32 arrays)")
    else:
        k_scale = v_scale = slot_mapping   # never read
    offsets = (k_cache.offset, v_cache.offset, index_k_cache.offset if call.sparse else 0)
    strides = (*k_cache.strides, *v_cache.strides, *(index_k_cache.strides if call.sparse else (0, 0, 0)))
    args = (qkv.ref, positions, inv_freq, q_norm, k_norm, index_q_norm, index_k_norm, slot_mapping, k_scale, v_scale,
            pool.ref, *offsets, *strides, *qkv.strides, call.num_tokens, call.eps)
    dtype = qkv.dtype
    outputs = (dense("q", (call.num_tokens, call.num_q_heads, call.head_dim), dtype),
               dense("idx_q", (call.num_tokens, call.num_kv_heads, call.index_head_dim), dtype) if call.sparse
               else unused("idx_q", dtype),
               Output("pool", pool.shape, pool.dtype, pool.strides))
    constexprs = dict(
        BLOCK_T=cfg.block_t, Q_HEADS=cfg.q_heads, NUM_Q_HEADS=call.num_q_heads, NUM_KV_HEADS=call.num_kv_heads,
        KV_HEADS_PAD=next_pow2(call.num_kv_heads), HEAD_DIM=call.head_dim,
        # a dense layer: index sizes that compile (never used)
        INDEX_HEAD_DIM=call.index_head_dim or 16, ROTARY_DIM=call.rotary_dim,
        INDEX_ROTARY_DIM=call.index_rotary_dim or 16, SPARSE=call.sparse, KV_DTYPE=k_cache.triton_dtype,
        INDEX_DTYPE=(index_k_cache if call.sparse else k_cache).triton_dtype,
        ALIGNED=qk_rope_aligned(qkv.strides[0], offsets, strides))
    if not cfg.fp_fusion:
        constexprs["enable_fp_fusion"] = False   # a compile option, passed with the constexprs (both runs)
    return Launch("qk_rope.qk_norm_rope_kernel",
                  (cdiv(call.num_tokens, cfg.block_t), 1 + cdiv(call.num_q_heads, cfg.q_heads)), args, outputs,
                  constexprs, cfg.num_warps, cfg.num_stages, aliases=((10, 2),))   # args[10]: the pool


# -- the fused MoE experts ------------------------------------------------------------------

def fused_moe(*, x: Operand, w_gate_up: Operand, w_down: Operand, topk_ids: Operand, topk_weights,
              shared_gate_up: Optional[Operand], shared_down: Optional[Operand], swiglu_alpha: float,
              swiglu_limit: float, routed_scaling_factor: float, interpret: bool) -> Launch:
    """``moe.align_kernel`` -> ``gate_up_kernel`` -> ``down_kernel`` -> ``sum_kernel`` -> ``out [T, H]`` in
    x's dtype. Every array contiguous; ``topk_weights``: ``[T, k]`` float32."""
    tokens, hidden = x.shape
    experts, two_inter, _ = w_gate_up.shape
    inter, top_k, shared = two_inter // 2, topk_ids.shape[1], shared_gate_up is not None
    per_token = top_k + shared
    pairs, all_experts = tokens * per_token, experts + shared
    cfg = tuning.moe(pairs=pairs, experts=all_experts, hidden=hidden, inter=inter, itemsize=ITEMSIZE[x.dtype],
                     interpret=interpret)
    # each expert with pairs adds at most one block beyond an even split of the pairs
    num_blocks = cdiv(pairs, cfg.block_m) + min(all_experts, pairs)
    num_rows = num_blocks * cfg.block_m   # the sorted (padded) pair order
    shape = dict(NUM_EXPERTS=experts, TOP_K=top_k, SHARED=shared)
    if not shared:   # its weight pointers get the routed experts' (never read)
        shared_gate_up, shared_down = w_gate_up, w_down

    def gemm(name, n, g: tuning.GemmConfig, args, out: Output) -> Launch:
        return Launch(f"moe.{name}", (num_blocks, cdiv(n, g.block_n)), args, (out,),
                      dict(shape, HIDDEN=hidden, INTER=inter, BLOCK_M=cfg.block_m, BLOCK_N=g.block_n,
                           BLOCK_K=g.block_k),
                      g.num_warps, g.num_stages)

    align = Launch("moe.align_kernel", (1,), (topk_ids.ref, tokens),
                   (dense("sorted_pairs", (num_rows,), "int32"), dense("block_expert", (num_blocks,), "int32"),
                    dense("block_rows", (num_blocks,), "int32")),
                   dict(shape, EXPERTS_POW2=next_pow2(all_experts), BLOCK_M=cfg.block_m, NUM_BLOCKS=num_blocks,
                        CHUNK=cfg.align_chunk),
                   tuning.MOE_ALIGN_NUM_WARPS, 1)
    routing = (Prev(0), Prev(1), Prev(2))   # align's outputs, read by gate_up
    gate_up = gemm("gate_up_kernel", inter, cfg.gate_up,
                   (x.ref, w_gate_up.ref, shared_gate_up.ref, *routing, float(swiglu_alpha), float(swiglu_limit)),
                   dense("act", (num_rows, inter), x.dtype))
    down = gemm("down_kernel", hidden, cfg.down,
                (Prev(0), w_down.ref, shared_down.ref, *(Prev(p.index, back=2) for p in routing), topk_weights),
                dense("weighted", (pairs, hidden), "float32"))
    total = Launch("moe.sum_kernel", (tokens, cdiv(hidden, cfg.sum_block_h)), (Prev(0), float(routed_scaling_factor)),
                   (dense("out", (tokens, hidden), x.dtype),),
                   dict(HIDDEN=hidden, TOP_K=top_k, SHARED=shared, BLOCK_H=cfg.sum_block_h),
                   tuning.MOE_SUM_NUM_WARPS, 1)
    return chain(align, gate_up, down, total)


# -- sampling -------------------------------------------------------------------------------

def sample(*, logits: Operand, temperature, top_k, top_p, min_p, seed_words, counters, penalties: Optional[tuple],
           seen: Optional[Operand], token_bitmask=None, interpret: bool) -> Launch:
    """``sampling.sample_kernel`` -> ``tokens`` int32, ``logprobs`` and ``lse`` float32, ``[L]`` each.

    logits: ``[L, V]``, unit column stride; per-row arrays ``[L]`` and ``seed_words [L, 2]``: contiguous.
    ``penalties`` (repetition, presence, frequency) with ``seen`` (``[L, >= V]``, unit column stride: see
    the kernel), or None for neither. ``token_bitmask``: ``[L, ceil(V / 32)]`` int32, contiguous (the
    ``MASKED`` variant), or None. The processed logits of filtered rows go to the scratch output
    ``sample_logits``."""
    rows, vocab = logits.shape
    cfg = tuning.sample(rows=rows, vocab=vocab, interpret=interpret)
    has_penalties = penalties is not None
    if not has_penalties:   # stand-ins, never read
        penalties, seen = (temperature,) * 3, Operand(counters, 0, (rows, 0), (0, 1))
    masked = token_bitmask is not None
    args = (logits.ref, temperature, top_k, top_p, min_p, seed_words, counters, *penalties, seen.ref,
            token_bitmask if masked else counters,   # counters stand in: never read unmasked
            rows, vocab, logits.strides[0], seen.strides[0])
    outputs = (dense("tokens", (rows,), "int32"), dense("logprobs", (rows,), "float32"),
               dense("lse", (rows,), "float32"), dense("sample_logits", (rows, vocab), "float32", scratch=True))
    return Launch("sampling.sample_kernel", (cdiv(rows, cfg.block_r),), args, outputs,
                  dict(HAS_PENALTIES=has_penalties, BLOCK_R=cfg.block_r, BLOCK_V=cfg.block_v,
                       BLOCK_S=cfg.block_s, PIVOTS=cfg.pivots, MASKED=masked),
                  cfg.num_warps, cfg.num_stages)
