"""MSA decode benchmark suite on one GPU: `python3 -m benchmarks.run [--quick] [--out DIR]`.

Measures the card's copy bandwidth, then for each case (head config x batch x
context x decode_query_len) the CUDA-graph replay time of every decode op,
the whole msa_decode step, and the baselines:
  (a) plain torch: gather pages, matmul + amax scores, torch.topk, gather the
      chosen blocks, scaled_dot_product_attention;
  (b) prefill-shaped: our attention kernel with one decode token per 128-row
      query tile and no split-K (what engines ran before decode kernels);
  (c) dense_decode over the whole context (what sparsity saves);
  (d) the same msa_decode launched from JAX at batch >= 32 and 16k: one jitted
      function over the rotated inputs, steady-state throughput.
Floors: bytes an op must move / measured copy bandwidth (index-K once per
request; the distinct chosen K/V blocks once per (request, KV head); q, out).
Inputs rotate through more memory than L2 holds. Writes results.json,
results.md and plots to --out; prints a summary table last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import m3_torch
from m3_kernels import maps, tuning
from m3_torch import ops

PAGE = 128
L2_BYTES = 60 << 20
CONFIGS = {"M3": dict(hq=64, hk=4, d=128), "TP8": dict(hq=8, hk=1, d=128)}
TOPK = 16


def copy_bandwidth():
    x = torch.empty(1 << 29, device="cuda")  # 2 GiB
    y = torch.empty_like(x)
    ms = time_fn(lambda: y.copy_(x), reps=20)
    del x, y
    return 2 * (1 << 29) * 4 / (ms * 1e-3)


def time_fn(fn, reps=30):
    """Median milliseconds of fn() between CUDA events (after 3 warm-up calls)."""
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start.record(); fn(); end.record(); end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_graph(steps, reps=30):
    """Per-step median microseconds of one CUDA graph replaying ``steps`` (rotated inputs)."""
    for s in steps:
        s()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):   # as the engine (m3_torch.engine)
        for s in steps:
            s()
    ms = time_fn(graph.replay, reps)
    del graph
    return ms * 1e3 / len(steps)


@contextlib.contextmanager
def sparse_layout(packed):
    """Sparse attention row tiles of several tokens (True), of one token (False) or as the default
    rules pick (None), for the ``with`` block: MTP decode (``maps.decode_tile``) and prefill
    (``maps.prefill_tile_kind``; make a fresh plan inside) alike."""
    saved = maps.SPARSE_PACK_RATIO, maps.SPARSE_PACK_MIN_PROGRAMS
    if packed is not None:
        maps.SPARSE_PACK_RATIO, maps.SPARSE_PACK_MIN_PROGRAMS = (0, 0) if packed else (1 << 30, 0)
    try:
        yield
    finally:
        maps.SPARSE_PACK_RATIO, maps.SPARSE_PACK_MIN_PROGRAMS = saved


class Pool:
    """Random bf16 K/V/index-K pages for one head config, shared by its cases."""

    def __init__(self, cfg, num_pages):
        g = torch.Generator(device="cuda").manual_seed(0)
        shape = (num_pages, cfg["hk"], PAGE, cfg["d"])
        self.k = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        self.v = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        self.ik = torch.randn(num_pages, PAGE, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        self.num_pages = num_pages


def make_step_inputs(pool, cfg, batch, context, n, seed):
    """One step's inputs: lengths within +-10% of context, random pages of the pool."""
    g = torch.Generator().manual_seed(seed)
    lens = (context * (0.9 + 0.2 * torch.rand(batch, generator=g))).int().clamp(min=n)
    max_blocks = int(-(-int(lens.max()) // PAGE))
    pages = torch.randperm(pool.num_pages, generator=g)[:batch * max_blocks].int().reshape(batch, max_blocks)
    T = batch * n
    return dict(
        q=torch.randn(T, cfg["hq"], cfg["d"], generator=g).to("cuda", torch.bfloat16),
        idx_q=torch.randn(T, cfg["hk"], 128, generator=g).to("cuda", torch.bfloat16),
        block_table=pages.cuda(), seq_lens=lens.cuda(), lens=lens)


def floors(x, ids, cfg, n):
    """Bytes each op must move."""
    lens = x["lens"].long()
    blocks = (lens + PAGE - 1) // PAGE
    T, Hq, D, Hk = x["q"].shape[0], cfg["hq"], cfg["d"], cfg["hk"]
    max_blocks = x["block_table"].shape[1]
    page_kv = PAGE * D * 2 * 2  # K and V of one (block, KV head)
    qo = 2 * T * Hq * D * 2
    index_k = int(blocks.sum()) * PAGE * 128 * 2
    scores = Hk * T * max_blocks * 4
    ids_np = ids.cpu().numpy().reshape(Hk, -1, n, TOPK)
    distinct = sum(len(set(ids_np[h, r].ravel().tolist()) - {-1}) for h in range(Hk) for r in range(ids_np.shape[1]))
    return dict(
        index_scores=index_k + T * Hk * 128 * 2 + scores,
        select_blocks=scores + Hk * T * TOPK * 4,
        sparse_decode=distinct * page_kv + qo,
        dense_decode=int(lens.sum()) * Hk * D * 2 * 2 + qo,
        msa_decode=index_k + T * Hk * 128 * 2 + distinct * page_kv + qo,
    )


def torch_baseline(pool, x, n, cfg):
    """(a) plain torch msa step: gathers, matmul, amax, topk, SDPA."""
    bt, lens = x["block_table"].long(), x["seq_lens"].long()
    R, MB = bt.shape
    T, Hk, G, D = x["q"].shape[0], cfg["hk"], cfg["hq"] // cfg["hk"], cfg["d"]
    pos = (lens[:, None] - n + torch.arange(n, device="cuda")).reshape(T)          # [T]
    req = torch.arange(R, device="cuda").repeat_interleave(n)
    keys = pool.ik[bt]                                                              # [R, MB, 128, Di]
    dots = torch.einsum("thd,tbkd->htbk", x["idx_q"].float(), keys[req].float())  # [Hk, T, MB, 128]
    kv_pos = torch.arange(MB * PAGE, device="cuda").reshape(MB, PAGE)
    dots = dots.masked_fill(kv_pos > pos[None, :, None, None], -math.inf)
    scores = dots.amax(-1)
    ids = scores.topk(min(TOPK, MB), dim=-1).indices                                # [Hk, T, k]
    pages = bt[req[None, :, None], ids]                                             # [Hk, T, k]
    heads = torch.arange(Hk, device="cuda")[:, None, None]
    k = pool.k[pages, heads].flatten(2, 3)                                          # [Hk, T, k*128, D]
    v = pool.v[pages, heads].flatten(2, 3)
    tok = (ids[..., None] * PAGE + torch.arange(PAGE, device="cuda")).flatten(2)
    mask = tok <= pos[None, :, None]                                                # [Hk, T, k*128]
    q = x["q"].reshape(T, Hk, G, D).permute(1, 0, 2, 3)                             # [Hk, T, G, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, :, None, :])
    return out


def torch_baseline_bytes(batch, context, n, cfg):
    mb = -(-int(context * 1.1) // PAGE)
    T = batch * n
    return (batch * mb * PAGE * 128 * 2 * (1 + n)                  # gathered index-K (+ per-token copy)
            + cfg["hk"] * T * mb * PAGE * 4 * 2                    # dots (+ masked copy)
            + 2 * cfg["hk"] * T * TOPK * PAGE * cfg["d"] * 2)      # gathered K and V


def prefill_shaped(x, pool, ids, n, cfg):
    """(b) one decode token per 128-row query tile, no split-K."""
    group = cfg["hq"] // cfg["hk"]
    tokens_per_tile = maps.row_tile(group, 128).tokens_per_tile
    T = x["q"].shape[0]
    key = ("prefill_shaped", T, n)
    if key not in _maps:
        _maps[key] = torch.tensor([(t // n, t, t % n - n, 1) for t in range(T)], dtype=torch.int32, device="cuda")
    out = torch.empty_like(x["q"])

    def step():
        with tuning.override(sparse_target_programs=1):  # no split-K
            ops.paged_attention(x["q"], pool.k, pool.v, ids, x["block_table"], x["seq_lens"], _maps[key], out,
                                None, None, tokens_per_tile, cfg["d"] ** -0.5, None, None)
    return step


_maps: dict = {}


def jax_steps_us(pool, sets, n, calls=20, reps=5):
    """(d) per-step microseconds of the jitted JAX msa_decode, as steady-state throughput.

    One jitted function runs the step on every input set (as the torch CUDA
    graph replays them); ``calls`` calls are issued back to back and waited for
    once, so host dispatch overlaps the GPU as in a serving loop. Median of ``reps``.
    """
    import jax
    import m3_jax

    cache = [jax.dlpack.from_dlpack(t) for t in (pool.k, pool.v, pool.ik)]
    per_set = [[jax.dlpack.from_dlpack(s[key]) for key in ("q", "idx_q", "block_table", "seq_lens")] for s in sets]

    @jax.jit
    def steps(cache, per_set):
        k, v, ik = cache
        return [m3_jax.msa_decode(q, iq, k, v, ik, bt, sl, decode_query_len=n, topk=TOPK)[0]
                for q, iq, bt, sl in per_set]

    def run():
        for _ in range(calls):
            result = steps(cache, per_set)
        jax.block_until_ready(result)

    run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6 / (calls * len(sets))


def run_case(pool, cfg_name, cfg, batch, context, n, bw, full):
    probe = make_step_inputs(pool, cfg, batch, context, n, seed=1)
    out = torch.empty_like(probe["q"])
    _, ids = m3_torch.msa_decode(probe["q"], probe["idx_q"], pool.k, pool.v, pool.ik, probe["block_table"],
                                 probe["seq_lens"], decode_query_len=n, topk=TOPK, out=out)
    need = floors(probe, ids, cfg, n)
    rot = max(1, min(16, math.ceil(4 * L2_BYTES / max(need["msa_decode"], 1))))
    sets = [probe] + [make_step_inputs(pool, cfg, batch, context, n, seed=s) for s in range(2, rot + 1)]
    outs = [torch.empty_like(s["q"]) for s in sets]
    idss = [m3_torch.msa_decode(s["q"], s["idx_q"], pool.k, pool.v, pool.ik, s["block_table"], s["seq_lens"],
                                decode_query_len=n, topk=TOPK)[1] for s in sets]
    scoress = [m3_torch.index_scores(s["idx_q"], pool.ik, s["block_table"], s["seq_lens"], decode_query_len=n)
               for s in sets]
    ops = {
        "index_scores": [lambda s=s, o=o: m3_torch.index_scores(s["idx_q"], pool.ik, s["block_table"], s["seq_lens"],
                                                               decode_query_len=n, out=o)
                         for s, o in zip(sets, scoress)],
        "select_blocks": [lambda s=s, sc=sc, i=i: m3_torch.select_blocks(sc, s["seq_lens"], decode_query_len=n,
                                                                         topk=TOPK, out=i)
                          for s, sc, i in zip(sets, scoress, idss)],
        "sparse_decode": [lambda s=s, i=i, o=o: m3_torch.sparse_decode(s["q"], pool.k, pool.v, i, s["block_table"],
                                                                       s["seq_lens"], decode_query_len=n, out=o)
                          for s, i, o in zip(sets, idss, outs)],
        "msa_decode": [lambda s=s, o=o: m3_torch.msa_decode(s["q"], s["idx_q"], pool.k, pool.v, pool.ik,
                                                            s["block_table"], s["seq_lens"], decode_query_len=n,
                                                            topk=TOPK, out=o)
                       for s, o in zip(sets, outs)],
    }
    if full:
        ops["dense_decode"] = [lambda s=s, o=o: m3_torch.dense_decode(s["q"], pool.k, pool.v, s["block_table"],
                                                                      s["seq_lens"], decode_query_len=n, out=o)
                               for s, o in zip(sets, outs)]
        ops["baseline_prefill_shaped"] = [prefill_shaped(s, pool, i, n, cfg) for s, i in zip(sets, idss)]
        if torch_baseline_bytes(batch, context, n, cfg) < 8e9:
            ops["baseline_torch"] = [lambda s=s: torch_baseline(pool, s, n, cfg) for s in sets[:2]]
    if full and n > 1:  # the other MTP layout for sparse decode (maps.decode_tile)
        ops["sparse_decode_other_mtp_layout"] = ops["sparse_decode"]
    packs = maps.decode_tile(cfg["hq"] // cfg["hk"], n, True, max_blocks=probe["block_table"].shape[1], topk=TOPK,
                             num_requests=batch, num_kv_heads=cfg["hk"], interpret=False).tokens_per_tile > 1
    rows = []
    for op, steps in ops.items():
        other = op == "sparse_decode_other_mtp_layout"
        try:
            with sparse_layout(not packs if other else None):
                us = time_graph(steps)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            continue
        floor_key = {"baseline_prefill_shaped": "sparse_decode", "baseline_torch": "msa_decode",
                     "sparse_decode_other_mtp_layout": "sparse_decode"}.get(op, op)
        nbytes = need[floor_key]
        rows.append(dict(config=cfg_name, batch=batch, context=context, n=n, op=op, us=us, bytes=nbytes,
                         floor_us=nbytes / bw * 1e6, pct_floor=100 * nbytes / bw * 1e6 / us,
                         tbps=nbytes / (us * 1e-6) / 1e12, rotation=len(steps)))
    if full and batch >= 32 and context == 16384 and os.environ.get("M3_BENCH_JAX", "1") == "1":
        try:
            us = jax_steps_us(pool, sets, n)
            rows.append(dict(config=cfg_name, batch=batch, context=context, n=n, op="jax_msa_decode", us=us,
                             bytes=need["msa_decode"], floor_us=need["msa_decode"] / bw * 1e6,
                             pct_floor=100 * need["msa_decode"] / bw * 1e6 / us,
                             tbps=need["msa_decode"] / (us * 1e-6) / 1e12, rotation=len(sets)))
            eager = time_fn(ops["msa_decode"][0]) * 1e3
            rows.append(dict(config=cfg_name, batch=batch, context=context, n=n, op="torch_eager_msa_decode",
                             us=eager, bytes=need["msa_decode"], floor_us=need["msa_decode"] / bw * 1e6,
                             pct_floor=100 * need["msa_decode"] / bw * 1e6 / eager,
                             tbps=need["msa_decode"] / (eager * 1e-6) / 1e12, rotation=1))
        except Exception as exc:  # jax-triton missing: say so, keep going
            print(f"  jax timing skipped: {type(exc).__name__}: {str(exc)[:120]}")
    return rows


def prefill_rows(bw, matmul_flops):
    """One request of 8k and of 32k prompt tokens (no cached prefix), M3 shapes, eager timing.

    Floors: attention is matrix-bound, so the floor is its FLOPs over the
    measured bf16 matmul rate (dense: causal T^2/2 pairs; sparse: each token's
    visible part of its 16 chosen blocks); the indexer's floor counts FLOPs too.
    """
    from m3_torch import prefill_plan
    cfg = CONFIGS["M3"]
    rows = []
    for T in (8192, 32768):
        nb = T // PAGE
        g = torch.Generator(device="cuda").manual_seed(T)
        mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = mk(nb, cfg["hk"], PAGE, cfg["d"]), mk(nb, cfg["hk"], PAGE, cfg["d"])
        ik, q, iq = mk(nb, PAGE, 128), mk(T, cfg["hq"], cfg["d"]), mk(T, cfg["hk"], 128)
        bt = torch.randperm(nb, device="cuda").int()[None]
        sl = torch.tensor([T], dtype=torch.int32, device="cuda")
        cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
        plan = prefill_plan(cu)
        out = torch.empty_like(q)
        ids = m3_torch.msa_prefill(q, iq, k, v, ik, bt, sl, cu_seqlens_q=cu, plan=plan, out=out)[1]
        pairs_dense = T * (T + 1) / 2
        pos = torch.arange(T, device="cuda")
        chosen = ((ids >= 0) & (ids < (pos[None, :, None] // PAGE) + 1)).sum().item()  # blocks, all KV heads
        pairs_sparse = chosen * PAGE / cfg["hk"]                                        # per KV head (upper bound)
        attn_flops = lambda pairs: 4 * pairs * cfg["d"] * cfg["hq"]
        ops = {
            "dense_prefill": (lambda: m3_torch.dense_prefill(q, k, v, bt, sl, cu_seqlens_q=cu, plan=plan, out=out),
                              attn_flops(pairs_dense)),
            "msa_prefill": (lambda: m3_torch.msa_prefill(q, iq, k, v, ik, bt, sl, cu_seqlens_q=cu, plan=plan,
                                                         out=out),
                            attn_flops(pairs_sparse) + 2 * pairs_dense * 128 * cfg["hk"]),
        }
        for op, (fn, flops) in ops.items():
            us = time_fn(fn, reps=5) * 1e3
            floor_us = flops / matmul_flops * 1e6
            rows.append(dict(config="M3", batch=1, context=T, n=T, op=op, us=us, bytes=0, flops=flops,
                             floor_us=floor_us, pct_floor=100 * floor_us / us, tbps=0.0, rotation=1))
            print(f"prefill {op} T={T}: {us / 1e3:.2f} ms, floor {floor_us / 1e3:.2f} ms "
                  f"({100 * floor_us / us:.0f}%)", flush=True)
        del k, v, ik, q, iq
    return rows


def matmul_rate():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms = time_fn(lambda: a @ b, reps=10)
    return 2 * 8192 ** 3 / (ms * 1e-3)


def profiled_kernels(fn, cuda: bool) -> list:
    """(name, microseconds) of the kernels ``fn()`` runs, in launch order: on a GPU torch.profiler's CUDA
    kernels (memcpy / memset not counted); on the CPU the top-level CPU ops (the ``m3::`` custom ops run the
    kernels in Triton's interpreter)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA
                  and not e.name.startswith(("Memcpy", "Memset"))]
    else:
        events = [e for e in prof.events() if e.device_type == DeviceType.CPU and e.cpu_parent is None]
    return [(e.name, e.time_range.elapsed_us()) for e in sorted(events, key=lambda e: e.time_range.start)]


def save_results(out_dir, name: str, result: dict, markdown: str):
    """``result`` as ``<out_dir>/<name>.json`` and its ``markdown`` as ``<name>.md``; the markdown is printed."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(markdown)
    print(markdown)


def write_outputs(out_dir, meta, rows):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# MSA decode on {meta['gpu']} ({meta['date']})", "",
             f"Copy bandwidth (same run): {meta['copy_tbps']:.2f} TB/s; bf16 matmul {meta['bf16_matmul_tflops']:.0f} "
             f"TFLOP/s. Command: `{meta['command']}`.",
             "Times: CUDA-graph replay medians (us); % floor = (bytes / copy bandwidth) / time. "
             "jax_msa_decode: the jitted JAX step, steady-state throughput (back-to-back calls); "
             "torch_eager_msa_decode: one eager call. sparse_decode_other_mtp_layout: n > 1 with the row-tile "
             "layout the default did not pick (maps.decode_tile: packed tiles at contexts <= 4k (n = 8) from "
             "batch 8 (M3) here, one tile per token otherwise).", ""]
    for cfg in CONFIGS:
        sel = [r for r in rows if r["config"] == cfg and not r["op"].endswith("_prefill")]
        if not sel:
            continue
        ops = list(dict.fromkeys(r["op"] for r in sel))
        lines += [f"## {cfg}", "", "| n | batch | context | " + " | ".join(ops) + " |",
                  "|---|---|---|" + "---|" * len(ops)]
        for key in sorted({(r["n"], r["batch"], r["context"]) for r in sel}):
            cells = []
            for op in ops:
                r = next((r for r in sel if (r["n"], r["batch"], r["context"]) == key and r["op"] == op), None)
                cells.append("" if r is None else f"{r['us']:.1f} ({r['pct_floor']:.0f}%)")
            lines.append(f"| {key[0]} | {key[1]} | {key[2] // 1024}k | " + " | ".join(cells) + " |")
        lines.append("")
    pre = [r for r in rows if r["op"].endswith("_prefill")]
    if pre:
        lines += ["## Prefill (one request, no prefix; floor = FLOPs / measured bf16 matmul rate)", "",
                  "| tokens | op | ms | floor ms | % floor |", "|---|---|---|---|---|"]
        lines += [f"| {r['context']} | {r['op']} | {r['us'] / 1e3:.2f} | {r['floor_us'] / 1e3:.2f} | "
                  f"{r['pct_floor']:.0f}% |" for r in pre]
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(lines))
    try:
        plot(out_dir, rows)
    except Exception as exc:
        print(f"plots skipped: {exc}")


def plot(out_dir, rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, op in zip(axes, ["index_scores", "sparse_decode", "msa_decode"]):
        for (n, batch) in sorted({(r["n"], r["batch"]) for r in rows if r["config"] == "M3"}):
            pts = sorted((r["context"], r["pct_floor"]) for r in rows
                         if r["config"] == "M3" and r["op"] == op and r["n"] == n and r["batch"] == batch)
            if pts:
                ax.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], marker="o", label=f"n={n} b={batch}")
        ax.set_xscale("log", base=2); ax.set_xlabel("context (k tokens)"); ax.set_ylabel("% of floor")
        ax.set_title(f"{op} (M3 shapes)"); ax.grid(alpha=.3)
    axes[-1].legend(fontsize=7, ncol=2)
    fig.tight_layout(); fig.savefig(os.path.join(out_dir, "pct_floor.png"), dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few cases only")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/latest"))
    ap.add_argument("--budget-s", type=float, default=400, help="stop starting new cases after this")
    ap.add_argument("--batches", help="comma-separated batch sizes (instead of the grid's)")
    ap.add_argument("--contexts", help="comma-separated context lengths (instead of the grid's)")
    ap.add_argument("--ns", default="1,8", help="comma-separated decode_query_len values")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="head configs, of " + ", ".join(CONFIGS))
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill rows")
    ap.add_argument("--no-baselines", action="store_true",
                    help="M3 too without dense_decode and the torch baselines (the MSA kernels only)")
    args = ap.parse_args()
    t_start = time.time()
    bw = copy_bandwidth()
    meta = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), copy_tbps=bw / 1e12,
                command="python3 -m " + " ".join(["benchmarks.run"] + sys.argv[1:]),
                torch=torch.__version__, triton=__import__("triton").__version__)
    flops = matmul_rate()
    meta["bf16_matmul_tflops"] = flops / 1e12
    print(f"{meta['gpu']}: copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)
    batches = [8, 64] if args.quick else [1, 8, 32, 64, 128]
    contexts = [4096, 32768] if args.quick else [1024, 4096, 16384, 65536, 131072]
    batches = [int(b) for b in args.batches.split(",")] if args.batches else batches
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else contexts
    rows = []
    for cfg_name in args.configs.split(","):
        cfg = CONFIGS[cfg_name]
        pages = max(batches) * -(-int(max(contexts) * 1.1) // PAGE) + 64
        pool = Pool(cfg, pages)
        for n in (int(x) for x in args.ns.split(",")):
            for batch in batches:
                for context in contexts:
                    if time.time() - t_start > args.budget_s:
                        print(f"time budget reached: stopping before {cfg_name} n={n} b={batch} L={context}")
                        break
                    full = cfg_name == "M3" and not args.no_baselines
                    try:
                        case_rows = run_case(pool, cfg_name, cfg, batch, context, n, bw, full)
                    except Exception as exc:  # report and go on: one broken case must not lose the rest
                        print(f"{cfg_name} n={n} b={batch} L={context}: FAILED {type(exc).__name__}: {exc}")
                        torch.cuda.empty_cache()
                        continue
                    rows += case_rows
                    msa = next(r for r in case_rows if r["op"] == "msa_decode")
                    print(f"{cfg_name} n={n} b={batch:3d} L={context // 1024:3d}k  msa {msa['us']:8.1f} us "
                          f"({msa['pct_floor']:3.0f}% floor)  "
                          + "  ".join(f"{r['op']} {r['us']:.1f}" for r in case_rows if r["op"] != "msa_decode"),
                          flush=True)
        del pool
        torch.cuda.empty_cache()
    try:
        rows += [] if args.no_prefill else prefill_rows(bw, flops)
    except Exception as exc:
        print(f"prefill timing FAILED {type(exc).__name__}: {exc}")
    write_outputs(args.out, meta, rows)
    print(open(os.path.join(args.out, "results.md")).read())


if __name__ == "__main__":
    main()
