"""``benchmarks/warm_start.py``: its table from a result, and (long) its ``--tiny`` run on the CPU."""

import json

import pytest

from benchmarks import warm_start

ROW = dict(framework="torch", start="first", load_s=1.0, compile_s=30.0, capture_s=5.0, ready_s=36.0, programs=385,
           first_tok_s=9000.0, steady_tok_s=10000.0, first_vs_steady=0.9, late_programs=1,
           late_kernels=["align_kernel[num_warps=4](ids_ptr: *i32)"],
           passes=[dict(steps=300, host_ms=2.5, wait_ms=1.25, cuda_mallocs=7, cuda_frees=3, alloc_retries=1),
                   dict(steps=290, host_ms=1.5, wait_ms=1.0)])


def test_markdown_names_the_command_and_every_start():
    result = dict(device="NVIDIA H200", command="python3 -m benchmarks.warm_start --frameworks torch",
                  precompile=True, workload=warm_start.FULL,
                  rows=[ROW, dict(ROW, start="second", compile_s=10.0, ready_s=12.0, first_vs_steady=1.0,
                                  late_programs=0, late_kernels=[])])
    md = warm_start.markdown(result)
    assert "`python3 -m benchmarks.warm_start --frameworks torch`" in md
    assert ("| torch | first | 1.0 | 30.0 | 5.0 | 36.0 | 385 | 9000 | 10000 | 0.90 | 1 | 2.50 / 1.25 (300 steps; "
            "cudaMalloc 7, free 3, retries 1) | 1.50 / 1.00 (290 steps) |") in md
    assert "- torch first: `align_kernel[num_warps=4](ids_ptr: *i32)`" in md
    assert "| torch | second |" in md and "precompile True" in md
    assert "Triton kernels of the JAX start-up" not in md   # torch rows have no such counts
    assert "Kernels of one profiled generate" not in md       # rows without a profile
    attn, moe = dict(name="attn", calls=4, mean_us=100.0), dict(name="moe", calls=2, mean_us=50.0)
    profiles = [dict(prompts=64, new_tokens=32, kernel_ms=12.5, top=[attn, moe]),
                dict(prompts=64, new_tokens=32, kernel_ms=10.0, top=[dict(attn, mean_us=80.0)])]
    md = warm_start.markdown(dict(result, rows=[dict(ROW, kernel_profile=profiles[0]),
                                                dict(ROW, start="second", kernel_profile=profiles[1])]))
    assert "(64 of the prompts, 32 new tokens each;" in md and "| kernel | torch first | torch second |" in md
    assert "| all kernels, ms | 12.5 | 10.0 |" in md
    assert "| `attn` | 100.0 (4) | 80.0 (4) |" in md and "| `moe` | 50.0 (2) | - |" in md
    jax_rows = [dict(ROW, framework="jax", kernels_compiled=46, kernels_read=0),
                dict(ROW, framework="jax", start="second", kernels_compiled=0, kernels_read=46)]
    md = warm_start.markdown(dict(result, rows=jax_rows))
    assert ("Triton kernels of the JAX start-up, compiled to PTX / read back from the cache folder: "
            "first start 46 / 0, second start 0 / 46.") in md


@pytest.mark.long   # two engine starts in fresh processes
def test_tiny_run(tmp_path):
    warm_start.main(["--tiny", "--frameworks", "torch", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "warm_start.json").read_text())
    assert [r["start"] for r in result["rows"]] == ["first", "second"]
    assert all(r["ready_s"] > 0 and r["steady_tok_s"] > 0 for r in result["rows"])
    assert all(isinstance(r["late_programs"], int) and r["late_kernels"] == [] for r in result["rows"])
    assert all(p["steps"] > 0 and p["host_ms"] > 0 for r in result["rows"] for p in r["passes"])
    assert all(r["kernel_profile"]["kernel_ms"] > 0 and r["kernel_profile"]["top"] for r in result["rows"])
    assert "--tiny" in result["command"]
