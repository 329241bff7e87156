"""``load_format="dummy"``: random weights of a config's shapes, made on the device (vLLM's meaning).

vLLM's ``load_format="dummy"`` builds the model from ``config.json`` alone and
fills its weights with random values: an engine can then be measured and
profiled at a model's real shapes without its checkpoint (MiniMax-M3's is
hundreds of GB). Here each framework's runner draws the tensors of
:func:`m3_engine.checkpoint.expected_shapes` on its own device (torch: a
seeded ``torch.Generator`` on the device, ``m3_torch.dummy_weights``; JAX:
``jax.random`` under ``jax.jit``, ``m3_jax.dummy_weights``), from the list
:func:`dummy_tensors` gives: name, shape (one rank's slice under tensor
parallelism), standard deviation and seed of each tensor. Nothing is read
from disk but ``config.json`` (and, when present, the tokenizer and
``generation_config.json``).

Scales (those of ``m3_engine.tiny_model``'s random checkpoints), chosen so
that every layer adds O(1) to the residual stream and the logits are neither
flat nor one-hot, in bfloat16, through all the layers:

* linear weights ``[.., out, in]``: N(0, 1 / in), so a projection keeps the
  rms of its input (the routed experts' ``[E, out, in]`` too);
* norm weights: N(0, 0.1^2), near 0: the model's RMSNorm scales by ``1 + w``;
* the router's ``e_score_correction_bias``: N(0, 0.1^2), small beside the
  sigmoid weights it is added to (the choice of experts stays near uniform);
* ``embed_tokens``: N(0, 1), rows of rms 1.

Seeds: a tensor is drawn from a generator seeded with a hash of the engine's
``seed``, the tensor's name and the index ranges of the slice a rank holds
(``m3_engine.tp``). So the same seed gives the same weights in one framework
at one tensor-parallel size; what a rank replicates (embeddings, norms, the
router, the index-K projection) is equal on every rank, and ranks that share
a KV head hold the same k/v rows. A rank's slice is drawn on its own: it is
not the slice of the TP=1 model's tensor, and torch and JAX draw different
numbers (different generators). Framework-neutral: no torch, no jax.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Collection, Optional

from .checkpoint import expected_shapes
from .model_config import M3TextConfig
from .tp import RankShard

__all__ = ["LOAD_FORMATS", "check_load_format", "DummyTensor", "dummy_tensors", "dummy_dtype"]

LOAD_FORMATS = ("auto", "dummy")   # auto: read the checkpoint's safetensors; dummy: random weights
NORM_STD = 0.1                     # norm weights and the router bias
DEFAULT_DTYPE = "float32"          # a config without a dtype (transformers' default)


def check_load_format(value) -> str:
    """``value`` if it is one of :data:`LOAD_FORMATS`, else a ``ValueError`` listing them."""
    if not isinstance(value, str) or value not in LOAD_FORMATS:
        raise ValueError(f"load_format: expected one of {LOAD_FORMATS}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class DummyTensor:
    """One random tensor: ``N(0, std^2)`` of ``shape``, drawn from a generator seeded with ``seed``."""
    name: str
    shape: tuple[int, ...]   # this rank's part of the tensor
    std: float
    seed: int                # in [0, 2**63)


def dummy_dtype(dtype: Optional[str], config: M3TextConfig) -> str:
    """The dtype of dummy weights: the engine's ``dtype`` option, else config.json's, else float32."""
    return dtype or config.dtype or DEFAULT_DTYPE


def dummy_tensors(config: M3TextConfig, seed: int, *, shard: Optional[RankShard] = None,
                  skip: Collection[str] = ()) -> list[DummyTensor]:
    """Every tensor the model needs (as ``checkpoint.iter_weights`` yields them), as random specs.

    seed:  the engine's seed.
    shard: one tensor-parallel rank (``TPPlan(config, tp).rank(r)``): its slices (the vocabulary
           tensors' padding rows drawn too: no token reads them); None: whole tensors.
    skip:  canonical names to leave out (``lm_head.weight`` on a rank without the head). A tied
           ``lm_head`` is always left out: the embedding is the head.
    """
    out = []
    for name, shape in expected_shapes(config).items():
        if name in skip or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        cut = None if shard is None else shard.slice(name)
        held = shape if shard is None else shard.shape(name, shape)
        out.append(DummyTensor(name=name, shape=held, std=_std(name, shape),
                               seed=tensor_seed(seed, name, None if cut is None else cut.ranges)))
    return out


def tensor_seed(seed: int, name: str, ranges=None) -> int:
    """A seed in [0, 2**63) for tensor ``name`` (``ranges``: the slice a rank holds, None: whole)."""
    digest = zlib.crc32(f"{name}|{ranges}".encode())
    return (seed * 0x9E3779B97F4A7C15 + digest) % (1 << 63)


def _std(name: str, shape: tuple) -> float:
    if name.endswith(("norm.weight", "e_score_correction_bias")):
        return NORM_STD
    if name == "model.embed_tokens.weight":
        return 1.0
    return shape[-1] ** -0.5   # linear [.., out, in]: N(0, 1 / fan_in)
