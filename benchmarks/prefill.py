"""Prefill on the GPU: ``dense_prefill`` against torch's SDPA, ``msa_prefill`` and its three launches.

    python3 -m benchmarks.prefill [--lens 8192,32768,131072] [--out DIR] [--dense-backend cutedsl]
                                  [--sparse-backend cutedsl]

One request of T prompt tokens (no cached prefix), M3 shapes (64 q heads,
4 KV heads, D = Di = 128, 4 index heads, topk 16, bf16), eager timing (each
launch runs for milliseconds). Floors: FLOPs over
the bf16 matmul rate measured in the same run.

* dense: causal ``T (T + 1) / 2`` query-key pairs x 64 heads x 4 D FLOPs,
  against ``scaled_dot_product_attention(is_causal=True)`` on the same tensors
  (K/V repeated to 64 heads, and with ``enable_gqa``; the faster one counts).
  ``--dense-backend cutedsl`` also times ``dense_prefill(backend="cutedsl")``
  (the Hopper CuTeDSL kernel) beside them, with its largest difference from
  the Triton backend's output.
* msa: the indexer's causal ``q . k`` (2 Di FLOPs per pair and index head)
  plus attention over each token's chosen blocks (their visible positions).

The sparse attention's cost depends on how many blocks the tokens of one row
tile share (a tile computes all its rows against the union of their choices),
so it runs on two kinds of index queries: ``random`` (i.i.d. normal: tokens
share only the forced local block) and ``shared`` (each 64-token window's
queries are one direction plus 30% noise, as neighbouring tokens of a text
tend to be). Each row says how many distinct blocks an 8-token tile reads
(``union``) beside its 8 x 16 choices; ``sparse_prefill`` is timed with tiles of
8 tokens and of one (``default``: the one ``maps.prefill_tile_kind`` picks).
``--sparse-backend cutedsl`` also times ``sparse_prefill(backend="cutedsl")``
(the CuTeDSL kernel's sparse mode, tiles of 8 tokens x 16 heads) on the same
block ids, with the same FLOPs (the chosen blocks' visible positions: the
work a tile spends on the rest of its union counts as waste), the rate of the
MMA work it issues (``issued_tflops``: each consumer warpgroup's 4 tokens x 16
heads against the union of its tokens' blocks, ``union_per_warpgroup``) and
its largest difference from the Triton backend's output, and ``msa_prefill`` as a whole on
that backend (``M3_SPARSE_PREFILL=cutedsl``: indexer, selection launch, CuTeDSL
kernel), whose block ids must equal the Triton route's.
"""
import argparse
import os
from unittest import mock

import torch
import torch.nn.functional as F

import m3_torch
from benchmarks.run import copy_bandwidth, matmul_rate, save_results, sparse_layout, time_fn
from m3_kernels import backends, maps

PAGE, HQ, HK, D, DI, TOPK = 128, 64, 4, 128, 128, 16


def union_per_tile(ids, tokens):
    """Mean distinct valid blocks the ``tokens``-token tiles read, over tiles and KV heads."""
    hk, T, k = ids.shape
    x = ids[:, :T - T % tokens].reshape(hk, -1, tokens * k).sort(dim=-1).values
    distinct = (x[..., 1:] != x[..., :-1]) & (x[..., 1:] >= 0)
    return float((distinct.sum(-1) + (x[..., 0] >= 0)).float().mean())


def run_length(T, rate, reps, dense_backend="triton", sparse_backend="triton"):
    g = torch.Generator(device="cuda").manual_seed(T)
    mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    nb = T // PAGE
    k, v, ik = mk(nb, HK, PAGE, D), mk(nb, HK, PAGE, D), mk(nb, PAGE, DI)
    q = mk(T, HQ, D)
    bt = torch.randperm(nb, device="cuda", generator=g).int()[None]
    sl = torch.tensor([T], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    plan = m3_torch.prefill_plan(cu)
    out = torch.empty_like(q)
    rows = []

    def row(op, us, flops, **extra):
        floor = flops / rate * 1e6
        rows.append(dict(context=T, op=op, us=us, flops=flops, floor_us=floor, pct_floor=100 * floor / us,
                         tflops=flops / us / 1e6, **extra))
        more = " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())
        print(f"T={T:6d} {op:34s} {us / 1e3:9.2f} ms  {flops / us / 1e6:6.0f} TFLOP/s  "
              f"{100 * floor / us:4.0f}% of floor  {more}", flush=True)

    # -- dense: ours against SDPA on the same causal problem
    dense_flops = 4 * T * (T + 1) / 2 * D * HQ
    us = time_fn(lambda: m3_torch.dense_prefill(q, k, v, bt, sl, cu_seqlens_q=cu, plan=plan, out=out), reps) * 1e3
    row("dense_prefill", us, dense_flops)
    # the cache's pages in sequence order, [1, H, T, D]
    kt = k[bt[0].long()].permute(1, 0, 2, 3).reshape(1, HK, T, D)
    vt = v[bt[0].long()].permute(1, 0, 2, 3).reshape(1, HK, T, D)
    qt = q.permute(1, 0, 2)[None]
    sdpa = {
        "sdpa_gqa": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True),
        "sdpa_repeated_kv": lambda: F.scaled_dot_product_attention(
            qt, kt.repeat_interleave(HQ // HK, 1), vt.repeat_interleave(HQ // HK, 1), is_causal=True),
    }
    ref = m3_torch.dense_prefill(q, k, v, bt, sl, cu_seqlens_q=cu, plan=plan).float()
    if dense_backend == "cutedsl":
        cute = lambda: m3_torch.dense_prefill(q, k, v, bt, sl, cu_seqlens_q=cu, plan=plan, out=out, backend="cutedsl")
        err = (cute().float() - ref).abs().max().item()
        row("dense_prefill_cutedsl", time_fn(cute, reps) * 1e3, dense_flops, max_abs_diff_vs_ours=err)
    for name, fn in sdpa.items():
        try:
            err = (fn()[0].permute(1, 0, 2).float() - ref).abs().max().item()
            us = time_fn(fn, reps) * 1e3
        except RuntimeError as exc:   # a backend that does not take the shape
            print(f"T={T:6d} {name}: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        row(name, us, dense_flops, max_abs_diff_vs_ours=err)
    del ref, kt, vt, qt

    # -- msa: each kind of index query
    pairs = T * (T + 1) / 2
    index_flops = 2 * pairs * DI * HK
    pos = torch.arange(T, device="cuda")
    for kind in ("random", "shared"):
        if kind == "random":
            iq = mk(T, HK, DI)
        else:
            base = mk(-(-T // 64), 1, HK, DI).expand(-1, 64, -1, -1).reshape(-1, HK, DI)[:T]
            iq = base + 0.3 * mk(T, HK, DI)
        index = lambda: m3_torch.index_scores_prefill(iq, ik, bt, sl, cu_seqlens_q=cu, plan=plan)
        scores = index()
        select = lambda: m3_torch.select_blocks_prefill(scores, sl, cu_seqlens_q=cu, plan=plan)
        ids = select()
        # visible positions of each token's chosen blocks, all KV heads: attention's FLOPs
        start = ids.clamp(min=0).long() * PAGE
        seen = ((pos[None, :, None] - start + 1).clamp(0, PAGE) * (ids >= 0)).sum().item()
        sparse_flops = 4 * seen * D * (HQ // HK)
        union = union_per_tile(ids, 8)
        msa = lambda: m3_torch.msa_prefill(q, iq, k, v, ik, bt, sl, cu_seqlens_q=cu, plan=plan, out=out)
        row(f"msa_prefill[{kind}]", time_fn(msa, reps) * 1e3, index_flops + sparse_flops, union_8_tokens=union)
        if sparse_backend == "cutedsl":
            with mock.patch.dict(os.environ, {backends.SPARSE_PREFILL_ENV_VAR: "cutedsl"}):
                if not torch.equal(msa()[1], ids):
                    raise AssertionError(f"T={T} {kind}: msa_prefill on the cutedsl route chose other blocks "
                                         "than select_blocks_prefill")
                row(f"msa_prefill_cutedsl[{kind}]", time_fn(msa, reps) * 1e3, index_flops + sparse_flops,
                    union_8_tokens=union)
        row(f"  index_scores_prefill[{kind}]", time_fn(index, reps) * 1e3, index_flops)
        row(f"  select_blocks_prefill[{kind}]", time_fn(select, reps) * 1e3, 0.0)
        default = maps.prefill_tile_kind(True, nb, TOPK)
        for tpt in (8, 1):
            with sparse_layout(tpt > 1):
                p = m3_torch.prefill_plan(cu)
                us = time_fn(lambda: m3_torch.sparse_prefill(q, k, v, ids, bt, sl, cu_seqlens_q=cu, plan=p,
                                                             out=out), reps) * 1e3
            row(f"  sparse_prefill[{kind}] {tpt} tok/tile", us, sparse_flops, union=union_per_tile(ids, tpt),
                chosen=TOPK * tpt, default=(default == "token") == (tpt == 1))
        if sparse_backend == "cutedsl":
            cute = lambda: m3_torch.sparse_prefill(q, k, v, ids, bt, sl, cu_seqlens_q=cu, plan=plan, out=out,
                                                   backend="cutedsl")
            err = (cute().float() - m3_torch.sparse_prefill(q, k, v, ids, bt, sl, cu_seqlens_q=cu,
                                                            plan=plan).float()).abs().max().item()
            us = time_fn(cute, reps) * 1e3
            # the MMA work it issues: each warpgroup (4 tokens x 16 heads) against its tokens' union
            own = union_per_tile(ids, 4)
            mma_flops = own * (T / 4) * HK * 64 * PAGE * D * 4
            row(f"  sparse_prefill_cutedsl[{kind}]", us, sparse_flops, union=union, union_per_warpgroup=own,
                chosen=TOPK * 8, issued_tflops=mma_flops / us / 1e6, max_abs_diff_vs_triton=err)
        del scores, ids
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", default="8192,32768,131072")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="prefill")
    ap.add_argument("--dense-backend", choices=("triton", "cutedsl"), default="triton",
                    help="cutedsl: also time dense_prefill's CuTeDSL backend (Hopper) beside the Triton one and SDPA")
    ap.add_argument("--sparse-backend", choices=("triton", "cutedsl"), default="triton",
                    help="cutedsl: also time sparse_prefill's CuTeDSL backend (Hopper) beside the Triton rows, "
                         "and msa_prefill with M3_SPARSE_PREFILL=cutedsl")
    args = ap.parse_args()
    bw, rate = copy_bandwidth(), matmul_rate()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    for T in (int(x) for x in args.lens.split(",")):
        rows += run_length(T, rate, reps=3 if T > 65536 else 5, dense_backend=args.dense_backend,
                           sparse_backend=args.sparse_backend)
        torch.cuda.empty_cache()
    command = (f"python3 -m benchmarks.prefill --lens {args.lens} --dense-backend {args.dense_backend} "
               f"--sparse-backend {args.sparse_backend}")
    md = [f"# Prefill on {gpu}", "",
          f"Copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s (same run). "
          f"Command: `{command}`. Eager medians; floor = FLOPs / matmul rate.",
          "", "| T | op | ms | TFLOP/s | % of floor | notes |", "|---|---|---|---|---|---|"]
    for r in rows:
        notes = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                          if k not in ("context", "op", "us", "flops", "floor_us", "pct_floor", "tflops"))
        md.append(f"| {r['context']} | {r['op'].strip()} | {r['us'] / 1e3:.2f} | {r['tflops']:.0f} | "
                  f"{r['pct_floor']:.0f}% | {notes} |")
    save_results(args.out, args.name, dict(gpu=gpu, copy_tbps=bw / 1e12, matmul_tflops=rate / 1e12,
                                           command=command, rows=rows),
                 "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
