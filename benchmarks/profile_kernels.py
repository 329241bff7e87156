"""Eager msa_decode (or msa_prefill) calls at one case, for Nsight Compute (GPU):

    ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight ... \\
        python3 -m benchmarks.profile_kernels --batch 64 --context 131072 [--index-fp8] [--kv-fp8] [--n 1] \\
            [--backend cutedsl] [--prefill]

Three calls of the step (index_scores, select_blocks, paged attention, merge):
the first compiles, the second warms, the last runs inside the NVTX range
"profile". M3 head shapes; K/V and index-K pages as benchmarks.fp8.
``--prefill``: msa_prefill of one prompt of ``--context`` tokens instead
(random queries, no cached prefix; ``--batch`` and ``--n`` unused).
"""
import argparse

import torch

import m3_torch
from benchmarks.fp8 import Caches
from benchmarks.run import CONFIGS, PAGE, TOPK, make_step_inputs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--n", type=int, default=1, help="decode_query_len")
    ap.add_argument("--config", default="M3", choices=sorted(CONFIGS))
    ap.add_argument("--index-fp8", action="store_true")
    ap.add_argument("--kv-fp8", action="store_true")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--backend", default="triton", choices=("triton", "cutedsl"), help="the indexer's")
    ap.add_argument("--prefill", action="store_true", help="msa_prefill of one prompt of --context tokens")
    args = ap.parse_args()
    cfg = CONFIGS[args.config]
    if args.prefill:
        return prefill(args, cfg)
    caches = Caches(cfg, args.batch * -(-int(args.context * 1.1) // PAGE) + 64)
    c = caches.variant(args.index_fp8, args.kv_fp8)
    scales = {k: c[k] for k in ("k_scale", "v_scale") if k in c}
    x = make_step_inputs(caches, cfg, args.batch, args.context, args.n, seed=1)
    out = torch.empty_like(x["q"])
    for i in range(args.calls):
        if i == args.calls - 1:
            torch.cuda.nvtx.range_push("profile")
        m3_torch.msa_decode(x["q"], x["idx_q"], c["k_cache"], c["v_cache"], c["index_k_cache"], x["block_table"],
                            x["seq_lens"], decode_query_len=args.n, topk=TOPK, out=out,
                            backend=args.backend, **scales)
        torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    print(f"profiled: {args}")


def prefill(args, cfg):
    T = args.context
    caches = Caches(cfg, -(-T // PAGE))
    c = caches.variant(args.index_fp8, args.kv_fp8)
    scales = {k: c[k] for k in ("k_scale", "v_scale") if k in c}
    g = torch.Generator(device="cuda").manual_seed(T)
    q = torch.randn(T, cfg["hq"], cfg["d"], device="cuda", generator=g).bfloat16()
    idx_q = torch.randn(T, cfg["hk"], 128, device="cuda", generator=g).bfloat16()
    table = torch.randperm(-(-T // PAGE), device="cuda", generator=g).int()[None]
    seq_lens = torch.tensor([T], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    plan = m3_torch.prefill_plan(cu)
    out = torch.empty_like(q)
    for i in range(args.calls):
        if i == args.calls - 1:
            torch.cuda.nvtx.range_push("profile")
        m3_torch.msa_prefill(q, idx_q, c["k_cache"], c["v_cache"], c["index_k_cache"], table, seq_lens,
                             cu_seqlens_q=cu, plan=plan, topk=TOPK, out=out, backend=args.backend, **scales)
        torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    print(f"profiled: {args}")


if __name__ == "__main__":
    main()
