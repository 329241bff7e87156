"""``LLMEngine``: the request loop, as vLLM's (add_request / step / abort_request).

    engine.add_request("r0", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():          # RequestOutputs of the requests that moved this step
            print(out.request_id, out.outputs[0].text, out.finished)

The engine core (``m3_engine.engine_core``: scheduler, runner, sampling, structured outputs)
and the text side (``m3_engine.output_processor``: detokenization, stop strings, logprob
entries; a request of ``n`` completions fans out into ``n`` core requests there) in one
process, the way ``LLM`` runs them. One step: the core runs the model and
hands out each request's new token ids; the output processor turns them into text and looks
for stop strings, and the requests they end are finished in the core before its EAGLE-3 draft
pass (when there is one). The engine is not thread-safe: one thread drives it. ``m3-serve``
runs the same two halves in two processes (``m3_engine.server``).
"""

from __future__ import annotations

import time
import uuid
from typing import Optional, Sequence, Union

import numpy as np

from .engine_core import EngineCore
from .output_processor import OutputProcessor
from .runner import Runner
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .tokenizer import Tokenizer

__all__ = ["LLMEngine", "PromptType"]

PromptType = Union[str, Sequence[int], dict]


class LLMEngine:
    """Requests in, ``RequestOutput``s out, over one runner.

    runner:    a framework's :class:`m3_engine.runner.Runner`.
    scheduler: the :class:`m3_engine.scheduler.Scheduler` over the runner's pool.
    tokenizer: the model folder's, or None (token-id prompts only, empty texts).
    seed:      requests without a seed draw ``seed`` mixed with their arrival number.
    generation_defaults: ``SamplingParams`` fields from ``generation_config.json`` that
               replace the fields a request leaves at their class defaults.
    async_scheduling: the core schedules each step while the previous one runs
               (``m3_engine.engine_core``).
    """

    def __init__(self, runner: Runner, scheduler: Scheduler, *, tokenizer: Optional[Tokenizer], seed: int = 0,
                 generation_defaults: Optional[dict] = None, async_scheduling: bool = False):
        self.core = EngineCore(runner, scheduler, tokenizer=tokenizer, seed=seed, async_scheduling=async_scheduling)
        self.processor = OutputProcessor(tokenizer)
        self.runner, self.scheduler, self.tokenizer = runner, scheduler, tokenizer
        self.seed = seed
        self.generation_defaults = dict(generation_defaults or {})
        self._numbers = 0   # requests accepted: a request without an id gets the next number

    # -- requests ----------------------------------------------------------------------------------

    def add_request(self, request_id: Optional[str], prompt: PromptType,
                    params: Optional[SamplingParams] = None, *, arrival_time: Optional[float] = None) -> str:
        """Queue a prompt (text, token ids, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``);
        -> its request id (a fresh one when ``request_id`` is None). Bad input raises here,
        before anything is queued."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params: expected a SamplingParams, got {type(params).__name__}")
        params = params.with_defaults(self.generation_defaults)
        text, ids = self.tokenize_prompt(prompt)
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id: expected a string, got {type(request_id).__name__}")
        if request_id is None:
            number = str(self._numbers)
            request_id = number if number not in self.processor.requests else f"{number}-{uuid.uuid4().hex}"
        children = self.processor.add_request(request_id, text, ids, params,
                                              arrival_time=time.time() if arrival_time is None else arrival_time)
        added = []
        try:
            for child_id, child_params in children:   # n completions: n engine requests (output_processor)
                self.core.add_request(child_id, ids, child_params)
                added.append(child_id)
        except BaseException:
            self.core.finish_request(added)
            self.processor.abort_request(request_id, time.time())
            raise
        self._numbers += 1
        return request_id

    def tokenize_prompt(self, prompt: PromptType) -> tuple:
        """A prompt -> ``(text or None, token ids)``; the ids are checked by the scheduler."""
        if isinstance(prompt, dict):
            if not prompt or set(prompt) - {"prompt", "prompt_token_ids"}:
                raise ValueError(f"prompt: expected {{'prompt': text}} or {{'prompt_token_ids': [...]}}, "
                                 f"got keys {sorted(prompt)}")
            if "prompt_token_ids" in prompt:   # ids win; a text beside them is only shown
                return prompt.get("prompt"), self.tokenize_prompt(list(prompt["prompt_token_ids"]))[1]
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise TypeError(f"prompt: expected {{'prompt': text}}, got a {type(prompt).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: a text prompt needs tokenizer.json in the model folder; pass token ids")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise ValueError(f"prompt: {prompt!r} encodes to no tokens")
            return prompt, ids
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt: empty prompt (expected at least one token id)")
        if not isinstance(prompt, (list, tuple)):
            raise TypeError(f"prompt: expected a string, a list of token ids or a dict, got {type(prompt).__name__}")
        types = set(map(type, prompt))   # one pass in C: a 32k-token prompt costs microseconds, not 10 ms
        if any(t is bool or not issubclass(t, (int, np.integer)) for t in types):
            raise TypeError(f"prompt: expected a list of int token ids, got {prompt!r:.80}")
        return None, list(prompt) if types == {int} else [int(t) for t in prompt]

    def abort_request(self, request_ids: Union[str, Sequence[str]]) -> None:
        """Finish these requests now (``finish_reason="abort"``) and free their pages; unknown or
        finished ids are ignored."""
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        now = time.time()
        for request_id in request_ids:
            self.core.finish_request(self.processor.abort_request(request_id, now), "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.processor.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.processor.requests)

    @property
    def stats(self) -> dict:
        """Counters since start-up and the state now: requests, tokens, speculative decoding, pool pages,
        prefix cache."""
        return self.core.stats

    # -- steps -------------------------------------------------------------------------------------

    def step(self) -> list:
        """Run one step; -> the ``RequestOutput`` of each request that got a token or finished in
        it (cumulative: text and token ids so far)."""
        outputs, stopped = self.processor.process(self.core.execute_step(), time.time())
        self.core.finish_request(stopped, "stop")
        self.core.propose_drafts()
        return outputs
