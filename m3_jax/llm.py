"""``m3_jax.LLM``: the engine of ``m3_engine`` over the JAX runner (``m3_jax.runner``).

    from m3_jax import LLM, SamplingParams
    llm = LLM("path/to/model", dtype="bfloat16")
    print(llm.generate("Hello", SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text)

Options, methods and outputs: ``m3_engine.llm.LLM``. JAX specifics: every step
is one jitted function (model + sampling), compiled per batch bucket;
``device`` may also be a ``jax.Device`` (or, with tensor parallelism, a list
of them); tensor parallelism is a ``Mesh`` with the model step in
``shard_map`` (on a CPU: fake devices from
``XLA_FLAGS=--xla_force_host_platform_device_count=N``, set before JAX starts).
"""

from m3_engine.llm import LLM as _EngineLLM

# imported with this module, not from inside LLM(): a first import under the constructor's frame can leave
# that frame in a reference cycle (torch.fx.wrap, run by torch._dynamo's import, does), and a dropped LLM
# would then keep its pool until the garbage collector runs
from .runner import JaxRunner

__all__ = ["LLM"]


class LLM(_EngineLLM):
    framework = "jax"

    @classmethod
    def _runner_class(cls):
        return JaxRunner
