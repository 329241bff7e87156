"""EAGLE-3 draft head (torch): one Llama decoder layer over the target's hidden states, on paged caches.

:class:`Eagle3Draft` mirrors :class:`~m3_torch.model.M3Model` for the draft
(``m3_engine.eagle3`` has the format and the math, docs/ENGINE.md the
conventions): :meth:`~Eagle3Draft.forward` runs a step's tokens through the
layer with this project's kernels, ``m3_torch.write_cache`` (no index-K, as a
dense layer) into the draft's own cache and ``m3_torch.msa_attention_step(...,
sparse=False)`` with a plan from a planner of the draft's heads
(``StepPlanner(m3_engine.eagle3.draft_step_config(config, target_step_config))``);
the step's metadata (slot mapping, block table, lengths) is the target's, since
the draft's pool has the target pool's slots (:func:`allocate_draft_cache`).

What a step feeds in (vLLM's EAGLE-3 proposer, which the engine follows): the
row at position ``p`` takes the token at ``p + 1`` and the target's aux hidden
states at ``p`` (the first draft step after a target step: the step's tokens
shifted by one, the sampled token last), and writes the draft's K/V at ``p``;
later draft steps take the drafted token and the draft's own ``h_out`` of the
previous position. Norms compute in float32 and round as transformers' Llama
does (``weight * normed.to(dtype)``); everything else stays in the weights' dtype.

:class:`Eagle3Proposer` is the draft inside an engine (``m3_torch.runner``):
after each target step it runs the scheduler's
:class:`~m3_engine.scheduler.DraftPass` eagerly (first pass, then the chain).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F

from m3_engine.eagle3 import (LAYER, Eagle3Config, draft_pool_layout, draft_step_config, draft_to_target_ids,
                              expected_eagle3_shapes, load_eagle3_weights)
from m3_engine.model_config import M3TextConfig
from m3_engine.scheduler import DraftPass
from m3_kernels.planner import StepConfig, StepPlan, StepPlanner
from m3_kernels.pool import PoolLayout

from .api import msa_attention_step
from .cache import TORCH_DTYPES, LayerCaches, allocate_pool, layer_caches, write_cache
from .model import StepTensors, apply_rope, rope_cos_sin, take_weight
from .staging import upload

__all__ = ["Eagle3Draft", "Eagle3Proposer", "DraftCache", "allocate_draft_cache", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm over the last axis: float32 statistics, then ``weight * normed.to(x.dtype)``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class DraftCache(NamedTuple):
    pool: torch.Tensor      # 1-D [layout.numel], the draft's own pool
    layout: PoolLayout      # one dense layer, the target pool's num_slots
    caches: LayerCaches     # its K/V views (index_k_cache None)


def allocate_draft_cache(config: Eagle3Config, num_slots: int, dtype: str, device="cpu", *,
                         kv_cache_dtype: str = "auto") -> DraftCache:
    """A zero-filled draft pool of ``num_slots`` slots (the target pool's: same slot ids, same block tables)."""
    layout = draft_pool_layout(config, num_slots, dtype, kv_cache_dtype=kv_cache_dtype)
    pool = allocate_pool(layout, device)
    return DraftCache(pool, layout, layer_caches(pool, layout, 0))


class Eagle3Draft:
    """An EAGLE-3 draft head over a weights dict (``m3_engine.eagle3`` canonical names).

    config:         the draft's :class:`~m3_engine.eagle3.Eagle3Config`.
    weights:        name -> tensor, the float ones all on one device in one dtype
                    (``d2t`` any integer dtype); every expected tensor and no other.
    target_embed:   the target's ``[vocab, hidden]`` embedding, required when the
                    draft has none (``config.has_embedding`` False).
    target_lm_head: the target's ``[vocab, hidden]`` head, required when the draft
                    has no ``lm_head`` and does not tie it to the embedding.
    """

    def __init__(self, config: Eagle3Config, weights: dict, *, target_embed: Optional[torch.Tensor] = None,
                 target_lm_head: Optional[torch.Tensor] = None):
        self.config = c = config
        w = dict(weights)
        self._check(w)
        self.fc = take_weight(w, "fc.weight")
        self.dtype, self.device = self.fc.dtype, self.fc.device
        self.embed = self._shared(w, "embed_tokens.weight", target_embed, "target_embed")
        self.input_norm, self.hidden_norm, self.post_attn_norm = (
            take_weight(w, LAYER + n) for n in ("input_layernorm.weight", "hidden_norm.weight",
                                                "post_attention_layernorm.weight"))
        att, mlp = LAYER + "self_attn.", LAYER + "mlp."
        self.qkv = torch.cat([take_weight(w, att + f"{n}_proj.weight") for n in "qkv"])
        self.o_proj = take_weight(w, att + "o_proj.weight")
        self.gate_up = torch.cat([take_weight(w, mlp + "gate_proj.weight"), take_weight(w, mlp + "up_proj.weight")])
        self.down = take_weight(w, mlp + "down_proj.weight")
        self.norm = take_weight(w, "norm.weight")
        self.lm_head = self._head(w, target_lm_head)
        ids = draft_to_target_ids(w.pop("d2t").cpu()) if c.has_d2t else None
        self.draft_to_target = None if ids is None else torch.from_numpy(ids).long().to(self.device)
        if w:
            raise ValueError(f"weights: unexpected tensors {sorted(w)[:8]}")
        self.inv_freq = torch.from_numpy(c.inv_freq()).to(self.device)

    def _check(self, w: dict) -> None:
        for name, shape in expected_eagle3_shapes(self.config).items():
            if name in w and tuple(w[name].shape) != shape:
                raise ValueError(f"weights: tensor {name!r} has shape {tuple(w[name].shape)}, expected {shape}")
        kinds = sorted({f"{t.dtype} on {t.device}" for n, t in w.items() if n != "d2t"})
        if len(kinds) > 1:
            raise ValueError(f"weights: expected one dtype and device for the float tensors, got {kinds}")

    def _shared(self, w: dict, name: str, target: Optional[torch.Tensor], arg: str) -> torch.Tensor:
        """The draft's own ``name``, or the target's tensor passed as ``arg``."""
        if name in w:
            return w.pop(name)
        if target is None:
            raise ValueError(f"{arg}: the draft has no {name!r}; pass the target's")
        want = (self.config.vocab_size, self.config.hidden_size)
        if tuple(target.shape) != want:
            raise ValueError(f"{arg}: expected shape {want}, got {tuple(target.shape)}")
        return target.to(self.device, self.dtype)

    def _head(self, w: dict, target_lm_head: Optional[torch.Tensor]) -> torch.Tensor:
        if "lm_head.weight" in w or not self.config.tie_word_embeddings:
            return self._shared(w, "lm_head.weight", target_lm_head, "target_lm_head")
        return self.embed

    @classmethod
    def load(cls, path, target: M3TextConfig, *, dtype=torch.bfloat16, device="cpu",
             target_embed: Optional[torch.Tensor] = None, target_lm_head: Optional[torch.Tensor] = None,
             aux_layer_convention: str = "output") -> "Eagle3Draft":
        """The draft in folder ``path`` for ``target``, its float tensors cast to ``dtype`` on ``device``."""
        dtype = TORCH_DTYPES[dtype] if isinstance(dtype, str) else dtype
        config = Eagle3Config.from_dir(path, target, aux_layer_convention=aux_layer_convention)
        weights = load_eagle3_weights(path, config, framework="pt", device=str(device))
        weights = {n: t if n == "d2t" else t.to(dtype) for n, t in weights.items()}
        return cls(config, weights, target_embed=target_embed, target_lm_head=target_lm_head)

    # -- the layer ---------------------------------------------------------------------------

    @torch.no_grad()
    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's hidden input ``[T, hidden]``: ``fc`` of the concatenated aux states
        ``[T, 3 * target_hidden]``, or ``hidden`` itself when it is ``[T, hidden]`` already
        (the draft's own ``h_out``; SGLang's rule, so a 3x-wider aux input always takes ``fc``)."""
        c = self.config
        width = hidden.shape[-1]
        if hidden.dim() != 2 or width not in (c.hidden_size, c.fc_in_features):
            raise ValueError(f"hidden: expected [T, {c.fc_in_features}] (aux states) or [T, {c.hidden_size}] "
                             f"(the draft's h_out), got {tuple(hidden.shape)}")
        return hidden if width == c.hidden_size else F.linear(hidden, self.fc)

    @torch.no_grad()
    def forward(self, step: StepTensors, plan: StepPlan, cache: LayerCaches, hidden: torch.Tensor, *,
                k_scale=None, v_scale=None) -> torch.Tensor:
        """One step's tokens through the draft layer -> ``h_out [T, hidden]`` (before the final norm:
        the hidden input of the next draft step). Writes the step's K/V rows into ``cache`` (the
        draft's :class:`~m3_torch.cache.LayerCaches`). ``plan`` comes from the draft's planner;
        ``step`` is the target step's metadata (``logits_rows`` unused); ``hidden``: see :meth:`fuse`.
        ``k_scale``/``v_scale``: FP8 K/V caches only."""
        c = self.config
        if hidden.shape[0] != step.input_ids.shape[0]:
            raise ValueError(f"hidden: expected {step.input_ids.shape[0]} rows (the step's tokens), "
                             f"got {hidden.shape[0]}")
        h = self.fuse(hidden)
        normed = rms_norm(h, self.hidden_norm, c.rms_norm_eps)
        e = rms_norm(F.embedding(step.input_ids, self.embed), self.input_norm, c.rms_norm_eps)
        x = torch.cat([e, normed], dim=-1)
        residual = normed if c.norm_before_residual else h
        r = residual + self._attention(x, step, plan, cache, k_scale, v_scale)
        return r + self._mlp(rms_norm(r, self.post_attn_norm, c.rms_norm_eps))

    def _attention(self, x, step: StepTensors, plan: StepPlan, cache: LayerCaches, k_scale, v_scale):
        c = self.config
        T, hq, hk, d = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q, k, v = F.linear(x, self.qkv).split([hq * d, hk * d, hk * d], dim=-1)
        cos, sin = rope_cos_sin(step.positions, self.inv_freq, self.dtype)
        q = apply_rope(q.reshape(T, hq, d), cos, sin)
        k = apply_rope(k.reshape(T, hk, d), cos, sin)
        if cache.index_k_cache is not None:
            raise ValueError("cache: the draft's layer is dense (index_k_cache must be None)")
        write_cache(k, v.reshape(T, hk, d), None, cache.k_cache, cache.v_cache, None, step.slot_mapping,
                    k_scale=k_scale, v_scale=v_scale)
        out, _ = msa_attention_step(q, None, cache.k_cache, cache.v_cache, None, step.block_table, step.seq_lens,
                                    plan=plan, sparse=False, sm_scale=c.attention_scale, k_scale=k_scale,
                                    v_scale=v_scale)
        return F.linear(out.reshape(T, hq * d), self.o_proj)

    def _mlp(self, h):
        gate, up = F.linear(h, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down)

    # -- heads -------------------------------------------------------------------------------

    @torch.no_grad()
    def draft_logits(self, h_out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``lm_head(norm(h_out[rows]))`` -> ``[len(rows), draft_vocab]`` float32 (draft ids)."""
        x = rms_norm(h_out.index_select(0, rows), self.norm, self.config.rms_norm_eps)
        return F.linear(x, self.lm_head).float()

    @torch.no_grad()
    def logits(self, h_out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the TARGET vocabulary ``[len(rows), vocab]`` float32: a target id
        outside the draft vocabulary gets ``-inf`` (probability 0, as vLLM's ``compute_logits``)."""
        logits = self.draft_logits(h_out, rows)
        if self.draft_to_target is None:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.draft_to_target] = logits
        return full

    @torch.no_grad()
    def draft_tokens(self, h_out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Greedy drafts: the argmax over the draft vocabulary (ties: the lowest draft id) as
        TARGET ids ``[len(rows)]`` int64."""
        return self.to_target_ids(self.draft_logits(h_out, rows).argmax(dim=-1))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary ids -> target ids (``id + d2t[id]``; the identity without ``d2t``)."""
        draft_ids = draft_ids.long()
        return draft_ids if self.draft_to_target is None else self.draft_to_target[draft_ids]


class Eagle3Proposer:
    """An :class:`Eagle3Draft` inside an engine: its own pool (the target pool's slots) and planner,
    run eagerly after each target step.

    draft:          the draft head, on the engine's device in the model dtype.
    num_slots:      the target pool's slots.
    step_config:    the engine's planner config (batch, token and block limits); the draft's
                    plans use its heads and no graph padding.
    num_speculative_tokens: ``k``, drafts per request.
    kv_cache_dtype: the draft pool's K/V dtype, as the target's ("auto" or "fp8").
    """

    def __init__(self, draft: Eagle3Draft, *, num_slots: int, step_config: StepConfig, num_speculative_tokens: int,
                 kv_cache_dtype: str = "auto"):
        self.draft, self.k = draft, num_speculative_tokens
        dtype = next(name for name, d in TORCH_DTYPES.items() if d == draft.dtype)
        self.cache = allocate_draft_cache(draft.config, num_slots, dtype, draft.device, kv_cache_dtype=kv_cache_dtype)
        self.planner = StepPlanner(draft_step_config(draft.config,
                                                     dataclasses.replace(step_config, graph_batch_sizes=())))

    @torch.no_grad()
    def propose(self, work: DraftPass, aux: torch.Tensor) -> np.ndarray:
        """Run ``work`` after its target step, whose aux hidden states are ``aux [T, 3 * target_hidden]``
        -> the drafts ``[n, k]`` int32 (target ids) of ``work.request_ids``."""
        step = work.step
        # every pass's metadata in one copy: the first pass's fields (the step's rows, each taking the token
        # after it), the chained passes' block table, then per chained pass its positions, slot mapping and
        # lengths
        chained = [a for i in range(self.k - 1) for a in (work.positions[i], work.slot_mapping[i], work.seq_lens[i])]
        uploaded = upload([work.input_ids, step.positions, step.slot_mapping, step.block_table, step.seq_lens,
                           work.rows, work.block_table, *chained], self.draft.device)
        # the first pass: the target's aux states
        first = StepTensors(*uploaded[:6])
        table, chained = uploaded[6], uploaded[7:]
        plan = self.planner.plan(step.seq_lens, cu_seqlens_q=step.cu_seqlens_q, num_context=step.num_context)
        h = self.draft.forward(first, plan, self.cache.caches, aux)
        n = work.num_requests
        if n == 0:
            return np.zeros((0, self.k), np.int32)
        # draft 1 from each request's last valid row; then one-token steps on the draft's own h_out
        h = h.index_select(0, first.logits_rows)
        rows = torch.arange(n, device=self.draft.device)
        drafts = [self.draft.draft_tokens(h, rows)]
        for i in range(self.k - 1):
            positions, slot_mapping, seq_lens = chained[3 * i:3 * i + 3]
            chain = StepTensors(input_ids=drafts[-1], positions=positions, slot_mapping=slot_mapping,
                                block_table=table, seq_lens=seq_lens, logits_rows=rows)
            plan = self.planner.plan(work.seq_lens[i], q_lens=[1] * n, num_context=0)
            h = self.draft.forward(chain, plan, self.cache.caches, h)
            drafts.append(self.draft.draft_tokens(h, rows))
        return torch.stack(drafts, dim=1).int().cpu().numpy()
