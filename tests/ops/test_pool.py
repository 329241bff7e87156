"""Flat sub-page pool: layout views, decode ops on pool views, cache writes (CPU, torch and JAX).

GPU checks of the same features (cross-framework bit-identity, in-place JAX
writes, CUDA graphs) are in test_interop.py.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import m3_jax
import m3_torch
from m3_jax import cache as jcache
from m3_kernels.pool import LayerSpec, PoolLayout
from m3_torch import cache as tcache

from cases import PAGE, TORCH_DTYPES

HK, HQ, D, DI = 2, 4, 32, 16
SPARSE = (False, True, True)     # a layer group mixing a dense layer with sparse ones


def layout_for(kv_layout, dtype="bfloat16", num_slots=11, sparse=SPARSE):
    return PoolLayout.create(num_slots, sparse=sparse, num_kv_heads=HK, head_dim=D, index_head_dim=DI,
                             kv_layout=kv_layout, dtype=dtype)


def reference_caches(layout, seed):
    """Per layer: dense (K, V, index-K or None), logical [slots, Hk, 128, D] / [slots, 128, Di]; random."""
    g = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPES[layout.dtype]
    refs = []
    for spec in layout.layers:
        shape = (layout.num_slots, spec.num_kv_heads, PAGE, spec.head_dim)
        k, v = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
        ik = torch.randn(layout.num_slots, PAGE, spec.index_head_dim, generator=g).to(dtype) if spec.sparse else None
        refs.append((k, v, ik))
    return refs


def pack_pool(refs, kv_layout):
    """The pool bytes written out by hand (slot-major; per layer K, V, index-K; HND or NHD sub-pages)."""
    slots = []
    for s in range(refs[0][0].shape[0]):
        parts = []
        for k, v, ik in refs:
            for c in (k, v):
                sub = c[s] if kv_layout == "HND" else c[s].transpose(0, 1)
                parts.append(sub.reshape(-1))
            if ik is not None:
                parts.append(ik[s].reshape(-1))
        slots.append(torch.cat(parts))
    return torch.cat(slots)


def to_jnp(t):
    """torch CPU tensor -> jax array (a copy; bf16 exactly via float32)."""
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(t.numpy())


def bits(x):
    """Raw bits of a torch tensor or jax array as a numpy int array (NaN-exact comparisons)."""
    ints = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32)}
    a = x.contiguous().view(ints[x.element_size()][0]).numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return a if a.dtype.kind in "iu" else a.view(ints[a.dtype.itemsize][1])


# -- layout --------------------------------------------------------------------------

@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
def test_views_equal_reference_caches(kv_layout):
    layout = layout_for(kv_layout)
    refs = reference_caches(layout, seed=1)
    pool = pack_pool(refs, kv_layout)
    assert pool.shape == layout.shape
    jpool = to_jnp(pool)
    for layer, (k, v, ik) in enumerate(refs):
        views = tcache.layer_caches(pool, layout, layer)
        assert torch.equal(views.k_cache, k) and torch.equal(views.v_cache, v)
        jviews = jcache.layer_views(jpool, layout, layer)
        assert all(vw.buffer is jpool for vw in jviews if vw is not None)   # views, not slices
        assert np.array_equal(bits(jviews.k_cache.to_array()), bits(k))
        assert np.array_equal(bits(jviews.v_cache.to_array()), bits(v))
        if ik is None:
            assert views.index_k_cache is None and jviews.index_k_cache is None
        else:
            assert torch.equal(views.index_k_cache, ik)
            assert np.array_equal(bits(jviews.index_k_cache.to_array()), bits(ik))
        # torch views share the pool's memory
        assert views.k_cache.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()


def test_views_tile_the_pool_exactly():
    """Every element of the pool belongs to exactly one sub-page of one layer."""
    # heterogeneous layers: sparse, dense, sparse with other head counts and dims
    layout = PoolLayout(3, (LayerSpec(2, 16, 32), LayerSpec(1, 64), LayerSpec(4, 16, 16)), "NHD", "float32")
    pool = torch.arange(layout.numel, dtype=torch.float32)
    seen = []
    for layer in range(layout.num_layers):
        seen.extend(c.reshape(-1) for c in tcache.layer_caches(pool, layout, layer) if c is not None)
    idx = torch.sort(torch.cat(seen).long()).values
    assert torch.equal(idx, torch.arange(layout.numel))


@pytest.mark.parametrize("kv_cache_dtype, index_cache_dtype, dtype, kv_layout", [
    ("fp8", "auto", "bfloat16", "HND"), ("auto", "float8_e4m3fn", "float32", "NHD"), ("fp8", "fp8", "float16", "HND")])
def test_fp8_views_tile_the_byte_pool_exactly(kv_cache_dtype, index_cache_dtype, dtype, kv_layout):
    """A pool with FP8 caches is bytes; every byte belongs to exactly one sub-page, and the torch and
    JAX views read it as their caches' dtypes (no copy; test_interop.py compares their values)."""
    layout = PoolLayout(3, (LayerSpec(2, 16, 32), LayerSpec(1, 64), LayerSpec(4, 16, 16)), kv_layout, dtype,
                        kv_cache_dtype, index_cache_dtype)
    assert layout.buffer_dtype == "uint8" and layout.numel == layout.nbytes
    pool = torch.randint(0, 256, layout.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    jpool = jnp.asarray(pool.numpy())
    covered = []
    for layer in range(layout.num_layers):
        lv = layout.layer(layer)
        views = (lv.k, lv.v, lv.index_k)
        caches, jcaches = tcache.layer_caches(pool, layout, layer), jcache.layer_views(jpool, layout, layer)
        for view, cache, jview in zip(views, caches, jcaches):
            if view is None:
                continue
            size = cache.element_size()
            assert str(cache.dtype) == f"torch.{view.dtype}" and jview.dtype == jnp.dtype(view.dtype)
            assert cache.data_ptr() == pool.data_ptr() + view.offset * size and jview.buffer is jpool
            assert (jview.offset, jview.shape, jview.strides) == (view.offset, view.shape, view.strides)
            element = torch.as_strided(torch.arange(layout.numel // size), view.shape, view.strides, view.offset)
            covered.append((element.reshape(-1, 1) * size + torch.arange(size)).reshape(-1))
    assert torch.equal(torch.sort(torch.cat(covered)).values, torch.arange(layout.nbytes))


def test_allocate_pool_with_fp8_caches_is_a_zeroed_byte_buffer():
    layout = layout_for("HND", num_slots=2)
    fp8 = PoolLayout(2, layout.layers, "HND", "bfloat16", kv_cache_dtype="fp8")
    assert fp8.nbytes == layout.nbytes - 2 * 3 * 2 * (HK * PAGE * D)   # K/V at one byte per element
    tpool, jpool = m3_torch.allocate_pool(fp8), m3_jax.allocate_pool(fp8)
    assert tpool.dtype == torch.uint8 and jpool.dtype == jnp.uint8 and tpool.shape == jpool.shape == fp8.shape
    assert not tpool.any() and not jpool.any()
    with pytest.raises(TypeError, match="pool: expected dtype uint8"):
        tcache.layer_caches(torch.zeros(fp8.numel, dtype=torch.bfloat16), fp8, 0)


def test_layout_rejects_bad_specs():
    with pytest.raises(ValueError, match="kv_layout"):
        layout_for("HDN")
    with pytest.raises(TypeError, match="dtype"):
        layout_for("HND", dtype="int8")
    with pytest.raises(ValueError, match="head_dim"):
        PoolLayout(4, (LayerSpec(1, 48),))
    with pytest.raises(IndexError):
        layout_for("HND").layer(3)
    with pytest.raises(ValueError, match="pool: expected shape"):
        tcache.layer_caches(torch.zeros(5, dtype=torch.bfloat16), layout_for("HND"), 0)


# -- decode ops on pool views ------------------------------------------------------------

def decode_inputs(layout, seq_lens, n, seed):
    g = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPES[layout.dtype]
    max_blocks = max(-(-s // PAGE) for s in seq_lens) + 1
    perm = torch.randperm(layout.num_slots, generator=g).int()
    block_table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for r, s in enumerate(seq_lens):
        nb = -(-s // PAGE)
        block_table[r, :nb] = perm[used:used + nb]
        block_table[r, nb:] = torch.randint(-3, 5 * layout.num_slots, (max_blocks - nb,), generator=g)  # garbage
        used += nb
    assert used <= layout.num_slots
    T = len(seq_lens) * n
    return dict(q=torch.randn(T, HQ, D, generator=g).to(dtype), idx_q=torch.randn(T, HK, DI, generator=g).to(dtype),
                block_table=block_table, seq_lens=torch.tensor(seq_lens, dtype=torch.int32))


def standalone(c, kv_layout):
    """A dense copy of a cache view in its own storage (NHD: stored [slots, 128, Hk, D], viewed HND)."""
    if c is None or c.dim() == 3 or kv_layout == "HND":
        return None if c is None else c.contiguous()
    return c.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


@pytest.mark.parametrize("kv_layout, n", [("HND", 1), ("NHD", 2)])
def test_decode_ops_on_pool_views(kv_layout, n):
    layout = layout_for(kv_layout)
    pool = pack_pool(reference_caches(layout, seed=2), kv_layout)
    x = decode_inputs(layout, (1, 129, 300), n, seed=3)
    meta = (x["block_table"], x["seq_lens"])
    jpool = to_jnp(pool)
    jq, jiq, jmeta = to_jnp(x["q"]), to_jnp(x["idx_q"]), tuple(map(to_jnp, meta))
    jax_msa = jax.jit(m3_jax.msa_decode, static_argnames=("decode_query_len", "topk", "kv_layout"))

    # sparse layer 2: msa_decode
    k, v, ik = tcache.layer_caches(pool, layout, 2)
    out, ids = m3_torch.msa_decode(x["q"], x["idx_q"], k, v, ik, *meta, decode_query_len=n, topk=2)
    alone = [standalone(c, kv_layout) for c in (k, v, ik)]
    out_alone, ids_alone = m3_torch.msa_decode(x["q"], x["idx_q"], *alone, *meta, decode_query_len=n, topk=2)
    assert not torch.isnan(out).any()
    assert torch.equal(ids, ids_alone) and torch.equal(out, out_alone)
    jout, jids = jax_msa(jq, jiq, *jcache.layer_views(jpool, layout, 2), *jmeta, decode_query_len=n, topk=2)
    assert np.array_equal(np.asarray(jids), ids.numpy())
    assert np.array_equal(bits(jout), bits(out))

    # dense layer 0: dense_decode
    k, v, _ = tcache.layer_caches(pool, layout, 0)
    out = m3_torch.dense_decode(x["q"], k, v, *meta, decode_query_len=n)
    out_alone = m3_torch.dense_decode(x["q"], standalone(k, kv_layout), standalone(v, kv_layout), *meta,
                                      decode_query_len=n)
    assert torch.equal(out, out_alone)
    jk, jv, _ = jcache.layer_views(jpool, layout, 0)
    jout = m3_jax.dense_decode(jq, jk, jv, *jmeta, decode_query_len=n)
    assert np.array_equal(bits(jout), bits(out))


# -- cache writes ---------------------------------------------------------------------------

def write_inputs(layout, num_tokens, seed, slot_dtype=torch.int32):
    """New rows and a slot mapping: distinct random slots (page edges included), some -1."""
    g = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPES[layout.dtype]
    edges = torch.tensor([PAGE, 2 * PAGE - 1, layout.num_slots * PAGE - 1])  # a page's first/last row, the pool's last
    rest = torch.randperm(layout.num_slots * PAGE, generator=g)
    rest = rest[~torch.isin(rest, edges)][:num_tokens - len(edges)]
    slots = torch.cat([edges, rest])
    slots[3::4] = -1                                                      # skipped tokens
    return dict(k=torch.randn(num_tokens, HK, D, generator=g).to(dtype),
                v=torch.randn(num_tokens, HK, D, generator=g).to(dtype),
                index_k=torch.randn(num_tokens, DI, generator=g).to(dtype), slot_mapping=slots.to(slot_dtype))


def expected_write(caches, w):
    """Plain-torch scatter of the new rows into (views of) a copy of the caches' buffer."""
    k_cache, v_cache, ik_cache = caches
    for t, s in enumerate(w["slot_mapping"].tolist()):
        if s < 0:
            continue
        k_cache[s // PAGE, :, s % PAGE] = w["k"][t]
        v_cache[s // PAGE, :, s % PAGE] = w["v"][t]
        if ik_cache is not None:
            ik_cache[s // PAGE, s % PAGE] = w["index_k"][t]


@pytest.mark.parametrize("kv_layout, dtype, slot_dtype", [("HND", "bfloat16", torch.int32),
                                                          ("NHD", "float32", torch.int64)])
def test_write_cache_lands_exactly_at_slot_mapping(kv_layout, dtype, slot_dtype):
    layout = layout_for(kv_layout, dtype)
    pool = torch.full(layout.shape, math.nan, dtype=TORCH_DTYPES[dtype])   # poison
    expected = pool.clone()
    jpool = jnp.full(layout.shape, jnp.nan, dtype=dtype)
    write = jax.jit(jcache.write_layer, static_argnums=(1, 2), donate_argnums=0)
    for step, layer in enumerate((1, 0, 2)):      # sparse, dense, sparse (last in the slot)
        w = write_inputs(layout, 9, seed=10 + step, slot_dtype=slot_dtype)
        index_k = w["index_k"] if layout.layers[layer].sparse else None
        caches = tcache.layer_caches(pool, layout, layer)
        m3_torch.write_cache(w["k"], w["v"], index_k, *caches, w["slot_mapping"])
        expected_write(tcache.layer_caches(expected, layout, layer), {**w, "index_k": index_k})
        assert np.array_equal(bits(pool), bits(expected)), f"layer {layer}"

        ptr = jpool.unsafe_buffer_pointer()
        jpool = write(jpool, layout, layer, to_jnp(w["k"]), to_jnp(w["v"]),
                      None if index_k is None else to_jnp(index_k), to_jnp(w["slot_mapping"].int()))
        assert jpool.unsafe_buffer_pointer() == ptr          # donated: XLA reused the buffer
        assert np.array_equal(bits(jpool), bits(expected)), f"jax, layer {layer}"
    written = (~torch.isnan(pool)).sum().item()
    assert written == 7 * (2 * 3 * HK * D + 2 * DI)   # 7 of 9 tokens per step; 3 layers, 2 sparse


def test_write_cache_standalone_caches():
    """Caches in separate buffers (one launch each), NHD K store, nothing else touched."""
    w = write_inputs(layout_for("HND", "float16", num_slots=4), 6, seed=20)
    k_store = torch.full((4, PAGE, HK, D), math.nan, dtype=torch.float16)
    caches = (k_store.permute(0, 2, 1, 3), torch.full((4, HK, PAGE, D), math.nan, dtype=torch.float16),
              torch.full((4, PAGE, DI), math.nan, dtype=torch.float16))
    expected = tuple(c.clone() for c in caches)
    m3_torch.write_cache(w["k"], w["v"], w["index_k"], *caches, w["slot_mapping"])
    expected_write(expected, w)
    for got, exp in zip(caches, expected):
        assert np.array_equal(bits(got), bits(exp))

    # JAX: a plain NHD array (K), a PagedView (V), a plain array (index-K); each comes back as it went in
    jk, jv, jik = jcache.write_cache(to_jnp(w["k"]), to_jnp(w["v"]), to_jnp(w["index_k"]),
                                     jnp.full(k_store.shape, jnp.nan, jnp.float16),
                                     m3_jax.PagedView.of_array(jnp.full((4, HK, PAGE, D), jnp.nan, jnp.float16)),
                                     jnp.full((4, PAGE, DI), jnp.nan, jnp.float16), to_jnp(w["slot_mapping"]),
                                     kv_layout="NHD")
    assert jk.shape == k_store.shape and isinstance(jv, m3_jax.PagedView)
    assert np.array_equal(bits(jk), bits(expected[0].permute(0, 2, 1, 3)))
    assert np.array_equal(bits(jv.buffer), bits(expected[1])) and np.array_equal(bits(jik), bits(expected[2]))


def test_write_cache_rejects_bad_inputs():
    layout = layout_for("HND")
    pool = torch.zeros(layout.shape, dtype=torch.bfloat16)
    w = write_inputs(layout, 4, seed=30)
    sparse, dense = tcache.layer_caches(pool, layout, 1), tcache.layer_caches(pool, layout, 0)
    with pytest.raises(TypeError, match="slot_mapping"):
        m3_torch.write_cache(w["k"], w["v"], w["index_k"], *sparse, w["slot_mapping"].float())
    with pytest.raises(ValueError, match="slot_mapping"):
        m3_torch.write_cache(w["k"], w["v"], w["index_k"], *sparse, w["slot_mapping"][:3])
    with pytest.raises(ValueError, match="index_k"):
        m3_torch.write_cache(w["k"], w["v"], w["index_k"], *dense, w["slot_mapping"])
    with pytest.raises(TypeError, match="k_cache"):
        m3_torch.write_cache(w["k"].float(), w["v"].float(), None, *dense[:2], None, w["slot_mapping"])
    with pytest.raises(ValueError, match="Hk"):
        m3_torch.write_cache(w["k"][:, :1], w["v"][:, :1], None, *dense[:2], None, w["slot_mapping"])
    with pytest.raises(ValueError, match="index_k"):
        jcache.write_layer(to_jnp(pool), layout, 0, to_jnp(w["k"]), to_jnp(w["v"]), to_jnp(w["index_k"]),
                           to_jnp(w["slot_mapping"]))
    assert (pool == 0).all()
