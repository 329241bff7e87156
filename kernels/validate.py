"""Argument checks shared by both launchers.

They read ``.shape`` and ``.dtype`` only, never values, so no check
synchronizes with the device (a decode step stays CUDA-graph capturable).
Dtypes are compared by name, which torch ("torch.bfloat16") and JAX/numpy
("bfloat16") both provide.
"""

from __future__ import annotations

from .geometry import PAGE_SIZE

FLOAT_DTYPES = ("bfloat16", "float16", "float32")


def dtype_name(x) -> str:
    return str(x.dtype).removeprefix("torch.")


def _shape(x):
    return tuple(int(s) for s in x.shape)


def check_rank(name, x, rank, layout):
    if len(x.shape) != rank:
        raise ValueError(f"{name}: expected rank {rank} {layout}, got shape {_shape(x)}")


def check_dtype(name, x, allowed):
    allowed = (allowed,) if isinstance(allowed, str) else tuple(allowed)
    if dtype_name(x) not in allowed:
        raise TypeError(f"{name}: expected dtype {' or '.join(allowed)}, got {dtype_name(x)}")


def check_dim(name, x, axis, expected, what):
    got = int(x.shape[axis])
    if got != expected:
        raise ValueError(f"{name}: expected {what} = {expected} (axis {axis}), got {got} in shape {_shape(x)}")


def check_head_dim(name, d):
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"{name}: head dim must be a power of two in [16, 256], got {d}")


def check_metadata(block_table, seq_lens):
    """-> (R, max_blocks)."""
    check_rank("block_table", block_table, 2, "[R, max_blocks]")
    check_dtype("block_table", block_table, "int32")
    check_rank("seq_lens", seq_lens, 1, "[R]")
    check_dtype("seq_lens", seq_lens, "int32")
    check_dim("seq_lens", seq_lens, 0, int(block_table.shape[0]), "R (rows of block_table)")
    return int(block_table.shape[0]), int(block_table.shape[1])


def check_tokens(name, x, num_requests, decode_query_len, axis=0):
    if not isinstance(decode_query_len, int) or isinstance(decode_query_len, bool) or decode_query_len < 1:
        raise ValueError(f"decode_query_len: expected an int >= 1, got {decode_query_len!r}")
    check_dim(name, x, axis, num_requests * decode_query_len,
              f"T = R * decode_query_len = {num_requests} * {decode_query_len}")


def check_cu_seqlens(cu_seqlens_q, num_requests):
    """cu_seqlens_q [R + 1] int32 (its values are read by the planner, never here)."""
    check_rank("cu_seqlens_q", cu_seqlens_q, 1, "[R + 1]")
    check_dtype("cu_seqlens_q", cu_seqlens_q, "int32")
    check_dim("cu_seqlens_q", cu_seqlens_q, 0, num_requests + 1, "R + 1 (rows of block_table + 1)")


def check_prefill_plan(name, x, plan, num_requests, axis=0):
    """A prefill plan's rows and tokens against the tensors' shapes."""
    if plan.num_rows != num_requests:
        raise ValueError(f"plan: built for {plan.num_rows} requests, but block_table/seq_lens have {num_requests}")
    check_dim(name, x, axis, plan.num_tokens, "T = cu_seqlens_q[-1]")


def check_kv_caches(q, k_cache, v_cache):
    """q [T, Hq, D], caches [pages, Hk, PAGE_SIZE, D] (logical HND) -> (Hq, Hk, D)."""
    check_rank("q", q, 3, "[T, Hq, D]")
    check_dtype("q", q, FLOAT_DTYPES)
    num_q_heads, head_dim = int(q.shape[1]), int(q.shape[2])
    check_head_dim("q", head_dim)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_rank(name, cache, 4, "[pages, Hk, 128, D]")
        check_dtype(name, cache, dtype_name(q))
        check_dim(name, cache, 2, PAGE_SIZE, "page size")
        check_dim(name, cache, 3, head_dim, "head dim D of q")
    check_dim("v_cache", v_cache, 1, int(k_cache.shape[1]), "Hk of k_cache")
    num_kv_heads = int(k_cache.shape[1])
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"q/k_cache: query heads Hq={num_q_heads} must be a multiple of KV heads Hk={num_kv_heads}")
    return num_q_heads, num_kv_heads, head_dim


def check_index_inputs(idx_q, index_k_cache):
    """idx_q [T, Hi, Di], index_k_cache [pages, PAGE_SIZE, Di] -> (Hi, Di)."""
    check_rank("idx_q", idx_q, 3, "[T, Hi, Di]")
    check_dtype("idx_q", idx_q, FLOAT_DTYPES)
    check_rank("index_k_cache", index_k_cache, 3, "[pages, 128, Di]")
    check_dtype("index_k_cache", index_k_cache, dtype_name(idx_q))
    check_dim("index_k_cache", index_k_cache, 1, PAGE_SIZE, "page size")
    head_dim = int(idx_q.shape[2])
    check_head_dim("idx_q", head_dim)
    check_dim("index_k_cache", index_k_cache, 2, head_dim, "index head dim Di of idx_q")
    return int(idx_q.shape[1]), head_dim


def check_block_ids(block_ids, num_kv_heads, num_tokens):
    """block_ids [Hk, T, topk] int32 -> topk."""
    check_rank("block_ids", block_ids, 3, "[Hk, T, topk]")
    check_dtype("block_ids", block_ids, "int32")
    check_dim("block_ids", block_ids, 0, num_kv_heads, "Hk (KV heads of k_cache)")
    check_dim("block_ids", block_ids, 1, num_tokens, "T (tokens of q)")
    return int(block_ids.shape[2])


def check_selection_args(topk, init_blocks, local_blocks):
    for name, v, lo in (("topk", topk, 1), ("init_blocks", init_blocks, 0), ("local_blocks", local_blocks, 0)):
        if not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
    if init_blocks + local_blocks > topk:
        raise ValueError(f"init_blocks + local_blocks ({init_blocks} + {local_blocks}) must not exceed topk ({topk})")


def check_select_inputs(scores, seq_lens, decode_query_len, topk, init_blocks, local_blocks):
    """scores [Hi, T, max_blocks] float32, seq_lens [R] int32, T = R * n -> Hi."""
    check_selection_args(topk, init_blocks, local_blocks)
    check_rank("seq_lens", seq_lens, 1, "[R]")
    check_dtype("seq_lens", seq_lens, "int32")
    check_rank("scores", scores, 3, "[Hi, T, max_blocks]")
    check_dtype("scores", scores, "float32")
    check_tokens("scores", scores, int(seq_lens.shape[0]), decode_query_len, axis=1)
    return int(scores.shape[0])


def check_step_inputs(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, *, config, num_rows,
                      num_tokens, block_bound, sparse):
    """A mixed step's arrays against the step's plan (``msa_attention_step`` of both frameworks).

    config: the planner's StepConfig; num_rows / num_tokens: the plan's, padding
    included; block_bound: the most block-table columns any span of the plan reads.
    """
    num_requests, max_blocks = check_metadata(block_table, seq_lens)
    num_q_heads, num_kv_heads, head_dim = check_kv_caches(q, k_cache, v_cache)
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


def check_index_heads(num_index_heads, num_kv_heads):
    if num_index_heads != num_kv_heads:
        raise ValueError(f"idx_q: index heads Hi={num_index_heads} must equal KV heads Hk={num_kv_heads}")


def check_out(out, shape, dtype):
    if out is None:
        return
    if _shape(out) != tuple(shape):
        raise ValueError(f"out: expected shape {tuple(shape)}, got {_shape(out)}")
    check_dtype("out", out, dtype)
