"""One rank of the torch model runner: its weights, its pool, its CUDA graphs.

:class:`RankRunner` is what every rank holds: rank 0's lives in
:class:`m3_torch.runner.TorchRunner`, the others' in the worker processes of
``m3_torch.tp``; all run the same steps (the plans are made for one rank's
heads). On a GPU, pure decode steps (padded to ``graph_batch_sizes`` by the
step builder, ``m3_engine.step_inputs``) replay CUDA graphs, one per (padded batch, block-table
bound): the first step of each runs eagerly (its result is used; it compiles
the kernels and builds the persistent maps and workspaces), then the graph is
captured for the next ones. Prefill and mixed steps run eagerly. On a CPU
everything runs eagerly (the kernels through Triton's interpreter).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
# torch imports torch._dynamo on the first custom-op call, and torch.fx.wrap, run by that import, leaves a
# frame cycle holding the calling stack until the garbage collector runs: imported from inside an engine's
# first step, a dropped LLM kept its pool (and its workers) that long. Imported here, only module frames.
import torch._dynamo  # noqa: F401

from m3_engine import checkpoint
from m3_engine.args import kv_cache_pages
from m3_engine.dummy_weights import dummy_dtype
from m3_engine.quantization import is_quantized, is_scale, load_stream
from m3_engine.step_inputs import Step
from m3_engine.tp import VOCAB_TENSORS, TPPlan
from m3_kernels.pool import PoolLayout

from . import fp8
from .cache import allocate_pool, layer_caches
from .dummy_weights import iter_dummy_weights
from .model import M3Model, StepTensors
from .staging import upload

__all__ = ["RankRunner", "rank_device", "step_arrays", "carry_indices", "carry_tokens", "use_compile_cache",
           "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def use_compile_cache(folder) -> None:
    """Triton's cache (the kernels' compiled variants) in ``folder/triton`` (``m3_engine.compile_cache``):
    the one place the torch runner sets it, when each rank starts."""
    import triton

    triton.knobs.cache.dir = str(Path(folder) / "triton")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of tensor-parallel rank ``rank`` when rank 0 runs on ``device``."""
    return device if device.type == "cpu" else torch.device("cuda", device.index + rank)


class RankRunner:
    """One rank's part of an engine: its weights (its slices under tensor parallelism),
    its pool (its KV heads, the whole index-K), its decode graphs. Rank 0's lives in
    :class:`m3_torch.runner.TorchRunner`, the others' in the worker processes of ``m3_torch.tp``; all run the
    same steps.

    tp, rank:   the tensor-parallel plan and this rank (``TPPlan(config, 1)``, 0: no parallelism).
    dtype:      a torch dtype, or None for the checkpoint tensors' own.
    device:     rank 0's device (this rank's is :func:`rank_device` of it).
    num_slots, max_blocks: pool slots and block-table columns (the scheduler's); ``num_slots`` None
                (a GPU without ``num_gpu_blocks_override``): as many as ``gpu_memory_utilization`` of
                the GPU holds after the weights (``m3_engine.args.kv_cache_pages``; under tensor
                parallelism the fewest any rank holds), at least one request of ``max_model_len``.
    cuda_graphs: replay pure decode steps from CUDA graphs.
    all_reduce, all_gather: the model's tensor-parallel hooks (``m3_torch.tp.all_reduce`` and
                ``all_gather``), None on one rank.
    load_format: "auto" (read ``model_dir``'s safetensors) or "dummy" (random weights drawn on the
                device from ``seed``: ``m3_engine.dummy_weights``).
    quantization: None or "fp8": the linear weights as e4m3 codes and 128 x 128 block scales
                (``m3_engine.quantization``); checkpoint_quantization: the checkpoint's (None: the tensors
                are quantized at load, each on this rank's device; "fp8": read as is; "mxfp8": converted).
    aux_layers: an EAGLE-3 draft's aux layers (one rank only): every step also returns the
                residual stream after them (``M3Model.hidden_states``), from the graphs too.
    compile_cache_dir: the engine's compile cache folder (``m3_engine.compile_cache``): Triton's
                cache goes to its ``triton`` folder (None: Triton's own default).
    Under tensor parallelism every rank holds its vocabulary rows of the embedding
    and ``lm_head`` and its experts (``m3_engine.tp``), and every rank's step
    ends with the whole logits rows (rank 0 samples them).
    """

    def __init__(self, *, model_dir, tp: TPPlan, rank: int, device, dtype, num_slots: Optional[int],
                 max_blocks: int, cuda_graphs: bool, kv_cache_dtype: str = "auto", index_cache_dtype: str = "auto",
                 all_reduce: Optional[Callable] = None, all_gather: Optional[Callable] = None,
                 load_format: str = "auto", seed: int = 0, quantization: Optional[str] = None,
                 checkpoint_quantization: Optional[str] = None, aux_layers: tuple = (), compile_cache_dir=None,
                 gpu_memory_utilization: float = 0.9, max_model_len: Optional[int] = None):
        c = tp.config
        if compile_cache_dir is not None:
            use_compile_cache(compile_cache_dir)
        self.rank, self.device, self.max_blocks = rank, rank_device(torch.device(device), rank), max_blocks
        self.aux_layers = tuple(aux_layers)
        weights, self.dtype = {}, dtype
        stream = load_stream(self._weights(model_dir, tp, load_format, seed), checkpoint=checkpoint_quantization,
                             quantization=quantization, quantize=fp8.quantize_weight,
                             dequantize_mxfp8=fp8.dequantize_mxfp8)
        for name, w in stream:
            self.dtype = self.dtype or w.dtype   # a config without a dtype: the tensors' (the embedding's first)
            if quantization is not None and (is_quantized(name) or is_scale(name)):
                weights[name] = w   # FP8 codes and float32 scales
                continue
            padding = tp.vocab_rows - w.shape[0] if name in VOCAB_TENSORS else 0
            if padding:   # read from the checkpoint: the last ranks' vocabulary rows past vocab_size
                w = torch.cat([w, w.new_zeros((padding,) + tuple(w.shape[1:]))])
            weights[name] = w.to(self.dtype)
        self.model = M3Model(tp.local_config, weights, all_reduce=all_reduce, all_gather=all_gather,
                             vocab_start=tp.vocab(rank).start, expert_start=tp.experts(rank).start)
        del weights
        dtype_name = next(n for n, d in DTYPES.items() if d == self.dtype)

        def layout(slots: int) -> PoolLayout:
            return PoolLayout.create(slots, sparse=c.sparse_layers, num_kv_heads=tp.num_kv_heads, head_dim=c.head_dim,
                                     index_head_dim=c.index_head_dim, dtype=dtype_name,
                                     kv_cache_dtype=kv_cache_dtype, index_cache_dtype=index_cache_dtype)

        if num_slots is None:
            num_slots = self._pages_from_memory(layout(1).slot_nbytes, gpu_memory_utilization, max_model_len,
                                                tp.size)
        self.layout = layout(num_slots)
        self.pool = allocate_pool(self.layout, self.device)
        self.caches = [layer_caches(self.pool, self.layout, i) for i in range(c.num_hidden_layers)]
        self.graphs = _DecodeGraphs(self) if cuda_graphs else None

    def _pages_from_memory(self, page_bytes: int, gpu_memory_utilization: float, max_model_len: int,
                           tp_size: int) -> int:
        """The pool pages ``gpu_memory_utilization`` of this GPU holds after what this process holds now
        (the weights), vLLM's sizing (``kv_cache_pages``), at most the device's free memory; under
        tensor parallelism the fewest of any rank (every rank runs this, in the same order: an
        all-reduce)."""
        free, total = torch.cuda.mem_get_info(self.device)
        used = torch.cuda.memory_reserved(self.device)   # this process's allocations, not other processes'
        try:
            pages, error = kv_cache_pages(total_bytes=total, used_bytes=used, free_bytes=free,
                                          gpu_memory_utilization=gpu_memory_utilization, page_bytes=page_bytes,
                                          max_model_len=max_model_len), None
        except ValueError as e:   # raised after the all-reduce, which every rank must reach
            pages, error = 0, e
        if tp_size > 1:
            fewest = torch.tensor([pages], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(fewest, op=torch.distributed.ReduceOp.MIN)
            pages = int(fewest.item())
        if error is not None:
            raise error
        if pages < self.max_blocks:
            raise ValueError(f"gpu_memory_utilization: another tensor-parallel rank has room for {pages} KV pages "
                             f"only; one request of max_model_len={max_model_len} tokens needs {self.max_blocks}")
        return pages

    def _weights(self, model_dir, tp: TPPlan, load_format: str, seed: int):
        """``(canonical name, tensor)`` of this rank's weights, on its device: read from the checkpoint
        (``"auto"``), or drawn at random from ``seed`` (``"dummy"``: ``m3_torch.dummy_weights``)."""
        shard = tp.rank(self.rank) if tp.size > 1 else None
        if load_format == "dummy":
            dtype = self.dtype or DTYPES[dummy_dtype(None, tp.config)]
            return iter_dummy_weights(tp.config, device=self.device, dtype=dtype, seed=seed, shard=shard)
        return checkpoint.iter_weights(model_dir, tp.config, framework="pt", concatenate=torch.cat,
                                       device=str(self.device), shard=shard)

    def run(self, step: Step, carried: Optional[torch.Tensor] = None):
        """One step -> logits ``[len(step.forward_logits_indices), vocab]`` in the model dtype (every rank: the
        vocab-parallel head's all-gather gives each the whole rows; rank 0 samples). With ``aux_layers``:
        ``(logits, aux [T, 3 * hidden])`` (from a graph: its static output, valid until it replays).
        ``carried``: the previous step's sampled tokens on this device, for ``step.carry_from``."""
        if self.graphs is not None and step.plan.cuda_graph:
            return self.graphs.run(step, carried)
        carry = carry_indices(step.carry_from) if carried is not None else (None, None)
        *fields, into, source = upload([*step_arrays(step), *carry], self.device)   # one copy
        tensors = StepTensors(*fields)
        if carried is not None:
            carry_tokens(tensors.input_ids, into, source, carried)
        return self.model.forward(tensors, step.plan, self.caches, self.aux_layers)

    def compile_kernels(self, steps: list, threads: int, progress: bool = False) -> int:
        """Compile (Triton) every kernel variant the launches of ``steps`` need, in ``threads`` threads,
        launching none -> how many compilations ran (one per variant not yet in memory; a variant in
        Triton's on-disk cache is read back, not compiled again). Each step runs through the model
        inside ``ops.compile_only`` on the tensors its real run gets: a pure decode step that a CUDA
        graph replays on the graph's static inputs (a pointer's alignment picks the variant too),
        any other step on fresh ones. Triton compiles in threads: its LLVM and PTX passes release
        the GIL and ptxas is a process of its own (its MLIR passes hold the GIL). A GPU only."""
        from concurrent.futures import as_completed

        from tqdm.auto import tqdm

        from .ops import compile_only

        with compile_only(threads) as mode:
            for step in steps:
                plan = step.plan
                if self.graphs is not None and plan.cuda_graph:
                    tensors = self.graphs.static_inputs(plan.generation.num_rows, plan.generation.decode_query_len)
                else:
                    tensors = self.step_tensors(step)
                self.model.forward(tensors, plan, self.caches, self.aux_layers)
            futures = list(mode.raw_futures)
            for future in tqdm(as_completed(futures), total=len(futures), disable=not progress, unit="kernel",
                               desc="Compiling kernel variants (torch)"):
                future.result()
        torch.cuda.synchronize(self.device)
        return len(futures)

    def step_tensors(self, step: Step, logits_rows: Optional[np.ndarray] = None) -> StepTensors:
        """A step's numpy metadata on this rank's device (one copy: ``m3_torch.staging.upload``)."""
        return StepTensors(*upload(step_arrays(step, logits_rows), self.device))


def step_arrays(step: Step, logits_rows: Optional[np.ndarray] = None) -> list:
    """The numpy arrays of ``step``'s :class:`StepTensors`, in field order (``logits_rows``: instead of
    ``step.forward_logits_indices``)."""
    return [step.input_ids, step.positions, step.slot_mapping, step.block_table, step.seq_lens,
            step.forward_logits_indices if logits_rows is None else logits_rows]


def carry_indices(carry_from: np.ndarray) -> tuple:
    """``(into, source)`` int64: the token rows ``t`` with ``carry_from[t] >= 0`` and those ``carry_from[t]``
    (:func:`carry_tokens`' indices, on the host)."""
    into = np.flatnonzero(carry_from >= 0)
    return into, carry_from[into].astype(np.int64)


def carry_tokens(input_ids: torch.Tensor, into: torch.Tensor, source: torch.Tensor,
                 previous_tokens: torch.Tensor) -> None:
    """In place, on the device: ``input_ids[into[i]] = previous_tokens[source[i]]`` (async scheduling: the
    tokens the previous step sampled, which the host has not seen; ``into``, ``source``: int64
    :func:`carry_indices` of the step's ``carry_from`` on the device)."""
    input_ids.index_copy_(0, into, previous_tokens.index_select(0, source))


# -- CUDA graphs -----------------------------------------------------------------------------------

# the static inputs of a graph, in the order they lie in its one buffer
GRAPH_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "block_table")
# after them in the buffer, each step's int64 indices for the eager ops around the replay, up to one per
# token row each: the rows of the graph's logits the step returns, carry_tokens' into and source
GRAPH_INDEX_FIELDS = ("rows", "carry_into", "carry_from")
GRAPH_FIELD_ALIGN = 4   # int32 elements: 16 bytes


def graph_field_slices(batch: int, n: int, width: int) -> list:
    """``[(name, slice)]``: where each of ``GRAPH_FIELDS`` and ``GRAPH_INDEX_FIELDS`` lies in the graphs'
    int32 input buffer (an index field: two int32 elements per int64)."""
    tokens = batch * n
    sizes = (tokens, tokens, tokens, batch, batch * width) + (2 * tokens,) * len(GRAPH_INDEX_FIELDS)
    out, start = [], 0
    for name, size in zip(GRAPH_FIELDS + GRAPH_INDEX_FIELDS, sizes):
        out.append((name, slice(start, start + size)))
        start += -(-size // GRAPH_FIELD_ALIGN) * GRAPH_FIELD_ALIGN
    return out


def graph_inputs(batch: int, n: int, width: int, device) -> tuple:
    """(buffer, StepTensors) of the graphs of ``batch`` rows of ``n`` tokens: one int32 buffer holding
    ``GRAPH_FIELDS`` in order (``width`` block-table columns), then ``GRAPH_INDEX_FIELDS``, the tensors
    its slices, each starting 16-byte aligned like a tensor of its own (Triton specialises kernels on
    pointer alignment: an eager step of the same shape then runs the graph's kernel variants)."""
    fields = graph_field_slices(batch, n, width)
    buffer = torch.zeros(fields[-1][1].stop, dtype=torch.int32, device=device)
    dev = {name: buffer[span] for name, span in fields}
    tensors = StepTensors(input_ids=dev["input_ids"], positions=dev["positions"], slot_mapping=dev["slot_mapping"],
                          seq_lens=dev["seq_lens"], block_table=dev["block_table"].view(batch, width),
                          logits_rows=torch.arange(batch * n, dtype=torch.int32, device=device))
    return buffer, tensors


class _DecodeGraphs:
    """Pure decode steps replayed from CUDA graphs, one per (padded batch, query tokens per
    row, block-table bound): plain decode steps have one token a row, speculative verify
    steps ``k + 1`` (every token's logits are returned).

    Each (batch, tokens per row) has static inputs: one device int32 buffer holding the
    step's metadata and the indices of the eager ops around the replay (``GRAPH_INDEX_FIELDS``),
    filled by ONE copy from a pinned host buffer per step. With an
    EAGLE-3 draft the graphs also output the aux hidden states of every token row.
    The first step of each key runs eagerly on the static inputs (its result is
    used; it also compiles the kernels and creates the persistent maps and
    workspaces the graph points at), then the graph is captured; later steps
    with that key replay it. Under tensor parallelism every rank captures and
    replays the same keys in the same order (they run the same steps), its
    all-reduces inside its graph.
    """

    def __init__(self, runner: RankRunner):
        self.runner = runner
        self.mempool = torch.cuda.graph_pool_handle()
        # (batch, n) -> (pinned host buffer, its numpy views, device buffer, StepTensors, the device views
        # of GRAPH_INDEX_FIELDS, copy event)
        self.inputs: dict = {}
        self.graphs: dict = {}   # (batch, n, block bound) -> (CUDAGraph, logits or hidden states)

    def static_inputs(self, batch: int, n: int) -> StepTensors:
        """The device tensors the graphs of ``batch`` rows of ``n`` tokens read (made on first use)."""
        return self._static(batch, n)[3]

    def _static(self, batch: int, n: int):
        if (batch, n) not in self.inputs:
            buffer, tensors = graph_inputs(batch, n, self.runner.max_blocks, self.runner.device)
            host = torch.zeros(buffer.shape, dtype=torch.int32, pin_memory=True)
            fields = graph_field_slices(batch, n, self.runner.max_blocks)
            host_views = {name: host[span].view(torch.int64 if name in GRAPH_INDEX_FIELDS else torch.int32).numpy()
                          for name, span in fields}
            indices = {name: buffer[span].view(torch.int64) for name, span in fields if name in GRAPH_INDEX_FIELDS}
            self.inputs[batch, n] = (host, host_views, buffer, tensors, indices, torch.cuda.Event())
        return self.inputs[batch, n]

    def _forward(self, tensors: StepTensors, plan):
        return self.runner.model.forward(tensors, plan, self.runner.caches, self.runner.aux_layers)

    def run(self, step: Step, carried: Optional[torch.Tensor] = None):
        """-> logits ``[len(step.logits_indices), vocab]`` of a pure decode or verify step. With the
        runner's ``aux_layers``: ``(logits, aux)``, ``aux`` the
        graph's static output buffer (every token row of the step). ``carried``: the previous step's
        sampled tokens, for ``step.carry_from`` (written into the static input ids before the replay)."""
        gen = step.plan.generation
        batch, n, bound = gen.num_rows, gen.decode_query_len, gen.max_blocks
        device = self.runner.device
        host, views, buffer, static, indices, copied = self._static(batch, n)
        copied.synchronize()   # the previous step's upload from these host buffers is done
        for name in GRAPH_FIELDS:
            views[name][:] = getattr(step, name).reshape(-1)
        num_rows = len(step.logits_indices)
        views["rows"][:num_rows] = step.logits_indices
        if carried is not None:
            into, source = carry_indices(step.carry_from)
            views["carry_into"][:len(into)] = into
            views["carry_from"][:len(into)] = source
        buffer.copy_(host, non_blocking=True)   # the inputs and the indices: one copy
        copied.record()
        if carried is not None:
            carry_tokens(static.input_ids, indices["carry_into"][:len(into)], indices["carry_from"][:len(into)],
                         carried)
        rows = indices["rows"][:num_rows]
        key = (batch, n, bound)
        if key not in self.graphs:
            out = self._forward(static, step.plan)   # eager warm-up: a real step
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of OTHER host threads (JAX/XLA's runtime threads in a process that
            # also runs JAX, NCCL watchdogs) do not invalidate this capture; this thread's still do
            with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
                captured = self._forward(static, step.plan)
            self.graphs[key] = (graph, captured)
        else:
            graph, out = self.graphs[key]
            graph.replay()
        if self.runner.aux_layers:
            logits, aux = out
            return logits.index_select(0, rows), aux
        return out.index_select(0, rows)

    def release(self):
        """Free the captured graphs. Under tensor parallelism every rank must do this BEFORE the
        process group is destroyed: a graph holding NCCL kernels keeps its communicator alive, and
        NCCL's destroy then waits forever (pytorch/pytorch#115388). Also drops the static inputs and the
        link back to the runner: runner and graphs refer to each other, and the cycle would keep the
        runner's weights and pool alive until Python's cycle collector runs."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.inputs.clear()
        self.runner = None
