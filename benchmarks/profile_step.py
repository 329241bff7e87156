"""Where the torch engine's decode step spends its GPU time: ``python3 -m benchmarks.profile_step``.

Runs the eager model step (not the CUDA graph, so each kernel is visible to the
profiler) of the ``benchmarks.e2e`` model at M3's attention shapes, one decode
step at ``--context`` for each ``--batches``, and prints the kernels per step,
the GPU time per step and the top kernels by time. GPU only.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import m3_torch
from benchmarks import e2e


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    blocks = -(-args.context // e2e.PAGE_SIZE)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = e2e.write_model(Path(tmp) / "model", e2e.M3_SHAPES, args.context)
        llm = m3_torch.LLM(model_dir, precompile=False, dtype="bfloat16", device="cuda", max_num_seqs=max(batches),
                           max_model_len=args.context, num_gpu_blocks_override=max(batches) * blocks)
    for batch in batches:
        step = e2e.decode_step(llm.planner, llm.scheduler_config.max_blocks, batch, args.context, seed=batch)
        tensors = llm.runner.step_tensors(step)
        for _ in range(3):
            llm.runner.model.forward(tensors, step.plan, llm.runner.caches)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                llm.runner.model.forward(tensors, step.plan, llm.runner.caches)
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu_us = sum(e.device_time_total for e in events) / args.reps
        kernels = sum(e.count for e in events) / args.reps
        print(f"batch {batch} context {args.context}: {kernels:.0f} kernels/step, {gpu_us:.0f} us GPU time/step")
        for e in sorted(events, key=lambda e: -e.device_time_total)[:args.top]:
            print(f"   {e.device_time_total / args.reps:8.1f} us  x{e.count // args.reps:3d}  {e.key[:90]}")


if __name__ == "__main__":
    main()
