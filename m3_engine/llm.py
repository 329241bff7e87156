"""``LLM``: generate with a MiniMax-M3 checkpoint, vLLM's way, in torch or JAX.

    from m3_torch import LLM, SamplingParams         # or: from m3_jax import LLM, SamplingParams
    llm = LLM("path/to/model", dtype="bfloat16", max_num_seqs=8, max_model_len=32768)
    outputs = llm.generate(["Hello, my name is", "The capital of France is"],
                           SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32))
    print(outputs[0].outputs[0].text)

This class is the whole engine front end; ``m3_torch.LLM`` and ``m3_jax.LLM``
only name their runner (``_runner_class``). Options and sampling parameters
are checked here (``m3_engine.args``, ``m3_engine.sampling_params``), so both
frameworks accept and refuse the same things with the same messages.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from .args import CheckedArgs, EngineArgs, check_option_names
from .engine import LLMEngine, PromptType
from .model_config import read_json
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .step_inputs import StepBuilder
from .tokenizer import check_messages, load_tokenizer

__all__ = ["LLM", "generation_defaults"]

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field (the defaults a request does not set)
_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_dir) -> dict:
    """``SamplingParams`` defaults from the model folder's ``generation_config.json`` (if any)."""
    path = model_dir / "generation_config.json"
    config = read_json(path) if path.is_file() else {}
    defaults = {field: config[key] for key, field in _GENERATION_KEYS.items() if config.get(key) is not None}
    if config.get("do_sample") is False:   # transformers: greedy unless do_sample
        defaults["temperature"] = 0.0
    SamplingParams(**defaults)   # a bad value is an error naming the field
    return defaults


class LLM:
    """A MiniMax-M3 text model, ready to generate. Options: :class:`m3_engine.args.EngineArgs`
    (model, dtype, device, max_num_seqs, max_model_len, num_gpu_blocks_override,
    max_num_batched_tokens, prefill_chunk, graph_batch_sizes, gpu_memory_utilization,
    tensor_parallel_size, enable_expert_parallel, quantization, kv_cache_dtype,
    index_cache_dtype, seed, enforce_eager, enable_prefix_caching, load_format,
    speculative_config, async_scheduling, precompile, compile_cache_dir), vLLM's names.

    The constructor returns a ready engine: with ``precompile`` (default on a GPU) the runner has
    compiled (JAX) or captured (torch's CUDA graphs) every program a step can need
    (``runner.warm_up``; docs/ENGINE.md, "Ready means ready"). :attr:`startup_times` says where the
    time to ready went, in seconds: ``load`` (weights and pool), ``compile``, ``capture``,
    ``total``, and ``programs`` (how many step programs the warm-up made)."""

    framework = "?"   # "torch" | "jax", set by the framework's subclass

    @classmethod
    def _runner_class(cls):
        raise NotImplementedError("use m3_torch.LLM or m3_jax.LLM")

    def __init__(self, model, **options):
        self._closed = True
        check_option_names(options)
        self.args: CheckedArgs = EngineArgs(model, **options).check()
        args = self.args
        self.config, self.tp = args.config, args.tp
        self.tokenizer = load_tokenizer(args.model_dir)
        defaults = generation_defaults(args.model_dir)
        start = time.perf_counter()
        self.runner = self._runner_class()(args)
        self._closed = False
        load = time.perf_counter() - start
        self.scheduler_config = self.runner.scheduler_config   # the pool's pages: the runner sized it
        builder = StepBuilder(self.runner.buckets, args.step_config())   # the padding the runner declares
        self.planner = builder.planner   # one rank's heads: every rank runs the plans made here
        warm = dict(programs=0, compile=0.0, capture=0.0)
        if args.precompile_on(self.runner.on_gpu):
            warm = self.runner.warm_up(builder)
        # the start-up's objects (weights' wrappers, compiled kernels and traced programs, their metadata) move
        # to the collector's permanent generation: its full collections during steps do not walk them
        gc.collect()
        gc.freeze()
        self.startup_times = dict(load=load, compile=warm["compile"], capture=warm["capture"],
                                  total=time.perf_counter() - start, programs=warm["programs"])
        logger.info("%s engine ready in %.1f s: load %.1f s, compile %.1f s, capture %.1f s (%d step programs "
                    "made at start)", self.framework, self.startup_times["total"], load, warm["compile"],
                    warm["capture"], warm["programs"])
        self.engine = LLMEngine(self.runner, Scheduler(self.scheduler_config, self.config, builder=builder,
                                                       speculative=args.speculative),
                                tokenizer=self.tokenizer, seed=args.seed, generation_defaults=defaults,
                                async_scheduling=args.async_scheduling)

    # -- life cycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the device state (and end tensor-parallel workers); later calls raise. Idempotent;
        also run by ``with LLM(...) as llm:``."""
        if not self._closed:
            self._closed = True
            self.runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this LLM is closed (close() was called, or a tensor-parallel rank failed)")

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        """KV tokens per request, prompt and generated together (the ``max_model_len`` option, or its default)."""
        return self.scheduler_config.max_context

    # -- generation ------------------------------------------------------------------------------

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None, *,
                 use_tqdm: bool = True) -> list:
        """Complete each prompt; -> ``list[RequestOutput]`` in input order.

        prompts:  a string, a list of token ids, ``{"prompt": text}`` /
                  ``{"prompt_token_ids": ids}``, or a list of these.
        sampling_params: one ``SamplingParams`` for all, a list with one per prompt, or
                  None (the defaults, with the model's ``generation_config.json``).
        use_tqdm: a progress bar on stderr (shown only when stderr is a terminal).
        Bad input raises before any request runs (nothing stays queued).
        """
        self._check_open()
        prompts = _as_prompt_list(prompts)
        if not prompts:
            return []
        ids = self._add_all(prompts, self._params_list(sampling_params, len(prompts)))
        return self._run_to_completion(ids, use_tqdm)

    def chat(self, messages, sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None, *,
             chat_template: Optional[str] = None, add_generation_prompt: bool = True, tools=None,
             use_tqdm: bool = True) -> list:
        """Answer one conversation (a list of ``{"role", "content"}``; assistant ``tool_calls`` and
        ``"tool"`` results too) or a list of them, rendered with the model folder's chat template (or
        ``chat_template``) and OpenAI ``tools`` (``[{"type": "function", "function": {...}}]``, for
        every conversation); -> ``list[RequestOutput]``. The text is the model's raw answer: parse
        its tool calls and thinking with :class:`m3_engine.reasoning_parser.ChatOutputParser`."""
        self._check_open()
        if self.tokenizer is None:
            raise ValueError("chat: the model folder has no tokenizer.json")
        conversations = [messages] if messages and isinstance(messages, (list, tuple)) and \
            isinstance(messages[0], dict) else messages
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise TypeError("messages: expected a conversation (a list of {'role', 'content'} dicts) or a list of "
                            f"conversations, got {messages!r:.80}")
        prompts = []
        for conversation in conversations:
            check_messages(conversation)
            text = self.tokenizer.apply_chat_template(conversation, chat_template=chat_template,
                                                      add_generation_prompt=add_generation_prompt, tools=tools)
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        ids = self._add_all(prompts, self._params_list(sampling_params, len(prompts)))
        return self._run_to_completion(ids, use_tqdm)

    def generate_stream(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None
                        ) -> Iterator[RequestOutput]:
        """Yield the request's ``RequestOutput`` after each step that gives it a token (its text and
        token ids grow; the last one has ``finished=True``). Leaving the loop early aborts it."""
        self._check_open()
        [request_id] = self._add_all([prompt], [sampling_params])
        engine = self.engine
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.request_id == request_id:
                        yield output
                        if output.finished:
                            return
        finally:
            engine.abort_request(request_id)

    # -- helpers ---------------------------------------------------------------------------------

    def _params_list(self, sampling_params, n: int) -> list:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if not isinstance(sampling_params, (list, tuple)):
            raise TypeError(f"sampling_params: expected a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__}")
        if len(sampling_params) != n:
            raise ValueError(f"sampling_params: expected one per prompt ({n}), got {len(sampling_params)}")
        return list(sampling_params)

    def _add_all(self, prompts: list, params: list) -> list:
        """Queue every prompt, or none: a bad one aborts those queued before it, then raises."""
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                ids.append(self.engine.add_request(None, prompt, p))
        except (ValueError, TypeError) as e:
            self.engine.abort_request(ids)
            message = str(e)
            if len(prompts) > 1 and message.startswith("prompt"):   # name the prompt: "prompts[2]: ..."
                raise type(e)(f"prompts[{i}]" + message[len("prompt"):]) from None
            raise
        except BaseException:
            self.engine.abort_request(ids)
            raise
        return ids

    def _run_to_completion(self, ids: list, use_tqdm: bool) -> list:
        from tqdm.auto import tqdm

        done: dict = {}
        with tqdm(total=len(ids), desc="Processed prompts", unit="req", disable=None if use_tqdm else True) as bar:
            try:
                while len(done) < len(ids):
                    for output in self.engine.step():
                        if output.finished:
                            done[output.request_id] = output
                            bar.update(1)
            except BaseException:
                self.engine.abort_request(ids)
                raise
        return [done[i] for i in ids]


def _as_prompt_list(prompts) -> list:
    """One prompt or a list of them -> a list of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and isinstance(prompts[0], (int, np.integer)) and not isinstance(prompts[0], bool):
            return [prompts]   # one prompt of token ids (every id is checked when it is queued)
        return list(prompts)
    if hasattr(prompts, "tolist"):   # a numpy array of ids
        return _as_prompt_list(prompts.tolist())
    raise TypeError(f"prompts: expected a string, token ids, a dict or a list of these, got {type(prompts).__name__}")
