"""Launch descriptions of the model-step kernels: RMSNorm, the MoE router, the q/k norms with RoPE and
the cache write, the fused MoE experts, sampling, and the block-scaled FP8 weight kernels (the
activation quantization, the FP8 linear layer, the FP8 fused MoE).

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
from .maps import FP8_BLOCK, cdiv, contiguous_strides, next_pow2
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

@dataclasses.dataclass(frozen=True)
class MoEBlocks:
    """The (token, expert) pairs of one fused-MoE call, grouped by expert in blocks of ``cfg.block_m`` rows:
    what its align, GEMM and sum launches share. The shared expert (``shared``) is expert ``experts``."""
    tokens: int
    top_k: int
    experts: int
    shared: bool
    cfg: tuning.MoEConfig

    @property
    def pairs(self) -> int:
        return self.tokens * (self.top_k + self.shared)

    @property
    def num_blocks(self) -> int:
        # each expert with pairs adds at most one block beyond an even split of the pairs
        return cdiv(self.pairs, self.cfg.block_m) + min(self.experts + self.shared, self.pairs)

    @property
    def num_rows(self) -> int:
        """Rows of the sorted (padded) pair order: the GEMMs' intermediate rows."""
        return self.num_blocks * self.cfg.block_m

    @property
    def shape(self) -> dict:
        return dict(NUM_EXPERTS=self.experts, TOP_K=self.top_k, SHARED=self.shared)


def moe_align(blocks: MoEBlocks, topk_ids: Operand) -> Launch:
    """``moe.align_kernel`` -> ``sorted_pairs``, ``block_expert``, ``block_rows`` (int32)."""
    cfg = blocks.cfg
    return Launch("moe.align_kernel", (1,), (topk_ids.ref, blocks.tokens, blocks.num_blocks),
                  (dense("sorted_pairs", (blocks.num_rows,), "int32"),
                   dense("block_expert", (blocks.num_blocks,), "int32"),
                   dense("block_rows", (blocks.num_blocks,), "int32")),
                  dict(blocks.shape, EXPERTS_POW2=next_pow2(blocks.experts + blocks.shared), BLOCK_M=cfg.block_m,
                       CHUNK=cfg.align_chunk),
                  tuning.MOE_ALIGN_NUM_WARPS, 1)


def moe_gemm(kernel: str, blocks: MoEBlocks, n: int, g: tuning.GemmConfig, args: tuple, outputs: tuple,
             **constexprs) -> Launch:
    """A fused-MoE GEMM: one program per (block of rows, ``g.block_n`` of the ``n`` output columns)."""
    return Launch(kernel, (blocks.num_blocks, cdiv(n, g.block_n)), args, outputs,
                  dict(blocks.shape, **constexprs, BLOCK_M=blocks.cfg.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k),
                  g.num_warps, g.num_stages)


def moe_sum(blocks: MoEBlocks, hidden: int, routed_scaling_factor: float, dtype: str) -> Launch:
    """``moe.sum_kernel`` of the pairs' weighted outputs (the launch before it) -> ``out [T, H]`` in ``dtype``."""
    block_h = blocks.cfg.sum_block_h
    return Launch("moe.sum_kernel", (blocks.tokens, cdiv(hidden, block_h)), (Prev(0), float(routed_scaling_factor)),
                  (dense("out", (blocks.tokens, hidden), dtype),),
                  dict(HIDDEN=hidden, TOP_K=blocks.top_k, SHARED=blocks.shared, BLOCK_H=block_h),
                  tuning.MOE_SUM_NUM_WARPS, 1)


# align's outputs (sorted_pairs, block_expert, block_rows) in the args of the launch after it
ROUTING = (Prev(0), Prev(1), Prev(2))


def fused_moe(*, x: Operand, w_gate_up: Operand, w_down: Operand, topk_ids: Operand, topk_weights,
              shared_gate_up: Optional[Operand], shared_down: Optional[Operand], swiglu_alpha: float,
              swiglu_limit: float, routed_scaling_factor: float, interpret: bool) -> Launch:
    """``moe.align_kernel`` -> ``gate_up_kernel`` -> ``down_kernel`` -> ``sum_kernel`` -> ``out [T, H]`` in
    x's dtype. Every array contiguous; ``topk_weights``: ``[T, k]`` float32."""
    tokens, hidden = x.shape
    experts, two_inter, _ = w_gate_up.shape
    inter, top_k, shared = two_inter // 2, topk_ids.shape[1], shared_gate_up is not None
    cfg = tuning.moe(pairs=tokens * (top_k + shared), experts=experts + shared, hidden=hidden, inter=inter,
                     itemsize=ITEMSIZE[x.dtype], interpret=interpret)
    blocks = MoEBlocks(tokens, top_k, experts, shared, cfg)
    if not shared:   # its weight pointers get the routed experts' (never read)
        shared_gate_up, shared_down = w_gate_up, w_down
    gate_up = moe_gemm("moe.gate_up_kernel", blocks, inter, cfg.gate_up,
                       (x.ref, w_gate_up.ref, shared_gate_up.ref, *ROUTING, float(swiglu_alpha), float(swiglu_limit)),
                       (dense("act", (blocks.num_rows, inter), x.dtype),), HIDDEN=hidden, INTER=inter)
    down = moe_gemm("moe.down_kernel", blocks, hidden, cfg.down,
                    (Prev(0), w_down.ref, shared_down.ref, *(Prev(p.index, back=2) for p in ROUTING), topk_weights),
                    (dense("weighted", (blocks.pairs, hidden), "float32"),), HIDDEN=hidden, INTER=inter)
    return chain(moe_align(blocks, topk_ids), gate_up, down, moe_sum(blocks, hidden, routed_scaling_factor, x.dtype))


# -- block-scaled FP8 weights ---------------------------------------------------------------

def quantize_activation(*, x: Operand, interpret: bool) -> Launch:
    """``fp8_linear.quantize_act_kernel`` -> ``xq [T, K]`` float8_e4m3fn and ``x_scale [T, ceil(K / 128)]``
    float32 (per token and 128 channels). x contiguous."""
    tokens, k = x.shape
    groups = cdiv(k, FP8_BLOCK)
    cfg = tuning.fp8_quantize(groups=groups, interpret=interpret)
    return Launch("fp8_linear.quantize_act_kernel", (tokens, cdiv(groups, cfg.groups)), (x.ref,),
                  (dense("xq", (tokens, k), FP8), dense("x_scale", (tokens, groups), "float32")),
                  dict(K=k, GROUPS=cfg.groups), cfg.num_warps, 1)


def fp8_linear(*, x: Operand, weight: Operand, weight_scale, interpret: bool) -> Launch:
    """:func:`quantize_activation` of x -> ``fp8_linear.fp8_linear_kernel`` -> ``out [T, N]`` in x's dtype; split
    over K (decode sizes), the kernel writes float32 ``partial [splits, T, N]`` and ``fp8_linear.sum_splits_kernel``
    adds them in order into ``out``. x, weight ``[N, K]`` e4m3 and weight_scale ``[ceil(N / 128), ceil(K / 128)]``
    float32: contiguous."""
    tokens, k = x.shape
    n = weight.shape[0]
    cfg = tuning.fp8_linear(tokens=tokens, n=n, k=k, interpret=interpret)
    k_blocks = cdiv(k, FP8_BLOCK)
    split_blocks = cdiv(k_blocks, cfg.splits)
    splits = cdiv(k_blocks, split_blocks)   # every split gets blocks
    out = dense("out", (tokens, n), x.dtype)
    linear = Launch("fp8_linear.fp8_linear_kernel", (cdiv(n, cfg.block_n), cdiv(tokens, cfg.block_m), splits),
                    (Prev(0), Prev(1), weight.ref, weight_scale, tokens),
                    (out if splits == 1 else dense("partial", (splits, tokens, n), "float32"),),
                    dict(N=n, K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=FP8_BLOCK,
                         SPLIT_BLOCKS=split_blocks, PREFETCH_BLOCKS=cfg.prefetch_blocks),
                    cfg.num_warps, cfg.num_stages)
    if splits == 1:
        return chain(quantize_activation(x=x, interpret=interpret), linear)
    total = tokens * n
    sum_splits = Launch("fp8_linear.sum_splits_kernel", (cdiv(total, cfg.sum_block),), (Prev(0), total), (out,),
                        dict(SPLITS=splits, BLOCK=cfg.sum_block), tuning.FP8_SUM_NUM_WARPS, 1)
    return chain(quantize_activation(x=x, interpret=interpret), linear, sum_splits)


def fused_moe_fp8(*, x: Operand, w_gate_up: Operand, w_gate_up_scale, w_down: Operand, w_down_scale,
                  topk_ids: Operand, topk_weights, shared_gate_up: Optional[Operand], shared_gate_up_scale,
                  shared_down: Optional[Operand], shared_down_scale, swiglu_alpha: float, swiglu_limit: float,
                  routed_scaling_factor: float, interpret: bool) -> Launch:
    """:func:`quantize_activation` of x -> ``moe.align_kernel`` -> ``fp8_moe.fp8_gate_up_kernel`` ->
    ``fp8_down_kernel`` -> ``moe.sum_kernel`` -> ``out [T, H]`` in x's dtype. Every array contiguous; the
    weights e4m3 with float32 scales per 128 x 128 block (``validate.check_fp8_moe_call``); ``topk_weights``:
    ``[T, k]`` float32."""
    tokens, hidden = x.shape
    experts, two_inter, _ = w_gate_up.shape
    inter, top_k, shared = two_inter // 2, topk_ids.shape[1], shared_gate_up is not None
    cfg = tuning.fp8_moe(pairs=tokens * (top_k + shared), experts=experts + shared, hidden=hidden, inter=inter,
                         interpret=interpret)
    blocks = MoEBlocks(tokens, top_k, experts, shared, cfg)
    if not shared:   # its weight pointers get the routed experts' (never read)
        shared_gate_up, shared_gate_up_scale = w_gate_up, w_gate_up_scale
        shared_down, shared_down_scale = w_down, w_down_scale
    shape = dict(HIDDEN=hidden, INTER=inter, DTYPE=TRITON_DTYPES[x.dtype])
    xq = (Prev(0, back=2), Prev(1, back=2))   # quantize_activation's outputs, read by gate_up after align
    gate_up = moe_gemm("fp8_moe.fp8_gate_up_kernel", blocks, inter, cfg.gate_up,
                       (*xq, w_gate_up.ref, w_gate_up_scale, shared_gate_up.ref, shared_gate_up_scale, *ROUTING,
                        float(swiglu_alpha), float(swiglu_limit)),
                       (dense("act", (blocks.num_rows, inter), FP8),
                        dense("act_scale", (blocks.num_rows, cdiv(inter, FP8_BLOCK)), "float32")), **shape)
    down = moe_gemm("fp8_moe.fp8_down_kernel", blocks, hidden, cfg.down,
                    (Prev(0), Prev(1), w_down.ref, w_down_scale, shared_down.ref, shared_down_scale,
                     *(Prev(p.index, back=2) for p in ROUTING), topk_weights),
                    (dense("weighted", (blocks.pairs, hidden), "float32"),), **shape)
    return chain(quantize_activation(x=x, interpret=interpret), moe_align(blocks, topk_ids), gate_up, down,
                 moe_sum(blocks, hidden, routed_scaling_factor, x.dtype))


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
