"""The indexer backends side by side: `python3 -m benchmarks.indexer [--quick] [--sweep] [--jax] [--out DIR]`.

For each decode case of benchmarks/run.py's grid (head config x n x batch x
context) times, in the same process, ``index_scores`` and ``msa_decode`` with
``backend="triton"`` and ``backend="cutedsl"`` (CUDA-graph replay medians over
inputs rotated past L2), against the index floor (index-K once per request +
idx_q + scores, over the copy bandwidth measured first). Prints and writes
(results.json / results.md under --out) a table and the issue's targets:

* cutedsl never slower than Triton at batch >= 32,
* cutedsl >= 95% of the index floor at batch >= 32 and context >= 16k,
* cutedsl faster than Triton at batch <= 8.

``--index-fp8``: the same with an e4m3 index-K cache (its floor counts one
byte per element). ``--sweep``: also times the CuTeDSL scorer over pipeline stages and program
targets (``tuning.CUTEDSL_STAGES`` / ``CUTEDSL_TARGET_PROGRAMS``) on a few
cases, to pick the table's values. ``--jax``: the jitted JAX ``msa_decode``
with each backend at batch >= 32, 16k (steady-state throughput).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

import m3_torch
from m3_kernels import tuning

from .run import CONFIGS, L2_BYTES, PAGE, TOPK, Pool, copy_bandwidth, floors, make_step_inputs, time_graph

BACKENDS = ("triton", "cutedsl")


def case_rows(pool, cfg_name, cfg, batch, context, n, bw, jax_too, ik):
    """``ik``: the index-K cache (pool.ik, or an e4m3 copy of it)."""
    probe = make_step_inputs(pool, cfg, batch, context, n, seed=1)
    _, ids = m3_torch.msa_decode(probe["q"], probe["idx_q"], pool.k, pool.v, ik, probe["block_table"],
                                 probe["seq_lens"], decode_query_len=n, topk=TOPK)
    need = floors(probe, ids, cfg, n)
    if ik.element_size() == 1:   # floors() counts two bytes per index-K element
        fewer = int(((probe["lens"].long() + PAGE - 1) // PAGE).sum()) * PAGE * 128
        need["index_scores"] -= fewer
        need["msa_decode"] -= fewer
    rot = max(1, min(16, math.ceil(4 * L2_BYTES / max(need["index_scores"], 1))))
    sets = [probe] + [make_step_inputs(pool, cfg, batch, context, n, seed=s) for s in range(2, rot + 1)]
    scores = [torch.empty(cfg["hk"], s["q"].shape[0], s["block_table"].shape[1], device="cuda") for s in sets]
    outs = [torch.empty_like(s["q"]) for s in sets]
    rows = []
    for backend in BACKENDS:
        steps = {
            "index_scores": [lambda s=s, o=o, b=backend: m3_torch.index_scores(
                s["idx_q"], ik, s["block_table"], s["seq_lens"], decode_query_len=n, out=o, backend=b)
                for s, o in zip(sets, scores)],
            "msa_decode": [lambda s=s, o=o, b=backend: m3_torch.msa_decode(
                s["q"], s["idx_q"], pool.k, pool.v, ik, s["block_table"], s["seq_lens"], decode_query_len=n,
                topk=TOPK, out=o, backend=b) for s, o in zip(sets, outs)],
        }
        for op, fns in steps.items():
            us = time_graph(fns)
            rows.append(dict(config=cfg_name, batch=batch, context=context, n=n, op=op, backend=backend, us=us,
                             floor_us=need[op] / bw * 1e6, pct_floor=100 * need[op] / bw * 1e6 / us,
                             rotation=len(fns)))
        if jax_too and batch >= 32 and context == 16384:
            us = jax_msa_us(pool, sets, n, backend, ik)
            rows.append(dict(config=cfg_name, batch=batch, context=context, n=n, op="jax_msa_decode",
                             backend=backend, us=us, floor_us=need["msa_decode"] / bw * 1e6,
                             pct_floor=100 * need["msa_decode"] / bw * 1e6 / us, rotation=len(sets)))
    return rows


def jax_msa_us(pool, sets, n, backend, ik, calls=20, reps=5):
    import statistics

    import jax
    import m3_jax

    cache = [jax.dlpack.from_dlpack(t) for t in (pool.k, pool.v, ik)]
    per_set = [[jax.dlpack.from_dlpack(s[k]) for k in ("q", "idx_q", "block_table", "seq_lens")] for s in sets]

    @jax.jit
    def steps(cache, per_set):
        k, v, ik = cache
        return [m3_jax.msa_decode(q, iq, k, v, ik, bt, sl, decode_query_len=n, topk=TOPK, backend=backend)[0]
                for q, iq, bt, sl in per_set]

    jax.block_until_ready(steps(cache, per_set))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            result = steps(cache, per_set)
        jax.block_until_ready(result)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6 / (calls * len(sets))


def sweep_rows(pool, cfg, bw, max_context):
    """The CuTeDSL scorer over stages x program targets (M3 shapes, a few decode cases that fit the pool)."""
    rows = []
    saved = dict(tuning.CUTEDSL_STAGES), tuning.CUTEDSL_TARGET_PROGRAMS
    cases = [c for c in ((1, 16384, 1), (8, 16384, 1), (64, 16384, 1), (64, 65536, 1), (32, 16384, 8))
             if c[1] <= max_context]
    try:
        for batch, context, n in cases:
            sets = [make_step_inputs(pool, cfg, batch, context, n, seed=s) for s in range(1, 5)]
            outs = [torch.empty(cfg["hk"], s["q"].shape[0], s["block_table"].shape[1], device="cuda") for s in sets]
            index_k = sum(int(((s["lens"] + PAGE - 1) // PAGE).sum()) for s in sets) / len(sets) * PAGE * 128 * 2
            for stages in (2, 3, 4):
                for target in (256, 512, 1024, 2048):
                    tuning.CUTEDSL_STAGES[128] = stages
                    tuning.CUTEDSL_TARGET_PROGRAMS = target
                    us = time_graph([lambda s=s, o=o: m3_torch.index_scores(
                        s["idx_q"], pool.ik, s["block_table"], s["seq_lens"], decode_query_len=n, out=o,
                        backend="cutedsl") for s, o in zip(sets, outs)])
                    rows.append(dict(batch=batch, context=context, n=n, stages=stages, target=target, us=us,
                                     pct_floor=100 * index_k / bw * 1e6 / us))
                    print(f"sweep b={batch} L={context // 1024}k n={n} stages={stages} target={target}: "
                          f"{us:.1f} us ({rows[-1]['pct_floor']:.0f}% of the index-K floor)", flush=True)
    finally:
        tuning.CUTEDSL_STAGES.clear()
        tuning.CUTEDSL_STAGES.update(saved[0])
        tuning.CUTEDSL_TARGET_PROGRAMS = saved[1]
    return rows


def targets_report(rows) -> list:
    """The issue's three targets, case by case: (target, case, met, detail)."""
    out = []
    by = {(r["config"], r["n"], r["batch"], r["context"], r["op"], r["backend"]): r for r in rows}
    for (cfg, n, batch, context, op, backend), r in sorted(by.items()):
        if op != "index_scores" or backend != "cutedsl":
            continue
        t = by.get((cfg, n, batch, context, op, "triton"))
        case = f"{cfg} n={n} b={batch} {context // 1024}k"
        if t is None:
            continue
        ratio = t["us"] / r["us"]
        if batch >= 32:
            out.append(("never slower than Triton (b >= 32)", case, r["us"] <= t["us"] * 1.02,
                        f"cutedsl {r['us']:.1f} us, triton {t['us']:.1f} us"))
        if batch >= 32 and context >= 16384:
            out.append((">= 95% of index floor (b >= 32, >= 16k)", case, r["pct_floor"] >= 95,
                        f"{r['pct_floor']:.0f}%"))
        if batch <= 8:
            out.append(("faster than Triton (b <= 8)", case, ratio > 1.0, f"x{ratio:.2f}"))
    return out


def write(out_dir, meta, rows, sweep, report):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, sweep=sweep, targets=report), f, indent=1)
    lines = [f"# Indexer backends on {meta['gpu']} ({meta['date']})", "",
             f"Copy bandwidth (same run): {meta['copy_tbps']:.2f} TB/s. Command: `{meta['command']}`. "
             "CUDA-graph replay medians (us) and % of the floor (index_scores: index-K once per request + idx_q + "
             "scores; msa_decode: run.py's floor).", ""]
    ops = ["index_scores", "msa_decode", "jax_msa_decode"]
    for cfg in CONFIGS:
        sel = [r for r in rows if r["config"] == cfg]
        if not sel:
            continue
        cols = [(op, b) for op in ops for b in BACKENDS if any(r["op"] == op and r["backend"] == b for r in sel)]
        lines += [f"## {cfg}", "", "| n | batch | context | " + " | ".join(f"{op} {b}" for op, b in cols) + " |",
                  "|---|---|---|" + "---|" * len(cols)]
        for key in sorted({(r["n"], r["batch"], r["context"]) for r in sel}):
            cells = []
            for op, b in cols:
                r = next((r for r in sel if (r["n"], r["batch"], r["context"]) == key and r["op"] == op
                          and r["backend"] == b), None)
                cells.append("" if r is None else f"{r['us']:.1f} ({r['pct_floor']:.0f}%)")
            lines.append(f"| {key[0]} | {key[1]} | {key[2] // 1024}k | " + " | ".join(cells) + " |")
        lines.append("")
    if report:
        lines += ["## Targets (cutedsl index_scores)", "", "| target | case | met | |", "|---|---|---|---|"]
        lines += [f"| {t} | {c} | {'yes' if ok else 'NO'} | {d} |" for t, c, ok, d in report]
        lines.append("")
    if sweep:
        lines += ["## Sweep (cutedsl index_scores, M3 shapes)", "", "| n | batch | context | stages | target | us | "
                  "% index-K floor |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['n']} | {r['batch']} | {r['context'] // 1024}k | {r['stages']} | {r['target']} | "
                  f"{r['us']:.1f} | {r['pct_floor']:.0f}% |" for r in sweep]
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few cases only")
    ap.add_argument("--sweep", action="store_true", help="also sweep the CuTeDSL stages and program targets")
    ap.add_argument("--jax", action="store_true", help="also time the jitted JAX msa_decode (b >= 32, 16k)")
    ap.add_argument("--index-fp8", action="store_true", help="an e4m3 index-K cache")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results/latest"), "indexer"))
    ap.add_argument("--budget-s", type=float, default=400, help="stop starting new cases after this")
    args = ap.parse_args()
    t_start = time.time()
    bw = copy_bandwidth()
    meta = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), copy_tbps=bw / 1e12,
                command="python3 -m benchmarks.indexer" + "".join(
                    f" --{k.replace('_', '-')}" for k in ("quick", "sweep", "jax", "index_fp8") if getattr(args, k)),
                torch=torch.__version__, triton=__import__("triton").__version__)
    try:
        import importlib.metadata

        import cutlass.cute  # noqa: F401
        meta["cutlass_dsl"] = importlib.metadata.version("nvidia-cutlass-dsl")
    except ImportError as e:
        raise SystemExit(f"benchmarks.indexer: nvidia-cutlass-dsl is not importable ({e})")
    print(f"{meta['gpu']}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    batches = [1, 8, 64] if args.quick else [1, 8, 32, 64, 128]
    contexts = [4096, 16384] if args.quick else [1024, 4096, 16384, 65536, 131072]
    rows, sweep = [], []
    for cfg_name, cfg in CONFIGS.items():
        pool = Pool(cfg, max(batches) * -(-int(max(contexts) * 1.1) // PAGE) + 64)
        ik = pool.ik.to(torch.float8_e4m3fn) if args.index_fp8 else pool.ik
        for n in (1, 8):
            for batch in batches:
                for context in contexts:
                    if time.time() - t_start > args.budget_s:
                        break
                    try:
                        got = case_rows(pool, cfg_name, cfg, batch, context, n, bw, args.jax, ik)
                    except Exception as exc:   # one broken case must not lose the rest
                        print(f"{cfg_name} n={n} b={batch} L={context}: FAILED {type(exc).__name__}: {exc}",
                              flush=True)
                        torch.cuda.empty_cache()
                        continue
                    rows += got
                    print(f"{cfg_name} n={n} b={batch:3d} L={context // 1024:3d}k  " + "  ".join(
                        f"{r['op']}[{r['backend']}] {r['us']:.1f} us ({r['pct_floor']:.0f}%)" for r in got),
                        flush=True)
        if args.sweep and cfg_name == "M3":
            sweep = sweep_rows(pool, cfg, bw, max(contexts))
        del pool, ik
        torch.cuda.empty_cache()
    report = targets_report(rows)
    write(args.out, meta, rows, sweep, report)
    print(open(os.path.join(args.out, "results.md")).read())


if __name__ == "__main__":
    main()
