"""Time to first token of one long prompt at MiniMax-M3's layer shapes: ``python3 -m benchmarks.ttft``.

    python3 -m benchmarks.ttft [--lens 32768,131072] [--frameworks torch,jax]
                               [--prefill-backends triton,cutedsl] [--reps 5] [--out DIR] [--tiny]

The model is ``benchmarks.model_step``'s (``M3_DIMS``, ``text_config``): 4
layers at MiniMax-M3's per-layer dimensions, layer 0 dense attention + dense
MLP, layers 1-3 MSA + MoE, bf16, ``load_format="dummy"`` (random weights drawn
on the GPU, ~51 GB). Per framework (``--frameworks``: torch, and JAX through
the same ``LLM`` API) and prompt length (``--lens``) one engine is built with
``max_model_len`` = length (the prompt fills the cache; its one generated token
needs no room there: the scheduler ends a request when its next token would
need position ``max_model_len``. A longer one would widen the block table, which
every JAX prefill span reads whole: 131073 tokens would double its selection's
sort width at 128k), a pool of one such request
(``num_gpu_blocks_override``) and ``precompile=False``; every other option at
the engine's default, chunked prefill included: ``max_num_batched_tokens`` =
max(2048, ``max_num_seqs`` = 8) = 2048 tokens a step and ``prefill_chunk`` =
2048 prompt tokens a step, so a 32k prompt runs as 16 steps and a 128k one
as 64 (the chunk count is measured: the engine's step counter).

Per length: one untimed request of the same length first (it compiles and
autotunes the kernels of every chunk shape), then ``--reps`` requests (5) of
fresh random token ids, each ``LLM.generate`` of one prompt with
``max_tokens=1`` (greedy, ``ignore_eos``) timed on the wall clock from the
call to its output: ``ttft_ms`` is their median, ``prompt_tok_s`` = length /
TTFT, ``ms_per_chunk`` = TTFT / chunks.

Attention's share (torch): one more request under ``torch.profiler`` (CUDA
activity), its kernels in launch order (one stream; memcpy / memset not
counted). A kernel is attention's when its name holds one of
:data:`ATTENTION_KERNELS`' patterns, which are the names the kernels have in
``kernels/``:

* indexer: ``index_scores`` (Triton ``index.index_scores_kernel``; CuTeDSL
  ``cute_index.index_scores_kernel``, named ``kernel_cutlass_index_scores_kernel_...``
  by the CuTe DSL);
* selection: ``select_blocks`` (``index.select_blocks_kernel``, where the top-k
  runs as a launch of its own; with one-token row tiles it is fused into the
  sparse attention kernel and counted there);
* attention: ``paged_attention`` (``attention.paged_attention_kernel``, dense
  and sparse), ``merge_splits`` (``merge.merge_splits_kernel``, split-K
  partials), ``prefill_kernel`` (CuTeDSL ``cute_prefill.prefill_kernel``, dense
  and sparse, ``kernel_cutlass_prefill_kernel_...``).

The Triton attention kernel serves both layer kinds, so dense and sparse are
told apart by order: an attention kernel is sparse when the indexer or the
selection ran since the previous layer's attention (MSA layers score before
they attend; dense layers run no indexer). Reported: the kernels' total GPU
time, attention's time and share of it, and the split dense attention /
indexer / selection / sparse attention, with the attention kernels' names
(``attention_kernels``) and the top kernels by time (``top_kernels``), to
check the patterns against what ran. A kernel's time is its span on the GPU
(one launched early under programmatic dependent launch counts its wait too);
``kernel_pct_of_ttft``: the kernels' sum over the TTFT. Cache writes
(K/V/index-K rows: ``qk_norm_rope_kernel``, ``cache_write_kernel``) are not
counted as attention. JAX: no share
(its kernels run inside XLA's programs; a ``jax.profiler`` trace is another
tool).

``extrap_60l_tp8_ms`` (EXTRAPOLATION, torch, not measured): M3's 60 layers on
8 GPUs from that profile: ``(60 x other / 4 + 3 x dense attention + 57 x
MSA-layer attention / 3) / 8``, where ``other`` is the kernel time that is not
attention (projections, norms, MLP / MoE, the embedding and the last token's
head, averaged over the 4 layers: a dense MLP layer and an MoE one are taken
to cost alike), the attention per layer kind from the split above, the 8-way
split ideal (no all-reduces, host time not counted): an optimistic estimate
of the GPU time of the full model's prefill. ``attention_pct_60l``: attention's
share of it.

Prefill backends (``--prefill-backends``): each set runs in a fresh process
per framework with the environment variables ``M3_DENSE_PREFILL`` and
``M3_SPARSE_PREFILL`` unset (``triton``: the engine's default) or both
``cutedsl`` (the Hopper CuTeDSL kernels; each row records the backends
resolved). ``M3_INDEXER_SCORE`` is left as the environment sets it (recorded
too). JAX bakes the backends into its
programs when it traces them, torch reads them at each call.

Writes ``<date>-<gpu>-ttft.{json,md}`` to ``--out`` (default
benchmarks/results/) with the command, the GPU, the copy bandwidth and the
bf16 matmul rate measured first in the same run (``benchmarks.run``), after
each process (a run cut short keeps what it measured). ``--tiny``: the same
code on the tiny test config on the CPU (Triton's interpreter; prompts of
300 tokens, one chunk; the profile counts the top-level CPU ops, among them
the ``m3::`` custom ops that run the kernels in the interpreter, in place of
GPU kernels), to check the script, not to measure.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from m3_engine import SamplingParams
from m3_engine.model_config import M3TextConfig
from m3_kernels import backends
from m3_kernels.planner import PAGE_SIZE

from benchmarks import model_step
from benchmarks.e2e import in_fresh_process
from benchmarks.run import profiled_kernels, save_results

LAYERS = 4                                   # 1 dense + 3 MSA/MoE, as benchmarks.model_step
LENS, TINY_LENS = (32768, 131072), (300,)
REPS, TINY_REPS = 5, 1
FULL_LAYERS, FULL_DENSE_LAYERS, FULL_TP = model_step.FULL_LAYERS, model_step.FULL_DENSE_LAYERS, model_step.FULL_TP
PREFILL_ENV_VARS = ("M3_DENSE_PREFILL", "M3_SPARSE_PREFILL")
PREFILL_BACKENDS = ("triton", "cutedsl")
ATTENTION_KERNELS = {   # kind -> name patterns (the kernels' names in kernels/; module docstring)
    "indexer": ("index_scores",),
    "selection": ("select_blocks",),
    "attention": ("paged_attention", "merge_splits", "prefill_kernel"),
}
SPLIT = ("dense_attention", "indexer", "selection", "sparse_attention")


# -- which kernels are attention's ---------------------------------------------------------------

def kernel_kind(name: str) -> str | None:
    """"indexer", "selection", "attention" (dense or sparse) or None (not attention) by name."""
    for kind, patterns in ATTENTION_KERNELS.items():
        if any(p in name for p in patterns):
            return kind
    return None


def attention_split(kernels) -> dict:
    """``kernels``: (name, microseconds) in launch order -> microseconds per kind of :data:`SPLIT` plus
    ``other`` (not attention) and ``total``. An attention kernel is sparse when the indexer or the selection
    ran since the previous attention kernel's layer ended (the first non-attention kernel after it)."""
    us = dict.fromkeys((*SPLIT, "other"), 0.0)
    sparse, attended = False, False
    for name, t in kernels:
        kind = kernel_kind(name)
        if kind in ("indexer", "selection"):
            sparse = True
        elif kind == "attention":
            kind = "sparse_attention" if sparse else "dense_attention"
        else:
            kind = "other"
            if attended:   # the layer's attention is over: the next one starts unscored
                sparse = False
        attended = kind.endswith("attention")
        us[kind] += t
    us["total"] = sum(us.values())
    return us


def attention_share(kernels, c: M3TextConfig) -> dict:
    """The profile's numbers (module docstring): kernel time, attention's time, share and split, the
    attention kernels' names, the top kernels, and the 60-layer extrapolation."""
    us = attention_split(kernels)
    attention = sum(us[k] for k in SPLIT)
    row = dict(kernels=len(kernels), kernel_ms=us["total"] / 1e3, attention_ms=attention / 1e3,
               attention_pct=100 * attention / us["total"] if us["total"] else None,
               **{f"{k}_ms": us[k] / 1e3 for k in SPLIT})
    row["attention_kernels"] = sorted({name[:100] for name, _ in kernels if kernel_kind(name)})
    by_name = {}
    for name, t in kernels:
        total, count = by_name.get(name, (0.0, 0))
        by_name[name] = (total + t, count + 1)
    row["top_kernels"] = [dict(name=name[:100], ms=t / 1e3, count=n)
                          for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:12]]
    dense, msa = c.sparse_layers.count(False), c.sparse_layers.count(True)
    dense_layer = row["dense_attention_ms"] / dense
    msa_layer = (row["indexer_ms"] + row["selection_ms"] + row["sparse_attention_ms"]) / msa
    other_layer = us["other"] / 1e3 / c.num_hidden_layers
    attention_60l = FULL_DENSE_LAYERS * dense_layer + (FULL_LAYERS - FULL_DENSE_LAYERS) * msa_layer
    gpu_60l = FULL_LAYERS * other_layer + attention_60l
    row.update(extrap_60l_tp8_ms=gpu_60l / FULL_TP,
               attention_pct_60l=100 * attention_60l / gpu_60l if gpu_60l else None)
    return row


# -- one engine per length -----------------------------------------------------------------------

@contextlib.contextmanager
def prefill_env(backend: str):
    """``M3_DENSE_PREFILL`` and ``M3_SPARSE_PREFILL`` unset ("triton") or both "cutedsl" inside the block."""
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"backend: expected one of {PREFILL_BACKENDS}, got {backend!r}")
    saved = {name: os.environ.pop(name, None) for name in PREFILL_ENV_VARS}
    if backend == "cutedsl":
        os.environ.update(dict.fromkeys(PREFILL_ENV_VARS, "cutedsl"))
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def resolved_backends() -> dict:
    """The prefill and indexer backends resolved from the environment."""
    return dict(dense_prefill_backend=backends.dense_prefill_backend(),
                sparse_prefill_backend=backends.sparse_prefill_backend(),
                indexer_backend=backends.indexer_backend())


def timed_generate(llm, prompt, params) -> float:
    """Seconds from ``generate``'s call to its output."""
    t0 = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return time.perf_counter() - t0


def measure_length(framework: str, model_dir, length: int, reps: int, device: str, c: M3TextConfig) -> dict:
    """One engine of ``framework`` for prompts of ``length`` tokens -> its row (closed before returning)."""
    if framework == "torch":
        import m3_torch as fw
    else:
        import m3_jax as fw
    rng = np.random.default_rng(length)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = lambda: rng.integers(3, c.vocab_size, length).tolist()   # ids 0-2 are the special tokens
    t0 = time.perf_counter()
    llm = fw.LLM(model_dir, precompile=False, dtype="bfloat16", device=device, load_format="dummy",
                 max_model_len=length, num_gpu_blocks_override=-(-length // PAGE_SIZE))
    try:
        sched = llm.scheduler_config
        row = dict(framework=framework, length=length, build_s=time.perf_counter() - t0,
                   max_num_batched_tokens=sched.max_num_tokens, prefill_chunk=sched.prefill_chunk,
                   **resolved_backends())
        steps = llm.engine.stats["steps"]
        row["warmup_s"] = timed_generate(llm, prompt(), params)   # compiles / autotunes every chunk's kernels
        row["chunks"] = llm.engine.stats["steps"] - steps
        times = [timed_generate(llm, prompt(), params) for _ in range(reps)]
        row.update(ttft_ms=1e3 * statistics.median(times), ttft_all_ms=[1e3 * t for t in times])
        row.update(prompt_tok_s=length / (row["ttft_ms"] / 1e3), ms_per_chunk=row["ttft_ms"] / row["chunks"])
        if framework == "torch":
            kernels = profiled_kernels(lambda: llm.generate([prompt()], params, use_tqdm=False), device == "cuda")
            row["profile"] = attention_share(kernels, c)
            row["profile"]["kernel_pct_of_ttft"] = 100 * row["profile"]["kernel_ms"] / row["ttft_ms"]
        print(f"  {framework} dense {row['dense_prefill_backend']} sparse {row['sparse_prefill_backend']} {length}: "
              f"TTFT {row['ttft_ms']:.1f} ms, {row['prompt_tok_s']:.0f} tok/s, {row['chunks']} chunks"
              + (f", attention {row['profile']['attention_pct']:.0f}% of kernel time" if "profile" in row else ""),
              flush=True)
        return row
    finally:
        llm.close()


def run_set(framework: str, backend: str, model_dir, lens, reps: int, device: str, c: M3TextConfig) -> dict:
    """Every length of one framework under one prefill backend set (a fresh process on a GPU)
    -> {"rows": [...], "errors": [...]}."""
    if framework == "jax":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(model_step.MEMORY_FRACTION))
    out = dict(rows=[], errors=[])
    with prefill_env(backend):
        for length in lens:
            try:
                out["rows"].append(dict(measure_length(framework, model_dir, length, reps, device, c),
                                        prefill_backends=backend))
            except Exception as e:   # one length failing must not lose the others' numbers
                out["errors"].append(f"{framework} {backend} {length}: {type(e).__name__}: {e}")
                print("  " + out["errors"][-1], flush=True)
            gc.collect()   # here, not in the except clause: its traceback holds the failed engine's frames
            if framework == "torch" and device == "cuda":
                torch.cuda.empty_cache()
    return out


# -- the run -------------------------------------------------------------------------------------

def device_info(device: str) -> dict:
    """Name, memory, copy bandwidth (bytes read + written per second) and bf16 matmul rate (FLOP/s)."""
    info = model_step.device_info(device)
    if device == "cuda":
        from benchmarks.run import matmul_rate

        info["matmul_rate"] = matmul_rate()
    else:
        a = torch.randn(512, 512, dtype=torch.bfloat16)
        t0 = time.perf_counter()
        a @ a
        info["matmul_rate"] = 2 * 512 ** 3 / (time.perf_counter() - t0)
    return info


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--lens", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help=f"prompt lengths (default {','.join(map(str, LENS))}; --tiny {','.join(map(str, TINY_LENS))})")
    ap.add_argument("--frameworks", type=lambda s: s.split(","), default=["torch"], help="torch and/or jax")
    ap.add_argument("--prefill-backends", type=lambda s: s.split(","), default=["triton"],
                    help="triton (M3_DENSE_PREFILL / M3_SPARSE_PREFILL unset) and/or cutedsl (both set)")
    ap.add_argument("--reps", type=int, default=None, help=f"timed requests per length (default {REPS})")
    ap.add_argument("--tiny", action="store_true", help="the tiny test config on the CPU (checks the script)")
    args = ap.parse_args(argv)
    if not set(args.frameworks) <= {"torch", "jax"}:
        ap.error(f"--frameworks: expected torch and/or jax, got {','.join(args.frameworks)}")
    if not set(args.prefill_backends) <= set(PREFILL_BACKENDS):
        ap.error(f"--prefill-backends: expected triton and/or cutedsl, got {','.join(args.prefill_backends)}")
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("benchmarks.ttft: needs a GPU (use --tiny to check the script on the CPU)")
    args.lens = args.lens or list(TINY_LENS if args.tiny else LENS)
    args.reps = args.reps or (TINY_REPS if args.tiny else REPS)
    if min(args.lens) < 1 or args.reps < 1:
        ap.error(f"--lens and --reps: expected positive numbers, got {args.lens} and {args.reps}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    dims = {} if args.tiny else model_step.M3_DIMS   # {}: tiny_text_config's own dimensions
    text = model_step.text_config(dims, LAYERS, max(args.lens))
    c = M3TextConfig.from_dict(text)
    info = in_fresh_process(device_info, device) if device == "cuda" else device_info(device)
    child = in_fresh_process if device == "cuda" else (lambda fn, *a: fn(*a))
    result = dict(date=datetime.date.today().isoformat(), device=info["name"],
                  command="python3 -m benchmarks.ttft " + " ".join(sys.argv[1:] if argv is None else argv),
                  copy_bandwidth_TBps=info["copy_bandwidth"] / 1e12, matmul_TFLOPs=info["matmul_rate"] / 1e12,
                  config=dict(shapes="tiny test config" if args.tiny else "MiniMax-M3", layers=LAYERS, **dims),
                  weights_GB=model_step.weight_bytes(c) / 1e9, rows=[], errors=[])
    name = f"{result['date']}-{model_step.slug(result['device'])}-ttft"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_step.write_config(Path(tmp), text)
        for backend in args.prefill_backends:
            for framework in args.frameworks:
                try:
                    out = child(run_set, framework, backend, model_dir, args.lens, args.reps, device, c)
                except Exception as e:   # a process that died: its numbers are lost, not the other runs'
                    out = dict(rows=[], errors=[f"{framework} {backend}: {type(e).__name__}: {e}"])
                result["rows"] += out["rows"]
                result["errors"] += out["errors"]
                save_results(args.out, name, result, markdown(result))
    return result


# -- markdown ------------------------------------------------------------------------------------

def markdown(r: dict) -> str:
    lines = [f"# Time to first token at MiniMax-M3's layer shapes ({r['device']}, {r['date']})", "",
             f"Command: `{r['command']}`; measured in the same run: copy bandwidth {r['copy_bandwidth_TBps']:.3g} TB/s "
             f"(device copy, bytes read + written), bf16 matmul {r['matmul_TFLOPs']:.3g} TFLOP/s. Model: "
             f"{r['config']['shapes']}, 1 dense + {r['config']['layers'] - 1} MSA/MoE layers, "
             f"{r['weights_GB']:.1f} GB of bf16 weights (load_format=dummy).", "",
             "One prompt of random token ids, `generate` with max_tokens=1, wall clock from the call to the output "
             "(median of the reps, after an untimed request of the same length), the engine's default chunked "
             "prefill (chunk = prompt tokens per step). Attention (torch): the profiled request's attention kernels "
             "(indexer, top-k selection, dense and sparse paged attention, CuTeDSL included) over all its kernels' "
             "GPU time. 60L TP8: EXTRAPOLATION from that profile, (60 x non-attention layer + 3 x dense + 57 x MSA "
             "attention) / 8, ideal split, no all-reduces, kernel time only.", "",
             "| backends | framework | prompt | TTFT ms | prompt tok/s | chunks (tokens) | ms / chunk | kernel ms | "
             "attention ms (%) | dense / indexer / selection / sparse ms | 60L TP8 extrap. ms (attention %) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in r["rows"]:
        p = row.get("profile")
        backends_used = (f"{row['prefill_backends']} (dense {row['dense_prefill_backend']}, sparse "
                         f"{row['sparse_prefill_backend']}, indexer {row['indexer_backend']})")
        profile = ["-", "-", "-", "-"] if p is None else [
            f"{p['kernel_ms']:.1f}", f"{p['attention_ms']:.1f} ({_pct(p['attention_pct'])})",
            " / ".join(f"{p[k + '_ms']:.1f}" for k in SPLIT),
            f"{p['extrap_60l_tp8_ms']:.1f} ({_pct(p['attention_pct_60l'])})"]
        lines.append(f"| {backends_used} | {row['framework']} | {model_step.token_count(row['length'])} | "
                     f"{row['ttft_ms']:.1f} | "
                     f"{row['prompt_tok_s']:.0f} | {row['chunks']} ({row['prefill_chunk']}) | "
                     f"{row['ms_per_chunk']:.2f} | " + " | ".join(profile) + " |")
    profiled = [row for row in r["rows"] if "profile" in row]
    if profiled:
        lines += ["", "Attention kernels counted (names cut at 100 characters):", ""]
        for name in sorted({n for row in profiled for n in row["profile"]["attention_kernels"]}):
            lines.append(f"- `{name}`")
    if r["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in r["errors"]]]
    return "\n".join(lines) + "\n"


def _pct(v) -> str:
    return "-" if v is None else f"{v:.0f}%"


if __name__ == "__main__":
    main()
