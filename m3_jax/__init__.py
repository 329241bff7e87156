"""JAX API of the MiniMax-M3 MSA kernels.

The same Triton kernels and launch descriptions as ``m3_torch``: compiled
through jax-triton on a GPU backend, run by Triton's interpreter inside
``jax.pure_callback`` on a CPU backend. Every op works under ``jax.jit``.
See SPEC.md for what each op computes.

``import m3_jax`` loads the ops and the kernels only. The engine-level names
``LLM``, ``SamplingParams``, ``RequestOutput`` and ``CompletionOutput`` come
from the floors above the ops (``m3_engine``, and the JAX runner's
``m3_jax.llm``) and are imported on first use: ``from m3_jax import LLM``
loads the engine and the model then.
"""

import importlib

try:
    import jax  # noqa: F401  (first: without JAX, name the extra that installs it)
except ModuleNotFoundError as exc:
    if exc.name not in ("jax", "jaxlib"):
        raise
    raise ModuleNotFoundError("m3_jax needs JAX: pip install 'm3-msa-kernels[jax]' (on an NVIDIA GPU: [cuda12] or "
                              "[cuda13]; on a CPU also [torch], whose CPU tensors the interpreted kernels run on)",
                              name="jax") from None

from . import cache, interop, ops, reference
from .api import (StepSpec, dense_decode, dense_prefill, index_scores, index_scores_prefill, msa_attention_step,
                  msa_decode, msa_prefill, select_blocks, select_blocks_prefill, sparse_decode, sparse_prefill,
                  step_inputs)
from .cache import allocate_pool, layer_views, write_cache, write_layer
from .interop import StepMetadata, to_jax, to_torch
from .ops import PrefillMaps, prefill_maps
from .moe import fused_moe
from .sampling import sample
from .fused import add_rms_norm, moe_route, qk_norm_rope, rms_norm
from .views import PagedView, as_index_k_view, as_kv_view, index_k_view, kv_cache_view

# the engine-level names: name -> the module above the ops that defines it, imported by __getattr__ on first use
_ENGINE_NAMES = {"LLM": "m3_jax.llm", "SamplingParams": "m3_engine", "RequestOutput": "m3_engine",
                 "CompletionOutput": "m3_engine"}

__all__ = ["index_scores", "select_blocks", "sparse_decode", "dense_decode", "msa_decode",
           "index_scores_prefill", "select_blocks_prefill", "sparse_prefill", "dense_prefill", "msa_prefill",
           "PrefillMaps", "prefill_maps", "msa_attention_step", "StepSpec", "step_inputs",
           "PagedView", "kv_cache_view", "index_k_view", "as_kv_view", "as_index_k_view",
           "cache", "allocate_pool", "layer_views", "write_cache", "write_layer",
           "interop", "StepMetadata", "to_jax", "to_torch", "ops", "reference", "sample", "fused_moe",
           "add_rms_norm", "rms_norm", "moe_route", "qk_norm_rope", *_ENGINE_NAMES]


def __getattr__(name: str):
    if name not in _ENGINE_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_ENGINE_NAMES[name]), name)
    globals()[name] = value   # later lookups find it without coming here
    return value


def __dir__():
    return sorted(set(globals()) | set(_ENGINE_NAMES))
