"""MiniMax-M3 text model: the math of one forward step over paged caches (torch).

One call of :meth:`M3Model.forward` runs every token of a step (context rows'
prompt chunks first, generation rows last, as the step planner wants) through
all layers at once. On a GPU the step runs in this project's kernels where it
spends its time (the shared Triton kernels, ``m3_torch.fused``,
``m3_torch.moe``):

* each residual add and the RMSNorm after it: one kernel (``add_rms_norm``);
* attention: the fused q/k/v (/index q/k) GEMM, then one kernel for the q/k
  norms and RoPE that also writes the K/V (and, sparse layers, index-K) rows
  into the layer's pool views (``qk_norm_rope``), then
  ``m3_torch.msa_attention_step`` with the step's plan (``sparse=True`` on MSA
  layers, ``False`` on dense ones), then ``o_proj``;
* MoE: the router (``moe_route``: logits, then the top-k) and the experts in
  the fused-MoE kernels (``fused_moe``: each touched expert's weights read
  once, SwiGLU-OAI and the routing weights fused, the shared expert as one
  more expert when it has the experts' width, M3's).

On the CPU the attention kernels run in Triton's interpreter, but the norms,
RoPE, router and experts are the same math in torch ops (``write_cache`` for
the cache rows, ``grouped_mm`` for the experts): their interpreted kernels
cost 25-110 ms a call. tests/ops/test_fused_ops.py and tests/ops/test_moe.py check the
kernels against these ops.

FP8 weights (``quantization="fp8"``, an :class:`Fp8Weight` per linear weight)
run in ``fp8_linear`` and ``fused_moe_fp8`` on both devices (on the CPU in the
interpreter: there is no torch-op twin of their roundings); :func:`linear`
dispatches on the weight.

No step synchronises with the host, so decode steps are captured in CUDA
graphs. Weights and activations stay in the weights' dtype; norms, the router
and the attention softmax compute in float32 where transformers does, and each
kernel rounds where the transformers module does (the kernels' docstrings say
where a rounding differs).

Semantics: transformers 5.23's ``MiniMaxM3VLForCausalLM`` (text model); the
math, and where and why this project differs from transformers, are written
once, in docs/ENGINE.md ("The model's semantics"). The JAX twin is
``m3_jax/model.py`` (same math; XLA fuses the norms itself there). The
module-level ``rms_norm``, ``rope_cos_sin``, ``apply_rope`` and ``swiglu_oai``
are that math in torch ops: the references the fused kernels are tested
against, and the EAGLE-3 draft head's building blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from m3_kernels import planner as step_planner
from m3_kernels.maps import PAGE_SIZE
from m3_kernels.pool import PoolLayout
from m3_engine.model_config import M3TextConfig
from m3_engine.quantization import FP8_BLOCK, scale_name

from . import fused
from .api import msa_attention_step
from .cache import LayerCaches, allocate_pool, layer_caches, write_cache
from .fp8 import fp8_linear, fused_moe_fp8
from .moe import fused_moe
from .ops import compiled

__all__ = ["M3Model", "StepTensors", "Fp8Weight", "linear", "rms_norm", "apply_rope", "rope_cos_sin", "swiglu_oai",
           "take_weight", "take_linear", "local_experts"]


# -- building blocks (the math of transformers' modules, on [T, ...] token rows) -------------

class Fp8Weight(NamedTuple):
    """A block-scaled FP8 linear weight (``m3_engine.quantization``): ``W ~= weight * scale`` per 128 x 128
    block. weight: ``[..., N, K]`` float8_e4m3fn; scale: ``[..., ceil(N / 128), ceil(K / 128)]`` float32."""
    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """``x @ W.T`` in x's dtype, ``w`` a weight tensor (``F.linear``) or an :class:`Fp8Weight` (``fp8_linear``:
    x quantized per token and 128 channels, FP8 GEMM; its CPU path is the kernel in the interpreter)."""
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w.weight, w.scale)
    return F.linear(x, w)


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


def local_experts(chosen: torch.Tensor, top_w: torch.Tensor, start: int, count: int):
    """The router's choice for a rank holding experts ``[start, start + count)`` -> (ids [T, k] int32 in
    ``[0, count)``, weights [T, k] float32). A pair routed to another rank's expert gets local expert 0 and
    weight 0: it adds an exact zero to its token's sum (``fused_moe`` has no id it skips, and dropping the
    pair would change the ``[T, k]`` shape it takes), so each rank computes every pair, at most one expert
    (its expert 0) more than the ones its tokens chose."""
    local = chosen - start
    mine = (local >= 0) & (local < count)
    return torch.where(mine, local, 0).to(torch.int32), torch.where(mine, top_w, 0.0)


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
    # the linear weights (qkv, o_proj, the MLPs' and experts'): a tensor, or an Fp8Weight (quantized)
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


def take_weight(weights: dict, name: str) -> torch.Tensor:
    """``weights[name]``, popped: the tensors left in ``weights`` at the end are the unexpected ones."""
    try:
        return weights.pop(name)
    except KeyError:
        raise ValueError(f"weights: missing tensor {name!r}") from None


def take_linear(weights: dict, name: str):
    """A linear weight, popped: an :class:`Fp8Weight` when ``weights`` holds its scale
    (``<name>_scale_inv``; made contiguous, as the FP8 kernels read them), else the tensor."""
    weight = take_weight(weights, name)
    scale = weights.pop(scale_name(name), None)
    return weight if scale is None else Fp8Weight(weight.contiguous(), scale.contiguous())


def _concat_rows(parts: list):
    """Linear weights stacked along their output rows (one GEMM for all): FP8 ones by whole 128-row blocks."""
    if not any(isinstance(p, Fp8Weight) for p in parts):
        return torch.cat(parts)
    if not all(isinstance(p, Fp8Weight) and p.shape[0] % FP8_BLOCK == 0 for p in parts):
        raise ValueError(f"weights: the fused q/k/v projections need every part FP8 with whole 128-row blocks, "
                         f"got shapes {[tuple(p.shape) for p in parts]} "
                         f"(FP8: {[isinstance(p, Fp8Weight) for p in parts]})")
    return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]))


class M3Model:
    """MiniMax-M3 text model over a weights dict (transformers' ``MiniMaxM3VLForCausalLM``
    state-dict names, ``model.layers.{i}.self_attn.q_proj.weight`` ...).

    config:     an ``m3_engine.model_config.M3TextConfig``: the shapes of ``weights``.
    weights:    name -> tensor, all on one device in one float dtype (the engine
                loads and casts them); every expected tensor must be there and
                no other. A layer's q/k/v (and index q/k) projections are fused
                into one matrix (one GEMM per layer). FP8 weights
                (``m3_engine.quantization``): a quantized linear weight's e4m3
                codes with its float32 block scales as ``<name>_scale_inv``; it
                runs in ``fp8_linear`` / ``fused_moe_fp8`` (:class:`Fp8Weight`).
    all_reduce: None, or ``all_reduce(t) -> t``, the sum of ``t`` over the ranks
                of a tensor-parallel group. The model itself knows nothing of
                tensor parallelism: given one rank's slices of the weights
                (``m3_engine.tp``: its heads, its rows of each MLP) and the
                config of those slices (``TPPlan.local_config``), the outputs
                of ``o_proj`` and of each MLP are partial sums, and this hook
                completes them (``m3_torch.tp``), which keeps the residual
                stream the same on every rank.
    all_gather: None, or ``all_gather(t [L, n]) -> [L, ranks * n]``, the ranks'
                ``t`` side by side in rank order: the model is vocab-parallel.
                Its embedding and ``lm_head`` then hold the vocabulary rows
                ``[vocab_start, vocab_start + n)`` (rows past ``vocab_size``:
                padding); a lookup of an id outside them gives zeros, completed
                by ``all_reduce``, and the local logits by ``all_gather`` (then
                cut to ``vocab_size``).
    expert_start: the global id of the first routed expert in ``weights``
                (expert parallelism: a rank holds ``[expert_start, expert_start
                + n)``, ``n`` from the weights' shape); the router still scores
                all ``num_local_experts`` and the pairs routed to other ranks'
                experts weigh 0 here (:func:`local_experts`).
    """

    def __init__(self, config: M3TextConfig, weights: dict, *, all_reduce: Optional[Callable] = None,
                 all_gather: Optional[Callable] = None, vocab_start: int = 0, expert_start: int = 0):
        self.config = c = config
        self.all_reduce, self.all_gather = all_reduce, all_gather
        self.vocab_start, self.expert_start = vocab_start, expert_start
        weights = dict(weights)
        self.embed = take_weight(weights, "model.embed_tokens.weight")
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.norm = take_weight(weights, "model.norm.weight")
        self.lm_head = self.embed if c.tie_word_embeddings else take_weight(weights, "lm_head.weight")
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
        proj = [take_linear(w, att + f"{n}_proj.weight") for n in ("q", "k", "v")]
        extra = {}
        if sparse:
            proj += [take_linear(w, att + "indexer.q_proj.weight"), take_linear(w, att + "indexer.k_proj.weight")]
            extra = dict(index_q_norm=take_weight(w, att + "indexer.q_norm.weight"),
                         index_k_norm=take_weight(w, att + "indexer.k_norm.weight"))
        mlp = p + "mlp."
        if moe:
            extra.update(router=take_weight(w, mlp + "gate.weight"),
                         router_bias=take_weight(w, mlp + "gate.e_score_correction_bias"),
                         experts_gate_up=take_linear(w, mlp + "experts.gate_up_proj"),
                         experts_down=take_linear(w, mlp + "experts.down_proj"),
                         shared_gate_up=take_linear(w, mlp + "shared_experts.gate_up_proj.weight"),
                         shared_down=take_linear(w, mlp + "shared_experts.down_proj.weight"))
        else:
            extra.update(mlp_gate_up=take_linear(w, mlp + "gate_up_proj.weight"),
                         mlp_down=take_linear(w, mlp + "down_proj.weight"))
        return _Layer(sparse=sparse, moe=moe, input_norm=take_weight(w, p + "input_layernorm.weight"),
                      post_attn_norm=take_weight(w, p + "post_attention_layernorm.weight"), qkv=_concat_rows(proj),
                      q_norm=take_weight(w, att + "q_norm.weight"), k_norm=take_weight(w, att + "k_norm.weight"),
                      o_proj=take_linear(w, att + "o_proj.weight"), **extra)

    # -- forward ---------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, step: StepTensors, plan: step_planner.StepPlan, caches: Sequence[LayerCaches],
                aux_layers: Sequence[int] = ()):
        """All tokens of one step through the model -> logits ``[L, vocab]`` (model dtype) of
        ``step.logits_rows``. Writes the step's K/V/index-K rows into ``caches`` (one
        :class:`~m3_torch.cache.LayerCaches` per layer, views of the pool). With ``aux_layers``
        (an EAGLE-3 draft's): ``(logits, aux)``, ``aux`` as :meth:`hidden_states` gives it."""
        if not aux_layers:
            return self.logits(self.hidden_states(step, plan, caches), step.logits_rows)
        x, aux = self.hidden_states(step, plan, caches, aux_layers)
        return self.logits(x, step.logits_rows), aux

    @torch.no_grad()
    def hidden_states(self, step: StepTensors, plan: step_planner.StepPlan, caches: Sequence[LayerCaches],
                      aux_layers: Sequence[int] = ()):
        """The step through every layer (cache writes included) -> the residual stream ``[T, hidden]``.
        With ``aux_layers``: ``(x, aux)``, ``aux [T, len(aux_layers) * hidden]`` the residual stream
        after each of those layers (their outputs), concatenated in their order: EAGLE-3's aux states."""
        x = self._embed(step.input_ids)
        mlp_out, outputs = None, {}     # each layer's MLP output is added by the next layer's norm kernel
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            if mlp_out is None:
                h = self._norm(x, layer.input_norm)
            else:
                x, h = self._add_norm(mlp_out, x, layer.input_norm)
            attn_out = self._reduce(self._attention(layer, h, step, plan, cache))
            x, h = self._add_norm(attn_out, x, layer.post_attn_norm)
            mlp_out = self._reduce(self._mlp(layer, h))
            if i in aux_layers:
                outputs[i] = x + mlp_out
        x = x + mlp_out
        if not aux_layers:
            return x
        return x, torch.cat([outputs[i] for i in aux_layers], dim=-1)

    @torch.no_grad()
    def logits(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Final norm + ``lm_head`` of the rows ``rows`` of ``x [T, hidden]`` -> ``[len(rows), vocab]``."""
        logits = F.linear(self._norm(x.index_select(0, rows), self.norm), self.lm_head)
        if self.all_gather is None:
            return logits
        logits = self.all_gather(logits)
        vocab = self.config.vocab_size
        return logits if logits.shape[1] == vocab else logits[:, :vocab].contiguous()

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``ids``; vocab-parallel: the local rows (zeros for ids another rank
        holds), summed over the ranks."""
        if self.all_gather is None:
            return F.embedding(ids, self.embed)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.embed.shape[0])
        x = F.embedding(torch.where(inside, local, 0), self.embed)
        return self.all_reduce(x.masked_fill_(~inside[:, None], 0))

    def _norm(self, x, weight):
        """RMSNorm: one kernel on a GPU, torch ops on the CPU (see the module docstring)."""
        eps = self.config.rms_norm_eps
        return fused.rms_norm(x, weight, eps) if compiled(x.device) else rms_norm(x, weight, eps)

    def _add_norm(self, x, residual, weight):
        """-> (residual + x, its RMSNorm): one kernel on a GPU, torch ops on the CPU."""
        eps = self.config.rms_norm_eps
        if compiled(x.device):
            return fused.add_rms_norm(x, residual, weight, eps)
        residual = residual + x
        return residual, rms_norm(residual, weight, eps)

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
        return linear(swiglu_oai(linear(h, layer.mlp_gate_up), c.swiglu_alpha, c.swiglu_limit), layer.mlp_down)

    @torch.no_grad()
    def projections(self, i: int, h: torch.Tensor, positions: torch.Tensor):
        """Layer ``i``'s attention inputs for normalised rows ``h [T, hidden]`` at ``positions [T]``
        -> ``(q [T, Hq, D], k [T, Hk, D], v [T, Hk, D], idx_q [T, Hi, Di], idx_k [T, Di])``,
        normed and rotated (``idx_q``/``idx_k`` are None on a dense layer): the step's own path
        (:meth:`_project`) into scratch caches, k/v/idx_k read back from them."""
        c, layer, T = self.config, self.layers[i], h.shape[0]
        layout = PoolLayout.create(max(1, -(-T // PAGE_SIZE)), sparse=[layer.sparse],
                                   num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                                   index_head_dim=c.index_head_dim, dtype=str(self.dtype).removeprefix("torch."))
        cache = layer_caches(allocate_pool(layout, h.device), layout, 0)
        slots = torch.arange(T, device=h.device)
        q, idx_q = self._project(layer, h, positions, slots, cache)
        page, row = slots // PAGE_SIZE, slots % PAGE_SIZE
        k, v = cache.k_cache[page, :, row], cache.v_cache[page, :, row]
        return q, k, v, idx_q, cache.index_k_cache[page, row] if layer.sparse else None

    def _project(self, layer: _Layer, h, positions, slot_mapping, cache: LayerCaches):
        """The layer's fused q/k/v (/index q/k) GEMM, then one kernel (``m3_torch.qk_norm_rope``): q/k
        norms and RoPE, the K/V/index-K rows written to ``cache`` -> (q, idx_q or None)."""
        c = self.config
        qkv = linear(h, layer.qkv)
        if compiled(h.device):
            return fused.qk_norm_rope(qkv, positions, self.inv_freq, layer.q_norm, layer.k_norm, cache.k_cache,
                                      cache.v_cache, slot_mapping, num_q_heads=c.num_attention_heads,
                                      eps=c.rms_norm_eps, index_q_norm=layer.index_q_norm,
                                      index_k_norm=layer.index_k_norm, index_k_cache=cache.index_k_cache)
        # the CPU: the same math in torch ops, then write_cache
        T, hq, hk, d, eps = h.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.dtype)
        sizes = [hq * d, hk * d, hk * d] + ([c.index_n_heads * c.index_head_dim, c.index_head_dim]
                                           if layer.sparse else [])
        parts = qkv.split(sizes, dim=-1)
        q = apply_rope(rms_norm(parts[0].view(T, hq, d), layer.q_norm, eps), cos, sin)
        k = apply_rope(rms_norm(parts[1].view(T, hk, d), layer.k_norm, eps), cos, sin)
        v = parts[2].reshape(T, hk, d)
        idx_q = idx_k = None
        if layer.sparse:
            di, rot = c.index_head_dim, c.index_rotary_dim
            icos, isin = cos[:, :rot], sin[:, :rot]
            idx_q = apply_rope(rms_norm(parts[3].view(T, c.index_n_heads, di), layer.index_q_norm, eps), icos, isin)
            idx_k = apply_rope(rms_norm(parts[4].view(T, 1, di), layer.index_k_norm, eps), icos, isin).view(T, di)
        write_cache(k, v, idx_k, cache.k_cache, cache.v_cache, cache.index_k_cache, slot_mapping)
        return q, idx_q

    def _attention(self, layer: _Layer, h, step: StepTensors, plan, cache: LayerCaches):
        c = self.config
        q, idx_q = self._project(layer, h, step.positions, step.slot_mapping, cache)
        out, _ = msa_attention_step(q, idx_q, cache.k_cache, cache.v_cache, cache.index_k_cache, step.block_table,
                                    step.seq_lens, plan=plan, sparse=layer.sparse, init_blocks=c.index_init_blocks,
                                    local_blocks=c.index_local_blocks, sm_scale=c.attention_scale)
        return linear(out.view(h.shape[0], -1), layer.o_proj)

    def _moe(self, layer: _Layer, h):
        c = self.config
        chosen, top_w = self._route(layer, h)
        num_experts = layer.experts_gate_up.shape[0]
        if num_experts != c.num_local_experts:   # expert parallel: this rank's experts only
            chosen, top_w = local_experts(chosen, top_w, self.expert_start, num_experts)
        fp8 = isinstance(layer.experts_gate_up, Fp8Weight)   # FP8 experts: the kernels, also on the CPU
        if not compiled(h.device) and not fp8:
            return self._experts(layer, h, chosen, top_w) * c.routed_scaling_factor + self._shared_expert(layer, h)
        # the shared expert runs inside fused_moe as one more expert when it has the experts' width (M3's)
        fuse_shared = layer.shared_down.shape[1] == layer.experts_down.shape[2]
        options = dict(swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit,
                       routed_scaling_factor=c.routed_scaling_factor)
        if fp8:
            shared = dict(shared_gate_up=layer.shared_gate_up.weight, shared_gate_up_scale=layer.shared_gate_up.scale,
                          shared_down=layer.shared_down.weight, shared_down_scale=layer.shared_down.scale)
            out = fused_moe_fp8(h, *layer.experts_gate_up, *layer.experts_down, chosen.to(torch.int32), top_w,
                                **options, **(shared if fuse_shared else {}))
        else:
            shared = dict(shared_gate_up=layer.shared_gate_up, shared_down=layer.shared_down)
            out = fused_moe(h, layer.experts_gate_up, layer.experts_down, chosen, top_w, **options,
                            **(shared if fuse_shared else {}))
        return out if fuse_shared else out + self._shared_expert(layer, h)

    def _shared_expert(self, layer: _Layer, h):
        c = self.config
        return linear(swiglu_oai(linear(h, layer.shared_gate_up), c.swiglu_alpha, c.swiglu_limit),
                      layer.shared_down)

    def _route(self, layer: _Layer, h):
        """The router (``m3_torch.moe_route``): -> (chosen [T, k] int32 expert ids, top_w [T, k]
        float32 weights summing to 1)."""
        k = self.config.num_experts_per_tok
        if compiled(h.device):
            return fused.moe_route(h, layer.router, layer.router_bias, k)
        weights = torch.sigmoid(F.linear(h, layer.router).float())                    # [T, E]
        _, chosen = torch.topk(weights + layer.router_bias, k, dim=-1, sorted=False)
        top_w = weights.gather(1, chosen)
        return chosen, top_w / top_w.sum(dim=-1, keepdim=True)

    def _experts(self, layer: _Layer, h, chosen, top_w):
        """sum_k top_w[t, k] * expert_{chosen[t, k]}(h[t]) -> [T, hidden] in h's dtype: the CPU path, torch's
        grouped GEMM over the rows sorted by expert (``fused_moe`` computes the same on the GPU)."""
        c = self.config
        T, k = chosen.shape
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)                                     # rows grouped by expert
        counts = torch.bincount(flat, minlength=layer.experts_gate_up.shape[0])
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = h.index_select(0, order // k)                                          # [T*k, hidden]
        act = swiglu_oai(F.grouped_mm(rows, layer.experts_gate_up.transpose(1, 2), offs=offsets),
                         c.swiglu_alpha, c.swiglu_limit)
        out = F.grouped_mm(act, layer.experts_down.transpose(1, 2), offs=offsets)   # [T*k, hidden]
        weighted = torch.empty((T * k, out.shape[1]), dtype=torch.float32, device=h.device)
        weighted[order] = out.float() * top_w.reshape(-1)[order, None]
        return weighted.view(T, k, -1).sum(1).to(h.dtype)
