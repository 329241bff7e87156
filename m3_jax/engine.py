"""``m3_jax.LLM``: MiniMax-M3 text generation in JAX over the flat sub-page pool.

    llm = m3_jax.LLM("path/to/model", dtype="bfloat16", max_batch=8, max_context=4096)
    llm.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)        # -> [[...16 ids], [...]]

The framework-neutral :class:`m3_kernels.scheduler.Scheduler` decides each
step (admission, slots, chunked prefill, mixed steps, decode padding); this
module only moves its numpy metadata to the device and runs ONE jitted
function, model forward + sampling, with the pool donated (cache writes in
place). What the compile cache is keyed by:

* **pure decode steps**: the scheduler's graph batch size (``graph_batch_sizes``
  = 1, 2, 4, 8, then multiples of 16 up to ``max_batch``, as ``m3_torch``'s CUDA
  graphs). The generation span always spans the whole block table
  (``max_context / 128`` columns), so no length ever recompiles: one
  compilation per batch size.
* **steps with context rows** (prefill, mixed): re-padded here, on the host,
  to buckets: context tokens to the next of 8, 12, 16, 24, 32, 48, ...
  (powers of two and 1.5x them, capped at ``max_num_tokens``) by one padding
  context row (``seq_len = 0``: its tokens see nothing, write nothing), context
  rows to a power of two (empty rows), generation rows to a graph batch size.
  With the context span's block bound and row tile (powers of two) that is the
  key: it depends on buckets, never on lengths.

With ``tensor_parallel_size=N`` the same jitted function runs the model step
in ``shard_map`` over a mesh of N devices (``m3_jax.tp``); the scheduler,
the padding and the compile keys are unchanged (plans are made for one
shard's heads).

:attr:`LLM.compiled_steps` lists the ``StepSpec`` of every compilation.
Sampling runs on the device: greedy (argmax) at temperature 0; otherwise
temperature + top-p (nucleus) with ``jax.random``, keyed per token by
``(seed, prompt index, output index)``, so a seeded run does not depend on
batching.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from m3_kernels import checkpoint, model_config, planner
from m3_kernels.maps import next_pow2
from m3_kernels.scheduler import Scheduler, SchedulerConfig, Step
from m3_kernels.tp import TPPlan

from . import model, tp
from .api import StepSpec, step_inputs
from .cache import allocate_pool

__all__ = ["LLM"]

MIN_TOKEN_BUCKET = 8


class Sampling(NamedTuple):
    """Per logits row (padded to the step's rows): temperature, top-p and the key of its token."""
    temperature: jax.Array   # [L] float32; 0 = greedy
    top_p: jax.Array         # [L] float32 in (0, 1]
    prompt_index: jax.Array  # [L] int32: the prompt of the row in its generate() call
    output_index: jax.Array  # [L] int32: tokens that prompt has generated before this one
    key: jax.Array           # a jax.random key (the call's seed)


def sample(logits, s: Sampling, *, do_sample: bool):
    """logits [L, V] float32 -> [L] int32 tokens: argmax where temperature == 0, else top-p sampling."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not do_sample:
        return greedy
    keys = jax.vmap(lambda p, i: jax.random.fold_in(jax.random.fold_in(s.key, p), i))(s.prompt_index,
                                                                                       s.output_index)
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)                                   # descending
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    keep = jnp.cumsum(probs, axis=-1) - probs < s.top_p[:, None]           # the nucleus (the top token always)
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, sorted_logits, -jnp.inf))
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(s.temperature > 0, sampled, greedy)


def _resolve_dtype(dtype) -> str | None:
    if dtype is None:
        return None
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        raise TypeError(f"dtype: expected None, a jnp dtype or its name, got {dtype!r}") from None
    if name not in model.DTYPES:
        raise ValueError(f"dtype: expected one of {model.DTYPES}, got {name!r}")
    return name


def _resolve_device(device):
    if device is None or isinstance(device, jax.Device):
        return device
    if not isinstance(device, str):
        raise TypeError(f"device: expected None, a jax.Device or a string such as 'cpu' or 'gpu:0', got "
                        f"{type(device).__name__}")
    platform, _, index = device.partition(":")
    platform = {"cuda": "gpu"}.get(platform, platform)
    try:
        devices = jax.devices(platform)
    except RuntimeError as e:
        raise ValueError(f"device: no JAX {platform!r} backend here ({e})") from None
    i = int(index) if index else 0
    if not 0 <= i < len(devices):
        raise ValueError(f"device: {device!r} asks for device {i}, JAX has {len(devices)} {platform} device(s)")
    return devices[i]


class LLM:
    """A MiniMax-M3 text checkpoint, ready to generate (JAX).

    model_dir:       a directory with ``config.json`` and safetensors (transformers
                     format, flat text config or a full VL release).
    dtype:           None (the checkpoint's), a jnp dtype or its name ("bfloat16");
                     weights, activations and the KV pool use it.
    device:          None (JAX's default), a ``jax.Device`` or a string ("cpu", "gpu:1").
    max_batch:       requests per step.
    max_context:     KV tokens per request (prompt + generated); default
                     ``min(8192, max_position_embeddings)``.
    max_cache_pages: pool slots (pages of 128 tokens); default: ``max_batch`` requests
                     of ``max_context`` tokens. Too few for one request of
                     ``max_context`` tokens: ``ValueError`` here.
    max_num_tokens:  query tokens per step (default ``max(2048, max_batch)``).
    prefill_chunk:   prompt tokens per request per step (default ``max_num_tokens``).
    tensor_parallel_size: shards the model is split over (``m3_kernels.tp``, ``m3_jax.tp``):
                     a ``Mesh`` over that many devices (``device``: None for the default
                     backend's first ones, a platform string, or a sequence of
                     ``jax.Device``), weights and pool laid out with ``NamedSharding``,
                     the model step in ``shard_map``. A split that does not exist
                     (e.g. 3 KV heads over 2 shards), or too few devices, is a
                     ``ValueError`` here. On a CPU, fake devices come from
                     ``XLA_FLAGS=--xla_force_host_platform_device_count=N``, set
                     before JAX initialises.
    kv_cache_dtype, index_cache_dtype: the K/V and index-K caches' element type:
                     ``"auto"`` (the model's dtype) or ``"fp8"`` / ``"float8_e4m3fn"``
                     (``m3_kernels.pool``: the pool becomes a byte pool). FP8 K/V use
                     scale 1.0 on every layer; index-K is unscaled.
    """

    def __init__(self, model_dir, *, dtype=None, device=None, max_batch: int = 8, max_context: int | None = None,
                 max_cache_pages: int | None = None, max_num_tokens: int | None = None,
                 prefill_chunk: int | None = None, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto",
                 index_cache_dtype: str = "auto"):
        self._closed = False
        self.config = config = model_config.load_config(model_dir)
        self.tp = TPPlan(config, tensor_parallel_size)
        dtype = _resolve_dtype(dtype)
        if self.tp.size == 1:
            self.device, self.mesh = _resolve_device(device), None
        else:
            devices = _resolve_devices(device, self.tp.size)
            self.device, self.mesh = devices[0], tp.make_mesh(devices)
        self.scheduler_config = sc = SchedulerConfig.from_engine_args(
            config, max_batch=max_batch, max_context=max_context, max_cache_pages=max_cache_pages,
            max_num_tokens=max_num_tokens, prefill_chunk=prefill_chunk)
        self.scheduler: Scheduler | None = None   # the one of the running (or last) generate call
        # plans are made for one shard's heads (all of them without tensor parallelism)
        heads = dict(num_q_heads=self.tp.num_q_heads, num_kv_heads=self.tp.num_kv_heads, head_dim=config.head_dim,
                     max_blocks=sc.max_blocks, topk=config.index_topk_blocks)
        self.planner = planner.StepPlanner(planner.StepConfig(
            max_batch=sc.max_batch, max_num_tokens=sc.max_num_tokens, graph_batch_sizes=sc.graph_batch_sizes,
            **heads))
        # steps with context rows are re-planned after padding: room for the padding rows and tokens
        self._prefill_planner = planner.StepPlanner(planner.StepConfig(
            max_batch=next_pow2(sc.max_batch + 1) + sc.max_batch, max_num_tokens=sc.max_num_tokens + sc.max_batch,
            **heads))
        self._token_buckets = _token_buckets(sc.max_num_tokens)

        with self._on_device():
            if self.mesh is None:
                weights = checkpoint.load_weights(model_dir, config, framework="numpy")
                if config.tie_word_embeddings:
                    del weights["lm_head.weight"]   # the head is the embedding
                self.dtype = dtype or config.dtype or np.dtype(weights["model.embed_tokens.weight"].dtype).name
                self.params = {name: self._put(np.asarray(w).astype(jnp.dtype(self.dtype)))
                               for name, w in weights.items()}
                del weights
            else:
                self.params, self.dtype = tp.load_params(model_dir, self.tp, self.mesh, dtype)
            self.pool_layout = model.pool_layout(self.tp.local_config, sc.num_slots, self.dtype,  # one shard's
                                                 kv_cache_dtype=kv_cache_dtype, index_cache_dtype=index_cache_dtype)
            self.pool = allocate_pool(self.pool_layout, self.device) if self.mesh is None else \
                tp.allocate_pool(self.pool_layout, self.mesh)
        self.compiled_steps: list[StepSpec] = []   # one entry per compilation: the spec it was traced for
        self._step = jax.jit(self._run, static_argnames=("spec", "do_sample"), donate_argnames=("pool",))

    # -- public ----------------------------------------------------------------------------------

    def close(self):
        """Release the weights and the pool; later calls of :meth:`generate` raise. (The twin of
        ``m3_torch.LLM.close``; one process, nothing else to end.) Also run by ``with LLM(...)``."""
        self.params = self.pool = None
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, *,
                 progress: Callable[[int], None] | None = None) -> list[list[int]]:
        """New token ids per prompt (prompts: lists of token ids), stopping at the config's eos ids
        (kept), after ``max_new_tokens``, or when a request's cache is full (``max_context``).

        temperature: 0 = greedy; > 0 samples from ``softmax(logits / temperature)``
                     restricted to the top-``top_p`` nucleus, reproducibly per ``seed``.
        progress:    called with the number of tokens generated after each step.
        Bad input (empty prompt, prompt longer than ``max_context``, token id outside
        the vocabulary, ``max_new_tokens < 1``, bad temperature/top_p/seed) raises
        before any work.
        """
        if self._closed:
            raise RuntimeError("this LLM is closed (close() was called)")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise ValueError(f"temperature: expected a float >= 0, got {temperature!r}")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"top_p: expected a float in (0, 1], got {top_p!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise TypeError(f"seed: expected an int or None, got {type(seed).__name__}")
        self.scheduler = Scheduler(self.scheduler_config, self.config, planner=self.planner)
        ids = self.scheduler.add_requests(prompts, max_new_tokens)
        index = {rid: i for i, rid in enumerate(ids)}
        do_sample = temperature > 0
        with self._on_device():
            key = self._put(jax.random.key(secrets.randbits(63) if seed is None else int(seed)))
            while self.scheduler.has_unfinished():
                step = self.scheduler.schedule()
                tokens = self._run_step(step, index, float(temperature), float(top_p), key, do_sample)
                self.scheduler.update(step, tokens)
                if progress is not None:
                    progress(len(step.request_ids))
        return [self.scheduler.output(rid) for rid in ids]

    # -- one step -----------------------------------------------------------------------------------

    def _run_step(self, step: Step, prompt_index: dict, temperature, top_p, key, do_sample) -> np.ndarray:
        batch, spec, maps = self._layout(step)
        rows = spec.num_rows
        num_logits = len(step.logits_indices)
        pad = rows - num_logits
        sampling = Sampling(
            temperature=np.full(rows, temperature, np.float32), top_p=np.full(rows, top_p, np.float32),
            prompt_index=np.pad(np.asarray([prompt_index[r] for r in step.request_ids.tolist()], np.int32), (0, pad)),
            output_index=np.pad(step.output_index, (0, pad)), key=key)
        tokens, self.pool = self._step(self.params, self.pool, self._put(batch), self._put(maps),
                                       self._put(sampling), spec=spec, do_sample=do_sample)
        return np.asarray(tokens)[:num_logits]

    def _run(self, params, pool, batch, maps, sampling, *, spec, do_sample):
        self.compiled_steps.append(spec)  # runs once per trace, i.e. per compilation
        if self.mesh is None:
            logits, pool = model.forward(params, pool, batch, maps, config=self.config, layout=self.pool_layout,
                                         spec=spec)
        else:
            logits, pool = tp.forward(params, pool, batch, maps, plan=self.tp, layout=self.pool_layout, spec=spec,
                                      mesh=self.mesh)
        return sample(logits, sampling, do_sample=do_sample), pool

    def _layout(self, step: Step):
        """The scheduler's step as (StepBatch of numpy arrays, StepSpec, PrefillMaps | None), padded to buckets."""
        max_blocks = self.scheduler_config.max_blocks
        if step.is_decode:  # padded to a graph batch size by the scheduler
            spec, maps = step_inputs(step.plan)
            rows = np.pad(step.logits_indices, (0, spec.num_rows - len(step.logits_indices)))
            batch = model.StepBatch(step.input_ids, step.positions, step.slot_mapping, step.block_table,
                                    step.seq_lens, rows)
            return batch, dataclasses.replace(spec, generation_max_blocks=max_blocks), maps

        cu, R, Rc = step.cu_seqlens_q, step.num_rows, step.num_context
        q_lens, seq_lens = np.diff(cu), step.seq_lens
        Tc, Rg = int(cu[Rc]), R - Rc
        Tc_pad = next(b for b in self._token_buckets + (Tc,) if b >= Tc) - Tc
        Rc_new = next_pow2(Rc + (Tc_pad > 0))
        Rg_new = next((g for g in self.scheduler_config.graph_batch_sizes if g >= Rg), Rg) if Rg else 0
        # rows: context | padding context row (Tc_pad tokens) | empty context rows | generation | padding rows
        empty = Rc_new - Rc - (Tc_pad > 0)
        new_q = _int32(q_lens[:Rc], [Tc_pad] * (Tc_pad > 0), [0] * empty, q_lens[Rc:], [1] * (Rg_new - Rg))
        new_seq = _int32(seq_lens[:Rc], [0] * (Rc_new - Rc), seq_lens[Rc:], [0] * (Rg_new - Rg))
        table = np.full((Rc_new + Rg_new, max_blocks), -1, np.int32)
        table[:Rc], table[Rc_new:Rc_new + Rg] = step.block_table[:Rc], step.block_table[Rc:]
        T_new = Tc + Tc_pad + Rg_new
        ctx_end, gen_start = Tc, Tc + Tc_pad

        def tokens(x, fill):
            out = np.full(T_new, fill, np.int32)
            out[:ctx_end], out[gen_start:gen_start + Rg] = x[:Tc], x[Tc:]
            return out

        rows = step.logits_indices
        rows = np.where(rows < Tc, rows, rows + Tc_pad).astype(np.int32)
        batch = model.StepBatch(tokens(step.input_ids, 0), tokens(step.positions, 0), tokens(step.slot_mapping, -1),
                                table, new_seq, np.pad(rows, (0, Rc_new + Rg_new - len(rows))))
        plan = self._prefill_planner.plan(new_seq, q_lens=new_q, num_context=Rc_new)
        spec, maps = step_inputs(plan)
        if Rg_new:
            spec = dataclasses.replace(spec, generation_max_blocks=max_blocks)
        return batch, spec, maps

    # -- devices ----------------------------------------------------------------------------------

    def _on_device(self):
        """Run (and trace: the kernels pick their GPU or CPU path from it) on this engine's device."""
        return jax.default_device(self.device) if self.device is not None else contextlib.nullcontext()

    def _put(self, tree):
        """Host data -> this engine's device (tensor parallelism: replicated on every shard)."""
        if self.mesh is not None:
            return jax.device_put(tree, tp.replicated(self.mesh))
        return jax.device_put(tree, self.device) if self.device is not None else jax.device_put(tree)


def _resolve_devices(device, count: int) -> list:
    """The devices of a tensor-parallel engine: None (the default backend's first ``count``), a
    platform string ("cpu", "gpu") or a sequence of ``count`` distinct ``jax.Device``s."""
    if device is None or isinstance(device, str):
        platform, _, index = (device or "").partition(":")
        platform = {"cuda": "gpu"}.get(platform, platform) or None
        if index:
            raise ValueError(f"device: with tensor_parallel_size={count}, expected None, a platform ('cpu', 'gpu') "
                             f"or a list of devices, got {device!r}")
        try:
            devices = jax.devices(platform)
        except RuntimeError as e:
            raise ValueError(f"device: no JAX {platform!r} backend here ({e})") from None
        if len(devices) < count:
            hint = (" (on a CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX initialises)"
                    if devices[0].platform == "cpu" else "")
            raise ValueError(f"tensor_parallel_size={count} needs {count} devices, JAX has {len(devices)} "
                             f"{devices[0].platform} device(s){hint}")
        devices = devices[:count]
    elif isinstance(device, jax.Device):
        raise ValueError(f"device: tensor_parallel_size={count} needs {count} devices, got one ({device})")
    else:
        devices = list(device)
        if len(devices) != count or len(set(devices)) != count or \
                not all(isinstance(d, jax.Device) for d in devices):
            raise ValueError(f"device: expected {count} distinct jax.Devices for tensor_parallel_size={count}, "
                             f"got {devices!r}")
    if devices[0].platform == "cpu":
        _check_cpu_threads(count)
    return devices


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


def _int32(*parts) -> np.ndarray:
    return np.concatenate([np.asarray(p, np.int32) for p in parts])


def _token_buckets(max_num_tokens: int) -> tuple:
    """Context-token buckets: 8, 12, 16, 24, 32, 48, ... (powers of two and 1.5x them, so padding wastes
    at most a third), up to ``max_num_tokens``, which is the last one."""
    buckets, b = set(), MIN_TOKEN_BUCKET
    while b < max_num_tokens:
        buckets |= {b, b * 3 // 2}
        b *= 2
    return tuple(sorted(x for x in buckets if x < max_num_tokens)) + (max_num_tokens,)
