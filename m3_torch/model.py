"""MiniMax-M3 text model: the math of one forward step over paged caches (torch).

One call of :meth:`M3Model.forward` runs every token of a step (context rows'
prompt chunks first, generation rows last, as the step planner wants) through
all layers at once; attention goes through this project's kernels: per layer
``m3_torch.write_cache`` appends the step's K/V (and, sparse layers, index-K)
rows to the layer's pool views, then ``m3_torch.msa_attention_step`` attends
with the step's plan (``sparse=True`` on MSA layers, ``False`` on dense ones).
Weights and activations stay in the weights' dtype; norms, the router and the
attention softmax compute in float32 where transformers does.

Semantics: transformers 5.23's ``MiniMaxM3VLForCausalLM`` (text model); the
math, and where and why this project differs from transformers, are written
once, in docs/ENGINE.md ("The model's semantics"). The JAX twin is
``m3_jax/model.py`` (same math, same order of roundings).

MoE experts run as ``torch.nn.functional.grouped_mm`` over token rows sorted
by expert (no host sync, so decode steps can be captured in CUDA graphs; the
weighted sum over the k experts of a token accumulates in float32). CUDA's
grouped GEMM takes bfloat16 only: other dtypes on a GPU run every expert over
every token and weight the unchosen ones by 0 (same math, more flops).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from m3_kernels import planner as step_planner
from m3_engine.model_config import M3TextConfig

from .api import msa_attention_step
from .cache import LayerCaches, write_cache

__all__ = ["M3Model", "StepTensors", "rms_norm", "apply_rope", "rope_cos_sin", "swiglu_oai"]


# -- building blocks (the math of transformers' modules, on [T, ...] token rows) -------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma-style RMSNorm over the last axis: float32 math, scale ``1 + weight``, input dtype out."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """positions [T] -> (cos, sin) [T, rotary_dim] in ``dtype`` (float32 math, then cast)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, R]: rotate the first R channels (rotate_half form), pass the rest."""
    r = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, x_pass), dim=-1)


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[..., 2I] (gate half, then up half) -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


# -- step inputs -----------------------------------------------------------------------------

@dataclasses.dataclass
class StepTensors:
    """One step's metadata on the model's device (the scheduler's numpy arrays, moved).

    input_ids:    [T] int32/int64 token ids (padding tokens: any valid id).
    positions:    [T] int32/int64 position of each token in its request.
    slot_mapping: [T] int32 ``slot * 128 + row`` of each token's cache row; -1 skips (padding).
    block_table:  [R, max_blocks] int32 slot ids per request (padding rows: anything).
    seq_lens:     [R] int32 KV length per row, this step's tokens included (0: padding row).
    logits_rows:  [L] int32/int64 token rows whose next-token logits the step returns.
    """
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    logits_rows: torch.Tensor


# -- weights -----------------------------------------------------------------------------------

@dataclasses.dataclass
class _Layer:
    sparse: bool
    moe: bool
    input_norm: torch.Tensor        # [hidden]
    post_attn_norm: torch.Tensor    # [hidden]
    qkv: torch.Tensor               # [Hq*D + 2*Hk*D (+ Hi*Di + Di), hidden]: q, k, v (, index q, index k)
    q_norm: torch.Tensor            # [D]
    k_norm: torch.Tensor            # [D]
    o_proj: torch.Tensor            # [hidden, Hq*D]
    index_q_norm: Optional[torch.Tensor] = None   # [Di]
    index_k_norm: Optional[torch.Tensor] = None   # [Di]
    mlp_gate_up: Optional[torch.Tensor] = None    # dense: [2*I, hidden]
    mlp_down: Optional[torch.Tensor] = None       # dense: [hidden, I]
    router: Optional[torch.Tensor] = None         # [E, hidden]
    router_bias: Optional[torch.Tensor] = None    # [E] e_score_correction_bias
    experts_gate_up: Optional[torch.Tensor] = None  # [E, 2*I, hidden]
    experts_down: Optional[torch.Tensor] = None     # [E, hidden, I]
    shared_gate_up: Optional[torch.Tensor] = None   # [2*I_shared, hidden]
    shared_down: Optional[torch.Tensor] = None      # [hidden, I_shared]


def _take(weights: dict, name: str) -> torch.Tensor:
    try:
        return weights.pop(name)
    except KeyError:
        raise ValueError(f"weights: missing tensor {name!r}") from None


class M3Model:
    """MiniMax-M3 text model over a weights dict (transformers' ``MiniMaxM3VLForCausalLM``
    state-dict names, ``model.layers.{i}.self_attn.q_proj.weight`` ...).

    config:     an ``m3_engine.model_config.M3TextConfig``: the shapes of ``weights``.
    weights:    name -> tensor, all on one device in one float dtype (the engine
                loads and casts them); every expected tensor must be there and
                no other. A layer's q/k/v (and index q/k) projections are fused
                into one matrix (one GEMM per layer).
    all_reduce: None, or ``all_reduce(t) -> t``, the sum of ``t`` over the ranks
                of a tensor-parallel group. The model itself knows nothing of
                tensor parallelism: given one rank's slices of the weights
                (``m3_engine.tp``: its heads, its rows of each MLP) and the
                config of those slices (``TPPlan.local_config``), the outputs
                of ``o_proj`` and of each MLP are partial sums, and this hook
                completes them (``m3_torch.tp``), which keeps the residual
                stream the same on every rank.
    lm_head:    False: no ``lm_head.weight`` (nor a tied one): the model computes
                hidden states only (:meth:`hidden_states`), as a tensor-parallel
                worker that never samples does.
    """

    def __init__(self, config: M3TextConfig, weights: dict, *, all_reduce: Optional[Callable] = None,
                 lm_head: bool = True):
        self.config = c = config
        self.all_reduce = all_reduce
        weights = dict(weights)
        self.embed = _take(weights, "model.embed_tokens.weight")
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.norm = _take(weights, "model.norm.weight")
        self.lm_head = None
        if lm_head:
            self.lm_head = self.embed if c.tie_word_embeddings else _take(weights, "lm_head.weight")
        weights.pop("lm_head.weight", None)
        self.layers = [self._layer(weights, i) for i in range(c.num_hidden_layers)]
        if weights:
            raise ValueError(f"weights: unexpected tensors {sorted(weights)[:8]}")
        rot = c.rotary_dim
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float32,
                                                             device=self.device) / rot))

    def _layer(self, w: dict, i: int) -> _Layer:
        c, p = self.config, f"model.layers.{i}."
        sparse, moe = c.sparse_layers[i], c.moe_layers[i]
        att = p + "self_attn."
        proj = [_take(w, att + f"{n}_proj.weight") for n in ("q", "k", "v")]
        extra = {}
        if sparse:
            proj += [_take(w, att + "indexer.q_proj.weight"), _take(w, att + "indexer.k_proj.weight")]
            extra = dict(index_q_norm=_take(w, att + "indexer.q_norm.weight"),
                         index_k_norm=_take(w, att + "indexer.k_norm.weight"))
        mlp = p + "mlp."
        if moe:
            extra.update(router=_take(w, mlp + "gate.weight"),
                         router_bias=_take(w, mlp + "gate.e_score_correction_bias"),
                         experts_gate_up=_take(w, mlp + "experts.gate_up_proj"),
                         experts_down=_take(w, mlp + "experts.down_proj"),
                         shared_gate_up=_take(w, mlp + "shared_experts.gate_up_proj.weight"),
                         shared_down=_take(w, mlp + "shared_experts.down_proj.weight"))
        else:
            extra.update(mlp_gate_up=_take(w, mlp + "gate_up_proj.weight"), mlp_down=_take(w, mlp + "down_proj.weight"))
        return _Layer(sparse=sparse, moe=moe, input_norm=_take(w, p + "input_layernorm.weight"),
                      post_attn_norm=_take(w, p + "post_attention_layernorm.weight"), qkv=torch.cat(proj),
                      q_norm=_take(w, att + "q_norm.weight"), k_norm=_take(w, att + "k_norm.weight"),
                      o_proj=_take(w, att + "o_proj.weight"), **extra)

    # -- forward ---------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, step: StepTensors, plan: step_planner.StepPlan, caches: Sequence[LayerCaches]) -> torch.Tensor:
        """All tokens of one step through the model -> logits ``[L, vocab]`` (model dtype) of
        ``step.logits_rows``. Writes the step's K/V/index-K rows into ``caches`` (one
        :class:`~m3_torch.cache.LayerCaches` per layer, views of the pool)."""
        return self.logits(self.hidden_states(step, plan, caches), step.logits_rows)

    @torch.no_grad()
    def hidden_states(self, step: StepTensors, plan: step_planner.StepPlan,
                      caches: Sequence[LayerCaches]) -> torch.Tensor:
        """The step through every layer (cache writes included) -> the residual stream ``[T, hidden]``."""
        c = self.config
        x = F.embedding(step.input_ids, self.embed)
        cos, sin = rope_cos_sin(step.positions, self.inv_freq, self.dtype)
        for layer, cache in zip(self.layers, caches):
            h = rms_norm(x, layer.input_norm, c.rms_norm_eps)
            x = x + self._reduce(self._attention(layer, h, cos, sin, step, plan, cache))
            h = rms_norm(x, layer.post_attn_norm, c.rms_norm_eps)
            x = x + self._reduce(self._mlp(layer, h))
        return x

    @torch.no_grad()
    def logits(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Final norm + ``lm_head`` of the rows ``rows`` of ``x [T, hidden]`` -> ``[len(rows), vocab]``."""
        if self.lm_head is None:
            raise RuntimeError("logits: this model was built with lm_head=False (hidden states only)")
        x = rms_norm(x.index_select(0, rows), self.norm, self.config.rms_norm_eps)
        return F.linear(x, self.lm_head)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.all_reduce is None else self.all_reduce(partial)

    @torch.no_grad()
    def mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s MLP (dense SwiGLU-OAI or MoE) on normalised rows ``h [T, hidden]``."""
        return self._mlp(self.layers[i], h)

    def _mlp(self, layer: _Layer, h):
        c = self.config
        if layer.moe:
            return self._moe(layer, h)
        return F.linear(swiglu_oai(F.linear(h, layer.mlp_gate_up), c.swiglu_alpha, c.swiglu_limit), layer.mlp_down)

    @torch.no_grad()
    def projections(self, i: int, h: torch.Tensor, positions: torch.Tensor):
        """Layer ``i``'s attention inputs for normalised rows ``h [T, hidden]`` at ``positions [T]``
        -> ``(q [T, Hq, D], k [T, Hk, D], v [T, Hk, D], idx_q [T, Hi, Di], idx_k [T, Di])``,
        normed and rotated (``idx_q``/``idx_k`` are None on a dense layer)."""
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.dtype)
        return self._project(self.layers[i], h, cos, sin)

    def _project(self, layer: _Layer, h, cos, sin):
        c = self.config
        T, hq, hk, d = h.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        sizes = [hq * d, hk * d, hk * d] + ([c.index_n_heads * c.index_head_dim, c.index_head_dim]
                                           if layer.sparse else [])
        parts = F.linear(h, layer.qkv).split(sizes, dim=-1)
        q = apply_rope(rms_norm(parts[0].view(T, hq, d), layer.q_norm, c.rms_norm_eps), cos, sin)
        k = apply_rope(rms_norm(parts[1].view(T, hk, d), layer.k_norm, c.rms_norm_eps), cos, sin)
        v = parts[2].reshape(T, hk, d)
        if not layer.sparse:
            return q, k, v, None, None
        di, rot = c.index_head_dim, c.index_rotary_dim
        icos, isin = cos[:, :rot], sin[:, :rot]
        idx_q = apply_rope(rms_norm(parts[3].view(T, c.index_n_heads, di), layer.index_q_norm, c.rms_norm_eps),
                           icos, isin)
        idx_k = apply_rope(rms_norm(parts[4].view(T, 1, di), layer.index_k_norm, c.rms_norm_eps), icos, isin)
        return q, k, v, idx_q, idx_k.view(T, di)

    def _attention(self, layer: _Layer, h, cos, sin, step: StepTensors, plan, cache: LayerCaches):
        c = self.config
        q, k, v, idx_q, idx_k = self._project(layer, h, cos, sin)
        write_cache(k, v, idx_k, cache.k_cache, cache.v_cache, cache.index_k_cache, step.slot_mapping)
        out, _ = msa_attention_step(q, idx_q, cache.k_cache, cache.v_cache, cache.index_k_cache, step.block_table,
                                    step.seq_lens, plan=plan, sparse=layer.sparse, init_blocks=c.index_init_blocks,
                                    local_blocks=c.index_local_blocks, sm_scale=c.attention_scale)
        return F.linear(out.view(h.shape[0], -1), layer.o_proj)

    def _moe(self, layer: _Layer, h):
        c = self.config
        shared = F.linear(swiglu_oai(F.linear(h, layer.shared_gate_up), c.swiglu_alpha, c.swiglu_limit),
                          layer.shared_down)
        weights = torch.sigmoid(F.linear(h, layer.router).float())                    # [T, E]
        _, chosen = torch.topk(weights + layer.router_bias, c.num_experts_per_tok, dim=-1, sorted=False)
        top_w = weights.gather(1, chosen)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)                               # [T, k] float32
        routed = self._experts(layer, h, chosen, top_w)
        return routed * c.routed_scaling_factor + shared

    def _experts(self, layer: _Layer, h, chosen, top_w):
        """sum_k top_w[t, k] * expert_{chosen[t, k]}(h[t]) -> [T, hidden] in h's dtype."""
        c = self.config
        num_experts = layer.experts_gate_up.shape[0]
        if h.device.type == "cuda" and h.dtype != torch.bfloat16:
            return self._experts_dense(layer, h, chosen, top_w)
        T, k = chosen.shape
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)                                     # rows grouped by expert
        counts = torch.bincount(flat, minlength=num_experts) if h.device.type == "cpu" else \
            torch.histc(flat.int(), bins=num_experts, min=0, max=num_experts - 1)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = h.index_select(0, order // k)                                          # [T*k, hidden]
        act = swiglu_oai(F.grouped_mm(rows, layer.experts_gate_up.transpose(1, 2), offs=offsets),
                         c.swiglu_alpha, c.swiglu_limit)
        out = F.grouped_mm(act, layer.experts_down.transpose(1, 2), offs=offsets)   # [T*k, hidden]
        weighted = torch.empty((T * k, out.shape[1]), dtype=torch.float32, device=h.device)
        weighted[order] = out.float() * top_w.reshape(-1)[order, None]
        return weighted.view(T, k, -1).sum(1).to(h.dtype)

    def _experts_dense(self, layer: _Layer, h, chosen, top_w):
        c = self.config
        gate = torch.zeros((h.shape[0], layer.experts_gate_up.shape[0]), dtype=torch.float32, device=h.device)
        gate.scatter_(1, chosen, top_w)                                               # [T, E]
        act = swiglu_oai(torch.einsum("th,eih->eti", h, layer.experts_gate_up), c.swiglu_alpha, c.swiglu_limit)
        out = torch.einsum("eti,ehi->eth", act, layer.experts_down)                  # [E, T, hidden]
        return torch.einsum("eth,te->th", out.float(), gate).to(h.dtype)
