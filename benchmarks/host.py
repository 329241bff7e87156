"""Host-side costs of the engines' decode loop (no GPU needed): ``python3 -m benchmarks.host``.

* ``schedule`` / ``update``: ``m3_engine.scheduler.Scheduler`` alone, median of 50 decode steps after the
  prompts are prefilled (tiny model config, 1024 block-table columns), at batch 8 / 4k and batch 64 / 32k.
  The engines run both between steps with the GPU idle.
* ``tp_round_trip``: ``m3_torch.LLM(tensor_parallel_size=2)`` on the CPU (gloo), median of 100
  ``collective_rpc`` calls (after 2 warm-ups) carrying a 64 KiB array (a batch-64 decode step's block table): how long rank 0
  takes to hand a step to a worker and hear back.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import numpy as np

from benchmarks.e2e_ranks import wall_us
from m3_engine.model_config import M3TextConfig
from m3_engine.scheduler import Scheduler, SchedulerConfig
from m3_engine.tiny_model import tiny_text_config, write_tiny_checkpoint


def scheduler_us(batch: int, context: int, steps: int = 50) -> tuple[float, float]:
    """-> median (schedule, update) microseconds of a decode step at ``batch`` x ``context``."""
    text = tiny_text_config()
    text["max_position_embeddings"] = 131072
    config = M3TextConfig.from_dict(text)
    sc = SchedulerConfig.from_engine_args(config, max_num_seqs=64, max_model_len=131072,
                                          num_gpu_blocks_override=64 * 1024 + 64)
    s = Scheduler(sc, config)
    rng = np.random.default_rng(0)
    s.add_requests([rng.integers(3, 200, context).tolist() for _ in range(batch)], max_new_tokens=10_000)
    while True:   # prefill
        step = s.schedule()
        s.update(step, [5] * len(step.logits_indices))
        if step.is_decode:
            break
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step = s.schedule()
        t1 = time.perf_counter()
        s.update(step, [5] * len(step.logits_indices))
        times.append((t1 - t0, time.perf_counter() - t1))
    return tuple(statistics.median(t[i] for t in times) * 1e6 for i in range(2))


def _rank(runner, payload):
    return runner.rank


def tp_round_trip_us(calls: int = 100) -> float:
    import m3_torch

    payload = np.zeros((64, 256), np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_checkpoint(tmp, seed=0)
        with m3_torch.LLM(model_dir, tensor_parallel_size=2, device="cpu", max_num_seqs=4, max_model_len=512) as llm:
            return wall_us(lambda: llm.runner.collective_rpc(_rank, payload), calls)


def main():
    for batch, context in ((8, 4096), (64, 32768)):
        schedule, update = scheduler_us(batch, context)
        print(f"scheduler, batch {batch} at {context // 1024}k: schedule {schedule:.0f} us, update {update:.0f} us",
              flush=True)
    print(f"TP=2 step hand-off round trip (CPU), collective_rpc with 64 KiB: {tp_round_trip_us():.0f} us")


if __name__ == "__main__":
    main()
