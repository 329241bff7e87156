"""``benchmarks/serve.py --offline``: the same requests through the engine alone, and the server-vs-offline
table.

The offline engine here is ``engine_helpers.FakeLLM`` (the engine over a runner that sleeps 5 ms a step):
its step classification (decode-only at which batch) is checked against the steps the runner was given,
and the spawned-process run feeds the table. The whole ``--tiny --offline`` command (a real server,
then the real offline engine, minutes in the CPU interpreter) is a ``long`` test.
"""

import collections
import json
import random
from types import SimpleNamespace

import pytest

from benchmarks import serve
from engine_helpers import FakeLLM
from m3_engine.step_timeline import read as read_timeline
from m3_engine.tiny_model import write_tiny_checkpoint

OPTIONS = dict(device="cpu", max_num_seqs=4, max_model_len=256, prefill_chunk=4)   # prompts take several steps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_servebench"), seed=0)


def test_offline_pass_times_exactly_the_decode_only_steps(model_dir):
    with FakeLLM(model_dir, **OPTIONS) as llm:
        given = []   # per runner step: its batch when decode-only, else 0
        execute = llm.runner.execute

        def recorded(step, sampling):
            given.append(len(step.rows) if step.is_decode else 0)
            return execute(step, sampling)

        llm.runner.execute = recorded
        prompts = [[5 + i] * n for i, n in enumerate((9, 3, 6, 12, 2, 7))]
        outputs = [3, 5, 4, 6, 2, 5]
        for concurrency in (6, 4, 1):
            given.clear()
            result = serve.offline_pass(llm, prompts, outputs, concurrency, temperature=0.0)
            assert result["output_tokens"] == sum(outputs) and result["steps"] == len(given)
            decode = collections.Counter(b for b in given if b)
            assert {d["batch"]: d["steps"] for d in result["decode_steps"]} == decode
            assert 0 < sum(decode.values()) < len(given)      # mixed steps happened too, and were left out
            assert max(decode) == min(concurrency, OPTIONS["max_num_seqs"])
            assert result["tpot_ms"]["p50"] > 0 and result["num_requests"] == 6
        assert set(decode) == {1} and sum(decode.values()) == sum(n - 1 for n in outputs)   # one at a time


def test_offline_process_and_the_server_vs_offline_table(model_dir, tmp_path):
    args = SimpleNamespace(input_len=10, output_len=4, range_ratio=0.5)
    workloads = [(c, *serve.make_requests(random.Random(0), args, n, 64)) for c, n in ((4, 6), (1, 2))]
    offline = serve.offline("engine_helpers:FakeLLM", str(model_dir), OPTIONS, workloads, 0.0,
                            str(tmp_path / "steps.jsonl"))
    assert [(o["max_concurrency"], o["num_requests"]) for o in offline] == [(4, 6), (1, 2)]
    assert [o["output_tokens"] for o in offline] == [sum(w[2]) for w in workloads]
    lines = read_timeline(tmp_path / "steps.jsonl")   # the warm-up passes' steps, then the measured ones
    for o, (_, prompts, output_lens) in zip(offline, workloads):
        t = serve.timeline_summary(lines, o.pop("timing"))
        assert t["steps"] == o["steps"] and t["prefill_steps"] > 0
        assert t["prompt_tokens_per_prefill_step"] * t["prefill_steps"] == pytest.approx(sum(map(len, prompts)))
        assert t["device_wait_s"] <= 0.005 * o["steps"] <= t["busy_s"] < t["wall_s"]   # FakeRunner: 5 ms in submit
        assert t["core_idle_s"] == pytest.approx(t["wall_s"] - t["busy_s"]) and 0 < t["gaps_s"] < t["core_idle_s"]
        assert 0 <= t["first_arrival_ms"] < 5 and 0 <= t["arrival_ms"]["p99"] < 5
        assert 0 <= t["last_token_lag_ms"]["p50"] < 5 and t["first_token_lag_ms"]["p50"] >= 0
        o["timeline"] = t

    def row(rate, c, n, tput, tpot):
        return dict(request_rate=rate, max_concurrency=c, num_requests=n, output_throughput=tput,
                    tpot_ms={"p50": tpot, "p99": 2 * tpot}, completed=n, failed=0, short_outputs=0,
                    server_idle_after=True, request_throughput=1.0, total_token_throughput=2 * tput,
                    **{f"{k}_ms": {"p50": 1.0, "p99": 2.0} for k in ("ttft", "itl", "e2e")})

    full, one = (next(d for d in o["decode_steps"] if d["batch"] == b) for o, b in zip(offline, (4, 1)))
    rows = [row("inf", 4, 6, 0.95 * offline[0]["output_throughput"], 1.25 * full["median_ms"]),
            row(2.0, 4, 6, 0.5 * offline[0]["output_throughput"], 3 * full["median_ms"]),
            row("inf", 1, 2, 0.5 * offline[1]["output_throughput"], 1.5 * one["median_ms"])]
    versus = serve.versus_offline(rows, offline, max_num_seqs=4)
    assert [v["throughput_ratio"] for v in versus] == pytest.approx([0.95, 0.5, 0.5])
    assert [v["tpot_step_ratio"] for v in versus] == pytest.approx([1.25, 3, 1.5])
    assert [v["decode_batch"] for v in versus] == [4, 4, 1]
    # targets: rate inf only; tok/s at full concurrency; TPOT there and at concurrency 1
    assert [(v["throughput_ratio_min"], v["tpot_step_ratio_max"]) for v in versus] == \
        [(0.9, 1.3), (None, None), (None, 1.2)]

    result = dict(date="today", command="python3 -m benchmarks.serve --offline", rows=rows, offline=offline,
                  versus_offline=versus, setup=dict(server="m3-serve fake", model=str(model_dir), num_requests=[6, 2],
                                                    input_len=10, output_len=4, range_ratio=0.5, temperature=0.0,
                                                    offline="`engine_helpers:FakeLLM`"))
    json.dumps(result)
    table = serve.markdown(result).split("## Server vs offline")[1]
    lines = [line for line in table.splitlines() if line.startswith("| inf") or line.startswith("| 2.0")]
    assert len(lines) == 3
    assert "| 0.950 | >= 0.9 met |" in lines[0] and "| 1.250 | <= 1.3 met |" in lines[0]
    assert lines[1].endswith("| 3.000 | - |") and "| 0.500 | - |" in lines[1]
    assert "| 1.500 | <= 1.2 MISSED |" in lines[2]
    # the step timeline beside each server row: the server's (none here: no server ran) and the offline one
    timeline = serve.markdown(result).split("## Step timeline")[1].splitlines()
    assert "| server, rate inf, c 4 | offline, rate inf, c 4 | server, rate 2.0, c 4 |" in timeline[4]
    steps = next(line for line in timeline if line.startswith("| steps |"))
    assert steps == f"| steps | - | {offline[0]['steps']} | - | {offline[0]['steps']} | - | {offline[1]['steps']} |"


def test_timeline_summary_of_a_row():
    def step(start, end, prompt_tokens=0, added=(), first=(), finished=()):
        return dict(start=start, end=end, rows=1, context_rows=0, generation_rows=1, prompt_tokens=prompt_tokens,
                    device_wait=(end - start) / 2, since_last=None, added=list(added), first=list(first),
                    finished=list(finished))

    lines = [step(0.5, 0.6, 100, added=[("warm", 0.45)], first=["warm"], finished=["warm"]),   # before the row
             step(10.1, 10.2, 300, added=[("a", 10.05)]),
             step(10.25, 10.3, 200, added=[("b", 10.22)], first=["a"]),
             step(10.4, 10.5, first=["b"], finished=["a"]),
             step(10.5, 10.6, finished=["b"])]
    for x, y in zip(lines[1:], lines[2:]):
        y["since_last"] = y["start"] - x["end"]
    timing = dict(window=(10.0, 11.0), requests=[("b", 10.2, 10.51, 10.7), ("a", 10.0, 10.35, 10.52)])
    t = serve.timeline_summary(lines, timing)
    assert (t["steps"], t["prefill_steps"], t["prompt_tokens_per_prefill_step"]) == (4, 2, 250)
    assert t["generation_rows"] == 1
    assert t["busy_s"] == pytest.approx(0.35) and t["device_wait_s"] == pytest.approx(0.175)
    assert t["longest_step_ms"] == pytest.approx(100)
    assert t["core_idle_s"] == pytest.approx(0.65) and t["gaps_s"] == pytest.approx(0.15)
    assert t["first_arrival_ms"] == pytest.approx(50)                       # "a" was sent first
    assert t["arrival_ms"]["p50"] == pytest.approx(35)                      # 50 and 20 ms
    assert t["first_token_lag_ms"]["p50"] == pytest.approx(30)             # 50 and 10 ms
    assert t["last_token_lag_ms"]["p99"] == pytest.approx(99.2)            # 20 and 100 ms


def test_bad_command_lines(capsys):
    for argv, message in ((["--offline"], "--offline: needs --model"),   # it builds the server's engine
                          (["--max-concurrency", "4,1", "--num-requests", "8,2,1"],
                           "--num-requests: expected one count or one per --max-concurrency value (2), got 3")):
        with pytest.raises(SystemExit) as e:
            serve.main(["--url", "http://127.0.0.1:9/v1", *argv])
        assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.long   # a real server, then the real engine, in the CPU interpreter: minutes
def test_tiny_offline_run(tmp_path):
    result = serve.main(["--tiny", "--offline", "--max-concurrency", "2,1", "--num-requests", "2,1", "--output-len",
                         "3", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "serve.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert [v["max_concurrency"] for v in saved["versus_offline"]] == [2, 1]
    assert all(v["decode_step_ms"] > 0 and v["throughput_ratio"] > 0 for v in saved["versus_offline"])
    assert "## Server vs offline" in (tmp_path / "serve.md").read_text()
