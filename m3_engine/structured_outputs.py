"""Structured outputs (constrained decoding): vLLM's ``StructuredOutputsParams`` over xgrammar.

    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", ...}))
    SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"\\d{3}-\\d{4}"))
    SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    SamplingParams(structured_outputs=StructuredOutputsParams(grammar='root ::= "a" root | "b"'))
    SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))

A request names exactly one constraint. How it runs (vLLM v1's design):

* **Compile once.** :class:`StructuredOutputsBackend` holds the tokenizer's
  vocabulary as xgrammar sees it (``xgrammar.TokenizerInfo``, built once per
  engine) and an ``xgrammar.GrammarCompiler`` whose cache keeps each compiled
  constraint by (kind, text): the same schema sent by many requests compiles
  once. The engine compiles when a request is added, so a schema, regex or
  grammar that does not compile is a ``ValueError`` there (a 400 from the
  server) and nothing is queued.
* **One matcher per request.** :class:`Grammar` wraps the request's
  ``xgrammar.GrammarMatcher``: it accepts the request's tokens one by one and
  says which tokens may come next.
* **A bitmask per step.** While the step's forward runs, :func:`fill_bitmask`
  writes, for every logits row, the tokens that row may sample (the rows of
  a step in one multi-threaded call): ``[L, ceil(V / 32)]``
  int32, bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed, ``V`` the
  model's vocabulary (the logits width, which may exceed the tokenizer's: ids
  past the tokenizer's are never allowed). Unconstrained rows are all ones
  (-1). The sampling kernel sets the logits of disallowed tokens to -inf
  before anything else (:func:`apply_token_bitmask` is the NumPy reference).
* **Speculative decoding.** A verify row samples ``k + 1`` logits rows, row
  ``j`` after the request's tokens and drafts ``0..j-1``: the matcher accepts
  the drafts one at a time to fill each row's mask, then rolls them back
  (xgrammar's rollback is unlimited). A draft the grammar refuses is never
  accepted by the verify (its row forbids it), so the rows after it are left
  all ones: they are never used. After the step the matcher accepts the tokens
  the request actually emitted.
* **End.** At the grammar's end the mask allows only the stop tokens (the
  model's eos ids and the request's ``stop_token_ids``); the matcher
  terminates when it accepts one and the request finishes with
  ``finish_reason="stop"`` (also with ``ignore_eos``).

xgrammar is an optional dependency (``pip install 'm3-msa-kernels[structured]'``),
imported on the first constrained request; it imports torch itself.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from typing import Optional, Sequence, Union

import numpy as np

__all__ = ["StructuredOutputsParams", "StructuredOutputsBackend", "Grammar", "fill_bitmask", "forbid_tokens",
           "apply_token_bitmask", "bitmask_width", "COMPILE_CACHE_BYTES", "FILL_THREADS"]

COMPILE_CACHE_BYTES = 1 << 30   # compiled grammars kept by the backend (xgrammar evicts past this)
# threads filling a step's bitmask rows: half the cores (the other half run the engine, the server and
# the framework's dispatch), at most 8 (a step's rows are few; more threads cost more to start than they save)
FILL_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: ": the message is what follows
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's fields; set exactly one).

    json:        a JSON schema (a dict, or its JSON text): the output is a JSON value
                 it accepts (properties in the schema's order, no properties it does
                 not list unless it allows them).
    regex:       the output matches this regular expression (as a whole).
    choice:      the output is one of these strings.
    grammar:     an EBNF grammar in xgrammar's (GBNF) syntax whose root rule is ``root``.
    json_object: True: the output is any JSON object or array.
    """
    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def __post_init__(self):
        given = [k for k in _KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: expected exactly one of {', '.join(_KINDS)}, got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json: not valid JSON ({e})") from None
            if not isinstance(schema, dict):
                raise TypeError(f"structured_outputs.json: expected a JSON schema object (a dict or its JSON "
                                f"text), got {type(schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"structured_outputs.{name}: expected a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) for c in self.choice):
                raise TypeError(f"structured_outputs.choice: expected a non-empty list of strings, "
                                f"got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object: expected True, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in _KINDS if getattr(self, k) is not None)

    @property
    def spec(self) -> str:
        """The text the backend compiles: the schema as compact JSON (its key order kept: it is the
        output's), the regex, the EBNF grammar (a choice becomes ``root ::= "a" | "b"``), "" for
        json_object."""
        kind = self.kind
        if kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        if kind == "choice":   # JSON string literals are valid EBNF string literals
            return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
        if kind == "json_object":
            return ""
        return getattr(self, kind)


def bitmask_width(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask: ``ceil(vocab_size / 32)``."""
    return -(-vocab_size // 32)


class Grammar:
    """One request's position in its constraint: an ``xgrammar.GrammarMatcher``."""

    def __init__(self, matcher):
        self.matcher = matcher

    def accept(self, token: int) -> None:
        """Advance past a token the request emitted. A token the grammar forbids raises
        ``RuntimeError``: the sampler (which applies the step's token bitmask) let it through."""
        if not self.matcher.accept_token(int(token)):
            raise RuntimeError(f"structured outputs: token {int(token)} was sampled but the request's grammar "
                               f"forbids it (the runner's sampler must apply SamplingBatch.token_bitmask)")

    def try_accept(self, token: int) -> bool:
        """Advance past a draft token if the grammar allows it; -> whether it did."""
        return bool(self.matcher.accept_token(int(token)))

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens (drafts)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """True once the grammar is complete and a stop token was accepted."""
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens that may come next into ``bitmask[row]``."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


def fill_bitmask(rows: Sequence[tuple], vocab_size: int) -> np.ndarray:
    """The token bitmask of one step: ``[L, ceil(vocab_size / 32)]`` int32, L = the step's logits rows.

    rows: per real row of the step, in order, ``(grammar or None, its number of logits rows, its
          drafts)``: 0 logits rows (a prompt chunk), 1, or ``k + 1`` for a verify row whose
          logits row ``j`` follows drafts ``0..j-1``.
    Unconstrained rows are all ones (-1); so are the rows of a verify row after a draft its
    grammar refuses or that terminates it (the verify never accepts past that draft, so they
    are never used). A constrained row that allows no token raises ``RuntimeError``. The rows
    without drafts are filled in one call on :data:`FILL_THREADS` threads (xgrammar's
    ``BatchGrammarMatcher``).
    """
    total = sum(count for _, count, _ in rows)
    bitmask = np.full((total, bitmask_width(vocab_size)), -1, np.int32)
    start, batch, batch_rows = 0, [], []
    for grammar, count, drafts in rows:
        if grammar is not None and count and not drafts:
            batch.append(grammar.matcher)
            batch_rows.append(start)
        elif grammar is not None:
            accepted = 0
            for j in range(count):
                grammar.fill(bitmask, start + j)
                if j == len(drafts) or not grammar.try_accept(drafts[j]):
                    break   # past the drafts (padding rows), or a refused draft: the rest are never used
                accepted += 1
                if grammar.is_terminated:
                    break   # a stop-token draft: the request ends there
            grammar.rollback(accepted)
        start += count
    if batch:
        _batch_matcher().batch_fill_next_token_bitmask(batch, bitmask, batch_rows)
    # the rows not filled are all ones, so a row without a set bit is a filled row that allows no token:
    # one pass over the mask finds it (a row's largest word, as unsigned, is 0 only then)
    if (bitmask.view(np.uint32).max(axis=1) == 0).any():
        raise RuntimeError("structured outputs: the request's grammar allows no token of the vocabulary "
                           "next (a grammar this tokenizer cannot write)")
    return bitmask


@functools.lru_cache(maxsize=None)
def _batch_matcher():
    """xgrammar's multi-threaded filler of many matchers' rows (one per process)."""
    return _import_xgrammar().BatchGrammarMatcher(FILL_THREADS)


def forbid_tokens(bitmask: np.ndarray, row: int, token_ids: Sequence[int]) -> None:
    """Clear the bits of ``token_ids`` in ``bitmask[row]`` (int32 ``[L, ceil(V / 32)]``): the
    sampling kernel never samples them in that row; the row's other bits are kept (an AND)."""
    words = bitmask.view(np.uint32)
    for t in token_ids:
        words[row, t >> 5] &= ~np.uint32(1 << (t & 31))


def apply_token_bitmask(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """NumPy reference of what the sampling kernel does with a token bitmask: ``logits [L, V]``
    with the tokens whose bit is 0 set to -inf (a new array). ``bitmask``: ``[L, ceil(V / 32)]``
    int32, bit ``t % 32`` of word ``t // 32`` for token ``t``; bits past ``V`` are ignored."""
    logits = np.asarray(logits)
    bitmask = np.asarray(bitmask)
    if logits.ndim != 2:
        raise ValueError(f"logits: expected [L, V], got shape {logits.shape}")
    expected = (logits.shape[0], bitmask_width(logits.shape[1]))
    if bitmask.dtype != np.int32 or bitmask.shape != expected:
        raise ValueError(f"bitmask: expected int32 {expected}, got {bitmask.dtype} {bitmask.shape}")
    bytes_ = np.ascontiguousarray(bitmask).astype("<i4", copy=False).view(np.uint8)
    allowed = np.unpackbits(bytes_, axis=1, bitorder="little")[:, :logits.shape[1]].astype(bool)
    return np.where(allowed, logits, -np.inf).astype(logits.dtype, copy=False)


class StructuredOutputsBackend:
    """Compiles constraints for one tokenizer and model (xgrammar), and makes requests' matchers.

    tokenizer:  the model folder's :class:`m3_engine.tokenizer.Tokenizer`.
    vocab_size: the model's vocabulary (the logits width, the bitmask's); ids at or past the
                tokenizer's size are never allowed, tokenizer ids at or past it never exist.
    """

    def __init__(self, tokenizer, *, vocab_size: int):
        xgr = _import_xgrammar()
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size: expected an int >= 1, got {vocab_size!r}")
        self.vocab_size = vocab_size
        vocab_type, add_prefix_space = _vocab_type(tokenizer.backend, xgr)
        # stop tokens are given per request (override_stop_tokens): none are set here
        self.tokenizer_info = xgr.TokenizerInfo(_encoded_vocab(tokenizer.backend, vocab_size), vocab_type,
                                                vocab_size=vocab_size, stop_token_ids=[],
                                                add_prefix_space=add_prefix_space)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, cache_limit_bytes=COMPILE_CACHE_BYTES)
        self._xgr = xgr

    def compile(self, params: StructuredOutputsParams):
        """The ``xgrammar.CompiledGrammar`` of a constraint (the compiler's cache returns the one
        compiled before for the same kind and text). A constraint that does not compile raises
        ``ValueError``."""
        if not isinstance(params, StructuredOutputsParams):
            raise TypeError(f"structured_outputs: expected a StructuredOutputsParams, got {type(params).__name__}")
        kind, spec = params.kind, params.spec
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(spec)
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            if kind == "json_object":
                return self.compiler.compile_builtin_json_grammar()
            return self.compiler.compile_grammar(spec)   # grammar, choice
        except RuntimeError as e:   # xgrammar's parse and conversion errors
            raise ValueError(f"structured_outputs.{kind}: {_XGRAMMAR_LOCATION.sub('', str(e)).strip()}") from None

    def grammar(self, params: StructuredOutputsParams, *, stop_token_ids: Sequence[int]) -> Grammar:
        """A new request's matcher; ``stop_token_ids`` (the model's eos ids and the request's own)
        are what the request may end with once its grammar is complete."""
        stop = sorted({int(t) for t in stop_token_ids})
        if not stop:
            raise ValueError("structured_outputs: the model has no eos token id (config.json / "
                             "generation_config.json eos_token_id) and the request no stop_token_ids: a "
                             "constrained request could never end")
        if stop[-1] >= self.vocab_size:
            raise ValueError(f"stop_token_ids: expected ids < the vocabulary size {self.vocab_size}, got {stop[-1]}")
        return Grammar(self._xgr.GrammarMatcher(self.compile(params), override_stop_tokens=stop))


# -- xgrammar ----------------------------------------------------------------------------------

def _import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError("structured outputs need xgrammar: pip install 'm3-msa-kernels[structured]'") from e
    return xgrammar


def _encoded_vocab(backend, vocab_size: int) -> list:
    """Each id's token as tokenizer.json spells it, ``vocab_size`` entries; "" for special tokens
    and ids the tokenizer lacks (xgrammar never allows an empty token, except as a stop token)."""
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    vocab = [""] * vocab_size
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and i not in special:
            vocab[i] = token
    return vocab


def _vocab_type(backend, xgr) -> tuple:
    """(xgrammar's VocabType, add_prefix_space) read from tokenizer.json, as xgrammar reads a
    Hugging Face tokenizer: a ByteLevel decoder is BYTE_LEVEL, a ByteFallback one (alone or in a
    Sequence) BYTE_FALLBACK, anything else RAW; a prefix space is added by a ``Prepend("▁")``
    normalizer or a Metaspace pre-tokenizer whose prepend_scheme is "always" or "first"."""
    config = json.loads(backend.to_str())
    decoder = config.get("decoder") or {}
    decoders = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    types = [d.get("type") for d in decoders]
    vocab_type = xgr.VocabType.RAW
    for t in types:
        if t in ("ByteLevel", "ByteFallback"):
            vocab_type = xgr.VocabType.BYTE_LEVEL if t == "ByteLevel" else xgr.VocabType.BYTE_FALLBACK
            break
    normalizer = config.get("normalizer") or {}
    normalizers = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    pre = config.get("pre_tokenizer") or {}
    add_prefix_space = any(n.get("type") == "Prepend" and n.get("prepend") == "\u2581" for n in normalizers) or \
        (pre.get("type") == "Metaspace" and pre.get("prepend_scheme") in ("always", "first"))
    return vocab_type, add_prefix_space
