"""``m3_torch.LLM``: the engine of ``m3_engine`` over the torch runner (``m3_torch.runner``).

    from m3_torch import LLM, SamplingParams
    llm = LLM("path/to/model", dtype="bfloat16")
    print(llm.generate("Hello", SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text)

Options, methods and outputs: ``m3_engine.llm.LLM``. torch specifics: CUDA
graphs replay pure decode steps on a GPU (``enforce_eager=True`` turns them
off); tensor parallelism spawns ``tensor_parallel_size - 1`` worker processes
(a script needs the ``if __name__ == "__main__":`` guard).
"""

from m3_engine.llm import LLM as _EngineLLM

# imported with this module, not from inside LLM(): a first import under the constructor's frame can leave
# that frame in a reference cycle (torch.fx.wrap, run by torch._dynamo's import, does), and a dropped LLM
# would then keep its pool until the garbage collector runs
from .runner import TorchRunner

__all__ = ["LLM"]


class LLM(_EngineLLM):
    framework = "torch"

    @classmethod
    def _runner_class(cls):
        return TorchRunner
