"""PyTorch API of the MiniMax-M3 MSA kernels.

See SPEC.md / README.md for what each op computes. CUDA tensors run the
compiled Triton kernels; CPU tensors run the same kernels in Triton's
interpreter. The ``torch.ops.m3.*`` custom ops behind these functions are
internal (``m3_torch.ops``; their signatures may change).

``import m3_torch`` loads the ops and the kernels only. The engine-level names
``LLM``, ``SamplingParams``, ``RequestOutput`` and ``CompletionOutput`` come
from the floors above the ops (``m3_engine``, and the torch runner's
``m3_torch.llm``) and are imported on first use: ``from m3_torch import LLM``
loads the engine and the model then.
"""

import importlib

try:
    import torch  # noqa: F401  (first: without PyTorch, name the extra that installs it)
except ModuleNotFoundError as exc:
    if exc.name != "torch":
        raise
    raise ModuleNotFoundError("m3_torch needs PyTorch: pip install 'm3-msa-kernels[torch]'", name="torch") from None

from . import cache, ops, reference
from .api import (dense_decode, dense_prefill, index_scores, index_scores_prefill, msa_attention_step, msa_decode,
                  msa_prefill, prefill_plan, select_blocks, select_blocks_prefill, sparse_decode, sparse_prefill)
from .cache import allocate_pool, layer_caches, write_cache
from .ops import StepArena, step_arena
from .moe import fused_moe
from .sampling import sample
from .fused import add_rms_norm, moe_route, qk_norm_rope, rms_norm

# the engine-level names: name -> the module above the ops that defines it, imported by __getattr__ on first use
_ENGINE_NAMES = {"LLM": "m3_torch.llm", "SamplingParams": "m3_engine", "RequestOutput": "m3_engine",
                 "CompletionOutput": "m3_engine"}

__all__ = ["index_scores", "select_blocks", "sparse_decode", "dense_decode", "msa_decode",
           "index_scores_prefill", "select_blocks_prefill", "sparse_prefill", "dense_prefill", "msa_prefill",
           "msa_attention_step", "prefill_plan", "StepArena", "step_arena",
           "cache", "allocate_pool", "layer_caches", "write_cache", "ops", "reference", "sample", "fused_moe",
           "add_rms_norm", "rms_norm", "moe_route", "qk_norm_rope", *_ENGINE_NAMES]


def __getattr__(name: str):
    if name not in _ENGINE_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_ENGINE_NAMES[name]), name)
    globals()[name] = value   # later lookups find it without coming here
    return value


def __dir__():
    return sorted(set(globals()) | set(_ENGINE_NAMES))
