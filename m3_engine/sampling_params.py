"""``SamplingParams``: how one request samples and when it stops (vLLM's names and meanings).

    SamplingParams(temperature=0)                          # greedy
    SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=64, stop=["\\n\\n"])
    SamplingParams(n=4, temperature=1.0, seed=7)           # 4 completions of one prompt (seeds 7..10)

Every field is checked once, here, when the object is made, so both
frameworks raise the same exception with the same message. The order in
which a row's logits are processed (one shared Triton kernel,
``m3_kernels/sampling.py``): repetition, frequency and presence penalties ->
``/ temperature`` -> top-k -> top-p (within the top-k set) -> min-p -> a
Gumbel-max draw whose noise comes from Philox keyed by (seed, the request's
own token index, vocabulary id). A seeded request therefore samples the same
tokens whatever else is in the batch, and torch and JAX sample the same token
from the same logits. ``temperature == 0`` is greedy: argmax, ties to the
lowest token id. Before all of that the kernel sets the logits of the tokens
the row's token bitmask forbids to -inf: the tokens a structured output does
not allow, the stop tokens before ``min_tokens`` outputs, and ``bad_words``
(``m3_engine.engine_core``). Every range is vLLM's (``SamplingParams._verify_args``),
except ``logprobs`` / ``prompt_logprobs`` (at most 20, OpenAI's limit; vLLM
also takes -1, the whole vocabulary) and ``seed`` (int64 on the device).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence, Union

from .structured_outputs import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams", "MAX_LOGPROBS", "MAX_SEED"]

MAX_LOGPROBS = 20          # top-N logprobs per token, as OpenAI's API allows
MAX_SEED = (1 << 63) - 1   # seeds are int64 on the device


@dataclasses.dataclass
class SamplingParams:
    """Sampling and stopping for one request.

    n:            completions of the prompt (>= 1): the request's ``RequestOutput`` holds
                  ``n`` ``CompletionOutput``s, ``index`` 0..n-1. Each is a request of its own
                  in the engine (``m3_engine.output_processor.ParentRequest``); with a ``seed``,
                  completion ``i`` samples with ``seed + i`` (vLLM's rule).
    max_tokens:   tokens to generate at most (>= 1), or None: up to the end of the
                  context (``max_model_len`` - the prompt's length); a request also stops
                  when its KV cache reaches the engine's ``max_model_len``
                  (``finish_reason="length"`` in both cases).
    min_tokens:   tokens to generate before the request may stop (>= 0, <= max_tokens):
                  until then the model's end-of-sequence tokens (unless ``ignore_eos``) and
                  ``stop_token_ids`` are never sampled, and stop strings are not looked for.
    temperature:  >= 0 and finite; 0 is greedy.
    top_p:        nucleus mass in (0, 1]; 1 is off.
    top_k:        keep the k most likely tokens; -1 or 0 is off.
    min_p:        keep tokens with probability >= min_p * the top probability; in [0, 1]
                  (1: only the most likely tokens); 0 is off.
    seed:         int in [0, 2**63) for reproducible sampling; None draws from
                  the engine's seed (``LLM(..., seed=...)``).
    stop:         a string or list of strings; generation stops when the text
                  contains one (it is cut from the text unless
                  ``include_stop_str_in_output``).
    stop_token_ids: token ids that end the request (kept in ``token_ids``; the
                  text of the stop token that ended it, one of these or an eos,
                  is left out unless ``include_stop_str_in_output``, as vLLM's).
    bad_words:    words never generated: each word is tokenized as it is and with a leading
                  space (vLLM's rule); a one-token word's token is never sampled, a longer
                  word's last token is not sampled right after the output ends with the rest
                  of the word (the output's tokens only, not the prompt's).
    ignore_eos:   keep generating past the model's end-of-sequence tokens.
    logprobs:     None (no logprobs), or N in [0, 20]: per generated token the
                  logprobs of the N most likely tokens and of the sampled one
                  (raw log-softmax of the model's logits: before penalties,
                  temperature and filters). With ``structured_outputs`` the
                  log-softmax is over the logits the grammar allows (the others
                  are -inf: logprob -inf), as vLLM's, whose runner masks the
                  logits before its sampler takes the raw logprobs.
    prompt_logprobs: None, or N in [0, 20]: ``RequestOutput.prompt_logprobs``, per prompt
                  token (None for the first) the logprobs of the N most likely tokens and of
                  the prompt's token at that position (raw log-softmax of the model's logits).
                  Such a request computes its whole prompt (the prefix cache is not used for it).
    include_stop_str_in_output: keep the matched stop string (or stop token's text) in the text.
    repetition_penalty: > 0; tokens seen in the prompt or output get
                  ``logit / p`` (logit > 0) or ``logit * p``; 1 is off.
    presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the
                  logits of generated tokens once / per occurrence; 0 is off.
    skip_special_tokens: leave special tokens out of the text (not the ids).
    structured_outputs: a :class:`m3_engine.structured_outputs.StructuredOutputsParams`
                  (a JSON schema, regex, choice, grammar or any JSON): only tokens that keep
                  the output inside it are sampled, and the request ends (``finish_reason
                  "stop"``) when it is complete and a stop token follows.
    """
    n: int = 1
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, Sequence[str]]] = None
    stop_token_ids: Optional[Sequence[int]] = None
    bad_words: Optional[Sequence[str]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self):
        self.n = _int("n", self.n, low=1)
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, low=1)
        self.min_tokens = _int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: expected <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        self.temperature = _float("temperature", self.temperature)
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature: expected a finite number >= 0, got {self.temperature}")
        self.top_p = _float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p}")
        self.top_k = _int("top_k", self.top_k, low=-1)
        self.min_p = _float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: expected a number in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self.seed = _int("seed", self.seed, low=0, high=MAX_SEED - (self.n - 1))   # completion i: seed + i
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise TypeError(f"stop: expected a string or a list of strings, got {self.stop!r}")
        else:
            self.stop = list(self.stop)
        if any(s == "" for s in self.stop):
            raise ValueError("stop: expected non-empty strings, got ''")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError(f"stop_token_ids: expected a list of ints, got {type(self.stop_token_ids).__name__}")
        else:
            self.stop_token_ids = [_int(f"stop_token_ids[{i}]", t, low=0) for i, t in enumerate(self.stop_token_ids)]
        if self.bad_words is None:
            self.bad_words = []
        elif isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple)) or \
                not all(isinstance(w, str) for w in self.bad_words):
            raise TypeError(f"bad_words: expected a list of strings, got {self.bad_words!r}")
        else:
            self.bad_words = list(self.bad_words)
        if any(not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words: expected words with a non-space character, got {self.bad_words!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty: expected a number > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}: expected a number in [-2, 2], got {value}")
            setattr(self, name, value)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(f"structured_outputs: expected a StructuredOutputsParams, got "
                            f"{type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def with_defaults(self, defaults: dict) -> "SamplingParams":
        """A copy in which each field the caller did not set takes the value of ``defaults`` (the
        model's ``generation_config.json``: temperature, top_p, top_k, min_p, repetition_penalty,
        max_tokens)."""
        changes = {k: v for k, v in defaults.items() if k not in self._explicit}
        return dataclasses.replace(self, **changes) if changes else self


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams))
_dataclass_init = SamplingParams.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args, **kwargs):
    # remember which fields the caller set, so that generation_config.json fills only the others
    object.__setattr__(self, "_explicit", frozenset(_FIELD_NAMES[:len(args)]) | frozenset(kwargs))
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _init


def _int(name, value, *, low=None, high=None) -> int:
    if isinstance(value, bool) or not _is_int(value):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if low is not None and value < low or high is not None and value > high:
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}: expected an int {bounds}, got {value}")
    return value


def _float(name, value) -> float:
    if isinstance(value, bool) or not (_is_int(value) or _is_float(value)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) or type(value).__name__ in ("int8", "int16", "int32", "int64", "uint8", "uint16",
                                                              "uint32", "uint64")


def _is_float(value) -> bool:
    return isinstance(value, float) or type(value).__name__ in ("float16", "float32", "float64")
