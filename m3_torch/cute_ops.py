"""The torch side of the CuTeDSL kernels (``backend="cutedsl"``): compile once per shape class, launch.

The indexer scorer (``cute_index``) and the dense and sparse prefill attention (``cute_prefill``,
below the scorer's code), each behind its op's backend switch (``m3_kernels.backends``).

``torch.ops.m3.index_scores_cutedsl`` takes the arguments of
``torch.ops.m3.index_scores`` (internal; the public ops choose between them,
``m3_kernels.backends``). It hands the kernel raw device pointers, sizes and
strides (no DLPack round trip per call), so any strided ``out`` (the
transposed view of a graph-stable buffer) and strided ``idx_q`` work, on the
current CUDA stream.

Compiled once per shape class (idx_q dtype, Hi, row tile, Di, stages, program
target, index-K cache dtype: bf16/fp16 as idx_q, or float8_e4m3fn) on the first
call, per device, and cached for the process. That
first call must be eager: compiling or loading the module inside a CUDA-graph
capture is refused with an error (run one eager warm-up call, as a decode
step does before it is captured). Later calls, captured or not, only launch:
nothing recompiles as lengths, batch contents or pointers change.
"""

from __future__ import annotations

import threading

import torch

from m3_kernels import backends, maps, tuning
from m3_kernels.validate import check_cache_layout

from . import ops

_lock = threading.Lock()
_compiled: dict = {}

# Fake addresses for compiling: only the pointers' alignment assumptions reach the compiled code.
_ALIGN = dict(q=2, k=16, table=4, lens=4, tile_map=4, scores=4)


def _align(name: str, elem) -> int:
    """The alignment (bytes) the kernel may assume of a pointer: idx_q's element size (1 for an
    e4m3 query), the others fixed."""
    return elem.width // 8 if name == "q" else _ALIGN[name]


def shape_class(dtype: str, num_heads: int, tokens_per_tile: int, head_dim: int,
                cache_dtype: str | None = None) -> tuple:
    """What one compiled kernel is specialized on: (dtype, Hi, heads_pad, block_m, Di, stages, target,
    cache dtype); ``cache_dtype`` (of index_k_cache) defaults to idx_q's ``dtype``."""
    tile = maps.index_tile(num_heads, tokens_per_tile)
    cfg = tuning.cutedsl_index_scores(head_dim=head_dim)
    return (dtype, num_heads, tile.heads_pad, tile.block_m, head_dim, cfg.stages, cfg.target_programs,
            dtype if cache_dtype is None else cache_dtype)


def compile_index_scores(key: tuple, arch: str | None = None):
    """Compile ``cute_index.index_scores_launch`` for shape class ``key`` (see :func:`shape_class`).

    arch: e.g. "sm_90a" to compile without a GPU (tests); None: the current GPU's.
    """
    ci = backends.cutedsl_module()
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    dtype, num_heads, heads_pad, block_m, head_dim, stages, target, cache_dtype = key
    gmem = cute.AddressSpace.gmem
    types = dict(q=ci.dtype_of(dtype), k=ci.dtype_of(cache_dtype), table=cutlass.Int32, lens=cutlass.Int32,
                 tile_map=cutlass.Int32, scores=cutlass.Float32)
    ptrs = [make_ptr(types[n], 1 << 16, gmem, assumed_align=_align(n, types[n])) for n in _ALIGN]
    sizes = [1] * 5 + [1] * 11          # num_tokens .. num_tiles, then the strides (runtime values)
    options = f"--gpu-arch {arch}" if arch else None
    kwargs = {} if options is None else dict(options=options)
    return cute.compile(ci.index_scores_launch, *ptrs, *sizes, cuda.CUstream(0), num_heads=num_heads,
                        heads_pad=heads_pad, block_m=block_m, head_dim=head_dim, stages=stages,
                        target_programs=target, **kwargs)


def _compiled_for(key: tuple, device: torch.device, what: str = "scorer"):
    """The kernel compiled for shape class ``key`` on ``device`` (compiled on its first call): the
    scorer's (``what="scorer"``), the dense prefill's (``"dense prefill"``) or the sparse prefill's
    (``"sparse prefill"``)."""
    full = (what, str(device), *key)
    fn = _compiled.get(full)
    if fn is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"backend='cutedsl': the CuTeDSL {what} kernel for this shape class "
                               f"{key} is compiled and loaded on its first call, which cannot happen inside a "
                               "CUDA-graph capture; make one eager call with the same shapes before capturing")
        with _lock:
            fn = _compiled.get(full)
            if fn is None:
                compile_fn = {"scorer": compile_index_scores, "dense prefill": compile_dense_prefill,
                              "sparse prefill": compile_sparse_prefill}[what]
                fn = _compiled[full] = compile_fn(key)
    return fn


def _check_index_k(index_k_cache: torch.Tensor):
    """TMA reads whole 128 x Di pages: page/token strides multiples of 16 elements (as for the Triton
    scorer), rows contiguous, a 16-byte aligned start."""
    check_cache_layout("index_k_cache", 0, index_k_cache.stride())
    if index_k_cache.stride(-1) != 1 or index_k_cache.data_ptr() % 16:
        raise ValueError("index_k_cache: backend='cutedsl' needs contiguous rows (last stride 1) and a 16-byte "
                         f"aligned start, got strides {tuple(index_k_cache.stride())} at address "
                         f"{index_k_cache.data_ptr():#x}; use backend='triton'")


def _index_scores(idx_q: torch.Tensor, index_k_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, tile_map: torch.Tensor, out: torch.Tensor, tokens_per_tile: int) -> None:
    """``scores [Hi, T, max_blocks]`` (any strides) of ``tile_map``'s row tiles, with the CuTeDSL kernel."""
    num_tokens, num_heads, head_dim = idx_q.shape
    num_requests, max_blocks = block_table.shape
    num_tiles = tile_map.shape[0]
    if num_tokens == 0 or num_tiles == 0 or max_blocks == 0:
        return
    _check_index_k(index_k_cache)
    key = shape_class(str(idx_q.dtype).removeprefix("torch."), num_heads, tokens_per_tile, head_dim,
                      str(index_k_cache.dtype).removeprefix("torch."))
    device = out.device
    fn = _compiled_for(key, device)
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    ci = backends.cutedsl_module()
    q_elem, k_elem = ci.dtype_of(key[0]), ci.dtype_of(key[-1])   # a byte pool's sub-pages: their own type
    gmem = cute.AddressSpace.gmem
    ptrs = [make_ptr(dt, t.data_ptr(), gmem, assumed_align=_align(n, dt)) for n, dt, t in (
        ("q", q_elem, idx_q), ("k", k_elem, index_k_cache), ("table", cutlass.Int32, block_table),
        ("lens", cutlass.Int32, seq_lens), ("tile_map", cutlass.Int32, tile_map), ("scores", cutlass.Float32, out))]
    with torch.cuda.device(device):
        stream = cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
        fn(*ptrs, num_tokens, num_requests, max_blocks, index_k_cache.shape[0], num_tiles,
           *idx_q.stride(), index_k_cache.stride(0), index_k_cache.stride(1), *block_table.stride(),
           seq_lens.stride(0), *out.stride(), stream)


index_scores = ops.define(
    "index_scores_cutedsl(Tensor idx_q, Tensor index_k_cache, Tensor block_table, Tensor seq_lens, "
    "Tensor tile_map, Tensor(a!) out, int tokens_per_tile) -> ()", _index_scores)


# -- dense prefill attention (m3_kernels.cute_prefill) ----------------------------------------

# Fake addresses for compiling, as above: q/out at their element size, the caches' pages 16 B aligned.
_PREFILL_ALIGN = dict(q=2, k=16, v=16, table=4, lens=4, tile_map=4, out=2)
_SPARSE_PREFILL_ALIGN = dict(_PREFILL_ALIGN, ids=4)   # the launch's pointer order: ids after out


def prefill_shape_class(dtype: str, group: int, head_dim: int) -> tuple:
    """What one compiled dense prefill kernel is specialized on: (dtype, group, heads_pad, D, stages)."""
    tile = maps.index_tile(group, maps.MAX_TILE_ROWS)
    return (dtype, group, tile.heads_pad, head_dim, tuning.CUTEDSL_PREFILL_STAGES[head_dim])


def sparse_prefill_shape_class(dtype: str, group: int, head_dim: int, topk: int) -> tuple:
    """What one compiled sparse prefill kernel is specialized on: the dense class and topk."""
    return (*prefill_shape_class(dtype, group, head_dim), topk)


def compile_sparse_prefill(key: tuple, arch: str | None = None):
    """Compile ``cute_prefill.sparse_prefill_launch`` for shape class ``key``
    (:func:`sparse_prefill_shape_class`); ``arch`` as in :func:`compile_dense_prefill`."""
    cp = backends.cutedsl_prefill_module()
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    dtype, group, heads_pad, head_dim, stages, topk = key
    gmem = cute.AddressSpace.gmem
    elem = cp.dtype_of(dtype)
    types = dict(q=elem, k=elem, v=elem, table=cutlass.Int32, lens=cutlass.Int32, tile_map=cutlass.Int32, out=elem,
                 ids=cutlass.Int32)
    ptrs = [make_ptr(types[n], 1 << 16, gmem, assumed_align=a) for n, a in _SPARSE_PREFILL_ALIGN.items()]
    sizes = [1] * 7                    # num_tokens .. num_kv_heads, num_sms (runtime values)
    strides = [1] * 18
    kwargs = {} if arch is None else dict(options=f"--gpu-arch {arch}")
    return cute.compile(cp.sparse_prefill_launch, *ptrs, *sizes, cutlass.Float32(1.0), *strides, cuda.CUstream(0),
                        group=group, heads_pad=heads_pad, head_dim=head_dim, stages=stages, topk=topk, **kwargs)


def compile_dense_prefill(key: tuple, arch: str | None = None):
    """Compile ``cute_prefill.dense_prefill_launch`` for shape class ``key`` (:func:`prefill_shape_class`).

    arch: e.g. "sm_90a" to compile without a GPU (tests); None: the current GPU's.
    """
    cp = backends.cutedsl_prefill_module()
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    dtype, group, heads_pad, head_dim, stages = key
    gmem = cute.AddressSpace.gmem
    elem = cp.dtype_of(dtype)
    types = dict(q=elem, k=elem, v=elem, table=cutlass.Int32, lens=cutlass.Int32, tile_map=cutlass.Int32, out=elem)
    ptrs = [make_ptr(types[n], 1 << 16, gmem, assumed_align=a) for n, a in _PREFILL_ALIGN.items()]
    sizes = [1] * 7                    # num_tokens .. num_kv_heads, num_sms (runtime values)
    strides = [1] * 15
    kwargs = {} if arch is None else dict(options=f"--gpu-arch {arch}")
    return cute.compile(cp.dense_prefill_launch, *ptrs, *sizes, cutlass.Float32(1.0), *strides, cuda.CUstream(0),
                        group=group, heads_pad=heads_pad, head_dim=head_dim, stages=stages, **kwargs)


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of ``device``: the prefill kernel's persistent grid has at most
    one CTA on each."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_kv_cache(name: str, cache: torch.Tensor):
    """TMA reads whole 128 x D pages of one head: rows contiguous, page/head/token strides multiples
    of 16 bytes, a 16-byte aligned start."""
    elem = cache.element_size()
    if (cache.stride(-1) != 1 or cache.data_ptr() % 16
            or any(s * elem % 16 for s in cache.stride()[:-1])):
        raise ValueError(f"{name}: backend='cutedsl' needs contiguous rows (last stride 1), page/head/token strides "
                         f"that are multiples of 16 bytes and a 16-byte aligned start, got strides "
                         f"{tuple(cache.stride())} at address {cache.data_ptr():#x}; use backend='triton'")


def _dense_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, tile_map: torch.Tensor, out: torch.Tensor, sm_scale: float) -> None:
    """``out [T, Hq, D]`` (any strides) of ``tile_map``'s row tiles (``maps.index_tile`` of the group:
    up to 128 rows of tokens x heads) with the CuTeDSL kernel; k_cache/v_cache ``[pages, Hk, 128, D]``."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    num_requests, max_blocks = block_table.shape
    num_tiles = tile_map.shape[0]
    if num_tokens == 0 or num_tiles == 0:
        return
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_kv_cache(name, cache)
    key = prefill_shape_class(str(q.dtype).removeprefix("torch."), num_heads // num_kv_heads, head_dim)
    device = out.device
    fn = _compiled_for(key, device, "dense prefill")
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    elem = backends.cutedsl_prefill_module().dtype_of(key[0])
    gmem = cute.AddressSpace.gmem
    types = dict(q=elem, k=elem, v=elem, table=cutlass.Int32, lens=cutlass.Int32, tile_map=cutlass.Int32, out=elem)
    tensors = dict(q=q, k=k_cache, v=v_cache, table=block_table, lens=seq_lens, tile_map=tile_map, out=out)
    ptrs = [make_ptr(types[n], tensors[n].data_ptr(), gmem, assumed_align=a) for n, a in _PREFILL_ALIGN.items()]
    with torch.cuda.device(device):
        stream = cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
        fn(*ptrs, num_tokens, num_requests, max_blocks, k_cache.shape[0], num_tiles, num_kv_heads, sm_count(device),
           cutlass.Float32(sm_scale), *q.stride(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
           v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *block_table.stride(), seq_lens.stride(0),
           *out.stride(), stream)


def _sparse_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, tile_map: torch.Tensor, out: torch.Tensor,
                    sm_scale: float) -> None:
    """``out [T, Hq, D]`` (any strides) of ``tile_map``'s row tiles (``maps.index_tile`` of the group),
    each row over its token's ``block_ids [Hk, T, topk]`` (any strides), with the CuTeDSL kernel."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    num_requests, max_blocks = block_table.shape
    num_tiles = tile_map.shape[0]
    if num_tokens == 0 or num_tiles == 0:
        return
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_kv_cache(name, cache)
    key = sparse_prefill_shape_class(str(q.dtype).removeprefix("torch."), num_heads // num_kv_heads, head_dim,
                                     block_ids.shape[2])
    device = out.device
    fn = _compiled_for(key, device, "sparse prefill")
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    elem = backends.cutedsl_prefill_module().dtype_of(key[0])
    gmem = cute.AddressSpace.gmem
    types = dict(q=elem, k=elem, v=elem, table=cutlass.Int32, lens=cutlass.Int32, tile_map=cutlass.Int32, out=elem,
                 ids=cutlass.Int32)
    tensors = dict(q=q, k=k_cache, v=v_cache, table=block_table, lens=seq_lens, tile_map=tile_map, out=out,
                   ids=block_ids)
    ptrs = [make_ptr(types[n], tensors[n].data_ptr(), gmem, assumed_align=a)
            for n, a in _SPARSE_PREFILL_ALIGN.items()]
    with torch.cuda.device(device):
        stream = cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
        fn(*ptrs, num_tokens, num_requests, max_blocks, k_cache.shape[0], num_tiles, num_kv_heads, sm_count(device),
           cutlass.Float32(sm_scale), *q.stride(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
           v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *block_table.stride(), seq_lens.stride(0),
           *out.stride(), *block_ids.stride(), stream)


dense_prefill = ops.define(
    "dense_prefill_cutedsl(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
    "Tensor tile_map, Tensor(a!) out, float sm_scale) -> ()", _dense_prefill)


sparse_prefill = ops.define(
    "sparse_prefill_cutedsl(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_ids, Tensor block_table, "
    "Tensor seq_lens, Tensor tile_map, Tensor(a!) out, float sm_scale) -> ()", _sparse_prefill)
