"""jnp references for every decode op (float32 math; for tests and demos).

They mirror ``m3_torch/reference.py`` (same names, same arguments, same
semantics as SPEC.md), vectorised instead of looped: each query token gathers
the pages of its request's visible blocks (entries past them are masked, so
garbage in ``block_table`` is never used), then masks by position. Token
positions come from per-request query lengths ``q_lens`` (a static list of
ints): decode is ``q_lens = [n] * R``. ``seq_lens`` may be a traced array, so
the references also run under ``jax.jit`` with ``q_lens`` static.

Caches are what the ops accept: arrays in ``kv_layout`` or PagedViews, FP8
ones dequantised first (``stored * scale``; index-K unscaled). Each
reference is jitted as a whole (static: ``q_lens``, selection and layout
arguments), which is much faster than op-by-op dispatch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .views import as_index_k_view, as_kv_view

PAGE_SIZE = 128
_HI = jax.lax.Precision.HIGHEST


def token_positions(q_lens):
    """-> (request [T], position - seq_len [T]) int32 numpy arrays, request-major."""
    req = [r for r, q_len in enumerate(q_lens) for _ in range(int(q_len))]
    rel = [j - int(q_len) for q_len in q_lens for j in range(int(q_len))]
    return np.asarray(req, np.int32), np.asarray(rel, np.int32)


def _token_geometry(block_table, seq_lens, q_lens, num_pages):
    """-> (pos [T], nb [T], pages [T, max_blocks]) with invisible blocks' pages replaced by 0."""
    req, rel = token_positions(q_lens)
    pos = jnp.asarray(seq_lens, jnp.int32)[req] + rel                 # [T]
    nb = -(-jnp.maximum(pos + 1, 0) // PAGE_SIZE)                       # [T] visible blocks
    table = jnp.asarray(block_table, jnp.int32)[req]                    # [T, max_blocks]
    visible = jnp.arange(table.shape[1])[None, :] < nb[:, None]
    pages = jnp.where(visible, jnp.clip(table, 0, num_pages - 1), 0)
    return pos, nb, pages


def _kv_positions(max_blocks):
    return (jnp.arange(max_blocks)[:, None] * PAGE_SIZE + jnp.arange(PAGE_SIZE)[None, :])  # [max_blocks, 128]


def _jit(*static):
    """jax.jit with ``static`` argnames; a list ``q_lens`` is made hashable first."""
    def wrap(fn):
        jitted = jax.jit(fn, static_argnames=("q_lens",) + static)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            names = list(fn.__code__.co_varnames[:fn.__code__.co_argcount])
            bound = dict(zip(names, args), **kwargs)
            bound["q_lens"] = tuple(int(n) for n in bound["q_lens"])
            return jitted(**bound)
        return call
    return wrap


@_jit()
def index_scores_ref(idx_q, index_k_cache, block_table, seq_lens, q_lens):
    """-> scores [Hi, T, max_blocks] float32 (-inf past each token's visible blocks)."""
    keys = as_index_k_view(index_k_cache).to_array().astype(jnp.float32)    # [pages, 128, Di]
    pos, _, pages = _token_geometry(block_table, seq_lens, q_lens, keys.shape[0])
    k = keys[pages]                                                          # [T, MB, 128, Di]
    dots = jnp.einsum("thd,tbnd->htbn", jnp.asarray(idx_q, jnp.float32), k, precision=_HI)
    visible = _kv_positions(pages.shape[1])[None] <= pos[:, None, None]      # [T, MB, 128]
    return jnp.max(jnp.where(visible[None], dots, -jnp.inf), axis=-1)


@_jit("topk", "init_blocks", "local_blocks")
def select_blocks_ref(scores, seq_lens, q_lens, topk=16, init_blocks=0, local_blocks=1):
    """-> block ids [Hi, T, topk] int32: forced, then best scores (ties: lower id; NaN last), ascending, -1 tail."""
    scores = jnp.asarray(scores, jnp.float32)
    num_heads, num_tokens, max_blocks = scores.shape
    req, rel = token_positions(q_lens)
    pos = jnp.asarray(seq_lens, jnp.int32)[req] + rel
    nb = -(-jnp.maximum(pos + 1, 0) // PAGE_SIZE)[None, :, None]            # [1, T, 1]
    b = jnp.broadcast_to(jnp.arange(max_blocks, dtype=jnp.int32), scores.shape)
    visible = b < nb
    forced = visible & ((b < init_blocks) | (b >= nb - local_blocks))
    nan = jnp.isnan(scores)
    # rank: forced, then by score descending, then NaN, then invisible; ties -> lower id
    group = jnp.where(~visible, 3, jnp.where(forced, 0, jnp.where(nan, 2, 1)))
    key = jnp.where(group == 1, -scores, 0.0)
    order = jnp.lexsort((b, key, group), axis=-1)
    rank = jnp.argsort(order, axis=-1)
    chosen = rank < jnp.minimum(nb, topk)
    ids = jnp.sort(jnp.where(chosen, b, max_blocks), axis=-1)
    if max_blocks < topk:
        ids = jnp.pad(ids, ((0, 0), (0, 0), (0, topk - max_blocks)), constant_values=max_blocks)
    ids = ids[..., :topk]
    return jnp.where(ids >= max_blocks, -1, ids).astype(jnp.int32)


def _dequantised(cache, kv_layout, name, scale):
    """A K/V cache as float32 [pages, Hk, 128, D], times ``scale`` (FP8; None: 1.0)."""
    x = as_kv_view(cache, kv_layout, name).to_array().astype(jnp.float32)
    return x if scale is None else x * jnp.reshape(jnp.asarray(scale, jnp.float32), ())


@_jit("sm_scale", "kv_layout")
def attention_ref(q, k_cache, v_cache, block_table, seq_lens, q_lens, block_ids=None, sm_scale=None,
                  kv_layout="HND", k_scale=None, v_scale=None):
    """Dense (block_ids None) or block-sparse paged GQA attention -> float32 [T, Hq, D]."""
    k_all = _dequantised(k_cache, kv_layout, "k_cache", k_scale)   # [pages, Hk, 128, D]
    v_all = _dequantised(v_cache, kv_layout, "v_cache", v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_all.shape[1]
    group = num_q_heads // num_kv_heads
    scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    pos, nb, pages = _token_geometry(block_table, seq_lens, q_lens, k_all.shape[0])
    max_blocks = pages.shape[1]
    k, v = k_all[pages], v_all[pages]                                         # [T, MB, Hk, 128, D]
    qg = jnp.asarray(q, jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    logits = scale * jnp.einsum("tkgd,tbknd->tkgbn", qg, k, precision=_HI)   # [T, Hk, G, MB, 128]
    allowed = (_kv_positions(max_blocks)[None] <= pos[:, None, None])[:, None]  # [T, 1, MB, 128]
    if block_ids is not None:
        ids = jnp.asarray(block_ids, jnp.int32)                               # [Hk, T, topk]
        chosen = (ids[..., None] == jnp.arange(max_blocks)).any(axis=2)       # [Hk, T, MB]
        chosen = chosen & (jnp.arange(max_blocks) < nb[:, None])[None]
        allowed = allowed & jnp.transpose(chosen, (1, 0, 2))[..., None]       # [T, Hk, MB, 128]
    allowed = allowed[:, :, None]                                             # [T, Hk, 1, MB, 128]
    logits = jnp.where(allowed, logits, -jnp.inf)
    m = jnp.max(logits, axis=(-2, -1), keepdims=True)
    p = jnp.where(allowed, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    den = jnp.sum(p, axis=(-2, -1))                                           # [T, Hk, G]
    out = jnp.einsum("tkgbn,tbknd->tkgd", p, v, precision=_HI)
    out = out / jnp.where(den > 0, den, 1.0)[..., None]
    return out.reshape(num_tokens, num_q_heads, head_dim)


@_jit("topk", "init_blocks", "local_blocks", "sm_scale", "kv_layout")
def msa_decode_ref(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, q_lens, topk=16,
                   init_blocks=0, local_blocks=1, sm_scale=None, kv_layout="HND", k_scale=None, v_scale=None):
    """-> (out float32 [T, Hq, D], block_ids [Hk, T, topk])."""
    scores = index_scores_ref(idx_q, index_k_cache, block_table, seq_lens, q_lens)
    ids = select_blocks_ref(scores, seq_lens, q_lens, topk, init_blocks, local_blocks)
    out = attention_ref(q, k_cache, v_cache, block_table, seq_lens, q_lens, ids, sm_scale, kv_layout, k_scale,
                        v_scale)
    return out, ids


__all__ = ["token_positions", "index_scores_ref", "select_blocks_ref", "attention_ref", "msa_decode_ref"]


# -- block-scaled FP8 weights (m3_jax.fp8) ----------------------------------------------------

FP8_BLOCK = 128


@jax.jit
def quantize_activation_ref(x):
    """``x [T, K]`` -> (e4m3 codes [T, K], float32 scales [T, ceil(K / 128)]) as ``m3_jax.fp8.quantize_activation``:
    per token and 128 channels ``scale = max(amax without NaN, 1e-12) / 448``, ``codes = saturate(x / scale)``
    rounded to nearest even, in float32 (XLA divides by multiplying with the reciprocal: a scale may differ
    from the kernel's in its last bit, a code by one step)."""
    tokens, k = x.shape
    groups = -(-k // FP8_BLOCK)
    x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, groups * FP8_BLOCK - k))).reshape(tokens, groups, FP8_BLOCK)
    amax = jnp.where(jnp.isnan(x), 0.0, jnp.abs(x)).max(axis=-1, initial=0.0)
    scale = jnp.maximum(amax, jnp.float32(1e-12)) / 448.0
    codes = jnp.clip(x / scale[..., None], -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return codes.reshape(tokens, groups * FP8_BLOCK)[:, :k], scale


def dequantize_fp8_ref(codes, scale):
    """e4m3 weight ``codes [..., N, K]`` times their block scales ``[..., ceil(N / 128), ceil(K / 128)]`` -> float32."""
    n, k = codes.shape[-2:]
    full = jnp.repeat(jnp.repeat(scale, FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)
    return codes.astype(jnp.float32) * full[..., :n, :k]


def dequantize_activation_ref(codes, scale):
    """e4m3 activation ``codes [T, K]`` times their scales ``[T, ceil(K / 128)]`` -> float32."""
    return codes.astype(jnp.float32) * jnp.repeat(scale, FP8_BLOCK, axis=-1)[:, :codes.shape[1]]


@jax.jit
def fp8_linear_ref(x, weight, weight_scale):
    """``fp8_linear``: x quantized as the kernel does, both operands dequantized, the product in float32
    (highest precision) [T, N]."""
    return jnp.matmul(dequantize_activation_ref(*quantize_activation_ref(x)), dequantize_fp8_ref(weight, weight_scale).T,
                      precision=_HI)
