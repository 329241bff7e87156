"""EAGLE-3 draft heads for MiniMax-M3: the published format, read and checked, and a random writer.

An EAGLE-3 draft (``architectures: ["LlamaForCausalLMEagle3"]``, the format of the
public MiniMax-M2.x / M3 drafts that vLLM and SGLang serve and SpecForge /
TorchSpec train) is ONE Llama decoder layer fed with the target's hidden states:

    h     = fc(concat(aux_1, aux_2, aux_3))      [T, 3 * target_hidden] -> [T, hidden]
            (no fc when the input already has ``hidden`` columns: the draft's own
            ``h_out`` of the previous draft step)
    e     = embed_tokens(input_ids)              the draft's own, or the target's when absent
    x     = concat(input_layernorm(e), hidden_norm(h))           [T, 2 * hidden]
    r     = h  (hidden_norm(h) when ``norm_before_residual``)
    r     = r + o_proj(attention(rope(q_proj(x)), rope(k_proj(x)), v_proj(x)))   causal, paged
    h_out = r + down_proj(silu(gate_proj(n)) * up_proj(n)),   n = post_attention_layernorm(r)
    logits over the draft vocabulary = lm_head(norm(h_out))
    a draft token id ``i`` is target token ``i + d2t[i]`` (identity without ``d2t``)

Norms are standard Llama RMSNorm (``weight * x / rms(x)``, NOT the target's
``1 + weight``); RoPE is Llama's, over the whole head (``rope_theta``, plain,
``"linear"`` or ``"llama3"`` scaling); the attention scale is ``head_dim ** -0.5``.

**Aux layers** (:attr:`Eagle3Config.aux_layer_ids`): layer indices of the target
whose OUTPUT is fed in, i.e. the residual stream after layer ``id`` ran (before
the final norm), transformers' ``output_hidden_states[id + 1]``. That is the
training convention (SpecForge takes ``hidden_states[id + 1]``; TorchSpec
documents "post-layer semantics") and SGLang's serving one
(``layers_to_capture = [id + 1 ...]``, captured at the input of that layer).
vLLM reads the same config key as the INPUT of layer ``id`` (the output of
``id - 1``): pass ``aux_layer_convention="input"`` for a draft whose ids were
written that way. Without ids in the config, every runtime uses the inputs of
layers ``(2, L // 2, L - 3)``, here ``(1, L // 2 - 1, L - 4)``. docs/ENGINE.md
("EAGLE-3 draft heads") lists the sources read.

Canonical tensor names (:func:`expected_eagle3_shapes`); stored names may carry a
``model.`` prefix and ``midlayer.`` (SpecForge) for ``layers.0.``::

    fc.weight                                  [hidden, 3 * target_hidden]
    embed_tokens.weight                        [vocab, hidden]         optional: the target's
    layers.0.input_layernorm.weight            [hidden]
    layers.0.hidden_norm.weight                [hidden]
    layers.0.self_attn.{q,k,v}_proj.weight     [heads * head_dim, 2 * hidden]   (k, v: kv_heads)
    layers.0.self_attn.o_proj.weight           [hidden, heads * head_dim]
    layers.0.post_attention_layernorm.weight   [hidden]
    layers.0.mlp.{gate,up}_proj.weight         [intermediate, hidden]
    layers.0.mlp.down_proj.weight              [hidden, intermediate]
    norm.weight                                [hidden]
    lm_head.weight                             [draft_vocab, hidden]   optional: the target's (full vocab)
    d2t                                        [draft_vocab] int       required when draft_vocab < vocab
    t2d                                        [vocab] bool            optional, checked against d2t

The draft's KV cache is a pool of its own (:func:`draft_pool_layout`: one dense
layer with the draft's KV heads) with the target's ``num_slots``, so the
scheduler's slot ids and block tables address both; its attention runs the
project's paged kernels with a plan from a planner of the draft's heads
(:func:`draft_step_config`).

Framework-neutral: numpy, safetensors and json (and the pure-Python pool and
planner of ``m3_kernels``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from m3_kernels.planner import StepConfig
from m3_kernels.pool import PoolLayout

from .checkpoint import TensorReader, checkpoint_index
from .model_config import M3TextConfig, read_json

__all__ = ["Eagle3Config", "ARCHITECTURES", "LAYER", "ROPE_TYPES", "AUX_LAYER_CONVENTIONS", "default_aux_layer_ids",
           "canonical_eagle3_name", "expected_eagle3_shapes", "load_eagle3_weights", "draft_to_target_ids",
           "draft_pool_layout", "draft_step_config", "write_random_eagle3"]

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")
AUX_LAYER_CONVENTIONS = ("output", "input")
LAYER = "layers.0."
FRAMEWORKS = ("numpy", "jax", "pt")   # "jax": numpy arrays, which jnp.asarray takes as they are
OPTIONAL = ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)   # buffers some trainers save; recomputed here


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The aux layers when a draft's config names none, in this module's (output) convention.

    vLLM (``get_eagle3_default_aux_hidden_state_layers``) and SGLang
    (``set_eagle3_layers_to_capture(None)``) capture the INPUTS of layers
    ``(2, L // 2, L - 3)``; SpecForge and TorchSpec train on the OUTPUTS of
    ``[1, L // 2 - 1, L - 4]``: the same tensors.
    """
    return (1, num_layers // 2 - 1, num_layers - 4)


# -- configuration -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Everything the draft layer's math needs, checked against its target (hashable: a static
    argument of a jitted JAX function).

    hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
    rms_norm_eps: the Llama layer (q/k/v take ``2 * hidden_size`` inputs).
    rope_theta, rope_type (``ROPE_TYPES``), rope_factor, rope_low_freq_factor,
    rope_high_freq_factor, rope_original_max_position_embeddings: Llama RoPE over
    the whole head (the scaling fields are None for "default").
    vocab_size:        the target's vocabulary (ids the draft takes and proposes).
    draft_vocab_size:  rows of ``lm_head`` (< vocab_size: a compressed head with ``d2t``).
    target_hidden_size: columns of each aux hidden state (``fc`` takes 3 of them).
    aux_layer_ids:     target layers whose OUTPUT feeds ``fc``, in order (module docstring).
    norm_before_residual: the residual of the attention is ``hidden_norm(h)``, not ``h``.
    has_embedding:     the checkpoint holds ``embed_tokens.weight`` (else the target's is used).
    has_lm_head:       the checkpoint holds ``lm_head.weight`` (else the target's, or the
                       embedding when ``tie_word_embeddings``).
    has_d2t:           the checkpoint holds ``d2t`` (draft id -> target id offsets).
    """
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool = False
    has_embedding: bool = True
    has_lm_head: bool = True
    has_d2t: bool = False
    tie_word_embeddings: bool = False
    rope_type: str = "default"
    rope_factor: float | None = None
    rope_low_freq_factor: float | None = None
    rope_high_freq_factor: float | None = None
    rope_original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    dtype: str | None = None

    def __post_init__(self):
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "vocab_size", "draft_vocab_size", "target_hidden_size"):
            _check_int(name, getattr(self, name))
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        d = self.head_dim
        if d < 16 or d > 256 or d & (d - 1):
            raise ValueError(f"head_dim: the paged kernels take a power of two in [16, 256], got {d}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} exceeds vocab_size={self.vocab_size}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type: expected one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.rope_type != "default" and self.rope_factor is None:
            raise ValueError(f"rope scaling {self.rope_type!r} needs a factor")
        if self.rope_type == "llama3" and None in (self.rope_low_freq_factor, self.rope_high_freq_factor,
                                                   self.rope_original_max_position_embeddings):
            raise ValueError("rope scaling 'llama3' needs low_freq_factor, high_freq_factor and "
                             "original_max_position_embeddings")
        self._check_heads()

    def _check_heads(self):
        if self.draft_vocab_size != self.vocab_size and not self.has_d2t:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} < vocab_size={self.vocab_size} needs a "
                             "'d2t' tensor (draft id -> target id) in the checkpoint")
        if not self.has_lm_head and self.draft_vocab_size != self.vocab_size:
            raise ValueError(f"no lm_head.weight: the target's (or the tied) head covers the whole vocabulary, "
                             f"but draft_vocab_size={self.draft_vocab_size} != vocab_size={self.vocab_size}")

    # -- derived values ---------------------------------------------------------------

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def fc_in_features(self) -> int:
        return len(self.aux_layer_ids) * self.target_hidden_size

    @property
    def attention_scale(self) -> float:
        return self.head_dim ** -0.5

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies ``[head_dim / 2]`` float32 (transformers' Llama rules, in float64)."""
        d = self.head_dim
        inv = 1.0 / self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
        if self.rope_type == "linear":
            inv = inv / self.rope_factor
        elif self.rope_type == "llama3":
            inv = self._llama3(inv)
        return inv.astype(np.float32)

    def _llama3(self, inv: np.ndarray) -> np.ndarray:
        """Llama 3.1's frequency-dependent scaling (transformers' ``_compute_llama3_parameters``)."""
        factor, low, high = self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor
        old_len = self.rope_original_max_position_embeddings
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return np.where(medium, smoothed, scaled)

    # -- reading -----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], target: M3TextConfig, *, tensor_names: Sequence[str] = (),
                  aux_layer_convention: str = "output") -> "Eagle3Config":
        """A draft ``config.json`` dict -> Eagle3Config, checked against ``target``.

        tensor_names: the checkpoint's canonical tensor names (say which optional
            tensors exist); ``from_dir`` reads them from the safetensors headers.
        aux_layer_convention: "output" (the ids name layers whose output is fed:
            SGLang, SpecForge, TorchSpec) or "input" (vLLM's reading: the input of
            layer ``id``, stored here as ``id - 1``).
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"config: expected a dict (config.json), got {type(config).__name__}")
        if aux_layer_convention not in AUX_LAYER_CONVENTIONS:
            raise ValueError(f"aux_layer_convention: expected one of {AUX_LAYER_CONVENTIONS}, "
                             f"got {aux_layer_convention!r}")
        flat, speculators = _flatten(config)
        _check_supported(flat)
        names = set(tensor_names)
        hidden, heads = int(flat["hidden_size"]), int(flat["num_attention_heads"])
        rope = _rope(flat)
        draft_config = cls(
            hidden_size=hidden, num_attention_heads=heads,
            num_key_value_heads=int(flat.get("num_key_value_heads") or heads),
            head_dim=int(flat.get("head_dim") or hidden // heads), intermediate_size=int(flat["intermediate_size"]),
            rms_norm_eps=float(flat.get("rms_norm_eps", 1e-6)), vocab_size=int(flat["vocab_size"]),
            draft_vocab_size=int(flat.get("draft_vocab_size") or flat["vocab_size"]),
            target_hidden_size=int(flat.get("target_hidden_size") or hidden),
            aux_layer_ids=_aux_layer_ids(flat, target, aux_layer_convention),
            norm_before_residual=bool(flat.get("norm_before_residual", speculators)),
            tie_word_embeddings=bool(flat.get("tie_word_embeddings", False)), **_present(names, flat),
            max_position_embeddings=flat.get("max_position_embeddings"),
            dtype=_dtype_name(flat.get("dtype") or flat.get("torch_dtype")), **rope)
        draft_config.check_target(target)
        return draft_config

    @classmethod
    def from_dir(cls, path, target: M3TextConfig, *, aux_layer_convention: str = "output") -> "Eagle3Config":
        """``path/config.json`` + the names in its safetensors -> Eagle3Config (errors name the file)."""
        path = Path(path)
        config_path = path / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"draft model: no config.json in {path}")
        names = [canonical_eagle3_name(n) for n in checkpoint_index(path)]
        try:
            return cls.from_dict(read_json(config_path), target, tensor_names=[n for n in names if n],
                                 aux_layer_convention=aux_layer_convention)
        except (KeyError, TypeError, ValueError) as e:
            raise type(e)(f"{config_path}: {e}") from None

    def check_target(self, target: M3TextConfig) -> None:
        """The draft fits ``target``: its vocabulary, hidden size and layer ids."""
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"vocab_size={self.vocab_size}, but the target's vocabulary has {target.vocab_size} "
                             "tokens")
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(f"target_hidden_size={self.target_hidden_size}, but the target's hidden size is "
                             f"{target.hidden_size}")
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids: EAGLE-3 fuses 3 target layers, got "
                             f"{list(self.aux_layer_ids)}")
        bad = [i for i in self.aux_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids: layers {bad} (output convention) are not layers "
                             f"of the target (0..{target.num_hidden_layers - 1})")
        if not self.has_embedding and self.hidden_size != target.hidden_size:
            raise ValueError(f"no embed_tokens.weight: the target's embedding ({target.hidden_size} wide) would be "
                             f"used, but hidden_size={self.hidden_size}")
        if not self.has_lm_head and not self.tie_word_embeddings and self.hidden_size != target.hidden_size:
            raise ValueError(f"no lm_head.weight: the target's head ({target.hidden_size} wide) would be used, "
                             f"but hidden_size={self.hidden_size}")


def _flatten(config: Mapping) -> tuple[dict, bool]:
    """-> (the Llama fields and the EAGLE-3 fields in one dict, whether it is the speculators format).

    The speculators format (``speculators_model_type: "eagle3"``) nests the Llama
    layer under ``transformer_layer_config`` and defaults ``norm_before_residual``
    to True (vLLM's ``update_eagle3``); the HF format is flat.
    """
    flat = dict(config)
    kind = flat.get("speculators_model_type")
    if kind is None:
        archs = flat.get("architectures") or []
        if not any(a in ARCHITECTURES for a in archs):
            raise ValueError(f"architectures: expected one of {list(ARCHITECTURES)} (an EAGLE-3 draft), got {archs}")
        return flat, False
    if kind != "eagle3":
        raise ValueError(f"speculators_model_type: expected 'eagle3', got {kind!r}")
    layer = flat.get("transformer_layer_config")
    if not isinstance(layer, Mapping):
        raise ValueError("speculators format: 'transformer_layer_config' must be an object")
    return {**layer, **{k: v for k, v in flat.items() if k != "transformer_layer_config"}}, True


def _check_supported(flat: Mapping) -> None:
    """Refuse what the draft layer here does not compute, naming the key."""
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in flat:
            raise KeyError(f"missing {key!r}")
    if int(flat.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"num_hidden_layers: a draft head of exactly 1 layer is supported, got "
                         f"{flat['num_hidden_layers']}")
    if flat.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: only 'silu' (Llama's MLP) is supported, got {flat['hidden_act']!r}")
    for key in ("attention_bias", "mlp_bias", "bias"):
        if flat.get(key):
            raise ValueError(f"{key}: projections with biases are not supported")
    eagle = flat.get("eagle_config") or {}
    if not eagle.get("use_aux_hidden_state", True):
        raise ValueError("eagle_config.use_aux_hidden_state=false (no fc, EAGLE-1 style) is not supported")
    if float(flat.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor: a Llama draft rotates the whole head")


def _present(names: set, flat: Mapping) -> dict:
    """-> the ``has_*`` fields: from the checkpoint's tensor names, or (none given) every optional
    tensor but ``d2t``, which a compressed head needs."""
    if not names:
        vocab = int(flat["vocab_size"])
        return dict(has_embedding=True, has_lm_head=True,
                    has_d2t=int(flat.get("draft_vocab_size") or vocab) != vocab)
    return dict(has_embedding="embed_tokens.weight" in names, has_lm_head="lm_head.weight" in names,
                has_d2t="d2t" in names)


def _rope(flat: Mapping) -> dict:
    """-> the rope fields of Eagle3Config, from ``rope_parameters`` (transformers 5) or ``rope_scaling``."""
    params = dict(flat.get("rope_parameters") or flat.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope scaling: {kind!r} is not supported (supported: {list(ROPE_TYPES)})")
    theta = params.get("rope_theta", flat.get("rope_theta", 10000.0))
    out = dict(rope_theta=float(theta), rope_type=kind)
    if kind != "default":
        out["rope_factor"] = float(params["factor"])
    if kind == "llama3":
        out.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]),
                   rope_original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    return out


def _aux_layer_ids(flat: Mapping, target: M3TextConfig, convention: str) -> tuple[int, ...]:
    eagle = flat.get("eagle_config") or {}
    if not isinstance(eagle, Mapping):
        raise TypeError("eagle_config: expected an object")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or flat.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return default_aux_layer_ids(target.num_hidden_layers)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TypeError(f"eagle_aux_hidden_state_layer_ids: expected a list of ints, got {ids!r}")
    if convention == "input":
        if min(ids) < 1:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids {list(ids)} (input convention): layer 0's input "
                             "is the embedding, not a layer output")
        return tuple(i - 1 for i in ids)
    return tuple(ids)


def _dtype_name(value) -> str | None:
    return None if value is None else str(value).removeprefix("torch.")


def _check_int(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


# -- tensors -----------------------------------------------------------------------------

def canonical_eagle3_name(stored: str) -> str | None:
    """Stored tensor name -> canonical name (module docstring); None for a buffer that is ignored."""
    if stored.endswith(_IGNORED_SUFFIXES):
        return None
    name = stored.removeprefix("model.")
    if name.startswith("midlayer."):
        name = LAYER + name.removeprefix("midlayer.")
    return name


def expected_eagle3_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor ``config`` needs (the optional ones only when present)."""
    c, H = config, config.hidden_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    att, mlp = LAYER + "self_attn.", LAYER + "mlp."
    shapes = {"fc.weight": (H, c.fc_in_features),
              LAYER + "input_layernorm.weight": (H,), LAYER + "hidden_norm.weight": (H,),
              att + "q_proj.weight": (q, 2 * H), att + "k_proj.weight": (kv, 2 * H),
              att + "v_proj.weight": (kv, 2 * H), att + "o_proj.weight": (H, q),
              LAYER + "post_attention_layernorm.weight": (H,),
              mlp + "gate_proj.weight": (c.intermediate_size, H), mlp + "up_proj.weight": (c.intermediate_size, H),
              mlp + "down_proj.weight": (H, c.intermediate_size), "norm.weight": (H,)}
    if c.has_embedding:
        shapes["embed_tokens.weight"] = (c.vocab_size, H)
    if c.has_lm_head:
        shapes["lm_head.weight"] = (c.draft_vocab_size, H)
    if c.has_d2t:
        shapes["d2t"] = (c.draft_vocab_size,)
    return shapes


def load_eagle3_weights(path, config: Eagle3Config, *, framework: str = "numpy", device: str = "cpu") -> dict:
    """Canonical name -> tensor of every tensor of the draft at ``path`` (checkpoint dtypes kept).

    framework: "numpy" or "jax" (numpy arrays, bfloat16 as ``ml_dtypes.bfloat16``:
    what ``jnp.asarray`` takes) or "pt" (torch tensors on ``device``). ``t2d`` is checked against
    ``d2t`` and not returned. Everything is checked before a tensor is read: a
    missing, unexpected, duplicated or mis-shaped tensor is a ``ValueError``
    naming it; so is a ``d2t`` that maps outside the target vocabulary or two
    draft ids onto one target id.
    """
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework: expected one of {FRAMEWORKS}, got {framework!r}")
    path = Path(path)
    plan = _plan(checkpoint_index(path), config)
    reader = TensorReader("numpy" if framework == "jax" else framework, device)
    try:
        for name, (file, stored) in plan.items():
            want = expected_eagle3_shapes(config).get(name, (config.vocab_size,))
            got = reader.shape(file, stored)
            if got != want:
                raise ValueError(f"tensor {name!r} (stored as {stored!r} in {file.name}): expected shape {want}, "
                                 f"got {got}")
        if config.has_d2t:
            _check_vocab_map(config, plan)
        return {name: reader.get(file, stored) for name, (file, stored) in plan.items() if name != "t2d"}
    finally:
        reader.close()


def _plan(index: Mapping[str, Path], config: Eagle3Config) -> dict[str, tuple[Path, str]]:
    """canonical name -> (file, stored name), checked against ``expected_eagle3_shapes``."""
    shapes = expected_eagle3_shapes(config)
    plan, unknown = {}, []
    for stored in sorted(index):
        name = canonical_eagle3_name(stored)
        if name is None:
            continue
        if name not in shapes and name != "t2d":
            unknown.append(stored)
            continue
        if name in plan:
            raise ValueError(f"tensor {name!r} is stored twice: as {plan[name][1]!r} and {stored!r}")
        plan[name] = (index[stored], stored)
    if unknown:
        raise ValueError(f"draft checkpoint has {len(unknown)} unexpected tensor(s) for this config: {unknown[:4]}")
    missing = [n for n in shapes if n not in plan]
    if missing:
        raise ValueError(f"draft checkpoint is missing {len(missing)} tensor(s): {missing[:4]}")
    if "t2d" in plan and not config.has_d2t:
        raise ValueError("draft checkpoint has 't2d' but no 'd2t'")
    return plan


def _check_vocab_map(config: Eagle3Config, plan: Mapping) -> None:
    """d2t maps every draft id into the target vocabulary, no two onto one id; t2d agrees."""
    reader = TensorReader("numpy", "cpu")   # small tensors, read again as numpy whatever the framework
    try:
        d2t = reader.get(*plan["d2t"])
        t2d = np.asarray(reader.get(*plan["t2d"])).astype(bool) if "t2d" in plan else None
    finally:
        reader.close()
    if not np.issubdtype(d2t.dtype, np.integer):
        raise ValueError(f"tensor 'd2t': expected integer offsets, got dtype {d2t.dtype}")
    ids = np.arange(d2t.shape[0], dtype=np.int64) + d2t.astype(np.int64)   # before any narrowing cast
    if ids.min(initial=0) < 0 or ids.max(initial=0) >= config.vocab_size:
        bad = int(np.flatnonzero((ids < 0) | (ids >= config.vocab_size))[0])
        raise ValueError(f"tensor 'd2t': draft id {bad} maps to target id {int(ids[bad])}, outside the vocabulary "
                         f"(0..{config.vocab_size - 1})")
    if len(np.unique(ids)) != len(ids):
        raise ValueError("tensor 'd2t': two draft ids map to the same target id")
    if t2d is not None and (t2d.sum() != len(ids) or not t2d[ids].all()):
        raise ValueError("tensor 't2d' disagrees with 'd2t': it must mark exactly the target ids "
                         "arange(draft_vocab) + d2t")


def draft_to_target_ids(d2t) -> np.ndarray:
    """``d2t`` offsets (numpy-convertible, ``[draft_vocab]``) -> target id of each draft id, int32."""
    d2t = np.asarray(d2t).astype(np.int64)
    return (np.arange(d2t.shape[0], dtype=np.int64) + d2t).astype(np.int32)


# -- the draft's cache and plans -----------------------------------------------------------

def draft_pool_layout(config: Eagle3Config, num_slots: int, dtype: str, *, kv_cache_dtype: str = "auto",
                      kv_layout: str = "HND") -> PoolLayout:
    """The draft's own pool: one dense layer of its KV heads, ``num_slots`` slots like the target's
    pool, so the scheduler's slot ids and block tables address both pools."""
    return PoolLayout.create(num_slots, sparse=[False], num_kv_heads=config.num_key_value_heads,
                             head_dim=config.head_dim, kv_layout=kv_layout, dtype=dtype,
                             kv_cache_dtype=kv_cache_dtype)


def draft_step_config(config: Eagle3Config, target: StepConfig) -> StepConfig:
    """The planner config of the draft: its heads, the target planner's batch, token and block limits
    (a draft step runs the tokens of a target step, or one token per generation row)."""
    return dataclasses.replace(target, num_q_heads=config.num_attention_heads,
                               num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim)


# -- a random draft in the published format ------------------------------------------------

def write_random_eagle3(path, target: M3TextConfig, *, seed: int = 0, dtype: str = "float32",
                        hidden_size: int | None = None, num_attention_heads: int | None = None,
                        num_key_value_heads: int | None = None, head_dim: int | None = None,
                        intermediate_size: int | None = None, draft_vocab_size: int | None = None,
                        aux_layer_ids: Sequence[int] | None = None, names: str = "midlayer",
                        ids_in: str = "eagle_config", with_embedding: bool = True, with_lm_head: bool = True,
                        norm_before_residual: bool = False, rope_scaling: Mapping | None = None) -> Path:
    """Write a random-weight EAGLE-3 draft for ``target`` to directory ``path`` (created) -> ``Path(path)``.

    Shapes default to a full-MHA head of the target's size (M3: hidden 6144, 64
    heads of 128, as the published M3 drafts). ``draft_vocab_size`` < the
    target's vocabulary writes a compressed head with ``d2t``/``t2d`` (random hot
    ids, sorted). names: "midlayer" (SpecForge: ``midlayer.*``), "layers"
    (``layers.0.*``) or "model" (``model.layers.0.*``, ``model.fc.weight`` ...).
    ids_in: where ``aux_layer_ids`` go: "eagle_config", "top" (top-level key) or
    "none" (left out: the defaults apply). Weights: linear ~ N(0, 1 / fan_in),
    norms ~ 1 + N(0, 0.1), embedding ~ N(0, 1): logits of order 1.
    """
    from safetensors.numpy import save_file

    if names not in ("midlayer", "layers", "model"):
        raise ValueError(f"names: expected 'midlayer', 'layers' or 'model', got {names!r}")
    if ids_in not in ("eagle_config", "top", "none"):
        raise ValueError(f"ids_in: expected 'eagle_config', 'top' or 'none', got {ids_in!r}")
    hidden = hidden_size or target.hidden_size
    heads = num_attention_heads or target.num_attention_heads
    draft_vocab = draft_vocab_size or target.vocab_size
    ids = tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(target.num_hidden_layers)
    config = Eagle3Config(
        hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=num_key_value_heads or heads,
        head_dim=head_dim or target.head_dim, intermediate_size=intermediate_size or 3 * hidden,
        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta, vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab, target_hidden_size=target.hidden_size, aux_layer_ids=ids,
        norm_before_residual=norm_before_residual, has_embedding=with_embedding, has_lm_head=with_lm_head,
        has_d2t=draft_vocab < target.vocab_size, max_position_embeddings=target.max_position_embeddings,
        dtype=dtype)
    rng = np.random.default_rng(seed)
    tensors = _random_tensors(config, rng)
    np_dtype = _numpy_dtype(dtype)
    tensors = {_stored_name(n, names): np.ascontiguousarray(t if t.dtype.kind in "biu" else t.astype(np_dtype))
               for n, t in tensors.items()}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("*.safetensors"):
        old.unlink()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(_config_json(config, ids_in, rope_scaling), indent=2))
    return path


def _random_tensors(c: Eagle3Config, rng: np.random.Generator) -> dict[str, np.ndarray]:
    def linear(*shape):
        return rng.standard_normal(shape) / np.sqrt(shape[-1])

    def norm():
        return 1.0 + 0.1 * rng.standard_normal(c.hidden_size)

    tensors = {name: (norm() if len(shape) == 1 else linear(*shape))
               for name, shape in expected_eagle3_shapes(c).items() if name not in OPTIONAL}
    if c.has_embedding:
        tensors["embed_tokens.weight"] = rng.standard_normal((c.vocab_size, c.hidden_size))
    if c.has_lm_head:
        tensors["lm_head.weight"] = linear(c.draft_vocab_size, c.hidden_size)
    if c.has_d2t:
        hot = np.sort(rng.choice(c.vocab_size, c.draft_vocab_size, replace=False))
        tensors["d2t"] = (hot - np.arange(c.draft_vocab_size)).astype(np.int64)
        t2d = np.zeros(c.vocab_size, dtype=bool)
        t2d[hot] = True
        tensors["t2d"] = t2d
    return tensors


def _stored_name(name: str, names: str) -> str:
    if names == "midlayer":
        return name.replace(LAYER, "midlayer.", 1)
    if names == "model" and name not in ("lm_head.weight", "d2t", "t2d"):
        return "model." + name
    return name


def _config_json(c: Eagle3Config, ids_in: str, rope_scaling: Mapping | None) -> dict:
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "rope_scaling": None if rope_scaling is None else dict(rope_scaling),
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": c.norm_before_residual, "tie_word_embeddings": False, "attention_bias": False,
        "torch_dtype": c.dtype,
    }
    ids = list(c.aux_layer_ids)
    if ids_in == "eagle_config":
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    elif ids_in == "top":
        config["eagle_aux_hidden_state_layer_ids"] = ids
    return config


def _numpy_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes  # installed with JAX (not a dependency of the package); only bfloat16 needs it
        return ml_dtypes.bfloat16
    if dtype not in ("float32", "float16"):
        raise ValueError(f"dtype: expected 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return np.dtype(dtype)
