"""FP8 caches on the decode grid: ``python3 -m benchmarks.fp8 [--quick] [--out DIR]`` (GPU only).

The same ``msa_decode`` and ``index_scores`` steps as ``benchmarks.run`` (M3
shapes, n = 1, lengths within +-10% of the context, one CUDA graph per op,
inputs rotated past L2) with four cache variants from the same random data:

* ``bf16``: bf16 K/V and index-K (the reference point);
* ``ik8``:  e4m3 index-K, bf16 K/V;
* ``kv8``:  bf16 index-K, e4m3 K/V (per-layer scales ``amax / 448``);
* ``fp8``:  both in e4m3.

The floor of each variant counts its own bytes (an e4m3 element is one byte),
over the copy bandwidth measured first in the same run. The peer's bf16 step
(``../shared/BENCH_ANCHORS.md``, measured on the same H200 model, copy
bandwidth 4.19 TB/s) is printed beside the ``fp8`` step: the FP8 issue's
target is ``fp8`` at >= 85% of its floor, >= 1.6x the peer, at batch >= 32
and context >= 16k, and ``index_scores`` on e4m3 at >= 90% of its floor from 64k.
Writes ``fp8.json`` and ``fp8.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

import m3_torch
from benchmarks.run import CONFIGS, L2_BYTES, PAGE, TOPK, copy_bandwidth, make_step_inputs, save_results, time_graph

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
VARIANTS = {"bf16": (False, False), "ik8": (True, False), "kv8": (False, True), "fp8": (True, True)}
CASES = [(b, c) for b in (8, 32, 64, 128) for c in (16384, 65536, 131072)] + [(1, 4096), (8, 4096), (64, 4096)]
QUICK_CASES = [(8, 16384), (64, 16384), (64, 131072)]
# BENCH_ANCHORS.md, n = 1 (peer microseconds, same H200 model, copy bandwidth 4.19 TB/s)
PEER_US = {(1, 4096): 15.8, (8, 4096): 27.2, (8, 16384): 35.2, (8, 65536): 65.3, (8, 131072): 104.3,
           (32, 16384): 82.6, (32, 65536): 184.2, (32, 131072): 324.3, (64, 4096): 96.5, (64, 16384): 145.4,
           (64, 65536): 342.7, (64, 131072): 600.3, (128, 16384): 272.3, (128, 131072): 1152.4}


class Caches:
    """bf16 K/V/index-K pages and their e4m3 copies (K/V scaled by amax / 448, index-K unscaled)."""

    def __init__(self, cfg, num_pages):
        g = torch.Generator(device="cuda").manual_seed(0)
        shape = (num_pages, cfg["hk"], PAGE, cfg["d"])
        self.num_pages = num_pages
        self.k = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        self.v = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        ik = torch.randn(num_pages, PAGE, 128, device="cuda", dtype=torch.float32, generator=g)
        ik = ik * torch.rsqrt(ik.pow(2).mean(-1, keepdim=True))   # RMS-normalised, as M3's index keys
        self.ik = ik.to(torch.bfloat16)
        self.ik8 = ik.to(FP8)
        del ik
        self.k8, self.k_scale = quantize(self.k)
        self.v8, self.v_scale = quantize(self.v)

    def variant(self, index_fp8: bool, kv_fp8: bool) -> dict:
        kv = dict(k_cache=self.k8, v_cache=self.v8, k_scale=self.k_scale, v_scale=self.v_scale) if kv_fp8 else \
            dict(k_cache=self.k, v_cache=self.v)
        return dict(kv, index_k_cache=self.ik8 if index_fp8 else self.ik)


def quantize(x, pages_per_chunk=4096):
    """-> (e4m3 copy of ``x`` scaled by ``amax / 448``, that scale as a float32 [1] tensor), chunked."""
    chunks = x.split(pages_per_chunk)
    scale = (torch.stack([c.abs().amax() for c in chunks]).amax().float() / E4M3_MAX).reshape(1)
    out = torch.empty(x.shape, dtype=FP8, device=x.device)
    for o, c in zip(out.split(pages_per_chunk), chunks):
        o.copy_((c.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8))
    return out, scale


def floor_bytes(x, ids, cfg, index_fp8: bool, kv_fp8: bool) -> dict:
    """Bytes the step must move: index-K once per request, each distinct chosen K/V block once per
    (request, KV head), q and out; e4m3 elements are one byte."""
    lens = x["lens"].long()
    T, Hq, D, Hk = x["q"].shape[0], cfg["hq"], cfg["d"], cfg["hk"]
    index_k = int(((lens + PAGE - 1) // PAGE).sum()) * PAGE * 128 * (1 if index_fp8 else 2)
    ids = ids.cpu().reshape(Hk, T, TOPK)
    distinct = sum(len(set(ids[h, t].tolist()) - {-1}) for h in range(Hk) for t in range(T))
    kv = distinct * PAGE * D * 2 * (1 if kv_fp8 else 2)
    idx_q, qo, scores = T * Hk * 128 * 2, 2 * T * Hq * D * 2, Hk * T * x["block_table"].shape[1] * 4
    return dict(msa_decode=index_k + idx_q + kv + qo, index_scores=index_k + idx_q + scores)


def run_case(caches, cfg, batch, context, bw) -> list:
    rows = []
    for name, (index_fp8, kv_fp8) in VARIANTS.items():
        c = caches.variant(index_fp8, kv_fp8)
        scales = {k: c[k] for k in ("k_scale", "v_scale") if k in c}

        def msa(s, out=None):
            return m3_torch.msa_decode(s["q"], s["idx_q"], c["k_cache"], c["v_cache"], c["index_k_cache"],
                                       s["block_table"], s["seq_lens"], decode_query_len=1, topk=TOPK, out=out,
                                       **scales)

        probe = make_step_inputs(caches, cfg, batch, context, 1, seed=1)
        _, ids = msa(probe)
        need = floor_bytes(probe, ids, cfg, index_fp8, kv_fp8)
        rot = max(1, min(16, math.ceil(4 * L2_BYTES / need["msa_decode"])))
        sets = [probe] + [make_step_inputs(caches, cfg, batch, context, 1, seed=s) for s in range(2, rot + 1)]
        outs = [torch.empty_like(s["q"]) for s in sets]
        scores = [m3_torch.index_scores(s["idx_q"], c["index_k_cache"], s["block_table"], s["seq_lens"],
                                        decode_query_len=1) for s in sets]
        steps = {
            "msa_decode": [lambda s=s, o=o: msa(s, o) for s, o in zip(sets, outs)],
            "index_scores": [lambda s=s, o=o: m3_torch.index_scores(s["idx_q"], c["index_k_cache"], s["block_table"],
                                                                   s["seq_lens"], decode_query_len=1, out=o)
                             for s, o in zip(sets, scores)],
        }
        for op, fns in steps.items():
            us = time_graph(fns)
            floor_us = need[op] / bw * 1e6
            rows.append(dict(variant=name, op=op, batch=batch, context=context, us=us, bytes=need[op],
                             floor_us=floor_us, pct_floor=100 * floor_us / us, rotation=len(fns)))
        print(f"  batch {batch:3d} context {context:6d} {name:4s}: " + "  ".join(
            f"{r['op']} {r['us']:7.1f} us ({r['pct_floor']:3.0f}%)" for r in rows[-2:]), flush=True)
    return rows


def markdown(result: dict) -> str:
    rows = result["rows"]
    get = {(r["variant"], r["op"], r["batch"], r["context"]): r for r in rows}
    cases = sorted({(r["batch"], r["context"]) for r in rows})
    lines = [f"# FP8 caches, decode (M3 shapes, n = 1, {result['device']})", "",
             f"Command: `{result['command']}`; copy bandwidth {result['copy_bandwidth_TBps']:.2f} TB/s "
             "(same run). Microseconds per step (CUDA-graph replay), % of each variant's own byte floor. "
             "Peer: BENCH_ANCHORS.md's bf16 step (copy bandwidth 4.19 TB/s there).", "",
             "## msa_decode", "",
             "| batch | context | bf16 | ik8 | kv8 | fp8 (both) | fp8 vs bf16 | peer bf16 | fp8 vs peer |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def cell(v, op, b, c):
        r = get.get((v, op, b, c))
        return f"{r['us']:.1f} ({r['pct_floor']:.0f}%)" if r else "-"

    for b, c in cases:
        fp8, bf16, peer = get[("fp8", "msa_decode", b, c)], get[("bf16", "msa_decode", b, c)], PEER_US.get((b, c))
        vs_peer = f"{peer / fp8['us']:.2f}x" if peer else "-"
        lines.append(f"| {b} | {c // 1024}k | " + " | ".join(cell(v, "msa_decode", b, c) for v in VARIANTS) +
                     f" | {bf16['us'] / fp8['us']:.2f}x | {peer or '-'} | {vs_peer} |")
    lines += ["", "## index_scores", "", "| batch | context | bf16 index-K | e4m3 index-K | e4m3 vs bf16 |",
              "| --- | --- | --- | --- | --- |"]
    for b, c in cases:
        bf16, ik8 = get[("bf16", "index_scores", b, c)], get[("ik8", "index_scores", b, c)]
        lines.append(f"| {b} | {c // 1024}k | {cell('bf16', 'index_scores', b, c)} | "
                     f"{cell('ik8', 'index_scores', b, c)} | {bf16['us'] / ik8['us']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"cases {QUICK_CASES}")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/latest"))
    args = ap.parse_args(argv)
    cases = QUICK_CASES if args.quick else CASES
    cfg = CONFIGS["M3"]
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    pages = max(b * -(-int(c * 1.1) // PAGE) for b, c in cases) + 16
    caches = Caches(cfg, pages)
    rows = []
    for batch, context in cases:
        rows += run_case(caches, cfg, batch, context, bw)
    result = dict(device=torch.cuda.get_device_name(), copy_bandwidth_TBps=bw / 1e12,
                  command="python3 -m benchmarks.fp8 " + " ".join(argv if argv is not None else sys.argv[1:]),
                  rows=rows)
    save_results(args.out, "fp8", result, markdown(result))


if __name__ == "__main__":
    main()
