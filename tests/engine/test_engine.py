"""The engine contract of ``m3_torch.LLM`` and ``m3_jax.LLM`` (vLLM's API), on the tiny checkpoint.

Tests that run the model are parametrized over both frameworks (``eng``) or
compare the two (``both``); each framework has one module-scoped engine
(construction and JAX compilation cost seconds; on the CPU a model step runs
the kernels in Triton's interpreter), and a second one of another
``max_num_seqs`` for batch invariance. Expected values come from the tokenizer
and from transformers' greedy reference (``hf_reference``: cheap, plain
PyTorch), so a test runs only its own requests (pytest-xdist may give the
tests of one engine to different workers). Every comparison asserts how many
tokens it compared.

The main engine has ``graph_batch_sizes=[4]`` (JAX compiles one decode step;
torch on the CPU pads nothing) and ``max_model_len=64`` (a prompt filling the
context is a cheap prefill; not a multiple of the 128-token page). A JAX
compilation costs about as much as four steps, so most multi-prompt batches are
four (or three) prompts of 6 tokens with logprobs asked by one row: one
compiled prefill and one decode step serve them.
"""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch

import m3_engine
import m3_jax
import m3_torch
from m3_engine import SamplingParams
from m3_engine.tiny_model import BOS_ID, EOS_ID, write_tiny_checkpoint
from m3_kernels import planner

import hf_reference

FRAMEWORKS = ("torch", "jax")
LLM_CLASSES = {"torch": m3_torch.LLM, "jax": m3_jax.LLM}
MAX_CONTEXT = 64
ENGINE_KW = dict(device="cpu", max_num_seqs=4, max_model_len=MAX_CONTEXT, graph_batch_sizes=[4], seed=0)
ENGINE2_KW = dict(device="cpu", max_num_seqs=2, max_model_len=MAX_CONTEXT, graph_batch_sizes=[2], seed=0)

# prompts whose greedy continuations have top-2 margins >= 0.02 (no near-ties between the frameworks)
PROMPTS = ["The quick brown fox", "A prompt is split", "Each request owns"]
STOP_PROMPT = "best sixteen blocks"  # greedy text "yerew M...": the stop string "w " spans tokens 1 and 2
EOS_PROMPT = "est"                 # greedy: eos (id 2) is the first token (transformers' reference says so)
PENALTY_PROMPT = "the lazy dog"    # greedy repeats one token: the penalties change the output
FIRST = (PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=2))   # each engine's first request: unseeded
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, seed=1234, max_tokens=3)
LARGE_SEED = 2 ** 40 + 7           # a seed beyond int32
GREEDY_TOKENS = 3
NEAR_TIE = 1e-3


# -- engines -------------------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class Eng:
    """One engine, the output of its first (unseeded) request, and results computed once."""
    framework: str
    llm: object
    first: object
    memo: dict = dataclasses.field(default_factory=dict)

    def once(self, key, fn):
        if key not in self.memo:
            self.memo[key] = fn(self)
        return self.memo[key]

    @property
    def tokenizer(self):
        return self.llm.get_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def engines(model_dir):
    """``engines(framework, second=False)``: that framework's engine (``ENGINE_KW``, or ``ENGINE2_KW``
    for the second), built on first use and closed when the module ends. Each engine's first request
    is unseeded: a fresh engine with the same ``seed=`` repeats it."""
    made: dict = {}

    def get(framework: str, second: bool = False) -> Eng:
        if (framework, second) not in made:
            llm = LLM_CLASSES[framework](model_dir, **(ENGINE2_KW if second else ENGINE_KW))
            [first] = llm.generate(FIRST[0], FIRST[1], use_tqdm=False)
            made[framework, second] = Eng(framework, llm, first)
        return made[framework, second]

    yield get
    for e in made.values():
        e.llm.close()


@pytest.fixture(scope="module", params=FRAMEWORKS)
def eng(request, engines) -> Eng:
    return engines(request.param)


@pytest.fixture
def eng2(eng, engines) -> Eng:
    """The second engine of ``eng``'s framework (max_num_seqs=2, the same seed=0)."""
    return engines(eng.framework, second=True)


@pytest.fixture(scope="module")
def both(engines) -> tuple:
    return engines("torch"), engines("jax")


def _idle(llm) -> bool:
    """No request left and every page free."""
    s = llm.engine.scheduler
    return not llm.engine.has_unfinished_requests() and s.num_free_slots == s.config.num_slots


# -- expectations ----------------------------------------------------------------------------------

def hf_greedy(model_dir, tokenizer, prompt, n) -> list:
    """transformers' greedy tokens (stopping at eos), asserted free of near-ties."""
    ref = hf_reference.reference_generate(model_dir, tokenizer.encode(prompt), n)
    assert min(ref.margins) > NEAR_TIE, f"{prompt!r}: a near-tie in the reference; pick another prompt"
    return ref.tokens


def hf_logits(model_dir, prompt_ids, tokens) -> torch.Tensor:
    """transformers' float64 logits that chose each of ``tokens`` after ``prompt_ids``: [len(tokens), V]."""
    logits = hf_reference.reference_prompt_logits(model_dir, list(prompt_ids) + list(tokens)).double()
    return logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(tokens)]


def spanning_stop(tokenizer, ids) -> tuple:
    """-> (k, s): a stop string ``s`` of two characters, the last of token k's text and the first of
    token k+1's, that first appears there in the full text (so a request stops at token k+1)."""
    full = tokenizer.decode(ids)
    for k in range(1, len(ids) - 2):
        before, a, b = (tokenizer.decode(ids[:n]) for n in (k, k + 1, k + 2))
        if not (len(before) < len(a) < len(b) and full.startswith(b) and b.startswith(a)):
            continue
        s = a[-1] + b[len(a)]
        if "\ufffd" not in s and s.isprintable() and full.find(s) == len(a) - 1:
            return k, s
    raise AssertionError(f"no stop string spanning two tokens in {full!r} ({ids}): pick other PROMPTS")


def compare_tokens(a, b) -> int:
    """Assert two token lists are equal; -> how many tokens were compared (> 0)."""
    assert list(a) == list(b)
    assert len(a) > 0
    return len(a)


# -- the API without an engine ------------------------------------------------------------------------

def test_sampling_params_names_and_defaults():
    assert m3_torch.SamplingParams is m3_jax.SamplingParams is m3_engine.SamplingParams
    p = SamplingParams()
    expected = dict(max_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=None, ignore_eos=False,
                    logprobs=None, include_stop_str_in_output=False, repetition_penalty=1.0, presence_penalty=0.0,
                    frequency_penalty=0.0)
    assert {k: getattr(p, k) for k in expected} == expected
    assert not p.stop and not p.stop_token_ids
    assert SamplingParams(stop="ab").stop == ["ab"]
    assert SamplingParams(stop=("ab", "c")).stop == ["ab", "c"]
    assert SamplingParams(temperature=0).greedy and not p.greedy
    for off in (-1, 0):
        assert SamplingParams(top_k=off).top_k == off
    assert SamplingParams(seed=2 ** 63 - 1).seed == 2 ** 63 - 1


BAD_SAMPLING = [dict(seed=-2), dict(temperature=float("inf")), dict(temperature=-1), dict(top_p=0),
                dict(top_k=-2), dict(min_p=1.5), dict(max_tokens=0), dict(logprobs=21), dict(stop=[""]),
                dict(repetition_penalty=0), dict(presence_penalty=2.5), dict(temperature=float("nan")),
                dict(seed=2 ** 63)]


@pytest.mark.parametrize("kw", BAD_SAMPLING, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_bad_sampling_params_same_error(kw):
    errors = []
    for cls in (m3_torch.SamplingParams, m3_jax.SamplingParams):
        with pytest.raises(ValueError) as info:
            cls(**kw)
        errors.append(str(info.value))
    assert errors[0] == errors[1]
    assert errors[0].startswith(next(iter(kw)) + ":")   # the message names the field


BAD_ENGINE = [dict(seed=-2), dict(dtype="bf16"), dict(dtype=3), dict(device="cuda"), dict(device="tpu"),
              dict(max_num_seqs=0), dict(max_model_len=10 ** 6), dict(kv_cache_dtype="int4"),
              dict(tensor_parallel_size=0), dict(enforce_eager="yes"), dict(num_gpu_blocks_override=0),
              dict(gpu_memory_utilization=1.5), dict(quantization="awq"), dict(enable_expert_parallel=True),
              dict(max_batch=4)]


@pytest.mark.parametrize("kw", BAD_ENGINE, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_bad_engine_args_same_error(model_dir, kw):
    """Checked before any weights load; the same exception and message from both frameworks."""
    if kw.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    [name] = kw
    errors = []
    for cls in LLM_CLASSES.values():
        with pytest.raises(Exception) as info:
            cls(model_dir, **{"device": "cpu", "max_num_seqs": 1, "max_model_len": MAX_CONTEXT, **kw})
        errors.append(info.value)
    assert type(errors[0]) is type(errors[1]) and type(errors[0]) in (ValueError, TypeError)
    assert str(errors[0]) == str(errors[1])
    assert str(errors[0]).startswith(name + ":")
    if name == "device":
        assert type(errors[0]) is ValueError


def _copy_model(model_dir, dst):
    shutil.copytree(model_dir, dst)
    return dst


def test_bad_files_same_error(model_dir, tmp_path):
    bad_json = _copy_model(model_dir, tmp_path / "bad_json")
    lines = (bad_json / "config.json").read_text().splitlines()
    lines[3] = lines[3].rstrip(",") + " oops,"   # line 4 of the file
    (bad_json / "config.json").write_text("\n".join(lines))
    truncated = _copy_model(model_dir, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:len(data) // 3])
    for folder, named, where in ((bad_json, "config.json", "line 4"), (truncated, "model.safetensors", "")):
        errors = []
        for cls in LLM_CLASSES.values():
            with pytest.raises(ValueError) as info:
                cls(folder, device="cpu", max_num_seqs=1, max_model_len=MAX_CONTEXT)
            errors.append(str(info.value))
        assert errors[0] == errors[1]
        assert str(folder / named) in errors[0] and where in errors[0]


def test_no_tokenizer_text_prompt_is_an_error(model_dir, tmp_path):
    folder = _copy_model(model_dir, tmp_path / "no_tokenizer")
    (folder / "tokenizer.json").unlink()
    errors = []
    for cls in LLM_CLASSES.values():
        llm = cls(folder, device="cpu", max_num_seqs=1, max_model_len=MAX_CONTEXT)
        try:
            assert llm.get_tokenizer() is None
            for call in (lambda: llm.generate("Hello", use_tqdm=False),
                         lambda: llm.generate([{"prompt": "Hello"}], use_tqdm=False),
                         lambda: llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)):
                with pytest.raises(ValueError) as info:
                    call()
                errors.append(str(info.value))
            assert _idle(llm)
        finally:
            llm.close()
    assert errors[:3] == errors[3:]
    assert all("tokenizer.json" in e for e in errors)


def test_close_frees_the_weights_and_the_pool(model_dir):
    """close() drops the engine's device state (a next engine in the process can take its memory); the
    LLM refuses work after it."""
    import gc
    import weakref

    llm = LLM_CLASSES["torch"](model_dir, device="cpu", max_num_seqs=1, max_model_len=MAX_CONTEXT)
    pool, embed = weakref.ref(llm.runner.pool), weakref.ref(llm.runner.model.embed)
    llm.close()
    gc.collect()
    assert pool() is None and embed() is None
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2, 3]], use_tqdm=False)


@pytest.mark.long
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_no_tokenizer_token_ids_generate(model_dir, tmp_path, framework):
    folder = _copy_model(model_dir, tmp_path / "no_tokenizer")
    (folder / "tokenizer.json").unlink()
    with LLM_CLASSES[framework](folder, device="cpu", max_num_seqs=1, max_model_len=MAX_CONTEXT) as llm:
        [out] = llm.generate([BOS_ID, 294], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                             use_tqdm=False)
    assert out.prompt is None and out.prompt_token_ids == [BOS_ID, 294]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].text == ""
    assert out.outputs[0].finish_reason == "length"


# -- greedy generation -----------------------------------------------------------------------------

def greedy_batch(e: Eng) -> list:
    """The three prompts in one greedy batch, with top-3 logprobs; the first also asks top-2 prompt logprobs."""
    params = [SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, logprobs=3,
                             prompt_logprobs=2 if i == 0 else None) for i in range(len(PROMPTS))]
    return e.once("greedy", lambda e: e.llm.generate(PROMPTS, params, use_tqdm=False))


def test_greedy_outputs(eng, model_dir):
    """Input order, prompt fields (BOS from the tokenizer files), text == decode(token_ids), metrics;
    the tokens are transformers' greedy ones and the logprobs its raw log-softmax."""
    outs = greedy_batch(eng)
    tok = eng.tokenizer
    assert len(outs) == len(PROMPTS)
    assert len({o.request_id for o in outs}) == len(PROMPTS)
    checked = 0
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt == prompt
        assert out.prompt_token_ids == tok.encode(prompt) and out.prompt_token_ids[0] == BOS_ID
        assert out.finished and len(out.outputs) == 1
        c = out.outputs[0]
        assert c.finish_reason == "length" and c.stop_reason is None
        assert c.text == tok.decode(c.token_ids)
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        compare_tokens(c.token_ids, hf_greedy(eng.llm.args.model_dir, tok, prompt, GREEDY_TOKENS))
        logsm = torch.log_softmax(hf_logits(model_dir, out.prompt_token_ids, c.token_ids), dim=-1)
        assert len(c.logprobs) == GREEDY_TOKENS
        total = 0.0
        for i, (t, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert t in entry and len(entry) == 3 and entry[t].rank == 1
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
            assert [lp.rank for _, lp in ranked] == [1, 2, 3]
            values = [lp.logprob for _, lp in ranked]
            assert values == sorted(values, reverse=True)
            np.testing.assert_allclose(values, logsm[i].topk(3).values.numpy(), atol=2e-3)
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(float(logsm[i, tid]), abs=2e-3)
                assert lp.decoded_token == tok.decode([tid], skip_special_tokens=False)
            total += entry[t].logprob
            checked += 1
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert checked == GREEDY_TOKENS * len(PROMPTS)
    assert outs[1].prompt_logprobs is None and outs[2].prompt_logprobs is None
    assert _check_prompt_logprobs(model_dir, outs[0], 2, tok) == len(outs[0].prompt_token_ids) - 1
    assert _idle(eng.llm)


def _check_prompt_logprobs(model_dir, out, n, tok) -> int:
    """``out.prompt_logprobs`` (top ``n``) against a float64 log-softmax of transformers' logits of the
    prompt; -> positions checked."""
    ids = out.prompt_token_ids
    logsm = torch.log_softmax(hf_reference.reference_prompt_logits(model_dir, ids).double(), dim=-1)
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for p, entry in enumerate(out.prompt_logprobs[1:]):
        row, t = logsm[p], ids[p + 1]
        top = row.topk(n)
        assert t in entry and len(entry) in (n, n + 1)
        assert [entry[int(i)].rank for i in top.indices] == list(range(1, n + 1))
        assert entry[t].rank == int((row > row[t]).sum()) + 1
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(float(row[tid]), abs=2e-3)
            assert lp.decoded_token == tok.decode([tid], skip_special_tokens=False)
    return len(ids) - 1


def test_prompt_logprobs_torch_equals_jax(both):
    """The greedy batch's prompt logprobs: the same entries in torch and JAX (ranks exactly)."""
    a, b = (greedy_batch(e)[0].prompt_logprobs for e in both)
    assert len(a) == len(b) > 1 and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:]):
        assert x.keys() == y.keys()
        assert all(x[t].rank == y[t].rank and x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4) for t in x)


def test_prompt_forms(eng):
    """A text, token ids, {"prompt"} and {"prompt_token_ids"}: the same prompt, the same token and
    logprobs, in input order (four prompts of 6 tokens: the greedy batch's compiled JAX step)."""
    tok = eng.tokenizer
    ids = tok.encode(PROMPTS[0])
    prompts = [PROMPTS[0], ids, {"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}]
    outs = eng.llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=3), use_tqdm=False)
    assert [o.prompt for o in outs] == [PROMPTS[0], None, PROMPTS[0], None]
    assert all(o.prompt_token_ids == ids for o in outs)
    first = outs[0].outputs[0]
    n = sum(compare_tokens(o.outputs[0].token_ids, first.token_ids) for o in outs)
    assert n == 4
    assert all(o.outputs[0].logprobs[0].keys() == first.logprobs[0].keys() for o in outs)
    assert all(o.outputs[0].text == first.text for o in outs)
    assert _idle(eng.llm)


def test_steps_are_padded_and_planned_once(eng, monkeypatch):
    """The step builder pads each step with the runner's policy (``runner.buckets``: JAX pads the
    prefill step to a token bucket, torch runs it as it is) and plans it once; the runner plans
    nothing. Every step's shape is one the policy lists."""
    planned, plan = [], planner.StepPlanner.plan
    monkeypatch.setattr(planner.StepPlanner, "plan", lambda self, *a, **kw: planned.append(self) or plan(self, *a, **kw))
    steps, submit = [], eng.llm.runner.submit
    monkeypatch.setattr(eng.llm.runner, "submit",
                        lambda step, sampling, previous=None: steps.append(step) or submit(step, sampling, previous))
    [out] = eng.llm.generate(FIRST[0], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(steps) == 2 and not steps[0].is_decode and steps[1].is_decode
    assert len(planned) == 2 and all(p is eng.llm.planner for p in planned)
    prompt_len = len(out.prompt_token_ids)
    assert steps[0].num_tokens == (8 if eng.framework == "jax" else prompt_len) and prompt_len < 8
    shapes = set(eng.llm.runner.buckets.shapes())
    for step in steps:
        p = step.plan
        assert (p.context.num_rows, p.context.num_tokens, p.generation.num_rows, p.generation.decode_query_len) \
            in shapes


def test_eos_and_single_prompts(eng):
    """One text prompt and one prompt of token ids (not lists of prompts) -> one output each. The greedy
    model emits eos: finish_reason "stop", stop_reason None, eos in token_ids, not in the text (not even
    with skip_special_tokens=False: the stop token's text is left out, as vLLM's). With ignore_eos it goes
    on to max_tokens ("length"); skip_special_tokens=False then shows eos in the text."""
    ids = eng.tokenizer.encode(EOS_PROMPT)
    expected = hf_reference.reference_generate(eng.llm.args.model_dir, ids, 1).tokens
    assert expected == [EOS_ID], "the reference no longer emits eos first: pick another EOS_PROMPT"
    outs = eng.llm.generate(EOS_PROMPT, SamplingParams(temperature=0, max_tokens=4, skip_special_tokens=False),
                            use_tqdm=False)
    assert len(outs) == 1 and outs[0].prompt == EOS_PROMPT
    c = outs[0].outputs[0]
    assert compare_tokens(c.token_ids, expected) == 1
    assert c.finish_reason == "stop" and c.stop_reason is None and c.text == ""
    outs = eng.llm.generate(ids, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                skip_special_tokens=False), use_tqdm=False)
    assert len(outs) == 1 and outs[0].prompt is None and outs[0].prompt_token_ids == ids
    c = outs[0].outputs[0]
    assert c.token_ids[0] == EOS_ID and len(c.token_ids) == 2
    assert c.finish_reason == "length" and c.stop_reason is None
    assert c.text == eng.tokenizer.decode(c.token_ids, skip_special_tokens=False) and c.text.startswith("</s>")
    assert _idle(eng.llm)


def test_sampling_params_list(eng):
    llm = eng.llm
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(PROMPTS, [SamplingParams(max_tokens=1)] * 2, use_tqdm=False)
    with pytest.raises(TypeError):
        llm.generate(PROMPTS[0], {"max_tokens": 1}, use_tqdm=False)
    assert llm.generate([], use_tqdm=False) == []
    assert _idle(llm)


def test_bad_prompts_queue_nothing(eng):
    llm = eng.llm
    with pytest.raises(ValueError, match=f"max_model_len={MAX_CONTEXT}"):
        llm.generate([list(range(3, 3 + MAX_CONTEXT + 1))], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):   # the bad one is last: the first is dequeued again
        llm.generate([PROMPTS[0], "x" * 300], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[BOS_ID, 512]], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises((TypeError, ValueError)):
        llm.generate([{"text": "x"}], use_tqdm=False)
    for bad in (True, 5.0, "5"):   # the id check looks at every element's type, not only the first
        with pytest.raises(TypeError, match="int token ids"):
            llm.generate([[BOS_ID, 5, bad, 6]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert _idle(llm)


def test_prompt_fills_the_context(eng):
    """len(prompt) == max_model_len: exactly one token, finish_reason "length" (whatever max_tokens)."""
    prompt = [BOS_ID] + [3 + i % 500 for i in range(MAX_CONTEXT - 1)]
    [out] = eng.llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                             use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1
    assert out.outputs[0].finish_reason == "length"
    assert _idle(eng.llm)


# -- stops -----------------------------------------------------------------------------------------

def test_stop_strings_and_stop_tokens(eng):
    """A stop string (spanning two tokens) is cut from the text, or kept with include_stop_str_in_output;
    the request ends at the token completing it, whose id stays (with its logprobs); a stop token id is
    kept in token_ids and is the stop_reason, its text left out of the text (vLLM's rule); a stop string
    before a stop token wins."""
    tok, model_dir = eng.tokenizer, eng.llm.args.model_dir
    ids0 = hf_greedy(model_dir, tok, STOP_PROMPT, 8)
    ids1 = hf_greedy(model_dir, tok, PROMPTS[1], 8)
    full0 = tok.decode(ids0)
    k, s = spanning_stop(tok, ids0)
    x = ids1[2]
    later = next(t for t in ids0[k + 2:] if t not in ids0[:k + 2])
    params = [SamplingParams(temperature=0, max_tokens=8, stop=s, logprobs=3),
              SamplingParams(temperature=0, max_tokens=8, stop=["never seen", s], include_stop_str_in_output=True),
              SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[x]),
              SamplingParams(temperature=0, max_tokens=8, stop=s, stop_token_ids=[later])]
    outs = eng.llm.generate([STOP_PROMPT, STOP_PROMPT, PROMPTS[1], STOP_PROMPT], params, use_tqdm=False)
    cut, kept, by_token, first_wins = (o.outputs[0] for o in outs)
    j = full0.find(s)
    n = compare_tokens(cut.token_ids, ids0[:k + 2])
    assert cut.text == full0[:j] and cut.finish_reason == "stop" and cut.stop_reason == s
    assert len(cut.logprobs) == k + 2 and all(t in e for t, e in zip(cut.token_ids, cut.logprobs))
    n += compare_tokens(kept.token_ids, ids0[:k + 2])
    assert kept.text == full0[:j + len(s)] and kept.text.endswith(s)
    assert kept.finish_reason == "stop" and kept.stop_reason == s
    i = ids1.index(x)
    n += compare_tokens(by_token.token_ids, ids1[:i + 1])
    assert by_token.finish_reason == "stop" and by_token.stop_reason == x
    assert by_token.text == tok.decode(ids1[:i]) != tok.decode(ids1[:i + 1])
    n += compare_tokens(first_wins.token_ids, ids0[:k + 2])
    assert first_wins.stop_reason == s
    assert n == 3 * (k + 2) + i + 1
    assert _idle(eng.llm)


def test_stop_token_adds_no_text(model_dir):
    """The output processor alone: the eos or stop_token_ids id that ended a request stays in token_ids
    and adds no text, even with skip_special_tokens=False (vLLM's detokenizer); with
    include_stop_str_in_output it does; an eos that did not end the request (ignore_eos) is text."""
    from m3_engine.engine_core import CoreOutput
    from m3_engine.output_processor import OutputProcessor
    from m3_engine.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    ids = tok.encode("The quick brown fox", add_special_tokens=False)
    word = ids[-1]   # a stop token that is a plain word
    cases = {   # name: (params, the core's tokens, finish_reason, stop_reason, the expected text)
        "eos": (SamplingParams(skip_special_tokens=False), ids + [EOS_ID], "stop", None, tok.decode(ids)),
        "kept": (SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True), ids + [EOS_ID], "stop",
                 None, tok.decode(ids) + "</s>"),
        "word": (SamplingParams(stop_token_ids=[word]), ids, "stop", word, tok.decode(ids[:-1])),
        "through": (SamplingParams(skip_special_tokens=False, ignore_eos=True), [EOS_ID] + ids, "length", None,
                    "</s>" + tok.decode(ids)),
    }
    processor = OutputProcessor(tok)
    for name, (params, tokens, reason, stop_reason, _) in cases.items():
        processor.add_request(name, None, [BOS_ID], params, arrival_time=0.0)
        *steps, last = [CoreOutput(name, [t]) for t in tokens]   # one token per step
        last.finish_reason, last.stop_reason = reason, stop_reason
        outputs = [processor.process([step], 0.0)[0][0] for step in [*steps, last]]
        c = outputs[-1].outputs[0]
        assert (c.text, c.token_ids, c.finish_reason) == (cases[name][4], tokens, reason), name
    assert not processor.requests


# -- streaming -------------------------------------------------------------------------------------

def test_generate_stream(eng):
    """Text and token ids grow; the deltas concatenate to the final text; a stop string spanning two
    tokens is never streamed, even in part; the last output is finished."""
    tok = eng.tokenizer
    ids = hf_greedy(eng.llm.args.model_dir, tok, STOP_PROMPT, 8)
    full = tok.decode(ids)
    k, s = spanning_stop(tok, ids)
    outs = list(eng.llm.generate_stream(STOP_PROMPT, SamplingParams(temperature=0, max_tokens=8, stop=[s])))
    assert len(outs) == k + 2
    deltas, text = [], ""
    for i, out in enumerate(outs):
        c = out.outputs[0]
        assert len(c.token_ids) == i + 1
        assert c.text.startswith(text)
        deltas.append(c.text[len(text):])
        text = c.text
        assert out.finished == (i == len(outs) - 1)
        assert len(c.text) <= full.find(s)   # not even the stop string's first character
    final = outs[-1].outputs[0]
    assert "".join(deltas) == final.text == full[:full.find(s)]
    assert final.finish_reason == "stop" and final.stop_reason == s
    assert compare_tokens(final.token_ids, ids[:k + 2]) == k + 2
    assert _idle(eng.llm)


def test_generate_stream_break_aborts(eng):
    """Leaving the loop early aborts the request and frees its pages. Also: sampling_params=None takes
    the engine's generation_config defaults (set to greedy here)."""
    llm = eng.llm
    expected = hf_greedy(llm.args.model_dir, eng.tokenizer, PROMPTS[1], 2)
    saved = dict(llm.engine.generation_defaults)
    llm.engine.generation_defaults.update(temperature=0.0, max_tokens=50)
    try:
        seen = []
        for out in llm.generate_stream(PROMPTS[1]):
            seen.append(out)
            if len(seen) == 2:
                break
    finally:
        llm.engine.generation_defaults.clear()
        llm.engine.generation_defaults.update(saved)
    assert _idle(llm)
    assert not seen[-1].finished
    assert compare_tokens(seen[-1].outputs[0].token_ids, expected) == 2


# -- the engine loop -------------------------------------------------------------------------------

def test_engine_loop_and_abort(eng):
    """add_request / step / abort_request / has_unfinished_requests; a duplicate id is an error; an
    abort frees the request's pages at once; outputs are cumulative."""
    llm, engine = eng.llm, eng.llm.engine
    expected = hf_greedy(llm.args.model_dir, eng.tokenizer, PROMPTS[1], 3)
    num_slots = engine.scheduler.config.num_slots
    waiting = [engine.add_request(f"w{i}", PROMPTS[0], SamplingParams(max_tokens=2)) for i in range(6)]
    assert waiting == [f"w{i}" for i in range(6)] and engine.get_num_unfinished_requests() == 6
    engine.abort_request(waiting)   # never scheduled (two of them could not even be admitted)
    assert _idle(llm)
    engine.add_request("a", PROMPTS[1], SamplingParams(temperature=0, max_tokens=3))
    engine.add_request("b", PROMPTS[2], SamplingParams(temperature=0, max_tokens=8))
    try:
        with pytest.raises(ValueError, match="'a'"):
            engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=1))
        assert engine.get_num_unfinished_requests() == 2
        first = {o.request_id: o for o in engine.step()}
        assert set(first) == {"a", "b"} and not any(o.finished for o in first.values())
        assert engine.scheduler.num_free_slots == num_slots - 2
        engine.abort_request("b")
        assert engine.scheduler.num_free_slots == num_slots - 1   # at once
        assert engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 1
        stream = [first["a"]]
        while engine.has_unfinished_requests():
            outs = engine.step()
            assert [o.request_id for o in outs] == ["a"]
            stream += outs
    finally:
        engine.abort_request(["a", "b"])
    assert [len(o.outputs[0].token_ids) for o in stream] == [1, 2, 3]
    assert [o.finished for o in stream] == [False, False, True]
    assert compare_tokens(stream[-1].outputs[0].token_ids, expected) == 3
    assert stream[-1].outputs[0].finish_reason == "length"
    assert _idle(llm)
    engine.abort_request("no such id")   # ignored
    engine.add_request("a", PROMPTS[1], SamplingParams(max_tokens=1))   # a finished id can be used again
    engine.abort_request("a")
    assert _idle(llm)


# -- chat ------------------------------------------------------------------------------------------

CONVERSATIONS = [[{"role": "user", "content": "Hi"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(model_dir)


def _hf_ids(hf_tokenizer, messages, **kw) -> list:
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, **kw)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_matches_transformers(eng, hf_tokenizer):
    params = SamplingParams(temperature=0, max_tokens=1)
    outs = eng.llm.chat(CONVERSATIONS, params, use_tqdm=False)
    assert len(outs) == 2
    for conversation, out in zip(CONVERSATIONS, outs):
        assert out.prompt == hf_tokenizer.apply_chat_template(conversation, tokenize=False,
                                                              add_generation_prompt=True)
        assert out.prompt.endswith("assistant:")
        assert out.prompt_token_ids == _hf_ids(hf_tokenizer, conversation, add_generation_prompt=True)
        assert out.prompt_token_ids.count(BOS_ID) == 1   # the template writes BOS: not added twice
        assert len(out.outputs[0].token_ids) == 1
    assert _idle(eng.llm)


def test_chat_custom_template_and_bad_role(eng, hf_tokenizer):
    """chat_template= wins over the folder's; add_generation_prompt=False reaches the template; one
    conversation (not a list of them); an unknown role raises (the tiny template's raise_exception)."""
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    [out] = eng.llm.chat(CONVERSATIONS[0], SamplingParams(temperature=0, max_tokens=1), chat_template=template,
                         add_generation_prompt=False, use_tqdm=False)
    assert out.prompt == "<s>[user] Hi" == hf_tokenizer.apply_chat_template(
        CONVERSATIONS[0], chat_template=template, tokenize=False, add_generation_prompt=False)
    assert out.prompt_token_ids == eng.tokenizer.encode("<s>[user] Hi", add_special_tokens=False)
    assert out.prompt_token_ids[0] == BOS_ID and out.prompt_token_ids.count(BOS_ID) == 1
    with pytest.raises(Exception, match="unknown role: robot"):
        eng.llm.chat([{"role": "robot", "content": "Hi"}], use_tqdm=False)
    with pytest.raises(Exception, match="unknown role: robot"):   # the bad conversation is the second one
        eng.llm.chat([CONVERSATIONS[0], [{"role": "robot", "content": "Hi"}]], use_tqdm=False)
    assert _idle(eng.llm)


# -- seeded sampling -------------------------------------------------------------------------------

def staggered_run(e: Eng) -> dict:
    """The engine loop: a seeded request runs one step alone, then an unseeded one (the twin of the
    engine's first request) and SEEDED join (third in the batch, in a mixed prefill + decode step).
    -> request id -> its outputs."""
    def run(e):
        engine = e.llm.engine
        engine.add_request("x", PROMPTS[1], SamplingParams(temperature=1.0, seed=7, max_tokens=4))
        outputs = {"x": [], "y": [], "s": []}
        for out in engine.step():
            outputs[out.request_id].append(out)
        engine.add_request("y", FIRST[0], FIRST[1])
        engine.add_request("s", PROMPTS[0], SEEDED)
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id].append(out)
        return outputs
    return e.once("staggered", run)


@pytest.mark.long
def test_seeded_request_ignores_the_batch(eng, eng2):
    """SEEDED gives the same tokens alone on an engine of another max_num_seqs and third of three requests
    streamed by one loop (joining mid-flight). Unseeded requests draw from the engine's seed= and their
    arrival number: the first request of two fresh engines with seed=0 repeats, a later twin differs."""
    assert compare_tokens(eng.first.outputs[0].token_ids, eng2.first.outputs[0].token_ids) == 2
    outputs = staggered_run(eng)
    for rid, outs in outputs.items():
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, len(outs) + 1)), rid
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], rid
        assert outs[-1].outputs[0].finish_reason == "length"
        assert outs[-1].outputs[0].text == eng.tokenizer.decode(outs[-1].outputs[0].token_ids)
    assert _idle(eng.llm)
    [alone] = eng2.once("seeded", lambda e: e.llm.generate(PROMPTS[0], SEEDED, use_tqdm=False))
    joined = outputs["s"][-1].outputs[0].token_ids
    assert compare_tokens(joined, alone.outputs[0].token_ids) == SEEDED.max_tokens
    twin = outputs["y"][-1].outputs[0].token_ids
    assert len(twin) == 2 and twin != eng.first.outputs[0].token_ids
    assert _idle(eng2.llm)


def sampled_params() -> list:
    """Seeded sampling requests with the filters on in different combinations; the last seed is
    beyond int32."""
    return [SEEDED,
            SamplingParams(temperature=1.0, seed=5, max_tokens=3, logprobs=0),
            SamplingParams(temperature=0.8, top_k=20, seed=6, max_tokens=3, logprobs=3),
            SamplingParams(temperature=1.0, top_p=0.8, min_p=0.1, top_k=0, seed=LARGE_SEED, max_tokens=3)]


def sampled_batch(e: Eng) -> list:
    return e.once("sampled", lambda e: e.llm.generate([PROMPTS[0], PROMPTS[1], STOP_PROMPT, PROMPTS[1]],
                                                      sampled_params(), use_tqdm=False))


def test_seeded_sampling_torch_equals_jax(both):
    """The same tokens in torch and JAX for seeded sampling with top-k / top-p / min-p; logprobs=0 gives
    only the sampled token, logprobs=3 the top 3 and the sampled one."""
    results = [sampled_batch(e) for e in both]
    for e, outs in zip(both, results):
        for out, p in zip(outs, sampled_params()):
            c = out.outputs[0]
            assert len(c.token_ids) == p.max_tokens and c.finish_reason == "length"
            assert c.text == e.tokenizer.decode(c.token_ids)
        c = outs[1].outputs[0]
        assert all(list(entry) == [t] and entry[t].rank >= 1 for t, entry in zip(c.token_ids, c.logprobs))
        assert c.cumulative_logprob == pytest.approx(
            sum(entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)), abs=1e-4)
        c = outs[2].outputs[0]
        for t, entry in zip(c.token_ids, c.logprobs):
            assert sorted(lp.rank for lp in entry.values())[:3] == [1, 2, 3] and t in entry
            assert len(entry) == (3 if entry[t].rank <= 3 else 4)
            assert entry[t].rank <= 20   # top_k=20
        assert outs[0].outputs[0].logprobs is None and outs[0].outputs[0].cumulative_logprob is None
        assert _idle(e.llm)
    n = 0
    for a, b in list(zip(*results))[:3]:
        n += compare_tokens(a.outputs[0].token_ids, b.outputs[0].token_ids)
        assert a.outputs[0].text == b.outputs[0].text
    assert n == 9
    a, b = (r[3].outputs[0].token_ids for r in results)
    assert compare_tokens(a, b) == 3, f"seed {LARGE_SEED} (beyond int32) samples differently"


def test_unseeded_first_request_torch_equals_jax(both):
    """Unseeded requests draw a 63-bit seed from the engine's seed= and their arrival number: the same
    in both frameworks."""
    assert compare_tokens(both[0].first.outputs[0].token_ids, both[1].first.outputs[0].token_ids) == 2


# -- penalties -------------------------------------------------------------------------------------

PENALTY_PROMPTS = [PENALTY_PROMPT, PENALTY_PROMPT, PROMPTS[2], PENALTY_PROMPT]
PENALTY_TOKENS = 3


def penalty_params() -> list:
    return [SamplingParams(temperature=0, max_tokens=PENALTY_TOKENS, repetition_penalty=1.5),
            SamplingParams(temperature=0, max_tokens=PENALTY_TOKENS, frequency_penalty=1.0),
            SamplingParams(temperature=0, max_tokens=PENALTY_TOKENS, presence_penalty=-1.0),
            SamplingParams(temperature=0, max_tokens=PENALTY_TOKENS)]


def _penalised_greedy_check(model_dir, prompt_ids, tokens, p: SamplingParams) -> int:
    """Each token is the argmax of transformers' logits with vLLM's penalties applied (repetition on
    prompt + output tokens, frequency and presence on output tokens); -> steps checked (up to a near-tie)."""
    logits = hf_logits(model_dir, prompt_ids, tokens)
    for i, t in enumerate(tokens):
        x = logits[i].clone()
        seen = sorted(set(prompt_ids) | set(tokens[:i]))
        x[seen] = torch.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
        for v in set(tokens[:i]):
            x[v] -= p.frequency_penalty * tokens[:i].count(v) + p.presence_penalty
        top2 = x.topk(2).values
        if top2[0] - top2[1] < NEAR_TIE:
            return i
        assert t == int(x.argmax()), f"step {i}: {tokens} with {p}"
    return len(tokens)


def test_greedy_and_penalties_torch_equals_jax(both, model_dir):
    """Greedy decoding with repetition, frequency and presence penalties as vLLM's (checked on
    transformers' logits) and without: the same tokens in torch and JAX; a penalty changes them."""
    results = [e.once("penalties", lambda e: e.llm.generate(PENALTY_PROMPTS, penalty_params(), use_tqdm=False))
               for e in both]
    for e, outs in zip(both, results):
        checked = sum(_penalised_greedy_check(model_dir, out.prompt_token_ids, out.outputs[0].token_ids, p)
                      for out, p in zip(outs, penalty_params()))
        assert checked >= 3 * PENALTY_TOKENS
        plain = outs[3].outputs[0].token_ids
        assert plain == [plain[0]] * PENALTY_TOKENS   # the plain greedy output repeats one token
        assert outs[0].outputs[0].token_ids != plain and outs[1].outputs[0].token_ids != plain
        assert outs[2].outputs[0].token_ids != hf_greedy(model_dir, e.tokenizer, PROMPTS[2], PENALTY_TOKENS)
        assert _idle(e.llm)
    n = sum(compare_tokens(a.outputs[0].token_ids, b.outputs[0].token_ids) for a, b in zip(*results))
    assert n == PENALTY_TOKENS * len(PENALTY_PROMPTS)
