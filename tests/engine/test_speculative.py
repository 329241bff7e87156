"""Speculative decoding (``m3_engine.speculative``): the option, n-gram drafts, verify steps.

The engine-level tests run the real scheduler and engine over a stand-in runner whose
"model" reads each token's context back through the step's cache metadata (slot mapping,
block table, positions), so a draft row that was rejected but still counted as cached
would change the next tokens. Speculative and plain runs must give the same tokens.
With method "eagle3" the stand-in also keeps a "draft cache" written through the draft
passes' slot mappings (the token each draft row takes) and checks, at every pass, that it
holds the token after every cached position of every drafting request.
The model tests (torch and JAX) run the tiny checkpoint; the EAGLE-3 model tests are in
test_speculative_eagle3.py.
"""

import numpy as np
import pytest

from m3_engine import SamplingParams
from m3_engine.engine import LLMEngine
from m3_engine.model_config import load_config
from m3_engine.runner import SampleResult, SynchronousRunner
from m3_engine.scheduler import Scheduler, SchedulerConfig
from m3_engine.speculative import (MAX_PROBE_INTERVAL, MAX_SPECULATIVE_TOKENS, MIN_ACCEPTANCE, PROBE_INTERVAL,
                                   SpeculationGate, SpeculativeConfig, ngram_draft, num_accepted)
from m3_engine.tiny_model import EOS_ID
from m3_engine.tokenizer import load_tokenizer
from m3_kernels.planner import PAGE_SIZE

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
# the tiny random model does not repeat its prompt: 1-gram matches give it drafts (mostly rejected), so
# its steps verify anyway
NGRAM_1 = dict(NGRAM, prompt_lookup_min=1)


# -- the option ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, error", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3}, "lookup"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tokens": 3}, "unknown keys"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_config_errors(value, error):
    with pytest.raises(ValueError, match=error):
        SpeculativeConfig.from_dict(value)


def test_config_type_error():
    with pytest.raises(TypeError, match="speculative_config"):
        SpeculativeConfig.from_dict("ngram")


def test_eagle3_options(tmp_path):
    """The draft folder is read and checked against the target before anything loads; tensor
    parallelism is refused."""
    import json
    from m3_engine.args import EngineArgs
    from m3_engine.eagle3 import write_random_eagle3
    from m3_engine.model_config import M3TextConfig
    from m3_engine.tiny_model import tiny_text_config
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(tiny_text_config()))
    config = M3TextConfig.from_dict(tiny_text_config())
    draft = write_random_eagle3(tmp_path / "draft", config, num_attention_heads=2, head_dim=32,
                                intermediate_size=64, aux_layer_ids=(0, 1, 3))

    def check(model, **options):
        spec = {"method": "eagle3", "model": str(model), "num_speculative_tokens": 2}
        return EngineArgs(target, speculative_config=spec, **options).check()

    assert check(draft).draft.aux_layer_ids == (0, 1, 3)
    assert EngineArgs(target, speculative_config=NGRAM).check().draft is None
    with pytest.raises(ValueError, match=r"'eagle3' draft head runs on one device.*tensor_parallel_size=2"):
        check(draft, tensor_parallel_size=2)
    with pytest.raises(FileNotFoundError, match=r"speculative_config.model: .*missing is not a folder"):
        check(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="draft model: no config.json"):
        check(tmp_path / "empty")
    other = write_random_eagle3(tmp_path / "other", M3TextConfig.from_dict(tiny_text_config(hidden_size=64)))
    with pytest.raises(ValueError, match=r"other/config.json: target_hidden_size=64"):
        check(other)


def test_ngram_draft():
    t = np.array([5, 6, 7, 8, 9, 1, 2, 5, 6, 7], np.int32)
    assert ngram_draft(t, 3, 2, 5).tolist() == [8, 9, 1]           # suffix 5 6 7 seen at the start
    assert ngram_draft(t, 9, 2, 5).tolist() == [8, 9, 1, 2, 5, 6, 7]  # no further than the sequence
    t = np.array([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3], np.int32)
    assert ngram_draft(t, 2, 1, 5).tolist() == [9, 1]             # two matches of length 3: the most recent
    t = np.array([4, 2, 3, 7, 1, 2, 3, 9, 1, 2, 3], np.int32)
    assert ngram_draft(t, 2, 1, 5).tolist() == [9, 1]             # the longer match (1 2 3) wins over (2 3)
    assert ngram_draft(np.array([1, 2, 3], np.int32), 3, 1, 5).tolist() == []
    assert ngram_draft(np.array([1, 2, 1, 3], np.int32), 3, 2, 5).tolist() == []   # only 1-grams match


def test_num_accepted():
    assert num_accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert num_accepted([4, 5, 6], [4, 9, 6, 7]) == 1
    assert num_accepted([4, 5, 6], [1, 5, 6, 7]) == 0
    assert num_accepted([], [3]) == 0


# -- the engine over a stand-in model -------------------------------------------------------------

class CacheModel(SynchronousRunner):
    """A deterministic "model": the next token is a function of every token before it, read back
    from a cache of token ids written through the step's slot mapping and read through its block
    table (unwritten or freed rows are -1, and reading one fails the test).

    ``drafter`` (method "eagle3"): ``drafter(tokens) -> the token after them``, the stand-in draft
    model; :meth:`propose` writes the token each draft row takes into ``draft_cache`` (where the
    draft's K/V would go) and drafts from the sequence it reads back from both caches."""

    def __init__(self, num_slots: int, next_token, drafter=None):
        self.cache = np.full(num_slots * PAGE_SIZE, -1, np.int64)
        self.draft_cache = np.full(num_slots * PAGE_SIZE, -1, np.int64)
        self.next_token, self.drafter = next_token, drafter
        self.steps, self.passes = [], []

    def execute(self, step, sampling):
        self.steps.append(step)
        written = step.slot_mapping >= 0
        self.cache[step.slot_mapping[written]] = step.input_ids[written]
        tokens = []
        for t in step.logits_indices.tolist():
            row = int(np.searchsorted(step.cu_seqlens_q, t, side="right")) - 1
            pos = np.arange(step.positions[t] + 1)
            seen = self.cache[step.block_table[row, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE]
            assert (seen >= 0).all(), "read an unwritten cache row"
            tokens.append(self.next_token(seen))
        return SampleResult(tokens=np.array(tokens, np.int32), logprobs=np.zeros(len(tokens), np.float32))

    def propose(self, work):
        self.passes.append(work)
        step = work.step
        assert len(work.input_ids) == len(step.input_ids)
        written = step.slot_mapping >= 0
        self.draft_cache[step.slot_mapping[written]] = work.input_ids[written]   # row p: the token at p + 1
        k = work.positions.shape[0] + 1
        drafts = np.zeros((work.num_requests, k), np.int32)
        for i, row in enumerate(work.rows.tolist()):
            n = int(step.positions[row]) + 1         # the request's cached length: positions 0 .. n - 1
            table = work.block_table[i]
            pos = np.arange(n)
            slots = table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
            seen, after = self.cache[slots], self.draft_cache[slots]
            assert (seen >= 0).all() and (after >= 0).all(), "a cached position without its (draft) row"
            assert (after[:-1] == seen[1:]).all(), "a draft row that does not hold the token after its position"
            assert after[-1] == self.next_token(seen), "draft 1 is not made from the row of the last token"
            assert (work.positions[:, i] == n + np.arange(k - 1)).all()
            assert (table[work.positions[:, i] // PAGE_SIZE] >= 0).all(), "a chain position outside its slots"
            tokens = list(np.concatenate([seen[:1], after]))   # the whole sequence, the last token included
            for j in range(k):
                drafts[i, j] = self.drafter(np.array(tokens))
                tokens.append(int(drafts[i, j]))
            chain = work.slot_mapping[:, i]
            self.draft_cache[chain] = drafts[i, :k - 1]   # chain step j writes its input, draft j, at n + j
        return drafts

    def close(self):
        pass


def periodic(seen):
    """Mostly repeats the token 4 back (n-gram drafts get accepted), every 7th position breaks it."""
    if len(seen) % 7 == 0:
        return int(3 + (seen[-1] * 5 + len(seen)) % 40)
    return int(seen[-4]) if len(seen) >= 4 else 9


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from m3_engine.tiny_model import write_tiny_checkpoint
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "m", seed=0)
    return load_config(path), load_tokenizer(path)


def run_engine(tiny, prompts, params, next_token=periodic, *, speculative=None, max_batch=4, prefill_chunk=None,
               prefix=False, tokenizer=False, drafter=None, max_context=1024, one_by_one=False):
    """Run the engine over a :class:`CacheModel` (``drafter``: its stand-in EAGLE-3 draft, default a
    perfect one). ``one_by_one``: each prompt runs to the end before the next is added."""
    config, tok = tiny
    sc = SchedulerConfig(max_batch=max_batch, max_context=max_context, num_slots=64, max_num_tokens=256,
                         prefill_chunk=prefill_chunk, enable_prefix_caching=prefix)
    model = CacheModel(sc.num_slots, next_token, drafter or next_token)
    engine = LLMEngine(model, Scheduler(sc, config, speculative=SpeculativeConfig.from_dict(speculative)),
                       tokenizer=tok if tokenizer else None)
    params = params if isinstance(params, list) else [params] * len(prompts)
    done = {}
    for group in ([[i] for i in range(len(prompts))] if one_by_one else [range(len(prompts))]):
        for i in group:
            engine.add_request(str(i), prompts[i], params[i])
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    return [done[str(i)] for i in range(len(prompts))], engine, model


def prompts_mix(rng):
    base = rng.integers(3, 40, 4).tolist()
    return [base * 6 + [EOS_ID] + base,             # periodic, with an eos id in the period's past
            rng.integers(3, 400, 5).tolist(),       # short, random
            base * 40,                              # long: prefilled in chunks beside verify steps
            [7]]


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("prefix", [False, True])
def test_speculation_matches_plain(tiny, k, prefix):
    rng = np.random.default_rng(k)
    prompts = prompts_mix(rng)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (30, 5, 23, 2)]
    plain, _, _ = run_engine(tiny, prompts, params, prefill_chunk=48, prefix=prefix)
    spec, engine, model = run_engine(tiny, prompts, params, prefill_chunk=48, prefix=prefix,
                                     speculative=dict(NGRAM, num_speculative_tokens=k))
    for a, b in zip(plain, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason == "length"
    stats = engine.stats
    assert stats["spec_verify_steps"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["spec_draft_tokens"] == sum(o.metrics.num_draft_tokens for o in spec)
    assert stats["spec_accepted_tokens"] == sum(o.metrics.num_accepted_tokens for o in spec)
    assert stats["generation_tokens"] == sum(len(o.outputs[0].token_ids) for o in spec)
    assert spec[0].metrics.mean_accepted_length > 1
    verify = [s for s in model.steps if s.num_verify_rows]
    assert any(s.num_context for s in verify), "expected a prefill chunk beside a verify step"
    assert all(s.plan.generation.decode_query_len == k + 1 for s in verify)
    assert len(model.steps) < len(run_engine(tiny, prompts, params, prefill_chunk=48)[2].steps)


def test_eos_inside_accepted_run(tiny):
    period = [11, 12, EOS_ID, 13]
    prompt = period * 8 + period[:1]
    params = SamplingParams(max_tokens=40)
    plain, _, _ = run_engine(tiny, [prompt], params, next_token=lambda seen: int(seen[-4]))
    spec, _, model = run_engine(tiny, [prompt], params, next_token=lambda seen: int(seen[-4]), speculative=NGRAM)
    assert plain[0].outputs[0].token_ids == spec[0].outputs[0].token_ids == [12, EOS_ID]
    assert spec[0].outputs[0].finish_reason == "stop"
    assert spec[0].metrics.num_accepted_tokens >= 1   # the eos was an accepted draft, not the bonus token


def test_stop_string_inside_accepted_run(tiny):
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, 300, 6).tolist() * 6
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    [full], _, _ = run_engine(tiny, [prompt], params, tokenizer=True)
    text = full.outputs[0].text
    stop = text[len(text) // 3:len(text) // 3 + 3]
    params = SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop])
    plain, _, _ = run_engine(tiny, [prompt], params, tokenizer=True)
    spec, _, _ = run_engine(tiny, [prompt], params, tokenizer=True, speculative=dict(NGRAM, num_speculative_tokens=5))
    assert spec[0].outputs[0].text == plain[0].outputs[0].text == text[:text.index(stop)]
    assert spec[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert spec[0].outputs[0].finish_reason == "stop" and spec[0].outputs[0].stop_reason == stop


def test_zero_acceptance_turns_speculation_off(tiny):
    prompt = [5, 6, 7, 8] * 10

    def never(seen):   # a model that always disagrees with the n-gram draft it would be shown
        draft = ngram_draft(seen.astype(np.int32), 1, 2, 5)
        return int(draft[0]) % 20 + 3 if len(draft) else 3 + len(seen) % 4

    [out], engine, model = run_engine(tiny, [prompt], SamplingParams(max_tokens=120, ignore_eos=True),
                                      next_token=never, speculative=NGRAM)
    verify = sum(1 for s in model.steps if s.num_verify_rows)
    assert engine.stats["spec_accepted_tokens"] == 0 and verify >= 1
    assert verify <= 3 + 3, (verify, len(model.steps))   # ~125 steps: probes at 16, 32 and 64 at most


def test_gate_probes_back_off_and_reset():
    """Zero acceptance: three verify steps bring the average under the floor, then probes in the steps that
    are multiples of 16, 32, 64, ... (doubling after each failed probe, capped); an accepted probe brings
    back drafting at once and the interval back to 16."""
    gate, drafted = SpeculationGate(), []
    for step in range(1, 2049):
        if gate.wants_drafts(step):
            drafted.append(step)
            gate.record(4, 0)
    assert drafted[:3] == [1, 2, 3]
    probes = drafted[3:]
    assert probes[:5] == [16, 32, 64, 128, 256]
    assert all(b - a == MAX_PROBE_INTERVAL for a, b in zip(probes[4:], probes[5:])), probes
    gate.record(4, 4)   # a probe whose drafts were all right
    assert gate.wants_drafts(2049) and gate.probe_interval == PROBE_INTERVAL
    # a request whose drafts are half right keeps drafting through two steps with nothing accepted
    gate = SpeculationGate()
    for accepted in (2, 0, 0):
        gate.record(4, accepted)
    assert gate.acceptance >= MIN_ACCEPTANCE


EAGLE = {"method": "eagle3", "model": "stand-in", "num_speculative_tokens": 3}


def wrong(seen):
    """A stand-in draft that is never right."""
    return periodic(seen) + 1


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("drafter", [None, wrong], ids=["right", "wrong"])
def test_eagle3_drafts_match_plain(tiny, k, prefix, drafter):
    """Drafts from the (stand-in) draft model after every step: a draft pass per step, its first pass
    over every row (prefill chunks beside verify steps included: the stand-in checks the draft cache
    at every pass), the tokens of plain decoding; a right draft is always accepted, a wrong one never
    and then turns speculation off."""
    rng = np.random.default_rng(k)
    prompts = prompts_mix(rng)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (30, 5, 23, 2)]
    plain, _, _ = run_engine(tiny, prompts, params, prefill_chunk=48, prefix=prefix)
    spec, engine, model = run_engine(tiny, prompts, params, prefill_chunk=48, prefix=prefix, drafter=drafter,
                                     speculative=dict(EAGLE, num_speculative_tokens=k))
    for a, b in zip(plain, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert [p.step for p in model.passes] == model.steps
    stats = engine.stats
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_time_s"] > 0
    assert stats["spec_draft_tokens"] == sum(o.metrics.num_draft_tokens for o in spec)
    # the passes that draft for nobody (pure prefill steps) count in the engine's total only
    assert 0 < sum(o.metrics.draft_time for o in spec) <= stats["spec_draft_time_s"] + 1e-9
    verify = [s for s in model.steps if s.num_verify_rows]
    assert any(s.num_context for s in verify), "expected a prefill chunk beside a verify step"
    if drafter is None:
        assert sum(p.num_requests for p in model.passes) > len(model.passes) // 2
        assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"]
        assert len(model.steps) < len(run_engine(tiny, prompts, params, prefill_chunk=48)[2].steps)
    else:
        # no chain for a request whose gate has closed, but in the shared probe steps
        chains = sum(1 for p in model.passes if p.num_requests)
        assert chains <= 3 * len(prompts) + len(model.passes) // PROBE_INTERVAL + 1, (chains, len(model.passes))
        assert stats["spec_accepted_tokens"] == 0   # each request: 3 verify steps drop its average below 0.2
        assert all(o.metrics.num_verify_steps <= 3 + len(model.steps) // PROBE_INTERVAL + 1 for o in spec)


def test_requests_that_stopped_drafting_probe_together(tiny):
    """Requests that reach the acceptance floor at different steps (staggered prefills; drafts always
    there, never right) probe in the same engine steps: verify steps grow by one per PROBE_INTERVAL
    steps, not by one per request."""
    prompts = [[5, 6, 7, 8] * n for n in (2, 6, 10, 14)]   # prefilled in 1, 3, 5 and 7 chunks of 8
    outs, engine, model = run_engine(tiny, prompts, SamplingParams(max_tokens=120, ignore_eos=True),
                                     speculative=EAGLE, drafter=wrong, prefill_chunk=8)
    verify = sum(1 for s in model.steps if s.num_verify_rows)
    assert engine.stats["spec_accepted_tokens"] == 0
    assert all(o.metrics.num_verify_steps > 3 + 2 for o in outs)   # each probed a few times
    # each request: 3 verify steps drop its average below 0.2; then the shared probes
    assert verify <= 3 * len(prompts) + len(model.steps) // PROBE_INTERVAL + 1, (verify, len(model.steps))


def test_eagle3_prefix_cache_recomputes_the_last_hit_block(tiny):
    """The draft's row at a block's last position holds the token after the block: a prompt that
    shares two full blocks with an earlier one (and then differs) reuses the first only."""
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 400, 2 * PAGE_SIZE).tolist()
    prompts = [shared + [5, 6, 7], shared + [8, 9]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    plain, _, _ = run_engine(tiny, prompts, params, prefix=True, one_by_one=True)
    spec, engine, model = run_engine(tiny, prompts, params, prefix=True, one_by_one=True, speculative=EAGLE)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert engine.stats["prefix_cache_hit_tokens"] == PAGE_SIZE
    assert spec[1].num_cached_tokens == PAGE_SIZE


def test_eagle3_chain_stays_in_the_context(tiny):
    """Near ``max_context`` a request stops drafting (no chain past its slots); an eos inside an
    accepted run ends it as plain decoding does; over ``disable_by_batch_size`` no chain runs."""
    prompt = [5, 6, 7, 8] * 25 + [5, 6]   # cached lengths 102, 106, ... 126: no room to verify, then 127
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain, _, _ = run_engine(tiny, [prompt], params, max_context=PAGE_SIZE)   # one slot
    spec, engine, model = run_engine(tiny, [prompt], params, max_context=PAGE_SIZE, speculative=EAGLE)
    assert spec[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert spec[0].outputs[0].finish_reason == "length" and len(spec[0].outputs[0].token_ids) == 27
    assert model.passes[-1].num_requests == 0 and engine.stats["spec_accepted_tokens"] > 0
    period = [11, 12, EOS_ID, 13]
    spec, _, model = run_engine(tiny, [period * 8 + period[:1]], SamplingParams(max_tokens=40),
                                next_token=lambda seen: int(seen[-4]), speculative=EAGLE)
    assert spec[0].outputs[0].token_ids == [12, EOS_ID] and spec[0].metrics.num_accepted_tokens >= 1
    _, engine, model = run_engine(tiny, [prompt[:24]] * 3, params, speculative=dict(EAGLE, disable_by_batch_size=2))
    assert engine.stats["spec_verify_steps"] == 0 and all(p.num_requests == 0 for p in model.passes)


def test_batch_above_threshold_does_not_speculate(tiny):
    prompts = [[5, 6, 7, 8] * 6] * 3
    spec = dict(NGRAM, disable_by_batch_size=2)
    _, engine, model = run_engine(tiny, prompts, SamplingParams(max_tokens=8, ignore_eos=True), speculative=spec)
    assert engine.stats["spec_verify_steps"] == 0
    _, engine, _ = run_engine(tiny, prompts[:2], SamplingParams(max_tokens=8, ignore_eos=True), speculative=spec)
    assert engine.stats["spec_verify_steps"] > 0


# -- the sampling kernel as a rejection sampler -----------------------------------------------------

def test_rejection_sampling_keeps_the_target_distribution():
    """One verify row per seed: draft d0 then d1, target logits p0 at position 0 and p1 (given d0) at
    position 1. The first emitted token must follow p0 (accepted with probability p0(d0), else the
    residual), the second, when d0 was accepted, p1: chi-square over 4000 seeds."""
    torch = pytest.importorskip("torch")
    from m3_engine.runner import SamplingBatch
    from m3_torch.runner import sample_logits

    rng = np.random.default_rng(0)
    V, N, d0, d1 = 8, 4000, 2, 5
    p0 = rng.dirichlet(np.ones(V) * 2)
    p1 = rng.dirichlet(np.ones(V) * 2)
    logits = np.log(np.stack([p0, p1])).astype(np.float32)
    rows = torch.from_numpy(np.tile(logits, (N, 1)))                  # [2N, V]: row 2i + j = seed i, position j
    seeds = np.repeat(rng.integers(0, 2 ** 62, N), 2)
    batch = SamplingBatch(temperature=np.ones(2 * N, np.float32), top_k=np.zeros(2 * N, np.int32),
                          top_p=np.ones(2 * N, np.float32), min_p=np.zeros(2 * N, np.float32), seeds=seeds,
                          counters=np.tile(np.arange(2, dtype=np.int32) + 5, N))
    sampled = sample_logits(rows, batch).tokens.reshape(N, 2)
    accepted = np.array([num_accepted([d0, d1], s) for s in sampled])
    first = sampled[:, 0]
    second = sampled[accepted >= 1, 1]
    assert abs((accepted >= 1).mean() - p0[d0]) < 4 * np.sqrt(p0[d0] * (1 - p0[d0]) / N)
    for tokens, p in ((first, p0), (second, p1)):
        counts = np.bincount(tokens, minlength=V)
        expected = p * len(tokens)
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 24.3, (chi2, counts, expected)   # chi-square, 7 degrees of freedom, p = 0.001


# -- the models ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from m3_engine.tiny_model import write_tiny_checkpoint
    return write_tiny_checkpoint(tmp_path_factory.mktemp("spec-model") / "m", seed=0)


def _model_prompts():
    rng = np.random.default_rng(0)
    # every token id once: any next token has a 1-gram match, so the first steps always draft;
    # the last prompt is still being prefilled, in chunks, beside the first verify steps
    return [rng.permutation(512).tolist(), rng.integers(3, 500, 7).tolist(), rng.integers(3, 500, 150).tolist()]


_SEEDED: dict = {}


@pytest.mark.long   # minutes on the interpreter (the engine logic is tested above, over a stand-in model)
@pytest.mark.xdist_group("spec-models")   # one worker under --dist loadgroup: the cross-framework check below
@pytest.mark.parametrize("framework, full", [("torch", False), ("torch", True), ("jax", True)])
def test_model_speculation(model_dir, framework, full):
    """Greedy: speculative = plain token for token; seeded sampling: speculative = plain. ``full``:
    FP8 K/V + index-K caches, a prompt prefilled in chunks beside verify steps, and the seeded
    tokens the same in both frameworks."""
    LLM = pytest.importorskip(f"m3_{framework}").LLM
    prompts = _model_prompts() if full else _model_prompts()[:2]
    greedy = SamplingParams(max_tokens=8 if full else 5, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6 if full else 4, ignore_eos=True, temperature=1.0, seed=11)
    options = dict(max_num_seqs=4, max_model_len=1024)
    if full:
        options.update(prefill_chunk=64, kv_cache_dtype="fp8", index_cache_dtype="fp8")
    results = {}
    for name, spec in (("plain", None), ("spec", NGRAM_1)):
        with LLM(model_dir, speculative_config=spec, **options) as llm:
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            results[name] = [o.outputs[0].token_ids for o in outs]
            results[name + "-seeded"] = [o.outputs[0].token_ids
                                         for o in llm.generate(prompts[:1], seeded, use_tqdm=False)]
            if spec:
                assert llm.engine.stats["spec_verify_steps"] > 0
    assert results["spec"] == results["plain"]
    assert results["spec-seeded"] == results["plain-seeded"]
    if full:
        _SEEDED[framework] = results["spec-seeded"]


@pytest.mark.long
@pytest.mark.xdist_group("spec-models")
def test_model_speculation_seeded_tokens_match_across_frameworks():
    """The seeded speculative tokens of the two ``full`` runs above (same worker, same module)."""
    if len(_SEEDED) < 2:
        pytest.skip("needs both test_model_speculation[...-True] runs in this process (--dist loadgroup)")
    assert _SEEDED["torch"] == _SEEDED["jax"]


def _gpu_prompts():
    rng = np.random.default_rng(0)
    base = rng.integers(3, 500, 40).tolist()
    return [base + base[:20], rng.integers(3, 500, 7).tolist(), base[:10] * 4, rng.integers(3, 500, 320).tolist()]


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_gpu_speculation(model_dir, framework):
    """On the GPU (float32, CUDA graphs / compiled steps for the verify steps): greedy speculative =
    plain token for token; seeded sampling too. The last prompt is prefilled in chunks beside the
    first verify steps."""
    LLM = pytest.importorskip(f"m3_{framework}").LLM
    prompts = _gpu_prompts()
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    seeded = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=11)
    options = dict(dtype="float32", device="cuda", max_num_seqs=4, max_model_len=512, prefill_chunk=32)
    results = {}
    for name, spec in (("plain", None), ("spec", NGRAM_1)):
        with LLM(model_dir, speculative_config=spec, **options) as llm:
            results[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            results[name + "-seeded"] = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded,
                                                                                       use_tqdm=False)]
            if spec:
                stats = llm.engine.stats
                assert stats["spec_verify_steps"] > 0, (framework, stats)
                if framework == "torch":   # verify steps replayed from graphs of k + 1 tokens a row
                    assert any(n == NGRAM["num_speculative_tokens"] + 1 for _, n, _ in llm.runner.graphs.graphs)
    assert results["spec"] == results["plain"]
    assert results["spec-seeded"] == results["plain-seeded"]


def test_command_line_and_server_flags():
    pytest.importorskip("fastapi")
    from m3_engine.args import UsageError, engine_options
    from m3_engine.cli import build_parser as cli_parser
    from m3_engine.server.cli import build_parser as serve_parser
    flag = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    assert cli_parser().parse_args(["--model", "m"] + flag).speculative_config == {
        "method": "ngram", "num_speculative_tokens": 2}
    assert engine_options(serve_parser().parse_args(["m"] + flag))["speculative_config"]["num_speculative_tokens"] == 2
    with pytest.raises(UsageError, match="--speculative-config: expected JSON"):
        serve_parser().parse_args(["m", "--speculative-config", "{ngram"])


def test_gate_model_benchmark():
    """A smoke test of benchmarks.speculation_gate's pricing: every draft right gives k + 1 tokens a verify
    step; none right costs a few verify steps (the gate's own behaviour: test_gate_probes_back_off_and_reset)."""
    from benchmarks.speculation_gate import speedup

    assert speedup(1.0, 500, 4, 1.6, runs=2) == pytest.approx(5 / 1.6, rel=1e-9)
    assert 0.95 < speedup(0.0, 512, 4, 1.6, runs=2) < 1.0
