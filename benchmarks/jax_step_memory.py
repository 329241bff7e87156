"""Where the JAX engine's step program puts the KV pool: in place, or a pool-sized second buffer.

    python3 -m benchmarks.jax_step_memory [--pages N] [--layers 4] [--vocab 200064] [--no-async-scheduling]

Builds ``m3_jax.LLM`` as ``benchmarks.structured`` does (M3 layer shapes, random weights, 64
sequences, ``max_model_len`` 208, async scheduling unless ``--no-async-scheduling``; the pool from
``gpu_memory_utilization`` unless ``--pages``), then for the first prefill step of that benchmark (16 prompts of 128 tokens: the
padded shape of 2048 context tokens):

* compiles its step program ahead of time and prints ``memory_analysis()`` (temporaries, outputs,
  the bytes aliased to inputs) and every instruction of the optimized HLO with the pool's shape
  (a ``copy`` of it is a second pool);
* runs the step once and prints whether the pool came back in the same buffer (donation honoured)
  and how far the device's peak memory rose during the step, against the pool's size.

A compile-time copy shows in the first part; a runtime one (the pool not donated, so XLA writes
its output into a fresh pool-sized buffer) in the second. ``--pages`` small (e.g. 2048) runs both
whatever the cause; without it the step may run out of memory, which is reported.

On the CPU (XLA compiling the GPU code path's dataflow) every step program aliases the whole pool
to its pool output and copies none of it, and the pool keeps its buffer across steps; a
pool-sized allocation is what XLA's GPU client makes when an aliased input is not donated at run
time ("copy-protection"). Its logs say so with
``TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=gpu_executable=3,pjrt_stream_executor_client=1``.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.model_step import M3_DIMS, text_config, write_config

BATCH, PROMPT_LEN, NEW_TOKENS = 64, 128, 64   # benchmarks.structured's defaults


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=None, help="num_gpu_blocks_override (default: from memory)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=M3_DIMS["vocab_size"])
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    a = parser.parse_args(argv)

    import jax

    import m3_jax
    from m3_engine.runner import SamplingBatch
    from m3_engine.step_inputs import StepBuilder

    max_model_len = PROMPT_LEN + NEW_TOKENS + 16
    folder = write_config(Path(tempfile.mkdtemp()) / "model",
                          text_config(dict(M3_DIMS, vocab_size=a.vocab), a.layers, max_model_len))
    llm = m3_jax.LLM(str(folder), dtype="bfloat16", device="cuda", max_num_seqs=BATCH, max_model_len=max_model_len,
                     load_format="dummy", seed=0, async_scheduling=a.async_scheduling, precompile=False,
                     num_gpu_blocks_override=a.pages)
    runner = llm.runner
    gpu = runner.device
    pool_bytes = runner.pool.size * runner.pool.dtype.itemsize
    print(f"pool: {runner.scheduler_config.num_slots} pages, shape {runner.pool.shape} {runner.pool.dtype}, "
          f"{pool_bytes} bytes ({pool_bytes / 2**30:.2f} GiB); device memory {gpu.memory_stats()}")

    prompts = runner.buckets.max_num_tokens // PROMPT_LEN   # the prompts of the benchmark's first step
    shape = runner.buckets.shape(prompts, prompts * PROMPT_LEN, 0, 0)
    step = StepBuilder(runner.buckets, llm.args.step_config()).dummy(shape)
    forward = runner._forward_inputs(step, None)   # the step's forward: the program that writes the pool
    with jax.default_device(gpu):
        compiled = runner._forward.lower(*forward.args, **forward.static).compile()
    analysis = compiled.memory_analysis()
    print(f"step {shape}: {analysis}")
    pool_type = f"{np.dtype(runner.pool.dtype).name.replace('bfloat16', 'bf16')}[{runner.pool.size}]"
    pool_lines = [line.strip() for line in compiled.as_text().splitlines() if pool_type in line]
    print(f"optimized HLO instructions with the pool's shape {pool_type}: {len(pool_lines)}")
    for line in pool_lines:
        print("   ", re.sub(r"backend_config=.*", "backend_config=...", line)[:300])
    copies = [line for line in pool_lines if re.search(r"= \S+ copy\(", line)]

    before = runner.pool.unsafe_buffer_pointer()
    peak_before = gpu.memory_stats().get("peak_bytes_in_use")
    result = dict(pool_bytes=pool_bytes, temp_bytes=analysis.temp_size_in_bytes,
                  alias_bytes=analysis.alias_size_in_bytes, pool_copies_in_hlo=len(copies))
    try:
        runner.execute(step, SamplingBatch.greedy(1))
    except Exception as e:   # the failure under study: reported, not raised
        print(f"the step failed: {type(e).__name__}: {str(e)[:2000]}")
        result["error"] = str(e)[:2000]
    else:
        peak_after = gpu.memory_stats().get("peak_bytes_in_use")
        result.update(donated=runner.pool.unsafe_buffer_pointer() == before,
                      peak_rise_bytes=None if peak_before is None else peak_after - peak_before)
    print(result)
    llm.close()
    return result


if __name__ == "__main__":
    main()
