"""Async scheduling on and off, offline decode at batch 64: ``python3 -m benchmarks.async_scheduling``.

The model is the real-shape one of ``benchmarks/model_step.py`` (MiniMax-M3's per-layer dimensions,
``--layers`` layers, bf16, random weights drawn on the GPU). ``--batch`` requests of ``--prompt-len``
random tokens are prefilled first (not measured); then the decode-only steps to ``--new-tokens`` tokens
each (greedy, ``ignore_eos``: every step has ``--batch`` generation rows) are measured, for each
framework (a fresh process each) and each setting of ``async_scheduling`` (one engine each). The
engine is built with ``precompile=False`` (only this workload's step programs are compiled, not every
bucket's): a warm-up run of the same workload compiles them and captures the CUDA graphs, so the
measured runs are warm.

* ``tok/s``: decode tokens / wall time of the decode steps (median of ``--reps`` runs, no profiler);
* ``idle between steps``: the share of the decode span the GPU waits for the host between one
  step's work and the next's, the target (:data:`IDLE_TARGET`). torch: one more run with a CUDA event
  recorded before and after each step's launches (``runner.submit``) on the stream they use; the
  GPU reaches the "before" event of step k+1 when step k is done or, later, when the host queued it:
  the idle is ``elapsed(after_k, before_k+1)``, summed. JAX (no events from Python): from the profiled
  run, the ``steps - 1`` largest gaps between the GPU's busy intervals (exact when each step's work is
  one busy stretch and every gap between steps is longer than every gap inside one);
* ``gpu idle (all)``: from one more run under the framework's profiler (torch.profiler / jax.profiler's
  perfetto trace), 1 - (union of the GPU's kernel and copy intervals) / (first start to last end) over
  the decode steps: idle between and inside steps (the profiler's own host cost included);
* ``same tokens``: the outputs with async scheduling equal those without it.

Writes ``<date>-h200-async-scheduling.{json,md}`` to ``--out`` (default benchmarks/results/). ``--tiny``:
the tiny model on the CPU (checks the script; no GPU idle). On an H200 with the defaults, about 3
minutes for both frameworks, most of it compiling the warm-up's step programs.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.e2e import run_frameworks
from benchmarks.model_step import M3_DIMS, text_config, write_config

IDLE_TARGET = 0.10   # GPU idle between decode steps at batch 64, as a share of the decode span



def busy_fraction(intervals: list) -> tuple:
    """``[(start, end), ...]`` -> (busy time of their union, first start to last end)."""
    if not intervals:
        return 0.0, 0.0
    intervals = sorted(intervals)
    busy, (cur_start, cur_end) = 0.0, intervals[0]
    for start, end in intervals[1:]:
        if start > cur_end:
            busy, cur_start = busy + cur_end - cur_start, start
        cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy, intervals[-1][1] - intervals[0][0]


def largest_gaps_idle(intervals: list, steps: int) -> tuple:
    """``[(start, end), ...]`` of one run's GPU work over ``steps`` steps -> (the ``steps - 1`` largest
    gaps between their union's busy stretches, summed; first start to last end)."""
    if not intervals:
        return 0.0, 0.0
    intervals = sorted(intervals)
    gaps, cur_end = [], intervals[0][1]
    for start, end in intervals[1:]:
        if start > cur_end:
            gaps.append(start - cur_end)
        cur_end = max(cur_end, end)
    return sum(sorted(gaps)[len(gaps) - (steps - 1):]) if steps > 1 else 0.0, cur_end - intervals[0][0]


def torch_step_gaps(llm, run) -> tuple:
    """Run ``run()`` with a CUDA event recorded before and after each step's launches (the engine's
    ``runner.submit``, on the current stream, where the runner queues the step) -> (the GPU's idle
    between consecutive steps, summed; the first step's start to the last one's end), in seconds."""
    import torch
    runner = llm.engine.core.runner
    submit, events = runner.submit, []

    def timed(step, sampling, previous=None):
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        handle = submit(step, sampling, previous)
        after.record()
        events.append((before, after))
        return handle

    runner.submit = timed
    try:
        run()
    finally:
        del runner.submit   # the class's method again
    torch.cuda.synchronize()
    idle = sum(a.elapsed_time(b) for (_, a), (b, _) in zip(events, events[1:])) / 1e3
    return idle, events[0][0].elapsed_time(events[-1][1]) / 1e3 if events else 0.0


def torch_gpu_intervals(run) -> list:
    """Run ``run()`` under torch.profiler -> the GPU's kernel and memcpy/memset intervals (us)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
    out = []
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start:
            out.append((e.time_range.start, e.time_range.end))
    return out


def jax_gpu_intervals(run) -> list:
    """Run ``run()`` under jax.profiler (perfetto trace) -> the GPU's op intervals (us)."""
    import jax
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            run()
        [path] = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)
        with gzip.open(path, "rt") as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", ""))}
    return [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
            if e.get("ph") == "X" and e.get("pid") in gpu_pids and float(e.get("dur", 0)) > 0]


def prefill(llm, prompts, params) -> tuple:
    """Add ``prompts`` and step until every request has its first token (the prefill, not measured)
    -> (their request ids, ``{id: token ids so far}``, ``step``: one engine step that updates it)."""
    engine = llm.engine
    base = engine.stats["generation_tokens"]
    ids = [engine.add_request(None, p, params) for p in prompts]
    outputs = {}

    def step():
        for o in engine.step():
            outputs[o.request_id] = o.outputs[0].token_ids

    while engine.stats["generation_tokens"] - base < len(prompts):
        step()
    return ids, outputs, step


def decode_run(llm, prompts, params, profile=None) -> tuple:
    """Prefill every request (unmeasured), then step to the end -> (outputs, decode seconds, decode
    tokens, what ``profile`` returned or None, decode steps). ``profile``: a function of the decode
    steps' ``run`` (``torch_gpu_intervals``, ...) that calls it once."""
    engine = llm.engine
    ids, outputs, step = prefill(llm, prompts, params)
    first, steps = engine.stats["generation_tokens"], engine.stats["steps"]

    def decode():
        while engine.has_unfinished_requests():
            step()

    start = time.perf_counter()
    measured = profile(decode) if profile is not None else decode()
    seconds = time.perf_counter() - start
    return ([list(outputs[i]) for i in ids], seconds, engine.stats["generation_tokens"] - first, measured,
            engine.stats["steps"] - steps)


def run_framework(framework: str, model_dir: str, args: dict) -> dict:
    """Both settings for one framework (run in a fresh process)."""
    import importlib
    from m3_engine import SamplingParams
    LLM = importlib.import_module(f"m3_{framework}").LLM
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, args["vocab"], args["prompt_len"]).tolist() for _ in range(args["batch"])]
    params = SamplingParams(max_tokens=args["new_tokens"], ignore_eos=True, temperature=0.0)
    profile = None if args["device"] == "cpu" else torch_gpu_intervals if framework == "torch" else \
        jax_gpu_intervals
    rows, tokens = [], {}
    for on in (False, True):
        # precompile off: the warm-up run compiles this workload's step programs (and captures its
        # CUDA graphs), not every bucket's
        with LLM(model_dir, dtype=args["dtype"], device=args["device"], max_num_seqs=args["batch"],
                 max_model_len=args["prompt_len"] + args["new_tokens"] + 16, load_format="dummy", seed=0,
                 async_scheduling=on, precompile=False) as llm:
            start = time.perf_counter()
            decode_run(llm, prompts, params)                  # warm-up: the same steps as the measured runs
            warm_up_s = time.perf_counter() - start
            runs = [decode_run(llm, prompts, params) for _ in range(args["reps"])]
            tokens[on] = runs[-1][0]
            seconds = float(np.median([r[1] for r in runs]))
            row = dict(framework=framework, async_scheduling=on, tokens_per_s=runs[-1][2] / seconds,
                       decode_s=seconds, decode_tokens=runs[-1][2], decode_steps=runs[-1][4], warm_up_s=warm_up_s,
                       gpu_idle=None, idle_between_steps=None,
                       steps_ahead=llm.engine.stats["steps_ahead"], steps=llm.engine.stats["steps"])
            if profile is not None:
                _, _, _, intervals, steps = decode_run(llm, prompts, params, profile)
                busy, span = busy_fraction(intervals)
                row["gpu_idle"] = 1 - busy / span if span else None
                if framework == "torch":
                    idle, span = decode_run(llm, prompts, params, lambda run: torch_step_gaps(llm, run))[3]
                else:
                    idle, span = largest_gaps_idle(intervals, steps)
                row["idle_between_steps"] = idle / span if span else None
            rows.append(row)
            print(row, flush=True)
    for row in rows:
        row["same_tokens"] = tokens[True] == tokens[False]
    return dict(rows=rows)


def markdown(r: dict) -> str:
    lines = [f"# Async scheduling on {r['name']} ({r['date']})", "",
             f"Command: `{r['command']}`. Model: {r['model']}, random weights; {r['batch']} random prompts of "
             f"{r['prompt_len']} tokens prefilled first, then {r['new_tokens']} greedy tokens each: the decode "
             f"steps are measured (tok/s: median of {r['reps']} runs), all at batch {r['batch']}, decode only. "
             "Engines built with precompile=False; a warm-up run of the same workload first (its time: "
             "compiling and capturing). GPU idle between steps: torch from CUDA events around each step's "
             "launches, JAX from the profiled run's largest gaps; GPU idle (all): 1 - busy / span of the "
             f"profiled run's GPU intervals. Target: idle between steps <= {IDLE_TARGET:.0%}.", "",
             "| framework | async_scheduling | decode tok/s | decode steps | GPU idle between steps | target | "
             "GPU idle (all) | steps ahead / steps | same tokens | warm-up (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def percent(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    for fw, res in r["results"].items():
        for row in res["rows"]:
            between = row["idle_between_steps"]
            target = "-" if between is None else \
                f"<= {IDLE_TARGET:.0%} {'met' if between <= IDLE_TARGET else 'MISSED'}"
            lines.append(f"| {fw} | {row['async_scheduling']} | {row['tokens_per_s']:.0f} | {row['decode_steps']} | "
                         f"{percent(between)} | {target} | {percent(row['gpu_idle'])} | "
                         f"{row['steps_ahead']} / {row['steps']} | {row['same_tokens']} | {row['warm_up_s']:.1f} |")
    return "\n".join(lines) + "\n"


def decode_parser(description: str) -> argparse.ArgumentParser:
    """The options of a decode-step benchmark (this one, ``benchmarks.structured``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--frameworks", default="torch,jax")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tiny", action="store_true", help="the tiny CPU model (checks the script)")
    return parser


def write_model(folder: Path, a) -> tuple:
    """The benchmark's model folder (config.json only: ``load_format="dummy"``): the tiny test model with
    ``--tiny``, else ``--layers`` of M3's shapes -> (its config dict, the folder)."""
    if a.tiny:
        from m3_engine.tiny_model import tiny_text_config
        text = tiny_text_config()
    else:
        text = text_config(M3_DIMS, a.layers, a.prompt_len + a.new_tokens + 16)
    return text, write_config(folder / "model", text)


def main(argv=None) -> dict:
    parser = decode_parser(__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    a = parser.parse_args(argv)
    from benchmarks.model_step import device_info
    device = "cpu" if a.tiny else "cuda"
    info = device_info(device)
    with tempfile.TemporaryDirectory() as tmp:
        text, model_dir = write_model(Path(tmp), a)
        model_dir = str(model_dir)
        args = dict(batch=a.batch, prompt_len=a.prompt_len, new_tokens=a.new_tokens, reps=a.reps,
                    vocab=min(text["vocab_size"], 1000),
                    dtype="float32" if a.tiny else "bfloat16", device=device)
        result = dict(command="python3 -m benchmarks.async_scheduling " + " ".join(
                          argv if argv is not None else sys.argv[1:]),
                      date=datetime.date.today().isoformat(), **info, layers=a.layers, batch=a.batch,
                      prompt_len=a.prompt_len, new_tokens=a.new_tokens, reps=a.reps,
                      model="the tiny test model (float32)" if a.tiny else f"M3 layer shapes, {a.layers} layers, bf16",
                      results={})
        name = f"{result['date']}-{'cpu-tiny' if a.tiny else 'h200'}-async-scheduling"
        return run_frameworks(a.frameworks, run_framework, model_dir, args, result, a.out, name, markdown)


if __name__ == "__main__":
    main()
