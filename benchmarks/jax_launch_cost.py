"""The host cost of one Triton launch from JAX against its launch payload: ``python3 -m benchmarks.jax_launch_cost``.

jaxlib's legacy Triton custom call (jax-triton's ``triton_kernel_call``) finds its kernel by the whole
launch payload at every launch (a hash and a compare of it: ``GetKernelCall`` in jaxlib's
``gpu/triton_kernels.cc``). This measures what that costs: ``N`` (64) chained launches of a one-CTA
Triton kernel in one jitted function, blocking (one call, then wait; median of ``REPS``) and back to
back (``REPS`` calls, one wait), per launch, with the payload padded by incompressible PTX comments
(jaxlib's own kernel module, without ``m3_jax``'s lean payload, which would drop them). Beside it, in the
same process: ``N`` chained XLA sorts (XLA's own kernels), an empty jit (the dispatch floor), and the same
Triton kernel launched ``N`` times by torch eagerly and from a CUDA graph.

Run it twice to compare XLA's command buffers: as is, and with
``XLA_FLAGS=--xla_gpu_enable_command_buffer=``. Writes ``<date>-<gpu>-jax-launch-cost.{json,md}``
to ``--out`` (``--name`` changes the suffix). GPU only. Results: ``benchmarks/results/2026-12-02-h200-jax-launch-cost.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import secrets
import statistics
import time

N, REPS = 64, 50
PADS = (0, 500, 1000, 2000, 4000)   # comment lines of 67 bytes (32 random bytes as hex: ~33 compressed)


class _Padded:
    """Stands in for jaxlib's ``gpu_triton`` module inside jax-triton: each kernel's PTX gets ``lines``
    random comment lines (what a bigger kernel's payload costs, without a bigger kernel)."""

    def __init__(self, lib, lines: int):
        self.lib, self.lines = lib, lines

    def TritonKernel(self, name, num_warps, num_ctas, shared_mem, ptx, ttir, *rest):  # noqa: N802 (jaxlib's name)
        ptx = ptx + "\n" + "".join("// " + secrets.token_hex(32) + "\n" for _ in range(self.lines))
        return self.lib.TritonKernel(name, num_warps, num_ctas, shared_mem, ptx, ttir, *rest)

    def __getattr__(self, name):
        return getattr(self.lib, name)


def timed(fn, x) -> tuple[float, float]:
    """(blocking, back to back) microseconds per call of ``fn(x)``."""
    fn(x).block_until_ready()
    fn(x).block_until_ready()
    blocking = []
    for _ in range(REPS):
        t = time.perf_counter()
        fn(x).block_until_ready()
        blocking.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(REPS):
        y = fn(x)
    y.block_until_ready()
    return statistics.median(blocking) * 1e6, (time.perf_counter() - t) / REPS * 1e6


def measure() -> dict:
    import jax
    import jax.numpy as jnp
    import torch
    import triton
    import triton.language as tl

    from benchmarks.jax_launch import _Payloads
    from m3_jax._triton_call import _jax_triton, _LeanKernels

    @triton.jit
    def add_one(x_ptr, y_ptr, TAG: tl.constexpr):
        i = tl.arange(0, 128)
        tl.store(y_ptr + i, tl.load(x_ptr + i) + 1.0)

    lib = _jax_triton()[0].triton_lib
    payloads = lib.zlib = _Payloads(lib.zlib)
    jaxlib_kernels = lib.triton_kernel_call_lib
    if isinstance(jaxlib_kernels, _LeanKernels):
        jaxlib_kernels = jaxlib_kernels.lib
    x = jnp.arange(128, dtype=jnp.float32)
    rows = {}
    for tag, pad in enumerate(PADS):
        lib.triton_kernel_call_lib = _Padded(jaxlib_kernels, pad)
        before = len(payloads.sizes)

        def chain(x, tag=tag):   # TAG: a kernel of its own per padding (jax-triton caches compiled kernels)
            for _ in range(N):
                x = _jax_triton()[0].triton_call(x, kernel=add_one, out_shape=jax.ShapeDtypeStruct((128,), jnp.float32),
                                                 grid=(1,), num_warps=1, num_stages=1, TAG=tag)
            return x

        f = jax.jit(chain)
        blocking, pipelined = timed(f, x)
        assert float(f(x)[0]) == N, "the chained launches did not all run"
        rows[f"triton pad={pad}"] = dict(payload=payloads.sizes[before], blocking_us=blocking, pipelined_us=pipelined,
                                         per_launch_blocking=blocking / N, per_launch_pipelined=pipelined / N)
        print(f"triton, payload {payloads.sizes[before]} B: {blocking / N:.1f} / {pipelined / N:.1f} us a launch",
              flush=True)
    lib.triton_kernel_call_lib = _LeanKernels(jaxlib_kernels)

    def sorts(x):
        for _ in range(N):
            x = jax.lax.sort(x[::-1] + 1.0)
        return x

    blocking, pipelined = timed(jax.jit(sorts), x)
    rows["xla sort"] = dict(blocking_us=blocking, pipelined_us=pipelined, per_launch_blocking=blocking / N,
                            per_launch_pipelined=pipelined / N)
    rows["empty jit"] = dict(zip(("blocking_us", "pipelined_us"), timed(jax.jit(lambda x: x + 1.0), x)))

    xt = torch.arange(128, dtype=torch.float32, device="cuda")
    ys = [torch.empty_like(xt) for _ in range(N)]

    def torch_chain():
        prev = xt
        for y in ys:
            add_one[(1,)](prev, y, TAG=0, num_warps=1, num_stages=1)
            prev = y

    def torch_blocking(run):
        run()
        torch.cuda.synchronize()
        times = []
        for _ in range(REPS):
            t = time.perf_counter()
            run()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6

    us = torch_blocking(torch_chain)
    rows["torch eager"] = dict(blocking_us=us, per_launch_blocking=us / N)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch_chain()
        with torch.cuda.graph(graph, stream=stream):
            torch_chain()
    us = torch_blocking(graph.replay)
    rows["torch graph"] = dict(blocking_us=us, per_launch_blocking=us / N)
    return rows


def markdown(result: dict) -> str:
    lines = [f"# Host cost of a Triton launch from JAX ({result['device']}, {result['date']})", "",
             f"Command: `{result['command']}`, XLA_FLAGS `{result['xla_flags'] or '(none)'}`. {N} chained launches "
             f"of a one-CTA kernel in one jitted function; blocking: median of {REPS} calls; back to back: {REPS} "
             "calls, one wait. Microseconds. `triton pad=L`: jax-triton's legacy call with L comment lines added to "
             "the kernel's PTX; `xla sort`: each of the N steps is two XLA kernels (a fusion and a sort); `empty "
             "jit`: one call of a jitted `x + 1`; torch: the same Triton kernel launched eagerly and replayed "
             "from a CUDA graph.", "",
             "| what | payload bytes | blocking us / launch | back to back us / launch |", "| --- | --- | --- | --- |"]
    for name, r in result["rows"].items():
        per = (r.get("per_launch_blocking"), r.get("per_launch_pipelined"))
        cells = [f"{v:.1f}" if v is not None else "-" for v in per]
        if name == "empty jit":
            cells = [f"{r['blocking_us']:.1f} (a call)", f"{r['pipelined_us']:.1f} (a call)"]
        lines.append(f"| {name} | {r.get('payload', '-')} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--name", default="jax-launch-cost", help="the results' file name after <date>-<gpu>-")
    args = ap.parse_args(argv)
    import jax

    from benchmarks.run import save_results
    result = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind,
                  command="python3 -m benchmarks.jax_launch_cost", xla_flags=os.environ.get("XLA_FLAGS", ""),
                  rows=measure())
    save_results(args.out, f"{result['date']}-{result['device'].split()[-1].lower()}-{args.name}", result,
                 markdown(result))


if __name__ == "__main__":
    main()
