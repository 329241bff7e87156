"""MiniMax-M3 text-model configuration, read from a transformers ``config.json``.

:func:`load_config` reads ``config.json`` of a model directory into a frozen
:class:`M3TextConfig` holding every number the model math needs, the way
transformers 5.23's ``MiniMaxM3VLTextConfig`` reads it:

* flat (``save_pretrained`` of ``MiniMaxM3VLForCausalLM``) or nested under
  ``text_config`` (a full MiniMax-M3 VL checkpoint; ``tie_word_embeddings`` and
  ``dtype`` of the outer config count too);
* legacy keys translated: ``sparse_attention_config`` (``sparse_num_index_heads``,
  ``sparse_index_dim``, ``sparse_block_size``, ``sparse_topk_blocks``,
  ``sparse_local_block``, ``sparse_attention_freq`` -> ``layer_types``) and
  ``moe_layer_freq`` -> ``mlp_layer_types``; ``rope_theta`` /
  ``partial_rotary_factor`` / ``rope_scaling`` at the top level;
  ``torch_dtype`` for ``dtype``;
* keys that are absent take the config class's defaults (the full M3 sizes).

One rule differs from transformers on purpose: the RoPE width.
transformers 5.23 rotates ``head_dim * rope_parameters["partial_rotary_factor"]``
channels (all when absent) and ignores ``rotary_dim``, while M3 checkpoints
carry ``rotary_dim`` (64 of 128). Here: ``partial_rotary_factor`` when given,
else ``rotary_dim``, else the whole head; both given and disagreeing is a
``ValueError``.

Framework-neutral: no torch, no jax.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

__all__ = ["M3TextConfig", "load_config", "FULL_ATTENTION", "SPARSE_ATTENTION", "DENSE_MLP", "MOE_MLP"]

FULL_ATTENTION = "full_attention"        # layer_types entry: dense paged attention
SPARSE_ATTENTION = "minimax_m3_sparse"   # layer_types entry: MSA (indexer + block-sparse attention)
DENSE_MLP = "dense"                      # mlp_layer_types entry: SwiGLU-OAI MLP
MOE_MLP = "sparse"                       # mlp_layer_types entry: MoE block
DTYPES = ("float32", "bfloat16", "float16")

# transformers 5.23 MiniMaxM3VLTextConfig defaults (the full MiniMax-M3 text model).
DEFAULTS = dict(
    vocab_size=200064, hidden_size=6144, num_hidden_layers=60, num_attention_heads=64, num_key_value_heads=4,
    head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=524288, rope_theta=5000000.0,
    intermediate_size=3072, dense_intermediate_size=12288, shared_intermediate_size=3072,
    num_local_experts=128, num_experts_per_tok=4, routed_scaling_factor=2.0, swiglu_alpha=1.702,
    swiglu_limit=7.0, index_n_heads=4, index_head_dim=128, index_block_size=128, index_topk_blocks=16,
    index_local_blocks=1, bos_token_id=200034, eos_token_id=200020, pad_token_id=None,
    tie_word_embeddings=False,
)
_LEGACY_SPARSE_KEYS = {  # sparse_attention_config key -> flat key
    "sparse_num_index_heads": "index_n_heads",
    "sparse_index_dim": "index_head_dim",
    "sparse_block_size": "index_block_size",
    "sparse_topk_blocks": "index_topk_blocks",
    "sparse_local_block": "index_local_blocks",
}


@dataclasses.dataclass(frozen=True)
class M3TextConfig:
    """Everything the M3 text model's math needs (transformers field names).

    Attention (every layer): ``num_attention_heads`` query heads (Hq),
    ``num_key_value_heads`` KV heads (Hk), ``head_dim`` (D), per-head q/k RMSNorm,
    RoPE on the first ``rotary_dim`` channels (theta ``rope_theta``, the
    rotate-half convention), scale ``D ** -0.5``.
    Sparse layers (``layer_types[i] == "minimax_m3_sparse"``) add the indexer:
    ``index_n_heads`` (Hi, == Hk) index-q heads and ONE shared index-k head of
    ``index_head_dim`` (Di), their RMSNorms, RoPE on the first
    ``index_rotary_dim`` channels with the attention's cos/sin table (see there),
    then top-``index_topk_blocks`` blocks of ``index_block_size`` (== 128)
    tokens with ``index_local_blocks`` forced local blocks (no init blocks).
    MLP: ``mlp_layer_types[i] == "dense"``: SwiGLU-OAI of
    ``dense_intermediate_size``; ``"sparse"``: MoE of ``num_local_experts``
    experts of ``intermediate_size``, sigmoid router + correction bias, top
    ``num_experts_per_tok``, weights renormalised, times ``routed_scaling_factor``,
    plus one shared expert of ``shared_intermediate_size``. SwiGLU-OAI:
    ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
    ``(up + 1) * gate * sigmoid(alpha * gate)``.
    RMSNorm (Gemma style): ``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` in float32.
    """
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int                       # channels rotated by RoPE (resolved by the rule above)
    max_position_embeddings: int
    layer_types: tuple[str, ...]          # per layer: "full_attention" | "minimax_m3_sparse"
    mlp_layer_types: tuple[str, ...]      # per layer: "dense" | "sparse"
    # indexer (sparse layers)
    index_n_heads: int
    index_head_dim: int
    index_block_size: int
    index_topk_blocks: int
    index_local_blocks: int
    # MLPs
    dense_intermediate_size: int
    intermediate_size: int                # one routed expert
    shared_intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    swiglu_alpha: float
    swiglu_limit: float
    # tokens and weights
    eos_token_ids: tuple[int, ...]        # generation stops at any of these (config.json + generation_config.json)
    bos_token_id: int | None
    pad_token_id: int | None
    tie_word_embeddings: bool
    dtype: str | None                     # checkpoint dtype name ("bfloat16", ...), None when config.json has none

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "rotary_dim", "index_n_heads", "index_head_dim", "index_block_size",
                     "index_topk_blocks", "dense_intermediate_size", "intermediate_size",
                     "shared_intermediate_size", "num_local_experts", "num_experts_per_tok"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("index_local_blocks", self.index_local_blocks, minimum=0)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim: expected an even number <= head_dim={self.head_dim}, got {self.rotary_dim}")
        for name, allowed in (("layer_types", (FULL_ATTENTION, SPARSE_ATTENTION)),
                              ("mlp_layer_types", (DENSE_MLP, MOE_MLP))):
            values = getattr(self, name)
            if len(values) != self.num_hidden_layers:
                raise ValueError(f"{name}: expected one entry per layer ({self.num_hidden_layers}), "
                                 f"got {len(values)}")
            for i, v in enumerate(values):
                if v not in allowed:
                    raise ValueError(f"{name}[{i}]: expected one of {allowed}, got {v!r}")
        if any(self.sparse_layers):
            if self.index_n_heads != self.num_key_value_heads:
                raise ValueError(f"index_n_heads={self.index_n_heads} must equal num_key_value_heads="
                                 f"{self.num_key_value_heads} (one index head selects blocks for one KV head)")
            if self.index_block_size != 128:
                raise ValueError(f"index_block_size: the kernels use blocks of 128 tokens, got {self.index_block_size}")
            if self.index_local_blocks > self.index_topk_blocks:
                raise ValueError(f"index_local_blocks={self.index_local_blocks} must be <= index_topk_blocks="
                                 f"{self.index_topk_blocks}")
        if MOE_MLP in self.mlp_layer_types and not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_local_experts="
                             f"{self.num_local_experts}]")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES} or None, got {self.dtype!r}")

    # -- derived values -----------------------------------------------------------

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer: True for an MSA layer (indexer + sparse attention)."""
        return tuple(t == SPARSE_ATTENTION for t in self.layer_types)

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer: True for an MoE MLP."""
        return tuple(t == MOE_MLP for t in self.mlp_layer_types)

    @property
    def index_init_blocks(self) -> int:
        """Forced leading blocks of the selection: 0 (transformers' indexer has none)."""
        return 0

    @property
    def index_rotary_dim(self) -> int:
        """Channels of idx_q / idx_k that RoPE rotates: ``min(rotary_dim, index_head_dim)``.

        transformers applies ``apply_rotary_pos_emb(idx_q, idx_k, cos[..., :Di], sin[..., :Di])``
        with the attention's cos/sin table (``rotary_dim`` wide, ``cat(freqs, freqs)``
        with ``freqs = pos * theta ** (-arange(0, rotary_dim, 2) / rotary_dim)``).
        When ``rotary_dim <= Di`` (M3: 64 <= 128) that is the same rotation as the
        attention's; otherwise the first ``Di`` columns of the table are used as is.
        """
        return min(self.rotary_dim, self.index_head_dim)

    @property
    def attention_scale(self) -> float:
        """Softmax scale of the main attention: ``head_dim ** -0.5``."""
        return self.head_dim ** -0.5

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None) -> "M3TextConfig":
        """A ``config.json`` dict (flat or with ``text_config``) -> M3TextConfig.

        ``generation_config``: the ``generation_config.json`` dict, if any; its
        ``eos_token_id`` entries are added to the config's.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"config: expected a dict (config.json), got {type(config).__name__}")
        outer = dict(config)
        text = outer.get("text_config")
        if text is None:
            text, outer = outer, {}
        elif not isinstance(text, Mapping):
            raise TypeError(f"config.json: text_config must be an object, got {type(text).__name__}")
        text = dict(text)

        def get(key):
            return text[key] if key in text else DEFAULTS[key]

        sparse_cfg = text.get("sparse_attention_config") or {}  # legacy keys win, as in transformers
        index = {flat: sparse_cfg.get(legacy, get(flat)) for legacy, flat in _LEGACY_SPARSE_KEYS.items()}

        num_layers = int(get("num_hidden_layers"))
        layer_types = text.get("layer_types")
        if layer_types is None and "sparse_attention_freq" in sparse_cfg:
            layer_types = [SPARSE_ATTENTION if f else FULL_ATTENTION for f in sparse_cfg["sparse_attention_freq"]]
        if layer_types is None:
            layer_types = [FULL_ATTENTION] * num_layers
        layer_types = ["full_attention" if t == "attention" else t for t in layer_types]  # transformers' legacy remap
        mlp_layer_types = text.get("mlp_layer_types")
        if mlp_layer_types is None and text.get("moe_layer_freq") is not None:
            mlp_layer_types = [MOE_MLP if f else DENSE_MLP for f in text["moe_layer_freq"]]
        if mlp_layer_types is None:
            mlp_layer_types = [MOE_MLP] * num_layers

        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        head_dim = int(text["head_dim"]) if text.get("head_dim") is not None else (
            hidden // heads if "head_dim" in text else DEFAULTS["head_dim"])
        rope_theta, rotary_dim = _rope(text, head_dim)

        eos = _token_ids("eos_token_id", get("eos_token_id"))
        if generation_config and generation_config.get("eos_token_id") is not None:
            eos += tuple(t for t in _token_ids("generation_config eos_token_id", generation_config["eos_token_id"])
                         if t not in eos)
        tie = bool(outer.get("tie_word_embeddings") or get("tie_word_embeddings"))
        dtype = _first(text.get("dtype"), text.get("torch_dtype"), outer.get("dtype"), outer.get("torch_dtype"))

        return cls(
            vocab_size=int(get("vocab_size")), hidden_size=hidden, num_hidden_layers=num_layers,
            num_attention_heads=heads, num_key_value_heads=int(get("num_key_value_heads")), head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps")), rope_theta=rope_theta, rotary_dim=rotary_dim,
            max_position_embeddings=int(get("max_position_embeddings")),
            layer_types=tuple(layer_types), mlp_layer_types=tuple(mlp_layer_types),
            index_n_heads=int(index["index_n_heads"]), index_head_dim=int(index["index_head_dim"]),
            index_block_size=int(index["index_block_size"]), index_topk_blocks=int(index["index_topk_blocks"]),
            index_local_blocks=int(index["index_local_blocks"]),
            dense_intermediate_size=int(get("dense_intermediate_size")),
            intermediate_size=int(get("intermediate_size")),
            shared_intermediate_size=int(get("shared_intermediate_size")),
            num_local_experts=int(text["num_experts"] if text.get("num_experts") is not None
                                  else get("num_local_experts")),
            num_experts_per_tok=int(get("num_experts_per_tok")),
            routed_scaling_factor=float(get("routed_scaling_factor")), swiglu_alpha=float(get("swiglu_alpha")),
            swiglu_limit=float(get("swiglu_limit")), eos_token_ids=eos,
            bos_token_id=get("bos_token_id"), pad_token_id=get("pad_token_id"), tie_word_embeddings=tie,
            dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        )


def load_config(model_dir) -> M3TextConfig:
    """``model_dir/config.json`` (+ ``generation_config.json`` when present) -> M3TextConfig."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model_dir: no config.json in {model_dir}")
    config = read_json(path)
    gen_path = model_dir / "generation_config.json"
    generation = read_json(gen_path) if gen_path.is_file() else None
    try:
        return M3TextConfig.from_dict(config, generation)
    except (KeyError, TypeError, ValueError) as e:
        raise type(e)(f"{path}: {e}") from None


def read_json(path: Path) -> Any:
    """A JSON file's value; a malformed file is a ``ValueError`` naming the file, line and column."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None


# -- helpers ---------------------------------------------------------------------------

def _rope(text: Mapping, head_dim: int) -> tuple[float, int]:
    """-> (rope_theta, rotary_dim) by the RoPE-width rule of the module docstring."""
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_parameters.rope_type: only 'default' RoPE is supported, got {rope_type!r}")
    theta = float(_first(params.get("rope_theta"), text.get("rope_theta"), DEFAULTS["rope_theta"]))
    factor = _first(params.get("partial_rotary_factor"), text.get("partial_rotary_factor"))
    rotary_dim = text.get("rotary_dim")
    from_factor = None if factor is None else int(head_dim * float(factor))
    if from_factor is not None and rotary_dim is not None and from_factor != int(rotary_dim):
        raise ValueError(f"rotary_dim={rotary_dim} disagrees with partial_rotary_factor={factor} "
                         f"(head_dim {head_dim} * {factor} = {from_factor} channels)")
    return theta, int(_first(from_factor, rotary_dim, head_dim))


def _token_ids(name, value) -> tuple[int, ...]:
    if value is None:
        return ()
    values = [value] if isinstance(value, int) else list(value)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TypeError(f"{name}: expected an int or a list of ints, got {value!r}")
    return tuple(dict.fromkeys(values))


def _first(*values):
    return next((v for v in values if v is not None), None)


def _check_int(name, value, *, minimum):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
