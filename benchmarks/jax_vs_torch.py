"""The same msa_decode kernels launched from torch and from JAX (GPU): `python3 -m benchmarks.jax_vs_torch`.

Per step, M3 shapes, per case (``--cases`` n:batch, ``--contexts``; ``--grid``: the
anchors' 87 cases, n 1/2/4/8 x batch 1-128 x 1k-128k): torch CUDA-graph replay, also
blocking (one replay, then wait); torch eager and the jitted JAX step, each as 50
back-to-back calls timed as a whole (steady-state throughput: host dispatch
overlaps the GPU) and as blocking single calls; then eight steps on eight input
sets per call on both sides (a CUDA graph, one jitted function), which compares
the device time of the two launch paths. The summary puts JAX against torch as
the JAX-speed targets do: back to back (JAX jit / torch graph) and blocking (JAX
jit blocking / torch graph blocking), within 1.05x at batch >= 8 and 1.25x below.
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


CONTEXTS = (1024, 4096, 16384, 65536, 131072)
# The anchors' 87 cases (../shared/BENCH_ANCHORS.md): n = 1 at batch 1-64 (and 128 at 16k / 128k), n = 2 / 4 / 8
# at batch 1-32, every context.
GRID = [(1, b, c) for b in (1, 4, 8, 32, 64) for c in CONTEXTS] + [(1, 128, 16384), (1, 128, 131072)] + \
       [(n, b, c) for n in (2, 4, 8) for b in (1, 4, 8, 32) for c in CONTEXTS]
TARGETS = ((8, 1.05), (1, 1.25))   # (smallest batch, JAX / torch at most): the JAX-speed targets


def target(batch: int) -> float:
    return next(limit for smallest, limit in TARGETS if batch >= smallest)


def graph_blocking_us(step, reps=30):
    """Median wall-clock microseconds of one CUDA-graph replay of ``step`` and a synchronize."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        step()
    times = []
    for _ in range(reps + 3):
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e6


def _ratios(rows, launch, kind):
    """JAX / torch per row: ``kind`` "x8" (eight steps a call on both sides), "b2b" (one step a call, back to back)
    or "blocking" (one step a call, then wait)."""
    jax_key, torch_key = {"x8": ("_jax_jit_8_us", "torch_graph_8_us"), "b2b": ("_jax_jit_us", "torch_graph_us"),
                          "blocking": ("_jax_jit_blocking_us", "torch_graph_blocking_us")}[kind]
    return [r[launch + jax_key] / r[torch_key] for r in rows]


def summary(rows, launch) -> list:
    """Markdown lines: per batch (then all rows), the geometric mean and the worst of JAX / torch with eight steps a
    call, one step a call back to back and blocking, and how many cases meet the target (the last two)."""
    lines = ["| launch | batch | cases | target | x8: geomean / worst | back to back: geomean / worst / met | "
             "blocking: geomean / worst / met |", "|---|---|---|---|---|---|---|"]
    groups = [(str(b), [r for r in rows if r["batch"] == b]) for b in sorted({r["batch"] for r in rows})]
    for name, sel in groups + [("all", rows)]:
        cells = []
        for kind in ("x8", "b2b", "blocking"):
            ratios = _ratios(sel, launch, kind)
            geomean = statistics.geometric_mean(ratios)
            met = sum(x <= target(r["batch"]) for x, r in zip(ratios, sel))
            cells.append(f"{geomean:.2f}x / {max(ratios):.2f}x" + ("" if kind == "x8" else f" / {met} of {len(sel)}"))
        limit = f"{target(int(name))}x" if name != "all" else "-"
        lines.append(f"| {launch} | {name} | {len(sel)} | {limit} | {' | '.join(cells)} |")
    return lines


def cases_of(args) -> list:
    """[(n, batch, context)] the run measures."""
    if args.grid:
        ns = {int(n) for n in args.ns.split(",")} if args.ns else {1, 2, 4, 8}
        return [case for case in GRID if case[0] in ns]
    pairs = [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",")]
    return [(n, b, int(c)) for n, b in pairs for c in args.contexts.split(",")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/latest"))
    ap.add_argument("--cases", default="1:1,1:8,1:32,1:64,8:8", help="decode_query_len:batch, comma-separated")
    ap.add_argument("--contexts", default="16384", help="context lengths, comma-separated")
    ap.add_argument("--grid", action="store_true", help="the anchors' grid instead of --cases / --contexts "
                    "(87 cases; about 5 minutes on the H200)")
    ap.add_argument("--ns", help="with --grid: its decode_query_len values, comma-separated (default 1,2,4,8)")
    ap.add_argument("--budget-s", type=float, default=500, help="start no case after this many seconds")
    ap.add_argument("--launch", choices=sorted(_triton_call.LAUNCH_TARGETS) + ["both"], default="legacy")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="write one report of these runs' jax_vs_torch.json "
                    "(e.g. the grid's two halves) to --out, and stop")
    args = ap.parse_args()
    launches = sorted(_triton_call.LAUNCH_TARGETS) if args.launch == "both" else [args.launch]
    if args.merge:
        return write(args.out, merge(args.merge), launches)
    if args.ns and not args.grid:
        ap.error("--ns selects the --grid's decode_query_len values; without --grid use --cases n:batch")
    cases = cases_of(args)
    t_start = time.time()
    xla_flags = os.environ.get("XLA_FLAGS", "")
    bw = copy_bandwidth()
    cfg = CONFIGS["M3"]
    pool = Pool(cfg, max(b * -(-int(c * 1.1) // 128) for _, b, c in cases) + 64)
    jpool = [jax.dlpack.from_dlpack(t) for t in (pool.k, pool.v, pool.ik)]
    rows = []

    def result(rows):
        return dict(gpu=torch.cuda.get_device_name(), copy_tbps=bw / 1e12, xla_flags=xla_flags, jax=jax.__version__,
                    command="python3 -m " + " ".join(["benchmarks.jax_vs_torch"] + sys.argv[1:]), rows=rows)

    for n, batch, context in cases:
        if time.time() - t_start > args.budget_s:
            print(f"time budget reached: stopping before n={n} batch={batch} context={context}", flush=True)
            break
        x = make_step_inputs(pool, cfg, batch, context, n, seed=1)
        out = torch.empty_like(x["q"])
        torch_step = lambda: m3_torch.msa_decode(x["q"], x["idx_q"], pool.k, pool.v, pool.ik, x["block_table"],
                                                 x["seq_lens"], decode_query_len=n, topk=TOPK, out=out)[0]
        jargs = [jax.dlpack.from_dlpack(x[k]) for k in ("q", "idx_q")] + jpool + \
                [jax.dlpack.from_dlpack(x[k]) for k in ("block_table", "seq_lens")]
        torch_sync = lambda r: torch.cuda.synchronize()
        row = dict(n=n, batch=batch, context=context,
                   torch_graph_us=time_graph([torch_step]),
                   torch_graph_blocking_us=graph_blocking_us(torch_step),
                   torch_eager_us=wall_us(torch_step, torch_sync),
                   torch_eager_blocking_us=wall_us(torch_step, torch_sync, calls=1, reps=30))
        # Eight input sets per call on both sides: torch one CUDA graph of eight
        # steps, JAX one jitted function of eight steps, called back to back.
        sets = [x] + [make_step_inputs(pool, cfg, batch, context, n, seed=s) for s in range(2, 9)]
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
        save_json(args.out, result(rows))   # so a run cut short by a time limit keeps its cases
    write(args.out, result(rows), launches)


def save_json(out, result):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "jax_vs_torch.json"), "w") as f:
        json.dump(result, f, indent=1)


def write(out, result, launches):
    """jax_vs_torch.{json,md} of ``result`` (gpu, copy_tbps, xla_flags, command, rows) in ``out``; prints the md."""
    save_json(out, result)
    lines = [f"# torch vs JAX launch of the same msa_decode kernels ({result['gpu']}, "
             f"copy {result['copy_tbps']:.2f} TB/s)", "",
             f"Command: `{result['command']}`. XLA_FLAGS: `{result['xla_flags'] or '(none)'}`.", "",
             "Microseconds per step, M3 shapes. Throughput = 50 back-to-back calls / 50 (torch graph: CUDA events "
             "around a replay); blocking = one call (torch graph: one replay) then wait; x8 = eight steps on eight "
             "input sets per call (torch: one CUDA graph replay; JAX: one jitted function, 20 calls back to back).",
             ""]
    for la in launches:
        lines += summary(result["rows"], la) + [""]
    lines += table(result["rows"], launches)
    with open(os.path.join(out, "jax_vs_torch.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        plot(out, result, launches[0])
    except ImportError as exc:
        print(f"jax_vs_torch.png not written: {exc} (pip install matplotlib)")


def plot(out, result, launch):
    """jax_vs_torch.png: JAX / torch per case against torch's step time, eight steps a call and one step a call
    back to back, coloured by batch, with the targets."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for ax, kind, torch_key, title in ((axes[0], "x8", "torch_graph_8_us", "eight steps a call"),
                                       (axes[1], "b2b", "torch_graph_us", "one step a call, back to back")):
        ratios = _ratios(rows, launch, kind)
        for batch in sorted({r["batch"] for r in rows}):
            pts = [(r[torch_key], x) for r, x in zip(rows, ratios) if r["batch"] == batch]
            ax.scatter(*zip(*pts), s=18, label=f"batch {batch}")
        for limit, style in ((1.25, ":"), (1.05, "--")):
            ax.axhline(limit, color="gray", linestyle=style, linewidth=1, label=f"target {limit}x")
        ax.set_xscale("log"); ax.set_yscale("log"); ax.grid(alpha=.3, which="both")
        ax.set_xlabel("torch graph, us a step"); ax.set_title(title)
    axes[0].set_ylabel("JAX / torch")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"msa_decode, M3 shapes, {len(rows)} cases: JAX ({launch} launch) against the torch graph "
                 f"({result['gpu']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "jax_vs_torch.png"), dpi=110)
    plt.close(fig)


def merge(paths) -> dict:
    """One result of several ``jax_vs_torch.json`` runs (the grid's halves): their rows in the grid's order; copy
    bandwidth and commands of each run kept (also those of the runs an input had merged itself)."""
    runs = [json.load(open(p)) for p in paths]
    if len({r["gpu"] for r in runs}) != 1:
        raise SystemExit(f"--merge: runs on different GPUs: {sorted({r['gpu'] for r in runs})}")
    cases = [(row["n"], row["batch"], row["context"]) for r in runs for row in r["rows"]]
    if len(set(cases)) != len(cases):
        raise SystemExit("--merge: a case is in more than one run")
    return dict(gpu=runs[0]["gpu"], copy_tbps=min(r["copy_tbps"] for r in runs),
                copy_tbps_per_run=[bw for r in runs for bw in r.get("copy_tbps_per_run", [r["copy_tbps"]])],
                xla_flags=runs[0]["xla_flags"], jax=runs[0]["jax"],
                command=" ; ".join(r["command"] for r in runs),
                rows=sorted((row for r in runs for row in r["rows"]),
                            key=lambda row: (row["n"], row["batch"], row["context"])))


def table(rows, launches) -> list:
    lines = ["| n | batch | context | launch | bit-identical | torch graph | torch eager | JAX jit | torch graph "
             "blocking | torch eager blocking | JAX jit blocking | torch graph x8 | JAX jit x8 | JAX / torch x8 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    return lines + [
        f"| {r['n']} | {r['batch']} | {r['context'] // 1024}k | {la} | {r[la + '_bit_identical']} | "
        f"{r['torch_graph_us']:.1f} | {r['torch_eager_us']:.1f} | {r[la + '_jax_jit_us']:.1f} | "
        f"{r['torch_graph_blocking_us']:.1f} | {r['torch_eager_blocking_us']:.1f} | "
        f"{r[la + '_jax_jit_blocking_us']:.1f} | {r['torch_graph_8_us']:.1f} | {r[la + '_jax_jit_8_us']:.1f} | "
        f"{r[la + '_jax_jit_8_us'] / r['torch_graph_8_us']:.3f} |" for r in rows for la in launches]


if __name__ == "__main__":
    main()
