"""The torch model runner behind ``m3_torch.LLM`` (the engine itself is ``m3_engine``).

:class:`TorchRunner` puts the weights and the pool on the device (rank 0's
:class:`m3_torch.rank.RankRunner`, plus ``tensor_parallel_size - 1`` worker
processes from ``m3_torch.tp``), runs each step the engine schedules (CUDA
graphs for pure decode steps on a GPU) and samples with the shared sampling
kernel (``m3_torch.sample``) on rank 0 (under tensor parallelism every rank
ends a step with the whole logits, gathered from the vocab-parallel head). Its
:attr:`TorchRunner.buckets` pads pure decode steps to ``graph_batch_sizes``
where CUDA graphs replay them (a GPU, without ``enforce_eager``) and nothing
else: prefill and mixed steps run eagerly at their own shape. With an
EAGLE-3 draft (one rank) each step also returns the target's aux hidden
states, and :meth:`TorchRunner.propose` runs the draft on them, eagerly
(``m3_torch.eagle3.Eagle3Proposer``).

:meth:`TorchRunner.warm_up` (``precompile``) makes, before the engine is
ready, every program key (:func:`program_keys`) a step can have: every CUDA
graph (padded decode batch x tokens per row x block bound), and for the eager
steps every context span (block bound x row-tile class) and generation span
(rows x tokens per row x block bound). On a GPU it first compiles the Triton
kernel variants of all those steps at once, in parallel threads, without
running them (``RankRunner.compile_kernels``; into the persistent cache of
``m3_engine.compile_cache``), then captures the graphs; the eager steps need
nothing more, so none of them runs.
:attr:`TorchRunner.cold_programs` lists the keys of later steps outside the
warm-up's set (empty when the set is whole).

:meth:`TorchRunner.submit` queues a step's forward, then fills its late token
bitmask on the host while the device runs it (``m3_engine.runner``), then queues
its sampling (its parameters and the mask in one copy from pinned memory:
``m3_torch.staging``) and the copy of its sampled outputs into pinned host
memory, and records an event after them;
:meth:`TorchRunner.result` waits for that event. A step scheduled while the one
before it runs (async scheduling, one rank) takes its carried input ids from
that step's sampled tokens on the device (``m3_torch.rank.carry_tokens``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Optional

import numpy as np
import torch

from m3_engine.args import CheckedArgs, check_gpu_device
from m3_engine.buckets import StepBuckets, StepShape, block_bounds
from m3_engine.runner import SampleResult, SamplingBatch
from m3_engine.scheduler import DraftPass
from m3_engine.step_inputs import Step, StepBuilder
from m3_engine.structured_outputs import bitmask_width
from m3_kernels.maps import PAGE_SIZE

from . import tp
from .eagle3 import Eagle3Draft, Eagle3Proposer
from .model import StepTensors
from .rank import DTYPES, RankRunner
from .sampling import apply_token_bitmask, sample
from .staging import upload

__all__ = ["TorchRunner"]


def resolve_device(args: CheckedArgs) -> torch.device:
    """Rank 0's device: the CUDA device asked for (with its index), a GPU when there is one, else the CPU."""
    size = args.tp.size
    if args.device_object is not None:
        device = args.device_object
        if not isinstance(device, torch.device):
            raise TypeError(f"device: expected None, a string or a torch.device, got {type(device).__name__}")
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"device: expected a CUDA device or the CPU, got {device}")
        platform, index = ("gpu", device.index) if device.type == "cuda" else ("cpu", None)
        shown = str(device)
    else:
        platform, index, shown = args.platform, args.device_index, args.device
        if platform is None:
            platform = "gpu" if torch.cuda.is_available() else "cpu"
            shown = "cuda" if platform == "gpu" else "cpu"
    if platform == "cpu":
        return torch.device("cpu")
    if index is None and size == 1 and torch.cuda.is_available():
        index = torch.cuda.current_device()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return torch.device("cuda", check_gpu_device(shown, index, count, size))


class TorchRunner:
    """The torch side of an engine (``m3_engine.runner.Runner``). ``args``: the checked options.
    On a GPU without ``num_gpu_blocks_override`` the KV pool holds what ``gpu_memory_utilization``
    of the GPU leaves after the weights (``m3_torch.rank.RankRunner``); :attr:`scheduler_config`
    is ``args.scheduler`` with the pool's pages."""

    def __init__(self, args: CheckedArgs):
        self.tp = args.tp
        self.device = resolve_device(args)
        sc = args.scheduler
        # decode steps are padded to graph batch sizes only where CUDA graphs replay them
        self.buckets = StepBuckets.from_config(sc, args.speculative, pad_prefill=False,
                                               pad_decode=self.device.type == "cuda" and not args.enforce_eager)
        # on a GPU without num_gpu_blocks_override every rank sizes its pool from its memory after the weights
        sized = self.device.type == "cuda" and args.num_gpu_blocks_override is None
        runner_args = dict(model_dir=str(args.model_dir), dtype=DTYPES[args.dtype] if args.dtype else None,
                           num_slots=None if sized else sc.num_slots, max_blocks=sc.max_blocks,
                           gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=sc.max_context,
                           cuda_graphs=bool(self.buckets.decode_batch_sizes),
                           kv_cache_dtype=args.kv_cache_dtype, index_cache_dtype=args.index_cache_dtype,
                           load_format=args.load_format, seed=args.seed, quantization=args.quantization,
                           checkpoint_quantization=args.checkpoint_quantization,
                           compile_cache_dir=args.compile_cache_dir)
        self._workers = None
        all_reduce = all_gather = None
        if self.tp.size > 1:
            # the worker processes start now and load their slices while rank 0 loads its own
            self._workers = tp.Workers(self.tp, self.device, runner_args)
            all_reduce, all_gather = tp.all_reduce, tp.all_gather
        aux_layers = args.draft.aux_layer_ids if args.draft is not None else ()   # eagle3: one rank (args)
        try:
            self.rank0 = RankRunner(tp=self.tp, rank=0, device=self.device, all_reduce=all_reduce,
                                    all_gather=all_gather, aux_layers=aux_layers, **runner_args)
            if self._workers is not None:
                if self.rank0.graphs is not None:   # freed before the group goes, also when a step fails
                    self._workers.before_destroy = self.rank0.graphs.release
                self._workers.wait_ready()
        except BaseException:
            if self._workers is not None:
                self._workers.close(force=True)
            raise
        r = self.rank0
        self.dtype, self.model, self.layout, self.pool, self.caches, self.graphs = \
            r.dtype, r.model, r.layout, r.pool, r.caches, r.graphs
        self.scheduler_config = sc = dataclasses.replace(sc, num_slots=self.layout.num_slots)
        self.proposer = None
        if args.draft is not None:
            draft = Eagle3Draft.load(args.speculative.model, args.config, dtype=self.dtype, device=self.device,
                                     target_embed=self.model.embed, target_lm_head=self.model.lm_head)
            self.proposer = Eagle3Proposer(draft, num_slots=sc.num_slots,
                                           step_config=self.buckets.planner_config(args.step_config()),
                                           num_speculative_tokens=args.speculative.num_speculative_tokens,
                                           kv_cache_dtype=args.kv_cache_dtype)
        self._aux = None   # eagle3: (the last step, its aux hidden states)
        self.warm_programs: Optional[set] = None   # program_keys run by warm_up (None: no warm-up)
        self.cold_programs: list = []              # keys of steps run since that the warm-up did not run

    # -- the protocol ----------------------------------------------------------------------------

    def submit(self, step: Step, sampling: SamplingBatch, previous: Optional["SubmittedStep"] = None) \
            -> "SubmittedStep":
        """Queue ``step``'s forward, then (its late token bitmask filled on the host meanwhile) its sampling
        and the copy of the sampled outputs to the host; returns without waiting for the device.
        ``previous``: the step submitted before it, when ``step.carry_from`` takes its tokens."""
        if self.rank0 is None:
            raise RuntimeError("this LLM is closed (close() was called)")
        carried = None
        if step.carry_from is not None:
            if previous is None:
                raise ValueError("previous: expected the step submitted before (step.carry_from takes its sampled "
                                 "tokens), got None")
            carried = previous.tokens
        if self.warm_programs is not None:
            self.cold_programs += [k for k in program_keys(step, self.graphs is not None)
                                   if k not in self.warm_programs]
        logits = self.step_logits(step, carried)   # queued on the stream: the host goes on
        return SubmittedStep.start(sample_on_device(logits, sampling.with_token_bitmask()))

    def result(self, handle: "SubmittedStep") -> SampleResult:
        """Wait for a submitted step -> its sampled outputs (numpy)."""
        return handle.wait()

    def execute(self, step: Step, sampling: SamplingBatch) -> SampleResult:
        return self.result(self.submit(step, sampling))

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def warm_up(self, builder: StepBuilder) -> dict:
        """Make every program of ``warm_up_shapes`` (on every rank). On a GPU, first every Triton kernel
        variant of every shape is compiled, in parallel threads, without running a step
        (``RankRunner.compile_kernels``: ``compile``), then each CUDA graph is captured (its eager
        run and its capture: ``capture``); eager steps of the other shapes need nothing more. On the
        CPU (Triton's interpreter: nothing to compile) each shape's step runs once (``compile``). The
        steps read slot 0 and write nothing."""
        from tqdm.auto import tqdm

        graphs = self.graphs is not None
        steps = [builder.dummy(shape, kv_len) for shape, kv_len in
                 warm_up_shapes(self.buckets, self.rank0.max_blocks, graphs)]
        keys = [program_keys(step, graphs) for step in steps]
        times = dict(compile=0.0, capture=0.0)
        start = time.perf_counter()
        if self.on_gpu:
            threads = max(1, (os.cpu_count() or 1) // self.tp.size)
            self.collective_rpc(compile_kernels_on_rank, [tp.portable(step) for step in steps], threads)
            self.compile_sampling(threads)
            torch.cuda.synchronize(self.device)
            times["compile"] = time.perf_counter() - start
            captured = [step for step, k in zip(steps, keys) if k[0][0] == "graph"]
            start = time.perf_counter()
            for step in tqdm(captured, desc="Capturing CUDA graphs (torch)", unit="graph"):
                self.step_logits(step)
            torch.cuda.synchronize(self.device)
            times["capture"] = time.perf_counter() - start
        else:
            for step in tqdm(steps, desc="Running step programs (torch)", unit="step"):
                self.step_logits(step)
            times["compile"] = time.perf_counter() - start
        self.warm_programs = {k for step_keys in keys for k in step_keys}
        self._aux = None
        return dict(programs=len(steps), **times)

    def compile_sampling(self, threads: int) -> None:
        """Compile every variant of the sampling kernel (:func:`sampling_variants`) in ``threads`` threads,
        launching none (rank 0 samples). A GPU only."""
        from .ops import compile_only

        logits = torch.zeros((1, self.model.config.vocab_size), dtype=torch.float32, device=self.device)
        with compile_only(threads):
            for batch in sampling_variants(logits.shape[1]):
                sample_on_device(logits, batch)

    def propose(self, work: DraftPass) -> np.ndarray:
        """EAGLE-3: the draft after the step just executed (``work.step``) -> drafts ``[n, k]`` int32."""
        if self.proposer is None:
            raise RuntimeError("propose: this engine has no EAGLE-3 draft (speculative_config method 'eagle3')")
        if self._aux is None or self._aux[0] is not work.step:
            raise RuntimeError("propose: expected the DraftPass of the step executed last")
        aux, self._aux = self._aux[1], None
        return self.proposer.propose(work, aux)

    def close(self) -> None:
        """End the worker processes (tensor parallelism), free the graphs, and drop the weights, the pool
        and the caches (their memory goes back to the device: a next engine in this process can take
        it). Idempotent."""
        if self._workers is not None:
            self._workers.close()   # frees rank 0's graphs first (before_destroy)
        if self.graphs is not None:
            self.graphs.release()
        self.rank0 = self.model = self.pool = self.caches = self.graphs = self.proposer = self._aux = None
        if self.on_gpu:
            torch.cuda.empty_cache()

    # -- steps -----------------------------------------------------------------------------------

    def step_logits(self, step: Step, carried: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run one scheduler step (on every rank) -> float32 logits ``[len(step.forward_logits_indices), vocab]``
        (with an EAGLE-3 draft, the step's aux hidden states are kept for :meth:`propose`). ``carried``:
        the previous step's sampled tokens on the device, when ``step.carry_from`` takes some (one rank)."""
        if self._workers is not None:
            return self._workers.run_step(step, self.rank0)
        if self.proposer is None:
            return self.rank0.run(step, carried).float()
        logits, aux = self.rank0.run(step)
        self._aux = (step, aux)
        return logits.float()

    def step_tensors(self, step: Step, logits_rows: Optional[np.ndarray] = None) -> StepTensors:
        """A step's numpy metadata on rank 0's device."""
        return self.rank0.step_tensors(step, logits_rows)

    def collective_rpc(self, fn: Callable, *args) -> list:
        """``[fn(runner, *args) for every rank's RankRunner]``, rank 0's first: a debugging and test hook.
        ``fn`` must be picklable by reference (a module-level function)."""
        if self._workers is None:
            return [fn(self.rank0, *args)]
        return self._workers.call(fn, args, self.rank0)


def compile_kernels_on_rank(rank: RankRunner, steps: list, threads: int) -> int:
    """``rank.compile_kernels(steps, threads)`` on one rank (``TorchRunner.collective_rpc``); rank 0
    shows the progress bar."""
    return rank.compile_kernels(steps, threads, progress=rank.rank == 0)


def program_keys(step: Step, graphs: bool) -> tuple:
    """What picks the programs of a step: ``("graph", rows, tokens per row, block bound)`` for a step
    replayed from a CUDA graph; else one key per span, ``("context", block bound, index row tile's
    tokens)`` and ``("generation", rows, tokens per row, block bound)`` (the kernels of a span follow
    from these; a span's launches are its own, whatever the other span holds)."""
    plan = step.plan
    ctx, gen = plan.context, plan.generation
    if graphs and plan.cuda_graph:
        return (("graph", gen.num_rows, gen.decode_query_len, gen.max_blocks),)
    keys = ()
    if ctx.num_rows:
        tile, _ = ctx.prefill.tiles(plan.config.num_kv_heads, "index")
        keys += (("context", ctx.max_blocks, tile.tokens_per_tile),)
    if gen.num_rows:
        keys += (("generation", gen.num_rows, gen.decode_query_len, gen.max_blocks),)
    return keys


def sampling_variants(vocab: int) -> list:
    """One-row ``SamplingBatch`` es that launch, between them, every variant of the sampling kernel over
    ``vocab`` logits (its constexprs: with or without penalties, with or without a token bitmask; the
    row count and the logits' stride are run-time values)."""
    greedy = SamplingBatch.greedy(1)
    ids = np.zeros((1, 1), np.int32)
    penalties = dict(repetition_penalty=np.ones(1, np.float32), presence_penalty=np.zeros(1, np.float32),
                     frequency_penalty=np.zeros(1, np.float32), prompt_ids=ids, output_ids=ids)
    mask = dict(token_bitmask=np.full((1, bitmask_width(vocab)), -1, np.int32))
    return [greedy, dataclasses.replace(greedy, **penalties), dataclasses.replace(greedy, **mask),
            dataclasses.replace(greedy, **penalties, **mask)]


def warm_up_shapes(buckets: StepBuckets, max_blocks: int, graphs: bool) -> list:
    """``(StepShape, kv_len)`` of the warm-up's steps: for every block bound (``kv_len`` = its
    tokens), each CUDA graph (``graphs``: the padded pure generation shapes), a context row of each
    power of two of query tokens up to the prefill chunk (row-tile classes, attention split counts,
    the norm, router and MoE tunings by token count), and each
    generation part (rows, tokens per row) of the policy beside a one-token context row (where it
    fits; else alone) that no graph holds."""
    longest = min(buckets.prefill_chunk, buckets.max_num_tokens)
    work = []
    for bound in block_bounds(max_blocks):
        kv_len = bound * PAGE_SIZE
        tokens = 1
        while tokens <= min(longest, kv_len):   # the context rows: row-tile classes, split counts, MoE sizes
            work.append((StepShape(1, tokens, 0, 0), kv_len))
            tokens *= 2
        for rows, n in buckets.generation_parts():
            if not rows:
                continue
            alone = buckets.shape(0, 0, rows, n)
            if graphs and alone.generation_rows in buckets.decode_batch_sizes:
                work.append((alone, kv_len))   # a graph (pure generation steps of these rows)
            if rows < buckets.max_batch and rows * n < buckets.max_num_tokens:
                work.append((StepShape(1, 1, rows, n), kv_len))   # eager, beside a context row
            elif not (graphs and alone.generation_rows in buckets.decode_batch_sizes):
                work.append((alone, kv_len))   # eager, alone
    return list(dict.fromkeys(work))


@dataclasses.dataclass(eq=False)
class SubmittedStep:
    """A step queued on the device (``TorchRunner.submit``): its sampled ``tokens`` there (the next step
    may carry them), the host copies of its outputs (``SampleResult`` fields; pinned memory on a GPU,
    filled by copies queued after the step) and the event recorded after those copies (None on a CPU:
    the copies are done when they return)."""
    tokens: torch.Tensor
    host: dict
    copied: Optional[torch.cuda.Event]

    @classmethod
    def start(cls, outputs: dict) -> "SubmittedStep":
        """Queue the copies of ``outputs`` (``sample_on_device``'s) to the host."""
        tokens = outputs["tokens"]
        if not tokens.is_cuda:
            return cls(tokens, outputs, None)
        host = {name: None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
            t, non_blocking=True) for name, t in outputs.items()}
        copied = torch.cuda.Event()
        copied.record()
        return cls(tokens, host, copied)

    def wait(self) -> SampleResult:
        if self.copied is not None:
            self.copied.synchronize()
        return SampleResult(**{name: None if t is None else t.numpy() for name, t in self.host.items()})


def sample_logits(logits: torch.Tensor, s: SamplingBatch) -> SampleResult:
    """The shared sampling kernel on float32 ``logits [L, V]`` (+ top-N logprobs when asked), on the host."""
    return SubmittedStep.start(sample_on_device(logits, s.with_token_bitmask())).wait()


def sample_on_device(logits: torch.Tensor, s: SamplingBatch) -> dict:
    """The shared sampling kernel on float32 ``logits [L, V]`` (+ top-N logprobs when asked) -> the
    ``SampleResult`` fields as tensors on the logits' device (None where not asked). ``s``: its token
    bitmask given (``SamplingBatch.with_token_bitmask``). With
    ``s.prompt_targets`` the logits have ``P`` prompt rows after the ``L`` sampled ones
    (``Step.forward_logits_indices``): the ``prompt_*`` fields come from them (:func:`prompt_logprobs`)."""
    num_sampled = len(s.temperature)
    penalties = s.penalties()
    # the parameters, bitmask, prompt targets and penalties: one copy
    (temperature, top_k, top_p, min_p, seeds, counters, token_bitmask, targets, *penalty_values) = upload(
        [s.temperature, s.top_k, s.top_p, s.min_p, s.seeds, s.counters, s.token_bitmask, s.prompt_targets,
         *penalties.values()], logits.device)
    prompt = {} if targets is None else prompt_logprobs(logits[num_sampled:], targets, s.num_prompt_logprobs)
    logits = logits[:num_sampled]
    tokens, logprobs, lse = sample(logits, temperature, top_k, top_p, min_p, seeds, counters,
                                   token_bitmask=token_bitmask, **dict(zip(penalties, penalty_values)))
    top_ids = top_logprobs = ranks = None
    if s.num_logprobs is not None:
        if token_bitmask is not None:   # logprobs and ranks over the masked logits, as the sampled token's
            logits = apply_token_bitmask(logits, token_bitmask)
        chosen = logits.gather(1, tokens.long()[:, None])
        ranks = ((logits > chosen).sum(dim=1) + 1).int()
        if s.num_logprobs > 0:
            values, ids = _top(logits, s.num_logprobs)
            top_ids, top_logprobs = ids.int(), values - lse[:, None]
    return dict(tokens=tokens, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs, ranks=ranks,
                **prompt)


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, num_prompt_logprobs: int) -> dict:
    """The ``SampleResult.prompt_*`` fields (tensors on the logits' device) from float32 ``logits [P, V]``
    of the step's prompt rows and their ``targets [P]`` (``SamplingBatch.prompt_targets`` on the device):
    each target's raw logprob (``logit - logsumexp``) and rank, and the top ``num_prompt_logprobs``."""
    targets = targets.long()
    lse = torch.logsumexp(logits, dim=1)
    chosen = logits.gather(1, targets[:, None])
    out = dict(prompt_logprobs=chosen[:, 0] - lse, prompt_ranks=((logits > chosen).sum(dim=1) + 1).int())
    if num_prompt_logprobs > 0:
        values, ids = _top(logits, num_prompt_logprobs)
        out.update(prompt_top_ids=ids.int(), prompt_top_logprobs=values - lse[:, None])
    return out


def _top(logits: torch.Tensor, n: int):
    """The ``n`` largest logits per row and their ids, ties to the lower id (a stable descending sort)."""
    values, ids = torch.sort(logits, dim=1, descending=True, stable=True)
    return values[:, :n], ids[:, :n]
