"""The model's decode step at MiniMax-M3's real layer shapes: ``python3 -m benchmarks.model_step``.

Where the step stands against its byte floor, at the per-layer dimensions of
MiniMax-M3 (``m3_engine.model_config.DEFAULTS``, transformers' config of the
full model, with ``rotary_dim`` 64): hidden 6144, 64 query / 4 KV heads of
128, RoPE on 64 channels, 4 index heads of 128 and one index-K head, top-16
blocks of 128; MoE of 128 experts (top 4, intermediate 3072, SwiGLU-OAI,
sigmoid router with correction bias, routed scaling 2) plus one shared expert
of 3072; a dense MLP of 12288 on dense layers; vocabulary 200064; bf16.
Layers: ``--layers`` (4): layer 0 dense attention + dense MLP, the others MSA
+ MoE; 4 layers are ~50 GB of weights. The model folder holds ``config.json``
only: both engines are built with ``load_format="dummy"`` (random weights
drawn on the GPU in seconds, ``m3_engine.dummy_weights``).

Each framework runs in a fresh process of its own (torch: CUDA graphs; JAX:
jitted steps), which builds one engine per context (``--contexts``, 4k / 32k
/ 128k) in turn, with a pool for the largest batch of ``--batches`` (1 / 8 /
32 / 64 / 128) whose KV fits beside the weights in 95% of the GPU less 12 GiB
of headroom (128 requests of 128k need 150 GB of KV and do not fit one H200:
those rows are marked skipped, with the bytes they would need). The pool is
filled with random K/V/index-K directly (no prefill); every request of a step
is at the context, on its own random pages (``benchmarks.e2e.decode_step``).
Per batch:

* ``torch_step_us``: the engine's captured decode graph (embedding to logits;
  sampling excluded), median of ``--reps`` replays timed by CUDA events.
  ``torch_kernels``: kernels in one replay (torch.profiler's CUDA kernel events;
  memcpy/memset nodes not counted). ``torch_dense_layer_*`` /
  ``torch_msa_layer_*``: one layer of each type (norm, attention, residual,
  norm, MLP, residual: ``M3Model.hidden_states``' loop body) in a CUDA graph of
  its own: time and kernels per layer. ``torch_rest_us``: the step minus its
  layers (embedding, final norm, lm_head).
* ``jax_step_us``: the engine's two jitted programs of a step (the forward,
  then greedy sampling of its logits) compiled ahead of time and called with
  device-resident inputs, median of ``--reps`` blocking steps;
  ``jax_pipelined_us``: ``--reps`` steps back to back / reps.
  ``jax_launches``: static launch sites in the two programs' optimized HLO
  (fusions, custom calls = Triton kernels and cuBLAS GEMMs, copies, sorts, ...;
  a while body counted once), not a profile; per layer = launches / layers,
  embedding, head and sampling included.
* ``floor_us``: the bytes the step must move over the copy bandwidth measured
  in the same run (2 GiB device copy, bytes read + written): every weight the
  step reads (attention projections and norms, the shared expert, the router,
  the dense MLP, lm_head, the embedding rows of its tokens) plus, per MoE layer,
  the experts the batch touches: the router's real choices on the step
  (``experts_touched``, from one eager torch step; without a torch run the
  EXPECTED number for uniform random routing ``E (1 - (1 - k/E)^T)``, 111 of
  128 at 64 tokens, also recorded as ``experts_expected``: the random-weight
  router concentrates on fewer); plus attention's KV bytes: dense layers every visible K/V row, MSA
  layers all of index-K, the index queries and each request's top-16 blocks of
  K and V per KV head; plus the new K/V/index-K rows, q and o, and the logits.
  Other activations are not counted. ``*_pct_floor`` = floor / time.
* ``extrap_60l_tp8_us`` (EXTRAPOLATION, not measured): the full model's decode
  step on 8 GPUs from the torch layer times above: ``(3 x dense layer + 57 x
  MSA layer + rest) / 8``, i.e. M3's 60 layers (SPEC.md: layers 0-2 dense
  attention; assumed with dense MLPs too, the rest MSA + MoE) split ideally 8
  ways (tensor parallelism dividing every layer's time by 8; the two
  all-reduces per layer, the index-K every rank reads in full and the KV head
  each pair of ranks shares are not counted: a lower bound). It is the time
  per output token at that batch. ``floor_60l_tp8_us``: the 60-layer byte
  floor / 8 under the same assumption.

Pieces (torch, CUDA graphs, tokens ``--piece-tokens`` 1 / 8 / 64 / 128, on the
engine of ``--piece-context``, 32k, or of the first context when that is not
one of ``--contexts``): the MSA layer's q/k/v/index projections
(one fused GEMM) + ``qk_norm_rope`` (norms, RoPE, the cache rows written), its
attention (write_cache + msa_attention_step on random q/k/v), the dense layer's
attention, o_proj, the MoE (router kernel, fused experts with the shared one;
floor with the distinct experts its router chose on the piece's random input), the dense MLP, and the final norm + lm_head: time,
kernels, floor (weights + the piece's inputs and outputs) and share.

FP8 weights (``--quantization none,fp8``): every run above once per weight
format, each in a process of its own, the engines built with
``quantization="fp8"`` (the linear weights as e4m3 codes with 128 x 128 block
scales, quantized as they are drawn; ``m3_engine.quantization``). The floor
counts those weights at 1 byte plus their scales; ``fp8_speedups``: the bf16
time over the FP8 time per batch and context (torch, JAX, the 60-layer
extrapolation) and each format's JAX / torch ratio. ``full_model_memory``
(ARITHMETIC): M3's 60 layers at these dimensions in bf16 and FP8 on 4 and 8
GPUs of this kind: weights per GPU split ideally, and the KV room 90% of the
GPU leaves.

Writes ``<date>-<gpu>-model-step.{json,md}`` to ``--out`` (default
benchmarks/results/) with the command, the GPU, the copy bandwidth and every
number above. ``--tiny``: the same code on the tiny test config on the CPU
(Triton's interpreter, no CUDA graphs: wall-clock times, no kernel counts, a
CPU copy for the bandwidth), to check the script, not to measure.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from m3_engine.checkpoint import expected_shapes
from m3_engine.model_config import DEFAULTS, M3TextConfig
from m3_engine.quantization import is_quantized
from m3_engine.runner import SamplingBatch
from m3_engine.tiny_model import tiny_fp8_config, tiny_text_config
from m3_kernels.maps import FP8_BLOCK
from m3_kernels.planner import PAGE_SIZE
from m3_kernels.pool import PoolLayout

from benchmarks.e2e import decode_step, in_fresh_process
from benchmarks.e2e_ranks import attention_call, replay_us
from benchmarks.run import save_results

M3_DIMS = dict({k: DEFAULTS[k] for k in (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
    "index_head_dim", "index_topk_blocks", "index_local_blocks", "num_local_experts", "num_experts_per_tok",
    "intermediate_size", "shared_intermediate_size", "dense_intermediate_size")}, rotary_dim=64)
BATCHES, CONTEXTS, PIECE_TOKENS, PIECE_CONTEXT = (1, 8, 32, 64, 128), (4096, 32768, 131072), (1, 8, 64, 128), 32768
TINY_BATCHES, TINY_CONTEXTS, TINY_PIECE_TOKENS = (1, 2), (256,), (1, 2)
FULL_LAYERS, FULL_DENSE_LAYERS, FULL_TP = 60, 3, 8        # the extrapolation's model and GPUs
MEMORY_FRACTION = 0.95            # of the GPU, for weights + pool + HEADROOM (JAX's allocator limit is set to it)
HEADROOM = 12 << 30               # CUDA/XLA context, graphs, workspaces, activations, allocator slack


# -- the model -----------------------------------------------------------------------------------

def text_config(dims: dict, layers: int, max_context: int) -> dict:
    """config.json (flat legacy form of ``tiny_text_config``): layer 0 dense attention + dense MLP, the
    others MSA + MoE, bf16."""
    text = tiny_text_config(num_hidden_layers=layers, num_dense_layers=1, dtype="bfloat16", **dims)
    text["max_position_embeddings"] = max(DEFAULTS["max_position_embeddings"], max_context)
    return text


def write_config(path: Path, text: dict) -> Path:
    """A model folder holding config.json only: what ``load_format="dummy"`` needs."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(text, indent=2))
    return path


def weight_elt(quantization) -> float:
    """Bytes per element of a quantized linear weight (``m3_engine.quantization.is_quantized``): bf16, or
    e4m3 plus one float32 scale per 128 x 128 block."""
    return 2.0 if quantization is None else 1.0 + 4.0 / (FP8_BLOCK * FP8_BLOCK)


def weight_bytes(c: M3TextConfig, quantization=None) -> float:
    """The checkpoint's bytes as the engine holds them (``quantization``: None or "fp8")."""
    return sum(math.prod(shape) * (weight_elt(quantization) if is_quantized(name) else 2)
               for name, shape in expected_shapes(c).items())


def kv_bytes_per_request(c: M3TextConfig, context: int) -> int:
    """Pool bytes of one request at ``context`` tokens (every layer's K, V and index-K pages)."""
    layout = PoolLayout.create(1, sparse=c.sparse_layers, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                               index_head_dim=c.index_head_dim, dtype="bfloat16")
    return -(-context // PAGE_SIZE) * layout.slot_nbytes


def plan_grid(c: M3TextConfig, batches, contexts, memory: int | None) -> tuple[dict, dict]:
    """-> ({context: batches that fit}, {(batch, context): why skipped}); ``memory``: the GPU's bytes
    (None: everything fits). Planned for bf16 weights (FP8 ones take less)."""
    runs, skipped = {}, {}
    budget = None if memory is None else MEMORY_FRACTION * memory - weight_bytes(c) - HEADROOM
    for context in contexts:
        runs[context] = []
        for batch in batches:
            need = batch * kv_bytes_per_request(c, context)
            if budget is None or need <= budget:
                runs[context].append(batch)
            else:
                skipped[batch, context] = (f"skipped: the KV pool of {batch} x {token_count(context)} needs "
                                           f"{need / 1e9:.1f} GB, {max(budget, 0) / 1e9:.1f} GB fit beside "
                                           f"{weight_bytes(c) / 1e9:.1f} GB of weights")
    return runs, skipped


# -- byte floors -------------------------------------------------------------------------------

def expected_experts(tokens: int, experts: int, k: int) -> float:
    """Distinct experts ``tokens`` tokens touch when each picks ``k`` of ``experts`` uniformly at random."""
    return experts * (1 - (1 - k / experts) ** tokens)


def projection_weight_bytes(c: M3TextConfig, sparse: bool, wb: float = 2.0) -> float:
    """The fused q/k/v (+ index q/k) projection and the q/k (+ index) norms of a layer; ``wb``: bytes per
    element of the quantized weights (:func:`weight_elt`)."""
    H, D, Di = c.hidden_size, c.head_dim, c.index_head_dim
    rows = (c.num_attention_heads + 2 * c.num_key_value_heads) * D + (c.index_n_heads * Di + Di if sparse else 0)
    return wb * rows * H + 2 * (2 * D + (2 * Di if sparse else 0))


def attention_weight_bytes(c: M3TextConfig, sparse: bool, wb: float = 2.0) -> float:
    """The projections, their norms and o_proj."""
    return projection_weight_bytes(c, sparse, wb) + wb * c.hidden_size * c.num_attention_heads * c.head_dim


def mlp_weight_bytes(c: M3TextConfig, moe: bool, experts: float, wb: float = 2.0) -> float:
    """The dense MLP, or the MoE's router (bf16), shared expert and the ``experts`` it touches."""
    H = c.hidden_size
    if not moe:
        return wb * 3 * c.dense_intermediate_size * H
    E = c.num_local_experts
    return 2 * (E * H + E) + wb * (3 * c.shared_intermediate_size * H + experts * 3 * c.intermediate_size * H)


def kv_bytes(c: M3TextConfig, tokens: int, context: int, sparse: bool) -> int:
    """Attention's cache and q/o bytes for ``tokens`` decode requests at ``context`` (benchmarks/run.py's
    floor): dense every visible K/V row; MSA all of index-K, the index queries and each request's top-k
    blocks of K and V per KV head; plus the new rows written, q and o."""
    row = 2 * 2 * c.num_key_value_heads * c.head_dim                     # K and V of one token, bf16
    index_row = 2 * c.index_head_dim
    io = tokens * (2 * 2 * c.num_attention_heads * c.head_dim + row + (index_row if sparse else 0))
    if not sparse:
        return tokens * context * row + io
    chosen = min(c.index_topk_blocks, -(-context // PAGE_SIZE))
    return tokens * (context * index_row + c.index_n_heads * index_row + chosen * PAGE_SIZE * row) + io


def layer_bytes(c: M3TextConfig, sparse: bool, moe: bool, tokens: int, context: int,
                experts: float | None = None, wb: float = 2.0) -> float:
    """``experts``: the distinct experts the layer's router chose (None: the uniform-routing expectation)."""
    if experts is None:
        experts = expected_experts(tokens, c.num_local_experts, c.num_experts_per_tok)
    return (attention_weight_bytes(c, sparse, wb) + 2 * 2 * c.hidden_size + mlp_weight_bytes(c, moe, experts, wb)
            + kv_bytes(c, tokens, context, sparse))


def head_bytes(c: M3TextConfig, tokens: int) -> int:
    """Embedding rows, final norm, lm_head and the logits."""
    H, V = c.hidden_size, c.vocab_size
    return 2 * (tokens * H + H + V * H + tokens * V)


def step_floor_bytes(c: M3TextConfig, tokens: int, context: int, experts_touched=None, quantization=None) -> float:
    """``experts_touched``: the distinct experts of each MoE layer in order (None: the expectation)."""
    touched, wb = iter(experts_touched or []), weight_elt(quantization)
    return head_bytes(c, tokens) + sum(layer_bytes(c, s, m, tokens, context, next(touched, None) if m else None, wb)
                                       for s, m in zip(c.sparse_layers, c.moe_layers))


def full_model_floor_bytes(c: M3TextConfig, tokens: int, context: int, quantization=None) -> float:
    """The byte floor of M3's 60 layers (3 dense + 57 MSA + MoE) at these dimensions, on one device."""
    wb = weight_elt(quantization)
    return (head_bytes(c, tokens) + FULL_DENSE_LAYERS * layer_bytes(c, False, False, tokens, context, wb=wb)
            + (FULL_LAYERS - FULL_DENSE_LAYERS) * layer_bytes(c, True, True, tokens, context, wb=wb))


def full_model_memory(dims: dict, quantization, tp: int, gpu_bytes: float) -> dict:
    """M3's 60 layers (3 dense + 57 MSA + MoE) at these dimensions: weight bytes per GPU split ideally
    ``tp`` ways (tensor parallelism for attention and the dense MLP, the experts spread over the GPUs),
    and what ``gpu_bytes`` x 0.9 (``gpu_memory_utilization``) leaves for KV, in tokens of context: a
    GPU holds its share of the KV heads (``min(tp, KV heads)`` ways; ranks beyond share a head) and the
    whole index-K (one head, on every rank), bf16."""
    text = tiny_text_config(num_hidden_layers=FULL_LAYERS, num_dense_layers=FULL_DENSE_LAYERS, dtype="bfloat16",
                            **dims)
    c = M3TextConfig.from_dict(text)
    per_gpu = weight_bytes(c, quantization) / tp
    free = 0.9 * gpu_bytes - per_gpu
    kv_per_token = 2 * 2 * c.num_key_value_heads * c.head_dim * c.num_hidden_layers / min(tp, c.num_key_value_heads)
    index_per_token = 2 * c.index_head_dim * sum(c.sparse_layers)
    return dict(quantization=quantization or "bf16", tp=tp, params_B=weight_bytes(c, None) / 2e9,
                weights_per_gpu_GB=per_gpu / 1e9, kv_room_per_gpu_GB=free / 1e9,
                kv_tokens=max(free, 0) / (kv_per_token + index_per_token))


# -- torch -----------------------------------------------------------------------------------------

def measure(fn, device: torch.device, reps: int) -> tuple[float, int | None]:
    """-> (microseconds, kernels) of ``fn``: on a GPU its CUDA graph (captured after one eager call, which
    also compiles the kernels and sets up workspaces), median of ``reps`` replays, and the kernels of one
    replay; on a CPU the eager wall clock and no count."""
    if device.type != "cuda":
        return wall_us(fn, reps), None
    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):   # as the engine (m3_torch.rank)
        fn()
    return replay_us(graph, reps), graph_kernels(graph)


def graph_kernels(graph) -> int:
    """Kernels in one replay of ``graph``: torch.profiler's CUDA kernel events (memcpy / memset nodes not
    counted)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset")))


def routed_experts(model, fn) -> list:
    """Distinct experts each MoE layer's router chose during one eager ``fn()`` (the model's own routing)."""
    seen, original = [], model._route

    def record(layer, h):
        chosen, top_w = original(layer, h)
        seen.append(int(chosen.unique().numel()))
        return chosen, top_w

    model._route = record
    try:
        fn()
    finally:
        del model._route
    return seen


def layer_call(runner, i: int, step, x):
    """Layer ``i`` of the step alone (``M3Model.hidden_states``' loop body) on hidden states ``x``."""
    from m3_torch import fused

    model, eps = runner.model, runner.model.config.rms_norm_eps
    layer, tensors = model.layers[i], runner.step_tensors(step)

    def run():
        h = fused.rms_norm(x, layer.input_norm, eps)
        y, h = fused.add_rms_norm(model._attention(layer, h, tensors, step.plan, runner.caches[i]), x,
                                  layer.post_attn_norm, eps)
        return y + model._mlp(layer, h)
    return run


def torch_step(llm, step, reps: int) -> dict:
    """The engine's decode step (its CUDA graph on a GPU) and one layer of each type."""
    runner, device = llm.runner.rank0, llm.runner.device
    model, c = runner.model, runner.model.config
    greedy = SamplingBatch.greedy(len(step.logits_indices))
    tensors = runner.step_tensors(step)
    row = dict(experts_touched=routed_experts(model, lambda: model.forward(tensors, step.plan, runner.caches)))
    if runner.graphs is not None:
        known = set(runner.graphs.graphs)
        llm.runner.execute(step, greedy)   # an eager warm-up, then the capture
        [key] = set(runner.graphs.graphs) - known
        graph = runner.graphs.graphs[key][0]
        row.update(torch_step_us=replay_us(graph, reps), torch_kernels=graph_kernels(graph))
    else:
        row.update(torch_step_us=wall_us(lambda: llm.runner.execute(step, greedy), reps), torch_kernels=None)
    x = torch.randn(step.plan.num_tokens, c.hidden_size, generator=torch.Generator(device).manual_seed(0),
                    device=device).to(model.dtype)
    layers = 0.0
    for kind, sparse in (("dense", False), ("msa", True)):
        i = c.sparse_layers.index(sparse)
        us, kernels = measure(layer_call(runner, i, step, x), device, reps)
        row.update({f"torch_{kind}_layer_us": us, f"torch_{kind}_layer_kernels": kernels})
        layers += us * c.sparse_layers.count(sparse)
    row["torch_rest_us"] = max(row["torch_step_us"] - layers, 0.0)
    return row


def torch_pieces(llm, tokens: int, context: int, reps: int, quantization=None) -> list:
    """The step's pieces at ``tokens`` decode requests (attention at ``context``): see the module docstring."""
    from m3_torch.model import linear

    runner, device = llm.runner.rank0, llm.runner.device
    model, c = runner.model, runner.model.config
    dense, msa = c.sparse_layers.index(False), c.sparse_layers.index(True)
    step = decode_step(llm.planner, llm.scheduler_config.max_blocks, tokens, context, seed=tokens)
    tensors = runner.step_tensors(step)
    g = torch.Generator(device).manual_seed(1)
    h = torch.randn(tokens, c.hidden_size, generator=g, device=device).to(model.dtype)
    o = torch.randn(tokens, c.num_attention_heads * c.head_dim, generator=g, device=device).to(model.dtype)
    rows = torch.arange(tokens, device=device)
    experts = routed_experts(model, lambda: model.mlp(msa, h))[0]
    H, elt, io, wb = c.hidden_size, 2, 2 * 2 * tokens * c.hidden_size, weight_elt(quantization)
    qkv_out = model.layers[msa].qkv.shape[0]
    pieces = {   # name -> (what runs, bytes it must move)
        "projections": (lambda: model._project(model.layers[msa], h, tensors.positions, tensors.slot_mapping,
                                                runner.caches[msa]),
                        projection_weight_bytes(c, True, wb) + elt * tokens * (H + qkv_out)),
        "msa_attention": (attention_call(runner, step, [msa]), kv_bytes(c, tokens, context, True)),
        "dense_attention": (attention_call(runner, step, [dense]), kv_bytes(c, tokens, context, False)),
        "o_proj": (lambda: linear(o, model.layers[msa].o_proj),
                   wb * H * o.shape[1] + elt * tokens * (o.shape[1] + H)),
        "moe": (lambda: model.mlp(msa, h), mlp_weight_bytes(c, True, experts, wb) + io),
        "dense_mlp": (lambda: model.mlp(dense, h), mlp_weight_bytes(c, False, 0, wb) + io),
        "lm_head": (lambda: model.logits(h, rows), head_bytes(c, tokens)),   # h's rows for the embedding's
    }
    out = []
    for name, (fn, nbytes) in pieces.items():
        us, kernels = measure(fn, device, reps)
        out.append(dict(piece=name, tokens=tokens, context=context, quantization=quantization, us=us,
                        kernels=kernels, floor_bytes=nbytes, **({"experts_touched": experts} if name == "moe" else {})))
    return out


def torch_context(model_dir, context: int, batches, reps: int, device: str, piece_tokens=(),
                  quantization=None) -> tuple:
    """-> ({batch: row}, pieces) of a torch engine built for ``context`` (closed before returning)."""
    import m3_torch

    blocks = -(-context // PAGE_SIZE)
    llm = m3_torch.LLM(model_dir, precompile=False,
                       dtype="bfloat16", device=device, load_format="dummy", max_num_seqs=max(batches),
                       max_model_len=context, num_gpu_blocks_override=max(batches) * blocks,
                       quantization=quantization)
    try:
        runner = llm.runner.rank0
        runner.pool.normal_(generator=torch.Generator(device=runner.device).manual_seed(0))   # random K/V/index-K
        rows = {}
        for batch in batches:
            step = decode_step(llm.planner, llm.scheduler_config.max_blocks, batch, context, seed=batch)
            rows[batch] = torch_step(llm, step, reps)
            _print(f"torch {_quant(quantization)} batch {batch:3d} context {token_count(context):>4}", rows[batch])
        pieces = [p for t in piece_tokens if t <= max(batches)
                  for p in torch_pieces(llm, t, context, reps, quantization)]
        for p in pieces:
            _print(f"torch piece {p['piece']:15s} tokens {p['tokens']:3d}", p)
        return rows, pieces
    finally:
        llm.close()


def run_torch(model_dir, runs: dict, reps: int, device: str, piece_context: int, piece_tokens,
              quantization=None) -> dict:
    """Every context of ``runs`` ({context: batches}) in turn, one engine each (in one fresh process on a
    GPU) -> {"rows": {(batch, context): row}, "pieces": [...], "errors": [...]}."""
    out = dict(rows={}, pieces=[], errors=[])
    for context, batches in runs.items():
        try:
            rows, pieces = torch_context(model_dir, context, batches, reps, device,
                                         piece_tokens if context == piece_context else (), quantization)
        except Exception as e:   # one context failing must not lose the others' numbers
            out["errors"].append(_error(f"torch {_quant(quantization)}", context, e))
            rows, pieces = {}, []
        _free_torch()   # here, not in the except clause: its traceback holds the failed engine's frames
        out["rows"].update({(batch, context): row for batch, row in rows.items()})
        out["pieces"] += pieces
    return out


def _free_torch():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- JAX ---------------------------------------------------------------------------------------------

_NO_LAUNCH = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "call", "while", "conditional",
              "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id", "domain",
              "get-dimension-size", "async-done", "async-update", "all-reduce-done", "all-gather-done",
              "collective-permute-done", "copy-done", "send-done", "recv-done"}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*)$")
_CALLED = re.compile(r"\b(calls|to_apply)=%?([\w.\-]+)|\bcalled_computations=\{([^}]*)\}")


def hlo_launches(text: str) -> int:
    """Static launch sites of an optimized HLO module: the instructions of every computation that runs
    as a program (the entry, while bodies, branches, command buffers; not fusion bodies nor reducers)
    that launch work (fusions, custom calls, copies, sorts, collectives, ...). A while body counts once."""
    computations, current = {}, None
    for line in text.splitlines():
        if (m := _HEADER.match(line)) and "=" not in line.split("(")[0]:
            current = computations.setdefault(m[1], [])
        elif current is not None and (m := _INSTRUCTION.match(line)):
            current.append(_opcode(m[1]) + " " + m[1])
    inner = set()   # fusion bodies, reducers, comparators, a custom call's computations
    for instructions in computations.values():
        for ins in instructions:
            opcode = ins.split(" ", 1)[0]
            for kind, name, listed in _CALLED.findall(ins):
                if listed:
                    inner |= {n.strip().lstrip("%") for n in listed.split(",")}
                elif not (opcode == "call" and kind == "to_apply"):   # a call's computation runs as a program
                    inner.add(name)
    return sum(1 for name, instructions in computations.items() if name not in inner
               for ins in instructions if ins.split(" ", 1)[0] not in _NO_LAUNCH)


def _opcode(rhs: str) -> str:
    """``f32[2]{0} fusion(%a), kind=...`` -> ``fusion`` (the type may be a parenthesised tuple)."""
    if rhs.startswith("("):
        depth = 0
        for i, ch in enumerate(rhs):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                rhs = rhs[i + 1:]
                break
    else:
        rhs = rhs.split(" ", 1)[1] if " " in rhs else ""
    return rhs.strip().split("(", 1)[0]


def jax_step(llm, step, reps: int) -> dict:
    """The engine's two jitted programs of a step (the forward, then greedy sampling of its logits;
    ``JaxRunner.execute`` without its host work), compiled ahead of time, on device-resident inputs; the
    pool is donated from call to call."""
    import jax
    from m3_jax.runner import _sampling_arrays, pack_inputs

    runner = llm.runner
    batch, spec, maps = runner._layout(step)
    rows = len(batch.logits_rows)
    flat, packing = pack_inputs((batch, maps, None))   # no carried tokens (async scheduling off)
    sampling_flat, sampling_packing = pack_inputs(_sampling_arrays(SamplingBatch.greedy(len(step.logits_indices)),
                                                                   rows))
    inputs, sampling_inputs = (runner._put(flat), None), (runner._put(sampling_flat), None)
    t0 = time.perf_counter()
    forward = runner._forward.lower(runner.params, runner.pool, *inputs, spec=spec, packing=packing).compile()
    logits = jax.ShapeDtypeStruct((rows, llm.config.vocab_size), "float32")   # what the forward returns
    sample = runner._sample.lower(logits, *sampling_inputs, packing=sampling_packing, num_logprobs=None,
                                  prompt=None).compile()
    row = dict(jax_compile_s=time.perf_counter() - t0,
               jax_launches=hlo_launches(forward.as_text()) + hlo_launches(sample.as_text()))

    def call():
        (logits, _), runner.pool = forward(runner.params, runner.pool, *inputs)
        out, _ = sample(logits, *sampling_inputs)
        return out

    row["jax_step_us"] = wall_us(lambda: jax.block_until_ready(call()), reps)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = call()
    jax.block_until_ready(out)
    row["jax_pipelined_us"] = (time.perf_counter() - t0) / reps * 1e6
    return row


def fill_jax_pool(runner, seed: int = 0):
    """Random K/V/index-K in the JAX engine's pool, in place: a jitted update of a group of slots at a time
    with the pool donated (a whole-pool draw could leave pool-sized temporaries: 75 GB at 64 x 128k)."""
    import jax
    import jax.numpy as jnp

    rows, cols = runner.pool_layout.num_slots, runner.pool_layout.slot_numel
    group = math.gcd(rows, 256)

    def fill(pool, key, i):
        x = jax.random.normal(jax.random.fold_in(key, i), (group, cols), jnp.float32).astype(pool.dtype)
        return jax.lax.dynamic_update_slice(pool.reshape(rows, cols), x, (i * group, 0)).reshape(pool.shape)

    fill = jax.jit(fill, donate_argnums=0)
    key = jax.random.key(seed)
    for i in range(rows // group):
        runner.pool = fill(runner.pool, key, i)


def jax_context(model_dir, context: int, batches, reps: int, device: str, quantization=None) -> dict:
    """-> {batch: row} of a JAX engine built for ``context`` (closed before returning)."""
    import jax

    import m3_jax

    blocks = -(-context // PAGE_SIZE)
    platform = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    llm = m3_jax.LLM(model_dir, precompile=False,
                     dtype="bfloat16", device=platform, load_format="dummy", max_num_seqs=max(batches),
                     max_model_len=context, num_gpu_blocks_override=max(batches) * blocks,
                     quantization=quantization)
    rows = {}
    try:
        with jax.default_device(platform):   # the kernels trace their GPU or CPU path from it
            fill_jax_pool(llm.runner)
            for batch in batches:
                step = decode_step(llm.planner, llm.scheduler_config.max_blocks, batch, context, seed=batch)
                rows[batch] = jax_step(llm, step, reps)
                _print(f"jax   {_quant(quantization)} batch {batch:3d} context {token_count(context):>4}", rows[batch])
        return rows
    finally:
        llm.close()


def run_jax(model_dir, runs: dict, reps: int, device: str, quantization=None) -> dict:
    """As :func:`run_torch`, for the JAX engine -> {"rows": {(batch, context): row}, "errors": [...]}."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(MEMORY_FRACTION))   # default 0.75: too little
    out = dict(rows={}, errors=[])
    for context, batches in runs.items():
        try:
            rows = jax_context(model_dir, context, batches, reps, device, quantization)
        except Exception as e:   # one context failing must not lose the others' numbers
            out["errors"].append(_error(f"jax {_quant(quantization)}", context, e))
            rows = {}
        gc.collect()   # here, not in the except clause: its traceback holds the failed engine's frames
        out["rows"].update({(batch, context): row for batch, row in rows.items()})
    return out


# -- the run -------------------------------------------------------------------------------------------

def device_info(device: str) -> dict:
    """The device's name, memory and copy bandwidth (bytes read + written per second)."""
    if device == "cuda":
        from benchmarks.run import copy_bandwidth

        return dict(name=torch.cuda.get_device_name(), memory=torch.cuda.get_device_properties(0).total_memory,
                    copy_bandwidth=copy_bandwidth())
    x = torch.empty(1 << 24)   # 64 MiB
    y = torch.empty_like(x)
    seconds = statistics.median(_seconds(lambda: y.copy_(x)) for _ in range(5))
    return dict(name="cpu (Triton interpreter)", memory=None, copy_bandwidth=2 * x.nbytes / seconds)


def finish_row(row: dict, c: M3TextConfig, bandwidth: float):
    """Floors, shares of the floor and the 60-layer extrapolation of a measured row."""
    batch, context, quantization = row["batch"], row["context"], row["quantization"]
    row["floor_bytes"] = step_floor_bytes(c, batch, context, row.get("experts_touched"), quantization)
    row["floor_us"] = row["floor_bytes"] / bandwidth * 1e6
    row["experts_expected"] = expected_experts(batch, c.num_local_experts, c.num_experts_per_tok)
    for name in ("torch_step_us", "jax_step_us", "jax_pipelined_us"):
        if row.get(name):
            row[name.replace("_us", "_pct_floor")] = row["floor_us"] / row[name]
    if row.get("torch_step_us"):
        row["torch_tok_s"] = batch / (row["torch_step_us"] * 1e-6)
    if row.get("jax_launches") is not None:
        row["jax_launches_per_layer"] = row["jax_launches"] / c.num_hidden_layers
    row["floor_60l_tp8_us"] = full_model_floor_bytes(c, batch, context, quantization) / bandwidth * 1e6 / FULL_TP
    if "torch_msa_layer_us" in row:
        row["extrap_60l_tp8_us"] = (FULL_DENSE_LAYERS * row["torch_dense_layer_us"] + (
            FULL_LAYERS - FULL_DENSE_LAYERS) * row["torch_msa_layer_us"] + row["torch_rest_us"]) / FULL_TP


def run_grid(args, model_dir: Path, runs: dict, device: str, report) -> tuple[list, list, list]:
    """Each framework's engines per weight format (``--quantization``), one process each (a fresh one on a
    GPU: each process's allocator keeps its memory) -> (rows, pieces, errors); ``report(rows, pieces,
    errors)`` after each process."""
    child = in_fresh_process if device == "cuda" else (lambda fn, *a: fn(*a))
    runs = {context: batches for context, batches in runs.items() if batches}
    rows, pieces, errors = {}, [], []
    piece_context = args.piece_context if args.piece_context in runs else next(iter(runs), None)
    for quantization in args.quantization:
        for name in args.frameworks:
            try:
                if name == "torch":
                    result = child(run_torch, model_dir, runs, args.reps, device, piece_context, args.piece_tokens,
                                   quantization)
                else:
                    result = child(run_jax, model_dir, runs, args.reps, device, quantization)
            except Exception as e:   # a process that died: its numbers are lost, not the other runs'
                errors.append(f"{name} {_quant(quantization)}: {type(e).__name__}: {e}")
                print("  " + errors[-1], flush=True)
                continue
            errors += result["errors"]
            pieces += result.get("pieces", [])
            for (batch, context), row in result["rows"].items():
                rows.setdefault((batch, context, quantization),
                                dict(batch=batch, context=context, quantization=quantization)).update(row)
            report(list(rows.values()), pieces, errors)
    return list(rows.values()), pieces, errors


def build_result(command: str, info: dict, c: M3TextConfig, config: dict, skipped: dict, rows: list, pieces: list,
                 errors: list) -> dict:
    """The JSON of a run: the measured rows finished (floors, shares, extrapolation) and the skipped ones."""
    rows = sorted(rows + [dict(batch=b, context=ctx, quantization=None, skipped=why)
                          for (b, ctx), why in skipped.items()],
                  key=lambda r: (r["quantization"] or "", r["context"], r["batch"]))
    for row in rows:
        if "skipped" not in row:
            finish_row(row, c, info["copy_bandwidth"])
    for p in pieces:
        p["floor_us"] = p["floor_bytes"] / info["copy_bandwidth"] * 1e6
        p["pct_floor"] = p["floor_us"] / p["us"]
    dims = {k: v for k, v in config.items() if k in M3_DIMS}
    memory = [full_model_memory(dims, q, tp, info["memory"]) for q in (None, "fp8") for tp in (4, 8)] \
        if info["memory"] is not None else []
    return dict(date=datetime.date.today().isoformat(), device=info["name"], command=command,
                copy_bandwidth_TBps=info["copy_bandwidth"] / 1e12, config=config, weights_GB=weight_bytes(c) / 1e9,
                kv_bytes_per_token=kv_bytes_per_request(c, PAGE_SIZE) / PAGE_SIZE, rows=rows, pieces=pieces,
                fp8_speedups=fp8_speedups(rows), full_model_memory=memory, errors=errors)


def fp8_speedups(rows: list) -> list:
    """Per (batch, context) measured in both weight formats: the FP8 step against the bf16 one, torch and JAX."""
    by = {(r["batch"], r["context"], r["quantization"]): r for r in rows if "skipped" not in r}
    out = []
    for (batch, context, quantization), fp8 in by.items():
        bf16 = by.get((batch, context, None))
        if quantization != "fp8" or bf16 is None:
            continue
        row = dict(batch=batch, context=context)
        for name in ("torch_step_us", "jax_step_us", "jax_pipelined_us", "extrap_60l_tp8_us"):
            if bf16.get(name) and fp8.get(name):
                row[name.replace("_us", "_speedup")] = bf16[name] / fp8[name]
        for q, r in (("bf16", bf16), ("fp8", fp8)):
            if r.get("torch_step_us") and r.get("jax_step_us"):
                row[f"jax_over_torch_{q}"] = r["jax_step_us"] / r["torch_step_us"]
        out.append(row)
    return out


def write_result(out_dir, result: dict, final: bool):
    """``<date>-<gpu>-model-step.{json,md}`` in ``out_dir``; the final one's markdown is also printed."""
    name = f"{result['date']}-{slug(result['device'])}-model-step"
    if final:
        save_results(out_dir, name, result, markdown(result))
        return
    os.makedirs(out_dir, exist_ok=True)   # a partial result, in case the run is cut short
    Path(out_dir, name + ".json").write_text(json.dumps(result, indent=1))
    Path(out_dir, name + ".md").write_text(markdown(result))


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--layers", type=int, default=4, help="1 dense + LAYERS-1 MSA/MoE layers (default 4, ~50 GB)")
    ap.add_argument("--batches", type=_ints, default=None, help=f"default {','.join(map(str, BATCHES))}")
    ap.add_argument("--contexts", type=_ints, default=None, help=f"default {','.join(map(str, CONTEXTS))}")
    ap.add_argument("--piece-tokens", type=_ints, default=None, help="tokens of the pieces table (default "
                    f"{','.join(map(str, PIECE_TOKENS))}; 0: no pieces)")
    ap.add_argument("--piece-context", type=int, default=PIECE_CONTEXT, help="the pieces' attention context "
                    "(one of --contexts; else the first)")
    ap.add_argument("--frameworks", type=lambda s: s.split(","), default=["torch", "jax"])
    ap.add_argument("--quantization", type=lambda s: [None if q == "none" else q for q in s.split(",")],
                    default=[None], help="weight formats, each run in turn: none (bf16) and/or fp8 (default none)")
    ap.add_argument("--reps", type=int, default=None, help="timed replays / calls per number (default 10)")
    ap.add_argument("--tiny", action="store_true", help="the tiny test config on the CPU (checks the script)")
    args = ap.parse_args(argv)
    if args.layers < 2:
        ap.error("--layers: at least 2 (one dense, one MSA + MoE layer)")
    if not set(args.quantization) <= {None, "fp8"}:
        ap.error(f"--quantization: expected none and/or fp8, got {','.join(q or 'none' for q in args.quantization)}")
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("benchmarks.model_step: needs a GPU (use --tiny to check the script on the CPU)")
    defaults = (TINY_BATCHES, TINY_CONTEXTS, TINY_PIECE_TOKENS, 1) if args.tiny else (
        BATCHES, CONTEXTS, PIECE_TOKENS, 10)
    args.batches, args.contexts, args.piece_tokens, args.reps = (
        given or default for given, default in zip((args.batches, args.contexts, args.piece_tokens, args.reps),
                                                   defaults))
    args.piece_tokens = [t for t in args.piece_tokens if t > 0]
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    # --tiny: the tiny test config whose quantized weights are whole 128 x 128 blocks (FP8's unit)
    dims, device = ({k: v for k, v in tiny_fp8_config().items() if k != "num_hidden_layers"}, "cpu") \
        if args.tiny else (M3_DIMS, "cuda")
    text = text_config(dims, args.layers, max(args.contexts))
    c = M3TextConfig.from_dict(text)
    info = in_fresh_process(device_info, device) if device == "cuda" else device_info(device)
    runs, skipped = plan_grid(c, args.batches, args.contexts, info["memory"])
    command = "python3 -m benchmarks.model_step " + " ".join(sys.argv[1:] if argv is None else argv)
    config = dict(shapes="tiny test config" if args.tiny else "MiniMax-M3", layers=args.layers, **dims)

    def report(rows, pieces, errors, final=False):
        result = build_result(command, info, c, config, skipped, rows, pieces, errors)
        write_result(args.out, result, final)
        return result

    with tempfile.TemporaryDirectory() as tmp:
        rows, pieces, errors = run_grid(args, write_config(Path(tmp), text), runs, device, report)
    return report(rows, pieces, errors, final=True)


# -- markdown ----------------------------------------------------------------------------------------

def markdown(r: dict) -> str:
    lines = [f"# The model step at MiniMax-M3's layer shapes ({r['device']}, {r['date']})", "",
             f"Command: `{r['command']}`; copy bandwidth in the same run: {r['copy_bandwidth_TBps']:.3g} TB/s "
             f"(device copy, bytes read + written). Model: {r['config']}; 1 dense + "
             f"{r['config']['layers'] - 1} MSA/MoE layers, {r['weights_GB']:.1f} GB of bf16 weights "
             f"(load_format=dummy), {r['kv_bytes_per_token'] / 1024:.2f} KiB of KV per token.", "",
             "Step times in us (torch: CUDA-graph replay of the model step, embedding to logits; JAX: the jitted "
             "step with greedy sampling, blocking call, and back-to-back calls / n). Kernels: torch.profiler's "
             "CUDA kernels in one replay (per layer: one layer's own graph, dense / MSA); JAX: static launch sites "
             "in the optimized HLO (per layer: / layers). Floor: the bytes the step must move (weights read, "
             "the experts the torch router chose per MoE layer, or the uniform-routing expectation without a torch "
             "run, KV and index-K with top-16 selection) / copy bandwidth. Experts: expected / the torch router's distinct choices per MoE layer. 60L TP8: "
             "EXTRAPOLATION, (3 dense + 57 MSA layer times + rest) / 8, ideal 8-way split, no all-reduces; "
             "its floor likewise.", "",
             "| weights | batch | context | torch step | kernels (dense / MSA layer) | torch % floor | JAX step | JAX "
             "pipelined | JAX launches (per layer) | JAX % floor | floor | experts | 60L TP8 extrap. (floor) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in r["rows"]:
        if "skipped" in row:
            lines.append(f"| {_quant(row['quantization'])} | {row['batch']} | {token_count(row['context'])} | "
                         f"{row['skipped']} |" + " |" * 9)
            continue
        kernels = (f"{_num(row.get('torch_kernels'))} ({_num(row.get('torch_dense_layer_kernels'))} / "
                   f"{_num(row.get('torch_msa_layer_kernels'))})")
        launches = f"{_num(row.get('jax_launches'))} ({_num(row.get('jax_launches_per_layer'))})"
        experts = f"{row['experts_expected']:.0f} / " + ", ".join(map(str, row.get("experts_touched", ["-"])))
        extrap = f"{_num(row.get('extrap_60l_tp8_us'))} ({_num(row.get('floor_60l_tp8_us'))})"
        lines.append(f"| {_quant(row['quantization'])} | {row['batch']} | {token_count(row['context'])} | "
                     f"{_num(row.get('torch_step_us'))} | {kernels} | "
                     f"{_pct(row.get('torch_step_pct_floor'))} | {_num(row.get('jax_step_us'))} | "
                     f"{_num(row.get('jax_pipelined_us'))} | {launches} | {_pct(row.get('jax_step_pct_floor'))} | "
                     f"{_num(row['floor_us'])} | {experts} | {extrap} |")
    if r["pieces"]:
        lines += ["", "Pieces (torch, each in its own CUDA graph; MSA layer unless named; attention at "
                  f"{token_count(r['pieces'][0]['context'])}; MoE floor with the experts its router chose):", "",
                  "| weights | piece | tokens | us | kernels | floor us | % floor |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for p in r["pieces"]:
            lines.append(f"| {_quant(p['quantization'])} | {p['piece']} | {p['tokens']} | {_num(p['us'])} | "
                         f"{_num(p['kernels'])} | {_num(p['floor_us'])} | {_pct(p['pct_floor'])} |")
    if r["fp8_speedups"]:
        lines += ["", "FP8 weights against bf16 (the same batch and context; speedup = bf16 time / FP8 time; "
                  "JAX / torch = the blocking JAX step over the torch step, per weight format):", "",
                  "| batch | context | torch | JAX blocking | JAX pipelined | 60L TP8 extrap. | JAX / torch bf16 | "
                  "JAX / torch FP8 |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for s in r["fp8_speedups"]:
            lines.append(f"| {s['batch']} | {token_count(s['context'])} | {_x(s.get('torch_step_speedup'))} | "
                         f"{_x(s.get('jax_step_speedup'))} | {_x(s.get('jax_pipelined_speedup'))} | "
                         f"{_x(s.get('extrap_60l_tp8_speedup'))} | {_x(s.get('jax_over_torch_bf16'))} | "
                         f"{_x(s.get('jax_over_torch_fp8'))} |")
    if r["full_model_memory"]:
        lines += ["", "M3's 60 layers at these dimensions (3 dense + 57 MSA/MoE; ARITHMETIC, not measured): weights "
                  "per GPU split ideally over the GPUs, and the KV room that 90% of this GPU's memory leaves "
                  "(tokens of context it holds: each GPU its share of the 4 KV heads and all of index-K, bf16):",
                  "",
                  "| weights | GPUs | parameters | weights / GPU | KV room / GPU | KV tokens |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for m in r["full_model_memory"]:
            lines.append(f"| {m['quantization']} | {m['tp']} | {m['params_B']:.0f} B | {m['weights_per_gpu_GB']:.1f} GB "
                         f"| {m['kv_room_per_gpu_GB']:.1f} GB | {m['kv_tokens'] / 1e6:.2f} M |")
    if r["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in r["errors"]]]
    return "\n".join(lines) + "\n"


# -- helpers -----------------------------------------------------------------------------------------

def _quant(quantization) -> str:
    return quantization or "bf16"


def _x(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x.strip()]


def token_count(n: int) -> str:
    """32768 -> "32k" (a whole number of 1024s), else the number."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _num(v) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _pct(v) -> str:
    return "-" if v is None else f"{v:.0%}"


def slug(device: str) -> str:
    """"NVIDIA H200" -> "h200" (the results' file names)."""
    m = re.search(r"\b([A-Z]\d{2,4}\w*)", device)
    return m[1].lower() if m else device.split()[0].lower()


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def wall_us(fn, reps: int) -> float:
    """Median wall-clock microseconds of ``fn()`` (which must synchronize), after one warm-up call."""
    fn()
    return statistics.median(_seconds(fn) for _ in range(reps)) * 1e6


def _error(framework: str, context: int, e: Exception) -> str:
    message = f"{framework} context {token_count(context)}: {type(e).__name__}: {e}"
    print("  " + message, flush=True)
    return message


def _print(label: str, row: dict):
    print(f"  {label}: " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                    for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
