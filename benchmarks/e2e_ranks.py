"""What ``benchmarks/e2e.py --tp N`` runs on EVERY rank of a torch engine (``LLM.collective_rpc``).

Each function gets the rank's ``m3_torch.rank.RankRunner``; the ranks run them at
the same time, so the collectives inside (the model's all-reduces, captured in
CUDA graphs) pair up. A module of its own: spawned workers import it by name.
"""

from __future__ import annotations

import statistics
import time

import torch

from m3_torch import tp as torch_tp
from m3_torch.model import rms_norm, rope_cos_sin


def fill_pool(runner, seed: int = 0):
    """Random caches (step times do not depend on the values: every request reads its top-k blocks)."""
    runner.pool.normal_(generator=torch.Generator(device=runner.device).manual_seed(seed + runner.rank))
    return runner.rank


def wall_us(fn, reps: int) -> float:
    """Median wall-clock microseconds of ``fn()`` (which returns host data: synchronized), after 2 warm-ups."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def replay_us(graph, reps: int) -> float:
    """Median CUDA-event microseconds of one replay."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def timed(fn, reps: int, device) -> float:
    """Median microseconds of ``fn``: CUDA-graph replays timed by events on a GPU (captured after one
    eager call, which also compiles the kernels and sets up workspaces), wall clock on a CPU."""
    if device.type != "cuda":
        return wall_us(fn, reps)
    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):   # as the engine (m3_torch.engine)
        fn()
    return replay_us(graph, reps)


def graph_replay_us(runner, key, reps: int):
    """The captured decode step ``key`` (batch, tokens per row, block bound) alone, replayed on every rank."""
    if runner.graphs is None or key not in runner.graphs.graphs:
        return None
    graph, _ = runner.graphs.graphs[key]
    return replay_us(graph, reps)   # a graph exists only on a GPU


def layer_times(runner, step, reps: int) -> dict:
    """One decode step's pieces on this rank, each with its all-reduce (the step's metadata, random
    hidden states): the attention block and the MLP block of the first layer of each type (dense
    attention + dense MLP, MSA + MoE), and the step's all-reduces alone (2 per layer)."""
    model, device = runner.model, runner.device
    c = model.config
    tensors = runner.step_tensors(step)
    T = step.plan.num_tokens
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(T, c.hidden_size, generator=g, device=device).to(model.dtype)
    cos, sin = rope_cos_sin(tensors.positions, model.inv_freq, model.dtype)
    out = {}
    for kind, sparse in (("dense", False), ("msa", True)):
        i = next((i for i, s in enumerate(c.sparse_layers) if s == sparse), None)
        if i is None:
            continue
        layer = model.layers[i]
        h = rms_norm(x, layer.input_norm, c.rms_norm_eps)
        mlp_kind = "moe" if layer.moe else "dense_mlp"
        out[f"{kind}_attention_us"] = timed(
            lambda: model._reduce(model._attention(layer, h, cos, sin, tensors, step.plan, runner.caches[i])),
            reps, device)
        out[f"{mlp_kind}_us"] = timed(lambda: model._reduce(model._mlp(layer, h)), reps, device)
        out[f"{kind}_layers"] = sum(1 for s in c.sparse_layers if s == sparse)
    out.update(attention_kernels(runner, step, reps))
    if model.all_reduce is not None:
        buffer = torch.zeros(T, c.hidden_size, dtype=model.dtype, device=device)

        def reduces():
            for _ in range(2 * c.num_hidden_layers):
                torch_tp.all_reduce(buffer)
        out["all_reduce_us"] = timed(reduces, reps, device)
    else:
        out["all_reduce_us"] = 0.0
    return out


def attention_call(runner, step, layers):
    """A callable running the attention kernels alone for ``step`` on this rank: per layer in ``layers``
    (indices), ``write_cache`` + ``msa_attention_step`` of the rank's heads, on random q/k/v."""
    from m3_torch import msa_attention_step, write_cache

    c, device, dt = runner.model.config, runner.device, runner.model.dtype
    tensors = runner.step_tensors(step)
    T = step.plan.num_tokens
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=g, device=device).to(dt)

    q, idx_q = randn(T, c.num_attention_heads, c.head_dim), randn(T, c.index_n_heads, c.index_head_dim)
    k, v, idx_k = (randn(T, c.num_key_value_heads, c.head_dim), randn(T, c.num_key_value_heads, c.head_dim),
                   randn(T, c.index_head_dim))

    def run():
        for i in layers:
            sparse, cache = c.sparse_layers[i], runner.caches[i]
            write_cache(k, v, idx_k if sparse else None, cache.k_cache, cache.v_cache, cache.index_k_cache,
                        tensors.slot_mapping)
            msa_attention_step(q, idx_q if sparse else None, cache.k_cache, cache.v_cache,
                               cache.index_k_cache if sparse else None, tensors.block_table, tensors.seq_lens,
                               plan=step.plan, sparse=sparse, init_blocks=c.index_init_blocks,
                               local_blocks=c.index_local_blocks, sm_scale=c.attention_scale)
    return run


def attention_kernels(runner, step, reps: int) -> dict:
    """The attention kernels alone on this rank (:func:`attention_call` of one dense and one MSA layer),
    and the bytes each must move: the floor of ``benchmarks/run.py`` for a decode step where every
    request is at the same context. The MSA layer reads all of index-K (the one index head is
    replicated: TP does not shrink it), the index queries, its KV heads' ``min(topk, blocks)`` chosen
    blocks of K and V, and q and o; the dense layer reads every visible K/V row of its KV heads."""
    c, dt = runner.model.config, runner.model.dtype
    T = step.plan.num_tokens
    lens = runner.step_tensors(step).seq_lens[:T].long().cpu()
    blocks = (lens + 127) // 128
    elt = torch.finfo(dt).bits // 8
    qo = 2 * T * c.num_attention_heads * c.head_dim * elt
    kv_row = 2 * c.num_key_value_heads * c.head_dim * elt       # K and V of one token, this rank's heads
    out = {}
    for kind, sparse in (("dense", False), ("msa", True)):
        i = next((i for i, s in enumerate(c.sparse_layers) if s == sparse), None)
        if i is None:
            continue
        out[f"{kind}_kernels_us"] = timed(attention_call(runner, step, [i]), reps, runner.device)
        if sparse:
            chosen = blocks.clamp(max=c.index_topk_blocks)
            out[f"{kind}_kernels_bytes"] = int(
                blocks.sum() * 128 * c.index_head_dim * elt                    # index-K, all of it
                + T * c.index_n_heads * c.index_head_dim * elt                 # index queries
                + chosen.sum() * 128 * kv_row + qo)                            # chosen K/V blocks, q, o
        else:
            out[f"{kind}_kernels_bytes"] = int(lens.sum() * kv_row + qo)
    return out
