"""Async scheduling: the next step scheduled (and, in an engine, submitted) before the last one's tokens
are back, with the same tokens as synchronous steps.

The scheduler part drives ``m3_engine.scheduler`` as ``EngineCore`` does, over a fake model that
writes each step's token ids into a fake paged cache (the carried ids taken from the previous step's
sampled tokens, as a runner does on its device) and hashes each logits row's sequence, read back
through the block table, into the next token: a wrong position, slot, table or carried id changes
the tokens. The engine part runs the tiny model in both frameworks.
"""

import numpy as np
import pytest

from m3_engine import SamplingParams
from m3_engine.engine_core import EngineCore
from m3_engine.model_config import M3TextConfig
from m3_engine.runner import SampleResult
from m3_engine.scheduler import Scheduler, SchedulerConfig
from m3_engine.tiny_model import write_tiny_checkpoint
from m3_engine.tokenizer import load_tokenizer

PAGE = 128
VOCAB = 1000


def scheduler(**limits) -> Scheduler:
    config = SchedulerConfig(**dict(dict(max_batch=4, max_context=512, num_slots=12, max_num_tokens=64,
                                         prefill_chunk=40, enable_prefix_caching=True), **limits))
    model = M3TextConfig.from_dict(dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=32, index_n_heads=2, index_head_dim=32,
                                        index_topk_blocks=2, eos_token_id=VOCAB - 1,
                                        layer_types=["full_attention", "minimax_m3_sparse"]))
    return Scheduler(config, model)


class FakeModel:
    """Runs a step on submission (a device runs them in submission order): token ids (carried ones from
    the previous step's tokens) into the cache at ``slot_mapping``, then per logits row a hash of the
    row's sequence read through ``block_table`` / ``seq_lens`` (never the eos id)."""

    def __init__(self, num_slots: int):
        self.cache = np.full(num_slots * PAGE, -1, np.int64)

    def run(self, step, previous_tokens) -> np.ndarray:
        ids = step.input_ids.astype(np.int64)
        if step.carry_from is not None:
            carried = step.carry_from >= 0
            ids[carried] = previous_tokens[step.carry_from[carried]]
        written = step.slot_mapping >= 0
        self.cache[step.slot_mapping[written]] = ids[written]
        row_of_token = np.searchsorted(step.cu_seqlens_q, step.logits_indices, side="right") - 1
        tokens = []
        for t, row in zip(step.logits_indices, row_of_token):
            n = int(step.seq_lens[row]) - (int(step.cu_seqlens_q[row + 1]) - 1 - int(t))   # up to token t
            pos = np.arange(n)
            seq = self.cache[step.block_table[row, pos // PAGE] * PAGE + pos % PAGE]
            assert (seq >= 0).all(), "a row reads a cache position nobody wrote"
            weights = np.arange(1, n + 1, dtype=np.int64) * 7919
            tokens.append(int((seq @ weights + n * 31) % (VOCAB - 1)))
        return np.array(tokens, np.int32)


def drive(s: Scheduler, *, ahead: bool, arrivals=(), aborts=()) -> dict:
    """Run ``s`` to the end as ``EngineCore.execute_step`` does (``ahead``: each step scheduled before
    the previous one's tokens are back). ``arrivals``: (after how many updates, prompt, max_new_tokens,
    stop ids); ``aborts``: (request id, abort once it has this many tokens). -> {request id: output}."""
    model, outputs, updates = FakeModel(s.config.num_slots), {}, 0
    arrivals, aborts = list(arrivals), dict(aborts)
    in_flight = None   # (step, its tokens)
    while True:
        while arrivals and arrivals[0][0] <= updates:
            _, prompt, n, stops = arrivals.pop(0)
            s.add_request(prompt, n, stop_token_ids=stops)
        if in_flight is None:
            if not s.has_unfinished():
                break
            step = s.schedule()
            in_flight = (step, model.run(step, None))
        done, in_flight = in_flight, None
        if ahead and s.has_unfinished():
            step = s.schedule()
            if step is not None:
                in_flight = (step, model.run(step, done[1]))
        for i in s.update(*done):
            outputs[i] = s.output(i)
        updates += 1
        for i, at in list(aborts.items()):
            if i in s.requests and not s.requests[i].finished and len(s.requests[i].output) >= at:
                s.finish_request(i, "abort")
                outputs[i] = s.output(i)
                del aborts[i]
    assert not s.has_unfinished() and s.num_free_slots == s.config.num_slots
    return outputs


def prompt(n: int, seed: int) -> list:
    return np.random.default_rng(seed).integers(0, VOCAB - 1, n).tolist()


def test_scheduling_ahead_gives_the_same_tokens():
    """Mixed prompt lengths, chunked prefill, stop tokens, max_new_tokens, a full cache, arrivals and an
    abort mid-run, prefix caching: the same outputs with steps scheduled ahead."""
    shared = prompt(140, 0)   # its first block is cached for a later request
    arrivals = [(0, shared + [1], 6), (0, prompt(3, 1), 9), (0, prompt(70, 2), 5), (0, prompt(5, 3), 1),
                (6, shared + [2, 3], 7), (3, prompt(505, 4), 12), (4, prompt(9, 5), 8)]
    plain = drive(scheduler(), ahead=False, arrivals=[a + ((),) for a in arrivals], aborts=[(1, 4)])
    stops = {2: [plain[2][2]], 4: [plain[4][1]]}   # end requests 2 and 4 early at these tokens
    workload = dict(arrivals=[a + (stops.get(i, ()),) for i, a in enumerate(arrivals)], aborts=[(1, 4)])
    results = {}
    for ahead in (False, True):
        s = scheduler()
        results[ahead] = drive(s, ahead=ahead, **workload)
        assert s.blocks.hit_tokens == PAGE   # request 4 took request 0's first block from the cache
    assert results[True] == results[False]
    outputs = results[True]
    assert len(outputs) == 7 and len(outputs[1]) == 4 and len(outputs[3]) == 1   # aborted; max_new_tokens 1
    assert len(outputs[2]) == 3 and len(outputs[4]) == 2                          # stop tokens
    assert len(outputs[5]) == 512 - 505 + 1                                       # the cache is full


def test_a_stop_is_applied_one_step_late():
    """A stop token sampled by step N ends its request when N is updated, after step N+1 (scheduled
    ahead) took a row for it: that row's token is discarded, its cache position given back, its slots
    freed; a request that N ends by length is not in N+1."""
    s = scheduler(enable_prefix_caching=False)
    model = FakeModel(s.config.num_slots)
    s.add_request(prompt(4, 7), 5)   # 0: runs on
    s.add_request(prompt(6, 8), 1)   # 1: step 1's token ends it by length
    s.add_request(prompt(5, 9), 5)   # 2: step 1's token is a stop token (below)
    first = s.schedule()
    tokens = model.run(first, None)
    a, b, c = (s.requests[i] for i in range(3))
    assert [r.num_inflight for r in (a, b, c)] == [1, 1, 1] and a.num_cached == 4   # advanced at scheduling
    c.stop_token_ids = frozenset({int(tokens[2])})
    ahead = s.schedule()
    assert [r.id for r, _ in ahead.rows] == [0, 2]                                  # 1 ends by length
    np.testing.assert_array_equal(ahead.carry_from[ahead.cu_seqlens_q[ahead.row_index]], [0, 2])
    assert (ahead.input_ids[ahead.cu_seqlens_q[ahead.row_index]] == 0).all()         # taken on the device
    np.testing.assert_array_equal(ahead.output_index, [1, 1])
    assert c.num_cached == 6 and c.num_inflight == 2
    free = s.num_free_slots
    assert sorted(s.update(first, tokens)) == [1, 2]
    assert c.output == [int(tokens[2])] and c.finish_reason == "stop" and c.num_cached == 5   # one position back
    assert c.num_inflight == 0 and s.num_free_slots == free + 2
    later = model.run(ahead, tokens)
    assert s.update(ahead, later) == []
    assert c.output == [int(tokens[2])] and a.output == [int(tokens[0]), int(later[0])]   # c's row discarded
    assert a.num_inflight == 0 and a.num_cached == 5


class FakeRunner:
    """``Runner.submit`` / ``result`` over :class:`FakeModel` (the step runs at submission, in order)."""

    def __init__(self, num_slots: int):
        self.model = FakeModel(num_slots)

    def submit(self, step, sampling, previous=None):
        return self.model.run(step, previous)

    def result(self, tokens):
        return SampleResult(tokens=tokens, logprobs=np.zeros(len(tokens), np.float32))


def run_core(*, overlap: bool, stops=None) -> tuple:
    """A workload through ``EngineCore`` (arrivals, an abort and a front-end stop between steps, stop
    tokens, max_tokens, chunked prefill) -> ({request id: (tokens, finish reason)}, steps run ahead)."""
    s = scheduler()
    core = EngineCore(FakeRunner(s.config.num_slots), s, tokenizer=None, async_scheduling=overlap)
    stops = stops or {}

    def add(request_id, n, max_tokens, seed):
        core.add_request(request_id, prompt(n, seed), SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                     stop_token_ids=stops.get(request_id)))

    for request_id, n, max_tokens, seed in [("a", 90, 6, 1), ("b", 4, 5, 2), ("c", 7, 1, 3), ("d", 3, 8, 4)]:
        add(request_id, n, max_tokens, seed)
    out, calls = {}, 0
    while core.has_unfinished_requests():
        for o in core.execute_step():
            tokens, _ = out.get(o.request_id, ([], None))
            out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason)
        calls += 1
        if calls == 2:
            add("e", 30, 4, 5)
        if len(out.get("b", ([],))[0]) == 2:
            core.finish_request("b", "abort")
            out["b"] = (out["b"][0], "abort")
        if len(out.get("d", ([],))[0]) == 3:   # a stop string the front end found
            core.finish_request("d", "stop")
            out["d"] = (out["d"][0], "stop")
    assert s.num_free_slots == s.config.num_slots and not s.has_unfinished()
    return out, core.stats["steps_ahead"]


def test_engine_core_runs_steps_ahead_with_the_same_tokens():
    plain, ahead = run_core(overlap=False)
    assert ahead == 0
    stops = {"a": [plain["a"][0][3]], "e": [plain["e"][0][1]]}
    reference, _ = run_core(overlap=False, stops=stops)
    overlapped, ahead = run_core(overlap=True, stops=stops)
    assert overlapped == reference and ahead >= 5
    assert reference["a"] == (plain["a"][0][:4], "stop") and reference["e"] == (plain["e"][0][:2], "stop")
    assert reference["b"][1] == "abort" and reference["c"][1] == "length" and reference["d"] == (
        plain["d"][0][:3], "stop")


class MaskingRunner(FakeRunner):
    """:class:`FakeRunner` whose rows never take a token the step's bitmask forbids (the next allowed id).
    The bitmask is asked for after the step's "forward" ran, as a runner does (``m3_engine.runner``)."""

    def submit(self, step, sampling, previous=None):
        tokens = self.model.run(step, previous)
        sampling = sampling.with_token_bitmask()
        if sampling.token_bitmask is not None:
            bits = np.unpackbits(sampling.token_bitmask.view(np.uint8), axis=1, bitorder="little")[:, :VOCAB]
            for row, allowed in enumerate(bits):
                while not allowed[tokens[row]]:
                    tokens[row] = (tokens[row] + 1) % VOCAB
        return tokens


def run_masked(params: SamplingParams, *, overlap: bool, tokenizer=None) -> tuple:
    """One request of ``params`` beside a plain one -> (its tokens and finish reason, steps run ahead)."""
    s = scheduler()
    core = EngineCore(MaskingRunner(s.config.num_slots), s, tokenizer=tokenizer, async_scheduling=overlap)
    core.add_request("plain", prompt(5, 8), SamplingParams(max_tokens=8, ignore_eos=True))
    core.add_request("r", prompt(6, 9), params)
    out, reason = {}, None
    while core.has_unfinished_requests():
        for o in core.execute_step():
            out[o.request_id] = out.get(o.request_id, []) + o.new_token_ids
            reason = o.finish_reason if o.request_id == "r" else reason
    assert s.num_free_slots == s.config.num_slots and not s.has_unfinished()
    return (out["r"], reason), core.stats["steps_ahead"]


def test_masked_requests_run_ahead_with_the_same_tokens(tmp_path):
    """Structured outputs (a JSON schema, a regex, a choice whose grammar ends the request under
    ignore_eos), min_tokens (the stop ids masked until the output has exactly that many tokens) and a
    bad word of several tokens (matched against the whole output): every step after the first runs
    ahead, its bitmask filled once the step before it is applied, with the tokens of synchronous steps."""
    from m3_engine.structured_outputs import StructuredOutputsParams as Constraint

    pytest.importorskip("xgrammar")
    tokenizer = load_tokenizer(write_tiny_checkpoint(tmp_path, seed=0))
    (plain, _), _ = run_masked(SamplingParams(max_tokens=8, ignore_eos=True, min_tokens=4,
                                              stop_token_ids=[VOCAB - 2]), overlap=False)
    stop = plain[4]   # the first token min_tokens=4 lets through: a stale count would mask it
    word = next(w for w in ("quick brown", "the lazy dog") if len(tokenizer.encode(w, add_special_tokens=False)) > 1)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    cases = {"min_tokens": SamplingParams(max_tokens=8, ignore_eos=True, min_tokens=4, stop_token_ids=[stop]),
             "bad_words": SamplingParams(max_tokens=8, ignore_eos=True, bad_words=[word]),
             "json": SamplingParams(max_tokens=12, structured_outputs=Constraint(json=schema)),
             "regex": SamplingParams(max_tokens=12, structured_outputs=Constraint(regex=r"[a-z]{3,8}-\d{2}")),
             "choice": SamplingParams(max_tokens=12, ignore_eos=True,
                                      structured_outputs=Constraint(choice=["yes", "no way"]))}
    for name, params in cases.items():
        sync, _ = run_masked(params, overlap=False, tokenizer=tokenizer)
        ahead, steps_ahead = run_masked(params, overlap=True, tokenizer=tokenizer)
        assert ahead == sync, name
        assert steps_ahead >= max(len(sync[0]), 8) - 1, name   # every step but the first ran ahead
    assert run_masked(cases["min_tokens"], overlap=False)[0] == (plain[:5], "stop")
    choice, reason = run_masked(cases["choice"], overlap=True, tokenizer=tokenizer)[0]
    assert reason == "stop" and tokenizer.decode(choice[:-1]) in ("yes", "no way")   # the grammar ended it


class FailingRunner(MaskingRunner):
    """:class:`MaskingRunner` whose ``fail_at``-th submission fails after asking for its late bitmask
    (a sampling launch that fails once the step before it was applied)."""

    def __init__(self, num_slots: int, fail_at: int):
        super().__init__(num_slots)
        self.fail_at, self.submitted = fail_at, 0

    def submit(self, step, sampling, previous=None):
        self.submitted += 1
        if self.submitted == self.fail_at:
            self.model.run(step, previous)
            sampling.with_token_bitmask()
            raise RuntimeError("injected sampling failure")
        return super().submit(step, sampling, previous)


def test_a_failure_after_the_previous_step_was_applied_comes_one_call_later():
    """The step before the failed one has its outputs handed out (its request saw its tokens); the failure
    is raised by the next call, with nothing scheduled left behind."""
    s = scheduler()
    core = EngineCore(FailingRunner(s.config.num_slots, fail_at=3), s, tokenizer=None, async_scheduling=True)
    core.add_request("r", prompt(6, 9), SamplingParams(max_tokens=8, ignore_eos=True, min_tokens=6,
                                                       stop_token_ids=[VOCAB - 2]))
    assert [len(o.new_token_ids) for o in core.execute_step()] == [1]
    assert [len(o.new_token_ids) for o in core.execute_step()] == [1]   # submission 3 failed after applying 2
    with pytest.raises(RuntimeError, match="injected sampling failure"):
        core.execute_step()
    assert core.unfinished_request_ids() == ["r"]
    core.finish_request("r")
    assert s.num_free_slots == s.config.num_slots and not s.has_unfinished()


# -- engines: the tiny model, both frameworks ---------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def run_engine(llm, stop_token, *, overlap: bool) -> dict:
    """A varied workload through ``llm.engine`` (chunked prefill, arrivals mid-run, an abort, max_tokens,
    seeded sampling, a stop token when given) -> {request id: (token ids, finish reason)}. ``overlap``:
    the core schedules ahead (else every step is synchronous, on the same compiled runner)."""
    def greedy(n, **kw):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)

    from m3_engine.structured_outputs import StructuredOutputsParams as Constraint

    engine = llm.engine
    engine.core.async_scheduling = overlap
    stops = [] if stop_token is None else [stop_token]
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    requests = [("long", list(range(3, 23)), greedy(3)), ("short", [5, 6, 7], greedy(1)),
                ("seeded", [9, 10, 11], SamplingParams(temperature=0.8, seed=7, max_tokens=3, ignore_eos=True)),
                ("stop", [13, 14, 15], greedy(4, stop_token_ids=stops)),
                ("json", [40, 41], greedy(4, structured_outputs=Constraint(json=schema))),
                ("regex", [42, 43], greedy(4, structured_outputs=Constraint(regex=r"[a-z]{2,5}-\d"))),
                ("choice", [44, 45], greedy(6, structured_outputs=Constraint(choice=["yes", "no"]))),
                ("min_tokens", [46, 47], greedy(3, min_tokens=2, stop_token_ids=[50, 51])),
                ("bad_words", [48, 49], greedy(3, bad_words=["quick brown"]))]
    late = [("late", [20, 21], greedy(2)), ("aborted", [30, 31], greedy(4))]
    for request_id, ids, params in requests:
        engine.add_request(request_id, ids, params)
    out, steps = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] = (list(o.outputs[0].token_ids), o.outputs[0].finish_reason)
        steps += 1
        if steps == 1:
            for request_id, ids, params in late:
                engine.add_request(request_id, ids, params)
        if "aborted" in out and out["aborted"][1] is None:
            engine.abort_request("aborted")
            out["aborted"] = (out["aborted"][0], "abort")
    return out


@pytest.mark.long   # ~60 s a framework on the CPU interpreter: `pytest -m long tests/test_async_scheduling.py`
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_engine_same_tokens_async_on_and_off(model_dir, framework):
    """The synchronous run (no stop token) is the reference; the run with steps ahead ends "stop" at its
    second token, found one step late. Constrained requests (a JSON schema, a regex, a choice its grammar
    ends), min_tokens and bad words run ahead with their late token bitmasks, to the same tokens."""
    llm_class = pytest.importorskip(f"m3_{framework}").LLM
    with llm_class(model_dir, device="cpu", max_num_seqs=4, max_model_len=64, graph_batch_sizes=[4],
                   max_num_batched_tokens=16, prefill_chunk=12, async_scheduling=True) as llm:
        sync = run_engine(llm, None, overlap=False)
        stop_token = sync["stop"][0][1]
        if stop_token == sync["stop"][0][0]:
            pytest.fail("the greedy run repeats its first token: pick another prompt for 'stop'")
        overlapped = run_engine(llm, stop_token, overlap=True)
        assert llm.engine.stats["steps_ahead"] >= 3   # the steps did run ahead
        s = llm.engine.scheduler
        assert s.num_free_slots == s.config.num_slots and not llm.engine.has_unfinished_requests()
    assert overlapped.pop("stop") == (sync.pop("stop")[0][:2], "stop")
    assert overlapped == sync
    assert len(sync["long"][0]) == 3 and sync["short"] == (sync["short"][0], "length")
    assert sync["aborted"][1] == "abort" and len(sync) == 10
    assert sync["choice"][1] == "stop"   # the grammar ended it (ignore_eos)


def test_async_scheduling_option_is_checked(model_dir):
    from m3_engine.args import EngineArgs
    with pytest.raises(TypeError, match="async_scheduling: expected a bool"):
        EngineArgs(model_dir, async_scheduling=1).check()
    with pytest.raises(ValueError, match="async_scheduling: not with speculative decoding"):
        EngineArgs(model_dir, async_scheduling=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2}).check()
