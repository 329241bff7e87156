"""FP8 weights: which tensors are quantized, the checkpoint formats, the tensor-parallel block rule.

The engines run one weight format, ``quantization="fp8"``: each quantized
linear weight ``[..., N, K]`` is held as ``float8_e4m3fn`` codes and float32
scales ``[..., ceil(N / 128), ceil(K / 128)]``, one per 128 x 128 block, with
``W ~= codes * scale`` (DeepSeek-V3 / vLLM ``weight_block_size: [128, 128]``;
the kernels are ``m3_torch.fp8`` / ``m3_jax.fp8``). Quantized: the attention
projections (q/k/v/o and the indexer's q/k), the dense MLP, the routed experts
and the shared expert (:func:`is_quantized`); the router, norms, embeddings and
lm_head stay in the model dtype.

Where the FP8 weights come from (``config.json``'s ``quantization_config``):

* no ``quantization_config`` and ``quantization="fp8"``: the checkpoint's
  tensors are quantized at load, one tensor at a time on its device
  (:func:`load_stream` with the framework's ``quantize_weight``);
* ``quant_method: "fp8"`` with ``weight_block_size: [128, 128]``: stored as
  ``<name>`` (e4m3) + ``<name>_scale_inv`` (float32 block scales), loaded as is;
* ``quant_method: "mxfp8"``: e4m3 codes with one power-of-two scale (UE8M0: a
  uint8 biased exponent, ``2 ** (e - 127)``) per 1 x 32 block along K, stored
  as ``<name>`` + ``<name>_scale``; converted at load: dequantized
  (``codes * 2 ** (e - 127)``, exact in float32), then requantized to 128 x 128
  blocks.

Scale tensors are named after their weight (:data:`SCALE_SUFFIXES`): a
canonical ``...q_proj.weight`` has ``...q_proj.weight_scale_inv``, the
experts' ``...experts.gate_up_proj`` has ``...experts.gate_up_proj_scale_inv``
(transformers' FP8 naming of fused experts); stored per-expert pieces
(``experts.{e}.w1.weight_scale_inv``) merge like their weights.

Tensor parallelism: every rank must hold whole 128 x 128 blocks of every
quantized tensor (:func:`check_fp8_shapes`), so a rank's scales are the block
range of its slice (:func:`scale_slice`).

Framework-neutral: no torch, no jax.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from m3_kernels.maps import FP8_BLOCK, MX_BLOCK

from .model_config import read_json
from .tp import TensorSlice, TPPlan

__all__ = ["SUPPORTED_QUANTIZATION", "CHECKPOINT_METHODS", "FP8_BLOCK", "MX_BLOCK", "SCALE_SUFFIXES",
           "is_quantized", "is_scale", "weight_name", "scale_name", "checkpoint_quantization",
           "resolve_quantization", "check_fp8_shapes", "scale_shape", "scale_slice", "load_stream"]

SUPPORTED_QUANTIZATION = ("fp8",)          # the engine option's values (vLLM's names)
CHECKPOINT_METHODS = ("fp8", "mxfp8")      # quantization_config.quant_method values the loader reads
# checkpoint method -> the suffix of its scale tensors' names (appended to the weight's name)
SCALE_SUFFIXES = {"fp8": "_scale_inv", "mxfp8": "_scale"}

_QUANTIZED = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj\.weight|self_attn\.indexer\.(q|k)_proj\.weight"
    r"|mlp\.(gate_up_proj|down_proj)\.weight|mlp\.shared_experts\.(gate_up_proj|down_proj)\.weight"
    r"|mlp\.experts\.(gate_up_proj|down_proj))$")


def is_quantized(name: str) -> bool:
    """Whether canonical weight ``name`` is FP8 in a quantized model (a linear weight, not the router)."""
    return bool(_QUANTIZED.match(name))


def is_scale(name: str) -> bool:
    """Whether ``name`` is the scale tensor of a quantized weight (either checkpoint method's)."""
    return weight_name(name) != name


def weight_name(name: str) -> str:
    """The weight a scale tensor belongs to (``name`` itself when it is no scale)."""
    for suffix in SCALE_SUFFIXES.values():
        if name.endswith(suffix) and is_quantized(name[:-len(suffix)]):
            return name[:-len(suffix)]
    return name


def scale_name(name: str, method: str = "fp8") -> str:
    """The name of weight ``name``'s scale tensor in a ``method`` checkpoint (the engine's: ``"fp8"``)."""
    return name + SCALE_SUFFIXES[method]


def checkpoint_quantization(model_dir) -> Optional[str]:
    """The quantization of a model folder's weights: None, ``"fp8"`` (128 x 128 blocks) or ``"mxfp8"``,
    from ``config.json``'s ``quantization_config`` (top level, or under ``text_config``)."""
    outer = read_json(Path(model_dir) / "config.json")
    q = outer.get("quantization_config")
    if q is None and isinstance(outer.get("text_config"), dict):
        q = outer["text_config"].get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"config.json: quantization_config.quant_method: expected one of {CHECKPOINT_METHODS}, "
                         f"got {method!r}")
    if method == "fp8" and list(q.get("weight_block_size") or []) != [FP8_BLOCK, FP8_BLOCK]:
        raise ValueError(f"config.json: quantization_config.weight_block_size: expected [128, 128] (block-scaled "
                         f"FP8), got {q.get('weight_block_size')!r}")
    return method


def resolve_quantization(option: Optional[str], checkpoint: Optional[str]) -> Optional[str]:
    """The engine's ``quantization`` option and the checkpoint's method -> the weight format the engine runs
    (None or ``"fp8"``). Unset: as the checkpoint says (an FP8 or MXFP8 checkpoint runs as ``"fp8"``)."""
    if option is not None and option not in SUPPORTED_QUANTIZATION:
        raise ValueError(f"quantization: expected None (unquantized weights, or as the checkpoint says) or one "
                         f"of {SUPPORTED_QUANTIZATION}, got {option!r}")
    if checkpoint is None:
        return option
    if option is not None and not (option == "fp8" and checkpoint in ("fp8", "mxfp8")):
        raise ValueError(f"quantization: {option!r} does not match the checkpoint's quantization_config "
                         f"(quant_method {checkpoint!r})")
    return "fp8"


def check_fp8_shapes(plan: TPPlan, shapes: dict) -> None:
    """Every quantized tensor of ``shapes`` (canonical name -> whole shape) must give each rank of ``plan``
    whole 128 x 128 blocks: its slice's last two dimensions multiples of 128 (the TP split then falls on
    block edges, the fused q/k/v GEMM concatenates whole blocks, the MoE kernels get H and I in blocks)."""
    for name, shape in shapes.items():
        if not is_quantized(name):
            continue
        local = plan.rank(0).shape(name, shape)
        if local[-2] % FP8_BLOCK or local[-1] % FP8_BLOCK:
            where = (f"a rank's slice of it (tensor_parallel_size={plan.size}) is {local[-2:]}" if plan.size > 1
                     else f"it is {local[-2:]}")
            raise ValueError(f"quantization='fp8': tensor {name!r} must split into whole 128 x 128 blocks per "
                             f"rank, but {where}" + (" (use a tensor_parallel_size that keeps whole blocks)"
                                                     if plan.size > 1 else ""))


def scale_shape(shape, method: str = "fp8") -> tuple:
    """The scale tensor's shape of a weight of ``shape`` in a ``method`` checkpoint."""
    *lead, n, k = shape
    if method == "mxfp8":
        return (*lead, n, -(-k // MX_BLOCK))
    return (*lead, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))


def scale_slice(cut: Optional[TensorSlice], ndim: int, method: str = "fp8") -> Optional[TensorSlice]:
    """A rank's slice of a scale tensor from its weight's slice ``cut`` (``ndim``: the weight's rank).
    The weight's ranges must fall on block edges (:func:`check_fp8_shapes`)."""
    if cut is None:
        return None
    block = MX_BLOCK if method == "mxfp8" else FP8_BLOCK
    blocked_dims = (ndim - 1,) if method == "mxfp8" else (ndim - 2, ndim - 1)
    if cut.dim not in blocked_dims:
        return cut   # a leading axis (experts), or MXFP8's rows: the scales' slice is the weight's
    if any(start % block or stop % block for start, stop in cut.ranges):
        raise ValueError(f"scale slice: the weight's ranges {cut.ranges} split a block of {block}")
    return TensorSlice(cut.dim, tuple((start // block, stop // block) for start, stop in cut.ranges))


def load_stream(weights: Iterator[tuple[str, Any]], *, checkpoint: Optional[str], quantization: Optional[str],
                quantize: Callable, dequantize_mxfp8: Callable) -> Iterator[tuple[str, Any]]:
    """The loader's ``(canonical name, tensor)`` stream (``checkpoint.iter_weights``: a quantized weight, then
    its scale) -> the engine's: with ``quantization="fp8"`` each quantized weight as its e4m3 codes, then
    ``scale_name(name)``'s float32 block scales; everything else as read.

    checkpoint:       the checkpoint's method (None, "fp8", "mxfp8").
    quantization:     the engine's (:func:`resolve_quantization`).
    quantize:         the framework's ``quantize_weight(w) -> (codes, scale)``, run where ``w`` is (its device).
    dequantize_mxfp8: the framework's ``(codes, e8m0 scales) -> float32 weight``.
    """
    if quantization is None:
        yield from weights
        return
    pending = None   # an MXFP8 weight's codes, waiting for its scales
    for name, w in weights:
        if checkpoint == "fp8" or not (is_quantized(name) or is_scale(name)):
            yield name, w
        elif checkpoint is None:
            codes, scale = quantize(w)
            yield name, codes
            yield scale_name(name), scale
        elif not is_scale(name):
            pending = w
        else:
            codes, scale = quantize(dequantize_mxfp8(pending, w))
            pending = None
            yield weight_name(name), codes
            yield scale_name(weight_name(name)), scale
