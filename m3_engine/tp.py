"""Tensor parallelism: how MiniMax-M3's tensors split over ``size`` ranks.

The split is the one of transformers' ``MiniMaxM3VLTextConfig.base_model_tp_plan``
extended to the whole model, as inference engines serve M3 at TP 2-8:

* **attention**: rank ``r`` holds query heads ``[r * Hq/tp, (r + 1) * Hq/tp)``
  (``q_proj`` rows, ``o_proj`` columns: column- then row-parallel) and the KV
  heads they read: ``Hk/tp`` of them when ``tp <= Hk``, else ONE KV head
  (``r * Hk // tp``), replicated on the ``tp / Hk`` ranks that share it.
  ``k_proj``/``v_proj`` rows follow; the indexer's query heads
  (``indexer.q_proj`` rows) are sharded like the KV heads (index head ``i``
  selects blocks for KV head ``i``; the kernels take ``Hi == Hk`` per call);
  the ONE index-K head (``indexer.k_proj``) and the q/k norms are replicated,
  and so is every rank's index-K cache.
* **MLPs**: the shared expert and the dense MLP are split INSIDE
  (transformers' ``packed_colwise`` / ``rowwise``): rank ``r`` holds rows
  ``[r * I/tp, (r + 1) * I/tp)`` of the gate half AND of the up half of
  ``gate_up_proj`` (so its local ``[gate_r; up_r]`` feeds SwiGLU as is) and the
  same columns of ``down_proj``. The routed experts are split the same way
  (every rank a slice of every expert), or, with ``expert_parallel=True``
  (the engine's ``enable_expert_parallel``), each rank holds ``E/tp`` WHOLE
  experts ``[r * E/tp, (r + 1) * E/tp)`` (``experts.*`` sliced on the experts'
  axis). The router and its bias are replicated: every rank routes the same
  (replicated) hidden states to the same experts; under expert parallelism a
  rank then runs the (token, expert) pairs of ITS experts only (the others
  weigh 0 there), so its MoE output is again a partial sum.
* **vocabulary**: ``model.embed_tokens`` and ``lm_head`` are split over the
  vocabulary: rank ``r`` holds rows ``[r * V', (r + 1) * V')``, ``V' =
  ceil(vocab_size / tp)`` (:attr:`TPPlan.vocab_rows`), the last ranks' rows
  past ``vocab_size`` padded with zeros by the engine (:meth:`RankShard.shape`
  is the padded shape; the slice read from the checkpoint is the real rows).
  The embedding is a local lookup (ids outside the rank's rows give zeros)
  completed by an all-reduce; the head gives local logits ``[T, V']``, which
  an all-gather puts side by side (then cut to ``vocab_size``). A sum of one
  value and zeros is exact, and each logit is the dot product of one row, so
  the split changes no bit of the embedding and, up to the GEMM's blocking,
  none of the logits.
* **the rest** (norms, the router, the index-K projection) is replicated.

Expert parallelism here dispatches no tokens: after the attention all-reduce
the hidden states are replicated on every rank, so each rank runs its own
experts on every token that chose them and the all-reduce that already
follows the MoE (as it follows the inside split) sums the ranks' partial
outputs. At decode batch sizes a step is bound by reading the touched
experts' weights, and this reads each touched expert once, on one rank, with
no extra collective. An all-to-all dispatch (each rank sends only its tokens'
hidden rows to the experts' ranks, and receives the outputs back) would win
when the token count makes the per-rank expert GEMMs, not the weight reads,
the cost (large prefill chunks), or once the hidden states are no longer
replicated (sequence/data parallel attention); it is not done here.

The outputs of ``o_proj`` and of each MLP (its ``down_proj``, or under expert
parallelism the rank's experts) are partial sums: the engines all-reduce them
over the ranks (two all-reduces per layer, one more for the embedding, one
all-gather of the logits), which leaves the residual stream replicated.
Numerically the only change from one rank is the order of those sums.

    plan = TPPlan(config, 2)              # ValueError when 2 does not divide the heads / MLPs
    plan.local_config                      # the M3TextConfig one rank computes with (its head counts, ...)
    plan.rank(1).slice("model.layers.0.self_attn.q_proj.weight")   # TensorSlice(dim=0, ranges=((64, 128),))
    TPPlan(config, 8, expert_parallel=True).experts(3)              # range(48, 64) of M3's 128 experts

``m3_engine.checkpoint.iter_weights(..., shard=plan.rank(r))`` reads exactly
those slices from the safetensors files (``get_slice``), never a whole tensor.

Framework-neutral: no torch, no jax.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from .model_config import M3TextConfig

__all__ = ["TPPlan", "RankShard", "TensorSlice", "check_tensor_parallel_size", "VOCAB_TENSORS"]

VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")   # split over the vocabulary


@dataclasses.dataclass(frozen=True)
class TensorSlice:
    """The part of a canonical tensor one rank holds: along ``dim``, the
    concatenation of the index ranges ``[start, stop)`` in ``ranges`` (two
    ranges for a packed gate/up projection, one otherwise)."""
    dim: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def length(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    def shape(self, full_shape) -> tuple[int, ...]:
        """The local shape of a tensor of ``full_shape``."""
        shape = list(full_shape)
        shape[self.dim] = self.length
        return tuple(shape)

    def take(self, array, concatenate=None):
        """This slice of a whole (numpy-like) ``array``: what a rank would read from the checkpoint."""
        index = [slice(None)] * array.ndim
        parts = []
        for start, stop in self.ranges:
            index[self.dim] = slice(start, stop)
            parts.append(array[tuple(index)])
        if len(parts) == 1:
            return parts[0]
        return (concatenate or np.concatenate)(parts, self.dim)


def check_tensor_parallel_size(size) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"tensor_parallel_size: expected an int >= 1, got {size!r}")
    return int(size)


# canonical name (layer prefix removed) -> how it splits: "q" query-head rows, "kv" KV-head rows,
# "index_q" index-head rows (= KV heads), "o" query-head columns, "gate_up" packed rows, "down" columns
_RULES = (
    (re.compile(r"^self_attn\.q_proj\.weight$"), "q"),
    (re.compile(r"^self_attn\.(k|v)_proj\.weight$"), "kv"),
    (re.compile(r"^self_attn\.indexer\.q_proj\.weight$"), "index_q"),
    (re.compile(r"^self_attn\.o_proj\.weight$"), "o"),
    (re.compile(r"^mlp\.(gate_up_proj\.weight|shared_experts\.gate_up_proj\.weight|experts\.gate_up_proj)$"),
     "gate_up"),
    (re.compile(r"^mlp\.(down_proj\.weight|shared_experts\.down_proj\.weight|experts\.down_proj)$"), "down"),
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


@dataclasses.dataclass(frozen=True)
class TPPlan:
    """How ``config``'s tensors split over ``size`` ranks (see the module docstring).

    Construction checks that the split exists and raises ``ValueError`` naming
    the numbers otherwise: ``num_attention_heads % size``, ``num_key_value_heads``
    and ``size`` (one must divide the other), the intermediate sizes of the
    MLPs the model has (not the routed experts' under expert parallelism), a
    vocabulary that leaves every rank a row, and with ``expert_parallel``
    (engine option ``enable_expert_parallel``) ``size > 1`` dividing
    ``num_local_experts``.
    """
    config: M3TextConfig
    size: int
    expert_parallel: bool = False

    def __post_init__(self):
        c, tp = self.config, check_tensor_parallel_size(self.size)
        object.__setattr__(self, "size", tp)
        if not isinstance(self.expert_parallel, bool):
            raise TypeError(f"enable_expert_parallel: expected a bool, got {self.expert_parallel!r}")
        if self.expert_parallel:
            if tp == 1:
                raise ValueError("enable_expert_parallel: needs tensor_parallel_size > 1 (the experts are split "
                                 "over the tensor-parallel ranks), got tensor_parallel_size=1")
            if c.num_local_experts % tp:
                raise ValueError(f"enable_expert_parallel: tensor_parallel_size={tp} does not divide "
                                 f"num_local_experts={c.num_local_experts} (each rank holds E / tp whole experts)")
        if tp > 1 and (tp - 1) * -(-c.vocab_size // tp) >= c.vocab_size:
            raise ValueError(f"tensor_parallel_size={tp} leaves a rank no row of vocab_size={c.vocab_size} "
                             f"(each rank holds ceil(vocab_size / tensor_parallel_size) rows of the embedding "
                             f"and lm_head)")
        hq, hk = c.num_attention_heads, c.num_key_value_heads
        if hq % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide num_attention_heads={hq}: each rank "
                             f"holds num_attention_heads / tensor_parallel_size query heads")
        if hk % tp and tp % hk:
            raise ValueError(f"tensor_parallel_size={tp} and num_key_value_heads={hk}: one must divide the other "
                             f"(each rank holds num_key_value_heads / tensor_parallel_size KV heads, or one KV "
                             f"head replicated on tensor_parallel_size / num_key_value_heads ranks)")
        sizes = []
        if not all(c.moe_layers):
            sizes.append(("dense_intermediate_size", c.dense_intermediate_size))
        if any(c.moe_layers):
            if not self.expert_parallel:   # whole experts otherwise
                sizes.append(("intermediate_size", c.intermediate_size))
            sizes.append(("shared_intermediate_size", c.shared_intermediate_size))
        for name, value in sizes:
            if value % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={value}: each rank holds "
                                 f"{name} / tensor_parallel_size rows of every gate/up projection")

    # -- per-rank sizes ---------------------------------------------------------------

    @property
    def num_q_heads(self) -> int:
        """Query heads per rank."""
        return self.config.num_attention_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        """KV heads (and index-q heads) per rank: ``max(1, Hk / tp)``."""
        return max(1, self.config.num_key_value_heads // self.size)

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head: 1, or ``tp / Hk`` when ``tp > Hk``."""
        return max(1, self.size // self.config.num_key_value_heads)

    def kv_heads(self, rank: int) -> range:
        """The global KV heads rank ``rank`` holds (those its query heads read)."""
        first = self._rank(rank) * self.config.num_key_value_heads // self.size
        return range(first, first + self.num_kv_heads)

    def q_heads(self, rank: int) -> range:
        return range(self._rank(rank) * self.num_q_heads, (self._rank(rank) + 1) * self.num_q_heads)

    @property
    def num_experts(self) -> int:
        """Routed experts per rank: ``E / tp`` whole ones under expert parallelism, else all ``E`` (sliced)."""
        return self.config.num_local_experts // self.size if self.expert_parallel else self.config.num_local_experts

    def experts(self, rank: int) -> range:
        """The global ids of the routed experts rank ``rank`` holds (its weights' axis 0, in order)."""
        first = self._rank(rank) * self.num_experts if self.expert_parallel else 0
        return range(first, first + self.num_experts)

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and of ``lm_head`` per rank: ``ceil(vocab_size / tp)`` (padding included)."""
        return -(-self.config.vocab_size // self.size)

    def vocab(self, rank: int) -> range:
        """The token ids whose embedding and ``lm_head`` rows rank ``rank`` holds (padding excluded)."""
        start = self._rank(rank) * self.vocab_rows
        return range(start, min(start + self.vocab_rows, self.config.vocab_size))

    @property
    def local_config(self) -> M3TextConfig:
        """The config one rank's model math runs with: its head counts and MLP widths (the routed
        experts' whole width under expert parallelism). ``num_local_experts`` and ``vocab_size`` stay
        the model's: the router scores every expert, the logits cover the whole vocabulary."""
        c, tp = self.config, self.size
        if tp == 1:
            return c
        return dataclasses.replace(
            c, num_attention_heads=self.num_q_heads, num_key_value_heads=self.num_kv_heads,
            index_n_heads=self.num_kv_heads, dense_intermediate_size=c.dense_intermediate_size // tp,
            intermediate_size=c.intermediate_size if self.expert_parallel else c.intermediate_size // tp,
            shared_intermediate_size=c.shared_intermediate_size // tp)

    def rank(self, rank: int) -> "RankShard":
        return RankShard(self, self._rank(rank))

    def _rank(self, rank) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.size:
            raise ValueError(f"rank: expected an int in [0, {self.size}), got {rank!r}")
        return int(rank)

    # -- slices -----------------------------------------------------------------------

    def slice(self, name: str, rank: int) -> TensorSlice | None:
        """The part of canonical tensor ``name`` rank ``rank`` holds; None: the whole tensor (replicated)."""
        rank = self._rank(rank)
        if self.size == 1:
            return None
        if name in VOCAB_TENSORS:
            rows = self.vocab(rank)
            return TensorSlice(0, ((rows.start, rows.stop),))
        m = _LAYER.match(name)
        if m is None:
            return None
        rule = next((kind for pattern, kind in _RULES if pattern.match(m[2])), None)
        if rule is None:
            return None
        c = self.config
        d, di = c.head_dim, c.index_head_dim
        q0 = self.q_heads(rank).start
        k0 = self.kv_heads(rank).start
        if rule == "q":
            return TensorSlice(0, ((q0 * d, (q0 + self.num_q_heads) * d),))
        if rule == "kv":
            return TensorSlice(0, ((k0 * d, (k0 + self.num_kv_heads) * d),))
        if rule == "index_q":
            return TensorSlice(0, ((k0 * di, (k0 + self.num_kv_heads) * di),))
        if rule == "o":
            return TensorSlice(1, ((q0 * d, (q0 + self.num_q_heads) * d),))
        experts = m[2].startswith("mlp.experts.")
        if experts and self.expert_parallel:   # whole experts: a range of the experts' axis
            ids = self.experts(rank)
            return TensorSlice(0, ((ids.start, ids.stop),))
        width = (c.intermediate_size if experts else c.shared_intermediate_size if "shared_experts" in m[2]
                 else c.dense_intermediate_size)
        local = width // self.size
        start = rank * local
        if rule == "gate_up":   # [.., 2I, hidden]: the rank's rows of the gate half, then of the up half
            return TensorSlice(int(experts), ((start, start + local), (width + start, width + start + local)))
        return TensorSlice(1 + int(experts), ((start, start + local),))   # down: [.., hidden, I] columns


@dataclasses.dataclass(frozen=True)
class RankShard:
    """One rank of a :class:`TPPlan`: what ``checkpoint.iter_weights(shard=...)`` reads for it."""
    plan: TPPlan
    rank: int

    def slice(self, name: str) -> TensorSlice | None:
        return self.plan.slice(name, self.rank)

    def shape(self, name: str, full_shape) -> tuple[int, ...]:
        """The shape of the tensor the rank holds: its slice's, with the vocabulary tensors padded to
        :attr:`TPPlan.vocab_rows` rows."""
        cut = self.slice(name)
        if cut is None:
            return tuple(full_shape)
        if name in VOCAB_TENSORS:
            return (self.plan.vocab_rows,) + tuple(full_shape[1:])
        return cut.shape(full_shape)
