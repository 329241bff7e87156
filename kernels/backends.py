"""The indexer-backend switch (SPEC.md, "Indexer backends"), for both frameworks.

``backend="triton"`` (the default) scores with ``index.index_scores_kernel``;
``backend="cutedsl"`` with the CuTeDSL kernel of ``cute_index.py`` (Hopper
sm_90+, optional package ``nvidia-cutlass-dsl``; bf16/fp16 index caches with a
query of their dtype, e4m3 ones with a bf16, fp16 or e4m3 query). The environment variable
``M3_INDEXER_SCORE`` sets the default (read at each call), an argument wins.
A backend that cannot run is an error, never a silent fallback.

Each public op that scores calls :func:`check_indexer_backend` once, after
its argument checks (``validate``); it reads shapes, dtypes and a device
description only (no values, no device sync), and imports ``cutlass`` only
when the CuTeDSL backend is asked for.

``dense_prefill`` has the same switch (SPEC.md, "Prefill attention backends"):
``backend="triton"`` (the default) runs ``attention.paged_attention_kernel``,
``backend="cutedsl"`` the CuTeDSL kernel of ``cute_prefill.py`` (Hopper sm_90a only,
bf16/fp16 q with K/V caches of its dtype, D in 64/128, up to 128 query heads
per KV head); the environment variable ``M3_DENSE_PREFILL`` sets the default,
an argument wins, and the errors are the indexer's
(:func:`check_dense_prefill_backend`). ``msa_attention_step`` on a dense layer
(the models' layers 0-2) runs its context span with the variable's backend.

``sparse_prefill`` has its own switch of the same kind (SPEC.md, "Prefill attention backends"):
the CuTeDSL kernel is ``cute_prefill.py``'s sparse mode, under ``dense_prefill``'s conditions plus
tiles of at most ``CUTEDSL_SPARSE_MAX_TOKENS`` tokens (``Hq // Hk`` of 4 or more) and at most
``CUTEDSL_SPARSE_MAX_ENTRIES`` (tokens x topk) block ids per tile; the variable is
``M3_SPARSE_PREFILL`` (:func:`check_sparse_prefill_backend`). ``msa_prefill`` and
``msa_attention_step`` on a sparse layer (the models' MSA layers: their context span) attend with
the variable's backend too; their ``backend`` argument is the indexer's.
"""

from __future__ import annotations

import importlib
import os
from typing import Optional, Tuple

from .maps import MAX_TILE_ROWS, next_pow2

INDEXER_BACKENDS = ("triton", "cutedsl")
ENV_VAR = "M3_INDEXER_SCORE"
DENSE_PREFILL_BACKENDS = INDEXER_BACKENDS
DENSE_PREFILL_ENV_VAR = "M3_DENSE_PREFILL"
SPARSE_PREFILL_BACKENDS = INDEXER_BACKENDS
SPARSE_PREFILL_ENV_VAR = "M3_SPARSE_PREFILL"
# cute_prefill.SPARSE_MAX_TOKENS / SPARSE_MAX_ENTRIES: a block's choosing tokens are one int32 bit
# mask, a tile's block list has room for 128 ids in shared memory (M3: 8 tokens x topk 16)
CUTEDSL_SPARSE_MAX_TOKENS = 32
CUTEDSL_SPARSE_MAX_ENTRIES = 128
CUTEDSL_HEAD_DIMS = (64, 128)
CUTEDSL_DTYPES = ("bfloat16", "float16")   # idx_q (and a 16-bit index-K cache: the same dtype)
CUTEDSL_FP8 = "float8_e4m3fn"              # an FP8 index-K cache (unscaled), with any of those queries or an e4m3 one
CUTEDSL_MIN_CAPABILITY = (9, 0)
CUTEDSL_PACKAGE = "nvidia-cutlass-dsl==4.8.1"
INSTALL_HINT = (f'install the optional extra: pip install -e ".[cutedsl]" ({CUTEDSL_PACKAGE}); on a machine without '
                f'network access see README.md, "CuteDSL indexer backend"')


def indexer_backend(backend: Optional[str] = None) -> str:
    """``backend``, or ``$M3_INDEXER_SCORE``, or "triton" -> a valid backend name (else ValueError)."""
    return _backend_name(backend, ENV_VAR, INDEXER_BACKENDS)


def dense_prefill_backend(backend: Optional[str] = None) -> str:
    """``backend``, or ``$M3_DENSE_PREFILL``, or "triton" -> a valid backend name (else ValueError)."""
    return _backend_name(backend, DENSE_PREFILL_ENV_VAR, DENSE_PREFILL_BACKENDS)


def sparse_prefill_backend(backend: Optional[str] = None) -> str:
    """``backend``, or ``$M3_SPARSE_PREFILL``, or "triton" -> a valid backend name (else ValueError)."""
    return _backend_name(backend, SPARSE_PREFILL_ENV_VAR, SPARSE_PREFILL_BACKENDS)


def _backend_name(backend: Optional[str], env_var: str, names: Tuple[str, ...]) -> str:
    if backend is None:
        env = os.environ.get(env_var, "").strip()
        if env and env.lower() not in names:
            raise ValueError(f"{env_var}: expected one of {', '.join(names)}, got {env!r}")
        return env.lower() or "triton"
    if not isinstance(backend, str) or backend not in names:
        raise ValueError(f"backend: expected one of {', '.join(repr(b) for b in names)} (or None for "
                         f"${env_var}, default 'triton'), got {backend!r}")
    return backend


def check_indexer_backend(backend: Optional[str], *, num_heads: int, head_dim: int, dtype: str,
                          device: str, capability: Optional[Tuple[int, int]], cache_dtype: Optional[str] = None) -> str:
    """Resolve the backend of one scoring call and check that it can run it -> "triton" or "cutedsl".

    num_heads / head_dim / dtype: of idx_q (``Hi``, ``Di``, dtype name);
    cache_dtype: of the index-K cache (default: ``dtype``);
    device: where the call runs ("cuda" for an NVIDIA GPU, else e.g. "cpu");
    capability: the GPU's compute capability (major, minor), None off a GPU.
    Errors: unknown name ValueError; Di or Hi the kernel lacks ValueError; a
    dtype pair it lacks (``cutedsl_dtypes_supported``) TypeError; not an sm_90+ NVIDIA GPU RuntimeError; the
    package missing ImportError (with the install hint).
    """
    name = indexer_backend(backend)
    if name == "triton":
        return name
    if head_dim not in CUTEDSL_HEAD_DIMS:
        raise ValueError(f"idx_q: backend='cutedsl' supports index head dims Di in {CUTEDSL_HEAD_DIMS}, got "
                         f"Di={head_dim}; use backend='triton'")
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    if not cutedsl_dtypes_supported(dtype, cache_dtype):
        raise TypeError(f"idx_q/index_k_cache: backend='cutedsl' supports {' and '.join(CUTEDSL_DTYPES)} index "
                        f"caches (the dtype of idx_q) and {CUTEDSL_FP8} ones (idx_q {', '.join(CUTEDSL_DTYPES)} or "
                        f"{CUTEDSL_FP8}), got idx_q {dtype} and index_k_cache {cache_dtype}; use backend='triton'")
    if next_pow2(num_heads) > MAX_TILE_ROWS:
        raise ValueError(f"idx_q: backend='cutedsl' supports up to {MAX_TILE_ROWS} index heads, got Hi={num_heads}")
    _check_cutedsl_device(device, capability)
    cutedsl_module()
    return name


def check_dense_prefill_backend(backend: Optional[str], *, group: int, head_dim: int, dtype: str, cache_dtype: str,
                                device: str, capability: Optional[Tuple[int, int]]) -> str:
    """Resolve the backend of one ``dense_prefill`` call and check that it can run it -> "triton" or "cutedsl".

    group / head_dim / dtype: Hq // Hk, D and q's dtype name; cache_dtype: of the K/V caches;
    device, capability: as in :func:`check_indexer_backend`. Errors as there: unknown name ValueError;
    D or a group the kernel lacks ValueError; a dtype pair it lacks (FP8 caches included) TypeError;
    not an sm_90+ NVIDIA GPU RuntimeError; the package missing ImportError (with the install hint).
    """
    name = dense_prefill_backend(backend)
    if name == "cutedsl":
        _check_cutedsl_prefill("dense_prefill", group, head_dim, dtype, cache_dtype, device, capability)
    return name


def check_sparse_prefill_backend(backend: Optional[str], *, group: int, head_dim: int, topk: int, dtype: str,
                                 cache_dtype: str, device: str, capability: Optional[Tuple[int, int]]) -> str:
    """Resolve the backend of one ``sparse_prefill`` call and check that it can run it -> "triton" or
    "cutedsl". As :func:`check_dense_prefill_backend` (``$M3_SPARSE_PREFILL``), with ``topk`` (block
    ids per token); ``topk`` 0, a tile of more than ``CUTEDSL_SPARSE_MAX_TOKENS`` tokens (``Hq // Hk`` < 4)
    or of more than ``CUTEDSL_SPARSE_MAX_ENTRIES`` ids (tokens x topk) is a ValueError.
    """
    name = sparse_prefill_backend(backend)
    if name == "triton":
        return name
    if topk < 1:
        # the kernel's block list has tokens x topk slots in shared memory: none to build it in
        raise ValueError(f"block_ids: backend='cutedsl' for sparse_prefill needs topk >= 1 (block_ids [Hk, T, topk]), "
                         f"got topk={topk}; use backend='triton'")
    tokens = MAX_TILE_ROWS // next_pow2(group)
    if tokens > CUTEDSL_SPARSE_MAX_TOKENS or tokens * topk > CUTEDSL_SPARSE_MAX_ENTRIES:
        raise ValueError(f"q/block_ids: backend='cutedsl' for sparse_prefill takes tiles of at most "
                         f"{CUTEDSL_SPARSE_MAX_TOKENS} tokens (Hq // Hk >= {MAX_TILE_ROWS // CUTEDSL_SPARSE_MAX_TOKENS})"
                         f" and at most {CUTEDSL_SPARSE_MAX_ENTRIES} block ids per tile (tokens x topk), got "
                         f"Hq // Hk = {group} ({tokens} tokens per tile) and topk={topk}; use backend='triton'")
    _check_cutedsl_prefill("sparse_prefill", group, head_dim, dtype, cache_dtype, device, capability)
    return name


def _check_cutedsl_prefill(op: str, group: int, head_dim: int, dtype: str, cache_dtype: str, device: str,
                           capability: Optional[Tuple[int, int]]) -> None:
    """The CuTeDSL prefill kernel (``cute_prefill.py``) can run this call of ``op``, or the error."""
    if head_dim not in CUTEDSL_HEAD_DIMS:
        raise ValueError(f"q: backend='cutedsl' supports head dims D in {CUTEDSL_HEAD_DIMS}, got D={head_dim}; "
                         f"use backend='triton'")
    if dtype not in CUTEDSL_DTYPES or cache_dtype != dtype:
        raise TypeError(f"q/k_cache: backend='cutedsl' supports {' and '.join(CUTEDSL_DTYPES)} q with K/V caches of "
                        f"its dtype, got q {dtype} and k_cache {cache_dtype}; use backend='triton'")
    if next_pow2(group) > MAX_TILE_ROWS:
        raise ValueError(f"q: backend='cutedsl' supports up to {MAX_TILE_ROWS} query heads per KV head, got "
                         f"Hq // Hk = {group}")
    _check_cutedsl_device(device, capability)
    if capability[0] != 9:
        raise RuntimeError(f"backend='cutedsl' for {op} uses Hopper's warpgroup MMA (wgmma, sm_90a), which "
                           f"this GPU (compute capability {'.'.join(map(str, capability))}) lacks; "
                           f"use backend='triton'")
    cutedsl_prefill_module()


def _check_cutedsl_device(device: str, capability: Optional[Tuple[int, int]]) -> None:
    if device != "cuda":
        raise RuntimeError(f"backend='cutedsl' runs on NVIDIA GPUs of compute capability "
                           f"{'.'.join(map(str, CUTEDSL_MIN_CAPABILITY))}+ (Hopper sm_90 or newer), but this call "
                           f"runs on {device}; use backend='triton' (CPU tensors run it in Triton's interpreter)")
    if capability is None or tuple(capability) < CUTEDSL_MIN_CAPABILITY:
        raise RuntimeError(f"backend='cutedsl' needs compute capability "
                           f"{'.'.join(map(str, CUTEDSL_MIN_CAPABILITY))}+ (Hopper sm_90 or newer), this GPU has "
                           f"{'unknown' if capability is None else '.'.join(map(str, capability))}; "
                           f"use backend='triton'")


def cutedsl_dtypes_supported(dtype: str, cache_dtype: str) -> bool:
    """Whether the CuTeDSL scorer takes idx_q of ``dtype`` with an index-K cache of ``cache_dtype``:
    a bf16/fp16 cache with a query of its dtype, or an e4m3 cache with a bf16, fp16 or e4m3 query."""
    if cache_dtype == CUTEDSL_FP8:
        return dtype in CUTEDSL_DTYPES or dtype == CUTEDSL_FP8
    return dtype in CUTEDSL_DTYPES and cache_dtype == dtype


def cutedsl_module():
    """``m3_kernels.cute_index`` (imports ``cutlass``), or ImportError with the install hint."""
    return _cutedsl_kernels("cute_index")


def cutedsl_prefill_module():
    """``m3_kernels.cute_prefill`` (imports ``cutlass``), or ImportError with the install hint."""
    return _cutedsl_kernels("cute_prefill")


def _cutedsl_kernels(name: str):
    try:
        return importlib.import_module(f".{name}", __package__)
    except ImportError as e:
        raise ImportError(f"backend='cutedsl' needs the CuTeDSL package, which is not importable here ({e}); "
                          f"{INSTALL_HINT}") from e
