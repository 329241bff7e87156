"""Structured outputs (``m3_engine.structured_outputs``): the parameters, the xgrammar backend over
the tiny model's tokenizer, the step's token bitmask, and the engine over a stand-in runner.

The runs sample greedily from random logits masked by the NumPy reference
(``apply_token_bitmask``, what the sampling kernel does), so whatever the "model" prefers,
the text must be valid: JSON with the schema's fields, a full regex match, one of the choices,
a sentence of the grammar; and the matcher must end on the eos token. The mask is built for a
model vocabulary (520) wider than the tokenizer's (512): the ids past it are never allowed.
"""

import dataclasses
import json
import re
import sys

import numpy as np
import pytest

from m3_engine import SamplingParams
from m3_engine.runner import SynchronousRunner
from m3_engine.structured_outputs import (Grammar, StructuredOutputsBackend, StructuredOutputsParams,
                                          apply_token_bitmask, bitmask_width, fill_bitmask)
from m3_engine.tiny_model import EOS_ID, write_tiny_checkpoint
from m3_engine.tokenizer import Tokenizer

pytest.importorskip("xgrammar")

VOCAB = 520   # the tiny tokenizer has 512 tokens: the model's logits are wider
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"]}
REGEX = r"[a-z]{2,6}-\d{3}(\.[a-z]+)?"
CHOICES = ["yes", "no", 'say "maybe"\n', "é"]
GRAMMAR = r"""root ::= "(" sum ")"
sum ::= num | num "+" sum
num ::= [1-9] [0-9]?"""


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer(write_tiny_checkpoint(tmp_path_factory.mktemp("so"), seed=0))


@pytest.fixture(scope="module")
def backend(tokenizer):
    return StructuredOutputsBackend(tokenizer, vocab_size=VOCAB)


def random_logits(rng, rows, tokenizer):
    """Random logits of a "model" that likes to close what it opened (strings, objects, lists,
    parentheses) and to stop, so that random runs end in tens of tokens, not thousands."""
    logits = rng.standard_normal((rows, VOCAB)).astype(np.float32)
    closing = [tokenizer.encode(c, add_special_tokens=False)[0] for c in '"}])'] + [EOS_ID]
    logits[:, closing] += 2.0
    return logits


# -- the parameters --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    ({}, ValueError, "exactly one of json, regex, choice, grammar, json_object, got none"),
    ({"regex": "a", "choice": ["a"]}, ValueError, "got regex, choice"),
    ({"json": "{not json"}, ValueError, "structured_outputs.json: not valid JSON"),
    ({"json": "[1, 2]"}, TypeError, "JSON schema object"),
    ({"regex": ""}, TypeError, "structured_outputs.regex: expected a non-empty string"),
    ({"grammar": 3}, TypeError, "structured_outputs.grammar"),
    ({"choice": "yes"}, TypeError, "structured_outputs.choice: expected a non-empty list of strings"),
    ({"choice": []}, TypeError, "structured_outputs.choice"),
    ({"choice": ["a", 1]}, TypeError, "structured_outputs.choice"),
    ({"json_object": False}, ValueError, "json_object: expected True"),
])
def test_params_validation(kwargs, error, match):
    with pytest.raises(error, match=re.escape(match)):
        StructuredOutputsParams(**kwargs)


def test_params_spec_and_sampling_params():
    schema = {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}}
    params = StructuredOutputsParams(json=schema)
    assert params.kind == "json" and list(json.loads(params.spec)["properties"]) == ["z", "a"]   # order kept
    assert StructuredOutputsParams(json=json.dumps(schema, indent=2)).spec == params.spec
    assert StructuredOutputsParams(choice=["a", 'b"']).spec == r'root ::= "a" | "b\""'
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    sp = SamplingParams(structured_outputs=params)
    assert sp.structured_outputs is params and SamplingParams().structured_outputs is None
    with pytest.raises(TypeError, match="structured_outputs: expected a StructuredOutputsParams, got dict"):
        SamplingParams(structured_outputs={"json": schema})


def test_missing_xgrammar_names_the_extra(monkeypatch, tokenizer):
    monkeypatch.setitem(sys.modules, "xgrammar", None)   # `import xgrammar` raises ImportError
    with pytest.raises(ImportError, match=re.escape("pip install 'm3-msa-kernels[structured]'")):
        StructuredOutputsBackend(tokenizer, vocab_size=VOCAB)


# -- the backend -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"regex": "a(b"}, r"structured_outputs.regex: .*parenthesis"),
    ({"grammar": "root ::= missing"}, r"structured_outputs.grammar: .*missing"),
    ({"json": {"type": "wat"}}, r"structured_outputs.json: .*wat"),
])
def test_a_constraint_that_does_not_compile_is_a_value_error(backend, kwargs, match):
    with pytest.raises(ValueError, match=match) as e:
        backend.grammar(StructuredOutputsParams(**kwargs), stop_token_ids=[EOS_ID])
    assert ".cc:" not in str(e.value)   # xgrammar's source location is cut


def test_a_constraint_compiles_once(backend):
    backend.compile(StructuredOutputsParams(json={"type": "object", "properties": {"once": {"type": "integer"}}}))
    size = backend.compiler.get_cache_size_bytes()
    for spec in [{"type": "object", "properties": {"once": {"type": "integer"}}},
                 '{"type": "object",\n "properties": {"once": {"type": "integer"}}}']:
        backend.compile(StructuredOutputsParams(json=spec))   # the same schema: from the cache
        assert backend.compiler.get_cache_size_bytes() == size
    backend.compile(StructuredOutputsParams(json={"type": "object", "properties": {"twice": {"type": "integer"}}}))
    assert backend.compiler.get_cache_size_bytes() > size


def test_a_request_needs_a_stop_token(backend):
    with pytest.raises(ValueError, match="could never end"):
        backend.grammar(StructuredOutputsParams(regex="a"), stop_token_ids=[])


def test_apply_token_bitmask():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 70)).astype(np.float32)
    allowed = rng.random((3, 70)) < 0.3
    bitmask = np.full((3, bitmask_width(70)), -1, np.int32)
    for i in range(2):   # row 2 stays all ones
        bits = np.zeros(32 * bitmask_width(70), np.uint64)
        bits[:70] = allowed[i]
        bitmask[i] = (bits.reshape(-1, 32) << np.arange(32, dtype=np.uint64)).sum(1).astype(np.uint32).view(np.int32)
    out = apply_token_bitmask(logits, bitmask)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out[:2], np.where(allowed[:2], logits[:2], -np.inf))
    np.testing.assert_array_equal(out[2], logits[2])
    with pytest.raises(ValueError, match=r"bitmask: expected int32 \(3, 3\)"):
        apply_token_bitmask(logits, bitmask[:, :2])


# -- random-logits runs ----------------------------------------------------------------------------

def _check_json(text):
    value = json.loads(text)
    assert list(value) == ["name", "age", "tags"], value
    assert isinstance(value["name"], str)
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
    assert len(value["tags"]) <= 3 and set(value["tags"]) <= {"red", "blue"}


CASES = {
    "json": ({"json": SCHEMA}, _check_json),
    "regex": ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text) or pytest.fail(repr(text))),
    "choice": ({"choice": CHOICES}, lambda text: text in CHOICES or pytest.fail(repr(text))),
    "grammar": ({"grammar": GRAMMAR}, lambda text: re.fullmatch(r"\((?:[1-9][0-9]?\+)*[1-9][0-9]?\)", text)
                or pytest.fail(repr(text))),
    "json_object": ({"json_object": True}, lambda text: isinstance(json.loads(text), (dict, list))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_random_logits_follow_the_constraint(backend, tokenizer, case):
    kwargs, check = CASES[case]
    rng = np.random.default_rng(list(CASES).index(case))
    for _ in range(3):
        grammar = backend.grammar(StructuredOutputsParams(**kwargs), stop_token_ids=[EOS_ID])
        tokens = []
        while not grammar.is_terminated:
            assert len(tokens) < 2000, "the matcher never terminated"
            bitmask = fill_bitmask([(grammar, 1, ())], VOCAB)
            assert bitmask.shape == (1, bitmask_width(VOCAB)) and bitmask.dtype == np.int32
            logits = apply_token_bitmask(random_logits(rng, 1, tokenizer), bitmask)
            assert np.isneginf(logits[0, 512:]).all(), "an id past the tokenizer's vocabulary is allowed"
            token = int(np.argmax(logits[0]))
            grammar.accept(token)
            tokens.append(token)
        assert tokens[-1] == EOS_ID
        check(tokenizer.decode(tokens))


def test_a_forbidden_token_is_an_error(backend, tokenizer):
    grammar = backend.grammar(StructuredOutputsParams(choice=["yes"]), stop_token_ids=[EOS_ID])
    with pytest.raises(RuntimeError, match="must apply SamplingBatch.token_bitmask"):
        grammar.accept(tokenizer.encode("no", add_special_tokens=False)[0])



def test_a_row_that_allows_no_token_is_an_error(backend):
    """A grammar the tokenizer cannot write (a stand-in: its rows allow nothing) fails the step's mask."""
    class Unwritable(Grammar):
        def fill(self, bitmask, row):
            bitmask[row] = 0

    matcher = backend.grammar(StructuredOutputsParams(choice=["yes"]), stop_token_ids=[EOS_ID]).matcher
    assert fill_bitmask([(None, 1, ()), (Grammar(matcher), 2, (EOS_ID,))], VOCAB).any(axis=1).all()
    with pytest.raises(RuntimeError, match="allows no token of the vocabulary"):
        fill_bitmask([(None, 1, ()), (Unwritable(matcher), 2, (EOS_ID,))], VOCAB)

# -- speculative decoding: one row per draft, then rolled back -------------------------------------

def test_verify_rows_follow_the_drafts_and_roll_back(backend, tokenizer):
    params = StructuredOutputsParams(regex=r"[a-z ]+\.")
    ids = tokenizer.encode("the lazy dog.", add_special_tokens=False)
    grammar = backend.grammar(params, stop_token_ids=[EOS_ID])
    k = len(ids) + 2
    drafts = ids + [EOS_ID]   # every draft valid, the last one ends the grammar
    rows = fill_bitmask([(None, 1, ()), (grammar, k + 1, tuple(drafts))], VOCAB)
    assert (rows[0] == -1).all()                 # an unconstrained row
    reference = backend.grammar(params, stop_token_ids=[EOS_ID])
    for j in range(len(drafts)):                 # row j: after drafts 0 .. j - 1
        np.testing.assert_array_equal(rows[1 + j], fill_bitmask([(reference, 1, ())], VOCAB)[0])
        reference.accept(drafts[j])
    assert reference.is_terminated and (rows[1 + len(drafts):] == -1).all()   # past the stop token: unused
    # the matcher rolled back: it accepts the same drafts again
    for token in drafts:
        grammar.accept(token)
    assert grammar.is_terminated

    grammar = backend.grammar(params, stop_token_ids=[EOS_ID])
    bad = ids[:2] + tokenizer.encode("7", add_special_tokens=False) + ids[2:]   # the third draft is refused
    rows = fill_bitmask([(grammar, len(bad) + 1, tuple(bad))], VOCAB)
    assert not (rows[:3] == -1).all(axis=1).any() and (rows[3:] == -1).all()
    np.testing.assert_array_equal(rows[0], fill_bitmask([(grammar, 1, ())], VOCAB)[0])   # rolled back


# -- the engine over a stand-in runner --------------------------------------------------------------

class MaskedRandomRunner(SynchronousRunner):
    """A "model" of random logits; samples greedily after the step's token bitmask (as the kernel does)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.rng, self.masked_steps = tokenizer, np.random.default_rng(0), 0

    def execute(self, step, sampling):
        from m3_engine.runner import SampleResult
        logits = random_logits(self.rng, len(step.logits_indices), self.tokenizer)
        if sampling.token_bitmask is None:
            logits[:, EOS_ID] = -np.inf   # the unconstrained request runs to max_tokens
        else:
            self.masked_steps += 1
            logits[(sampling.token_bitmask == -1).all(axis=1), EOS_ID] = -np.inf
            logits = apply_token_bitmask(logits, sampling.token_bitmask)
        tokens = np.argmax(logits, axis=1).astype(np.int32)
        return SampleResult(tokens=tokens, logprobs=np.zeros(len(tokens), np.float32))

    def close(self):
        pass


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_min": 1}])
def test_engine_constrains_its_requests(tmp_path, speculative):
    from m3_engine.engine import LLMEngine
    from m3_engine.model_config import load_config
    from m3_engine.scheduler import Scheduler, SchedulerConfig
    from m3_engine.speculative import SpeculativeConfig

    path = write_tiny_checkpoint(tmp_path / "m", seed=0)
    config, tokenizer = load_config(path), Tokenizer(path)
    config = dataclasses.replace(config, vocab_size=VOCAB)   # a model vocabulary wider than the tokenizer's
    runner = MaskedRandomRunner(tokenizer)
    engine = LLMEngine(runner, Scheduler(SchedulerConfig(max_batch=8, max_context=1024, num_slots=32),
                                         config, speculative=SpeculativeConfig.from_dict(speculative)),
                       tokenizer=tokenizer)
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        engine.add_request("bad", "hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    assert not engine.has_unfinished_requests()
    requests = {name: SamplingParams(temperature=0, max_tokens=400, structured_outputs=StructuredOutputsParams(**k))
                for name, (k, _) in CASES.items()}
    # the grammar ends the request even when eos does not (ignore_eos)
    requests["choice"] = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True,
                                        structured_outputs=StructuredOutputsParams(choice=CHOICES))
    requests["free"] = SamplingParams(temperature=0, max_tokens=8)
    for name, params in requests.items():
        engine.add_request(name, "the quick brown fox " * 2, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    for name, (_, check) in CASES.items():
        out = done[name].outputs[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] == EOS_ID, (name, out)
        check(out.text)
    assert done["free"].outputs[0].finish_reason == "length"
    assert runner.masked_steps > 0
    if speculative is not None:
        assert engine.stats["spec_draft_tokens"] > 0
