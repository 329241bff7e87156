"""What a request returns: ``RequestOutput`` holding ``CompletionOutput``s (vLLM's names)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

__all__ = ["CompletionOutput", "RequestOutput", "RequestMetrics", "Logprob"]


@dataclasses.dataclass
class Logprob:
    """One token's log-probability (raw log-softmax of the model's logits; with structured
    outputs, of the logits the grammar allows), its rank among those tokens (1 = most likely)
    and its text."""
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclasses.dataclass
class CompletionOutput:
    """The generated part of a request.

    text:          the detokenized text (stop string removed unless asked to keep it).
    token_ids:     the generated token ids (an end-of-sequence or stop token included).
    finish_reason: None while running, then "stop" (eos, a stop token or string),
                   "length" (``max_tokens`` or the context end) or "abort".
    stop_reason:   the stop string or stop token id that ended it; None for eos,
                   length and abort.
    logprobs:      when ``SamplingParams.logprobs`` is set: per generated token a
                   dict ``token id -> Logprob`` of the top-N tokens and the sampled one.
    cumulative_logprob: the sum of the sampled tokens' logprobs (when logprobs are asked).
    """
    index: int
    text: str
    token_ids: list
    cumulative_logprob: Optional[float]
    logprobs: Optional[list]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock times (``time.time()``) of a request, and its speculative decoding:
    draft tokens proposed and accepted, steps that verified drafts, and the seconds
    spent proposing them (all 0 without speculation)."""
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    draft_time: float = 0.0

    @property
    def acceptance_rate(self) -> Optional[float]:
        """Accepted / proposed draft tokens (None before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> Optional[float]:
        """Tokens emitted per verify step: 1 + accepted drafts per verify step (None before any)."""
        return 1 + self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else None


@dataclasses.dataclass
class RequestOutput:
    """One request: its prompt and its (growing, when streamed) completions, ``SamplingParams.n``
    of them (``outputs[i].index == i``); ``finished`` once all are. ``num_cached_tokens``: prompt
    tokens whose K/V came from the prefix cache (the first completion's). ``prompt_logprobs``: when
    ``SamplingParams.prompt_logprobs`` is set, once the prompt is computed: None for the first
    prompt token, then per prompt token a dict ``token id -> Logprob`` of the top-N tokens and the
    prompt's own token at that position. ``metrics``: with several completions, their first times,
    their last ones and their summed drafts."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    outputs: list
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list] = None
