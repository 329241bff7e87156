"""benchmarks.jax_launch's pieces that run without a GPU: the stand-in it puts into jax-triton, its table."""

import zlib

import pytest

from benchmarks import jax_launch


def test_payloads_record_compressed_sizes():
    payloads = jax_launch._Payloads(zlib)
    data = b"ptx " * 1000
    assert payloads.compress(data) == zlib.compress(data)
    assert payloads.sizes == [len(zlib.compress(data))] and payloads.decompress is zlib.decompress


def test_markdown_lists_every_run():
    row = dict(jax_step_us=2104.3, jax_pipelined_us=1672.4, execute_us=3089.0, payload_bytes=900000,
               payload_max=41000, tokens_hash="abc")
    result = dict(device="NVIDIA H200", date="2026-12-02", command="python3 -m benchmarks.jax_launch", layers=4,
                  context=4096, runs={"legacy": dict(rows={"1": row, "64": dict(row, jax_step_us=7411.0)}),
                                      "ffi": dict(error="timed out after 240 s")})
    text = jax_launch.markdown(result)
    assert "| legacy | 1 | 2104 | 1672 | 3089 | 900000 (41000) | abc |" in text
    assert "| legacy | 64 | 7411 |" in text and "| ffi | error: timed out after 240 s |" in text


def test_trace_summary_times_each_step_but_the_first(tmp_path):
    import gzip
    import json

    def x(name, ts, dur, pid=701, tid=7):
        return dict(ph="X", name=name, ts=ts, dur=dur, pid=pid, tid=tid)

    events = []
    for start, triton_us in ((0, 99), (10000, 20), (20000, 30)):   # three steps; the first is the profiler's warm-up
        events += [x("$runner.py:171 execute", start, 3000), x("$runner.py:224 _layout", start + 1, 50),
                   x("$runner.py:312 pack_inputs", start + 60, 40), x("PjitFunction(_run)", start + 200, 2500),
                   x("triton_kernel_call.7", start + 400, triton_us), x("triton_kernel_call.9", start + 500, 10),
                   x("MemcpyH2D", start + 300, 5, pid=1, tid=15), x("k1", start + 450, 100, pid=1, tid=14),
                   x("k2", start + 600, 50, pid=1, tid=14)]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(dict(traceEvents=events + [dict(ph="M", name="process_name", pid=1)]), f)
    s = jax_launch.trace_summary(path)
    assert s["step_us"] == 3000 and s["call_to_first_kernel_us"] == 250 and s["kernels"] == 2
    assert s["gpu_span_us"] == 200 and s["gpu_busy_us"] == 150
    assert s["Triton custom call thunks"] == (2, 35)   # the median of 30 and 40 us: 35
    assert s["runner: _layout, _sampling_arrays, pack_inputs"] == (2, 90) and s["cuGraphLaunch"] == (0, 0)


def test_launch_cost_pads_only_the_ptx_with_incompressible_comments():
    from benchmarks import jax_launch_cost
    from jax_helpers import FakeTritonKernels

    lib = FakeTritonKernels()
    padded = jax_launch_cost._Padded(lib, 100)
    assert padded.TritonKernel("k", 1, 1, 0, "PTX", "TTIR", 90) == "kernel" and padded.other == 7
    (name, *_, ptx, ttir, cc), = lib.calls
    assert (name, ttir, cc) == ("k", "TTIR", 90) and ptx.startswith("PTX\n") and ptx.count("\n// ") == 100
    assert len(zlib.compress(ptx.encode())) > 3000   # ~33 bytes a line survive compression


def test_launch_cost_table():
    from benchmarks import jax_launch_cost

    rows = {"triton pad=0": dict(payload=1462, blocking_us=364.3, pipelined_us=298.5, per_launch_blocking=5.69,
                                 per_launch_pipelined=4.66),
            "empty jit": dict(blocking_us=77.1, pipelined_us=39.5), "torch graph": dict(blocking_us=71.2,
                                                                                         per_launch_blocking=1.11)}
    text = jax_launch_cost.markdown(dict(device="NVIDIA H200", date="2026-12-02", command="c", xla_flags="", rows=rows))
    assert "| triton pad=0 | 1462 | 5.7 | 4.7 |" in text and "| empty jit | - | 77.1 (a call) | 39.5 (a call) |" in text
    assert "| torch graph | - | 1.1 | - |" in text


def test_jax_vs_torch_cases_and_targets():
    import argparse

    from benchmarks import jax_vs_torch

    args = argparse.Namespace(grid=False, cases="1:1,8:8", contexts="1024,16384", ns=None)
    assert jax_vs_torch.cases_of(args) == [(1, 1, 1024), (1, 1, 16384), (8, 8, 1024), (8, 8, 16384)]
    grid = jax_vs_torch.cases_of(argparse.Namespace(grid=True, cases="", contexts="", ns=None))
    assert len(grid) == 87 and len(set(grid)) == 87 and (1, 1, 1024) in grid and (8, 32, 131072) in grid
    assert (8, 128, 131072) not in grid and (1, 128, 16384) in grid and (1, 128, 4096) not in grid
    assert {n for n, _, _ in jax_vs_torch.cases_of(argparse.Namespace(grid=True, cases="", contexts="",
                                                                        ns="1,2"))} == {1, 2}
    assert [jax_vs_torch.target(b) for b in (1, 4, 8, 128)] == [1.25, 1.25, 1.05, 1.05]


def test_jax_vs_torch_summary_counts_cases_within_the_target():
    from benchmarks import jax_vs_torch

    def row(batch, jit, blocking, x8):
        return dict(n=1, batch=batch, context=16384, torch_graph_us=10.0, torch_graph_blocking_us=20.0,
                    torch_graph_8_us=8.0, legacy_jax_jit_us=jit, legacy_jax_jit_blocking_us=blocking,
                    legacy_jax_jit_8_us=x8)

    rows = [row(1, 12.0, 30.0, 16.0), row(1, 20.0, 24.0, 8.0), row(8, 10.4, 21.0, 8.8)]
    text = "\n".join(jax_vs_torch.summary(rows, "legacy"))
    # batch 1: x8 ratios 2.0 and 1.0; back to back 1.2 and 2.0 (geomean 1.55, one within 1.25x); blocking 1.5 and 1.2
    assert "| legacy | 1 | 2 | 1.25x | 1.41x / 2.00x | 1.55x / 2.00x / 1 of 2 | 1.34x / 1.50x / 1 of 2 |" in text
    assert "| legacy | 8 | 1 | 1.05x | 1.10x / 1.10x | 1.04x / 1.04x / 1 of 1 | 1.05x / 1.05x / 1 of 1 |" in text
    # all rows, each against its own batch's target
    assert "| legacy | all | 3 | - | 1.30x / 2.00x | 1.36x / 2.00x / 2 of 3 | 1.24x / 1.50x / 2 of 3 |" in text


def test_jax_vs_torch_merge_joins_runs_and_refuses_a_case_twice(tmp_path):
    import json

    from benchmarks import jax_vs_torch

    def run(name, cases, tbps):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(dict(gpu="NVIDIA H200", copy_tbps=tbps, xla_flags="", jax="0.11.2", command=name,
                                        rows=[dict(n=n, batch=b, context=c) for n, b, c in cases])))
        return str(path)

    a, b = run("a", [(1, 1, 1024), (2, 1, 1024)], 4.22), run("b", [(4, 1, 1024)], 4.19)
    merged = jax_vs_torch.merge([a, b])
    assert [(r["n"], r["batch"]) for r in merged["rows"]] == [(1, 1), (2, 1), (4, 1)]
    assert merged["copy_tbps_per_run"] == [4.22, 4.19] and merged["copy_tbps"] == 4.19 and merged["command"] == "a ; b"
    with pytest.raises(SystemExit, match="more than one run"):
        jax_vs_torch.merge([a, run("c", [(2, 1, 1024)], 4.2)])
    # rows in the grid's order whatever the runs' order
    assert [(r["n"], r["batch"]) for r in jax_vs_torch.merge([b, a])["rows"]] == [(1, 1), (2, 1), (4, 1)]
    # a merged result merges again, keeping every run's copy bandwidth
    ab = tmp_path / "ab.json"
    ab.write_text(json.dumps(merged))
    again = jax_vs_torch.merge([str(ab), run("d", [(8, 1, 1024)], 4.12)])
    assert again["copy_tbps_per_run"] == [4.22, 4.19, 4.12] and again["copy_tbps"] == 4.12
    assert len(again["rows"]) == 4 and again["command"] == "a ; b ; d"


def test_jax_vs_torch_table_row():
    from benchmarks import jax_vs_torch

    r = dict(n=8, batch=64, context=131072, torch_graph_us=145.4, torch_graph_blocking_us=160.0, torch_eager_us=698.0,
             torch_eager_blocking_us=773.4, torch_graph_8_us=138.5, legacy_bit_identical=True, legacy_jax_jit_us=153.4,
             legacy_jax_jit_blocking_us=362.8, legacy_jax_jit_8_us=148.8)
    lines = jax_vs_torch.table([r], ["legacy"])
    assert lines[0].count("|") == lines[2].count("|") == 15
    assert lines[2] == ("| 8 | 64 | 128k | legacy | True | 145.4 | 698.0 | 153.4 | 160.0 | 773.4 | 362.8 | 138.5 | "
                        "148.8 | 1.074 |")
