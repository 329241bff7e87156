"""The JAX model runner behind ``m3_jax.LLM`` (the engine itself is ``m3_engine``).

The framework-neutral scheduler (``m3_engine.scheduler``) decides each step
(admission, slots, chunked prefill, mixed steps) and the step builder
(``m3_engine.step_inputs``) pads and plans it by this runner's
:attr:`JaxRunner.buckets` (``m3_engine.buckets``: every step padded); this
module only moves the built arrays to the device and runs each step as TWO
jitted programs, one after the other: the **forward** (the model, with the
pool donated: cache writes in place) -> the float32 logits of the step's
logits rows, then the **sampling** of those logits (the shared sampling
kernel, ``m3_jax.sample``) -> the packed sampled outputs. The sampling
arrays are packed on the host while the device runs the forward; a step
whose token bitmask comes late (``SamplingBatch.late_token_bitmask``:
structured outputs, min_tokens, bad_words) has its mask filled there too.
What the forward's compile cache is keyed by:

* **pure decode steps**: the graph batch size (``graph_batch_sizes`` = 1, 2, 4,
  8, then multiples of 16 up to ``max_batch``, as ``m3_torch``'s CUDA graphs).
  The generation span always spans the whole block table (``max_context / 128``
  columns), so no length ever recompiles: one compilation per batch size.
* **steps with context rows** (prefill, mixed): context tokens padded to a
  bucket (8, 12, 16, 24, 32, 48, ...) by one padding context row, context rows
  to a power of two, generation rows to a graph batch size. The context span
  too reads the whole block table, and its row tiles are sized for its padded
  token count (``StepConfig.static_row_tiles``): the key is the padded shape,
  never a length.

So the forwards are exactly one per shape of ``buckets.shapes()`` (a step
asking for prompt logprobs adds its padded prompt rows to the logits rows: a
forward of its own), and the sampling programs one per logits rows and
sampling variant. Sampling parameters key only the sampling program, through
what changes the traced function: whether a row uses penalties (their id
arrays padded to powers of two), whether a row forbids tokens (the token
bitmask), how many top logprobs are asked, and on a step that computes prompt
logprobs, its prompt rows (padded to powers of two) and their top-N.
:meth:`JaxRunner.warm_up` compiles at start (``precompile``) every forward
and the plain (temperature, top-k/p, min-p: arrays, one program per logits
rows) and masked sampling programs; the others compile on their first use.
The persistent compilation cache (``m3_engine.compile_cache``, set up when
the runner starts) keeps them all for the next start.
:attr:`JaxRunner.compiled_forwards` lists the ``StepSpec`` of every
compilation of the forward, :attr:`JaxRunner.compiled_sampling` the key
``(logits rows, packing, num_logprobs, prompt)`` of every compilation of the
sampling.

With ``tensor_parallel_size=N`` the forward runs the model step in
``shard_map`` over a mesh of N devices (``m3_jax.tp``) and returns the logits
replicated on every device, where the sampling runs as on one device; the
scheduler, the padding and the compile keys are unchanged (plans are made
for one shard's heads).

With an EAGLE-3 draft (``speculative_config`` method "eagle3", one device)
the forward also returns the target's aux hidden states, and
:meth:`JaxRunner.propose` runs the draft on them after the step
(``m3_jax.eagle3.Eagle3Proposer``: a jitted first pass per step bucket, a
jitted chain per padded batch size).

:meth:`JaxRunner.submit` dispatches the two programs and starts the copy of
the packed outputs to the host; :meth:`JaxRunner.result` waits for them. With
``async_scheduling`` the forward also takes the previous step's sampled
tokens as a device array of fixed size (the "feed": ``buckets.max_rows``
entries, so it adds no compilations) and the step's ``carry_from`` among its
packed inputs, and the sampling returns the step's own feed for the next
step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
import typing
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from m3_engine import checkpoint
from m3_engine.args import CheckedArgs, check_gpu_device, kv_cache_pages
from m3_engine.buckets import StepBuckets
from m3_engine.dummy_weights import dummy_dtype
from m3_engine.quantization import is_quantized, is_scale, load_stream
from m3_engine.runner import SampleResult, SamplingBatch
from m3_engine.scheduler import DraftPass
from m3_engine.step_inputs import Step, StepBuilder
from m3_engine.structured_outputs import bitmask_width
from m3_kernels.maps import next_pow2

from . import eagle3, fp8, model, tp
from ._triton_call import kernel_cache_stats
from .api import StepSpec, step_inputs
from .cache import allocate_pool
from .dummy_weights import dummy_params
from .sampling import apply_token_bitmask, sample, seed_words

__all__ = ["JaxRunner"]

WARM_UP_THREADS = 8   # the warm-up's compile threads (at most; XLA also compiles in threads of its own)
logger = logging.getLogger(__name__)
MIN_IDS_BUCKET = 16   # penalty id arrays and prompt-logprob rows are padded to powers of two from here


def _gpus() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def resolve_devices(args: CheckedArgs) -> list:
    """The engine's devices (one per tensor-parallel shard); ``[None]``: JAX's default device."""
    size = args.tp.size
    if args.device_object is not None:
        given = args.device_object
        devices = [given] if isinstance(given, jax.Device) else list(given) if isinstance(given, (list, tuple)) \
            else None
        if devices is None or not all(isinstance(d, jax.Device) for d in devices):
            raise TypeError(f"device: expected None, a string, a jax.Device or a list of them, got "
                            f"{type(given).__name__}")
        if len(devices) != size or len(set(devices)) != size:
            raise ValueError(f"device: expected {size} distinct jax.Device(s) for tensor_parallel_size={size}, "
                             f"got {devices!r}")
    elif args.platform == "gpu":
        first = check_gpu_device(args.device, args.device_index, len(_gpus()), size)
        devices = _gpus()[first:first + size]
    elif args.platform == "cpu" or size > 1:
        devices = jax.devices("cpu") if args.platform == "cpu" else jax.devices()
        if len(devices) < size:
            hint = (" (on a CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX initialises)"
                    if devices[0].platform == "cpu" else "")
            raise ValueError(f"tensor_parallel_size={size} needs {size} devices, JAX has {len(devices)} "
                             f"{devices[0].platform} device(s){hint}")
        devices = devices[:size]
    else:
        return [None]
    if devices[0].platform == "cpu" and size > 1:
        _check_cpu_threads(size)
    return devices


def use_compile_cache(folder: Path) -> None:
    """Point JAX's persistent compilation cache at ``folder/jax`` and Triton's (jax-triton's kernels)
    at ``folder/triton`` (``m3_engine.compile_cache``), caching every program whatever its compile
    time or size. The one place the JAX runner sets them; a later engine of this process with
    another folder moves both."""
    import triton
    from jax.experimental.compilation_cache import compilation_cache

    jax_dir = str(folder / "jax")
    if jax.config.jax_compilation_cache_dir != jax_dir:
        jax.config.update("jax_compilation_cache_dir", jax_dir)
        compilation_cache.reset_cache()   # a cache opened before reads the new folder from now on
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    triton.knobs.cache.dir = str(folder / "triton")


class JaxRunner:
    """The JAX side of an engine (``m3_engine.runner.Runner``). ``args``: the checked options.
    On a GPU without ``num_gpu_blocks_override`` the KV pool holds what ``gpu_memory_utilization``
    leaves after the weights on the fullest shard's device; :attr:`scheduler_config` is
    ``args.scheduler`` with the pool's pages."""

    def __init__(self, args: CheckedArgs):
        if args.enforce_eager:
            raise ValueError("enforce_eager: the JAX engine always runs jitted steps (expected False)")
        if args.compile_cache_dir is not None:
            use_compile_cache(args.compile_cache_dir)
        self.config = config = args.config
        self.tp = args.tp
        devices = resolve_devices(args)
        self.device = devices[0]
        self.mesh = tp.make_mesh(devices) if self.tp.size > 1 else None
        self.scheduler_config = sc = args.scheduler
        # every step padded: each shape is one compilation, so the set must be bounded
        self.buckets = StepBuckets.from_config(sc, args.speculative, pad_prefill=True, pad_decode=True)
        dtype = args.dtype
        with self._on_device():
            if args.load_format == "dummy":   # random weights drawn on the device(s) (m3_jax.dummy_weights)
                self.dtype = dummy_dtype(dtype, config)
                self.params = dict(load_stream(
                    dummy_params(self.tp, dtype=self.dtype, seed=args.seed, mesh=self.mesh).items(),
                    checkpoint=None, quantization=args.quantization, quantize=fp8.quantize_weight,
                    dequantize_mxfp8=None))
            elif self.mesh is None:
                skip = ("lm_head.weight",) if config.tie_word_embeddings else ()   # the head is the embedding
                weights = load_stream(
                    checkpoint.iter_weights(args.model_dir, config, framework="numpy", skip=skip),
                    checkpoint=args.checkpoint_quantization, quantization=args.quantization,
                    quantize=lambda w: fp8.quantize_weight(self._put(w)),   # on the device, a tensor at a time
                    dequantize_mxfp8=lambda codes, scale: fp8.dequantize_mxfp8(self._put(codes), self._put(scale)))
                self.params, self.dtype = {}, None
                for name, w in weights:
                    self.dtype = self.dtype or dtype or config.dtype or np.dtype(w.dtype).name   # the embedding's
                    fp8_part = args.quantization is not None and (is_quantized(name) or is_scale(name))
                    self.params[name] = self._put(w if fp8_part else np.asarray(w).astype(jnp.dtype(self.dtype)))
            else:
                self.params, self.dtype = tp.load_params(args.model_dir, self.tp, self.mesh, dtype,
                                                         quantization=args.quantization,
                                                         checkpoint_quantization=args.checkpoint_quantization)

            def layout(slots: int):   # one shard's
                return model.pool_layout(self.tp.local_config, slots, self.dtype, kv_cache_dtype=args.kv_cache_dtype,
                                         index_cache_dtype=args.index_cache_dtype)

            if args.num_gpu_blocks_override is None and self.device is not None and self.device.platform == "gpu":
                # the KV pool from the memory left after the weights: the fewest pages of any shard's device
                pages = min(_pages_from_memory(d, layout(1).slot_nbytes, args.gpu_memory_utilization,
                                               sc.max_context) for d in devices)
                self.scheduler_config = sc = dataclasses.replace(sc, num_slots=pages)
            self.pool_layout = layout(sc.num_slots)
            self.pool = allocate_pool(self.pool_layout, self.device) if self.mesh is None else \
                tp.allocate_pool(self.pool_layout, self.mesh)
        self.compiled_forwards: list[StepSpec] = []   # one entry per compilation: the spec it was traced for
        self.compiled_sampling: list[tuple] = []      # one per compilation: (rows, packing, num_logprobs, prompt)
        self._forward = jax.jit(self._run_forward, static_argnames=("spec", "packing"), donate_argnames=("pool",))
        self._sample = jax.jit(self._run_sample, static_argnames=("packing", "num_logprobs", "prompt"))
        # async scheduling: the sampled tokens a step passes to the next one, on the device (None: off)
        self._no_feed = None
        if args.async_scheduling:
            with self._on_device():
                self._no_feed = self._put(np.zeros(self.buckets.max_rows, np.int32))
        self._aux_layers = args.draft.aux_layer_ids if args.draft is not None else ()   # eagle3: one device (args)
        self.proposer, self._last = None, None   # eagle3: the draft, and the last step (eagle3.TargetStep)
        if args.draft is not None:
            with self._on_device():
                embed = self.params["model.embed_tokens.weight"]
                draft_config, draft_params = eagle3.load_params(
                    args.speculative.model, config, dtype=self.dtype, target_embed=embed,
                    target_lm_head=self.params.get("lm_head.weight", embed))
                self.proposer = eagle3.Eagle3Proposer(
                    draft_config, draft_params, num_slots=sc.num_slots, dtype=self.dtype,
                    step_config=self.buckets.planner_config(args.step_config()), buckets=self.buckets,
                    num_speculative_tokens=args.speculative.num_speculative_tokens,
                    kv_cache_dtype=args.kv_cache_dtype, device=self.device)

    # -- the protocol ------------------------------------------------------------------------------

    def submit(self, step: Step, sampling: SamplingBatch, previous: Optional["SubmittedStep"] = None) \
            -> "SubmittedStep":
        """Dispatch ``step``'s forward, then its sampling, and start the copy of the outputs to the host;
        returns without waiting. ``previous``: the step submitted before it, when ``step.carry_from`` takes
        its tokens. The sampling arrays are packed (and a late token bitmask,
        ``sampling.late_token_bitmask``, filled) on the host while the device runs the forward."""
        if self.pool is None:
            raise RuntimeError("this LLM is closed (close() was called)")
        forward = self._forward_inputs(step, previous)
        with self._on_device():
            (logits, aux), self.pool = self._forward(*forward.args, **forward.static)
        if sampling.late_token_bitmask is not None:
            sampling = sampling.with_token_bitmask()
        num_prompt = len(step.prompt_logits_indices)
        prompt = (_prompt_rows(num_prompt), sampling.num_prompt_logprobs) if num_prompt else None
        flat, packing = pack_inputs(_sampling_arrays(sampling, forward.rows, prompt))
        with self._on_device():
            flat_out, next_feed = self._sample(logits, self._step_input(flat), forward.feed, packing=packing,
                                               num_logprobs=sampling.num_logprobs, prompt=prompt)
        flat_out.copy_to_host_async()
        if self.proposer is not None:
            self._last = (step, eagle3.TargetStep(forward.batch, aux))
        return SubmittedStep(flat_out, next_feed, len(step.logits_indices), forward.rows,
                             sampling.num_logprobs, num_prompt, prompt)

    def result(self, handle: "SubmittedStep") -> SampleResult:
        """Wait for a submitted step -> its sampled outputs (numpy), and its prompt logprobs."""
        host = np.asarray(jax.device_get(handle.outputs))   # one wait for every output
        out = unpack_outputs(host, handle.rows, handle.num_logprobs, handle.prompt)
        out = {k: v[:handle.num_prompt] if k.startswith("prompt_") else v[:handle.num_logits]
               for k, v in out.items()}
        return SampleResult(tokens=out["tokens"], logprobs=out["logprobs"], top_ids=out.get("top_ids"),
                            top_logprobs=out.get("top_logprobs"), ranks=out.get("ranks"),
                            prompt_logprobs=out.get("prompt_logprobs"), prompt_ranks=out.get("prompt_ranks"),
                            prompt_top_ids=out.get("prompt_top_ids"),
                            prompt_top_logprobs=out.get("prompt_top_logprobs"))

    def _forward_inputs(self, step: Step, previous: Optional["SubmittedStep"]) -> "_Forward":
        """The arguments of ``step``'s forward (``self._forward(*args, **static)``), its batch, logits rows
        (sampled ones; the prompt-logprob rows follow them) and feed."""
        batch, spec, maps = self._layout(step)
        carry, feed = self._carry(step, previous)
        flat, packing = pack_inputs((batch, maps, carry))
        return _Forward((self.params, self.pool, self._step_input(flat), feed), dict(spec=spec, packing=packing),
                        batch, _num_logits(spec), feed)

    @property
    def on_gpu(self) -> bool:
        device = self.device if self.device is not None else jax.devices()[0]
        return device.platform == "gpu"

    def warm_up(self, builder: StepBuilder) -> dict:
        """Compile the programs of every shape of ``self.buckets`` (``shapes()``: the bounded set): its forward,
        and the plain and masked sampling programs of its logits rows. First the forwards are traced and
        compiled on a thread pool (XLA compiles with the GIL released; nothing runs), then one step of each
        shape runs with plain and with masked sampling, reading and writing nothing (``builder.dummy``): it
        takes the forwards just compiled, compiles the (small) sampling programs and checks that each runs."""
        from concurrent.futures import ThreadPoolExecutor

        from tqdm.auto import tqdm

        start, before = time.perf_counter(), len(self.compiled_forwards) + len(self.compiled_sampling)
        plain = SamplingBatch.greedy(1)
        bitmask = np.full((1, bitmask_width(self.config.vocab_size)), -1, np.int32)
        masked = dataclasses.replace(plain, late_token_bitmask=lambda: bitmask)
        steps = [builder.dummy(shape) for shape in self.buckets.shapes()]

        def compile_forward(step: Step) -> tuple:
            """Trace, lower and compile ``step``'s forward -> the seconds each phase took."""
            forward = self._forward_inputs(step, None)
            with self._on_device():
                t0 = time.perf_counter()
                traced = self._forward.trace(*forward.args, **forward.static)
                t1 = time.perf_counter()
                lowered = traced.lower()
                t2 = time.perf_counter()
                lowered.compile()   # XLA, or a read of its persistent cache
            return t1 - t0, t2 - t1, time.perf_counter() - t2

        threads = max(1, min(len(steps), os.cpu_count() or 1, WARM_UP_THREADS))
        with ThreadPoolExecutor(threads) as pool:
            phases = list(tqdm(pool.map(compile_forward, steps), total=len(steps),
                               desc=f"Compiling the forwards (jax, {threads} threads)", unit="program"))
        trace, lower, xla = (sum(p[i] for p in phases) for i in range(3))
        compiled = time.perf_counter()
        for step in tqdm(steps, desc="Running each shape once, plain and masked (jax)", unit="shape"):
            self.execute(step, plain)
            self.execute(step, masked)
        self._last = None
        programs = len(self.compiled_forwards) + len(self.compiled_sampling) - before
        done = time.perf_counter()
        kernels = kernel_cache_stats()
        logger.info("jax warm-up: %d forwards compiled in %.1f s on %d threads (summed over the threads: trace "
                    "%.1f s, lower %.1f s, XLA compile or cache read %.1f s; Triton kernels so far: %d compiled, "
                    "%d read from the cache); each shape run once with plain and masked sampling in %.1f s",
                    len(steps), compiled - start, threads, trace, lower, xla, kernels["compiled"], kernels["read"],
                    done - compiled)
        return dict(programs=programs, compile=done - start, capture=0.0)

    def execute(self, step: Step, sampling: SamplingBatch) -> SampleResult:
        return self.result(self.submit(step, sampling))

    def _carry(self, step: Step, previous: Optional["SubmittedStep"]) -> tuple:
        """The step's ``carry_from`` (every entry -1 when it carries nothing) and the feed it indexes;
        ``(None, None)`` without async scheduling (the forward and the sampling then have neither)."""
        if self._no_feed is None:
            if step.carry_from is not None:
                raise ValueError("step.carry_from: this engine was built with async_scheduling=False")
            return None, None
        if step.carry_from is None:
            return np.full(step.num_tokens, -1, np.int32), self._no_feed
        if previous is None:
            raise ValueError("previous: expected the step submitted before (step.carry_from takes its sampled "
                             "tokens), got None")
        return step.carry_from, previous.feed

    def propose(self, work: DraftPass) -> np.ndarray:
        """EAGLE-3: the draft after the step just executed (``work.step``) -> drafts ``[n, k]`` int32."""
        if self.proposer is None:
            raise RuntimeError("propose: this engine has no EAGLE-3 draft (speculative_config method 'eagle3')")
        if self._last is None or self._last[0] is not work.step:
            raise RuntimeError("propose: expected the DraftPass of the step executed last")
        target, self._last = self._last[1], None
        with self._on_device():
            return self.proposer.propose(work, target)

    def close(self) -> None:
        """Release the weights and the pools (one process: nothing else to end)."""
        self.params = self.pool = self.proposer = self._last = None

    # -- one step -----------------------------------------------------------------------------------

    def _run_forward(self, params, pool, flat, feed, *, spec, packing):
        """Traced: the forward program -> ((float32 logits of the step's logits rows, aux or None), pool).
        On a mesh the logits come back replicated: the sampling runs on every device as on one."""
        self.compiled_forwards.append(spec)  # runs once per trace, i.e. per compilation
        batch, maps, carry = unpack_inputs(flat, packing)
        if feed is not None:   # async scheduling: carried input ids from the previous step's tokens
            taken = feed[jnp.maximum(carry, 0)]
            batch = batch._replace(input_ids=jnp.where(carry >= 0, taken, batch.input_ids))
        aux = None
        if self.mesh is not None:
            logits, pool = tp.forward(params, pool, batch, maps, plan=self.tp, layout=self.pool_layout, spec=spec,
                                      mesh=self.mesh)
            logits = jax.lax.with_sharding_constraint(logits, tp.replicated(self.mesh))
        elif self._aux_layers:   # an EAGLE-3 draft (one device): the aux states come back beside the logits
            (logits, aux), pool = model.forward(params, pool, batch, maps, config=self.config,
                                                layout=self.pool_layout, spec=spec, aux_layers=self._aux_layers)
        else:
            logits, pool = model.forward(params, pool, batch, maps, config=self.config, layout=self.pool_layout,
                                         spec=spec)
        return (logits.astype(jnp.float32), aux), pool

    def _run_sample(self, logits, flat, feed, *, packing, num_logprobs, prompt):
        """Traced: the sampling program of a step's logits -> (packed outputs, next feed or None)."""
        self.compiled_sampling.append((logits.shape[0], packing, num_logprobs, prompt))
        sampling = unpack_inputs(flat, packing)
        num_sampled = sampling["temperature"].shape[0]
        out = sample_logits(logits[:num_sampled], sampling, num_logprobs)
        if prompt is not None:   # the prompt-logprob rows follow the sampled ones
            out.update(prompt_logprobs(logits[num_sampled:], sampling["prompt_targets"], prompt[1]))
        next_feed = None if feed is None else jnp.zeros_like(feed).at[:out["tokens"].shape[0]].set(out["tokens"])
        return pack_outputs(out, num_logprobs, prompt), next_feed

    def _layout(self, step: Step):
        """The step, already padded and planned (``m3_engine.step_inputs``), as the forward takes it:
        (StepBatch of numpy arrays, StepSpec, PrefillMaps | None)."""
        spec, maps = step_inputs(step.plan)
        # every span reads the whole table: no length recompiles a step (the key is the padded shape)
        width = self.scheduler_config.max_blocks
        spec = dataclasses.replace(spec, context_max_blocks=width if spec.context_rows else spec.context_max_blocks,
                                   generation_max_blocks=width if spec.generation_rows else
                                   spec.generation_max_blocks)
        rows = _padded(step.logits_indices, _num_logits(spec))
        if len(step.prompt_logits_indices):   # then the prompt-logprob rows (padding: token row 0)
            rows = np.concatenate([rows, _padded(step.prompt_logits_indices,
                                                 _prompt_rows(len(step.prompt_logits_indices)))])
        batch = model.StepBatch(step.input_ids, step.positions, step.slot_mapping, step.block_table, step.seq_lens,
                                rows)
        return batch, spec, maps

    # -- devices ----------------------------------------------------------------------------------

    def _on_device(self):
        """Run (and trace: the kernels pick their GPU or CPU path from it) on this engine's device."""
        return jax.default_device(self.device) if self.device is not None else contextlib.nullcontext()

    def _step_input(self, flat: np.ndarray):
        """A step's packed host inputs as its jitted programs take them. One device: the numpy array itself,
        which jit's C++ dispatch copies to the device of the program's other arguments (~35 us a step on the
        CPU machine, against ~200 us through ``jax.device_put``'s Python path); on a mesh: replicated."""
        return flat if self.mesh is None else self._put(flat)

    def _put(self, tree):
        """Host data -> this engine's device (tensor parallelism: replicated on every shard)."""
        if self.mesh is not None:
            return jax.device_put(tree, tp.replicated(self.mesh))
        return jax.device_put(tree, self.device) if self.device is not None else jax.device_put(tree)


class _Forward(typing.NamedTuple):
    """A step's forward program's arguments (``JaxRunner._forward(*args, **static)``), the step's batch
    (``model.StepBatch``), sampled logits rows (padded) and feed (as :class:`SubmittedStep`)."""
    args: tuple
    static: dict
    batch: object
    rows: int
    feed: Optional[jax.Array]


@dataclasses.dataclass(eq=False)
class SubmittedStep:
    """A step dispatched by :meth:`JaxRunner.submit`: its packed sampled outputs (a device array whose
    copy to the host has started), its feed for the next step (async scheduling, else None), its real
    and padded logits rows, the top logprobs asked, and its prompt-logprob rows (real, and the
    sampling program's ``prompt`` key: ``(padded rows, top-N)`` or None)."""
    outputs: jax.Array
    feed: Optional[jax.Array]
    num_logits: int
    rows: int
    num_logprobs: Optional[int]
    num_prompt: int
    prompt: Optional[tuple]


def _pages_from_memory(device, page_bytes: int, gpu_memory_utilization: float, max_model_len: int) -> int:
    """The pool pages ``gpu_memory_utilization`` of ``device`` holds after what is allocated on it now
    (the weights), vLLM's sizing (``kv_cache_pages``), over the memory XLA's allocator may use
    (``bytes_limit``: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the GPU)."""
    stats = device.memory_stats()
    return kv_cache_pages(total_bytes=stats["bytes_limit"], used_bytes=stats["bytes_in_use"],
                          gpu_memory_utilization=gpu_memory_utilization, page_bytes=page_bytes,
                          max_model_len=max_model_len)


def _check_cpu_threads(count: int):
    """JAX's CPU client runs each device's program on a thread of one pool (``PJRT_NPROC`` or
    ``NPROC`` threads, else one per core) and copies a ``pure_callback``'s inputs on the same
    pool: when every thread runs a shard waiting in an interpreted kernel's callback, nothing
    copies and the step never ends. Refuse that instead of hanging."""
    threads = os.environ.get("PJRT_NPROC") or os.environ.get("NPROC")
    threads = int(threads) if threads and threads.isdigit() else len(os.sched_getaffinity(0))
    if threads <= count:
        raise ValueError(f"tensor_parallel_size={count} on CPU devices: JAX's CPU client has {threads} threads "
                         f"and the interpreted kernels' callbacks need one more than the devices: set "
                         f"PJRT_NPROC={count + 1} (or more) in the environment before JAX initialises")


#: Each packed array starts on a multiple of this many int32 elements (16 bytes): with the FFI launch
#: (``m3_jax._triton_call.LAUNCH_TARGET``) XLA may hand a Triton kernel its operand as an in-place slice of the
#: packed array, and jaxlib refuses a pointer the kernel assumes 16-byte aligned ("Parameter N is not
#: divisible by 16"; seen on an H200).
_ALIGN = 4


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where each array of a step's host inputs lies in the one int32 array they travel in: the pytree's
    structure and ``(shape, dtype, offset)`` per leaf. A static argument of the jitted programs (it follows
    from the step's shapes, so it adds no compilations)."""
    treedef: object
    leaves: tuple


def pack_inputs(tree) -> tuple[np.ndarray, Packing]:
    """A pytree of int32 / float32 numpy arrays (the forward's batch, maps and carry, or the sampling's
    arrays) -> one int32 array holding them all (float32 bits as they are) and its :class:`Packing`. One
    host-to-device copy a program instead of one per array: in a profile of the engine on an H200 (M3 layer
    shapes, batch 1) the three ``jax.device_put`` calls of the step's 12-16 arrays took ~2 ms of host time a
    step."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [np.asarray(leaf) for leaf in leaves]
    layout, offset = [], 0
    for a in arrays:
        name = "int32" if a.dtype == np.int32 else "float32" if a.dtype == np.float32 else None  # (dtype.name: ~4 us)
        if name is None:
            raise TypeError(f"pack_inputs: expected int32 / float32 arrays, got {a.dtype}")
        layout.append((a.shape, name, offset))
        offset += -(-a.size // _ALIGN) * _ALIGN
    flat = np.zeros(offset, np.int32)
    for a, (_, _, start) in zip(arrays, layout):
        flat[start:start + a.size] = a.reshape(-1).view(np.int32)
    return flat, Packing(treedef, tuple(layout))


def unpack_inputs(flat, packing: Packing):
    """Inverse of :func:`pack_inputs`, traced: static slices of ``flat`` (float32 leaves bitcast back)."""
    leaves = []
    for shape, dtype, offset in packing.leaves:
        x = jax.lax.slice_in_dim(flat, offset, offset + int(np.prod(shape, dtype=np.int64))).reshape(shape)
        leaves.append(jax.lax.bitcast_convert_type(x, jnp.float32) if dtype == "float32" else x)
    return jax.tree_util.tree_unflatten(packing.treedef, leaves)


def _output_layout(rows: int, num_logprobs, prompt=None) -> list:
    """``(name, shape, dtype)`` of each sampled output of a step with ``rows`` logits rows (and
    ``prompt = (prompt rows, their top-N)`` or None), in the order :func:`pack_outputs` packs them."""
    layout = [("tokens", (rows,), np.int32), ("logprobs", (rows,), np.float32)]
    if num_logprobs is not None:
        layout.append(("ranks", (rows,), np.int32))
        if num_logprobs > 0:
            layout += [("top_ids", (rows, num_logprobs), np.int32),
                       ("top_logprobs", (rows, num_logprobs), np.float32)]
    if prompt is not None:
        prompt_rows, top = prompt
        layout += [("prompt_logprobs", (prompt_rows,), np.float32), ("prompt_ranks", (prompt_rows,), np.int32)]
        if top > 0:
            layout += [("prompt_top_ids", (prompt_rows, top), np.int32),
                       ("prompt_top_logprobs", (prompt_rows, top), np.float32)]
    return layout


def pack_outputs(out: dict, num_logprobs, prompt=None):
    """Traced: the step's sampled outputs (``sample_logits``, ``prompt_logprobs``) as one int32 array
    (float32 bits as they are): one device-to-host copy a step."""
    rows = out["tokens"].shape[0]
    parts = [out[name] if dtype == np.int32 else jax.lax.bitcast_convert_type(out[name], jnp.int32)
             for name, _, dtype in _output_layout(rows, num_logprobs, prompt)]
    return jnp.concatenate([p.reshape(-1) for p in parts])


def unpack_outputs(flat: np.ndarray, rows: int, num_logprobs, prompt=None) -> dict:
    """Inverse of :func:`pack_outputs`, on the host: numpy views of ``flat``."""
    out, offset = {}, 0
    for name, shape, dtype in _output_layout(rows, num_logprobs, prompt):
        size = math.prod(shape)
        out[name] = flat[offset:offset + size].view(dtype).reshape(shape)
        offset += size
    return out


def _num_logits(spec: StepSpec) -> int:
    """Logits rows of a compiled step: one per context row, one per generation token (a speculative
    verify row samples each of its ``k + 1`` tokens)."""
    return spec.context_rows + spec.generation_rows * spec.decode_query_len


def _padded(a: np.ndarray, rows: int, fill=0) -> np.ndarray:
    """``a`` followed by ``fill`` rows up to ``rows`` rows (np.pad costs ~15 us a call)."""
    out = np.full((rows,) + a.shape[1:], fill, a.dtype)
    out[:len(a)] = a
    return out


def _prompt_rows(count: int) -> int:
    """Prompt-logprob rows of a compiled step: ``count`` padded to a power of two (>= MIN_IDS_BUCKET)."""
    return max(next_pow2(count), MIN_IDS_BUCKET)


def _sampling_arrays(s: SamplingBatch, rows: int, prompt=None) -> dict:
    """The step's sampling arrays padded to ``rows`` (padding rows: greedy); penalty ids padded to
    powers of two (so their lengths do not recompile the step at every token); with ``prompt``
    (``(prompt rows, top-N)``), the prompt-logprob targets padded to its rows."""
    out = dict(temperature=_padded(s.temperature, rows), top_k=_padded(s.top_k, rows),
               top_p=_padded(s.top_p, rows, 1), min_p=_padded(s.min_p, rows),
               seeds=_padded(seed_words(s.seeds), rows), counters=_padded(s.counters, rows))
    if s.has_penalties:
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            out[name] = _padded(getattr(s, name), rows, 1 if name == "repetition_penalty" else 0)
        for name in ("prompt_ids", "output_ids"):
            ids = getattr(s, name)
            width = max(next_pow2(ids.shape[1]), MIN_IDS_BUCKET)
            out[name] = _padded(np.pad(ids, [(0, 0), (0, width - ids.shape[1])], constant_values=-1), rows, -1)
    if s.token_bitmask is not None:   # padding rows allow every token
        out["token_bitmask"] = _padded(s.token_bitmask, rows, -1)
    if prompt is not None:
        out["prompt_targets"] = _padded(s.prompt_targets, prompt[0])
    return out


def sample_logits(logits, s: dict, num_logprobs):
    """The shared sampling kernel on float32 ``logits [L, V]`` (+ top-N logprobs when asked)."""
    penalties = {k: s[k] for k in ("repetition_penalty", "presence_penalty", "frequency_penalty", "prompt_ids",
                                   "output_ids") if k in s}
    token_bitmask = s.get("token_bitmask")
    tokens, logprobs, lse = sample(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seeds"],
                                   s["counters"], token_bitmask=token_bitmask, **penalties)
    out = {"tokens": tokens, "logprobs": logprobs}
    if num_logprobs is not None:
        if token_bitmask is not None:   # logprobs and ranks over the masked logits, as the sampled token's
            logits = apply_token_bitmask(logits, token_bitmask)
        chosen = jnp.take_along_axis(logits, tokens[:, None], axis=1)
        out["ranks"] = (jnp.sum(logits > chosen, axis=1) + 1).astype(jnp.int32)
        if num_logprobs > 0:
            order = jnp.argsort(-logits, axis=1, stable=True)[:, :num_logprobs]   # ties: the lower id first
            out["top_ids"] = order.astype(jnp.int32)
            out["top_logprobs"] = jnp.take_along_axis(logits, order, axis=1) - lse[:, None]
    return out


def prompt_logprobs(logits, targets, top: int) -> dict:
    """Traced: the ``SampleResult.prompt_*`` fields from float32 ``logits [P, V]`` of the step's prompt
    rows: each target's raw logprob (``logit - logsumexp``) and rank, and the ``top`` most likely."""
    lse = jax.nn.logsumexp(logits, axis=1)
    chosen = jnp.take_along_axis(logits, targets[:, None], axis=1)
    out = {"prompt_logprobs": chosen[:, 0] - lse,
           "prompt_ranks": (jnp.sum(logits > chosen, axis=1) + 1).astype(jnp.int32)}
    if top > 0:
        order = jnp.argsort(-logits, axis=1, stable=True)[:, :top]   # ties: the lower id first
        out["prompt_top_ids"] = order.astype(jnp.int32)
        out["prompt_top_logprobs"] = jnp.take_along_axis(logits, order, axis=1) - lse[:, None]
    return out
