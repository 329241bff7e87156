"""The framework-neutral MiniMax-M3 engine (vLLM's API): config and checkpoint reading, the
tensor-parallel plan, the scheduler, sampling parameters, text, the engine loop, the CLI and
the OpenAI-compatible server. A framework supplies only a runner (``m3_engine.runner``):
``m3_torch.LLM`` and ``m3_jax.LLM`` are this package's ``LLM`` over their runners.

Imports no framework: each framework's runner and ``LLM`` sit on top of the engine (they
implement its runner protocol), and :func:`engine_class` is the one place that reaches one, by
name, at run time.
"""

import importlib

from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics", "engine_class"]


def engine_class(framework: str):
    """``m3_torch.LLM`` or ``m3_jax.LLM`` for ``framework`` "torch" or "jax" (its package is imported now)."""
    if framework not in ("torch", "jax"):
        raise ValueError(f"framework: expected 'torch' or 'jax', got {framework!r}")
    return importlib.import_module(f"m3_{framework}.llm").LLM
