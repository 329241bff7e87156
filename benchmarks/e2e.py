"""End-to-end decode of the model engines: `python3 -m benchmarks.e2e [--out DIR] [--quick | --tiny] [--tp N]`.

A random bf16 model with MiniMax-M3's real attention shapes (hidden 6144, 64
query / 4 KV heads of 128, 4 index heads of 128, top-16 blocks, RoPE on 64
channels; layer 0 dense attention + dense MLP, layers 1-3 MSA + a small MoE;
a 32k vocabulary) is written to a temporary directory, then for each
context (4k, 32k, 128k) each engine is built once (``max_model_len`` = the
context, ``max_num_seqs`` 64, a pool for 64 requests of that context) and, for
each batch (1, 8, 32, 64), one decode step with every request at that context
(random block tables of distinct slots, random caches) is timed:

* ``torch_step_us``: ``TorchRunner.execute`` (model + the greedy sampling kernel) + the
  tokens on the host, wall clock (the CUDA-graph replay of the step plus its
  host work: metadata upload, logits gather); the scheduler's own host time
  (~0.3-1 ms per step) is not included, on either side.
* ``torch_graph_us``: the captured step's replay alone (CUDA events).
* ``attention_us``: the attention of the step alone (per layer
  ``write_cache`` + ``msa_attention_step``, one CUDA graph of the 4 layers),
  and ``attention_share = attention_us / torch_graph_us``.
* ``jax_step_us``: the JAX engine's jitted decode step (metadata upload,
  step, sampled tokens on the host), wall clock; ``jax_torch = jax_step_us /
  torch_step_us``.
* tokens/s = batch / step time; time per output token = step time.

The engines run one after the other (torch, then JAX, per context), each in
a fresh process, so that each one's 70 GiB pool at 128k x 64 fits the card
(neither allocator hands its memory back to the other within one process). Torch's pool is filled with
random values; JAX's keeps what ``m3_jax.LLM`` allocates (step times do not
depend on the values: every request reads its top-16 blocks). Writes e2e.json
and e2e.md to --out. ``--tiny`` runs the tiny test model on the CPU (Triton's
interpreter), to check the script, not to measure.

``--tp N``: tensor parallelism, TP=N against TP=1. Batches 8, 32,
64 at a 32k context (``--tiny``: batches 1, 2 at 256 tokens on the CPU, gloo),
torch then JAX for each TP size, each engine built with
``tensor_parallel_size``:

* ``step_us``: wall clock of a decode step (as ``torch_step_us`` /
  ``jax_step_us`` above; torch: rank 0 sends the step to the workers,
  every rank replays its CUDA graph); tok/s = batch / step.
* ``graph_us`` (torch): the captured step alone, replayed on every rank.
* per layer type (torch, on rank 0, each block in its own CUDA graph with its
  all-reduce, every rank replaying alike): ``dense_attention_us`` /
  ``dense_mlp_us`` (layer 0), ``msa_attention_us`` / ``moe_us`` (an MSA + MoE
  layer), and how many layers of each type the step runs;
* ``all_reduce_us``: the step's all-reduces alone (2 per layer, ``[T, hidden]``
  bf16; torch: NCCL in a CUDA graph; JAX: ``psum`` in a jitted ``shard_map``),
  and ``all_reduce_share`` = that / the step (torch: / ``graph_us``);
* ``dense_kernels_us`` / ``msa_kernels_us`` (torch, rank 0): one layer's attention kernels alone
  (``write_cache`` + ``msa_attention_step``, the rank's heads), with ``*_kernels_bytes`` (the byte floor of
  ``benchmarks/run.py``: index-K in full on every rank) and ``*_kernels_pct_floor``.

Writes e2e_tp.json and e2e_tp.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import m3_torch
from m3_kernels.planner import PAGE_SIZE
from m3_engine.runner import SamplingBatch
from m3_engine.step_inputs import Step
from m3_engine import checkpoint
from m3_engine.model_config import M3TextConfig
from m3_engine.tiny_model import tiny_text_config

from benchmarks import e2e_ranks
from benchmarks.e2e_ranks import replay_us, timed, wall_us
from benchmarks.run import copy_bandwidth, save_results

M3_SHAPES = dict(hidden_size=6144, num_attention_heads=64, num_key_value_heads=4, head_dim=128, rotary_dim=64,
                 index_head_dim=128, index_topk_blocks=16, num_hidden_layers=4, num_dense_layers=1,
                 vocab_size=32768, dense_intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2,
                 intermediate_size=256, shared_intermediate_size=256, rope_theta=5e6)
BATCHES, CONTEXTS = (1, 8, 32, 64), (4096, 32768, 131072)
QUICK_BATCHES, QUICK_CONTEXTS = (1, 64), (4096, 32768)
TINY_BATCHES, TINY_CONTEXTS = (1, 2), (256, 384)
TP_BATCHES, TP_CONTEXT, TINY_TP_CONTEXT = (8, 32, 64), 32768, 256


def write_model(path: Path, shapes: dict, max_context: int) -> Path:
    """A random bf16 checkpoint (config.json + model.safetensors, transformers' text-model names) of
    ``tiny_text_config(**shapes)``: the tiny model's layout and init scales, drawn with torch (the
    numpy writer of ``m3_engine.tiny_model`` takes ~1 min at these sizes)."""
    from safetensors.torch import save_file

    text = tiny_text_config(dtype="bfloat16", **shapes)
    text["max_position_embeddings"] = max(text["max_position_embeddings"], max_context)
    config = M3TextConfig.from_dict(text)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in checkpoint.expected_shapes(config).items():
        w = torch.randn(shape, generator=g)
        if name.endswith(("norm.weight", "e_score_correction_bias")):
            w *= 0.1                     # norms scale by 1 + weight
        elif name != "model.embed_tokens.weight":
            w /= shape[-1] ** 0.5        # linear layers: N(0, 1 / fan_in)
        tensors[name] = w.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(text, indent=2))
    return path


def decode_step(planner, max_blocks: int, batch: int, context: int, seed: int) -> Step:
    """One pure decode step: ``batch`` requests at ``context`` tokens (the new one included),
    each on its own random slots, padded to the planner's graph batch size."""
    rng = np.random.default_rng(seed)
    blocks = -(-context // PAGE_SIZE)
    plan = planner.plan([context] * batch, q_lens=[1] * batch, num_context=0)
    rows = plan.num_rows
    table = np.full((rows, max_blocks), -1, np.int32)
    table[:batch, :blocks] = rng.permutation(batch * blocks).reshape(batch, blocks)
    pos = context - 1
    slot_mapping = np.full(rows, -1, np.int32)
    slot_mapping[:batch] = table[:batch, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
    seq_lens = np.zeros(rows, np.int32)
    seq_lens[:batch] = context
    positions = np.zeros(rows, np.int32)
    positions[:batch] = pos
    input_ids = np.zeros(rows, np.int32)
    input_ids[:batch] = rng.integers(3, 512, batch)
    return Step(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, block_table=table,
                seq_lens=seq_lens, cu_seqlens_q=np.arange(rows + 1, dtype=np.int32),
                logits_indices=np.arange(batch, dtype=np.int32), request_ids=np.arange(batch, dtype=np.int32),
                output_index=np.zeros(batch, np.int32), plan=plan)


def attention_us(llm, step: Step, reps: int) -> float:
    """The step's attention alone: every layer's write_cache + msa_attention_step, random q/k/v."""
    layers = range(llm.config.num_hidden_layers)
    return timed(e2e_ranks.attention_call(llm.runner.rank0, step, layers), reps, llm.runner.device)


def run_torch(model_dir, context, batches, reps, device) -> dict:
    blocks = -(-context // PAGE_SIZE)
    llm = m3_torch.LLM(model_dir, precompile=False,
                       dtype="bfloat16", device=device, max_num_seqs=max(batches), max_model_len=context,
                       num_gpu_blocks_override=max(batches) * blocks)
    llm.runner.pool.normal_(generator=torch.Generator(device=llm.runner.device).manual_seed(0))
    out = {}
    for batch in batches:
        step = decode_step(llm.planner, llm.scheduler_config.max_blocks, batch, context, seed=batch)
        greedy = SamplingBatch.greedy(len(step.logits_indices))
        row = dict(torch_step_us=wall_us(lambda: llm.runner.execute(step, greedy), reps))
        if llm.runner.graphs is not None:
            graph, _ = llm.runner.graphs.graphs[(step.plan.num_rows, 1, step.plan.generation.max_blocks)]
            row["torch_graph_us"] = replay_us(graph, reps)
        row["attention_us"] = attention_us(llm, step, reps)
        row["attention_share"] = row["attention_us"] / row.get("torch_graph_us", row["torch_step_us"])
        out[batch] = row
        print(f"  torch batch {batch:3d} context {context:6d}: " +
              " ".join(f"{k}={v:.3g}" for k, v in row.items()), flush=True)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def run_jax(model_dir, context, batches, reps, device, launch="legacy") -> dict:
    import jax
    import m3_jax
    from m3_jax import _triton_call

    _triton_call.LAUNCH_TARGET = _triton_call.LAUNCH_TARGETS[launch]   # this process's kernels' custom call

    blocks = -(-context // PAGE_SIZE)
    llm = m3_jax.LLM(model_dir, precompile=False,
                     dtype="bfloat16", device=device, max_num_seqs=max(batches), max_model_len=context,
                     num_gpu_blocks_override=max(batches) * blocks)
    planner = llm.planner   # the engine's graph batch sizes
    out = {}
    with jax.default_device(llm.runner.device):   # the kernels trace their GPU or CPU path from it
        for batch in batches:
            step = decode_step(planner, llm.scheduler_config.max_blocks, batch, context, seed=batch)
            greedy = SamplingBatch.greedy(len(step.logits_indices))
            t0 = time.perf_counter()
            llm.runner.execute(step, greedy)   # compiles for this batch
            compile_s = time.perf_counter() - t0
            out[batch] = dict(jax_step_us=wall_us(lambda: llm.runner.execute(step, greedy), reps),
                              jax_first_step_s=compile_s)
            print(f"  jax   batch {batch:3d} context {context:6d}: " +
                  " ".join(f"{k}={v:.3g}" for k, v in out[batch].items()), flush=True)
    del llm
    gc.collect()
    return out


def in_fresh_process(fn, *args):
    """``fn(*args)`` in a spawned process (its GPU memory is gone when it returns)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def run_frameworks(frameworks: str, fn, model_dir: str, args: dict, result: dict, out, name: str, markdown) -> dict:
    """For each of the comma-separated ``frameworks``: ``result["results"][framework] = fn(framework,
    model_dir, args)`` in a fresh process (:func:`in_fresh_process`), then ``result`` saved as ``out/name``
    with its ``markdown(result)`` (``benchmarks.run.save_results``): a run cut short keeps what it measured.
    -> ``result``."""
    for framework in frameworks.split(","):
        result["results"][framework] = in_fresh_process(fn, framework, model_dir, args)
        save_results(out, name, result, markdown(result))
    return result


# -- tensor parallelism (--tp) ---------------------------------------------------------------------

def run_torch_tp(model_dir, tp: int, context: int, batches, reps: int, device) -> dict:
    """-> {batch: row} for the torch engine at ``tensor_parallel_size=tp`` (see the module docstring)."""

    blocks = -(-context // PAGE_SIZE)
    out = {}
    with m3_torch.LLM(model_dir, precompile=False,
                      dtype="bfloat16", device=device, max_num_seqs=max(batches), max_model_len=context,
                      num_gpu_blocks_override=max(batches) * blocks, tensor_parallel_size=tp) as llm:
        llm.runner.collective_rpc(e2e_ranks.fill_pool)
        for batch in batches:
            step = decode_step(llm.planner, llm.scheduler_config.max_blocks, batch, context, seed=batch)
            greedy = SamplingBatch.greedy(len(step.logits_indices))
            row = dict(step_us=wall_us(lambda: llm.runner.execute(step, greedy), reps))
            graph = llm.runner.collective_rpc(e2e_ranks.graph_replay_us, (step.plan.num_rows, 1,
                                                                   step.plan.generation.max_blocks), reps)[0]
            if graph is not None:
                row["graph_us"] = graph
            row.update(llm.runner.collective_rpc(e2e_ranks.layer_times, step, reps)[0])
            row["all_reduce_share"] = row["all_reduce_us"] / row.get("graph_us", row["step_us"])
            out[batch] = row
            print(f"  torch tp {tp} batch {batch:3d} context {context:6d}: " +
                  " ".join(f"{k}={v:.3g}" for k, v in row.items()), flush=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def run_jax_tp(model_dir, tp: int, context: int, batches, reps: int, device) -> dict:
    """-> {batch: row} for the JAX engine at ``tensor_parallel_size=tp``: the jitted decode step, and the
    step's psums alone."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import m3_jax

    blocks = -(-context // PAGE_SIZE)
    platform = "gpu" if device == "cuda" else "cpu"
    llm = m3_jax.LLM(model_dir, precompile=False,
                     dtype="bfloat16", device=platform if tp > 1 else jax.devices(platform)[0],
                     max_num_seqs=max(batches), max_model_len=context, num_gpu_blocks_override=max(batches) * blocks,
                     tensor_parallel_size=tp)
    c = llm.config
    out = {}
    with jax.default_device(llm.runner.device):   # the kernels trace their GPU or CPU path from it
        for batch in batches:
            step = decode_step(llm.planner, llm.scheduler_config.max_blocks, batch, context, seed=batch)
            greedy = SamplingBatch.greedy(len(step.logits_indices))
            t0 = time.perf_counter()
            llm.runner.execute(step, greedy)   # compiles for this batch
            row = dict(first_step_s=time.perf_counter() - t0,
                       step_us=wall_us(lambda: llm.runner.execute(step, greedy), reps))
            if llm.runner.mesh is not None:
                def reduces(x):
                    for _ in range(2 * c.num_hidden_layers):
                        x = jax.lax.psum(x, "tp") * 0.5
                    return x
                fn = jax.jit(jax.shard_map(reduces, mesh=llm.runner.mesh, in_specs=P("tp"), out_specs=P()))
                x = jax.device_put(jnp.ones((tp * step.plan.num_tokens, c.hidden_size), jnp.bfloat16),
                                   jax.sharding.NamedSharding(llm.runner.mesh, P("tp")))
                row["all_reduce_us"] = wall_us(lambda: fn(x).block_until_ready(), reps)
            else:
                row["all_reduce_us"] = 0.0
            row["all_reduce_share"] = row["all_reduce_us"] / row["step_us"]
            out[batch] = row
            print(f"  jax   tp {tp} batch {batch:3d} context {context:6d}: " +
                  " ".join(f"{k}={v:.3g}" for k, v in row.items()), flush=True)
    llm.close()
    del llm
    gc.collect()
    return out


# -- results as markdown ---------------------------------------------------------------------------

def _num(v, fmt=None) -> str:
    if v is None:
        return "-"
    return (fmt or ("{:.0f}" if abs(v) >= 100 else "{:.3g}")).format(v)


def _context(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 else str(tokens)


def _header(title: str, result: dict) -> list:
    return [f"# {title} ({result['device']})", "",
            f"Command: `{result['command']}`; device-to-device copy bandwidth in the same run: "
            f"{result['copy_bandwidth_TBps'] or float('nan'):.2f} TB/s.", "",
            f"Model: {result['shapes']}", ""]


def _document(lines: list, result: dict) -> str:
    if result.get("errors"):
        lines += ["", "Errors:", *[f"- {e}" for e in result["errors"]]]
    return "\n".join(lines) + "\n"


def markdown_tp(result: dict) -> str:
    tp = result["tp"]
    lines = [*_header(f"End-to-end decode, tensor parallel {tp} vs 1, M3 attention shapes", result),
             "Microseconds per decode step (time per output token); tok/s = batch / step; speedup = TP=1 step / "
             "this step. Per layer type: one block with its all-reduce (torch, rank 0). All-reduce: the step's "
             "2 per layer alone, and its share of the step. Kernels: one layer's write_cache + "
             "msa_attention_step alone on rank 0 (its heads), with its share of its byte floor (bytes / copy "
             "bandwidth; the MSA layer reads all of index-K on every rank).", "",
             "| framework | tp | batch | context | step | tok/s | speedup | graph | dense attn | dense MLP | "
             "MSA attn | MoE | all-reduce | AR share | dense kernels (floor) | MSA kernels (floor) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    for r in result["rows"]:
        context = _context(r["context"])
        cells = [_num(r.get(k), fmt) for k, fmt in (
            ("step_us", None), ("tok_s", None), ("speedup", "{:.2f}x"), ("graph_us", None),
            ("dense_attention_us", None), ("dense_mlp_us", None), ("msa_attention_us", None), ("moe_us", None),
            ("all_reduce_us", None), ("all_reduce_share", "{:.0%}"))]
        cells += [f"{_num(r[f'{kind}_kernels_us'])} ({_num(r.get(f'{kind}_kernels_pct_floor'), '{:.0%}')})"
                  if f"{kind}_kernels_us" in r else "-" for kind in ("dense", "msa")]
        lines.append(f"| {r['framework']} | {r['tp']} | {r['batch']} | {context} | " + " | ".join(cells) + " |")
    return _document(lines, result)


def main_tp(args, frameworks) -> dict:
    """``--tp N``: TP=1 and TP=N, torch and JAX, batches 8/32/64 at 32k (see the module docstring)."""
    tp = args.tp
    if args.tiny:
        shapes, batches, context, device, reps = {}, TINY_BATCHES, TINY_TP_CONTEXT, "cpu", args.reps or 2
    else:
        if torch.cuda.device_count() < tp:
            sys.exit(f"benchmarks.e2e --tp {tp}: needs {tp} GPUs, found {torch.cuda.device_count()} "
                     f"(use --tiny to check the script on the CPU)")
        shapes, batches, context, device, reps = M3_SHAPES, TP_BATCHES, TP_CONTEXT, "cuda", args.reps or 20
    rows, errors = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(args.model_dir or tmp), shapes, context)
        for size in (1, tp):
            for name, run in (("torch", run_torch_tp), ("jax", run_jax_tp)):
                if name not in frameworks:
                    continue
                try:
                    for batch, row in run(model_dir, size, context, batches, reps, device).items():
                        rows.append(dict(framework=name, tp=size, batch=batch, context=context, **row))
                except Exception as e:  # one engine failing must not lose the others' numbers
                    errors.append(f"{name} tp {size}: {type(e).__name__}: {e}")
                    print("  " + errors[-1], flush=True)
    bw = copy_bandwidth() if device == "cuda" else None
    base = {(r["framework"], r["batch"]): r["step_us"] for r in rows if r["tp"] == 1}
    for r in rows:
        r["tok_s"] = r["batch"] / (r["step_us"] * 1e-6)
        if (r["framework"], r["batch"]) in base:
            r["speedup"] = base[r["framework"], r["batch"]] / r["step_us"]
        for kind in ("dense", "msa"):
            if bw and f"{kind}_kernels_us" in r:
                r[f"{kind}_kernels_pct_floor"] = r[f"{kind}_kernels_bytes"] / bw * 1e6 / r[f"{kind}_kernels_us"]
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter, gloo)",
                  copy_bandwidth_TBps=bw / 1e12 if bw else None,
                  command="python3 -m benchmarks.e2e " + " ".join(sys.argv[1:]),
                  tp=tp, shapes=shapes or "tiny test model", rows=rows, errors=errors)
    save_results(args.out, "e2e_tp", result, markdown_tp(result))
    return result


def markdown(result: dict) -> str:
    lines = [*_header("End-to-end decode, M3 attention shapes", result),
             "Step times in microseconds (time per output token); tokens/s = batch / step.", "",
             "| batch | context | torch step | torch tok/s | graph replay | attention | attn share | "
             "JAX step | JAX tok/s | JAX/torch |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    for r in result["rows"]:
        context = _context(r["context"])
        cells = [_num(r.get(k), fmt) for k, fmt in (
            ("torch_step_us", None), ("torch_tok_s", None), ("torch_graph_us", None), ("attention_us", None),
            ("attention_share", "{:.0%}"), ("jax_step_us", None), ("jax_tok_s", None), ("jax_torch", "{:.2f}"))]
        lines.append(f"| {r['batch']} | {context} | " + " | ".join(cells) + " |")
    return _document(lines, result)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/latest"))
    ap.add_argument("--quick", action="store_true", help=f"batches {QUICK_BATCHES}, contexts {QUICK_CONTEXTS}")
    ap.add_argument("--tiny", action="store_true", help="the tiny test model on the CPU (checks the script)")
    ap.add_argument("--frameworks", default="torch,jax")
    ap.add_argument("--jax-launch", choices=("legacy", "ffi"), default="legacy",
                    help="the JAX kernels' custom call: legacy (jax-triton 0.3.1's triton_kernel_call) or ffi "
                         "(triton_kernel_call_ffi, recorded into XLA's command buffers)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--model-dir", default=None, help="where to write the random model (default: a temp dir)")
    ap.add_argument("--tp", type=int, default=None, metavar="N",
                    help="tensor parallelism: TP=N vs TP=1, batches 8/32/64 at 32k (writes e2e_tp.*)")
    args = ap.parse_args(argv)
    frameworks = args.frameworks.split(",")
    if args.tp is not None:
        if args.tp < 2:
            ap.error(f"--tp: expected an int >= 2, got {args.tp}")
        return main_tp(args, frameworks)
    if args.tiny:
        shapes, batches, contexts, device, reps = {}, TINY_BATCHES, TINY_CONTEXTS, "cpu", args.reps or 2
    else:
        if not torch.cuda.is_available():
            sys.exit("benchmarks.e2e: needs a GPU (use --tiny to check the script on the CPU)")
        quick = args.quick
        shapes, device, reps = M3_SHAPES, "cuda", args.reps or 20
        batches, contexts = (QUICK_BATCHES, QUICK_CONTEXTS) if quick else (BATCHES, CONTEXTS)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(args.model_dir or tmp), shapes, max(contexts))
        rows = {(b, c): dict(batch=b, context=c) for c in contexts for b in batches}
        errors = []
        for context in contexts:
            for name, run in (("torch", run_torch), ("jax", run_jax)):
                if name not in frameworks:
                    continue
                extra = (args.jax_launch,) if name == "jax" else ()
                try:
                    for batch, row in in_fresh_process(run, model_dir, context, batches, reps, device,
                                                       *extra).items():
                        rows[batch, context].update(row)
                except Exception as e:  # one engine failing must not lose the other's numbers
                    errors.append(f"{name} context {context}: {type(e).__name__}: {e}")
                    print("  " + errors[-1], flush=True)
    for r in rows.values():
        for name in ("torch", "jax"):
            if f"{name}_step_us" in r:
                r[f"{name}_tok_s"] = r["batch"] / (r[f"{name}_step_us"] * 1e-6)
        if "torch_step_us" in r and "jax_step_us" in r:
            r["jax_torch"] = r["jax_step_us"] / r["torch_step_us"]
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
                  copy_bandwidth_TBps=in_fresh_process(copy_bandwidth) / 1e12 if device == "cuda" else None,
                  command="python3 -m benchmarks.e2e " + " ".join(argv if argv is not None else sys.argv[1:]),
                  jax_launch=args.jax_launch,
                  shapes=shapes or "tiny test model", rows=list(rows.values()), errors=errors)
    save_results(args.out, "e2e", result, markdown(result))
    return result


if __name__ == "__main__":
    main()
