"""Time to ready and the first requests: `python3 -m benchmarks.warm_start [--out DIR] [--tiny] [--no-precompile]`.

For each engine (torch, then JAX), two starts in fresh processes over ONE compile cache folder
(``compile_cache_dir``, empty before the first): a first start (cold: every program compiled)
and a second (warm: JAX's persistent cache and Triton's cache read back). Each start builds
``LLM(model, dtype="bfloat16", max_num_seqs=64, max_model_len=2048, precompile=...)`` on the 4-layer
benchmark model of ``benchmarks.e2e`` (M3's attention shapes, a small MoE, a 32k vocabulary),
then generates twice: 128 prompts of 1024 random tokens, 256 new tokens each, greedy, ignoring
EOS. Reported per start:

* ``load_s`` / ``compile_s`` / ``capture_s`` / ``ready_s``: ``LLM.startup_times`` (weights and
  pool, the warm-up's eager steps or JAX compilations, the CUDA graph captures, all of it);
* ``first_tok_s``: generated tokens per second of the first 128 requests (what a server's first
  clients see), ``steady_tok_s`` the same workload again, ``first_vs_steady`` their ratio (1.0:
  nothing was compiled on the request path);
* ``late_programs``: what was made after ``LLM()`` returned, in the two passes: torch, the
  Triton kernel variants its launcher did not hold in memory (compiled, or read back from the
  disk cache; Triton's ``jit_post_compile_hook``), named in ``late_kernels``; JAX, the
  programs compiled (``compiled_forwards`` and ``compiled_sampling``). 0 is the "ready means
  ready" target;
* ``passes``: per pass (first, steady), from the engine's step timeline (``M3_STEP_TIMELINE``,
  ``m3_engine.step_timeline``): ``steps``, ``host_ms`` (a step call's time less its wait for the
  device, per step) and ``wait_ms`` (that wait, per step). A pass slower on the host shows in
  ``host_ms``, one slower on the GPU in ``wait_ms``. Torch on a GPU adds its caching allocator's
  counts over the pass (``torch.cuda.memory_stats``): ``cuda_mallocs``, ``cuda_frees`` and
  ``alloc_retries`` (a retry frees the cached blocks and synchronizes the device);
* torch: ``kernel_profile``: one more generate after the passes (64 of the prompts, 32 new tokens
  each) under torch.profiler, its kernels' total ms and the longest kernels' calls and mean us
  (:func:`kernel_profile`): whether the same kernels run slower in one start's process;
* JAX: ``kernels_compiled`` / ``kernels_read``: the Triton kernels its start-up compiled to PTX and
  read back from the cache folder (``m3_jax._triton_call.kernel_cache_stats``; a second start
  compiles none).

Writes warm_start.json and warm_start.md to --out. About 3-4 minutes on an H200 for both engines
(the JAX cold start compiles ~40 forwards). ``--tiny``: the tiny test model on the CPU (Triton's
interpreter), 4 prompts of 16 tokens, to check the script, not to measure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FULL = dict(prompts=128, prompt_len=1024, new_tokens=256, options=dict(dtype="bfloat16", max_num_seqs=64,
                                                                       max_model_len=2048))
TINY = dict(prompts=4, prompt_len=16, new_tokens=4, options=dict(max_num_seqs=2, max_model_len=128,
                                                                 max_num_batched_tokens=16, device="cpu"))


def one_start(framework: str, model_dir: str, cache_dir: str, precompile: bool, workload: dict) -> dict:
    """Build the engine, generate the workload twice -> the start's row (run in a fresh process)."""
    import importlib
    import os

    from m3_engine import step_timeline
    from m3_engine.sampling_params import SamplingParams

    timeline = Path(cache_dir).parent / f"timeline-{os.getpid()}.jsonl"
    os.environ[step_timeline.ENV_VAR] = str(timeline)   # this fresh process's engine records its steps
    llm_class = importlib.import_module(f"m3_{framework}").LLM
    late = []   # torch: the kernel variants the launcher compiled or read back after LLM() returned
    if framework == "torch":
        from triton import knobs

        ready = [False]

        def variant_made(*, fn, repr, **_):
            if ready[0]:
                late.append(repr)

        knobs.runtime.jit_post_compile_hook = variant_made
    llm = llm_class(model_dir, precompile=precompile, compile_cache_dir=cache_dir, **workload["options"])
    if framework == "torch":
        ready[0] = True
    else:
        from m3_jax._triton_call import kernel_cache_stats

        made_at_ready = len(llm.runner.compiled_forwards) + len(llm.runner.compiled_sampling)
        kernels = kernel_cache_stats()   # jax-triton's kernels made by the start-up: compiled, read back
    rng = np.random.default_rng(0)
    vocab = llm.config.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, workload["prompt_len"]).tolist()}
               for _ in range(workload["prompts"])]
    params = SamplingParams(temperature=0.0, max_tokens=workload["new_tokens"], ignore_eos=True)
    rates, bounds, allocator = [], [], []
    for _ in range(2):
        before = allocator_counts(framework)
        start, wall = time.perf_counter(), time.time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rates.append(tokens / (time.perf_counter() - start))
        bounds.append((wall, time.time()))
        allocator.append({k: v - before[k] for k, v in allocator_counts(framework).items()})
    profile = kernel_profile(llm, prompts[:PROFILED_PROMPTS], workload) if framework == "torch" else None
    times = dict(llm.startup_times)
    if framework == "torch":
        late_programs = len(late)
    else:
        late_programs = len(llm.runner.compiled_forwards) + len(llm.runner.compiled_sampling) - made_at_ready
    llm.close()
    extra = dict(kernel_profile=profile) if framework == "torch" else \
        dict(kernels_compiled=kernels["compiled"], kernels_read=kernels["read"])
    return dict(load_s=times["load"], compile_s=times["compile"], capture_s=times["capture"],
                ready_s=times["total"], programs=times["programs"], first_tok_s=rates[0], steady_tok_s=rates[1],
                first_vs_steady=rates[0] / rates[1], late_programs=late_programs, late_kernels=late[:20],
                passes=[dict(pass_split(step_timeline.read(timeline), *b), **counts)
                        for b, counts in zip(bounds, allocator)], **extra)


PROFILED_PROMPTS, PROFILED_TOKENS, PROFILED_TOP = 64, 32, 8


def kernel_profile(llm, prompts, workload) -> dict:
    """Torch: one more generate (``prompts``, ``PROFILED_TOKENS`` new tokens each) under torch.profiler ->
    its kernels' total time and the ``PROFILED_TOP`` longest kernels by total: calls and mean
    microseconds (on the CPU the top-level ops). Two starts' profiles side by side say whether the
    same work runs slower on the GPU in one of the processes."""
    import torch

    from benchmarks.run import profiled_kernels
    from m3_engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=min(PROFILED_TOKENS, workload["new_tokens"]), ignore_eos=True)
    kernels = profiled_kernels(lambda: llm.generate(prompts, params, use_tqdm=False), torch.cuda.is_available())
    by_name = {}
    for name, us in kernels:
        calls, total = by_name.get(name, (0, 0.0))
        by_name[name] = (calls + 1, total + us)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:PROFILED_TOP]
    return dict(prompts=len(prompts), new_tokens=params.max_tokens, kernel_ms=sum(us for _, us in kernels) / 1e3,
                top=[dict(name=name, calls=calls, mean_us=total / calls) for name, (calls, total) in top])


def allocator_counts(framework: str) -> dict:
    """Torch on a GPU: the caching allocator's device allocations, frees and retries so far; else {}."""
    import torch

    if framework != "torch" or not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return dict(cuda_mallocs=stats.get("num_device_alloc", 0), cuda_frees=stats.get("num_device_free", 0),
                alloc_retries=stats.get("num_alloc_retries", 0))


def pass_split(lines: list, start: float, end: float) -> dict:
    """The step lines of one pass (calls started in ``[start, end]``) -> steps, host and wait ms per step."""
    steps = [line for line in lines if start <= line["start"] <= end]
    n = max(len(steps), 1)
    wait = sum(line["device_wait"] for line in steps)
    host = sum(line["end"] - line["start"] for line in steps) - wait
    return dict(steps=len(steps), host_ms=1e3 * host / n, wait_ms=1e3 * wait / n)


def markdown(result: dict) -> str:
    lines = [f"# Time to ready ({result['device']}; precompile {result['precompile']})", "",
             f"Command: `{result['command']}`.", "",
             f"{result['workload']['prompts']} prompts x {result['workload']['prompt_len']} tokens, "
             f"{result['workload']['new_tokens']} new each; options {result['workload']['options']}", "",
             "| engine | start | load s | compile s | capture s | ready s | programs | first tok/s | steady tok/s "
             "| first/steady | made after ready | host / wait ms per step, first | same, steady |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        split = " | ".join(f"{p['host_ms']:.2f} / {p['wait_ms']:.2f} ({p['steps']} steps{_allocs(p)})"
                           for p in row["passes"])
        lines.append(f"| {row['framework']} | {row['start']} | {row['load_s']:.1f} | {row['compile_s']:.1f} | "
                     f"{row['capture_s']:.1f} | {row['ready_s']:.1f} | {row['programs']} | {row['first_tok_s']:.0f} | "
                     f"{row['steady_tok_s']:.0f} | {row['first_vs_steady']:.2f} | {row['late_programs']} | {split} |")
    kernels = [row for row in result["rows"] if "kernels_compiled" in row]
    if kernels:
        lines += ["", "Triton kernels of the JAX start-up, compiled to PTX / read back from the cache folder: " +
                  ", ".join(f"{row['start']} start {row['kernels_compiled']} / {row['kernels_read']}"
                            for row in kernels) + "."]
    profiled = [row for row in result["rows"] if row.get("kernel_profile")]
    if profiled:
        first = profiled[0]["kernel_profile"]
        lines += ["", f"Kernels of one profiled generate after the passes ({first['prompts']} of the prompts, "
                  f"{first['new_tokens']} new tokens each; the longest by total time): mean us per call (calls), "
                  "per start", "",
                  "| kernel | " + " | ".join(f"{row['framework']} {row['start']}" for row in profiled) + " |",
                  "|---|" + "---|" * len(profiled),
                  "| all kernels, ms | " + " | ".join(f"{row['kernel_profile']['kernel_ms']:.1f}"
                                                    for row in profiled) + " |"]
        means = [{k["name"]: k for k in row["kernel_profile"]["top"]} for row in profiled]
        for name in dict.fromkeys(k["name"] for row in profiled for k in row["kernel_profile"]["top"]):
            cells = [f"{m[name]['mean_us']:.1f} ({m[name]['calls']})" if name in m else "-" for m in means]
            lines.append(f"| `{name[:80]}` | " + " | ".join(cells) + " |")
    late = [(row, kernel) for row in result["rows"] for kernel in row["late_kernels"]]
    if late:
        lines += ["", "Kernel variants made after ready (torch, at most 20 a start):", ""]
        lines += [f"- {row['framework']} {row['start']}: `{kernel}`" for row, kernel in late]
    return "\n".join(lines) + "\n"


def _allocs(p: dict) -> str:
    if "cuda_mallocs" not in p:
        return ""
    return f"; cudaMalloc {p['cuda_mallocs']}, free {p['cuda_frees']}, retries {p['alloc_retries']}"


def main(argv=None):
    from benchmarks.e2e import M3_SHAPES, in_fresh_process, write_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/warm_start"))
    p.add_argument("--tiny", action="store_true", help="the tiny test model on the CPU (checks the script)")
    p.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=True,
                   help="build the engines with precompile (--no-precompile: compile on first use, the old way)")
    p.add_argument("--frameworks", default="torch,jax")
    args = p.parse_args(argv)
    workload = TINY if args.tiny else FULL
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            from m3_engine.tiny_model import write_tiny_checkpoint
            model_dir = write_tiny_checkpoint(Path(tmp) / "model", seed=0, form="text")
        else:
            model_dir = write_model(Path(tmp) / "model", M3_SHAPES, workload["options"]["max_model_len"])
        for framework in args.frameworks.split(","):
            cache_dir = Path(tmp) / f"cache-{framework}"   # empty before the first start
            for start in ("first", "second"):
                row = in_fresh_process(one_start, framework, str(model_dir), str(cache_dir), args.precompile,
                                       workload)
                rows.append(dict(framework=framework, start=start, **row))
                print(json.dumps(rows[-1]), flush=True)
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu"
    command = "python3 -m benchmarks.warm_start " + " ".join(sys.argv[1:] if argv is None else argv)
    result = dict(device=device, command=command, precompile=args.precompile, workload=workload, rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "warm_start.json").write_text(json.dumps(result, indent=2))
    (args.out / "warm_start.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
