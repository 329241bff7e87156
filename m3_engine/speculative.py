"""Speculative decoding: the option, the n-gram drafter, and when a step speculates.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4})

How a step speculates (``m3_engine.scheduler`` builds it, ``m3_engine.engine``
reads it back):

* **Drafts.** Before a step, each generation request may get up to ``k``
  draft tokens: ``"ngram"`` looks the request's last tokens up in its own
  prompt and output (:func:`ngram_draft`), no model involved; ``"eagle3"``
  takes the greedy drafts an EAGLE-3 draft head made after the previous step
  (``Scheduler.draft_pass``, the runners' ``propose``; docs/ENGINE.md,
  "EAGLE-3 draft heads").
* **Verify.** When any row has drafts, EVERY generation row of the step runs
  ``k + 1`` query tokens, its last token and ``k`` drafts (rows with fewer
  drafts are padded with their last token), through the decode kernels'
  multi-token path (``decode_query_len = k + 1``); so a verify step has one
  shape per batch size and replays a CUDA graph (torch) or a compiled step
  (JAX) like a plain decode step. Prefill chunks run beside it as context rows.
* **Accept.** The shared sampling kernel samples every one of the ``k + 1``
  positions, position ``j`` with the counter ``len(output) + j`` (the counter
  plain decoding would give that token). Draft ``j`` is accepted while the
  token sampled at position ``j`` equals it; the first position that differs
  gives its sampled token instead, and when all drafts are accepted position
  ``k`` gives a bonus token. Greedy rows: exact match. Sampled rows: this is
  rejection sampling for a draft distribution that is one-hot on the draft
  token ``x`` (n-gram and greedy drafts are): the kernel's Gumbel-max draw
  ``y ~ p`` equals ``x`` with probability ``p(x)``, the acceptance
  probability ``min(1, p(x) / q(x))``, and given ``y != x``, ``y`` follows
  ``p`` restricted to tokens other than ``x`` and renormalised, which is
  ``norm(max(0, p - q))``, the rejection sampler's residual. So every emitted
  token follows the target distribution, and a seeded request emits exactly
  the tokens it emits without speculation (same logits, same noise).
* **Rewind.** The K/V and index-K rows of rejected drafts stay in the pages
  but past the request's cached length, so no kernel reads them; the next
  step overwrites them.

**Never a loss** (:class:`SpeculationGate`): a step speculates only when it
has at most ``disable_by_batch_size`` generation rows and ``k + 1`` tokens
for each fit the step's token budget; a request drafts only while its recent
acceptance (an exponential average of accepted / proposed) stays at or above
``MIN_ACCEPTANCE``, and otherwise tries again in the engine steps that are
multiples of its probe interval: ``PROBE_INTERVAL`` at first, doubled by every
probe that leaves the average below the threshold (up to
``MAX_PROBE_INTERVAL``), back to ``PROBE_INTERVAL`` once it recovers. The
intervals are powers of two, so a batch's requests probe in the same steps
(one verify step, not one per request). A workload whose drafts are never
accepted (or that has no n-gram matches) therefore runs plain steps almost
always: 3 verify steps at first, then probes at steps 16, 32, 64, 128, 256,
then one in every 256.

Framework-neutral: pure Python and numpy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import numpy as np

__all__ = ["SpeculativeConfig", "ngram_draft", "num_accepted", "SpeculationGate", "MAX_SPECULATIVE_TOKENS", "MIN_ACCEPTANCE",
           "PROBE_INTERVAL", "MAX_PROBE_INTERVAL"]

MAX_SPECULATIVE_TOKENS = 7      # the decode kernels take up to 8 query tokens per request
DEFAULT_DISABLE_BY_BATCH_SIZE = 32
MIN_ACCEPTANCE = 0.2            # a request drafts while its acceptance average stays at or above this
PROBE_INTERVAL = 16             # ... and below it, drafts in every PROBE_INTERVAL-th step of the engine,
MAX_PROBE_INTERVAL = 256        # the interval doubling after each probe that fails, up to this
_EMA = 0.25                     # weight of the newest verify step in the acceptance average
# a new request's average: it drafts at once, and three verify steps with nothing accepted take it under
# MIN_ACCEPTANCE (0.45 * 0.75^3 = 0.19), one bad step among good ones does not
_FIRST_ACCEPTANCE = 0.45
METHODS = ("ngram", "eagle3")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """``speculative_config`` of an engine, with vLLM's names.

    method:                 "ngram" (drafts from the request's own tokens) or "eagle3"
                            (an EAGLE-3 draft head: ``model`` is its folder).
    num_speculative_tokens: drafts per request and step, 1..7 (``k``).
    prompt_lookup_min, prompt_lookup_max: n-gram lengths tried, longest first ("ngram").
    model:                  the draft model's folder ("eagle3").
    disable_by_batch_size:  steps with more generation rows than this do not speculate
                            (default 32).
    """
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: Optional[str] = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def from_dict(cls, value: Any) -> Optional["SpeculativeConfig"]:
        """None, a dict of the fields above (or a SpeculativeConfig) -> a checked config (or None)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"speculative_config: expected a dict like {{'method': 'ngram', "
                            f"'num_speculative_tokens': 4}}, got {type(value).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (expected some of {sorted(fields)})")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config: {key!r} is required")
        return cls(**value)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: expected one of {METHODS}, got {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, None)
        if self.method == "ngram":
            _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, None)
            _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, None)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} is larger than "
                                 f"prompt_lookup_max={self.prompt_lookup_max}")
            if self.model is not None:
                raise ValueError("speculative_config.model: the 'ngram' method uses no draft model (expected None)")
        elif not isinstance(self.model, str) or not self.model:
            raise ValueError(f"speculative_config.model: the {self.method!r} method needs the draft model's folder")


def _check_int(name, value, lo, hi):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo or \
            (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"speculative_config.{name}: expected an int {bound}, got {value!r}")


def ngram_draft(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Up to ``k`` draft tokens for a sequence ``tokens`` [L] int32 (prompt + output so far).

    Finds the earlier occurrence of the sequence's last ``n`` tokens with the largest ``n`` in
    ``[n_min, n_max]`` (ties: the most recent occurrence) and proposes the tokens that followed
    it; an empty array when no suffix of ``n_min`` tokens occurred before. Cost: one comparison
    over the sequence for its last token, then a few per candidate.
    """
    L = len(tokens)
    if L < n_min + 1:
        return tokens[:0]
    # candidate ends c (< L - 1): tokens[c] == the last token; extend each match backwards
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])
    if ends.size == 0:
        return tokens[:0]
    length = np.ones(ends.size, np.int64)
    alive = np.ones(ends.size, bool)
    for j in range(1, min(n_max, L - 1)):
        back = ends - j
        alive &= back >= 0
        alive[alive] = tokens[back[alive]] == tokens[L - 1 - j]
        length += alive
        if not alive.any():
            break
    best = int(length.max())
    if best < n_min:
        return tokens[:0]
    c = int(ends[np.flatnonzero(length == best)[-1]])   # the most recent of the longest matches
    return tokens[c + 1:c + 1 + k]


def num_accepted(drafts, sampled) -> int:
    """Drafts accepted: how many leading ``drafts`` equal the tokens sampled at their positions
    (``sampled[j]`` is the target's draw at draft ``j``'s position; see the module docstring)."""
    return next((j for j, (d, t) in enumerate(zip(drafts, sampled)) if d != t), len(drafts))


class SpeculationGate:
    """One request's acceptance average (see the module docstring)."""

    __slots__ = ("acceptance", "probe_interval")

    def __init__(self):
        self.acceptance = _FIRST_ACCEPTANCE
        self.probe_interval = PROBE_INTERVAL

    def wants_drafts(self, step_index: int) -> bool:
        """Draft in the scheduler's step ``step_index``? While the average is under ``MIN_ACCEPTANCE``,
        only in the engine's steps that are multiples of the probe interval (a power of two): requests
        that stopped drafting probe in the same steps, so a batch of them makes one verify step per
        interval, not one per request."""
        return self.acceptance >= MIN_ACCEPTANCE or step_index % self.probe_interval == 0

    def record(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        probing = self.acceptance < MIN_ACCEPTANCE
        self.acceptance = (1 - _EMA) * self.acceptance + _EMA * accepted / proposed
        if self.acceptance >= MIN_ACCEPTANCE:
            self.probe_interval = PROBE_INTERVAL
        elif probing:   # a probe that did not bring the average back: wait twice as long for the next
            self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
