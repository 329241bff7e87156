"""vLLM's SamplingParams fields beyond the sampling kernel's: n, min_tokens, max_tokens=None, bad_words,
prompt_logprobs' plumbing, min_p's range. Cheap: no model runs (a scripted runner samples from the
step's token bitmask); the values of prompt logprobs are checked on the tiny model in
tests/engine/test_engine.py (test_greedy_outputs, test_prompt_logprobs_torch_equals_jax)."""

from __future__ import annotations

import numpy as np
import pytest

from m3_engine import SamplingParams
from m3_engine.buckets import StepBuckets
from m3_engine.engine_core import CoreOutput, TokenLogprobs, bad_words_token_ids, banned_tokens
from m3_engine.llm import LLM
from m3_engine.output_processor import OutputProcessor, child_requests
from m3_engine.runner import SampleResult, SynchronousRunner
from m3_engine.sampling_params import MAX_SEED
from m3_engine.structured_outputs import apply_token_bitmask
from m3_engine.tiny_model import EOS_ID, write_tiny_checkpoint
from m3_engine.tokenizer import load_tokenizer

MAX_CONTEXT = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


# -- validation (vLLM's _verify_args ranges) ----------------------------------------------------------

@pytest.mark.parametrize("kw, message", [
    (dict(n=0), "n: expected an int >= 1, got 0"),
    (dict(min_tokens=-1), "min_tokens: expected an int >= 0, got -1"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens: expected <= max_tokens=4, got 5"),
    (dict(min_p=1.5), "min_p: expected a number in [0, 1], got 1.5"),
    (dict(prompt_logprobs=21), "prompt_logprobs: expected an int in [0, 20], got 21"),
    (dict(prompt_logprobs=-1), "prompt_logprobs: expected an int in [0, 20], got -1"),
    (dict(bad_words=[" "]), "bad_words: expected words with a non-space character"),
    (dict(seed=MAX_SEED, n=2), "seed: expected an int in [0, 9223372036854775806]"),
])
def test_bad_values(kw, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kw)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("kw", [dict(n=1.0), dict(min_tokens="2"), dict(bad_words="word"), dict(bad_words=[3]),
                                dict(max_tokens=2.0)])
def test_bad_types(kw):
    with pytest.raises(TypeError, match=f"^{next(iter(kw))}:"):
        SamplingParams(**kw)


def test_accepted_values():
    p = SamplingParams(n=3, max_tokens=None, min_tokens=2, min_p=1.0, bad_words=("a", " b"), prompt_logprobs=0)
    assert (p.n, p.max_tokens, p.min_tokens, p.min_p, p.bad_words, p.prompt_logprobs) == (3, None, 2, 1.0,
                                                                                         ["a", " b"], 0)
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100   # no max_tokens to exceed
    assert SamplingParams().n == 1 and SamplingParams().min_tokens == 0 and SamplingParams().bad_words == []


# -- n: one fan-out, one fan-in ------------------------------------------------------------------------

def test_child_requests():
    one = SamplingParams(seed=3)
    assert child_requests("r", one) == [("r", one)]
    kids = child_requests("r", SamplingParams(n=3, seed=7, prompt_logprobs=1, temperature=0.5))
    assert [i for i, _ in kids] == ["0_r", "1_r", "2_r"]
    assert [p.seed for _, p in kids] == [7, 8, 9] and all(p.n == 1 and p.temperature == 0.5 for _, p in kids)
    assert [p.prompt_logprobs for _, p in kids] == [1, None, None]
    assert all(p.seed is None for _, p in child_requests("r", SamplingParams(n=2)))


def _core_out(request_id, tokens, reason=None, **kw):
    return CoreOutput(request_id, list(tokens), finish_reason=reason, **kw)


def test_output_processor_fans_in():
    proc = OutputProcessor(None)
    kids = proc.add_request("r", None, [5, 6, 7], SamplingParams(n=2, prompt_logprobs=0), arrival_time=1.0)
    assert [c for c, _ in kids] == ["0_r", "1_r"] and proc.parent_id("1_r") == "r"
    with pytest.raises(ValueError, match="already running"):
        proc.add_request("r", None, [5], SamplingParams(), arrival_time=1.0)
    prompt_lps = [TokenLogprobs([], [], -1.5, 4), TokenLogprobs([], [], -0.5, 1)]
    [out], stopped = proc.process([_core_out("0_r", [9], prompt_logprobs=prompt_lps), _core_out("1_r", [8])], 2.0)
    assert not stopped and out.request_id == "r" and not out.finished
    assert [(c.index, c.token_ids) for c in out.outputs] == [(0, [9]), (1, [8])]
    assert out.prompt_logprobs[0] is None and [list(e) for e in out.prompt_logprobs[1:]] == [[6], [7]]
    assert out.prompt_logprobs[1][6].logprob == -1.5 and out.prompt_logprobs[1][6].rank == 4
    [out], _ = proc.process([_core_out("1_r", [3], "length")], 3.0)
    assert not out.finished and out.outputs[1].finish_reason == "length" and out.outputs[0].finish_reason is None
    assert proc.abort_request("r", 4.0) == ["0_r"] and proc.abort_request("r", 4.0) == []
    assert not proc.requests and proc.parent_id("0_r") is None


def test_stop_strings_wait_for_min_tokens(model_dir):
    """A stop string in the first min_tokens tokens' text does not end the request (vLLM)."""
    tok = load_tokenizer(model_dir)
    ids = tok.encode("ab ab ab ab", add_special_tokens=False)
    text = tok.decode(ids[:1])
    proc = OutputProcessor(tok)
    for min_tokens, expect_stop in ((0, True), (len(ids), False)):
        rid = f"m{min_tokens}"
        proc.add_request(rid, None, [1], SamplingParams(stop=[text], min_tokens=min_tokens, max_tokens=None),
                         arrival_time=0.0)
        [out], stopped = proc.process([_core_out(rid, ids[:1])], 1.0)
        assert (stopped == [rid]) == expect_stop and out.finished == expect_stop
        proc.abort_request(rid, 1.0)


# -- the token bitmask: min_tokens and bad_words --------------------------------------------------------

def test_banned_tokens_rule():
    words = [[11], [20, 21, 22]]
    assert banned_tokens(0, [], 2, [2, 5], words) == [2, 5, 11]          # before min_tokens: the stop ids
    assert banned_tokens(2, [7, 8], 2, [2, 5], words) == [11]            # after: a one-token word only
    assert banned_tokens(3, [9, 20, 21], 0, [], words) == [11, 22]      # the output ends with the prefix
    assert banned_tokens(2, [20, 21], 0, [], words) == [11, 22]
    assert banned_tokens(1, [21], 0, [], words) == [11]                 # too short for the prefix


def test_bad_words_token_ids(model_dir):
    tok = load_tokenizer(model_dir)
    vocab = 512
    got = bad_words_token_ids(tok, ["quick", " brown fox"], vocab)
    plain, spaced = tok.encode("quick", add_special_tokens=False), tok.encode(" quick", add_special_tokens=False)
    assert got[0] == plain
    assert (spaced in got) == (len(spaced) == len(plain) and spaced[0] != plain[0])
    assert tok.encode("brown fox", add_special_tokens=False) in got
    with pytest.raises(ValueError, match="bad_words: needs"):
        bad_words_token_ids(None, ["x"], vocab)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bad_words_token_ids(tok, ["quick"], 3)


class ScriptRunner(SynchronousRunner):
    """Samples ``script[k]`` for output token ``k`` (then ``fallback``) unless the step's token bitmask
    forbids it: then the lowest allowed id >= 3. Records the bitmasks it was given."""
    script: list = []
    bitmasks: list = []
    seeds: set = set()

    def __init__(self, args):
        self.scheduler_config = args.scheduler
        self.vocab = args.config.vocab_size
        self.buckets = StepBuckets.from_config(args.scheduler, args.speculative, pad_prefill=False, pad_decode=False)
        self.on_gpu = False   # precompile off: warm_up is never called

    def execute(self, step, sampling):
        rows = len(step.logits_indices)
        logits = np.full((rows, self.vocab), -1e9, np.float32)
        logits[:, 3:] = -np.arange(3, self.vocab, dtype=np.float32)   # lowest id >= 3 first
        for i, k in enumerate(sampling.counters.tolist()):
            if k < len(self.script):
                logits[i, self.script[k]] = 1.0
        ScriptRunner.seeds.update(sampling.seeds.tolist())
        if sampling.token_bitmask is not None:
            ScriptRunner.bitmasks.append(sampling.token_bitmask.copy())
            logits = apply_token_bitmask(logits, sampling.token_bitmask)
        tokens = logits.argmax(axis=1).astype(np.int32)
        return SampleResult(tokens=tokens, logprobs=np.zeros(rows, np.float32))

    def close(self):
        pass


class ScriptLLM(LLM):
    framework = "script"

    @classmethod
    def _runner_class(cls):
        return ScriptRunner


@pytest.fixture(scope="module")
def script_llm(model_dir):
    llm = ScriptLLM(model_dir, device="cpu", max_num_seqs=4, max_model_len=MAX_CONTEXT)
    yield llm
    llm.close()


def _run(llm, script, params, prompt=(1, 30, 31)):
    ScriptRunner.script, ScriptRunner.bitmasks = list(script), []
    [out] = llm.generate({"prompt_token_ids": list(prompt)}, params, use_tqdm=False)
    return out


def test_min_tokens_masks_eos_and_stop_ids(script_llm):
    out = _run(script_llm, [EOS_ID] * 4, SamplingParams(min_tokens=3, max_tokens=8)).outputs[0]
    assert out.token_ids == [3, 3, 3, EOS_ID] and out.finish_reason == "stop"
    assert len(ScriptRunner.bitmasks) == 3   # only the steps before min_tokens carry a mask
    out = _run(script_llm, [7] * 4, SamplingParams(min_tokens=2, stop_token_ids=[7], ignore_eos=True,
                                                  max_tokens=8)).outputs[0]
    assert out.token_ids == [3, 3, 7] and (out.finish_reason, out.stop_reason) == ("stop", 7)
    plain = _run(script_llm, [EOS_ID], SamplingParams(max_tokens=8)).outputs[0]
    assert plain.token_ids == [EOS_ID] and not ScriptRunner.bitmasks   # no mask: the bitmask is None


def test_bad_words_single_and_multi_token(script_llm):
    tok = script_llm.get_tokenizer()
    word = next(w for w in (tok.decode([t]) for t in range(100, 500))   # a word that is one token
                if w.isalpha() and len(tok.encode(w, add_special_tokens=False)) == 1)
    [single] = tok.encode(word, add_special_tokens=False)
    multi = next(ids for w in ("the lazy dog", "quick brown", "prompt split")
                 for ids in [tok.encode(w, add_special_tokens=False)] if len(ids) >= 2)
    out = _run(script_llm, [single, *multi, *multi], SamplingParams(
        max_tokens=1 + 2 * len(multi), bad_words=[word, tok.decode(multi)], ignore_eos=True)).outputs[0]
    assert single not in out.token_ids and out.token_ids[0] == 3
    assert out.token_ids[1:len(multi)] == multi[:-1] and out.token_ids[len(multi)] != multi[-1]


def test_max_tokens_none_reaches_the_context_end(script_llm):
    prompt = [1] + list(range(30, 40))
    out = _run(script_llm, [], SamplingParams(max_tokens=None, ignore_eos=True), prompt=prompt)
    assert len(out.outputs[0].token_ids) == MAX_CONTEXT - len(prompt) and out.outputs[0].finish_reason == "length"


def test_n_completions_share_one_request(script_llm):
    ScriptRunner.seeds = set()
    [out] = script_llm.generate({"prompt_token_ids": [1, 30]}, SamplingParams(n=3, max_tokens=2, seed=5),
                                use_tqdm=False)
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 2 for c in out.outputs) and ScriptRunner.seeds == {5, 6, 7}
    assert not script_llm.engine.has_unfinished_requests()
