"""The framework-neutral MiniMax-M3 engine (vLLM's API): config and checkpoint reading, the
tensor-parallel plan, the scheduler, sampling parameters, text, the engine loop, the CLI and
the OpenAI-compatible server. A framework supplies only a runner (``m3_engine.runner``):
``m3_torch.LLM`` and ``m3_jax.LLM`` are this package's ``LLM`` over their runners.

Imports no framework: ``m3_torch`` / ``m3_jax`` are chosen by name at run time.
"""

from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics", "engine_class"]


def engine_class(framework: str):
    """``m3_torch.LLM`` or ``m3_jax.LLM``, imported on first use."""
    if framework == "torch":
        from m3_torch import LLM
    elif framework == "jax":
        from m3_jax import LLM
    else:
        raise ValueError(f"framework: expected 'torch' or 'jax', got {framework!r}")
    return LLM
