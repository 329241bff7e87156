"""Launch-parameter sweeps of the decode kernels (GPU), CUDA-graph timed.

    python3 -m benchmarks.tune sparse   # sparse_decode n=1: splits x BLOCK_N x stages x warps, batch 32/64/128, 16k
    python3 -m benchmarks.tune small    # sparse_decode n=1 split counts at batch 1-16 (launch-bound cases)
    python3 -m benchmarks.tune select   # select_blocks: one- or two-level top-k x warps
    python3 -m benchmarks.tune mtp      # sparse/msa_decode n=2-8, short contexts: packed vs per-token row tiles
    python3 -m benchmarks.tune index    # index_scores and dense_decode: warps x stages x BLOCK_N, batch 64, 32k
    python3 -m benchmarks.tune fp8      # e4m3 caches: the index_scores, sparse_decode, dense_decode knobs
    python3 -m benchmarks.tune prefill  # dense_prefill and index_scores_prefill knobs, one 32k prompt

Prints one line per variant (median microseconds over a graph of rotated input
sets; % of the copy-bandwidth floor where it has one). The winners go into
kernels/tuning.py by hand; docs/PERF.md records the runs.
"""
import argparse
import dataclasses
import itertools

import torch

import m3_kernels
import m3_torch
from benchmarks.run import (CONFIGS, Pool, copy_bandwidth, make_step_inputs, matmul_rate, sparse_layout, time_fn,
                            time_graph)
from m3_kernels import maps, tuning

PAGE, HQ, HK, D, TOPK = 128, 64, 4, 128, 16


class Cache:
    """Random bf16 K/V/index-K pages, enough for the sweeps' largest case."""

    def __init__(self, pages):
        self.k = torch.randn(pages, HK, PAGE, D, device="cuda", dtype=torch.bfloat16)
        self.v = torch.randn_like(self.k)
        self.ik = torch.randn(pages, PAGE, D, device="cuda", dtype=torch.bfloat16)
        self.pages = pages

    def step(self, batch, context, n=1, seed=0):
        """One step's inputs (lengths within +-10% of context), its scores and chosen blocks."""
        g = torch.Generator().manual_seed(seed)
        lens = (context * (0.9 + 0.2 * torch.rand(batch, generator=g))).int()
        mb = int((lens.max() + PAGE - 1) // PAGE)
        bt = torch.randperm(self.pages, generator=g)[:batch * mb].int().reshape(batch, mb).cuda()
        q = torch.randn(batch * n, HQ, D, device="cuda", dtype=torch.bfloat16)
        iq = torch.randn(batch * n, HK, D, device="cuda", dtype=torch.bfloat16)
        sl = lens.cuda()
        scores = m3_torch.index_scores(iq, self.ik, bt, sl, decode_query_len=n)
        ids = m3_torch.select_blocks(scores, sl, decode_query_len=n)
        return dict(q=q, iq=iq, bt=bt, sl=sl, scores=scores, ids=ids, out=torch.empty_like(q), n=n)

    def sparse_us(self, sets):
        return time_graph([lambda x=x: m3_torch.sparse_decode(x["q"], self.k, self.v, x["ids"], x["bt"], x["sl"],
                                                              decode_query_len=x["n"], out=x["out"]) for x in sets])


def kv_floor_us(batch, bw):
    """sparse_decode n=1 floor: 16 chosen K/V blocks per (request, KV head)."""
    return batch * HK * TOPK * PAGE * D * 2 * 2 / bw * 1e6


def with_plan(**changes):
    """Patch tuning.attention to return its config with ``changes``; returns the undo."""
    return _patch("attention", changes)


def with_index_plan(**changes):
    """Patch tuning.index_scores to return its config with ``changes``; returns the undo."""
    return _patch("index_scores", changes)


def _patch(name, changes):
    orig = getattr(tuning, name)
    setattr(tuning, name, lambda **kw: dataclasses.replace(orig(**kw), **changes))
    return lambda: setattr(tuning, name, orig)


def sweep_sparse(bw):
    cache = Cache(128 * 160)
    for batch in (32, 64, 128):
        sets = [cache.step(batch, 16384, seed=s) for s in range(4)]
        print(f"-- sparse_decode batch {batch}, 16k, n=1: floor {kv_floor_us(batch, bw):.1f} us", flush=True)
        for splits, (block_n, stages), warps in itertools.product((1, 2, 4, 8), ((64, 3), (128, 2), (128, 3)), (4, 8)):
            undo = with_plan(num_splits=splits, block_n=block_n, num_stages=stages, num_warps=warps)
            try:
                us = cache.sparse_us(sets)
            finally:
                undo()
            print(f"splits {splits} BLOCK_N {block_n:3d} stages {stages} warps {warps}: {us:7.1f} us "
                  f"{100 * kv_floor_us(batch, bw) / us:4.0f}%", flush=True)


def sweep_small(bw):
    cache = Cache(128 * 100)
    for batch, context in ((1, 4096), (8, 4096), (8, 131072), (16, 16384)):
        sets = [cache.step(batch, context, seed=s) for s in range(4)]
        line = []
        for splits in (1, 2, 4, 8, 16):
            undo = with_plan(num_splits=splits)
            try:
                line.append(f"{splits} splits {cache.sparse_us(sets):6.1f}")
            finally:
                undo()
        tile = maps.decode_tile(HQ // HK, 1, True, max_blocks=1, topk=TOPK, num_requests=batch, num_kv_heads=HK,
                                interpret=False)
        default = tuning.attention(tile=tile,
                                   num_tiles=batch, num_kv_heads=HK, head_dim=D, topk=TOPK, max_blocks=1,
                                   sparse=True, interpret=False).num_splits
        print(f"batch {batch} {context // 1024}k n=1 (floor {kv_floor_us(batch, bw):.1f} us, default {default} "
              f"splits): " + "  ".join(line), flush=True)


def sweep_select(bw):
    orig_select, orig_two_level = tuning.select_blocks, tuning.SELECT_TWO_LEVEL_BLOCKS
    for batch, context, n in ((8, 16384, 1), (64, 16384, 1), (8, 131072, 1), (128, 131072, 1), (32, 131072, 8),
                              (128, 65536, 8)):
        sets = []
        for seed in range(4):  # scores straight from randn: select does not care where they came from
            g = torch.Generator().manual_seed(seed)
            lens = (context * (0.9 + 0.2 * torch.rand(batch, generator=g))).int().cuda()
            mb = int((lens.max() + PAGE - 1) // PAGE)
            sets.append((torch.randn(HK, batch * n, mb, device="cuda"), lens,
                         torch.empty(HK, batch * n, TOPK, dtype=torch.int32, device="cuda")))
        line, first = [], None
        for two_level, warps in itertools.product((False, True), (1, 2, 4, 8)):
            tuning.SELECT_TWO_LEVEL_BLOCKS = 0 if two_level else 1 << 30
            tuning.select_blocks = lambda w=warps, **kw: (*orig_select(**kw)[:2], w)
            try:
                us = time_graph([lambda x=x: m3_torch.select_blocks(x[0], x[1], decode_query_len=n, out=x[2])
                                 for x in sets])
            finally:
                tuning.select_blocks, tuning.SELECT_TWO_LEVEL_BLOCKS = orig_select, orig_two_level
            ids = sets[0][2].clone()
            first = ids if first is None else first
            same = "" if torch.equal(ids, first) else " MISMATCH"
            line.append(f"{'two' if two_level else 'one'}-level {warps}w {us:5.1f}{same}")
        print(f"select batch {batch} {context // 1024}k n={n} (default {orig_select(num_rows=batch * n * HK, max_blocks=mb, topk=TOPK)[2]} warps): "
              + "  ".join(line), flush=True)


def sweep_mtp(bw):
    """MTP steps where packing halves the block visits (short contexts): sparse_decode and msa_decode
    with packed row tiles and with one token per tile, over batch sizes; '*' marks the default."""
    cfg = CONFIGS["M3"]
    pool = Pool(cfg, 64 * 72 + 64)
    print("n batch ctx | sparse packed per-token | msa packed per-token")
    for n, ctx in ((2, 1024), (4, 1024), (4, 2048), (8, 1024), (8, 4096)):
        for batch in (1, 2, 4, 8, 16, 32, 64):
            sets = [make_step_inputs(pool, cfg, batch, ctx, n, seed=s) for s in range(1, 5)]
            outs = [torch.empty_like(s["q"]) for s in sets]
            idss = [m3_torch.msa_decode(s["q"], s["idx_q"], pool.k, pool.v, pool.ik, s["block_table"],
                                        s["seq_lens"], decode_query_len=n, topk=TOPK)[1] for s in sets]
            res = {}
            for packed in (True, False):
                with sparse_layout(packed):
                    res[packed] = (
                        time_graph([lambda s=s, i=i, o=o: m3_torch.sparse_decode(
                            s["q"], pool.k, pool.v, i, s["block_table"], s["seq_lens"], decode_query_len=n, out=o)
                            for s, i, o in zip(sets, idss, outs)]),
                        time_graph([lambda s=s, o=o: m3_torch.msa_decode(
                            s["q"], s["idx_q"], pool.k, pool.v, pool.ik, s["block_table"], s["seq_lens"],
                            decode_query_len=n, topk=TOPK, out=o) for s, o in zip(sets, outs)]))
            tile = maps.decode_tile(HQ // HK, n, True, max_blocks=sets[0]["block_table"].shape[1], topk=TOPK,
                                    num_requests=batch, num_kv_heads=HK, interpret=False)
            mark = {True: "*" if tile.tokens_per_tile > 1 else " "}
            mark[False] = " " if mark[True] == "*" else "*"
            print(f"{n} {batch:3d} {ctx:5d} | {res[True][0]:7.1f}{mark[True]}{res[False][0]:7.1f}{mark[False]}| "
                  f"{res[True][1]:7.1f}{mark[True]}{res[False][1]:7.1f}{mark[False]}", flush=True)


def resources():
    """'regs/spills/smem' of the most recently compiled index and attention kernels."""
    out = []
    for mod, name in (("index", "index_scores_kernel"), ("attention", "paged_attention_kernel")):
        fn = getattr(m3_kernels.kernel_module(mod, interpret=False), name)
        try:
            compiled = list(fn.device_caches[0][0].values())[-1]
            out.append(f"{compiled.n_regs}/{compiled.n_spills}/{compiled.metadata.shared}")
        except Exception as exc:  # the cache layout is Triton-internal
            out.append(f"?({type(exc).__name__})")
    return " ".join(out)


def sweep_index(bw):
    batch, context = 64, 32768
    cache = Cache(64 * 290)
    x = cache.step(batch, context)
    print(f"{'warps':>5} {'stages':>6} {'bn':>5} {'index us':>9} {'dense us':>9}"
          "  regs/spills/smem of the last-compiled index, attention kernels")
    for warps, stages, block_n in itertools.product([4, 8], [3, 4], [32, 64, 128]):
        undo_index = with_index_plan(num_warps=warps, num_stages=stages, block_n=block_n)
        undo = with_plan(num_warps=warps, num_stages=stages, block_n=block_n)
        try:
            t_idx = time_graph([lambda: m3_torch.index_scores(x["iq"], cache.ik, x["bt"], x["sl"], decode_query_len=1,
                                                              out=x["scores"])])
            t_de = time_graph([lambda: m3_torch.dense_decode(x["q"], cache.k, cache.v, x["bt"], x["sl"],
                                                             decode_query_len=1, out=x["out"])], reps=5)
        except Exception as exc:  # e.g. out of shared memory
            print(f"{warps:5d} {stages:6d} {block_n:5d}  failed: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        finally:
            undo_index()
            undo()
        print(f"{warps:5d} {stages:6d} {block_n:5d} {t_idx:9.1f} {t_de:9.1f}  {resources()}", flush=True)


def sweep_fp8(bw):
    """The knobs of the three cache-bound kernels reading e4m3 caches (tiles of half the bytes:
    more stages fit the same shared memory). Floors count one byte per element."""
    fp8 = torch.float8_e4m3fn
    cases = ((8, 16384), (64, 16384), (64, 131072))
    cache = Cache(64 * 1160)
    k8, v8, ik8 = (t.to(fp8) for t in (cache.k, cache.v, cache.ik))
    scale = torch.ones(1, device="cuda")
    for batch, context in cases:
        sets = [cache.step(batch, context, seed=s) for s in range(2)]
        x = sets[0]
        blocks = int(x["sl"].sum()) / PAGE
        idx_floor = blocks * PAGE * D / bw * 1e6
        print(f"-- e4m3, batch {batch}, {context // 1024}k: index floor {idx_floor:.1f} us, "
              f"sparse K/V floor {kv_floor_us(batch, bw) / 2:.1f} us, dense K/V floor "
              f"{blocks * HK * PAGE * D * 2 / bw * 1e6:.1f} us", flush=True)
        for warps, stages, block_n in itertools.product((4, 8), (3, 4, 6), (64, 128)):
            knobs = dict(num_warps=warps, num_stages=stages, block_n=block_n)
            undo_index, undo = with_index_plan(**knobs), with_plan(**knobs)
            line = f"warps {warps} stages {stages} BLOCK_N {block_n:3d}:"
            for name, fn in (
                    ("index", lambda x: m3_torch.index_scores(x["iq"], ik8, x["bt"], x["sl"], decode_query_len=1,
                                                              out=x["scores"])),
                    ("sparse", lambda x: m3_torch.sparse_decode(x["q"], k8, v8, x["ids"], x["bt"], x["sl"],
                                                                decode_query_len=1, out=x["out"], k_scale=scale,
                                                                v_scale=scale)),
                    ("dense", lambda x: m3_torch.dense_decode(x["q"], k8, v8, x["bt"], x["sl"], decode_query_len=1,
                                                              out=x["out"], k_scale=scale, v_scale=scale))):
                try:
                    line += f" {name} {time_graph([lambda x=x: fn(x) for x in sets], reps=10):7.1f}"
                except Exception as exc:  # e.g. out of shared memory
                    line += f" {name} failed ({type(exc).__name__})"
            undo_index()
            undo()
            print(line, flush=True)


def sweep_prefill(bw):
    """Knobs of the two matmul-bound prefill launches on one causal 32k prompt (eager: each runs for ms)."""
    T = 32768
    rate = matmul_rate()
    cache = Cache(T // PAGE)
    bt = torch.arange(T // PAGE, device="cuda", dtype=torch.int32)[None]
    sl = torch.tensor([T], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    q = torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16)
    iq = torch.randn(T, HK, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    plan = m3_torch.prefill_plan(cu)
    pairs = T * (T + 1) / 2
    print(f"-- 32k prompt, matmul {rate / 1e12:.0f} TFLOP/s: dense floor {4 * pairs * D * HQ / rate * 1e3:.2f} ms, "
          f"index floor {2 * pairs * D * HK / rate * 1e3:.2f} ms", flush=True)
    for warps, stages, block_n in itertools.product((4, 8), (2, 3, 4), (64, 128)):
        knobs = dict(num_warps=warps, num_stages=stages, block_n=block_n)
        undo_index, undo = with_index_plan(**knobs), with_plan(**knobs)
        line = f"warps {warps} stages {stages} BLOCK_N {block_n:3d}:"
        for name, fn, flops in (
                ("dense", lambda: m3_torch.dense_prefill(q, cache.k, cache.v, bt, sl, cu_seqlens_q=cu, plan=plan,
                                                         out=out), 4 * pairs * D * HQ),
                ("index", lambda: m3_torch.index_scores_prefill(iq, cache.ik, bt, sl, cu_seqlens_q=cu, plan=plan),
                 2 * pairs * D * HK)):
            try:
                ms = time_fn(fn, reps=5)
                line += f" {name} {ms:6.2f} ms ({flops / ms / 1e9:4.0f} TFLOP/s)"
            except Exception as exc:  # e.g. out of shared memory
                line += f" {name} failed ({type(exc).__name__})"
        undo_index()
        undo()
        print(f"{line}  {resources()}", flush=True)


SWEEPS = dict(sparse=sweep_sparse, small=sweep_small, select=sweep_select, mtp=sweep_mtp, index=sweep_index,
              fp8=sweep_fp8, prefill=sweep_prefill)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", choices=sorted(SWEEPS))
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    SWEEPS[args.sweep](bw)


if __name__ == "__main__":
    main()
