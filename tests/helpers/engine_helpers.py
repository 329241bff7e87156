"""Shared by the model tests: greedy (or seeded) generation as lists of token ids."""

import time

import numpy as np

from m3_engine import SamplingParams
from m3_engine.buckets import StepBuckets
from m3_engine.llm import LLM
from m3_engine.runner import SampleResult


def generate_ids(llm, prompts, max_new_tokens=16, *, temperature=0.0, top_p=1.0, seed=None, **params):
    """``llm.generate`` with one ``SamplingParams`` for every prompt -> the new token ids per prompt
    (greedy by default, as the model comparisons with transformers need)."""
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, **params)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


# -- a model runner without a model, for the server's in-process tests (test_serve.py) ---------------

FAIL_SEED = 990_000   # a request seeded FAIL_SEED + k makes the step that samples its token k fail


class FakeRunner:
    """Instant steps: token = 3 + (seed + 7 * index) % (vocab - 3); the sampled token's logprob is
    -temperature (so a test sees the temperature that reached the runner). A row seeded
    ``FAIL_SEED + k`` makes the step sampling its token ``k`` raise. Runs in the engine process of
    ``m3-serve``: tests steer it through requests only."""

    def __init__(self, args):
        self.vocab = args.config.vocab_size
        self.scheduler_config = args.scheduler
        self.buckets = StepBuckets.from_config(args.scheduler, args.speculative, pad_prefill=False, pad_decode=False)

    def execute(self, step, sampling):
        time.sleep(0.005)
        if np.any(sampling.seeds - sampling.counters == FAIL_SEED):
            raise RuntimeError("injected step failure")
        tokens = (3 + (sampling.seeds + 7 * sampling.counters) % (self.vocab - 3)).astype(np.int32)
        rows = len(tokens)
        n = sampling.num_logprobs
        top = None if n is None else (tokens[:, None] + np.arange(max(n, 1))[None]) % self.vocab
        return SampleResult(tokens=tokens, logprobs=-sampling.temperature.astype(np.float32),
                            top_ids=top, top_logprobs=None if n is None else np.full(top.shape, -0.5, np.float32),
                            ranks=None if n is None else np.ones(rows, np.int32))

    def close(self):
        pass


class FakeLLM(LLM):
    """``LLM`` over :class:`FakeRunner` (``"engine_helpers:FakeLLM"`` for the server's ``EngineClient``)."""
    framework = "fake"

    @classmethod
    def _runner_class(cls):
        return FakeRunner
