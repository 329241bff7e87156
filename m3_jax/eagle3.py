"""EAGLE-3 draft head in JAX: one Llama decoder layer over the target's hidden states, on a paged pool.

Pure functions over a params pytree, as ``m3_jax.model``: the canonical names of
``m3_engine.eagle3`` -> jax arrays (model dtype), plus ``"draft_to_target"``
(int32 ``[draft_vocab]``, when the head is compressed) and the target's
``embed_tokens.weight`` / ``lm_head.weight`` filled in when the draft shares
them (:func:`params_from_weights`). :func:`forward` runs a step's tokens through
the layer: ``m3_jax.write_cache`` into the draft's own pool (one dense layer:
``pool_layout``) and ``m3_jax.msa_attention_step(..., sparse=False)`` with the
``StepSpec``/``PrefillMaps`` of a plan made by the draft's planner
(``m3_engine.eagle3.draft_step_config``). Under ``jax.jit`` (``config``,
``layout`` and ``spec`` static) with the pool donated the cache writes are in place.

The math, the inputs a step feeds in and the rounding order are those of the
torch twin, ``m3_torch/eagle3.py``; the format and conventions are in
``m3_engine/eagle3.py`` and docs/ENGINE.md ("EAGLE-3 draft heads").

:class:`Eagle3Proposer` is the draft inside an engine (``m3_jax.runner``):
after each target step it runs the scheduler's
:class:`~m3_engine.scheduler.DraftPass` as two jitted functions, the first
pass over the target step's rows as the step builder padded them (compiled per
the step's shape) and the chain (compiled per padded batch size).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from m3_engine.buckets import StepBuckets
from m3_engine.eagle3 import (LAYER, Eagle3Config, draft_pool_layout, draft_step_config, draft_to_target_ids,
                              expected_eagle3_shapes, load_eagle3_weights)
from m3_engine.model_config import M3TextConfig
from m3_engine.scheduler import DraftPass
from m3_kernels.planner import StepConfig, StepPlanner
from m3_kernels.pool import PoolLayout

from .api import StepSpec, msa_attention_step, step_inputs
from .cache import allocate_pool, layer_views, write_cache
from .model import StepBatch, apply_rope, linear, rope_cos_sin

__all__ = ["params_from_weights", "load_params", "fuse", "forward", "draft_logits", "logits", "draft_tokens",
           "to_target_ids", "pool_layout", "rms_norm", "Eagle3Proposer", "TargetStep"]

DRAFT_TO_TARGET = "draft_to_target"


def rms_norm(x, weight, eps: float):
    """Llama RMSNorm over the last axis: float32 statistics, then ``weight * normed.astype(x.dtype)``."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def pool_layout(config: Eagle3Config, num_slots: int, dtype: str, *, kv_cache_dtype: str = "auto") -> PoolLayout:
    """The draft's pool: one dense layer of its KV heads, the target pool's ``num_slots``."""
    return draft_pool_layout(config, num_slots, dtype, kv_cache_dtype=kv_cache_dtype)


# -- params ------------------------------------------------------------------------------------

def params_from_weights(config: Eagle3Config, weights: Mapping, *, dtype=None, target_embed=None,
                        target_lm_head=None) -> dict:
    """Canonical name -> array (``load_eagle3_weights`` numpy arrays, or jax arrays) -> the params pytree.

    dtype: the float tensors' dtype (default: ``fc.weight``'s). target_embed /
    target_lm_head: the target's ``[vocab, hidden]`` tensors, required when the
    draft has no embedding / no head of its own (and does not tie the head).
    ``d2t`` becomes ``"draft_to_target"`` (int32 target ids).
    """
    c = config
    expected = expected_eagle3_shapes(c)
    w = dict(weights)
    extra, missing = sorted(set(w) - set(expected)), sorted(set(expected) - set(w))
    if extra or missing:
        raise ValueError(f"weights: unexpected tensors {extra[:8]}, missing tensors {missing[:8]}")
    for name, shape in expected.items():
        if tuple(w[name].shape) != shape:
            raise ValueError(f"weights: tensor {name!r} has shape {tuple(w[name].shape)}, expected {shape}")
    dtype = jnp.dtype(dtype or w["fc.weight"].dtype)
    params = {n: jnp.asarray(t, dtype) for n, t in w.items() if n != "d2t"}
    if c.has_d2t:
        params[DRAFT_TO_TARGET] = jnp.asarray(draft_to_target_ids(np.asarray(w["d2t"])))
    if not c.has_embedding:
        params["embed_tokens.weight"] = _target_tensor(c, target_embed, "target_embed", "embed_tokens.weight", dtype)
    if not c.has_lm_head and not c.tie_word_embeddings:
        params["lm_head.weight"] = _target_tensor(c, target_lm_head, "target_lm_head", "lm_head.weight", dtype)
    return params


def _target_tensor(config: Eagle3Config, tensor, arg: str, name: str, dtype):
    if tensor is None:
        raise ValueError(f"{arg}: the draft has no {name!r}; pass the target's")
    want = (config.vocab_size, config.hidden_size)
    if tuple(tensor.shape) != want:
        raise ValueError(f"{arg}: expected shape {want}, got {tuple(tensor.shape)}")
    return jnp.asarray(tensor, dtype)


def load_params(path, target: M3TextConfig, *, dtype="bfloat16", target_embed=None, target_lm_head=None,
                aux_layer_convention: str = "output") -> tuple[Eagle3Config, dict]:
    """The draft in folder ``path`` for ``target`` -> ``(config, params)`` in ``dtype``."""
    config = Eagle3Config.from_dir(path, target, aux_layer_convention=aux_layer_convention)
    weights = load_eagle3_weights(path, config, framework="numpy")
    return config, params_from_weights(config, weights, dtype=dtype, target_embed=target_embed,
                                       target_lm_head=target_lm_head)


# -- the layer ---------------------------------------------------------------------------------

def fuse(params: Mapping, hidden, *, config: Eagle3Config):
    """The layer's hidden input ``[T, hidden]``: ``fc`` of the aux states ``[T, 3 * target_hidden]``,
    or ``hidden`` itself when it is ``[T, hidden]`` already (the draft's own ``h_out``)."""
    c = config
    if hidden.ndim != 2 or hidden.shape[-1] not in (c.hidden_size, c.fc_in_features):
        raise ValueError(f"hidden: expected [T, {c.fc_in_features}] (aux states) or [T, {c.hidden_size}] "
                         f"(the draft's h_out), got {tuple(hidden.shape)}")
    return hidden if hidden.shape[-1] == c.hidden_size else linear(hidden, params["fc.weight"])


def forward(params: Mapping, pool, batch: StepBatch, maps, hidden, *, config: Eagle3Config, layout: PoolLayout,
            spec: StepSpec, k_scale=None, v_scale=None):
    """One step's tokens through the draft layer -> ``(h_out [T, hidden], pool)``.

    pool:   the draft's pool ``[layout.numel]`` (``pool_layout``; donate it under jit).
    batch:  the target step's :class:`~m3_jax.model.StepBatch` (``logits_rows`` unused).
    maps, spec: ``m3_jax.step_inputs(plan)`` of the draft planner's plan.
    hidden: ``[T, 3 * target_hidden]`` aux states or ``[T, hidden]`` (see :func:`fuse`).
    h_out is the residual stream before the final norm: the next draft step's hidden input.
    """
    c = config
    if hidden.shape[0] != batch.input_ids.shape[0]:
        raise ValueError(f"hidden: expected {batch.input_ids.shape[0]} rows (the step's tokens), "
                         f"got {hidden.shape[0]}")
    h = fuse(params, hidden, config=c)
    normed = rms_norm(h, params[LAYER + "hidden_norm.weight"], c.rms_norm_eps)
    e = rms_norm(params["embed_tokens.weight"][batch.input_ids], params[LAYER + "input_layernorm.weight"],
                 c.rms_norm_eps)
    x = jnp.concatenate([e, normed], axis=-1)
    residual = normed if c.norm_before_residual else h
    out, pool = _attention(params, x, pool, batch, maps, config=c, layout=layout, spec=spec, k_scale=k_scale,
                           v_scale=v_scale)
    r = residual + out
    return r + _mlp(params, rms_norm(r, params[LAYER + "post_attention_layernorm.weight"], c.rms_norm_eps)), pool


def _attention(params: Mapping, x, pool, batch: StepBatch, maps, *, config: Eagle3Config, layout: PoolLayout,
               spec: StepSpec, k_scale, v_scale):
    c, att = config, LAYER + "self_attn."
    T, hq, hk, d = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
    cos, sin = rope_cos_sin(batch.positions, c.inv_freq(), x.dtype)
    q = apply_rope(linear(x, params[att + "q_proj.weight"]).reshape(T, hq, d), cos, sin)
    k = apply_rope(linear(x, params[att + "k_proj.weight"]).reshape(T, hk, d), cos, sin)
    v = linear(x, params[att + "v_proj.weight"]).reshape(T, hk, d)
    views = layer_views(pool, layout, 0)
    if views.index_k_cache is not None:
        raise ValueError("layout: the draft's layer is dense (no index-K sub-page)")
    k_cache, v_cache, _ = write_cache(k, v, None, views.k_cache, views.v_cache, None, batch.slot_mapping,
                                      k_scale=k_scale, v_scale=v_scale)
    out, _ = msa_attention_step(q, None, k_cache, v_cache, None, batch.block_table, batch.seq_lens, plan=spec,
                                maps=maps, sparse=False, sm_scale=c.attention_scale, k_scale=k_scale,
                                v_scale=v_scale)
    return linear(out.reshape(T, hq * d), params[att + "o_proj.weight"]), k_cache.buffer


def _mlp(params: Mapping, h):
    mlp = LAYER + "mlp."
    gate, up = linear(h, params[mlp + "gate_proj.weight"]), linear(h, params[mlp + "up_proj.weight"])
    return linear(jax.nn.silu(gate) * up, params[mlp + "down_proj.weight"])


# -- heads -------------------------------------------------------------------------------------

def draft_logits(params: Mapping, h_out, *, config: Eagle3Config):
    """``lm_head(norm(h_out))`` of rows ``h_out [L, hidden]`` -> ``[L, draft_vocab]`` float32 (draft ids)."""
    head = params.get("lm_head.weight", params["embed_tokens.weight"])   # no lm_head: tied to the embedding
    return linear(rms_norm(h_out, params["norm.weight"], config.rms_norm_eps), head).astype(jnp.float32)


def logits(params: Mapping, h_out, *, config: Eagle3Config):
    """The draft's logits over the TARGET vocabulary ``[L, vocab]`` float32; ids outside the draft
    vocabulary get ``-inf``."""
    draft = draft_logits(params, h_out, config=config)
    if DRAFT_TO_TARGET not in params:
        return draft
    full = jnp.full((draft.shape[0], config.vocab_size), -jnp.inf, jnp.float32)
    return full.at[:, params[DRAFT_TO_TARGET]].set(draft)


def draft_tokens(params: Mapping, h_out, *, config: Eagle3Config):
    """Greedy drafts of rows ``h_out [L, hidden]``: argmax over the draft vocabulary (ties: the lowest
    draft id) as TARGET ids ``[L]`` int32."""
    return to_target_ids(params, jnp.argmax(draft_logits(params, h_out, config=config), axis=-1))


def to_target_ids(params: Mapping, draft_ids):
    """Draft vocabulary ids -> target ids (``id + d2t[id]``; the identity without ``d2t``)."""
    draft_ids = draft_ids.astype(jnp.int32)
    return draft_ids if DRAFT_TO_TARGET not in params else params[DRAFT_TO_TARGET][draft_ids]


# -- in an engine ------------------------------------------------------------------------------

class TargetStep(NamedTuple):
    """A target step as the JAX runner ran it, and its aux hidden states.

    batch: the step's :class:`~m3_jax.model.StepBatch` (numpy; padded as the step was built).
    aux:   [T, 3 * target_hidden] on the device.
    """
    batch: StepBatch
    aux: jax.Array


class Eagle3Proposer:
    """An EAGLE-3 draft inside the JAX engine: its params, its pool (the target pool's slots), its
    planner and two jitted functions (pool donated).

    config, params: the draft (:func:`load_params`), on the engine's device.
    num_slots:      the target pool's slots; dtype, kv_cache_dtype: the pool's (as the target's).
    step_config:    the config of the engine's planner (the padded steps' limits).
    buckets:        the engine's padding policy (the chain's batch sizes: its decode batch sizes).
    num_speculative_tokens: ``k``.
    device:         the engine's device (None: JAX's default).
    """

    def __init__(self, config: Eagle3Config, params: dict, *, num_slots: int, dtype: str, step_config: StepConfig,
                 buckets: StepBuckets, num_speculative_tokens: int, kv_cache_dtype: str = "auto", device=None):
        self.config, self.params, self.k, self.device = config, params, num_speculative_tokens, device
        self.step_config, self.buckets = step_config, buckets
        self.layout = pool_layout(config, num_slots, dtype, kv_cache_dtype=kv_cache_dtype)
        self.pool = allocate_pool(self.layout, device)
        self.planner = StepPlanner(draft_step_config(config, step_config))
        self._first = jax.jit(self._first_pass, static_argnames=("spec",), donate_argnames=("pool",))
        self._chain = jax.jit(self._chain_steps, static_argnames=("spec",), donate_argnames=("pool",))

    def propose(self, work: DraftPass, target: TargetStep) -> np.ndarray:
        """Run ``work`` after its target step ``target`` -> the drafts ``[n, k]`` int32 of ``work.request_ids``."""
        step, n = work.step, work.num_requests
        spec, maps = self._spec(self.planner.plan(step.seq_lens, cu_seqlens_q=step.cu_seqlens_q,
                                                  num_context=step.num_context))
        rows = np.zeros(self.buckets.max_batch, np.int32)   # one shape: the first pass compiles per step shape only
        rows[:n] = work.rows
        # host arrays as they are: jit's dispatch copies them to the draft's device (faster than device_put)
        h, self.pool = self._first(self.params, self.pool, target.batch._replace(input_ids=work.input_ids), maps,
                                   target.aux, rows, spec=spec)
        if n == 0:
            return np.zeros((0, self.k), np.int32)
        size = self.buckets.generation_rows(n)   # the chain's batch, padded as a decode step
        chain = {name: np.pad(getattr(work, name), [(0, 0), (0, size - n)], constant_values=fill)
                 for name, fill in (("positions", 0), ("slot_mapping", -1), ("seq_lens", 0))}
        chain["block_table"] = np.pad(work.block_table, [(0, size - n), (0, 0)], constant_values=-1)
        spec, _ = self._spec(self.planner.plan([1] * size, q_lens=[1] * size, num_context=0))
        drafts, self.pool = self._chain(self.params, self.pool, h, chain, spec=spec)
        return np.asarray(drafts)[:n]

    def _spec(self, plan):
        spec, maps = step_inputs(plan)
        if spec.generation_rows:   # as the runner's steps: the generation span over the whole table
            spec = dataclasses.replace(spec, generation_max_blocks=self.step_config.max_blocks)
        return spec, maps

    def _first_pass(self, params, pool, batch, maps, aux, rows, *, spec):
        """The target step's rows through the draft -> (``h_out`` of ``rows`` [max_batch, hidden], pool)."""
        h, pool = forward(params, pool, batch, maps, aux, config=self.config, layout=self.layout, spec=spec)
        return h[rows], pool

    def _chain_steps(self, params, pool, h, chain, *, spec):
        """Draft 1 from ``h`` (first rows), then ``k - 1`` one-token steps -> (drafts [rows, k], pool)."""
        h = h[:spec.generation_rows]
        drafts = [draft_tokens(params, h, config=self.config)]
        no_rows = jnp.zeros(0, jnp.int32)
        for i in range(self.k - 1):
            batch = StepBatch(drafts[-1], chain["positions"][i], chain["slot_mapping"][i], chain["block_table"],
                              chain["seq_lens"][i], no_rows)
            h, pool = forward(params, pool, batch, None, h, config=self.config, layout=self.layout, spec=spec)
            drafts.append(draft_tokens(params, h, config=self.config))
        return jnp.stack(drafts, axis=1), pool
