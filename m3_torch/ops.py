"""The torch side of the launch layer: ``run`` and one custom op per kernel.

``run(launch, outputs)`` executes an ``m3_kernels.launches.Launch`` (and the
launches chained after it), every kernel of the package (the model-step ops
of ``fused.py``, ``moe.py`` and ``sampling.py`` too), writing the given output
tensors and allocating the others. The custom ops
``torch.ops.m3.{index_scores, select_blocks, paged_attention, write_cache}``
are internal (their signatures may change): each builds its Launch from the
tensors' shapes and strides and runs it. They take tile/token maps, so the
decode, prefill and mixed-step paths of ``m3_torch.api`` share them. CUDA
tensors run the compiled kernels, CPU tensors the same source in Triton's
interpreter; inside :func:`record_variants`, meta tensors stand for a GPU's:
each launch's compiled variant is recorded, none runs. Every op is inference-only and graph-capturable (no host sync).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from m3_kernels import kernel_module, launches, maps, validate
from m3_kernels.launches import Operand, Prev

_lock = threading.Lock()
_workspaces: dict = {}
_device_maps: dict = {}
_arenas: dict = {}
_ones: dict = {}
_pdl: dict = {}
# inside compile_only: run compiles the launches' kernel variants and launches nothing
_compile_only = contextvars.ContextVar("m3_compile_only", default=None)
# inside record_variants: the Recording that run adds each launch's variant to (meta tensors: a GPU's)
_recording = contextvars.ContextVar("m3_recording", default=None)


def compiled(device) -> bool:
    """Whether launches on ``device`` take the GPU's kernel variants: a CUDA device, or the meta device
    inside :func:`record_variants` (recorded, not run). The CPU runs them in Triton's interpreter."""
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "meta" and _recording.get() is not None)


def device_capability(device) -> Optional[tuple]:
    """The CUDA compute capability of ``device`` (the recorded one for meta tensors inside
    :func:`record_variants`), or None for the CPU."""
    device = torch.device(device)
    if device.type == "meta" and _recording.get() is not None:
        return _recording.get().capability
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def operand(t: torch.Tensor) -> Operand:
    return Operand(t, 0, tuple(t.shape), tuple(t.stride()), validate.dtype_name(t))


def check_kv_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The K/V caches' stride rule (``validate.check_cache_layout``), for the MSA ops to check before their
    first launch: their attention launch checks it too, but only after the indexer's launches."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        validate.check_cache_layout(name, 0, cache.stride())


def as_scale(scale, device) -> torch.Tensor:
    """An FP8 cache's scale as the kernels read it: a float32 tensor on ``device``.

    A tensor is used as it is (the kernels read it at run time). None is 1.0: one
    persistent tensor per device, so a graph captured after a warm-up call keeps
    its address. A Python float becomes a new tensor filled on the device (a fill
    kernel, not a host-to-device copy, so a CUDA-graph capture takes it, with the
    value fixed in the graph: pass a tensor for scales that change between replays).
    """
    if isinstance(scale, torch.Tensor):
        return scale
    if scale is None:
        key = str(torch.device(device))
        with _lock:
            one = _ones.get(key)
            if one is None:
                one = _ones[key] = torch.ones((), dtype=torch.float32, device=device)
        return one
    return torch.full((), float(scale), dtype=torch.float32, device=device)


def kv_scales(k_cache: torch.Tensor, k_scale, v_scale, device):
    """(k_scale, v_scale) as the kernels read them: float32 tensors for an FP8 K/V cache
    (:func:`as_scale`), (None, None) for any other."""
    if k_cache.dtype != torch.float8_e4m3fn:
        return None, None
    return as_scale(k_scale, device), as_scale(v_scale, device)


def run(launch: launches.Launch, outputs: Optional[dict] = None) -> dict:
    """Launch ``launch`` (then the launches chained after it) -> ``{output name: tensor}`` (unused ones
    omitted).

    ``outputs``: tensors for some of the named outputs, written in place. Every other output is an
    aliased input (``Launch.aliases``: updated in place), a scratch one (the device's persistent
    workspace; a given scratch tensor is a flat float32 buffer, viewed to the launch's shape), or a new
    tensor. An unused output gets any tensor: the given one, else the first given output, else the
    launch's first. Everything runs on the device of the first given output, else of the first tensor
    argument. Inside :func:`compile_only` (a GPU) the kernels are compiled, not launched.
    """
    outputs = outputs or {}
    device = next(t for t in (*outputs.values(), *launch.args) if isinstance(t, torch.Tensor)).device
    interpret = not compiled(device)
    compiling = _compile_only.get() is not None
    recording = _recording.get() if device.type == "meta" else None
    if device.type == "meta" and recording is None:
        raise ValueError("run: meta tensors launch nothing outside record_variants")
    if compiling and interpret:
        raise ValueError(f"compile_only: the kernels run in Triton's interpreter on {device}; there is nothing "
                         f"to compile")
    pdl = _grid_dependency(device)
    results, done = {}, []   # done: each earlier launch's output tensors, for Prev
    while launch is not None:
        args = [done[-a.back][a.index] if isinstance(a, Prev) else a for a in launch.args]
        outs = _outputs(launch, args, outputs, device)
        if not launch.empty:
            module, fn = launch.kernel.split(".")
            kernel = getattr(kernel_module(module, interpret), fn)
            options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages, launch_pdl=pdl["PDL"],
                           **launch.constexprs, **pdl)
            if recording is not None:
                recording.add(variant_key(launch, kernel, args, outs, options))
            elif compiling:   # the variant a launch with these arguments runs, compiled on the executor
                kernel.warmup(*args, *outs, grid=launch.grid, **options)
            else:
                kernel[launch.grid](*args, *outs, **options)
        results.update((o.name, t) for o, t in zip(launch.outputs, outs) if not o.unused)
        done.append(outs)
        launch = launch.then
    return results


@contextlib.contextmanager
def compile_only(threads: int):
    """Inside the ``with`` block (this thread, CUDA tensors), :func:`run` launches nothing: it hands the
    compilation of each launch's kernel variant (Triton's specialisation of these very arguments: their
    constexprs, warps, stages, integer values 1 and multiples of 16, pointer alignment) to a pool of
    ``threads`` threads (``triton.AsyncCompileMode``; one compilation per variant). On leaving, every
    compilation has finished, each kernel's in-memory cache holds its variants and each variant is loaded
    (its module and launcher), so the launches of the same step afterwards compile and load nothing.
    Yields the mode: ``mode.raw_futures``, one future per compilation. Outputs of the kernels stay
    unwritten: a step run inside computes garbage (on purpose: nothing depends on it)."""
    import triton

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="m3-compile") as executor:
        mode = triton.AsyncCompileMode(executor)
        token = _compile_only.set(mode)
        try:
            with mode:
                yield mode
            # Triton loads a variant (its module into the device, and its launcher: a C compile when the
            # cache folder lacks it) at its first launch; a variant no warm-up step launches (the eager
            # steps, which the graph captures do not run) would load on the request path. Reading
            # ``run`` loads it now, on this thread (its current device).
            for future in mode.raw_futures:
                future.result().run  # noqa: B018 (the property loads the kernel)
        finally:
            _compile_only.reset(token)


class Recording:
    """What :func:`record_variants` collects: ``variants``, the set of :func:`variant_key` of every
    launch run inside it, and ``capability``, the GPU the meta tensors stand for."""

    def __init__(self, capability: tuple):
        self.capability = tuple(capability)
        self.variants: set = set()

    def add(self, key: tuple) -> None:
        self.variants.add(key)


@contextlib.contextmanager
def record_variants(capability: tuple = (9, 0)):
    """Inside the ``with`` block (this thread), meta tensors stand for the tensors of a GPU of compute
    ``capability``: the model and the ops take their GPU paths and :func:`run` records the Triton
    variant key (:func:`variant_key`) of each launch instead of running it. No GPU is needed (the
    CPU suffices); outputs stay meta tensors, so a step recorded runs no data-dependent host code.
    Yields the :class:`Recording`."""
    recording = Recording(capability)
    token = _recording.set(recording)
    try:
        yield recording
    finally:
        _recording.reset(token)


def variant_key(launch: launches.Launch, kernel, args: list, outs: list, options: dict) -> tuple:
    """What picks the compiled variant of a launch (Triton's specialisation of its arguments): the kernel,
    its constexprs and compile options (warps, stages, PDL), and per argument its class: an int's
    (``"1"`` for 1, ``"16"`` for a multiple of 16, ``"int"`` otherwise; one class where the kernel's
    ``do_not_specialize`` names it), a tensor's dtype and 16-byte alignment, a float's ``"float"``."""
    fn = kernel   # a JITFunction
    plain = {fn.arg_names[i] if isinstance(i, int) else i for i in getattr(fn, "do_not_specialize", ())}
    names = [n for n, p in zip(fn.arg_names, fn.params) if not p.is_constexpr]
    classes = []
    for name, a in zip(names, [*args, *outs]):
        if isinstance(a, torch.Tensor):
            classes.append((str(a.dtype), a.storage_offset() * a.element_size() % 16 == 0))
        elif isinstance(a, bool) or not isinstance(a, int):
            classes.append(type(a).__name__)
        elif name in plain:
            classes.append("int")
        else:
            classes.append("1" if a == 1 else "16" if a % 16 == 0 else "int")
    return (launch.kernel, tuple(sorted((k, repr(v)) for k, v in options.items())), tuple(classes))


def _grid_dependency(device) -> dict:
    """``launches.grid_dependency`` of ``device``, asked of the driver once per device."""
    key = (str(device), device_capability(device) if device.type == "meta" else None)
    found = _pdl.get(key)
    if found is None:
        nvidia = compiled(device) and torch.version.hip is None   # ROCm also reports type "cuda"
        found = _pdl[key] = launches.grid_dependency(device_capability(device) if nvidia else None)
    return found


def _outputs(launch: launches.Launch, args: list, given: dict, device) -> list:
    """The output tensors of one launch (``run``)."""
    aliased = {o: i for i, o in launch.aliases}
    outs = []
    for k, o in enumerate(launch.outputs):
        t = given.get(o.name)
        if o.unused:
            pass
        elif o.scratch:
            t = (t if t is not None else workspace(device, o.name, (o.numel,)))[:o.numel].view(o.shape)
        elif t is None and k in aliased:
            t = args[aliased[k]]
        elif t is None:
            t = torch.empty(o.shape, dtype=getattr(torch, o.dtype), device=device)
        outs.append(t)
    stand_in = next(iter(given.values()), None)
    if stand_in is None:
        stand_in = next(t for t in outs if t is not None)
    return [stand_in if t is None else t for t in outs]


def workspace(device, tag: str, shape, dtype=torch.float32) -> torch.Tensor:
    """A persistent buffer per (device, tag), grown on demand and never freed.

    Decode steps reuse the same addresses call after call, so a CUDA graph
    captured after one eager warm-up call replays against valid memory. Calls
    on one GPU share it: run them on one stream (as a decode step does). CPU
    calls may come from several threads: each thread has its own.
    """
    numel = 1
    for s in shape:
        numel *= int(s)
    key = (_owner(device), tag, dtype)
    with _lock:
        buf = _workspaces.get(key)
        if buf is None or buf.numel() < numel:
            buf = _workspaces[key] = torch.empty(max(numel, 1), dtype=dtype, device=device)
    return buf[:numel].view(shape)


def _owner(device):
    """Whose workspaces: the device (one stream per GPU), or the device and thread (CPU)."""
    device = torch.device(device)
    return (str(device), threading.get_ident()) if device.type == "cpu" else (str(device),)


def decode_maps(device, num_requests: int, decode_query_len: int, tokens_per_tile: int):
    """(tile_map, token_map) of a decode batch on ``device``, uploaded once per shape."""
    key = (str(device), num_requests, decode_query_len, tokens_per_tile)
    found = _device_maps.get(key)
    if found is None:
        tile_map, token_map = maps.decode_maps(num_requests, decode_query_len, tokens_per_tile)
        found = (torch.tensor(tile_map, device=device), torch.tensor(token_map, device=device))
        with _lock:
            found = _device_maps.setdefault(key, found)
    return found


def prefill_maps(plan, device, heads: int, kind: str = "attention"):
    """(RowTile, tile_map, token_map) of a PrefillPlan on ``device``, uploaded once per plan
    (``kind``: of ``PrefillPlan.tiles``)."""
    tile, tile_map = plan.tiles(heads, kind)
    tile_map = plan.memo(("torch", str(device), heads, kind), lambda: torch.tensor(tile_map, device=device))
    return tile, tile_map, prefill_token_map(plan, device)


def prefill_token_map(plan, device):
    return plan.memo(("torch", str(device), "token_map"), lambda: torch.tensor(plan.token_map, device=device))


class StepArena:
    """One byte buffer laid out by a :class:`~m3_kernels.planner.WorkspaceLayout` (a step's workspaces)."""

    def __init__(self, layout, device):
        self.layout = layout
        self.buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)

    def region(self, name: str, shape=None) -> torch.Tensor:
        """Region ``name`` as a flat tensor of its dtype, or its first elements viewed as ``shape``."""
        r = self.layout[name]
        flat = self.buffer[r.offset:r.offset + r.nbytes].view(getattr(torch, r.dtype))
        if shape is None:
            return flat
        numel = 1
        for s in shape:
            numel *= int(s)
        if numel > r.numel:
            raise ValueError(f"workspace {name}: {tuple(shape)} needs {numel} elements, the arena holds {r.numel}")
        return flat[:numel].view(tuple(shape))


def step_arena(layout, device) -> StepArena:
    """The arena for ``layout`` on ``device``, allocated on first use and kept (stable addresses)."""
    key = (layout, _owner(device))
    with _lock:
        arena = _arenas.get(key)
        if arena is None:
            arena = _arenas[key] = StepArena(layout, device)
    return arena


# -- one custom op per kernel --------------------------------------------------------------

# The ops are defined with torch.library.Library (schema strings) rather than the torch.library.custom_op
# decorator: both give torch.ops.m3.* ops that torch.compile traces through their fakes and CUDA graphs
# capture, but custom_op wraps every call in Python (its autograd and in-place/view layers, the filling
# of defaults): 149 us a call against 5 us for this op's schema on a 2-core CPU host (torch 2.13). An
# eager msa_decode makes two such calls, a prefill layer four or more. And torch 2.11's custom_op raised
# IndexError for a call that left out trailing defaulted arguments its mutates_args named (sparse_decode's
# paged_attention without `selected`); a schema's defaults are filled by the dispatcher in every version.
_lib = torch.library.Library("m3", "DEF")


def define(schema: str, fn):
    """Define ``m3::<schema>`` with ``fn`` as its kernel on every device and a fake that returns
    nothing (every op writes into arguments its schema marks mutated; inside :func:`record_variants`
    the fake runs ``fn``, whose launches are recorded); -> ``torch.ops.m3.<name>``."""
    name = schema.split("(", 1)[0]
    _lib.define(schema)
    _lib.impl(name, fn, "CompositeExplicitAutograd")
    def fake(*args, **kwargs):
        if _recording.get() is not None:   # meta tensors inside record_variants: record the launches
            fn(*args, **kwargs)

    torch.library.register_fake(f"m3::{name}", fake, lib=_lib)
    return getattr(torch.ops.m3, name)


def _index_scores(idx_q: torch.Tensor, index_k_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, tile_map: torch.Tensor, out: torch.Tensor, tokens_per_tile: int,
                   skip_blocks: int = 0) -> None:
    tile = maps.index_tile(idx_q.shape[1], tokens_per_tile)
    run(launches.index_scores(idx_q=operand(idx_q), index_k=operand(index_k_cache),
                              block_table=operand(block_table), seq_lens=seq_lens, tile_map=tile_map, tile=tile,
                              out_strides=out.stride(), dtype=str(idx_q.dtype), interpret=not compiled(out.device),
                              skip_blocks=skip_blocks),
        {"scores": out})


def _select_blocks(scores: torch.Tensor, seq_lens: torch.Tensor, token_map: torch.Tensor, out: torch.Tensor,
                   topk: int, init_blocks: int, local_blocks: int) -> None:
    run(launches.select_blocks(scores=operand(scores), seq_lens=seq_lens, token_map=token_map, topk=topk,
                               init_blocks=init_blocks, local_blocks=local_blocks, out_strides=out.stride(),
                               interpret=not compiled(out.device)),
        {"block_ids": out})


def _paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_ids: Optional[torch.Tensor], block_table: torch.Tensor, seq_lens: torch.Tensor,
                     tile_map: torch.Tensor, out: torch.Tensor, partial_out: Optional[torch.Tensor],
                     partial_lse: Optional[torch.Tensor], tokens_per_tile: int, sm_scale: float,
                     k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                     scores: Optional[torch.Tensor] = None, token_map: Optional[torch.Tensor] = None,
                     select: Optional[list[int]] = None, selected: Optional[torch.Tensor] = None) -> None:
    """Sparse with ``block_ids`` (read) or ``scores``, dense with neither; ``partial_*``: flat float32
    split-K buffers, or None for the device's workspaces; ``k_scale``/``v_scale``: float32 tensors for
    FP8 caches, else None. ``scores``, ``token_map`` and ``select = [topk, init_blocks, local_blocks]``:
    the blocks are selected first and written to ``selected`` (``launches.Selection``)."""
    tile = maps.row_tile(q.shape[1] // k_cache.shape[1], tokens_per_tile)
    selection = None
    if scores is not None:
        topk, init_blocks, local_blocks = select
        selection = launches.Selection(operand(scores), token_map, int(topk), int(init_blocks), int(local_blocks),
                                       selected.stride())
    launch = launches.paged_attention(
        q=operand(q), k=operand(k_cache), v=operand(v_cache),
        block_ids=None if block_ids is None else operand(block_ids), block_table=operand(block_table),
        seq_lens=seq_lens, tile_map=tile_map, tile=tile, sm_scale=sm_scale, out_dtype=str(q.dtype),
        out_strides=out.stride(), interpret=not compiled(out.device), k_scale=k_scale, v_scale=v_scale,
        select=selection)
    outputs = {"out": out}
    if selection is not None:
        outputs["block_ids"] = selected
    if partial_out is not None:
        outputs.update(partial_out=partial_out, partial_lse=partial_lse)
    run(launch, outputs)


def _write_cache(k: torch.Tensor, v: torch.Tensor, index_k: Optional[torch.Tensor], slot_mapping: torch.Tensor,
                 pool: torch.Tensor, offsets: list[int], k_cache_strides: list[int], v_cache_strides: list[int],
                 index_k_cache_strides: list[int], kv_cache_dtype: torch.dtype, index_cache_dtype: torch.dtype,
                 k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]) -> None:
    """Write into the flat buffer ``pool`` (its bytes: any dtype); a cache is absent (not in this buffer)
    when its strides are []; offsets and strides count the cache dtype's elements from the buffer's start."""
    def cache(i, strides, dtype):
        return Operand(None, offsets[i], (), tuple(strides), str(dtype).removeprefix("torch.")) if strides else None

    run(launches.write_cache(k=operand(k), v=operand(v), index_k=None if index_k is None else operand(index_k),
                             slot_mapping=slot_mapping, pool=pool, pool_shape=pool.shape, pool_dtype=str(pool.dtype),
                             k_cache=cache(0, k_cache_strides, kv_cache_dtype),
                             v_cache=cache(1, v_cache_strides, kv_cache_dtype),
                             index_k_cache=cache(2, index_k_cache_strides, index_cache_dtype),
                             interpret=not compiled(pool.device), k_scale=k_scale, v_scale=v_scale),
        {"pool": pool})


index_scores = define(
    "index_scores(Tensor idx_q, Tensor index_k_cache, Tensor block_table, Tensor seq_lens, Tensor tile_map, "
    "Tensor(a!) out, int tokens_per_tile, int skip_blocks=0) -> ()", _index_scores)
select_blocks = define(
    "select_blocks(Tensor scores, Tensor seq_lens, Tensor token_map, Tensor(a!) out, int topk, int init_blocks, "
    "int local_blocks) -> ()", _select_blocks)
paged_attention = define(
    "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? block_ids, Tensor block_table, "
    "Tensor seq_lens, Tensor tile_map, Tensor(a!) out, Tensor(b!)? partial_out, Tensor(c!)? partial_lse, "
    "int tokens_per_tile, float sm_scale, Tensor? k_scale, Tensor? v_scale, Tensor? scores=None, "
    "Tensor? token_map=None, int[]? select=None, Tensor(d!)? selected=None) -> ()", _paged_attention)
write_cache = define(
    "write_cache(Tensor k, Tensor v, Tensor? index_k, Tensor slot_mapping, Tensor(a!) pool, int[] offsets, "
    "int[] k_cache_strides, int[] v_cache_strides, int[] index_k_cache_strides, ScalarType kv_cache_dtype, "
    "ScalarType index_cache_dtype, Tensor? k_scale, Tensor? v_scale) -> ()", _write_cache)
