"""MiniMax-M3 text model in JAX: the math of one forward step over the paged pool.

Pure functions over a params pytree: the flat dict of canonical tensor names
(``m3_engine.checkpoint``: transformers' ``MiniMaxM3VLForCausalLM`` state-dict
names, ``model.layers.{i}.self_attn.q_proj.weight`` ...) -> jax arrays, all in
the model dtype. :func:`forward` runs every token of one step (context rows'
prompt chunks first, generation rows last, as the step planner wants) through
all layers. On a GPU the shared Triton kernels torch runs too do the work XLA
cannot fuse: per layer ``m3_jax.qk_norm_rope`` (q/k norms and RoPE, the K/V
and, on sparse layers, index-K rows written into the pool),
``msa_attention_step`` (``sparse=True`` on MSA layers), ``moe_route`` (the
router) and ``fused_moe`` (the routed and shared experts); the residual adds
and norms stay XLA's (it fuses them; a jax-triton launch costs more than a
fusion). On the CPU the attention kernels run in Triton's interpreter, but the
norms, RoPE (then ``write_cache``), router and experts are the same math in XLA
ops: their interpreted kernels cost 25-110 ms a call. Under ``jax.jit`` with
the pool donated the cache writes are in place.

Semantics: transformers 5.23's ``MiniMaxM3VLForCausalLM`` (text model); the
math, and where and why this project differs from transformers, are written
once, in docs/ENGINE.md ("The model's semantics"). The torch twin is
``m3_torch/model.py`` (same math and roundings). On the CPU the experts run as
``jax.lax.ragged_dot_general`` over token rows sorted by expert (the canonical
``[E, out, in]`` weights, no transpose); the sum over the k experts is float32
on both. FP8 weights (an :class:`Fp8Weight`: a weight and its ``_scale_inv`` in
the params) run in ``fp8_linear`` / ``fused_moe_fp8`` on both backends (the
kernels in the interpreter on the CPU), as in torch. The module-level
``rms_norm``, ``rope_cos_sin`` and ``apply_rope`` are that math in XLA ops (and
the EAGLE-3 head's building blocks).
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from m3_engine.model_config import M3TextConfig
from m3_engine.quantization import is_scale, scale_name
from m3_kernels.pool import PoolLayout

from .cache import layer_views, write_cache
from ._triton_call import on_gpu
from .api import StepSpec, msa_attention_step
from .fp8 import fp8_linear, fused_moe_fp8
from .fused import moe_route, qk_norm_rope
from .moe import fused_moe

__all__ = ["StepBatch", "forward", "hidden_states", "logits", "attention", "mlp", "moe", "route", "experts",
           "local_experts", "rms_norm", "rope_cos_sin", "apply_rope", "swiglu_oai", "linear", "Fp8Weight", "inv_freq",
           "pool_layout", "DTYPES"]

DTYPES = ("float32", "bfloat16", "float16")


class StepBatch(NamedTuple):
    """One step's metadata as int32 arrays (numpy on the host, jax on the device).

    input_ids:    [T] token ids (padding tokens: any valid id, e.g. 0).
    positions:    [T] position of each token in its request.
    slot_mapping: [T] ``slot * 128 + row`` of each token's cache row; -1 skips (padding).
    block_table:  [R, max_blocks] slot ids per request (padding rows: anything).
    seq_lens:     [R] KV length per row, this step's tokens included (0: padding row).
    logits_rows:  [L] token rows whose next-token logits the step returns.
    """
    input_ids: jax.Array
    positions: jax.Array
    slot_mapping: jax.Array
    block_table: jax.Array
    seq_lens: jax.Array
    logits_rows: jax.Array


# -- building blocks (transformers' modules, on [T, ...] token rows) --------------------------

class Fp8Weight(NamedTuple):
    """A block-scaled FP8 linear weight (``m3_engine.quantization``): ``W ~= weight * scale`` per 128 x 128
    block. weight: ``[..., N, K]`` float8_e4m3fn; scale: ``[..., ceil(N / 128), ceil(K / 128)]`` float32.
    The params hold the two as ``<name>`` and ``<name>_scale_inv``; a layer's view pairs them."""
    weight: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple:
        return self.weight.shape


def linear(x, w):
    """``x @ W.T`` (a torch ``F.linear``) in x's dtype, ``w`` an array (float32 at full precision, no TF32) or
    an :class:`Fp8Weight` (``fp8_linear``: x quantized per token and 128 channels, FP8 GEMM; on the CPU the
    kernel in the interpreter)."""
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w.weight, w.scale)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), precision=precision)


def rms_norm(x, weight, eps: float):
    """Gemma-style RMSNorm over the last axis: float32 math, scale ``1 + weight``, x's dtype out."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def inv_freq(config: M3TextConfig) -> np.ndarray:
    """RoPE inverse frequencies ``[rotary_dim / 2]`` float32, computed as transformers does (float32)."""
    rot = config.rotary_dim
    exponent = np.arange(0, rot, 2, dtype=np.float32) / np.float32(rot)
    return (np.float32(1.0) / np.power(np.float32(config.rope_theta), exponent)).astype(np.float32)


def rope_cos_sin(positions, freqs, dtype):
    """positions [T] -> (cos, sin) [T, rotary_dim] in ``dtype`` (float32 math, then cast)."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(freqs)[None, :]
    emb = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x, cos, sin):
    """x [T, H, D]; cos/sin [T, R]: rotate the first R channels (rotate_half form), pass the rest."""
    r = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    rotated = x_rot * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
    return jnp.concatenate([rotated, x_pass], axis=-1)


def swiglu_oai(gate_up, alpha: float, limit: float):
    """[..., 2I] (gate half, then up half) -> [..., I]."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1.0) * (gate * jax.nn.sigmoid(gate * alpha))


def mlp(x, gate_up, down, config: M3TextConfig):
    return linear(swiglu_oai(linear(x, gate_up), config.swiglu_alpha, config.swiglu_limit), down)


# the expert weights are [E, out, in]: contract x's last axis with the weights' last, group by axis 0
_EXPERT_DOT = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                                lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def _experts_dot(rows, weights, group_sizes):
    precision = jax.lax.Precision.HIGHEST if rows.dtype == jnp.float32 else None
    return jax.lax.ragged_dot_general(rows, weights, group_sizes, _EXPERT_DOT, precision=precision)


def route(p: Mapping, x, config: M3TextConfig):
    """The router of an MoE block on x [T, hidden] (on a GPU ``m3_jax.moe_route``, on the CPU the same math
    in XLA ops) -> (chosen [T, k] int32 expert ids, weights [T, k] float32 summing to 1 per row)."""
    if on_gpu():
        return moe_route(x, p["gate.weight"], p["gate.e_score_correction_bias"], config.num_experts_per_tok)
    probs = jax.nn.sigmoid(linear(x, p["gate.weight"]).astype(jnp.float32))               # [T, E]
    _, chosen = jax.lax.top_k(probs + p["gate.e_score_correction_bias"].astype(jnp.float32),
                              config.num_experts_per_tok)                                # [T, k]
    top_w = jnp.take_along_axis(probs, chosen, axis=-1)
    return chosen.astype(jnp.int32), top_w / jnp.sum(top_w, axis=-1, keepdims=True)


def local_experts(chosen, top_w, start, count: int):
    """The router's choice for a shard holding experts ``[start, start + count)`` -> (ids [T, k] int32 in
    ``[0, count)``, weights [T, k] float32): a pair routed to another shard's expert gets local expert 0 and
    weight 0, an exact zero in its token's sum (``fused_moe`` has no id it skips; the torch twin,
    ``m3_torch.model.local_experts``, says why)."""
    local = chosen - start
    mine = (local >= 0) & (local < count)
    return jnp.where(mine, local, 0).astype(jnp.int32), jnp.where(mine, top_w, 0.0)


def moe(p: Mapping, x, config: M3TextConfig, expert_start=None):
    """The MoE block of one layer (``p``: its ``mlp.*`` tensors by suffix) on x [T, hidden]: on a GPU the
    shared fused-MoE kernels (``m3_jax.fused_moe``; the shared expert inside them when it has the
    experts' width, M3's), on the CPU :func:`experts` (same math and roundings). ``expert_start``: None,
    or (expert parallelism) the global id of ``p``'s first expert: the pairs of other shards' experts
    weigh 0 (:func:`local_experts`)."""
    c = config
    chosen, top_w = route(p, x, c)
    if expert_start is not None:
        chosen, top_w = local_experts(chosen, top_w, expert_start, p["experts.gate_up_proj"].shape[0])
    gate_up, down = p["shared_experts.gate_up_proj.weight"], p["shared_experts.down_proj.weight"]
    fp8 = isinstance(p["experts.gate_up_proj"], Fp8Weight)   # FP8 experts: the kernels, also on the CPU
    if not on_gpu() and not fp8:
        return experts(p, x, chosen, top_w, c) * c.routed_scaling_factor + mlp(x, gate_up, down, c)
    fuse_shared = down.shape[1] == p["experts.down_proj"].shape[2]
    options = dict(swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit,
                   routed_scaling_factor=c.routed_scaling_factor)
    if fp8:
        shared = dict(shared_gate_up=gate_up.weight, shared_gate_up_scale=gate_up.scale, shared_down=down.weight,
                      shared_down_scale=down.scale)
        out = fused_moe_fp8(x, *p["experts.gate_up_proj"], *p["experts.down_proj"], chosen, top_w, **options,
                            **(shared if fuse_shared else {}))
    else:
        out = fused_moe(x, p["experts.gate_up_proj"], p["experts.down_proj"], chosen, top_w, **options,
                        **(dict(shared_gate_up=gate_up, shared_down=down) if fuse_shared else {}))
    return out if fuse_shared else out + mlp(x, gate_up, down, c)


def experts(p: Mapping, x, chosen, top_w, config: M3TextConfig):
    """``sum_j top_w[t, j] * expert_{chosen[t, j]}(x[t])`` [T, hidden] in x's dtype: ``ragged_dot`` over the
    rows sorted by expert, the sum over j in float32."""
    c = config
    T, k = chosen.shape
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)                                                # rows grouped by expert
    group_sizes = jnp.bincount(flat, length=p["experts.gate_up_proj"].shape[0]).astype(jnp.int32)
    rows = x[order // k]                                                                  # [T*k, hidden]
    act = swiglu_oai(_experts_dot(rows, p["experts.gate_up_proj"], group_sizes), c.swiglu_alpha, c.swiglu_limit)
    out = _experts_dot(act, p["experts.down_proj"], group_sizes)                          # [T*k, hidden]
    weighted = jnp.zeros((T * k, x.shape[1]), jnp.float32).at[order].set(
        out.astype(jnp.float32) * top_w.reshape(-1)[order, None])
    return weighted.reshape(T, k, -1).sum(axis=1).astype(x.dtype)


# -- attention ----------------------------------------------------------------------------------

def attention(p: Mapping, x, pool, batch: StepBatch, maps, *, layer: int, config: M3TextConfig, layout: PoolLayout,
              spec: StepSpec):
    """Attention of layer ``layer`` (``p``: its ``self_attn.*`` tensors by suffix) -> (out [T, hidden], pool).

    The q/k/v (/index q/k) projections, then one kernel (``m3_jax.qk_norm_rope``) for the q/k norms and
    RoPE that also writes the K/V (/index-K) rows into the pool, then ``msa_attention_step`` and o_proj."""
    c = config
    sparse = c.sparse_layers[layer]
    names = ["q_proj", "k_proj", "v_proj"] + (["indexer.q_proj", "indexer.k_proj"] if sparse else [])
    qkv = jnp.concatenate([linear(x, p[f"{n}.weight"]) for n in names], axis=-1)
    k_view, v_view, index_view = layer_views(pool, layout, layer)
    if on_gpu():
        q, idx_q, k_cache, v_cache, index_k_cache = qk_norm_rope(
            qkv, batch.positions, jnp.asarray(inv_freq(c)), p["q_norm.weight"], p["k_norm.weight"], k_view,
            v_view, batch.slot_mapping, num_q_heads=c.num_attention_heads, eps=c.rms_norm_eps,
            index_q_norm=p.get("indexer.q_norm.weight"), index_k_norm=p.get("indexer.k_norm.weight"),
            index_k_cache=index_view)
    else:   # the same math in XLA ops, then write_cache (the interpreted kernel costs ~0.1 s a call)
        q, k, v, idx_q, idx_k = _project(p, qkv, batch.positions, c, sparse)
        k_cache, v_cache, index_k_cache = write_cache(k, v, idx_k, k_view, v_view, index_view,
                                                      batch.slot_mapping)
    out, _ = msa_attention_step(q, idx_q, k_cache, v_cache, index_k_cache, batch.block_table, batch.seq_lens,
                                plan=spec, maps=maps, sparse=sparse, init_blocks=c.index_init_blocks,
                                local_blocks=c.index_local_blocks)
    return linear(out.reshape(x.shape[0], -1), p["o_proj.weight"]), k_cache.buffer


def _project(p: Mapping, qkv, positions, config: M3TextConfig, sparse: bool):
    """The q/k (/index) norms and RoPE of the fused projection ``qkv`` in XLA ops -> q, k, v, idx_q, idx_k."""
    c = config
    T, hq, hk, d, di, eps = qkv.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim, \
        c.index_head_dim, c.rms_norm_eps
    cos, sin = rope_cos_sin(positions, inv_freq(c), qkv.dtype)
    ends = np.cumsum([hq * d, hk * d, hk * d] + ([c.index_n_heads * di] if sparse else []))
    parts = jnp.split(qkv, ends, axis=-1)
    q = apply_rope(rms_norm(parts[0].reshape(T, hq, d), p["q_norm.weight"], eps), cos, sin)
    k = apply_rope(rms_norm(parts[1].reshape(T, hk, d), p["k_norm.weight"], eps), cos, sin)
    v = parts[2].reshape(T, hk, d)
    if not sparse:
        return q, k, v, None, None
    icos, isin = cos[:, :di], sin[:, :di]   # transformers: cos[..., :index_head_dim]
    idx_q = apply_rope(rms_norm(parts[3].reshape(T, c.index_n_heads, di), p["indexer.q_norm.weight"], eps),
                       icos, isin)
    idx_k = apply_rope(rms_norm(parts[4].reshape(T, 1, di), p["indexer.k_norm.weight"], eps), icos, isin)
    return q, k, v, idx_q, idx_k.reshape(T, di)


# -- the model ----------------------------------------------------------------------------------

def _layer_params(params: Mapping, layer: int, part: str) -> dict:
    """Layer ``layer``'s ``part`` tensors by suffix; an FP8 weight and its ``_scale_inv`` as one :class:`Fp8Weight`."""
    prefix = f"model.layers.{layer}.{part}."
    scales = {name: params.get(scale_name(name)) for name in params if name.startswith(prefix) and not is_scale(name)}
    return {name[len(prefix):]: params[name] if scale is None else Fp8Weight(params[name], scale)
            for name, scale in scales.items()}


def forward(params: Mapping, pool, batch: StepBatch, maps, *, config: M3TextConfig, layout: PoolLayout,
            spec: StepSpec, all_reduce: Callable | None = None, aux_layers: tuple = ()):
    """One step through the model -> ``(logits [L, vocab] float32, pool)``; with ``aux_layers`` (an
    EAGLE-3 draft's) ``((logits, aux), pool)``, ``aux`` as :func:`hidden_states` gives it.

    params: canonical name -> array (model dtype); ``lm_head.weight`` may be
            absent when ``config.tie_word_embeddings``.
    pool:   the flat sub-page pool ``[layout.numel]`` (donate it under jit).
    batch:  the step's :class:`StepBatch`; ``maps``: the context span's
            ``PrefillMaps`` (None without context rows).
    config, layout, spec: static (hashable): the model config, the pool layout
            (one layer per model layer) and the step's ``StepSpec``.
    all_reduce: see :func:`hidden_states`.
    """
    out, pool = hidden_states(params, pool, batch, maps, config=config, layout=layout, spec=spec,
                              all_reduce=all_reduce, aux_layers=aux_layers)
    if not aux_layers:
        return logits(params, out[batch.logits_rows], config=config), pool
    x, aux = out
    return (logits(params, x[batch.logits_rows], config=config), aux), pool


def hidden_states(params: Mapping, pool, batch: StepBatch, maps, *, config: M3TextConfig, layout: PoolLayout,
                  spec: StepSpec, all_reduce: Callable | None = None, aux_layers: tuple = (), vocab_start=None,
                  expert_start=None):
    """The step through every layer (cache writes included) -> ``(residual stream [T, hidden], pool)``.
    With ``aux_layers``: ``((x, aux), pool)``, ``aux [T, len(aux_layers) * hidden]`` the residual
    stream after each of those layers (their outputs), concatenated in their order: EAGLE-3's aux states.

    all_reduce: None, or ``all_reduce(x) -> x`` summed over a tensor-parallel
            axis. The model knows nothing of tensor parallelism: given one
            shard's slices of the weights (``m3_engine.tp``) and their config
            (``TPPlan.local_config``), the outputs of ``o_proj`` and of each
            MLP are partial sums, which this hook completes (``m3_jax.tp``
            passes ``jax.lax.psum`` over the mesh axis); ``lm_head`` is not used.
    vocab_start: None, or (vocab parallel) the first token id of the shard's embedding rows: an id
            outside them gives zeros, and ``all_reduce`` completes the lookup.
    expert_start: None, or (expert parallel) the global id of the shard's first routed expert (see
            :func:`moe`).
    """
    c = config
    if layout.num_layers != c.num_hidden_layers:
        raise ValueError(f"layout: expected {c.num_hidden_layers} layers (one per model layer), "
                         f"got {layout.num_layers}")
    reduce = all_reduce or (lambda t: t)
    embed = params["model.embed_tokens.weight"]
    if vocab_start is None:
        x = embed[batch.input_ids]
    else:
        local = batch.input_ids - vocab_start
        inside = (local >= 0) & (local < embed.shape[0])
        x = reduce(jnp.where(inside[:, None], embed[jnp.where(inside, local, 0)], 0).astype(embed.dtype))
    outputs = {}
    for i in range(c.num_hidden_layers):
        prefix = f"model.layers.{i}."
        h = rms_norm(x, params[prefix + "input_layernorm.weight"], c.rms_norm_eps)
        out, pool = attention(_layer_params(params, i, "self_attn"), h, pool, batch, maps, layer=i, config=c,
                              layout=layout, spec=spec)
        x = x + reduce(out)
        h = rms_norm(x, params[prefix + "post_attention_layernorm.weight"], c.rms_norm_eps)
        p = _layer_params(params, i, "mlp")
        x = x + reduce(moe(p, h, c, expert_start) if c.moe_layers[i]
                       else mlp(h, p["gate_up_proj.weight"], p["down_proj.weight"], c))
        if i in aux_layers:
            outputs[i] = x
    if not aux_layers:
        return x, pool
    return (x, jnp.concatenate([outputs[i] for i in aux_layers], axis=-1)), pool


def logits(params: Mapping, x, *, config: M3TextConfig):
    """Final norm + ``lm_head`` of hidden rows ``x [L, hidden]`` -> ``[L, vocab]`` float32."""
    x = rms_norm(x, params["model.norm.weight"], config.rms_norm_eps)
    head = params["model.embed_tokens.weight"] if config.tie_word_embeddings else params["lm_head.weight"]
    return linear(x, head).astype(jnp.float32)


def pool_layout(config: M3TextConfig, num_slots: int, dtype: str, *, kv_cache_dtype: str = "auto",
                index_cache_dtype: str = "auto") -> PoolLayout:
    """The pool of a model: one layer per model layer, index-K sub-pages on the sparse ones."""
    return PoolLayout.create(num_slots, sparse=config.sparse_layers, num_kv_heads=config.num_key_value_heads,
                             head_dim=config.head_dim, index_head_dim=config.index_head_dim, dtype=dtype,
                             kv_cache_dtype=kv_cache_dtype, index_cache_dtype=index_cache_dtype)

