"""Sweep launch parameters of the decode kernels at one shape (GPU).

python3 -m benchmarks.tune [--batch 64] [--context 32768] [--n 1]
Prints one line per variant: index_scores and sparse_decode medians (us).
The winners go into kernels/geometry.py by hand.
"""
import argparse
import dataclasses
import itertools

import torch

import m3_torch
import m3_kernels
from benchmarks.run import time_graph
from m3_kernels import geometry

PAGE = 128


def median_us(fn, reps=30):
    """CUDA-graph replay median: eager timing would measure the host-side launch cost."""
    return time_graph([fn], reps)


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--n", type=int, default=1)
    a = ap.parse_args()
    R, L, n, Hq, Hk, D = a.batch, a.context, a.n, 64, 4, 128
    torch.manual_seed(0)
    lens = (L * (0.9 + 0.2 * torch.rand(R))).int()
    mb = int((lens.max() + PAGE - 1) // PAGE)
    bt = torch.randperm(R * mb, device="cuda").int().reshape(R, mb)
    k = torch.randn(R * mb, Hk, PAGE, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ik = torch.randn(R * mb, PAGE, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(R * n, Hq, D, device="cuda", dtype=torch.bfloat16)
    iq = torch.randn(R * n, Hk, D, device="cuda", dtype=torch.bfloat16)
    sl = lens.cuda().int()
    out = torch.empty_like(q)
    scores = m3_torch.index_scores(iq, ik, bt, sl, decode_query_len=n)
    ids = m3_torch.select_blocks(scores, sl, decode_query_len=n)
    idx_floor = ((lens + PAGE - 1) // PAGE).sum().item() * PAGE * D * 2
    print(f"batch {R} context {L} n {n}; index-K bytes {idx_floor / 1e6:.0f} MB")
    orig_index, orig_attn, orig_target = geometry.index_plan, geometry.attention_plan, geometry.TARGET_PROGRAMS
    print(f"{'target':>6} {'warps':>5} {'stages':>6} {'bn':>5} {'index us':>9} {'sparse us':>9} {'dense us':>9}"
          "  regs/spills/smem of the last-compiled index, attention kernels")
    for target, warps, stages, block_n, min_bps in itertools.product([512, 1024, 2048], [4, 8], [3, 4], [32, 64, 128],
                                                                     [4]):
        geometry.TARGET_PROGRAMS = target
        geometry.MIN_BLOCKS_PER_SPLIT = min_bps
        geometry.index_plan = lambda **kw: dataclasses.replace(orig_index(**kw), num_warps=warps, num_stages=stages,
                                                               block_n=block_n)
        geometry.attention_plan = lambda **kw: dataclasses.replace(orig_attn(**kw), num_warps=warps,
                                                                   num_stages=stages, block_n=block_n)
        try:
            t_idx = median_us(lambda: m3_torch.index_scores(iq, ik, bt, sl, decode_query_len=n, out=scores))
            t_sp = median_us(lambda: m3_torch.sparse_decode(q, k, v, ids, bt, sl, decode_query_len=n, out=out))
            t_de = median_us(lambda: m3_torch.dense_decode(q, k, v, bt, sl, decode_query_len=n, out=out), reps=5)
        except Exception as exc:  # e.g. out of shared memory
            print(f"{target:6d} {warps:5d} {stages:6d}  failed: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        print(f"{target:6d}/{min_bps} {warps:5d} {stages:6d} {block_n:5d} {t_idx:9.1f} {t_sp:9.1f} {t_de:9.1f}  {resources()}")
    geometry.index_plan, geometry.attention_plan, geometry.TARGET_PROGRAMS = orig_index, orig_attn, orig_target


if __name__ == "__main__":
    main()
