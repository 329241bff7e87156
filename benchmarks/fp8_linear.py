"""Block-scaled FP8 weights at decode sizes: ``python3 -m benchmarks.fp8_linear --out DIR [--tune]`` (GPU only).

At T = 1 and 64 tokens, each timed with ``triton.testing.do_bench`` on a CUDA graph of 20 calls (per-call
median; linear layers cycle through copies of their weight so that no call finds it in L2):

* linear layers of MiniMax-M3's shapes (N x K = 6144 x 3072, 3072 x 6144, 12288 x 6144): bf16
  ``torch.matmul`` against ``m3_torch.fp8.fp8_linear`` (the activation quantization included);
* the fused MoE (128 experts top-4 + the shared expert, H 6144, I 3072, uniform random routing):
  bf16 ``m3_torch.fused_moe`` against ``m3_torch.fp8.fused_moe_fp8``.

Each row reports the bytes the call must move (weights read once, touched experts only, activations in
and out; e4m3 weights at one byte plus their scales), its byte floor (those bytes at the copy bandwidth
measured first in the same run), the time as a share of that floor ("% of floor": floor / time), and the
FP8 result's relative error against bf16. The fused MoE is always timed at 64 tokens (a decode batch
that touches most of the 128 experts: its floor is almost all of the FP8 weights), whatever ``--tokens`` says.
``--tune`` also times fp8_linear at other decode knobs (``tuning.fp8_linear``: BLOCK_N x warps, K splits,
stages, L2 prefetch blocks, BLOCK_M), one knob at a time from tuning's choice, and prints the best per shape
and T. Writes ``fp8_linear.json`` and ``fp8_linear.md`` to ``--out``; about a minute on an H200 (``--tune``:
up to three more).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools

import torch
import triton
import triton.runtime.errors
import triton.testing

from benchmarks.run import save_results

TOKENS = (1, 64)
MOE_FLOOR_TOKENS = 64   # the fused MoE is timed against its byte floor at this batch in every run
LINEAR_SHAPES = ((6144, 3072), (3072, 6144), (12288, 6144))   # (N, K)
E, TOP_K, H, I = 128, 4, 6144, 3072
ALPHA, LIMIT = 1.702, 7.0
CALLS_PER_GRAPH = 20
ROTATE_BYTES = 200 << 20


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB (read + write bytes / second), as ``do_bench`` times it."""
    x = torch.empty(1 << 28, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200)
    return 2 * x.numel() * 4 / (ms * 1e-3)


def graph_us(calls, rep: int = 100) -> float:
    """Median microseconds per call of the CUDA graph of ``calls`` (callables), replayed by do_bench for
    about ``rep`` ms."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=rep)
    del graph
    return ms * 1e3 / len(calls)


def rotation(nbytes: int) -> int:
    """Copies of an operand of ``nbytes`` to cycle through so that one graph replay reads ROTATE_BYTES
    (4x an H200's 50 MB L2: no call finds its weights in L2), at most CALLS_PER_GRAPH."""
    return min(CALLS_PER_GRAPH, -(-ROTATE_BYTES // nbytes))


def floor_fields(nbytes: int, us: float, bandwidth: float) -> dict:
    """A row's traffic: ``nbytes`` moved in ``us``, against the byte floor at the copy ``bandwidth``."""
    floor_us = nbytes / bandwidth * 1e6
    return dict(bytes=nbytes, bytes_per_s=nbytes / (us * 1e-6), floor_us=floor_us, pct_of_floor=100 * floor_us / us)


def rel(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def linear_rows(bandwidth, tokens_list, fp8):
    rows = []
    g = torch.Generator("cuda").manual_seed(0)
    for n, k in LINEAR_SHAPES:
        bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
                for _ in range(rotation(2 * n * k))]
        quantized = [fp8.quantize_weight(w) for w in bf16[:rotation(n * k)]]
        scale_bytes = 4 * quantized[0][1].numel()
        for tokens in tokens_list:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=g)
            act = 2 * tokens * (k + n)   # bf16 in and out
            for variant, weights, call, weight_bytes in (
                    ("bf16", bf16, lambda w: torch.matmul(x, w.T), 2 * n * k),
                    ("fp8", quantized, lambda w: fp8.fp8_linear(x, *w), n * k + scale_bytes)):
                us = graph_us([lambda i=i: call(weights[i % len(weights)]) for i in range(CALLS_PER_GRAPH)])
                nbytes = weight_bytes + act
                err = rel(call(quantized[0]), torch.matmul(x, bf16[0].T)) if variant == "fp8" else 0.0
                rows.append(dict(op="linear", shape=f"{n}x{k}", tokens=tokens, variant=variant, us=us,
                                 **floor_fields(nbytes, us, bandwidth), rel_err_vs_bf16=err))
                print(rows[-1], flush=True)
        del bf16, quantized
    return rows


def quantize_experts(fp8, w):
    """``quantize_weight`` of [E, N, K] expert weights 8 experts at a time (its float32 copy of all 128
    would take 19 GB), or of a [N, K] one."""
    if w.dim() == 2:
        return fp8.quantize_weight(w)
    parts = [fp8.quantize_weight(chunk) for chunk in w.split(8)]
    return torch.cat([codes for codes, _ in parts]), torch.cat([scale for _, scale in parts])


def moe_rows(bandwidth, tokens_list, fp8):
    import m3_torch
    from benchmarks.moe import make_weights, routing

    rows = []
    w_gate_up, w_down, shared_gate_up, shared_down = make_weights()
    dense = dict(w_gate_up=w_gate_up, w_down=w_down, shared_gate_up=shared_gate_up, shared_down=shared_down)
    quantized = {}
    for name, w in dense.items():
        quantized[name], quantized[f"{name}_scale"] = quantize_experts(fp8, w)
    kwargs = dict(swiglu_alpha=ALPHA, swiglu_limit=LIMIT)
    for tokens in tokens_list:
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        ids, weights = routing(tokens, tokens)
        experts = int(ids.unique().numel()) + 1   # + the shared expert
        act = 2 * tokens * H * 2
        scale_bytes = 4 * 3 * (I // 128) * (H // 128)
        for variant, fn, weight_bytes in (
                ("bf16", lambda: m3_torch.fused_moe(x, w_gate_up, w_down, ids, weights, shared_gate_up=shared_gate_up,
                                                    shared_down=shared_down, **kwargs), experts * 3 * I * H * 2),
                ("fp8", lambda: fp8.fused_moe_fp8(x, **{k: v for k, v in quantized.items() if k.startswith("w_")},
                                                  topk_ids=ids, topk_weights=weights,
                                                  **{k: v for k, v in quantized.items() if k.startswith("shared_")},
                                                  **kwargs), experts * (3 * I * H + scale_bytes))):
            us = graph_us([fn] * CALLS_PER_GRAPH)   # each call reads > 280 MB of weights: no rotation needed
            nbytes = weight_bytes + act
            want = m3_torch.fused_moe(x, w_gate_up, w_down, ids, weights, shared_gate_up=shared_gate_up,
                                      shared_down=shared_down, **kwargs)
            rows.append(dict(op="fused_moe", shape=f"E{E} top{TOP_K} H{H} I{I}", tokens=tokens, variant=variant, us=us,
                             **floor_fields(nbytes, us, bandwidth),
                             rel_err_vs_bf16=rel(fn(), want) if variant == "fp8" else 0.0, experts_touched=experts))
            print(rows[-1], flush=True)
    return rows


def tune(fp8, tokens_list):
    """Time fp8_linear (the whole call: quantization, linear, sum of the splits) at other decode knobs, per
    shape and T: from ``tuning.fp8_linear``'s choice, each knob in turn is set to its fastest value with the
    others held (BLOCK_N x warps, splits, stages, L2 prefetch blocks, BLOCK_M) -> {case: [(us, config)],
    fastest first}. About 80 variants, each compiled once: under three minutes on an H200."""
    from m3_kernels import tuning

    chosen = tuning.fp8_linear
    found = {}
    g = torch.Generator("cuda").manual_seed(1)
    try:
        for (n, k), tokens in itertools.product(LINEAR_SHAPES, tokens_list):
            weights = [fp8.quantize_weight(torch.randn(n, k, device="cuda", generator=g)) for _ in range(rotation(n * k))]
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=g)
            k_blocks = -(-k // 128)
            timed = {}

            def timed_us(cfg):
                if cfg not in timed:
                    tuning.fp8_linear = lambda **_: cfg
                    try:
                        timed[cfg] = graph_us([lambda i=i: fp8.fp8_linear(x, *weights[i % len(weights)])
                                               for i in range(CALLS_PER_GRAPH)], rep=30)
                    except triton.runtime.errors.OutOfResources as exc:   # tiles past the shared memory
                        print(f"  {n}x{k} T={tokens} {knobs(cfg)}: {exc}", flush=True)
                        timed[cfg] = float("inf")
                return timed[cfg]

            def with_programs(cfg, programs, **changes):
                """``cfg`` with ``changes`` and the splits that make about ``programs`` programs."""
                cfg = dataclasses.replace(cfg, **changes)
                tiles = -(-n // cfg.block_n) * -(-tokens // cfg.block_m)
                return dataclasses.replace(cfg, splits=max(1, min(-(-programs // tiles), k_blocks)))

            default = best = chosen(tokens=tokens, n=n, k=k, interpret=False)
            programs = -(-n // best.block_n) * best.splits
            block_ms = [m for m in (best.block_m, best.block_m // 2) if m >= 16]
            for candidates in (
                    lambda b: [with_programs(b, programs, block_n=bn, num_warps=w) for bn, w in ((64, 4), (128, 4),
                                                                                                (128, 8))],
                    lambda b: [with_programs(b, p) for p in (1, 132, 264, 396, 528, 792)],
                    lambda b: [dataclasses.replace(b, num_stages=s) for s in (3, 4, 6)],
                    lambda b: [dataclasses.replace(b, prefetch_blocks=p) for p in (0, 2, 4, 8)],
                    lambda b: [dataclasses.replace(b, block_m=m) for m in block_ms]):
                best = min(candidates(best) + [best], key=timed_us)
            results = sorted(((us, cfg) for cfg, us in timed.items()), key=lambda r: r[0])
            found[f"{n}x{k} T={tokens}"] = results
            print(f"tune {n}x{k} T={tokens}: best {knobs(best)} {timed[best]:.1f} us; tuning's choice "
                  f"{knobs(default)} {timed[default]:.1f} us", flush=True)
    finally:
        tuning.fp8_linear = chosen
    return found


def knobs(cfg) -> str:
    """A decode config's knobs, as the tune results print them."""
    return (f"BLOCK_M {cfg.block_m} BLOCK_N {cfg.block_n} splits {cfg.splits} prefetch {cfg.prefetch_blocks} "
            f"warps {cfg.num_warps} stages {cfg.num_stages}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--tune", action="store_true")
    args = parser.parse_args()

    import m3_torch.fp8 as fp8

    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = linear_rows(bandwidth, args.tokens, fp8)
    rows += moe_rows(bandwidth, sorted({*args.tokens, MOE_FLOOR_TOKENS}), fp8)
    tuned = tune(fp8, args.tokens) if args.tune else {}
    md = [f"# FP8 block-scaled weights vs bf16 at decode sizes ({torch.cuda.get_device_name()}, "
          f"{datetime.date.today()})", "",
          f"Command: `python3 -m benchmarks.fp8_linear --out {args.out}{' --tune' if args.tune else ''}`. Copy "
          f"bandwidth (same run): {bandwidth / 1e12:.2f} TB/s. Times: `triton.testing.do_bench` medians of a CUDA "
          f"graph of {CALLS_PER_GRAPH} calls, per call. Bytes: weights (touched experts only; e4m3 at one byte plus "
          "float32 scales per 128 x 128 block) + bf16 activations in and out; a variant's floor: its bytes at the "
          "copy bandwidth; % of floor: floor / time. rel err: the FP8 result vs bf16's.",
          "", "| op | shape | tokens | bf16 us (% of floor) | fp8 us (% of floor) | fp8 floor us | speedup | "
          "fp8 rel err |", "|---|---|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r["op"], r["shape"], r["tokens"]) for r in rows):
        bf16, fp8_row = (next(r for r in rows if (r["op"], r["shape"], r["tokens"]) == key and r["variant"] == v)
                         for v in ("bf16", "fp8"))
        md.append(f"| {key[0]} | {key[1]} | {key[2]} | {bf16['us']:.1f} ({bf16['pct_of_floor']:.0f}%) | "
                  f"{fp8_row['us']:.1f} ({fp8_row['pct_of_floor']:.0f}%) | {fp8_row['floor_us']:.1f} | "
                  f"{bf16['us'] / fp8_row['us']:.2f}x | {fp8_row['rel_err_vs_bf16']:.3f} |")
    if tuned:
        md += ["", "fp8_linear decode knobs (`--tune`), fastest three per shape:", ""]
        md += [f"- {key}: " + "; ".join(f"{knobs(c)}: {us:.1f} us" for us, c in results[:3])
               for key, results in tuned.items()]
    result = dict(gpu=torch.cuda.get_device_name(), date=str(datetime.date.today()), copy_bandwidth=bandwidth,
                  rows=rows, tuned={key: [[us, dataclasses.asdict(c)] for us, c in results]
                                                for key, results in tuned.items()})
    save_results(args.out, "fp8_linear", result, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
