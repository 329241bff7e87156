"""How the JAX engine's step launches the shared Triton kernels: ``python3 -m benchmarks.jax_launch``.

The model-step benchmark's M3-shape model (``benchmarks.model_step``: 4 layers, 1 dense + 3 MSA/MoE, bf16,
random weights drawn on the GPU), one decode step at ``--context`` (4k), per configuration in a process
of its own (XLA reads its flags when JAX starts):

* ``legacy``: jax-triton's legacy custom call (``m3_jax._triton_call.LAUNCH_TARGET``, the default), which
  XLA launches from the host kernel by kernel.
* ``lean``: in ONE process, ``legacy`` and then the same step with a lean launch payload, compared bit for
  bit. jaxlib's legacy call finds its kernel by the whole payload at every launch (a copy and a hash of
  it: ``GetKernelCall`` in jaxlib's ``gpu/triton_kernels.cc``), and jax-triton's payload is the zlib'd
  kernel: PTX with line info and the TTIR, which jaxlib only stores. The lean one drops the TTIR and the
  line info (``triton.knobs.compilation.disable_line_info``) by wrapping jax-triton's kernel constructor
  for this process only: an experiment, not the library's launch.
* ``ffi``: jaxlib's FFI call, which XLA records into command buffers (CUDA graphs).
* ``ffi_skip_temp``: ``ffi`` with ``--xla_gpu_command_buffer_update_mode=SKIP_TEMP`` (XLA's temporaries at
  fixed addresses; the VMM allocator).

Per configuration and batch (``--batches``, 1 and 64): ``step_us``, the compiled step on device-resident
inputs, median of ``--reps`` blocking calls; ``pipelined_us``, ``--reps`` calls back to back / reps;
``execute_us``, the engine's ``JaxRunner.execute`` (host packing, upload, step, download); the launch
payloads' compressed bytes (``payload_bytes``: the sum over the step's Triton kernels, ``payload_max``) and
a hash of one step's sampled tokens and logprobs. ``--xla-log``: XLA's command-buffer log
(``TF_CPP_VMODULE``) of each process in ``<out>/<config>.log``; ``--trace``: a ``jax.profiler`` trace of
five blocking steps at the first batch, per configuration (``<out>/trace-<config>/``, Perfetto JSON).

Writes ``<date>-<gpu>-jax-launch.{json,md}`` to ``--out``. GPU only (jax-triton's lowering needs the CUDA
plugin). Results so far: ``benchmarks/results/2026-12-02-h200-jax-launch-ab.md``.
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
    "lean": ("legacy", ""),
    "ffi": ("ffi", ""),
    "ffi_skip_temp": ("ffi", "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"),
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


class _LeanKernels:
    """Stands in for jaxlib's ``gpu_triton`` module inside jax-triton: kernels made without their TTIR."""

    def __init__(self, lib):
        self.lib = lib

    def TritonKernel(self, name, num_warps, num_ctas, shared_mem, ptx, ttir, *rest):  # noqa: N802 (jaxlib's name)
        return self.lib.TritonKernel(name, num_warps, num_ctas, shared_mem, ptx, "", *rest)

    def __getattr__(self, name):
        return getattr(self.lib, name)


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
        rows[batch] = row
        print(f"  batch {batch}: " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in row.items()), flush=True)
    return rows


def fresh_step(runner):
    """A new jit of the runner's step (nothing cached from the previous launch configuration), and jax-triton's
    compiled-kernel cache emptied."""
    from m3_jax._triton_call import _jax_triton

    _jax_triton()[0].triton_lib._COMPILED_KERNEL_CACHE.clear()
    runner._step = runner.jit_step()


def child(name: str, args) -> dict:
    """One configuration in this process -> {"rows": {...}} (the lean one: {"rows", "lean_rows", "same_bits"})."""
    import jax
    import triton

    import m3_jax
    from benchmarks.model_step import M3_DIMS, fill_jax_pool, text_config, write_config
    from m3_jax import _triton_call

    _triton_call.LAUNCH_TARGET = _triton_call.LAUNCH_TARGETS[CONFIGS[name][0]]
    lib = _triton_call._jax_triton()[0].triton_lib
    payloads = lib.zlib = _Payloads(lib.zlib)
    model = write_config(Path(tempfile.mkdtemp()) / "model", text_config(M3_DIMS, args.layers, args.context + 1024))
    gpu = jax.devices("gpu")[0]
    llm = m3_jax.LLM(str(model), dtype="bfloat16", device=gpu, load_format="dummy", max_batch=max(args.batches),
                     max_context=args.context + 1024, max_cache_pages=max(args.batches) * (args.context // 128 + 8))
    trace = Path(args.out, f"trace-{name}") if args.trace else None
    try:
        with jax.default_device(gpu):
            fill_jax_pool(llm.runner)
            out = dict(rows=measure(llm, args.batches, args.context, args.reps, payloads, trace))
            if name == "lean":
                lib.triton_kernel_call_lib = _LeanKernels(lib.triton_kernel_call_lib)
                triton.knobs.compilation.disable_line_info = True
                fresh_step(llm.runner)
                print("  lean payloads:", flush=True)
                out["lean_rows"] = measure(llm, args.batches, args.context, args.reps, payloads)
                out["same_bits"] = all(out["rows"][b]["tokens_hash"] == out["lean_rows"][b]["tokens_hash"]
                                       for b in args.batches)
        return out
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
        for label, rows in (("", run["rows"]), (" (lean payload)", run.get("lean_rows", {}))):
            for batch, r in rows.items():
                lines.append(f"| {name}{label} | {batch} | {r['jax_step_us']:.0f} | {r['jax_pipelined_us']:.0f} | "
                             f"{r['execute_us']:.0f} | {r['payload_bytes']} ({r['payload_max']}) | "
                             f"{r['tokens_hash']} |")
        if "same_bits" in run:
            lines.append(f"| {name}: lean = default bit for bit | {run['same_bits']} | | | | | |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=lambda s: s.split(","), default=["lean", "ffi", "ffi_skip_temp"],
                    help=f"some of {', '.join(CONFIGS)} (default: lean, ffi, ffi_skip_temp; lean runs legacy too)")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=240, help="seconds per configuration's process")
    ap.add_argument("--xla-log", action="store_true", help="XLA's command-buffer log per process")
    ap.add_argument("--trace", action="store_true", help="a jax.profiler trace per configuration")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
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
