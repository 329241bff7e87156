"""The fused MoE at MiniMax-M3's expert shapes against its byte floor and torch's grouped GEMM.

    python3 -m benchmarks.moe [--tune] [--tokens 1 8 64 ...] [--out DIR]

128 experts top-4 plus the shared expert, hidden 6144, intermediate 3072, bf16, weights drawn on the
GPU (14.6 GB). Per token count: uniform random routing (distinct experts per token), the experts it
touches, and

- ``fused_torch_us``: ``m3_torch.fused_moe`` (its four launches, shared expert inside) in a CUDA graph,
  median replay;
- ``grouped_mm_us``: the unfused path it replaced (sort, ``torch.nn.functional.grouped_mm`` twice,
  SwiGLU-OAI, the weighted float32 sum, the shared expert's two GEMMs and SwiGLU) in a CUDA graph;
- ``fused_jax_us``: ``m3_jax.fused_moe`` jitted, steady-state per call (back-to-back calls);
- the byte floor: the touched experts' and the shared expert's weights (3 * I * H * 2 bytes each) /
  the copy bandwidth measured in the same run, and the share of it each reaches.

``--tune`` first sweeps the GPU block sizes of ``m3_kernels.tuning`` (``MOE_GPU_DECODE`` / ``MOE_GPU_PREFILL``:
gate_up and down kernels one at a time, the other at its default) and prints the best per token count.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import statistics
import time

import torch

from benchmarks.run import copy_bandwidth, save_results, time_graph

E, K, H, I = 128, 4, 6144, 3072
ALPHA, LIMIT = 1.702, 7.0


def make_weights(seed=0):
    """-> (w_gate_up, w_down, shared_gate_up, shared_down) on the GPU, bf16."""
    g = torch.Generator("cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16) * shape[-1] ** -0.5
    return randn(E, 2 * I, H), randn(E, H, I), randn(2 * I, H), randn(H, I)


def routing(tokens, seed):
    g = torch.Generator("cuda").manual_seed(seed)
    ids = torch.rand(tokens, E, generator=g, device="cuda").topk(K, dim=1).indices.int()
    weights = torch.rand(tokens, K, generator=g, device="cuda")
    return ids, weights / weights.sum(1, keepdim=True)


def grouped_mm_moe(x, w_gate_up, w_down, shared_gate_up, shared_down, ids, weights):
    """The unfused path (``M3Model``'s MoE before the fused kernels; routing scale 1), for comparison."""
    from m3_torch.model import swiglu_oai

    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.histc(flat.float(), bins=E, min=0, max=E - 1)
    offsets = torch.cumsum(counts, 0).int()
    rows = x.index_select(0, order // k)
    act = swiglu_oai(torch.nn.functional.grouped_mm(rows, w_gate_up.transpose(1, 2), offs=offsets), ALPHA, LIMIT)
    out = torch.nn.functional.grouped_mm(act, w_down.transpose(1, 2), offs=offsets)
    weighted = torch.empty((T * k, H), dtype=torch.float32, device=x.device)
    weighted[order] = out.float() * weights.reshape(-1)[order, None]
    shared = torch.nn.functional.linear(swiglu_oai(torch.nn.functional.linear(x, shared_gate_up), ALPHA, LIMIT),
                                        shared_down)
    return weighted.view(T, k, -1).sum(1).to(x.dtype) + shared


def jax_us(fn, args, reps):
    import jax

    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times) * 1e6


def fused(x, weights, ids, routing_weights):
    import m3_torch

    w_gate_up, w_down, shared_gate_up, shared_down = weights
    return m3_torch.fused_moe(x, w_gate_up, w_down, ids, routing_weights, swiglu_alpha=ALPHA, swiglu_limit=LIMIT,
                              shared_gate_up=shared_gate_up, shared_down=shared_down)


def tune(weights, token_counts, reps):
    """Sweep each kernel's (BLOCK_N, BLOCK_K, warps, stages) -> {tokens: {kernel: (best config, us)}}."""
    from m3_kernels import tuning

    best = {}
    for tokens in token_counts:
        prefill = tokens * (K + 1) >= 32 * (E + 1)
        table = tuning.MOE_GPU_PREFILL if prefill else tuning.MOE_GPU_DECODE
        default = dict(table)
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        ids, routing_weights = routing(tokens, tokens)
        candidates = ([(n, k, w, s) for n, k, w, s in itertools.product((64, 128), (32, 64), (4, 8), (3, 4))]
                      if prefill else
                      [(n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64), (128, 256), (4,), (3, 4))])
        best[tokens] = {}
        for kernel in ("gate_up", "down"):
            results = []
            for config in candidates:
                table[kernel] = config
                try:
                    us = time_graph([lambda: fused(x, weights, ids, routing_weights)], reps)
                except Exception as exc:   # a config that does not compile (shared memory) is skipped
                    print(f"  tokens {tokens} {kernel} {config}: {type(exc).__name__}")
                    continue
                results.append((us, config))
            us, config = min(results)
            table[kernel] = config
            best[tokens][kernel] = (config, us)
            print(f"tokens {tokens:5d} {kernel:8s} best {config} {us:8.1f} us "
                  f"(default {default[kernel]}: {dict((c, u) for u, c in results).get(default[kernel], float('nan')):.1f})",
                  flush=True)
        table.update(default)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128, 1024, 4096])
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default=f"{datetime.date.today()}-h200-moe")
    args = parser.parse_args()

    import jax

    import m3_jax

    bandwidth = copy_bandwidth()
    weights = make_weights()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; experts {E} top-{K}, H {H}, I {I}, bf16", flush=True)
    tuned = tune(weights, [t for t in args.tokens if t in (1, 8, 64, 4096)], args.reps) if args.tune else {}
    jax_moe = jax.jit(lambda x, wgu, wd, sgu, sd, ids, w: m3_jax.fused_moe(
        x, wgu, wd, ids, w, swiglu_alpha=ALPHA, swiglu_limit=LIMIT, shared_gate_up=sgu, shared_down=sd))
    jw = tuple(m3_jax.to_jax(w) for w in weights)
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        ids, routing_weights = routing(tokens, tokens)
        touched = int(ids.unique().numel())
        floor_bytes = (touched + 1) * 3 * I * H * 2 + 2 * tokens * H * 2
        floor_us = floor_bytes / bandwidth * 1e6
        fused_us = time_graph([lambda: fused(x, weights, ids, routing_weights)], args.reps)
        unfused_us = time_graph([lambda: grouped_mm_moe(x, *weights, ids, routing_weights)], args.reps)
        ref = grouped_mm_moe(x, *weights, ids, routing_weights).float()
        got = fused(x, weights, ids, routing_weights).float()
        rel = ((got - ref).norm() / ref.norm()).item()
        jargs = (m3_jax.to_jax(x), *jw, m3_jax.to_jax(ids), m3_jax.to_jax(routing_weights))
        jax_time = jax_us(jax_moe, jargs, args.reps)
        same = bool(torch.equal(m3_jax.to_torch(jax_moe(*jargs)).float(), got))
        row = dict(tokens=tokens, experts_touched=touched, floor_us=floor_us, fused_torch_us=fused_us,
                   grouped_mm_us=unfused_us, fused_jax_us=jax_time, fused_floor_share=floor_us / fused_us,
                   grouped_mm_floor_share=floor_us / unfused_us, rel_diff_vs_grouped_mm=rel, jax_equals_torch=same)
        rows.append(row)
        print(row, flush=True)
    md = [f"# Fused MoE at MiniMax-M3's expert shapes ({torch.cuda.get_device_name()}, {datetime.date.today()})", "",
          f"Command: `python3 -m benchmarks.moe {'--tune ' if args.tune else ''}--tokens "
          f"{' '.join(map(str, args.tokens))}`. Copy bandwidth (same run): {bandwidth / 1e12:.2f} TB/s. "
          f"{E} experts top-{K} + the shared expert, H {H}, I {I}, bf16, uniform random routing. Floor: touched "
          "experts' and the shared expert's weights / copy bandwidth. torch times: CUDA-graph replay medians; JAX: jitted, back-to-back calls.", "",
          "| tokens | experts touched | floor us | fused torch us (% floor) | grouped_mm us (% floor) | speedup | "
          "fused JAX us | JAX bits = torch |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['tokens']} | {r['experts_touched']} | {r['floor_us']:.0f} | {r['fused_torch_us']:.0f} "
                  f"({100 * r['fused_floor_share']:.0f}%) | {r['grouped_mm_us']:.0f} "
                  f"({100 * r['grouped_mm_floor_share']:.0f}%) | {r['grouped_mm_us'] / r['fused_torch_us']:.2f}x | "
                  f"{r['fused_jax_us']:.0f} | {r['jax_equals_torch']} |")
    if tuned:
        md += ["", "Block-size sweep (best (BLOCK_N, BLOCK_K, warps, stages) per kernel, whole call us):", ""]
        md += [f"- {t} tokens: " + "; ".join(f"{k} {c} {u:.1f} us" for k, (c, u) in v.items()) for t, v in tuned.items()]
    result = dict(gpu=torch.cuda.get_device_name(), date=str(datetime.date.today()), copy_bandwidth=bandwidth,
                  shapes=dict(experts=E, top_k=K, hidden=H, inter=I), rows=rows,
                  tuned={str(t): {k: list(c) + [u] for k, (c, u) in v.items()} for t, v in tuned.items()})
    save_results(args.out, args.name, result, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
