"""How the JAX engine's step launches the shared Triton kernels: ``python3 -m benchmarks.jax_launch``.

The model-step benchmark's M3-shape model (``benchmarks.model_step``: 4 layers, 1 dense + 3 MSA/MoE, bf16,
random weights drawn on the GPU), one decode step at ``--context`` (4k), per configuration in a process
of its own (XLA reads its flags when JAX starts):

* ``legacy``: jax-triton's legacy custom call (``m3_jax._triton_call.LAUNCH_TARGET``, the default), which
  XLA launches from the host kernel by kernel.
* ``legacy_nocb``: the same without XLA's command buffers
  (``--xla_gpu_enable_command_buffer=``): between two legacy Triton calls XLA otherwise launches the few
  fusions in between as a CUDA graph of their own.
* ``ffi``: jaxlib's FFI call, which XLA records into command buffers (CUDA graphs).
* ``ffi_skip_temp``: ``ffi`` with ``--xla_gpu_command_buffer_update_mode=SKIP_TEMP`` (XLA's temporaries at
  fixed addresses; the VMM allocator).
* ``ffi_skip_profiled``: ``ffi`` with ``--xla_gpu_command_buffer_update_mode=SKIP_PROFILED``: XLA profiles
  the buffer addresses of the first executions, then maps the stable arguments, outputs and temporaries to
  fixed virtual addresses (VA remapping, the VMM allocator), so the recorded commands need no update when
  the runtime buffers move. jaxlib 0.11.2's XLA has this mode; it has no
  ``--xla_gpu_command_buffer_inline_traced_commands`` (traced commands stay child graphs).

Per configuration and batch (``--batches``, 1 and 64): ``step_us``, the compiled step on device-resident
inputs, median of ``--reps`` blocking calls; ``pipelined_us``, ``--reps`` calls back to back / reps;
``execute_us``, the engine's ``JaxRunner.execute`` (host packing, upload, step, download); the launch
payloads' compressed bytes (``payload_bytes``: the sum over the step's Triton kernels, ``payload_max``) and
a hash of one step's sampled tokens and logprobs. ``--xla-log``: XLA's command-buffer log
(``TF_CPP_VMODULE``) of each process in ``<out>/<config>.log``; ``--trace``: a ``jax.profiler`` trace of
five blocking steps at the first batch, per configuration (``<out>/trace-<config>-*.json.gz``: Perfetto's and
TensorBoard's trace JSON); ``--summarize TRACE...``: where a traced step's time goes (:func:`trace_summary`).

Writes ``<date>-<gpu>-jax-launch.{json,md}`` to ``--out``. GPU only (jax-triton's lowering needs the CUDA
plugin). Results: ``benchmarks/results/2026-12-02-h200-jax-launch-ab.md``, ``-lean-jax-launch.md``, ``-jax-step-trace.md``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {   # name -> (LAUNCH_TARGETS key, XLA flags)
    "legacy": ("legacy", ""),
    "legacy_nocb": ("legacy", "--xla_gpu_enable_command_buffer="),
    "ffi": ("ffi", ""),
    "ffi_skip_temp": ("ffi", "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"),
    "ffi_skip_profiled": ("ffi", "--xla_gpu_command_buffer_update_mode=SKIP_PROFILED"),
}
XLA_LOG = "command_buffer_thunk=3,command_executor=3"


class _Payloads:
    """Stands in for jax-triton's ``zlib`` module: records the compressed size of each launch payload."""

    def __init__(self, zlib):
        self.zlib, self.sizes = zlib, []

    def compress(self, data, *args):
        out = self.zlib.compress(data, *args)
        self.sizes.append(len(out))
        return out

    def __getattr__(self, name):
        return getattr(self.zlib, name)


def measure(llm, batches, context: int, reps: int, payloads: _Payloads, trace_dir=None) -> dict:
    """-> {batch: row} for the engine's current launch configuration (each step compiled afresh)."""
    import jax
    import numpy as np

    from benchmarks.e2e import decode_step
    from benchmarks.e2e_ranks import wall_us
    from benchmarks.model_step import jax_step
    from m3_engine.runner import SamplingBatch

    rows = {}
    for batch in batches:
        step = decode_step(llm.planner, llm.scheduler_config.max_blocks, batch, context, seed=batch)
        before = len(payloads.sizes)
        row = jax_step(llm, step, reps)
        row["payload_bytes"] = sum(payloads.sizes[before:])
        row["payload_max"] = max(payloads.sizes[before:], default=0)
        greedy = SamplingBatch.greedy(len(step.logits_indices))
        result = llm.runner.execute(step, greedy)
        row["execute_us"] = wall_us(lambda: llm.runner.execute(step, greedy), reps)
        row["tokens_hash"] = hashlib.sha1(np.asarray(result.tokens).tobytes() +
                                          np.asarray(result.logprobs).tobytes()).hexdigest()[:12]
        if trace_dir is not None and batch == batches[0]:
            try:
                with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
                    for _ in range(5):
                        llm.runner.execute(step, greedy)
            except Exception as e:   # the profiler's plugins may be missing: the timings still count
                row["trace_error"] = f"{type(e).__name__}: {e}"
            for f in trace_dir.glob("plugins/profile/*/*.json.gz"):   # flat beside the results
                f.rename(trace_dir.parent / f"{trace_dir.name}-{f.name}")
        rows[batch] = row
        print(f"  batch {batch}: " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in row.items()), flush=True)
    return rows


#: host-side trace events summed per step by :func:`trace_summary`: a label -> the event names it takes
TRACE_GROUPS = {
    "runner: _layout, _sampling_arrays, pack_inputs": ("_layout", "_sampling_arrays", "pack_inputs"),
    "runner._put (jax.device_put) of the inputs": ("_put",),
    "XLA ExecutePrepare": ("CommonPjRtLoadedExecutable::ExecutePrepare",),
    "XLA Thunks::Initialize": ("Thunks::Initialize",),
    "XLA command_buffer::update": ("command_buffer::update",),
    "Triton custom call thunks": ("triton_kernel_call",),
    "command buffer thunks": ("command_buffer_",),
    "cuGraphLaunch": ("cuGraphLaunch",),
    "slice thunks (a memcpy each)": ("wrapped_slice",),
}


def trace_summary(path) -> dict:
    """A ``--trace`` file (``trace-<config>-*.json.gz``) -> medians over its engine steps but the first (the
    profiler's warm-up): the step's wall time, from the jitted call to its first kernel, the GPU's span
    and busy time, and host time per :data:`TRACE_GROUPS` entry (count, microseconds). Host times are
    inflated by the profiler (CUPTI instruments every driver call)."""
    import gzip
    import statistics

    events = json.load(gzip.open(path))
    events = [e for e in (events["traceEvents"] if isinstance(events, dict) else events) if e.get("ph") == "X"]
    gpu = [e for e in events if e["pid"] == 1 and e["name"] not in ("MemcpyH2D", "MemcpyD2H")]
    streams = {(e["pid"], e["tid"]) for e in gpu}
    busiest = max(streams, key=lambda s: sum(1 for e in gpu if (e["pid"], e["tid"]) == s))
    gpu = sorted((e for e in gpu if (e["pid"], e["tid"]) == busiest), key=lambda e: e["ts"])
    host = sorted((e for e in events if e["pid"] != 1), key=lambda e: e["ts"])
    steps = [e for e in host if e["name"].startswith("$runner.py") and e["name"].endswith(" execute")][1:]
    starts = [e["ts"] for e in steps] + [float("inf")]
    rows = []
    for i, step in enumerate(steps):
        inside = [e for e in host if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
        call = next(e for e in inside if e["name"].startswith("PjitFunction"))
        kernels = [e for e in gpu if step["ts"] <= e["ts"] < starts[i + 1]]
        span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
        row = dict(step_us=step["dur"], call_to_first_kernel_us=kernels[0]["ts"] - call["ts"], kernels=len(kernels),
                   gpu_span_us=span, gpu_busy_us=sum(e["dur"] for e in kernels))
        for label, names in TRACE_GROUPS.items():
            hits = [e["dur"] for e in inside if any(e["name"].split()[-1] == n if e["name"].startswith("$")   # Python
                                                    else e["name"].startswith(n) for n in names)]
            row[label] = (len(hits), sum(hits))
        rows.append(row)
    out = {}
    for key, value in rows[0].items():
        if isinstance(value, tuple):
            out[key] = tuple(statistics.median(r[key][j] for r in rows) for j in range(2))
        else:
            out[key] = statistics.median(r[key] for r in rows)
    return out


def child(name: str, args) -> dict:
    """One configuration in this process -> {"rows": {...}}."""
    import jax

    import m3_jax
    from benchmarks.model_step import M3_DIMS, fill_jax_pool, text_config, write_config
    from m3_jax import _triton_call

    _triton_call.LAUNCH_TARGET = _triton_call.LAUNCH_TARGETS[CONFIGS[name][0]]
    lib = _triton_call._jax_triton()[0].triton_lib
    payloads = lib.zlib = _Payloads(lib.zlib)
    model = write_config(Path(tempfile.mkdtemp()) / "model", text_config(M3_DIMS, args.layers, args.context + 1024))
    gpu = jax.devices("gpu")[0]
    llm = m3_jax.LLM(str(model), precompile=False,
                     dtype="bfloat16", device=gpu, load_format="dummy", max_num_seqs=max(args.batches),
                     max_model_len=args.context + 1024, num_gpu_blocks_override=max(args.batches) * (args.context // 128 + 8))
    trace = Path(args.out, f"trace-{name}") if args.trace else None
    try:
        with jax.default_device(gpu):
            fill_jax_pool(llm.runner)
            return dict(rows=measure(llm, args.batches, args.context, args.reps, payloads, trace))
    finally:
        llm.close()


def markdown(result: dict) -> str:
    lines = [f"# JAX launch paths on {result['device']} ({result['date']})", "",
             f"Command: `{result['command']}`. Model: M3 layer shapes, {result['layers']} layers, bf16, random "
             f"weights; one decode step at {result['context']} tokens. us: blocking step / back to back / "
             "engine execute; payload: the step's Triton launch payloads, compressed bytes (sum, largest).", "",
             "| configuration | batch | step us | pipelined us | execute us | payload bytes (max) | tokens hash |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, run in result["runs"].items():
        if "error" in run:
            lines.append(f"| {name} | error: {run['error']} | | | | | |")
            continue
        for batch, r in run["rows"].items():
            lines.append(f"| {name} | {batch} | {r['jax_step_us']:.0f} | {r['jax_pipelined_us']:.0f} | "
                         f"{r['execute_us']:.0f} | {r['payload_bytes']} ({r['payload_max']}) | {r['tokens_hash']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=lambda s: s.split(","), default=["legacy", "ffi", "ffi_skip_temp"],
                    help=f"some of {', '.join(CONFIGS)} (default: legacy, ffi, ffi_skip_temp)")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=240, help="seconds per configuration's process")
    ap.add_argument("--xla-log", action="store_true", help="XLA's command-buffer log per process")
    ap.add_argument("--trace", action="store_true", help="a jax.profiler trace per configuration")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--summarize", nargs="+", metavar="TRACE", help="print trace_summary of --trace files, and stop")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.summarize:
        for path in args.summarize:
            print(path, json.dumps(trace_summary(path), indent=1))
        return
    if args.child:   # one configuration, in the process the parent started for it
        Path(args.out, f"{args.child}.json").write_text(json.dumps(child(args.child, args), default=str))
        return
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; expected some of {list(CONFIGS)}")
    os.makedirs(args.out, exist_ok=True)
    runs = {}
    for name in args.configs:
        flags = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), CONFIGS[name][1]) if f)
        env = dict(os.environ, XLA_FLAGS=flags)
        if args.xla_log:
            env.update(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE=XLA_LOG)
        command = [sys.executable, "-m", "benchmarks.jax_launch", "--child", name, *argv_of(args)]
        print(f"== {name} (XLA_FLAGS={flags!r})", flush=True)
        start = time.time()
        with open(Path(args.out, f"{name}.log"), "w") as log:
            try:
                done = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
                error = None if done.returncode == 0 else f"exit {done.returncode} (see {name}.log)"
            except subprocess.TimeoutExpired:
                error = f"timed out after {args.timeout:.0f} s"
        result_file = Path(args.out, f"{name}.json")
        runs[name] = dict(error=error) if error else json.loads(result_file.read_text())
        print(f"   {time.time() - start:.0f} s" + (f": {error}" if error else ""), flush=True)
    import jax
    result = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind,
                  command="python3 -m benchmarks.jax_launch " + " ".join(argv_of(args, configs=True)),
                  layers=args.layers, context=args.context, runs=runs)
    name = f"{result['date']}-{result['device'].split()[-1].lower()}-jax-launch"
    from benchmarks.run import save_results
    save_results(args.out, name, result, markdown(result))


def argv_of(args, configs: bool = False) -> list:
    """The options a configuration's process gets (``configs``: and the configurations, for the record)."""
    out = ["--batches", ",".join(map(str, args.batches)), "--context", str(args.context), "--layers",
           str(args.layers), "--reps", str(args.reps), "--out", str(args.out)]
    if args.trace:
        out.append("--trace")
    if configs:
        out = ["--configs", ",".join(args.configs), *out] + (["--xla-log"] if args.xla_log else [])
    return out


if __name__ == "__main__":
    main()
