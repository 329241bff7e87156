"""Every argument check of the public ops, for both frameworks.

The shape/dtype checks read ``.shape``, ``.dtype`` (and, for torch, strides
through the launch description) only, never values, so no check synchronizes
with the device and a decode step stays CUDA-graph capturable. Dtypes are
compared by name, which torch ("torch.bfloat16") and JAX/numpy ("bfloat16")
both provide. Each public op calls ONE ``check_*_call`` here, which returns a
:class:`Call` with the sizes it resolved; composite ops do not re-check
inside. Value checks (opt-in, ``M3_VALIDATE=1``) are at the end.
"""

from __future__ import annotations

import dataclasses
import numbers
import os

import numpy as np

from .maps import FP8_BLOCK, MX_BLOCK, PAGE_SIZE, cdiv
from .norm import MAX_WIDTH
from .router import MAX_EXPERTS, MAX_TOP_K
from .sampling import MAX_VOCAB

FLOAT_DTYPES = ("bfloat16", "float16", "float32")
FP8 = "float8_e4m3fn"   # the one FP8 cache format (SPEC.md, "FP8 caches")


@dataclasses.dataclass(frozen=True)
class Call:
    """What a validated call resolved (0 where it does not apply)."""
    num_requests: int = 0
    max_blocks: int = 0
    num_tokens: int = 0
    num_q_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    num_index_heads: int = 0
    index_head_dim: int = 0
    sm_scale: float = 0.0

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def dtype_name(x) -> str:
    return str(x.dtype).removeprefix("torch.")


def _shape(x):
    return tuple(int(s) for s in x.shape)


def check_rank(name, x, rank, layout):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an array of rank {rank} {layout}, got {type(x).__name__}")
    if len(x.shape) != rank:
        raise ValueError(f"{name}: expected rank {rank} {layout}, got shape {_shape(x)}")


def check_dtype(name, x, allowed):
    allowed = (allowed,) if isinstance(allowed, str) else tuple(allowed)
    if dtype_name(x) not in allowed:
        raise TypeError(f"{name}: expected dtype {' or '.join(allowed)}, got {dtype_name(x)}")


def check_cache_dtype(name, cache, model_dtype):
    """A cache holds the model's dtype or FP8 (float8_e4m3fn); other FP8 formats are named as such."""
    got, allowed = dtype_name(cache), tuple(dict.fromkeys((model_dtype, FP8)))
    if got in allowed:
        return got
    if got.startswith("float8"):
        raise TypeError(f"{name}: FP8 caches must be {FP8}, got {got} (no other FP8 format is supported)")
    raise TypeError(f"{name}: expected dtype {' or '.join(allowed)}, got {got}")


def check_scales(kv_cache_dtype, **scales):
    """``k_scale``/``v_scale``: None, a Python number, or a float32 array of shape [] or [1]
    (one scale per layer); only for FP8 K/V caches."""
    for name, scale in scales.items():
        if scale is None:
            continue
        if kv_cache_dtype != FP8:
            raise ValueError(f"{name}: scales apply to {FP8} K/V caches only, but the caches are {kv_cache_dtype}; "
                             f"pass {name}=None")
        if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
            continue   # converted by the op
        if not hasattr(scale, "shape") or not hasattr(scale, "dtype"):
            raise TypeError(f"{name}: expected a float or a float32 array of shape [] or [1], "
                            f"got {type(scale).__name__}")
        check_dtype(name, scale, "float32")
        if _shape(scale) not in ((), (1,)):
            raise ValueError(f"{name}: expected one scale per layer (shape [] or [1]), got shape {_shape(scale)}; "
                             "per-token or per-head scales are not supported")


def check_dim(name, x, axis, expected, what):
    got = int(x.shape[axis])
    if got != expected:
        raise ValueError(f"{name}: expected {what} = {expected} (axis {axis}), got {got} in shape {_shape(x)}")


def check_head_dim(name, d):
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"{name}: head dim must be a power of two in [16, 256], got {d}")


def softmax_scale(sm_scale, head_dim) -> float:
    """``sm_scale`` (a real number: a kernel scalar, which JAX bakes into its kernel), or the default
    ``head_dim ** -0.5`` (SPEC.md)."""
    if sm_scale is None:
        return head_dim ** -0.5
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale: expected a float or None (D ** -0.5), got {type(sm_scale).__name__}")
    return float(sm_scale)


def check_cache_layout(name, offset, strides):
    """Cache offsets and all strides but the last must be multiples of 16 elements.

    The kernels state this to the compiler (``multiple_of_16``) so that K/V
    loads vectorize and pipeline in both frameworks. Any cache whose head dim
    is a multiple of 16 and whose rows are contiguous, HND, NHD or inside a
    pool, satisfies it.
    """
    if any(int(x) % 16 for x in (offset, *strides[:-1])):
        raise ValueError(f"{name}: element offset and strides (except the last) must be multiples of 16, "
                         f"got offset {int(offset)}, strides {tuple(int(x) for x in strides)}")


# -- metadata and rows --------------------------------------------------------------------

def check_metadata(block_table, seq_lens):
    """-> (R, max_blocks)."""
    check_rank("block_table", block_table, 2, "[R, max_blocks]")
    check_dtype("block_table", block_table, "int32")
    check_rank("seq_lens", seq_lens, 1, "[R]")
    check_dtype("seq_lens", seq_lens, "int32")
    check_dim("seq_lens", seq_lens, 0, int(block_table.shape[0]), "R (rows of block_table)")
    return int(block_table.shape[0]), int(block_table.shape[1])


def check_int(name, value, minimum):
    """An int (Python or numpy integer, not bool) >= ``minimum`` -> Python int."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    value = int(value.__index__())
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_rows(name, x, num_requests, *, decode_query_len=None, prefill=None, cu_seqlens_q=None, axis=0) -> int:
    """The token axis of ``x`` against decode (``T = R * decode_query_len``) or a PrefillPlan -> T.

    ``cu_seqlens_q``: the array the plan was read from, if any (shape and dtype checked).
    """
    if cu_seqlens_q is not None and hasattr(cu_seqlens_q, "shape"):
        check_cu_seqlens(cu_seqlens_q, num_requests)
    if prefill is not None:
        if prefill.num_rows != num_requests:
            source = "cu_seqlens_q" if cu_seqlens_q is not None else "plan"
            raise ValueError(f"{source}: {prefill.num_rows} requests, but block_table/seq_lens have {num_requests}")
        check_dim(name, x, axis, prefill.num_tokens, "T = cu_seqlens_q[-1]")
        return prefill.num_tokens
    n = check_int("decode_query_len", decode_query_len, 1)
    check_dim(name, x, axis, num_requests * n, f"T = R * decode_query_len = {num_requests} * {n}")
    return num_requests * n


def check_cu_seqlens(cu_seqlens_q, num_requests):
    """cu_seqlens_q [R + 1] int32 (its values are read by the planner, never here)."""
    check_rank("cu_seqlens_q", cu_seqlens_q, 1, "[R + 1]")
    check_dtype("cu_seqlens_q", cu_seqlens_q, "int32")
    check_dim("cu_seqlens_q", cu_seqlens_q, 0, num_requests + 1, "R + 1 (rows of block_table + 1)")


def check_out(out, shape, dtype):
    if out is None:
        return
    if _shape(out) != tuple(shape):
        raise ValueError(f"out: expected shape {tuple(shape)}, got {_shape(out)}")
    check_dtype("out", out, dtype)


# -- operands ---------------------------------------------------------------------------

def check_kv_caches(q, k_cache, v_cache):
    """q [T, Hq, D], caches [pages, Hk, PAGE_SIZE, D] (logical HND) of q's dtype or FP8 -> (Hq, Hk, D)."""
    check_rank("q", q, 3, "[T, Hq, D]")
    check_dtype("q", q, FLOAT_DTYPES)
    num_q_heads, head_dim = int(q.shape[1]), int(q.shape[2])
    check_head_dim("q", head_dim)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_rank(name, cache, 4, "[pages, Hk, 128, D]")
        check_cache_dtype(name, cache, dtype_name(q))
        check_dim(name, cache, 2, PAGE_SIZE, "page size")
        check_dim(name, cache, 3, head_dim, "head dim D of q")
    check_dtype("v_cache", v_cache, dtype_name(k_cache))
    check_dim("v_cache", v_cache, 1, int(k_cache.shape[1]), "Hk of k_cache")
    num_kv_heads = int(k_cache.shape[1])
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"q/k_cache: query heads Hq={num_q_heads} must be a multiple of KV heads Hk={num_kv_heads}")
    return num_q_heads, num_kv_heads, head_dim


def check_index_inputs(idx_q, index_k_cache):
    """idx_q [T, Hi, Di], index_k_cache [pages, PAGE_SIZE, Di] of idx_q's dtype or FP8 -> (Hi, Di)."""
    check_rank("idx_q", idx_q, 3, "[T, Hi, Di]")
    check_dtype("idx_q", idx_q, FLOAT_DTYPES + (FP8,))
    check_rank("index_k_cache", index_k_cache, 3, "[pages, 128, Di]")
    check_cache_dtype("index_k_cache", index_k_cache, dtype_name(idx_q))
    check_dim("index_k_cache", index_k_cache, 1, PAGE_SIZE, "page size")
    head_dim = int(idx_q.shape[2])
    check_head_dim("idx_q", head_dim)
    check_dim("index_k_cache", index_k_cache, 2, head_dim, "index head dim Di of idx_q")
    return int(idx_q.shape[1]), head_dim


def check_index_heads(num_index_heads, num_kv_heads):
    if num_index_heads != num_kv_heads:
        raise ValueError(f"idx_q: index heads Hi={num_index_heads} must equal KV heads Hk={num_kv_heads}")


def check_block_ids(block_ids, num_kv_heads, num_tokens):
    """block_ids [Hk, T, topk] int32 -> topk."""
    check_rank("block_ids", block_ids, 3, "[Hk, T, topk]")
    check_dtype("block_ids", block_ids, "int32")
    check_dim("block_ids", block_ids, 0, num_kv_heads, "Hk (KV heads of k_cache)")
    check_dim("block_ids", block_ids, 1, num_tokens, "T (tokens of q)")
    return int(block_ids.shape[2])


def check_selection_args(topk, init_blocks, local_blocks):
    """-> (topk, init_blocks, local_blocks) as Python ints."""
    topk = check_int("topk", topk, 1)
    init_blocks = check_int("init_blocks", init_blocks, 0)
    local_blocks = check_int("local_blocks", local_blocks, 0)
    if init_blocks + local_blocks > topk:
        raise ValueError(f"init_blocks + local_blocks ({init_blocks} + {local_blocks}) must not exceed topk ({topk})")
    return topk, init_blocks, local_blocks


# -- one check per public call ------------------------------------------------------------

def check_index_call(idx_q, index_k_cache, block_table, seq_lens, *, decode_query_len=None, prefill=None,
                     cu_seqlens_q=None, out=None) -> Call:
    """``index_scores`` / ``index_scores_prefill``."""
    num_requests, max_blocks = check_metadata(block_table, seq_lens)
    num_heads, head_dim = check_index_inputs(idx_q, index_k_cache)
    num_tokens = check_rows("idx_q", idx_q, num_requests, decode_query_len=decode_query_len, prefill=prefill,
                            cu_seqlens_q=cu_seqlens_q)
    check_out(out, (num_heads, num_tokens, max_blocks), "float32")
    return Call(num_requests, max_blocks, num_tokens, num_index_heads=num_heads, index_head_dim=head_dim)


def check_select_call(scores, seq_lens, *, topk, init_blocks, local_blocks, decode_query_len=None, prefill=None,
                      cu_seqlens_q=None, out=None) -> Call:
    """``select_blocks`` / ``select_blocks_prefill``."""
    check_selection_args(topk, init_blocks, local_blocks)
    check_rank("seq_lens", seq_lens, 1, "[R]")
    check_dtype("seq_lens", seq_lens, "int32")
    check_rank("scores", scores, 3, "[Hi, T, max_blocks]")
    check_dtype("scores", scores, "float32")
    num_requests = int(seq_lens.shape[0])
    num_tokens = check_rows("scores", scores, num_requests, decode_query_len=decode_query_len, prefill=prefill,
                            cu_seqlens_q=cu_seqlens_q, axis=1)
    check_out(out, (int(scores.shape[0]), num_tokens, topk), "int32")
    return Call(num_requests, int(scores.shape[2]), num_tokens, num_index_heads=int(scores.shape[0]))


def check_attention_call(q, k_cache, v_cache, block_table, seq_lens, *, block_ids=None, sm_scale=None,
                         decode_query_len=None, prefill=None, cu_seqlens_q=None, out=None, k_scale=None,
                         v_scale=None) -> Call:
    """``sparse_*`` (with ``block_ids``) and ``dense_*``, decode or prefill."""
    num_requests, max_blocks = check_metadata(block_table, seq_lens)
    num_q_heads, num_kv_heads, head_dim = check_kv_caches(q, k_cache, v_cache)
    check_scales(dtype_name(k_cache), k_scale=k_scale, v_scale=v_scale)
    num_tokens = check_rows("q", q, num_requests, decode_query_len=decode_query_len, prefill=prefill,
                            cu_seqlens_q=cu_seqlens_q)
    if block_ids is not None:
        check_block_ids(block_ids, num_kv_heads, num_tokens)
    check_out(out, q.shape, dtype_name(q))
    return Call(num_requests, max_blocks, num_tokens, num_q_heads, num_kv_heads, head_dim,
                sm_scale=softmax_scale(sm_scale, head_dim))


def check_msa_call(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, *, topk, init_blocks,
                   local_blocks, sm_scale=None, decode_query_len=None, prefill=None, cu_seqlens_q=None,
                   out=None, k_scale=None, v_scale=None) -> Call:
    """``msa_decode`` / ``msa_prefill``: the three stages' inputs at once."""
    check_selection_args(topk, init_blocks, local_blocks)
    call = check_attention_call(q, k_cache, v_cache, block_table, seq_lens, sm_scale=sm_scale,
                                decode_query_len=decode_query_len, prefill=prefill,
                                cu_seqlens_q=cu_seqlens_q, out=out, k_scale=k_scale, v_scale=v_scale)
    num_index_heads, index_head_dim = check_index_inputs(idx_q, index_k_cache)
    check_index_heads(num_index_heads, call.num_kv_heads)
    check_dim("idx_q", idx_q, 0, call.num_tokens, "T (tokens of q)")
    return dataclasses.replace(call, num_index_heads=num_index_heads, index_head_dim=index_head_dim)


def check_step_call(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, *, config, num_rows,
                    num_tokens, block_bound, sparse, init_blocks, local_blocks, sm_scale=None, out=None,
                    k_scale=None, v_scale=None) -> Call:
    """``msa_attention_step``: a mixed step's arrays against the step's plan.

    config: the planner's StepConfig; num_rows / num_tokens: the plan's, padding
    included; block_bound: the most block-table columns any span of the plan reads.
    """
    if sparse:
        check_selection_args(config.topk, init_blocks, local_blocks)
    num_requests, max_blocks = check_metadata(block_table, seq_lens)
    num_q_heads, num_kv_heads, head_dim = check_kv_caches(q, k_cache, v_cache)
    check_scales(dtype_name(k_cache), k_scale=k_scale, v_scale=v_scale)
    for name, got, want in (("q: Hq", num_q_heads, config.num_q_heads),
                            ("k_cache: Hk", num_kv_heads, config.num_kv_heads), ("q: D", head_dim, config.head_dim)):
        if got != want:
            raise ValueError(f"{name} = {got}, but the step was planned for {want}")
    if num_requests != num_rows:
        raise ValueError(f"block_table/seq_lens: expected R = {num_rows} rows (the plan's, padding included), "
                         f"got {num_requests}")
    check_dim("q", q, 0, num_tokens, "T (the plan's query tokens, padding included)")
    if max_blocks < block_bound:
        raise ValueError(f"block_table: expected >= {block_bound} columns (the plan's block bound), got {max_blocks}")
    if sparse:
        if idx_q is None or index_k_cache is None:
            raise ValueError("idx_q, index_k_cache: required for a sparse layer (sparse=True)")
        num_index_heads, _ = check_index_inputs(idx_q, index_k_cache)
        check_index_heads(num_index_heads, num_kv_heads)
        check_dim("idx_q", idx_q, 0, num_tokens, "T (tokens of q)")
    check_out(out, q.shape, dtype_name(q))
    return Call(num_requests, max_blocks, num_tokens, num_q_heads, num_kv_heads, head_dim,
                sm_scale=softmax_scale(sm_scale, head_dim))


def check_cache_write(k, v, index_k, k_cache, v_cache, index_k_cache, slot_mapping, k_scale=None, v_scale=None):
    """``write_cache``: k, v [T, Hk, D]; index_k [T, Di] or None; caches as in SPEC.md (k's dtype
    or FP8); slot_mapping [T] int32/int64; scales for FP8 K/V caches. -> T."""
    check_rank("k", k, 3, "[T, Hk, D]")
    check_dtype("k", k, FLOAT_DTYPES)
    num_tokens, num_kv_heads, head_dim = (int(s) for s in k.shape)
    check_head_dim("k", head_dim)
    check_rank("v", v, 3, "[T, Hk, D]")
    check_dtype("v", v, dtype_name(k))
    for axis, (want, what) in enumerate(((num_tokens, "T"), (num_kv_heads, "Hk"), (head_dim, "D"))):
        check_dim("v", v, axis, want, f"{what} of k")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_rank(name, cache, 4, "[slots, Hk, 128, D]")
        check_cache_dtype(name, cache, dtype_name(k))
        check_dim(name, cache, 1, num_kv_heads, "Hk of k")
        check_dim(name, cache, 2, PAGE_SIZE, "page size")
        check_dim(name, cache, 3, head_dim, "D of k")
    check_dtype("v_cache", v_cache, dtype_name(k_cache))
    check_scales(dtype_name(k_cache), k_scale=k_scale, v_scale=v_scale)
    check_rank("slot_mapping", slot_mapping, 1, "[T]")
    check_dtype("slot_mapping", slot_mapping, ("int32", "int64"))
    check_dim("slot_mapping", slot_mapping, 0, num_tokens, "T (tokens of k)")
    if (index_k is None) != (index_k_cache is None):
        raise ValueError("index_k / index_k_cache: give both (sparse layer) or neither (dense layer), got "
                         f"index_k={'None' if index_k is None else 'a tensor'}, "
                         f"index_k_cache={'None' if index_k_cache is None else 'a tensor'}")
    if index_k is not None:
        check_rank("index_k", index_k, 2, "[T, Di]")
        check_dtype("index_k", index_k, dtype_name(k))
        check_dim("index_k", index_k, 0, num_tokens, "T (tokens of k)")
        check_head_dim("index_k", int(index_k.shape[1]))
        check_rank("index_k_cache", index_k_cache, 3, "[slots, 128, Di]")
        check_cache_dtype("index_k_cache", index_k_cache, dtype_name(k))
        check_dim("index_k_cache", index_k_cache, 1, PAGE_SIZE, "page size")
        check_dim("index_k_cache", index_k_cache, 2, int(index_k.shape[1]), "Di of index_k")
    return num_tokens


# -- the model-step ops ------------------------------------------------------------------

def check_norm_call(x, residual_in, weight, eps) -> tuple:
    """Check ``add_rms_norm`` (``residual_in`` given) / ``rms_norm`` (None) -> (T, H, eps as a float)."""
    check_rank("x", x, 2, "[T, H]")
    check_dtype("x", x, FLOAT_DTYPES)
    rows, hidden = (int(s) for s in x.shape)
    if not 1 <= hidden <= MAX_WIDTH:
        raise ValueError(f"x: expected a hidden size H in [1, {MAX_WIDTH}], got H = {hidden}")
    if residual_in is not None:
        check_rank("residual_in", residual_in, 2, "[T, H]")
        check_dtype("residual_in", residual_in, dtype_name(x))
        check_dim("residual_in", residual_in, 0, rows, "T (rows of x)")
        check_dim("residual_in", residual_in, 1, hidden, "H (columns of x)")
    check_rank("weight", weight, 1, "[H]")
    check_dtype("weight", weight, FLOAT_DTYPES)
    check_dim("weight", weight, 0, hidden, "H (columns of x)")
    return rows, hidden, check_eps(eps)


def check_eps(eps) -> float:
    """``eps``: a real number >= 0 (Python or numpy; a kernel scalar, which JAX bakes into its kernel) -> float."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps: expected a float, got {type(eps).__name__}")
    if not eps >= 0:
        raise ValueError(f"eps: expected a float >= 0, got {eps!r}")
    return float(eps)


def check_route_call(x, router_weight, bias, top_k) -> tuple:
    """Check ``moe_route``'s arguments -> (T, H, E, top_k)."""
    check_rank("x", x, 2, "[T, H]")
    check_dtype("x", x, FLOAT_DTYPES)
    tokens, hidden = (int(s) for s in x.shape)
    check_rank("router_weight", router_weight, 2, "[E, H]")
    check_dtype("router_weight", router_weight, dtype_name(x))
    check_dim("router_weight", router_weight, 1, hidden, "H (columns of x)")
    experts = int(router_weight.shape[0])
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"router_weight: expected E in [1, {MAX_EXPERTS}] experts, got E = {experts}")
    check_rank("bias", bias, 1, "[E]")
    check_dtype("bias", bias, FLOAT_DTYPES)
    check_dim("bias", bias, 0, experts, "E (rows of router_weight)")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"top_k: expected an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= min(MAX_TOP_K, experts):
        raise ValueError(f"top_k: expected 1 <= top_k <= min({MAX_TOP_K}, E = {experts}), got {top_k}")
    return tokens, hidden, experts, int(top_k)


@dataclasses.dataclass(frozen=True)
class QKRopeCall:
    """What ``check_qk_rope_call`` resolved."""
    num_tokens: int
    num_q_heads: int
    num_kv_heads: int       # also the index-q heads
    head_dim: int
    index_head_dim: int     # 0 on a dense layer
    rotary_dim: int
    index_rotary_dim: int   # min(rotary_dim, index_head_dim); 0 on a dense layer
    eps: float

    @property
    def sparse(self) -> bool:
        return self.index_head_dim > 0


def check_qk_rope_call(qkv, positions, inv_freq, q_norm, k_norm, k_cache, v_cache, slot_mapping, *, num_q_heads,
                       eps, index_q_norm, index_k_norm, index_k_cache, k_scale, v_scale) -> QKRopeCall:
    """Check ``qk_norm_rope``'s arguments (caches: anything with the logical ``.shape``/``.dtype``)."""
    check_rank("qkv", qkv, 2, "[T, Hq*D + 2*Hk*D (+ Hi*Di + Di)]")
    check_dtype("qkv", qkv, FLOAT_DTYPES)
    dtype = dtype_name(qkv)
    tokens, width = (int(s) for s in qkv.shape)
    num_q_heads = check_int("num_q_heads", num_q_heads, 1)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_rank(name, cache, 4, "[slots, Hk, 128, D]")
        check_cache_dtype(name, cache, dtype)
        check_dim(name, cache, 2, PAGE_SIZE, "page size")
    check_dtype("v_cache", v_cache, dtype_name(k_cache))
    num_kv_heads, head_dim = int(k_cache.shape[1]), int(k_cache.shape[3])
    check_head_dim("k_cache", head_dim)
    check_dim("v_cache", v_cache, 1, num_kv_heads, "Hk of k_cache")
    check_dim("v_cache", v_cache, 3, head_dim, "D of k_cache")
    check_scales(dtype_name(k_cache), k_scale=k_scale, v_scale=v_scale)
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        check_rank(name, w, 1, "[D]")
        check_dtype(name, w, FLOAT_DTYPES)
        check_dim(name, w, 0, head_dim, "D (head dim of k_cache)")
    check_rank("inv_freq", inv_freq, 1, "[rotary_dim / 2]")
    check_dtype("inv_freq", inv_freq, "float32")
    rotary_dim = 2 * int(inv_freq.shape[0])
    if not 2 <= rotary_dim <= head_dim:
        raise ValueError(f"inv_freq: expected rotary_dim / 2 entries with 2 <= rotary_dim <= D = {head_dim}, "
                         f"got {int(inv_freq.shape[0])}")
    for name, x in (("positions", positions), ("slot_mapping", slot_mapping)):
        check_rank(name, x, 1, "[T]")
        check_dtype(name, x, ("int32", "int64"))
        check_dim(name, x, 0, tokens, "T (rows of qkv)")
    index = {"index_q_norm": index_q_norm, "index_k_norm": index_k_norm, "index_k_cache": index_k_cache}
    given = [name for name, x in index.items() if x is not None]
    if given and len(given) != len(index):
        missing = [name for name in index if name not in given]
        raise ValueError(f"{', '.join(missing)}: missing; a sparse layer passes index_q_norm, index_k_norm and "
                         "index_k_cache together, a dense layer none of them")
    index_head_dim = index_rotary_dim = 0
    if given:
        check_rank("index_k_cache", index_k_cache, 3, "[slots, 128, Di]")
        check_cache_dtype("index_k_cache", index_k_cache, dtype)
        check_dim("index_k_cache", index_k_cache, 1, PAGE_SIZE, "page size")
        index_head_dim = int(index_k_cache.shape[2])
        check_head_dim("index_k_cache", index_head_dim)
        for name in ("index_q_norm", "index_k_norm"):
            check_rank(name, index[name], 1, "[Di]")
            check_dtype(name, index[name], FLOAT_DTYPES)
            check_dim(name, index[name], 0, index_head_dim, "Di (head dim of index_k_cache)")
        index_rotary_dim = min(rotary_dim, index_head_dim)
    expected = (num_q_heads + 2 * num_kv_heads) * head_dim + (num_kv_heads + 1) * index_head_dim
    if width != expected:
        layout = (f"(Hq + 2*Hk)*D + (Hi + 1)*Di with Hi = Hk, Di = {index_head_dim}" if given else "(Hq + 2*Hk)*D")
        raise ValueError(f"qkv: expected width {layout}, Hq = {num_q_heads} (num_q_heads), Hk = {num_kv_heads}, "
                         f"D = {head_dim} (k_cache): {expected}, got {width}")
    return QKRopeCall(tokens, num_q_heads, num_kv_heads, head_dim, index_head_dim, rotary_dim, index_rotary_dim,
                      check_eps(eps))


def check_moe_call(x, w_gate_up, w_down, topk_ids, topk_weights, shared_gate_up, shared_down) -> tuple:
    """Check ``fused_moe``'s arguments (shapes and dtypes only) -> (T, E, k, H, I)."""
    check_rank("x", x, 2, "[T, H]")
    check_dtype("x", x, FLOAT_DTYPES)
    check_rank("w_gate_up", w_gate_up, 3, "[E, 2I, H]")
    check_rank("w_down", w_down, 3, "[E, H, I]")
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError("shared_gate_up, shared_down: pass both (the shared expert) or neither")
    weights = [("w_gate_up", w_gate_up), ("w_down", w_down)]
    if shared_gate_up is not None:
        check_rank("shared_gate_up", shared_gate_up, 2, "[2I, H]")
        check_rank("shared_down", shared_down, 2, "[H, I]")
        weights += [("shared_gate_up", shared_gate_up), ("shared_down", shared_down)]
    tokens, experts, hidden, inter = check_moe_sizes(x, w_gate_up, w_down, shared_gate_up, shared_down)
    for name, w in weights:
        if dtype_name(w) != dtype_name(x):
            raise TypeError(f"{name}: expected the dtype of x ({dtype_name(x)}), got {dtype_name(w)}")
    top_k = check_moe_routing(topk_ids, topk_weights, tokens, experts)
    return tokens, experts, top_k, hidden, inter


def check_moe_sizes(x, w_gate_up, w_down, shared_gate_up, shared_down) -> tuple:
    """The expert weights' sizes against x's and each other's (ranks already checked; the shared
    expert's two weights, or None) -> (T, E, H, I)."""
    tokens, hidden = (int(s) for s in x.shape)
    experts, two_inter = int(w_gate_up.shape[0]), int(w_gate_up.shape[1])
    if two_inter % 2:
        raise ValueError(f"w_gate_up: expected [E, 2I, H] (gate rows, then up rows), got an odd 2I = {two_inter}")
    inter = two_inter // 2
    check_dim("w_gate_up", w_gate_up, 2, hidden, "H (columns of x)")
    check_dim("w_down", w_down, 0, experts, "E (experts of w_gate_up)")
    check_dim("w_down", w_down, 1, hidden, "H (columns of x)")
    check_dim("w_down", w_down, 2, inter, "I (half the rows of w_gate_up)")
    if shared_gate_up is not None:
        check_dim("shared_gate_up", shared_gate_up, 0, two_inter, "2I (the experts' width: a shared expert of "
                  "another width runs outside fused_moe)")
        check_dim("shared_gate_up", shared_gate_up, 1, hidden, "H (columns of x)")
        check_dim("shared_down", shared_down, 0, hidden, "H (columns of x)")
        check_dim("shared_down", shared_down, 1, inter, "I (the experts' width)")
    return tokens, experts, hidden, inter


def check_moe_routing(topk_ids, topk_weights, tokens: int, experts: int) -> int:
    """The router's choice for ``tokens`` tokens over ``experts`` experts -> k."""
    check_rank("topk_ids", topk_ids, 2, "[T, k]")
    check_dtype("topk_ids", topk_ids, "int32")
    check_dim("topk_ids", topk_ids, 0, tokens, "T (rows of x)")
    top_k = int(topk_ids.shape[1])
    if not 1 <= top_k <= experts:
        raise ValueError(f"topk_ids: expected k in [1, E = {experts}] experts per token, got k = {top_k}")
    check_rank("topk_weights", topk_weights, 2, "[T, k]")
    check_dtype("topk_weights", topk_weights, "float32")
    check_dim("topk_weights", topk_weights, 0, tokens, "T (rows of x)")
    check_dim("topk_weights", topk_weights, 1, top_k, "k (columns of topk_ids)")
    return top_k


# -- block-scaled FP8 weights (fp8_linear.py, fp8_moe.py) ---------------------------------------

def check_fp8_weight(name, weight, scale_name, weight_scale, layout, rows_what, cols_what) -> tuple:
    """An FP8 weight of ``layout`` (``"[N, K]"``, ``"[E, N, K]"``: the last two axes are rows and columns) in
    e4m3 and its float32 scales, ``[ceil(N / 128), ceil(K / 128)]`` after the same leading axes -> (N, K)."""
    axes = layout[1:-1].split(", ")
    rank = len(axes)
    scale_layout = "[" + ", ".join(axes[:-2] + [f"ceil({rows_what}/128)", f"ceil({cols_what}/128)"]) + "]"
    check_rank(name, weight, rank, layout)
    check_dtype(name, weight, FP8)
    n, k = (int(s) for s in weight.shape[-2:])
    check_rank(scale_name, weight_scale, rank, scale_layout)
    check_dtype(scale_name, weight_scale, "float32")
    for axis in range(rank - 2):
        check_dim(scale_name, weight_scale, axis, int(weight.shape[axis]), f"axis {axis} of {name}")
    check_dim(scale_name, weight_scale, rank - 2, cdiv(n, FP8_BLOCK),
              f"ceil({rows_what} / 128) (blocks of {name}'s rows)")
    check_dim(scale_name, weight_scale, rank - 1, cdiv(k, FP8_BLOCK),
              f"ceil({cols_what} / 128) (blocks of {name}'s columns)")
    return n, k


def check_quantize_call(x) -> tuple:
    """Check ``quantize_activation``'s argument -> (T, K)."""
    check_rank("x", x, 2, "[T, K]")
    check_dtype("x", x, FLOAT_DTYPES)
    return int(x.shape[0]), int(x.shape[1])


def check_fp8_linear_call(x, weight, weight_scale) -> tuple:
    """Check ``fp8_linear``'s arguments (shapes and dtypes only) -> (T, N, K)."""
    check_rank("x", x, 2, "[T, K]")
    check_dtype("x", x, FLOAT_DTYPES)
    n, k = check_fp8_weight("weight", weight, "weight_scale", weight_scale, "[N, K]", "N", "K")
    check_dim("x", x, 1, k, "K (columns of weight)")
    return int(x.shape[0]), n, k


def check_fp8_moe_call(x, w_gate_up, w_gate_up_scale, w_down, w_down_scale, topk_ids, topk_weights,
                       shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale) -> tuple:
    """Check ``fused_moe_fp8``'s arguments (shapes and dtypes only) -> (T, E, k, H, I)."""
    check_rank("x", x, 2, "[T, H]")
    check_dtype("x", x, FLOAT_DTYPES)
    hidden = int(x.shape[1])
    two_inter, _ = check_fp8_weight("w_gate_up", w_gate_up, "w_gate_up_scale", w_gate_up_scale, "[E, 2I, H]",
                                    "2I", "H")
    if hidden % FP8_BLOCK or two_inter % (2 * FP8_BLOCK):
        raise ValueError(f"w_gate_up: expected H and I multiples of {FP8_BLOCK} (whole scale blocks, none "
                         f"straddling the gate and up rows), got H = {hidden}, 2I = {two_inter}")
    check_fp8_weight("w_down", w_down, "w_down_scale", w_down_scale, "[E, H, I]", "H", "I")
    shared = (shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale)
    if any(t is None for t in shared) and any(t is not None for t in shared):
        raise ValueError("shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale: pass all four (the "
                         "shared expert) or none")
    if shared_gate_up is not None:
        check_fp8_weight("shared_gate_up", shared_gate_up, "shared_gate_up_scale", shared_gate_up_scale, "[2I, H]",
                         "2I", "H")
        check_fp8_weight("shared_down", shared_down, "shared_down_scale", shared_down_scale, "[H, I]", "H", "I")
    tokens, experts, hidden, inter = check_moe_sizes(x, w_gate_up, w_down, shared_gate_up, shared_down)
    top_k = check_moe_routing(topk_ids, topk_weights, tokens, experts)
    return tokens, experts, top_k, hidden, inter


SEED_DTYPES = ("int64", "int32")


def check_sample_call(logits, temperature, top_k, top_p, min_p, seeds, counters, penalties: dict,
                      prompt_ids, output_ids, token_bitmask=None) -> tuple:
    """Check ``sample``'s arguments -> (L, V, has_penalties). ``penalties``: name -> array or None;
    ``token_bitmask``: None or ``[L, ceil(V / 32)]`` int32."""
    check_rank("logits", logits, 2, "[L, V]")
    check_dtype("logits", logits, FLOAT_DTYPES)
    rows, vocab = (int(s) for s in logits.shape)
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(f"logits: expected a vocabulary V in [1, {MAX_VOCAB}], got V = {vocab}")
    per_row = [("temperature", temperature, "float32"), ("top_k", top_k, "int32"), ("top_p", top_p, "float32"),
               ("min_p", min_p, "float32"), ("seeds", seeds, SEED_DTYPES), ("counters", counters, "int32")]
    given = {name: p for name, p in penalties.items() if p is not None}
    ids = {"prompt_ids": prompt_ids, "output_ids": output_ids}
    given_ids = {name: a for name, a in ids.items() if a is not None}
    if (given or given_ids) and (len(given) != len(penalties) or len(given_ids) != len(ids)):
        missing = [n for n in (*penalties, *ids) if n not in given and n not in given_ids]
        raise ValueError(f"penalties: {', '.join(missing)} missing; pass {', '.join((*penalties, *ids))} "
                         "together or none of them")
    per_row += [(name, p, "float32") for name, p in given.items()]
    for name, x, dtype in per_row:
        check_rank(name, x, 1, "[L]")
        check_dtype(name, x, dtype)
        check_dim(name, x, 0, rows, "L (rows of logits)")
    for name, x in given_ids.items():
        check_rank(name, x, 2, f"[L, {'P' if name == 'prompt_ids' else 'O'}] padded with -1")
        check_dtype(name, x, "int32")
        check_dim(name, x, 0, rows, "L (rows of logits)")
    if token_bitmask is not None:
        check_rank("token_bitmask", token_bitmask, 2, "[L, ceil(V / 32)]")
        check_dtype("token_bitmask", token_bitmask, "int32")
        check_dim("token_bitmask", token_bitmask, 0, rows, "L (rows of logits)")
        check_dim("token_bitmask", token_bitmask, 1, -(-vocab // 32), f"ceil(V / 32) (V = {vocab})")
    return rows, vocab, bool(given)


# -- opt-in value checks (M3_VALIDATE=1) -----------------------------------------------------
# Off by default: reading values needs the metadata on the host (a device sync on a GPU).
# The framework guards (m3_torch.guards, m3_jax.guards) run them once per public call, on
# host numpy copies. Without them, out-of-range page or slot ids are undefined behaviour;
# lengths past the table and negative lengths are defined (clamped / padding) either way.

VALUE_CHECKED = ("seq_lens", "block_table", "block_ids", "slot_mapping")


def values_enabled() -> bool:
    """True when ``M3_VALIDATE`` is set to anything but "" or "0"; read at each call."""
    return os.environ.get("M3_VALIDATE", "") not in ("", "0")


def check_seq_lens_values(seq_lens, max_blocks):
    """Every ``seq_lens[r]`` in ``[0, max_blocks * 128]``."""
    seq_lens = np.asarray(seq_lens)
    limit = int(max_blocks) * PAGE_SIZE
    bad = np.flatnonzero((seq_lens < 0) | (seq_lens > limit))
    if bad.size:
        r = int(bad[0])
        raise ValueError(f"seq_lens: row {r} is {int(seq_lens[r])}, expected 0 <= seq_len <= {limit} "
                         f"(max_blocks * 128 = {int(max_blocks)} * 128)")


def check_metadata_values(block_table, seq_lens, num_pages):
    """``seq_lens`` as above; every visible ``block_table`` entry (the first
    ``ceil(seq_lens[r] / 128)`` of row r) in ``[0, num_pages)``. Entries past them are never read."""
    block_table, seq_lens = np.asarray(block_table), np.asarray(seq_lens)
    max_blocks = block_table.shape[1]
    check_seq_lens_values(seq_lens, max_blocks)
    visible = np.arange(max_blocks)[None, :] < -(-seq_lens[:, None] // PAGE_SIZE)
    bad = np.argwhere(visible & ((block_table < 0) | (block_table >= num_pages)))
    if bad.size:
        r, b = (int(i) for i in bad[0])
        raise ValueError(f"block_table: row {r}, block {b} is {int(block_table[r, b])}, expected a page id in "
                         f"[0, {int(num_pages)}) (pages of the caches; the row's first "
                         f"{-(-int(seq_lens[r]) // PAGE_SIZE)} blocks are read, seq_lens[{r}] = {int(seq_lens[r])})")


def check_slot_mapping_values(slot_mapping, num_slots):
    """Every ``slot_mapping[t]`` is -1 (skip) or in ``[0, num_slots * 128)``."""
    slot_mapping = np.asarray(slot_mapping)
    limit = int(num_slots) * PAGE_SIZE
    bad = np.flatnonzero((slot_mapping < -1) | (slot_mapping >= limit))
    if bad.size:
        t = int(bad[0])
        raise ValueError(f"slot_mapping: token {t} is {int(slot_mapping[t])}, expected -1 (skip) or a value in "
                         f"[0, {limit}) (num_slots * 128 = {int(num_slots)} * 128)")


def check_block_ids_values(block_ids, max_blocks):
    """Every ``block_ids[k, t, j]`` is -1 (empty slot) or in ``[0, max_blocks)``."""
    block_ids = np.asarray(block_ids)
    bad = np.argwhere((block_ids < -1) | (block_ids >= max_blocks))
    if bad.size:
        k, t, j = (int(i) for i in bad[0])
        raise ValueError(f"block_ids: [kv head {k}, token {t}, slot {j}] is {int(block_ids[k, t, j])}, expected -1 "
                         f"or a block in [0, {int(max_blocks)}) (max_blocks: columns of block_table)")


def value_check_bounds(arrays: dict) -> dict:
    """The bounds the value checks of one call need, from the shapes of its named arguments.

    Pages (and pool slots) from the caches' first axis (the smallest, when
    several caches are given), ``max_blocks`` from ``block_table`` (or the
    scores of ``select_blocks``).
    """
    pages = [int(arrays[n].shape[0]) for n in ("k_cache", "v_cache", "index_k_cache") if arrays.get(n) is not None]
    if arrays.get("block_table") is not None:
        max_blocks = int(arrays["block_table"].shape[1])
    elif arrays.get("scores") is not None:
        max_blocks = int(arrays["scores"].shape[2])
    else:
        max_blocks = None
    return dict(num_pages=min(pages) if pages else None, max_blocks=max_blocks)


def check_values(values: dict, *, num_pages, max_blocks):
    """Every value check that applies to ``values`` (host arrays by argument name, see VALUE_CHECKED)."""
    if "seq_lens" in values:
        if "block_table" in values:
            check_metadata_values(values["block_table"], values["seq_lens"], num_pages)
        else:
            check_seq_lens_values(values["seq_lens"], max_blocks)
    if "block_ids" in values:
        check_block_ids_values(values["block_ids"], max_blocks)
    if "slot_mapping" in values:
        check_slot_mapping_values(values["slot_mapping"], num_pages)


def check_mxfp8(codes, scale) -> None:
    """An MXFP8 weight: ``codes [..., N, K]`` float8_e4m3fn and ``scale [..., N, ceil(K / MX_BLOCK)]`` uint8."""
    if dtype_name(codes) != "float8_e4m3fn" or dtype_name(scale) != "uint8":
        raise TypeError(f"dequantize_mxfp8: expected float8_e4m3fn codes and uint8 scales, got {dtype_name(codes)} "
                        f"and {dtype_name(scale)}")
    want = (*_shape(codes)[:-1], cdiv(_shape(codes)[-1], MX_BLOCK))
    if _shape(scale) != want:
        raise ValueError(f"scale: expected shape {want} for codes of shape {_shape(codes)}, got {_shape(scale)}")
