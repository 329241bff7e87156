"""Prefix caching: `python3 -m benchmarks.prefix_cache [--out DIR] [--frameworks torch,jax] [--tiny]`.

The random bf16 model of ``benchmarks.e2e`` (MiniMax-M3's attention shapes, 4
layers: 1 dense + 3 MSA) through ``LLM.generate``, each framework in a fresh
process, with ``enable_prefix_caching`` on and off:

* **Shared long prefix** (``ttft``): a random prompt of ``--prefix`` tokens
  (32k) plus ``--suffix`` (100) tokens, generated with ``max_tokens=1``, so the
  wall time of the call is the time to first token. ``cold_ms``: the first
  request of that prefix (nothing cached); ``warm_ms``: a second request with
  the same prefix and another suffix; ``warm / cold`` is the share. Both run
  after two warm-up requests of another prefix (compilation and graph capture
  out of the timings); each is the median of ``--reps`` fresh prefixes.
* **Multi-turn chat** (``chat``): ``--conversations`` conversations, one
  ``generate`` call per turn for all of them (a batch), each turn's prompt is
  the whole conversation so far (the previous prompt, the previous answer,
  ``--user-tokens`` new tokens); answers are ``--answer-tokens`` long
  (``ignore_eos``). Requests/s over all turns, caching on against off, and
  the engine's prefix-cache hit rate. Every conversation starts with one
  ``--system-tokens`` system prompt. The timed pass follows a warm-up pass of
  the same workload with other tokens (each step shape compiled once).

Greedy sampling throughout; the chat runs' tokens with caching on and off are
compared (``same_tokens``). In bf16 they can differ at near-ties: reused K/V
rows were written by decode steps and round differently from rows a prefill
recomputes (docs/ENGINE.md). ``--profile`` adds torch.profiler's table of a
warm torch request. Writes prefix_cache.json and prefix_cache.md to --out.
``--tiny`` runs the tiny test model on the CPU (checks the script).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from m3_engine import SamplingParams


def _engine(framework: str, model_dir, *, caching: bool, max_model_len: int, max_num_seqs: int, device):
    if framework == "torch":
        import m3_torch as fw
    else:
        import m3_jax as fw
    return fw.LLM(model_dir, precompile=False,
                  dtype="bfloat16", device=device, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                  max_num_batched_tokens=min(8192, max_model_len), enable_prefix_caching=caching)


def _timed_generate(llm, prompts, params) -> tuple:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def run_ttft(framework, model_dir, args, device, vocab) -> dict:
    rng = np.random.default_rng(1)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prompt(prefix):
        return prefix + rng.integers(3, vocab, args.suffix).tolist()

    llm = _engine(framework, model_dir, caching=True, max_model_len=args.prefix + args.suffix + 256,
                  max_num_seqs=1, device=device)
    warm_prefix = rng.integers(3, vocab, args.prefix).tolist()
    _timed_generate(llm, [prompt(warm_prefix)], one)          # compile / capture / autotune
    _timed_generate(llm, [prompt(warm_prefix)], one)          # the cached path's shapes too
    cold, warm, cached = [], [], []
    for _ in range(args.reps):
        prefix = rng.integers(3, vocab, args.prefix).tolist()
        t, _ = _timed_generate(llm, [prompt(prefix)], one)
        cold.append(t)
        t, outs = _timed_generate(llm, [prompt(prefix)], one)
        warm.append(t)
        cached.append(outs[0].num_cached_tokens)
    row = dict(prefix=args.prefix, suffix=args.suffix, cold_ms=1e3 * statistics.median(cold),
               warm_ms=1e3 * statistics.median(warm), cold_all_ms=[1e3 * t for t in cold],
               warm_all_ms=[1e3 * t for t in warm], cached_tokens=cached)
    row["warm_over_cold"] = row["warm_ms"] / row["cold_ms"]
    if args.profile and framework == "torch":
        row["warm_profile"] = _torch_profile(llm, prompt(prefix), one)
    print(f"  {framework} ttft: " + " ".join(f"{k}={row[k]:.4g}" for k in ("cold_ms", "warm_ms", "warm_over_cold")),
          flush=True)
    llm.close()
    return row


def _chat_pass(llm, args, rng, vocab, params) -> tuple:
    """One pass of the multi-turn workload -> (seconds per turn, answers)."""
    system = rng.integers(3, vocab, args.system_tokens).tolist()
    conversations = [list(system) for _ in range(args.conversations)]
    turn_s, answers = [], []
    for _ in range(args.turns):
        for c in conversations:
            c.extend(rng.integers(3, vocab, args.user_tokens).tolist())
        t, outs = _timed_generate(llm, [list(c) for c in conversations], params)
        turn_s.append(t)
        for c, out in zip(conversations, outs):
            c.extend(out.outputs[0].token_ids)
            answers.append(list(out.outputs[0].token_ids))
    return turn_s, answers


def run_chat(framework, model_dir, args, device, vocab, caching: bool) -> tuple:
    params = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True)
    longest = args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens)
    llm = _engine(framework, model_dir, caching=caching, max_model_len=longest + 128,
                  max_num_seqs=args.conversations, device=device)
    # warm-up: the same workload with other tokens (every step shape compiled / captured once)
    _chat_pass(llm, args, np.random.default_rng(3), vocab, params)
    before = llm.engine.stats
    turn_s, answers = _chat_pass(llm, args, np.random.default_rng(2), vocab, params)
    after = llm.engine.stats
    requests = args.turns * args.conversations
    row = dict(caching=caching, requests=requests, seconds=sum(turn_s), turn_ms=[1e3 * t for t in turn_s],
               requests_per_s=requests / sum(turn_s),
               hit_rate=(after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"])
               / max(after["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"], 1))
    print(f"  {framework} chat caching={caching}: {row['requests_per_s']:.3g} req/s, hit rate {row['hit_rate']:.3f}, "
          f"turns (ms) {' '.join(f'{t:.0f}' for t in row['turn_ms'])}", flush=True)
    llm.close()
    return row, answers


def _torch_profile(llm, prompt, params) -> str:
    """torch.profiler's table of one warm request (kernels and host ops by total time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], params, use_tqdm=False)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    table = (f"CUDA kernels launched: {kernels}\n"
             + events.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60) + "\n"
             + events.table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    print(table, flush=True)
    return table


def run_framework(framework, model_dir, args, device, vocab) -> dict:
    out = dict(ttft=run_ttft(framework, model_dir, args, device, vocab))
    if args.skip_chat:
        return out
    on, on_tokens = run_chat(framework, model_dir, args, device, vocab, caching=True)
    off, off_tokens = run_chat(framework, model_dir, args, device, vocab, caching=False)
    out["chat"] = dict(on=on, off=off, speedup=on["requests_per_s"] / off["requests_per_s"],
                       same_tokens=on_tokens == off_tokens)
    return out


def _in_fresh_process(framework, model_dir, args, device, vocab) -> dict:
    import multiprocessing as mp
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(run_framework, (framework, model_dir, args, device, vocab))


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# Prefix caching on {result['gpu']} ({result['date']})", "",
             f"`{result['command']}`", "",
             f"Copy bandwidth (same run): {result['copy_tbps'] or 0:.2f} TB/s.", "",
             f"Model: benchmarks.e2e's random bf16 model (MiniMax-M3 attention shapes, 1 dense + 3 MSA layers). "
             f"Greedy, `LLM.generate`.", "",
             f"## Time to first token, {a['prefix']}-token shared prefix + {a['suffix']} new tokens "
             f"(median of {a['reps']})", "",
             "| framework | cold (ms) | warm (ms) | warm / cold | cached tokens |", "|---|---|---|---|---|"]
    for fw, r in result["frameworks"].items():
        t = r["ttft"]
        lines.append(f"| {fw} | {t['cold_ms']:.1f} | {t['warm_ms']:.1f} | {t['warm_over_cold']:.3f} | "
                     f"{t['cached_tokens'][0]} |")
    lines += ["", f"## Multi-turn chat: {a['conversations']} conversations x {a['turns']} turns, "
              f"system {a['system_tokens']}, user {a['user_tokens']}, answer {a['answer_tokens']} tokens", "",
              "| framework | caching off (req/s) | caching on (req/s) | on / off | hit rate (on) | same tokens |",
              "|---|---|---|---|---|---|"]
    for fw, r in result["frameworks"].items():
        if "chat" not in r:
            continue
        c = r["chat"]
        lines.append(f"| {fw} | {c['off']['requests_per_s']:.2f} | {c['on']['requests_per_s']:.2f} | "
                     f"{c['speedup']:.2f}x | {c['on']['hit_rate']:.3f} | {c['same_tokens']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/latest"))
    ap.add_argument("--frameworks", default="torch,jax")
    ap.add_argument("--prefix", type=int, default=32768)
    ap.add_argument("--suffix", type=int, default=100)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=4096)
    ap.add_argument("--user-tokens", type=int, default=512)
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--skip-chat", action="store_true", help="the time-to-first-token part only")
    ap.add_argument("--profile", action="store_true", help="torch: torch.profiler's table of a warm request")
    ap.add_argument("--tiny", action="store_true", help="the tiny test model on the CPU (checks the script)")
    ap.add_argument("--model-dir", default=None, help="where to write the random model (default: a temp dir)")
    args = ap.parse_args(argv)

    if args.tiny:
        from m3_engine.tiny_model import write_tiny_checkpoint
        args.prefix, args.suffix, args.reps = 260, 7, 1
        args.conversations, args.turns, args.system_tokens = 2, 2, 130
        args.user_tokens, args.answer_tokens = 9, 3
        model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="m3tiny-"))
        write_tiny_checkpoint(model_dir)
        device, gpu, vocab, copy_tbps = "cpu", "CPU (Triton interpreter)", 500, None
    else:
        import torch
        from benchmarks.e2e import M3_SHAPES, write_model
        model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="m3e2e-"))
        if not (model_dir / "config.json").is_file():
            write_model(model_dir, M3_SHAPES, args.prefix + args.suffix + 256)
        from benchmarks.run import copy_bandwidth
        device, gpu, vocab = "cuda", torch.cuda.get_device_name(), M3_SHAPES["vocab_size"]
        copy_tbps = copy_bandwidth() / 1e12
    result = dict(command="python3 -m benchmarks.prefix_cache " + " ".join(sys.argv[1:] if argv is None else argv),
                  gpu=gpu, copy_tbps=copy_tbps, date=datetime.date.today().isoformat(), args=vars(args) | {"out": None},
                  frameworks={})
    for fw in args.frameworks.split(","):
        result["frameworks"][fw] = (run_framework(fw, model_dir, args, device, vocab) if args.tiny
                                    else _in_fresh_process(fw, model_dir, args, device, vocab))
    from benchmarks.run import save_results
    save_results(args.out, "prefix_cache", result, markdown(result))
    return result


if __name__ == "__main__":
    main()
