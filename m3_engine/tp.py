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
* **MLPs**: every routed expert, the shared expert and the dense MLP are split
  INSIDE (transformers' ``packed_colwise`` / ``rowwise``): rank ``r`` holds
  rows ``[r * I/tp, (r + 1) * I/tp)`` of the gate half AND of the up half of
  ``gate_up_proj`` (so its local ``[gate_r; up_r]`` feeds SwiGLU as is) and the
  same columns of ``down_proj``. The router and its bias are replicated: every
  rank routes the same (replicated) hidden states to the same experts.
* **the rest** (embeddings, norms, ``lm_head``) is replicated here; whether an
  engine keeps ``lm_head`` on every rank, on one, or vocab-parallel is its
  choice (``m3_torch``: rank 0 only; ``m3_jax``: vocab-sharded by XLA).

The outputs of ``o_proj`` and of each MLP's ``down_proj`` are partial sums: the
engines all-reduce them over the ranks (two all-reduces per layer), which
leaves the residual stream replicated. Numerically the only change from one
rank is the order of those sums.

    plan = TPPlan(config, 2)              # ValueError when 2 does not divide the heads / MLPs
    plan.local_config                      # the M3TextConfig one rank computes with (its head counts, ...)
    plan.rank(1).slice("model.layers.0.self_attn.q_proj.weight")   # TensorSlice(dim=0, ranges=((64, 128),))

``m3_engine.checkpoint.iter_weights(..., shard=plan.rank(r))`` reads exactly
those slices from the safetensors files (``get_slice``), never a whole tensor.

Framework-neutral: no torch, no jax.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from .model_config import M3TextConfig

__all__ = ["TPPlan", "RankShard", "TensorSlice", "check_tensor_parallel_size"]


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
    and ``size`` (one must divide the other), and the intermediate sizes of
    the MLPs the model has.
    """
    config: M3TextConfig
    size: int

    def __post_init__(self):
        c, tp = self.config, check_tensor_parallel_size(self.size)
        object.__setattr__(self, "size", tp)
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
            sizes += [("intermediate_size", c.intermediate_size),
                      ("shared_intermediate_size", c.shared_intermediate_size)]
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
    def local_config(self) -> M3TextConfig:
        """The config one rank's model math runs with: its head counts and MLP widths."""
        c, tp = self.config, self.size
        if tp == 1:
            return c
        return dataclasses.replace(
            c, num_attention_heads=self.num_q_heads, num_key_value_heads=self.num_kv_heads,
            index_n_heads=self.num_kv_heads, dense_intermediate_size=c.dense_intermediate_size // tp,
            intermediate_size=c.intermediate_size // tp, shared_intermediate_size=c.shared_intermediate_size // tp)

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
        m = _LAYER.match(name)
        if self.size == 1 or m is None:
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
        cut = self.slice(name)
        return tuple(full_shape) if cut is None else cut.shape(full_shape)
