"""Shared by the model tests: greedy (or seeded) generation as lists of token ids; the server tests'
fake runner (:class:`FakeLLM`, which ``m3-serve``'s engine process runs in their servers)."""

import time

import numpy as np

from m3_engine import SamplingParams
from m3_engine.buckets import StepBuckets
from m3_engine.llm import LLM
from m3_engine.runner import SampleResult, SynchronousRunner
from m3_engine.tokenizer import Tokenizer


def generate_ids(llm, prompts, max_new_tokens=16, *, temperature=0.0, top_p=1.0, seed=None, **params):
    """``llm.generate`` with one ``SamplingParams`` for every prompt -> the new token ids per prompt
    (greedy by default, as the model comparisons with transformers need)."""
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, **params)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


# -- a model runner without a model, for the server's fake-runner tests (tests/server/test_serve.py) --

FAIL_SEED = 990_000   # a request seeded FAIL_SEED + k makes the step that samples its token k fail
SAY, END_SAY = "[[say]]", "[[/say]]"


def say(text: str) -> str:
    """Prompt text (a completion prompt, or part of a chat message) that makes :class:`FakeRunner`
    answer ``text``: its tokens, then eos."""
    return f"{SAY}{text}{END_SAY}"


def fake_prompt_logprob(rank):
    """:class:`FakeRunner`'s logprob of the prompt token of this rank."""
    return -0.25 * rank


class FakeRunner(SynchronousRunner):
    """Instant steps: token = 3 + (seed + 7 * index) % (vocab - 3). A row under a structured-outputs
    token bitmask takes the allowed token number (seed + 7 * index) % (how many are allowed) instead
    (a walk through the grammar, as random weights would take). A request whose prompt holds
    ``say(text)`` answers ``text``'s tokens (``tokenizer.encode(text, add_special_tokens=False)``),
    then eos, whatever the bitmask. The sampled token's logprob is -temperature (so a test sees the
    temperature that reached the runner). A prompt token t asked for its logprobs with top-N ranks
    N + 1 with logprob -0.25 (N + 1), after the N ids that follow it (t + 1, t + 2, ... mod vocab) with
    -0.25, -0.5, ... (:func:`fake_prompt_logprob`). A row seeded ``FAIL_SEED + k`` makes the step sampling its
    token ``k`` raise. Runs in the engine process of ``m3-serve``: tests steer it through requests
    only."""

    def __init__(self, args):
        self.vocab = args.config.vocab_size
        self.scheduler_config = args.scheduler
        self.buckets = StepBuckets.from_config(args.scheduler, args.speculative, pad_prefill=False, pad_decode=False)
        self.eos = args.config.eos_token_ids[0]
        self.tokenizer = Tokenizer(args.model_dir)
        self.scripts: dict = {}   # scheduler request id -> the token ids its prompt says, or None
        self.on_gpu = False   # precompile off by default: warm_up is never called

    def execute(self, step, sampling):
        time.sleep(0.005)
        if np.any(sampling.seeds - sampling.counters == FAIL_SEED):
            raise RuntimeError("injected step failure")
        walk = sampling.seeds + 7 * sampling.counters
        tokens = (3 + walk % (self.vocab - 3)).astype(np.int32)
        if sampling.token_bitmask is not None:
            bits = np.unpackbits(sampling.token_bitmask.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab]
            for row, allowed in enumerate(bits):
                if not allowed.all():
                    choices = np.flatnonzero(allowed)
                    tokens[row] = choices[walk[row] % len(choices)]
        requests = [r for (r, _), count in zip(step.rows, step.num_logits.tolist()) for _ in range(count)]
        for row, (request, index) in enumerate(zip(requests, sampling.counters.tolist())):
            script = self._script(request)
            if script is not None:
                tokens[row] = script[index] if index < len(script) else self.eos
        rows = len(tokens)
        n = sampling.num_logprobs
        top = None if not n else (tokens[:, None] + np.arange(n)[None]) % self.vocab   # N = 0: none, as the runners
        prompt = {}
        if sampling.prompt_targets is not None:
            targets, k = sampling.prompt_targets, sampling.num_prompt_logprobs
            prompt = dict(prompt_logprobs=np.full(len(targets), fake_prompt_logprob(k + 1), np.float32),
                          prompt_ranks=np.full(len(targets), k + 1, np.int32),
                          prompt_top_ids=((targets[:, None] + 1 + np.arange(k)[None]) % self.vocab).astype(np.int32),
                          prompt_top_logprobs=np.tile(fake_prompt_logprob(np.arange(1, k + 1)), (len(targets), 1))
                          .astype(np.float32))
        return SampleResult(tokens=tokens, logprobs=-sampling.temperature.astype(np.float32),
                            top_ids=top, top_logprobs=None if not n else np.full(top.shape, -0.5, np.float32),
                            ranks=None if n is None else np.ones(rows, np.int32), **prompt)

    def _script(self, request):
        """The token ids ``say(text)`` in the request's prompt asks for, or None."""
        if request.id not in self.scripts:
            prompt = self.tokenizer.decode(request.prompt.tolist(), skip_special_tokens=False)
            start = prompt.find(SAY)
            script = None
            if start >= 0:
                text = prompt[start + len(SAY):prompt.index(END_SAY, start)]
                script = self.tokenizer.encode(text, add_special_tokens=False)
            self.scripts[request.id] = script
        return self.scripts[request.id]

    def close(self):
        pass


class FakeLLM(LLM):
    """``LLM`` over :class:`FakeRunner` (``"engine_helpers:FakeLLM"`` for the server's ``EngineClient``)."""
    framework = "fake"

    @classmethod
    def _runner_class(cls):
        return FakeRunner
