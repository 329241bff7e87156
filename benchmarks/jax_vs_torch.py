"""The same msa_decode kernels launched from torch and from JAX (GPU): `python3 -m benchmarks.jax_vs_torch`.

Per step, M3 shapes, context 16k: torch CUDA-graph replay; torch eager and the
jitted JAX step, each as 50 back-to-back calls timed as a whole (steady-state
throughput: host dispatch overlaps the GPU) and as blocking single calls;
then eight steps on eight input sets per call on both sides (a CUDA graph, one
jitted function), which compares the device time of the two launch paths.
``--launch``: the JAX custom call(s) timed (``m3_jax._triton_call.LAUNCH_TARGET``):
``legacy`` (jax-triton 0.3.1's ``triton_kernel_call``, the default), ``ffi``
(jaxlib's command-buffer-compatible ``triton_kernel_call_ffi``) or ``both``.
Writes jax_vs_torch.{json,md} to --out.
"""

import argparse
import json
import os
import statistics
import sys
import time

import jax
import torch

import m3_jax
import m3_torch
from m3_jax import _triton_call
from benchmarks.run import CONFIGS, TOPK, Pool, copy_bandwidth, jax_steps_us, make_step_inputs, time_graph


def wall_us(fn, sync, calls=50, reps=5):
    """Median over reps of (calls back-to-back, one sync) per call, in microseconds."""
    sync(fn())
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            r = fn()
        sync(r)
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/latest"))
    ap.add_argument("--cases", default="1:1,1:8,1:32,1:64,8:8", help="decode_query_len:batch, comma-separated")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--launch", choices=sorted(_triton_call.LAUNCH_TARGETS) + ["both"], default="legacy")
    args = ap.parse_args()
    launches = sorted(_triton_call.LAUNCH_TARGETS) if args.launch == "both" else [args.launch]
    cases = [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",")]
    xla_flags = os.environ.get("XLA_FLAGS", "")
    bw = copy_bandwidth()
    cfg = CONFIGS["M3"]
    pool = Pool(cfg, 128 * 150 + 64)
    jpool = [jax.dlpack.from_dlpack(t) for t in (pool.k, pool.v, pool.ik)]
    rows = []
    for n, batch in cases:
        x = make_step_inputs(pool, cfg, batch, args.context, n, seed=1)
        out = torch.empty_like(x["q"])
        torch_step = lambda: m3_torch.msa_decode(x["q"], x["idx_q"], pool.k, pool.v, pool.ik, x["block_table"],
                                                 x["seq_lens"], decode_query_len=n, topk=TOPK, out=out)[0]
        jargs = [jax.dlpack.from_dlpack(x[k]) for k in ("q", "idx_q")] + jpool + \
                [jax.dlpack.from_dlpack(x[k]) for k in ("block_table", "seq_lens")]
        torch_sync = lambda r: torch.cuda.synchronize()
        row = dict(n=n, batch=batch, context=args.context,
                   torch_graph_us=time_graph([torch_step]),
                   torch_eager_us=wall_us(torch_step, torch_sync),
                   torch_eager_blocking_us=wall_us(torch_step, torch_sync, calls=1, reps=30))
        # Eight input sets per call on both sides: torch one CUDA graph of eight
        # steps, JAX one jitted function of eight steps, called back to back.
        sets = [x] + [make_step_inputs(pool, cfg, batch, args.context, n, seed=s) for s in range(2, 9)]
        outs = [torch.empty_like(s["q"]) for s in sets]
        row["torch_graph_8_us"] = time_graph([
            lambda s=s, o=o: m3_torch.msa_decode(s["q"], s["idx_q"], pool.k, pool.v, pool.ik, s["block_table"],
                                                 s["seq_lens"], decode_query_len=n, topk=TOPK, out=o)
            for s, o in zip(sets, outs)])
        for launch in launches:
            # read when a step is traced: the jitted functions below are new
            _triton_call.LAUNCH_TARGET = _triton_call.LAUNCH_TARGETS[launch]
            step = jax.jit(lambda *a: m3_jax.msa_decode(*a, decode_query_len=n, topk=TOPK))
            jax_step = lambda: step(*jargs)
            row[f"{launch}_bit_identical"] = bool((torch.from_dlpack(jax_step()[0]) == torch_step()).all())
            row[f"{launch}_jax_jit_us"] = wall_us(jax_step, jax.block_until_ready)
            row[f"{launch}_jax_jit_blocking_us"] = wall_us(jax_step, jax.block_until_ready, calls=1, reps=30)
            row[f"{launch}_jax_jit_8_us"] = jax_steps_us(pool, sets, n)
        _triton_call.LAUNCH_TARGET = _triton_call.LAUNCH_TARGETS["legacy"]
        rows.append(row)
        print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "jax_vs_torch.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), copy_tbps=bw / 1e12, xla_flags=xla_flags,
                       jax=jax.__version__,
                       command="python3 -m " + " ".join(["benchmarks.jax_vs_torch"] + sys.argv[1:]), rows=rows),
                  f, indent=1)
    lines = [f"# torch vs JAX launch of the same msa_decode kernels ({torch.cuda.get_device_name()}, "
             f"copy {bw / 1e12:.2f} TB/s)", "",
             f"XLA_FLAGS: `{xla_flags or '(none)'}`.", "",
             f"Microseconds per step, M3 shapes, context {args.context // 1024}k. Throughput = 50 back-to-back calls / 50; "
             "blocking = one call then wait; x8 = eight steps on eight input sets per call (torch: one CUDA "
             "graph replay; JAX: one jitted function, 20 calls back to back).", "",
             "| n | batch | launch | bit-identical | torch graph | torch eager | JAX jit | torch eager blocking "
             "| JAX jit blocking | torch graph x8 | JAX jit x8 | JAX / torch x8 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['n']} | {r['batch']} | {la} | {r[la + '_bit_identical']} | {r['torch_graph_us']:.1f} | "
              f"{r['torch_eager_us']:.1f} | {r[la + '_jax_jit_us']:.1f} | {r['torch_eager_blocking_us']:.1f} | "
              f"{r[la + '_jax_jit_blocking_us']:.1f} | {r['torch_graph_8_us']:.1f} | {r[la + '_jax_jit_8_us']:.1f} | "
              f"{r[la + '_jax_jit_8_us'] / r['torch_graph_8_us']:.3f} |" for r in rows for la in launches]
    with open(os.path.join(args.out, "jax_vs_torch.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
