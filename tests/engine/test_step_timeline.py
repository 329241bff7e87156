"""``m3_engine.step_timeline``: with ``M3_STEP_TIMELINE`` set, ``EngineCore`` writes one line per step
that matches the steps its runner was given and the outputs it handed out."""

import time

import numpy as np
import pytest

from m3_engine import SamplingParams
from m3_engine.engine_core import EngineCore
from m3_engine.model_config import M3TextConfig
from m3_engine.runner import SampleResult
from m3_engine.scheduler import Scheduler, SchedulerConfig
from m3_engine.step_timeline import ENV_VAR, PROFILE_ENV_VAR, read

VOCAB = 1000
WAIT_S = 0.002


class SleepyRunner:
    """Token 5 for every logits row; its result takes ``WAIT_S`` (the device wait). Records what each
    step it was given holds: (rows, generation rows, prompt tokens)."""

    def __init__(self):
        self.given = []

    def submit(self, step, sampling, previous=None):
        # a generation row: its prompt was cached before this step (the scheduler moved num_cached past it)
        generation = sum(1 for r, q in step.rows if r.num_cached - q >= len(r.prompt))
        self.given.append((len(step.rows), generation, step.num_prompt_tokens))
        return len(step.logits_indices)

    def result(self, rows):
        time.sleep(WAIT_S)
        return SampleResult(tokens=np.full(rows, 5, np.int32), logprobs=np.zeros(rows, np.float32))


def core(**kwargs) -> EngineCore:
    config = SchedulerConfig(max_batch=4, max_context=512, num_slots=12, max_num_tokens=64, prefill_chunk=40)
    model = M3TextConfig.from_dict(dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=32, index_n_heads=2, index_head_dim=32,
                                        index_topk_blocks=2, eos_token_id=VOCAB - 1,
                                        layer_types=["full_attention", "minimax_m3_sparse"]))
    return EngineCore(SleepyRunner(), Scheduler(config, model), tokenizer=None, **kwargs)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_line_per_step(tmp_path, monkeypatch, overlap):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(ENV_VAR, str(path))
    c = core(async_scheduling=overlap)
    params = lambda n: SamplingParams(max_tokens=n, ignore_eos=True)   # noqa: E731
    c.add_request("a", list(range(3, 93)), params(3))     # 90 prompt tokens: three chunks
    c.add_request("b", [7, 8, 9, 10], params(2))
    before_c = time.time()
    outputs, calls = [], 0
    while c.has_unfinished_requests():
        outputs.append(c.execute_step())
        calls += 1
        if calls == 1:
            before_c = time.time()
            c.add_request("c", [11, 12], params(4))
    lines = read(path)
    given = c.runner.given
    assert len(lines) == len(outputs) == len(given) == c.stats["steps"]
    # each line is the step whose tokens its call handed out: the runner's steps in order
    assert [(x["rows"], x["generation_rows"], x["prompt_tokens"]) for x in lines] == given
    assert all(x["context_rows"] + x["generation_rows"] == x["rows"] for x in lines)
    assert sum(x["prompt_tokens"] for x in lines) == 90 + 4 + 2
    assert all(x["device_wait"] >= WAIT_S and x["start"] < x["end"] for x in lines)
    assert lines[0]["since_last"] is None and all(x["since_last"] >= 0 for x in lines[1:])
    assert [r for r, _ in lines[0]["added"]] == ["a", "b"] and [r for r, _ in lines[1]["added"]] == ["c"]
    assert lines[1]["added"][0][1] >= before_c and all(not x["added"] for x in lines[2:])
    for key, moved in (("first", lambda o, seen: o.request_id not in seen), ("finished", lambda o, _: o.finish_reason)):
        seen, expected = set(), []
        for outs in outputs:
            expected.append([o.request_id for o in outs if moved(o, seen)])
            seen.update(o.request_id for o in outs)
        assert [x[key] for x in lines] == expected
    assert sorted(r for x in lines for r in x["finished"]) == ["a", "b", "c"]


def test_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv(PROFILE_ENV_VAR, raising=False)
    c = core()
    assert c.timeline is None and c.profile is None


def test_step_profile(tmp_path, monkeypatch):
    """``M3_STEP_PROFILE``: the steps run under cProfile, written as pstats (what ``benchmarks.serve
    --profile-steps`` tabulates): the runner's result, called inside each step, is in it once a step."""
    import pstats

    from benchmarks.serve import profile_markdown

    path = tmp_path / "steps.pstats"
    monkeypatch.setenv(PROFILE_ENV_VAR, str(path))
    c = core()
    c.add_request("a", [3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    steps = 0
    while c.has_unfinished_requests():
        c.execute_step()
        steps += 1
    c.add_request("b", [6], SamplingParams(max_tokens=1))   # added outside a step: not profiled
    c.profile.close()
    stats = {fn: v for (_, _, fn), v in pstats.Stats(str(path)).stats.items()}
    assert stats["result"][1] == steps == 4
    assert stats["<built-in method time.sleep>"][2] >= steps * WAIT_S   # tottime: the runner's device wait
    assert "add_request" not in stats
    table = profile_markdown({"core": (path, steps)})
    row = next(line for line in table if "<built-in method time.sleep>" in line)
    assert row.split("|")[2].strip() == "1.00"   # calls per step
