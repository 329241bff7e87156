"""``m3_torch.LLM``: generate with a MiniMax-M3 text checkpoint on this project's kernels.

    llm = m3_torch.LLM("path/to/model", dtype="bfloat16", max_batch=8)
    outputs = llm.generate([[1, 2, 3], [1, 5]], max_new_tokens=16)     # new token ids per prompt

The loop is the framework-neutral :class:`m3_kernels.scheduler.Scheduler`
(continuous batching over the flat sub-page pool, chunked prefill, mixed steps,
slots freed when a request finishes); this file only moves each step's numpy
metadata to the device, runs :class:`m3_torch.model.M3Model` and samples.
On a GPU, pure decode steps (padded by the scheduler to ``graph_batch_sizes``)
replay CUDA graphs, one per (padded batch, block-table bound): the first step
of each runs eagerly (its result is used; it compiles the kernels and builds
the persistent maps and workspaces), then the graph is captured for the next
ones. Prefill and mixed steps run eagerly. On a CPU everything runs eagerly
(the kernels through Triton's interpreter).

Tensor parallelism (``tensor_parallel_size=N``): the model splits as
``m3_kernels.tp`` says; this process is rank 0 (scheduler, sampling,
``lm_head``) and ``m3_torch.tp`` spawns and drives the N-1 workers. Each rank
is a :class:`Runner` (its weight slices, its pool, its graphs); plans are made
for one rank's heads, and every rank runs every step.

Sampling: greedy at ``temperature == 0``; otherwise softmax of
``logits / temperature`` restricted to the top-``p`` nucleus, drawn with a
``torch.Generator`` seeded from ``(seed, prompt index, output index)``, so a
request's sampled tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch
# torch imports torch._dynamo on the first custom-op call, and torch.fx.wrap, run by that import, leaves a
# frame cycle holding the calling stack until the garbage collector runs: imported from inside an engine's
# first step, a dropped LLM kept its pool (and its workers) that long. Imported here, only module frames.
import torch._dynamo  # noqa: F401

import m3_torch
from m3_kernels import checkpoint
from m3_kernels.model_config import load_config
from m3_kernels.planner import StepConfig, StepPlanner
from m3_kernels.pool import PoolLayout
from m3_kernels.scheduler import Scheduler, SchedulerConfig, Step
from m3_kernels.tp import TPPlan

from .model import M3Model, StepTensors

__all__ = ["LLM", "Runner"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype, checkpoint_dtype: Optional[str]) -> torch.dtype:
    """``None`` (the checkpoint's), a torch dtype or its name -> a torch float dtype."""
    if dtype is None:
        return DTYPES[checkpoint_dtype] if checkpoint_dtype is not None else None
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name not in DTYPES:
            raise ValueError(f"dtype: expected one of {tuple(DTYPES)}, got {dtype!r}")
        return DTYPES[name]
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype: expected one of {tuple(DTYPES.values())}, got {dtype}")
        return dtype
    raise TypeError(f"dtype: expected None, a torch dtype or its name, got {type(dtype).__name__}")


def resolve_device(device, tensor_parallel_size: int = 1) -> torch.device:
    """None (``cuda`` when available, else ``cpu``), a string or a ``torch.device`` -> rank 0's device
    (CUDA: with an index; rank ``r`` of a tensor-parallel engine uses index + r)."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device() if tensor_parallel_size == 1 else 0)
        if device.index + tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(f"device: tensor_parallel_size={tensor_parallel_size} from {device} needs CUDA devices "
                             f"{device.index}..{device.index + tensor_parallel_size - 1}, this process sees "
                             f"{torch.cuda.device_count()}")
    elif device.type != "cpu":
        raise ValueError(f"device: expected a CUDA device or 'cpu', got {device}")
    return device


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of tensor-parallel rank ``rank`` when rank 0 runs on ``device``."""
    return device if device.type == "cpu" else torch.device("cuda", device.index + rank)


class LLM:
    """A MiniMax-M3 text model ready to generate.

    model_dir:       config.json + safetensors (transformers ``save_pretrained``
                     form or the original MiniMax-M3 VL checkpoint; see
                     ``m3_kernels.checkpoint``).
    dtype:           weights, activations and KV cache: None (the checkpoint's),
                     ``torch.bfloat16``/``float16``/``float32`` or its name.
    device:          None (``cuda`` when available, else ``cpu``), a string or a ``torch.device``;
                     with tensor parallelism, rank 0's (rank ``r`` uses the CUDA
                     device ``r`` places after it; on a CPU every rank uses the CPU).
    max_batch:       requests per step (decode batch).
    max_context:     KV tokens per request, prompt and generated tokens together
                     (default ``min(8192, max_position_embeddings)``).
    max_cache_pages: pool slots of 128 tokens (default: ``max_batch`` requests of
                     ``max_context`` tokens); fewer than one request of
                     ``max_context`` needs is a ``ValueError``. With tensor
                     parallelism every rank has this many slots of its own heads.
    prefill_chunk:   prompt tokens per request per step (chunked prefill; default
                     ``max_num_tokens``).
    max_num_tokens:  query tokens per step (default: the scheduler's, ``max(2048, max_batch)``).
    cuda_graphs:     replay pure decode steps from CUDA graphs (GPU only; default True).
    graph_batch_sizes: decode batch sizes captured (default ``m3_kernels.scheduler.default_graph_batch_sizes``).
    tensor_parallel_size: ranks the model is split over (``m3_kernels.tp``: heads,
                     expert rows, all-reduces); > 1 spawns that many - 1 worker
                     processes (``m3_torch.tp``), ended by :meth:`close` (or the
                     ``with`` block). A split that does not exist (e.g. 3 KV heads
                     over 2 ranks) is a ``ValueError`` here, before anything starts.
    kv_cache_dtype, index_cache_dtype: the K/V and index-K caches' element type:
                     ``"auto"`` (the model's dtype) or ``"fp8"`` / ``"float8_e4m3fn"``
                     (``m3_kernels.pool``). FP8 K/V use scale 1.0 on every layer
                     (stored = saturate(x), as vLLM without calibrated scales);
                     index-K is unscaled (its rows are RMS-normalised).
    """

    def __init__(self, model_dir, *, dtype=None, device=None, max_batch: int = 8, max_context: Optional[int] = None,
                 max_cache_pages: Optional[int] = None, prefill_chunk: Optional[int] = None,
                 max_num_tokens: Optional[int] = None, cuda_graphs: bool = True,
                 graph_batch_sizes: Optional[Sequence[int]] = None, tensor_parallel_size: int = 1,
                 kv_cache_dtype: str = "auto", index_cache_dtype: str = "auto"):
        self._workers = None
        self._closed = False
        self.config = c = load_config(model_dir)
        self.tp = TPPlan(c, tensor_parallel_size)
        self.device = resolve_device(device, self.tp.size)
        use_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.scheduler_config = SchedulerConfig.from_engine_args(
            c, max_batch=max_batch, max_context=max_context, max_cache_pages=max_cache_pages,
            max_num_tokens=max_num_tokens, prefill_chunk=prefill_chunk,
            graph_batch_sizes=graph_batch_sizes if use_graphs else ())
        sc = self.scheduler_config
        self.planner = StepPlanner(StepConfig(   # one rank's heads: every rank runs the plans made here
            num_q_heads=self.tp.num_q_heads, num_kv_heads=self.tp.num_kv_heads, head_dim=c.head_dim,
            max_batch=sc.max_batch, max_num_tokens=sc.max_num_tokens, max_blocks=sc.max_blocks,
            topk=c.index_topk_blocks, graph_batch_sizes=sc.graph_batch_sizes))
        dtype = resolve_dtype(dtype, c.dtype)
        runner_args = dict(model_dir=str(model_dir), dtype=dtype, num_slots=sc.num_slots, max_blocks=sc.max_blocks,
                           cuda_graphs=bool(sc.graph_batch_sizes), kv_cache_dtype=kv_cache_dtype,
                           index_cache_dtype=index_cache_dtype)
        all_reduce = None
        if self.tp.size > 1:
            from . import tp   # the worker processes start now and load their slices while rank 0 loads its own
            self._workers = tp.Workers(self.tp, self.device, runner_args)
            all_reduce = tp.all_reduce
        try:
            self.runner = Runner(tp=self.tp, rank=0, device=self.device, all_reduce=all_reduce, **runner_args)
            if self._workers is not None:
                if self.runner.graphs is not None:   # freed before the group goes, also when a step fails
                    self._workers.before_destroy = self.runner.graphs.release
                self._workers.wait_ready()
        except BaseException:
            self._closed = True
            if self._workers is not None:
                self._workers.close(force=True)
            raise
        r = self.runner
        self.dtype, self.model, self.layout, self.pool, self.caches, self.graphs = \
            r.dtype, r.model, r.layout, r.pool, r.caches, r.graphs
        self.scheduler: Optional[Scheduler] = None   # the one of the running (or last) generate call

    # -- life cycle ------------------------------------------------------------------------------

    def close(self):
        """End the worker processes (tensor parallelism) and the process group; later calls
        of :meth:`generate` raise. Idempotent; also run by ``with LLM(...) as llm:`` and at exit."""
        self._closed = True
        if self._workers is not None:
            self._workers.close()   # frees rank 0's graphs first (before_destroy)
        if getattr(self, "graphs", None) is not None:
            self.graphs.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_workers", None) is not None:
            self.close()

    def collective_rpc(self, fn: Callable, *args) -> list:
        """``[fn(runner, *args) for every rank's Runner]``, rank 0's first: a debugging and
        test hook (inspect a rank's weights or pool). ``fn`` must be picklable by reference
        (a module-level function); an exception in a worker ends the engine."""
        self._check_open()
        if self._workers is None:
            return [fn(self.runner, *args)]
        return self._workers.call(fn, args, self.runner)

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this LLM is closed (close() was called, or a tensor-parallel rank failed)")

    # -- generation ------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, temperature: float = 0.0,
                 top_p: float = 1.0, seed: Optional[int] = None, *,
                 progress: Optional[Callable[[int], None]] = None) -> list[list[int]]:
        """New token ids per prompt (lists of token ids), generation stopping at the
        config's eos ids (kept), ``max_new_tokens`` or ``max_context``.

        temperature: 0 for greedy, else the softmax temperature.
        top_p:       nucleus mass in (0, 1].
        seed:        int >= 0 for reproducible sampling (None: fresh randomness).
        progress:    called with the number of tokens generated after each step.

        Bad input (empty prompt, one longer than ``max_context``, a token id outside
        the vocabulary, ``max_new_tokens < 1``, bad sampling parameters) raises
        ``ValueError``/``TypeError`` before any work (no rank sees a step).
        """
        self._check_open()
        temperature, top_p = _check_sampling(temperature, top_p)
        if seed is None:
            seed = int(np.random.SeedSequence().entropy % (1 << 63))
        elif isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed: expected None or an int >= 0, got {seed!r}")
        self.scheduler = scheduler = Scheduler(self.scheduler_config, self.config, planner=self.planner)
        ids = scheduler.add_requests(prompts, max_new_tokens)
        prompt_index = {request_id: i for i, request_id in enumerate(ids)}
        while scheduler.has_unfinished():
            step = scheduler.schedule()
            logits = self.step_logits(step)
            if temperature == 0.0:
                tokens = logits.argmax(dim=-1).tolist()
            else:
                keys = [(int(seed), prompt_index[int(r)], int(o)) for r, o in zip(step.request_ids, step.output_index)]
                tokens = sample(logits, temperature, top_p, keys)
            scheduler.update(step, tokens)
            if progress is not None:
                progress(len(step.request_ids))
        return [scheduler.output(i) for i in ids]

    def step_logits(self, step: Step) -> torch.Tensor:
        """Run one scheduler step (on every rank) -> float32 logits ``[len(step.logits_indices), vocab]``."""
        self._check_open()
        if self._workers is not None:
            return self._workers.run_step(step, self.runner)
        return self.runner.run(step).float()

    def step_tensors(self, step: Step, logits_rows: Optional[np.ndarray] = None) -> StepTensors:
        """A step's numpy metadata on rank 0's device."""
        return self.runner.step_tensors(step, logits_rows)


class Runner:
    """One rank's part of an engine: its weights (its slices under tensor parallelism),
    its pool (its KV heads, the whole index-K), its decode graphs. Rank 0's lives in
    :class:`LLM`, the others' in the worker processes of ``m3_torch.tp``; all run the
    same steps.

    tp, rank:   the tensor-parallel plan and this rank (``TPPlan(config, 1)``, 0: no parallelism).
    dtype:      a torch dtype, or None for the checkpoint tensors' own.
    device:     rank 0's device (this rank's is :func:`rank_device` of it).
    num_slots, max_blocks: pool slots and block-table columns (the scheduler's).
    cuda_graphs: replay pure decode steps from CUDA graphs.
    all_reduce: the model's tensor-parallel hook (``m3_torch.tp.all_reduce``), None on one rank.
    Rank 0 holds ``lm_head`` and returns logits; other ranks compute the hidden
    states only (their ``lm_head`` is never read from the checkpoint).
    """

    def __init__(self, *, model_dir, tp: TPPlan, rank: int, device, dtype, num_slots: int, max_blocks: int,
                 cuda_graphs: bool, kv_cache_dtype: str = "auto", index_cache_dtype: str = "auto",
                 all_reduce: Optional[Callable] = None):
        c = tp.config
        self.rank, self.device, self.max_blocks = rank, rank_device(torch.device(device), rank), max_blocks
        head = rank == 0
        weights, self.dtype = {}, dtype
        for name, w in checkpoint.iter_weights(model_dir, c, framework="pt", concatenate=torch.cat,
                                               device=str(self.device), shard=tp.rank(rank) if tp.size > 1 else None,
                                               skip=() if head else ("lm_head.weight",)):
            self.dtype = self.dtype or w.dtype   # a config without a dtype: the tensors'
            weights[name] = w.to(self.dtype)
        self.model = M3Model(tp.local_config, weights, all_reduce=all_reduce, lm_head=head)
        del weights
        dtype_name = next(n for n, d in DTYPES.items() if d == self.dtype)
        self.layout = PoolLayout.create(num_slots, sparse=c.sparse_layers, num_kv_heads=tp.num_kv_heads,
                                        head_dim=c.head_dim, index_head_dim=c.index_head_dim, dtype=dtype_name,
                                        kv_cache_dtype=kv_cache_dtype, index_cache_dtype=index_cache_dtype)
        self.pool = m3_torch.allocate_pool(self.layout, self.device)
        self.caches = [m3_torch.layer_caches(self.pool, self.layout, i) for i in range(c.num_hidden_layers)]
        self.graphs = _DecodeGraphs(self) if cuda_graphs else None

    def run(self, step: Step) -> Optional[torch.Tensor]:
        """One step -> logits ``[len(step.logits_indices), vocab]`` in the model dtype (rank 0), or
        None (other ranks: the step's cache writes and all-reduces only)."""
        if self.graphs is not None and step.plan.cuda_graph:
            return self.graphs.run(step)
        tensors = self.step_tensors(step)
        if self.model.lm_head is None:
            self.model.hidden_states(tensors, step.plan, self.caches)
            return None
        return self.model.forward(tensors, step.plan, self.caches)

    def step_tensors(self, step: Step, logits_rows: Optional[np.ndarray] = None) -> StepTensors:
        """A step's numpy metadata on this rank's device."""
        def dev(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)

        return StepTensors(input_ids=dev(step.input_ids), positions=dev(step.positions),
                           slot_mapping=dev(step.slot_mapping), block_table=dev(step.block_table),
                           seq_lens=dev(step.seq_lens),
                           logits_rows=dev(step.logits_indices if logits_rows is None else logits_rows))


# -- sampling --------------------------------------------------------------------------------------

def _check_sampling(temperature, top_p):
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    if not (temperature >= 0.0 and np.isfinite(temperature)):
        raise ValueError(f"temperature: expected a finite number >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p: expected a number in (0, 1], got {top_p}")
    return float(temperature), float(top_p)


def sample(logits: torch.Tensor, temperature: float, top_p: float, keys) -> list:
    """One token per row of ``logits [L, V]`` (float32): softmax of ``logits / temperature``
    cut to the smallest set of top tokens whose mass reaches ``top_p``; row ``i`` draws
    with a generator seeded from ``keys[i]`` (a tuple of ints)."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p   # the top token always stays
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    tokens = []
    for row, key in zip(probs, keys):
        seed = int(np.random.SeedSequence(list(key)).generate_state(1, np.uint64)[0] >> 1)
        generator = torch.Generator(device=logits.device).manual_seed(seed)
        tokens.append(int(torch.multinomial(row, 1, generator=generator)))
    return tokens


# -- CUDA graphs -----------------------------------------------------------------------------------

class _DecodeGraphs:
    """Pure decode steps replayed from CUDA graphs, one per (padded batch, block-table bound).

    Each batch size has static inputs: one device int32 buffer holding the
    step's metadata, filled by ONE copy from a pinned host buffer per step.
    The first step of each key runs eagerly on the static inputs (its result is
    used; it also compiles the kernels and creates the persistent maps and
    workspaces the graph points at), then the graph is captured; later steps
    with that key replay it. Under tensor parallelism every rank captures and
    replays the same keys in the same order (they run the same steps), its
    all-reduces inside its graph.
    """

    FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "block_table")

    def __init__(self, runner: Runner):
        self.runner = runner
        self.mempool = torch.cuda.graph_pool_handle()
        self.inputs: dict = {}   # batch size -> (pinned host buffer, its views, device buffer, StepTensors, copy event)
        self.graphs: dict = {}   # (batch size, block bound) -> (CUDAGraph, logits or hidden states)

    def _static(self, batch: int):
        if batch not in self.inputs:
            width, device = self.runner.max_blocks, self.runner.device
            sizes = [batch] * 4 + [batch * width]
            host = torch.zeros(sum(sizes), dtype=torch.int32, pin_memory=True)
            buffer = torch.zeros(sum(sizes), dtype=torch.int32, device=device)
            host_views = dict(zip(self.FIELDS, (t.numpy() for t in host.split(sizes))))
            dev = dict(zip(self.FIELDS, buffer.split(sizes)))
            tensors = StepTensors(input_ids=dev["input_ids"], positions=dev["positions"],
                                  slot_mapping=dev["slot_mapping"], seq_lens=dev["seq_lens"],
                                  block_table=dev["block_table"].view(batch, width),
                                  logits_rows=torch.arange(batch, dtype=torch.int32, device=device))
            self.inputs[batch] = (host, host_views, buffer, tensors, torch.cuda.Event())
        return self.inputs[batch]

    def _forward(self, tensors: StepTensors, plan):
        model = self.runner.model
        if model.lm_head is None:   # a tensor-parallel worker: hidden states only
            return model.hidden_states(tensors, plan, self.runner.caches)
        return model.forward(tensors, plan, self.runner.caches)

    def run(self, step: Step) -> Optional[torch.Tensor]:
        """-> logits ``[len(step.logits_indices), vocab]`` of a pure decode step (one token per row);
        None on a rank without ``lm_head``."""
        batch, bound = step.plan.num_rows, step.plan.generation.max_blocks
        device = self.runner.device
        host, views, buffer, static, copied = self._static(batch)
        copied.synchronize()   # the previous step's upload from these host buffers is done
        for name in self.FIELDS:
            views[name][:] = getattr(step, name).reshape(-1)
        buffer.copy_(host, non_blocking=True)
        copied.record()
        head = self.runner.model.lm_head is not None
        rows = torch.from_numpy(step.logits_indices.astype(np.int64)).to(device, non_blocking=True) if head else None
        key = (batch, bound)
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
        return out.index_select(0, rows) if head else None

    def release(self):
        """Free the captured graphs. Under tensor parallelism every rank must do this BEFORE the
        process group is destroyed: a graph holding NCCL kernels keeps its communicator alive, and
        NCCL's destroy then waits forever (pytorch/pytorch#115388)."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
