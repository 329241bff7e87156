"""The framework-neutral MiniMax-M3 engine (vLLM's API): config and checkpoint reading, the
tensor-parallel plan, the scheduler, sampling parameters, text, the engine loop, the CLI and
the OpenAI-compatible server. A framework supplies only a runner (``m3_engine.runner``):
``m3_torch.LLM`` and ``m3_jax.LLM`` are this package's ``LLM`` over their runners.

Imports no framework: each framework's runner and ``LLM`` sit on top of the engine (they
implement its runner protocol), and :func:`load_class` (through :func:`engine_class`, or given
``"module:Name"`` by the server's engine process) is the one place that reaches one, by name, at
run time.
"""

import importlib

from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics", "engine_class",
           "load_class"]


def engine_class(framework: str):
    """``m3_torch.LLM`` or ``m3_jax.LLM`` for ``framework`` "torch" or "jax" (its package is imported now)."""
    if framework not in ("torch", "jax"):
        raise ValueError(f"framework: expected 'torch' or 'jax', got {framework!r}")
    return load_class(f"m3_{framework}.llm:LLM")


def load_class(spec: str):
    """The class that ``spec``, ``"module:Name"``, names (the module is imported now), e.g.
    ``"m3_torch:LLM"``: how ``m3-serve``'s engine process finds its ``LLM`` class."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"spec: expected 'module:Name', got {spec!r}")
    return getattr(importlib.import_module(module), name)
