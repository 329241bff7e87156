"""Zero-copy exchange (DLPack) of pools and step metadata between torch and JAX.

CPU: round trips keep data pointers, clear errors where DLPack cannot be
zero-copy, and the cross-framework step scenarios in the interpreter.
GPU (``-m gpu`` on the device machine; the JAX ones also need jax-triton and a
GPU jaxlib): the same scenarios at TP-slice shapes must give bit-identical
outputs from both frameworks, the JAX cache write is in place under jit, and a
torch CUDA graph of "write cache + decode" replays correctly across steps.
"""

import gc
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import m3_jax
import m3_torch
from m3_jax import interop
from m3_jax.interop import StepMetadata, same_memory, to_jax, to_torch
from m3_kernels.pool import PoolLayout
from m3_torch import cache as tcache

PAGE = 128


def jax_on_gpu():
    # find_spec, not import: importing jax_triton resets Triton's cache dir (m3_jax._triton_call restores it)
    return importlib.util.find_spec("jax_triton") is not None and jax.default_backend() == "gpu"


needs_jax_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and jax_on_gpu()),
                                   reason="needs a GPU jaxlib and jax-triton")


def bits(x):
    """Raw bits (numpy ints, on the host) of a torch tensor or jax array: exact, NaN-safe comparisons."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().contiguous()
        return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[x.element_size()]).numpy()
    a = np.asarray(x)
    return a.view({1: np.int8, 2: np.int16, 4: np.int32}[a.dtype.itemsize])


def random_pool(layout, device, seed):
    """A torch pool of random cache contents (a pool with FP8 caches: each cache filled through its
    view, so the bytes hold valid values of every cache's dtype)."""
    g = torch.Generator().manual_seed(seed)
    if layout.buffer_dtype != "uint8":
        return torch.randn(layout.shape, generator=g).to(torch.bfloat16).to(device)
    pool = tcache.allocate_pool(layout, device)
    for layer in range(layout.num_layers):
        for cache in tcache.layer_caches(pool, layout, layer):
            if cache is not None:
                cache.copy_(torch.randn(cache.shape, generator=g).to(cache.dtype))
    return pool


FP8_SCALES = (0.05, 0.02)


def kv_scales(layout, framework, device="cpu"):
    """The k_scale/v_scale keywords of a layout with FP8 K/V caches (none otherwise)."""
    if layout.kv_cache_dtype != "float8_e4m3fn":
        return {}
    if framework == "torch":   # filled on the device: a host-to-device copy could not be graph-captured
        return {n: torch.full((), s, dtype=torch.float32, device=device) for n, s in zip(("k_scale", "v_scale"),
                                                                                          FP8_SCALES)}
    return {n: jnp.float32(s) for n, s in zip(("k_scale", "v_scale"), FP8_SCALES)}


# -- round trips -----------------------------------------------------------------------

def test_torch_jax_torch_round_trip_keeps_pointers():
    layout = PoolLayout.create(5, sparse=(False, True), num_kv_heads=1, head_dim=16)
    pool = torch.randn(layout.shape).to(torch.bfloat16)
    block_table = torch.randint(0, 5, (3, 4), dtype=torch.int32)
    seq_lens = torch.randint(1, 500, (3,), dtype=torch.int32)
    slot_mapping = torch.randint(-1, 5 * PAGE, (3,), dtype=torch.int32)
    meta = StepMetadata(block_table, seq_lens, slot_mapping)

    jpool, jmeta = to_jax(pool, "pool"), meta.to_jax()
    assert isinstance(jpool, jax.Array) and jpool.dtype == jnp.bfloat16 and jpool.shape == layout.shape
    assert same_memory(jpool, pool)
    for name in ("block_table", "seq_lens", "slot_mapping"):
        assert same_memory(getattr(jmeta, name), getattr(meta, name)), name
        assert np.array_equal(np.asarray(getattr(jmeta, name)), getattr(meta, name).numpy())
    assert np.array_equal(bits(jpool), bits(pool))

    back, back_meta = to_torch(jpool, "pool"), jmeta.to_torch()
    assert back.data_ptr() == pool.data_ptr() and back.dtype == pool.dtype
    for name in ("block_table", "seq_lens", "slot_mapping"):
        assert getattr(back_meta, name).data_ptr() == getattr(meta, name).data_ptr(), name
    assert StepMetadata(block_table, seq_lens).to_jax().slot_mapping is None


def test_byte_pool_with_fp8_caches_round_trips_without_copies():
    """A pool holding FP8 K/V beside bf16 index-K is one byte buffer: DLPack moves it as uint8, and both
    frameworks view the same bytes as each cache's dtype."""
    layout = PoolLayout.create(4, sparse=(False, True), num_kv_heads=1, head_dim=16, kv_cache_dtype="fp8")
    pool = random_pool(layout, "cpu", seed=0)
    jpool = to_jax(pool, "pool")
    assert jpool.dtype == jnp.uint8 and same_memory(jpool, pool) and same_memory(to_torch(jpool), pool)
    for layer in (0, 1):
        for cache, view in zip(tcache.layer_caches(pool, layout, layer), m3_jax.layer_views(jpool, layout, layer)):
            if cache is not None:
                assert view.dtype == jnp.dtype(str(cache.dtype).removeprefix("torch."))
                assert np.array_equal(bits(view.to_array()), bits(cache))


def test_jax_torch_jax_round_trip_keeps_pointers():
    pool = jax.random.normal(jax.random.key(0), (4 * 2 * PAGE * 16,), jnp.float16)
    meta = StepMetadata(jnp.arange(6, dtype=jnp.int32).reshape(2, 3), jnp.array([7, 300], jnp.int32))
    tpool, tmeta = to_torch(pool), meta.to_torch()
    assert isinstance(tpool, torch.Tensor) and tpool.dtype == torch.float16
    assert same_memory(tpool, pool) and same_memory(tmeta.block_table, meta.block_table)
    assert same_memory(to_jax(tpool), pool) and same_memory(tmeta.to_jax().seq_lens, meta.seq_lens)


def test_shared_pool_sees_writes_from_the_owner():
    """A torch write into a torch-owned pool is visible through its JAX export: one buffer."""
    layout = PoolLayout.create(3, sparse=(True,), num_kv_heads=1, head_dim=16, dtype="float32")
    pool = torch.randn(layout.shape)
    jpool = to_jax(pool)
    k, v, ik = torch.randn(2, 1, 16), torch.randn(2, 1, 16), torch.randn(2, 16)
    m3_torch.write_cache(k, v, ik, *tcache.layer_caches(pool, layout, 0),
                         torch.tensor([PAGE + 3, -1], dtype=torch.int32))
    jk = m3_jax.layer_views(to_jax(pool), layout, 0).k_cache.to_array()
    assert np.array_equal(np.asarray(jk[1, :, 3]), k[0].numpy())
    assert np.array_equal(np.asarray(jpool), pool.numpy())


# -- errors where DLPack cannot be zero-copy ----------------------------------------------

def test_non_contiguous_export_is_a_clear_error():
    pool = torch.randn(4, PAGE, 2, 16)
    with pytest.raises(ValueError, match=r"k_cache: JAX takes only dense row-major buffers.*strides"):
        to_jax(pool.permute(0, 2, 1, 3), "k_cache")
    with pytest.raises(ValueError, match="block_table: JAX takes only dense row-major"):
        to_jax(torch.zeros(8, 4, dtype=torch.int32)[:, ::2], "block_table")
    with pytest.raises(ValueError, match="pool: JAX cannot take this buffer without a copy"):
        to_jax(torch.randn(1000)[1:], "pool")          # misaligned start
    with pytest.raises(TypeError, match="seq_lens: dtype int64"):
        to_jax(torch.arange(4), "seq_lens")            # JAX would narrow it to int32: a copy
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        to_jax(np.zeros(3))
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda x: to_torch(x).sum())(jnp.ones(3))
    x = jnp.ones(8) + 1
    jax.jit(lambda a: a * 2, donate_argnums=0)(x)
    with pytest.raises(ValueError, match="deleted"):
        to_torch(x)


def test_jax_donation_needs_no_live_torch_alias():
    """Documented limit: while a torch tensor aliases a JAX pool, jit cannot donate it (JAX copies);
    once the alias is gone the write is in place again."""
    layout = PoolLayout.create(2, sparse=(False,), num_kv_heads=1, head_dim=16, dtype="float32")
    write = jax.jit(m3_jax.write_layer, static_argnums=(1, 2), donate_argnums=0)
    k = jnp.ones((1, 1, 16), jnp.float32)
    slot = jnp.array([5], jnp.int32)
    pool = jnp.zeros(layout.shape, jnp.float32) + 1
    alias = to_torch(pool)
    new = write(pool, layout, 0, k, k, None, slot)
    assert not same_memory(new, alias)
    del alias, pool
    gc.collect()
    ptr = new.unsafe_buffer_pointer()
    assert write(new, layout, 0, k, k, None, slot).unsafe_buffer_pointer() == ptr


# -- one decode step shared by both frameworks ----------------------------------------------

SMALL = dict(hq=4, hk=1, d=32, di=16, seq_lens=(1, 200, 0), n=1, topk=2, num_slots=6)
TP_SLICE = dict(hq=8, hk=1, d=128, di=128, seq_lens=(1, 127, 128, 129, 3000, 0, 2049, 700), n=2, topk=16,
                num_slots=80)
FP8 = dict(kv_cache_dtype="fp8", index_cache_dtype="fp8")   # a byte pool


def step_inputs(shapes, device, seed, kv_layout="HND"):
    """A mixed layer group (dense, sparse), a block table of pool slots, the step's new tokens and their
    slot mapping (token j of request r sits at seq_len - n + j; padding rows map to -1)."""
    g = torch.Generator().manual_seed(seed)
    hq, hk, d, di, n = shapes["hq"], shapes["hk"], shapes["d"], shapes["di"], shapes["n"]
    seq_lens = shapes["seq_lens"]
    layout = PoolLayout.create(shapes["num_slots"], sparse=(False, True), num_kv_heads=hk, head_dim=d,
                               index_head_dim=di, kv_layout=kv_layout,
                               kv_cache_dtype=shapes.get("kv_cache_dtype", "auto"),
                               index_cache_dtype=shapes.get("index_cache_dtype", "auto"))
    max_blocks = max(-(-s // PAGE) for s in seq_lens) + 1
    perm = torch.randperm(layout.num_slots, generator=g).int().tolist()
    block_table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    slots = []
    for r, s in enumerate(seq_lens):
        nb = -(-s // PAGE) + 1                        # one spare block per request: room to grow
        block_table[r, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
        for j in range(n):
            pos = s - n + j
            slots.append(int(block_table[r, pos // PAGE]) * PAGE + pos % PAGE if pos >= 0 else -1)
    T = len(seq_lens) * n

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16).to(device)

    x = dict(q=randn(T, hq, d), idx_q=randn(T, hk, di), k=randn(T, hk, d), v=randn(T, hk, d), index_k=randn(T, di))
    meta = StepMetadata(block_table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
                        torch.tensor(slots, dtype=torch.int32, device=device))
    return layout, meta, x


def torch_write(pool, layout, meta, x):
    """The step's rows into both layers (dense layer 0, sparse layer 1) of a torch pool."""
    for layer in (0, 1):
        k, v, ik = tcache.layer_caches(pool, layout, layer)
        m3_torch.write_cache(x["k"], x["v"], x["index_k"] if layer else None, k, v, ik, meta.slot_mapping,
                             **kv_scales(layout, "torch", pool.device))


def torch_decode(pool, layout, meta, x, shapes):
    """dense_decode (layer 0) and msa_decode (layer 1) on views of a torch pool -> (dense, out, ids)."""
    scales = kv_scales(layout, "torch", pool.device)
    k, v, _ = tcache.layer_caches(pool, layout, 0)
    dense = m3_torch.dense_decode(x["q"], k, v, meta.block_table, meta.seq_lens, decode_query_len=shapes["n"],
                                  **scales)
    k, v, ik = tcache.layer_caches(pool, layout, 1)
    out, ids = m3_torch.msa_decode(x["q"], x["idx_q"], k, v, ik, meta.block_table, meta.seq_lens,
                                   decode_query_len=shapes["n"], topk=shapes["topk"], **scales)
    return dense, out, ids


def torch_step(pool, layout, meta, x, shapes):
    torch_write(pool, layout, meta, x)
    return torch_decode(pool, layout, meta, x, shapes)


def jax_decode(pool, layout, meta, x, shapes):
    """dense_decode (layer 0) and msa_decode (layer 1) on views of a JAX pool, jitted."""
    @jax.jit
    def run(pool, q, idx_q, block_table, seq_lens):
        scales = kv_scales(layout, "jax")
        k, v, _ = m3_jax.layer_views(pool, layout, 0)
        dense = m3_jax.dense_decode(q, k, v, block_table, seq_lens, decode_query_len=shapes["n"], **scales)
        k, v, ik = m3_jax.layer_views(pool, layout, 1)
        out, ids = m3_jax.msa_decode(q, idx_q, k, v, ik, block_table, seq_lens, decode_query_len=shapes["n"],
                                     topk=shapes["topk"], **scales)
        return dense, out, ids

    return run(pool, x["q"], x["idx_q"], meta.block_table, meta.seq_lens)


def jax_write(pool, layout, meta, x):
    """The step's rows into both layers of a JAX pool, in place (donated)."""
    def write(pool, k, v, index_k, slot_mapping):
        scales = kv_scales(layout, "jax")
        pool = m3_jax.write_layer(pool, layout, 0, k, v, None, slot_mapping, **scales)
        return m3_jax.write_layer(pool, layout, 1, k, v, index_k, slot_mapping, **scales)

    return jax.jit(write, donate_argnums=0)(pool, x["k"], x["v"], x["index_k"], meta.slot_mapping)


def check_torch_owned(shapes, device, kv_layout):
    layout, meta, x = step_inputs(shapes, device, seed=1, kv_layout=kv_layout)
    pool = random_pool(layout, device, seed=1)                               # torch owns the pool
    dense, out, ids = torch_step(pool, layout, meta, x, shapes)
    assert not torch.isnan(out).any() and out.abs().sum() > 0 and dense.abs().sum() > 0
    jpool, jmeta = to_jax(pool, "pool"), meta.to_jax()                       # after torch's writes
    assert same_memory(jpool, pool) and same_memory(jmeta.block_table, meta.block_table)
    jx = {name: to_jax(t, name) for name, t in x.items()}
    jdense, jout, jids = jax_decode(jpool, layout, jmeta, jx, shapes)
    assert np.array_equal(np.asarray(jids), ids.cpu().numpy())
    assert np.array_equal(bits(jout), bits(out))
    assert np.array_equal(bits(jdense), bits(dense))


def check_jax_owned(shapes, device, kv_layout):
    layout, meta, x = step_inputs(shapes, device, seed=2, kv_layout=kv_layout)
    jmeta = meta.to_jax()
    jx = {name: to_jax(t, name) for name, t in x.items()}
    jpool = jnp.array(to_jax(random_pool(layout, device, seed=3)), copy=True)  # JAX owns the pool (a copy)
    expected = to_torch(jpool).clone()
    interop.synchronize()                              # torch's read is done before JAX writes in place
    gc.collect()                                       # and no torch alias stays alive across the donation
    jpool = jax_write(jpool, layout, jmeta, jx)
    jdense, jout, jids = jax_decode(jpool, layout, jmeta, jx, shapes)

    pool = to_torch(jpool, "pool")                     # waits for JAX's writes on torch's stream
    assert same_memory(pool, jpool)
    tmeta = jmeta.to_torch()
    # torch replays the same writes on a copy of the initial pool: JAX's writes landed identically
    torch_write(expected, layout, meta, x)
    assert np.array_equal(bits(pool), bits(expected))
    dense, out, ids = torch_decode(pool, layout, tmeta, x, shapes)
    assert np.array_equal(np.asarray(jids), ids.cpu().numpy())
    assert np.array_equal(bits(jout), bits(out))
    assert np.array_equal(bits(jdense), bits(dense))


def test_torch_owned_pool_step_cpu():
    check_torch_owned(SMALL, "cpu", "NHD")


@pytest.mark.parametrize("caches", [{}, FP8], ids=["bf16", "fp8"])
def test_jax_owned_pool_step_cpu(caches):
    check_jax_owned(dict(SMALL, **caches), "cpu", "HND")


# -- GPU -------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_jax_gpu
@pytest.mark.parametrize("caches", [{}, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
def test_torch_owned_pool_gpu_bit_identical(kv_layout, caches):
    check_torch_owned(dict(TP_SLICE, **caches), "cuda", kv_layout)


@pytest.mark.gpu
@needs_jax_gpu
@pytest.mark.parametrize("caches", [{}, FP8, dict(kv_cache_dtype="fp8")], ids=["bf16", "fp8", "fp8_kv"])
def test_jax_owned_pool_gpu_bit_identical(caches):
    check_jax_owned(dict(TP_SLICE, **caches), "cuda", "HND")


@pytest.mark.gpu
@needs_jax_gpu
@pytest.mark.parametrize("caches", [{}, FP8], ids=["bf16", "fp8"])
def test_jax_cache_write_in_place_under_jit(caches):
    layout, meta, x = step_inputs(dict(TP_SLICE, **caches), "cuda", seed=4)
    jmeta, jx = meta.to_jax(), {name: to_jax(t, name) for name, t in x.items()}
    pool = jnp.array(to_jax(random_pool(layout, "cuda", seed=5)), copy=True)
    expected = to_torch(pool).clone()
    interop.synchronize()
    gc.collect()
    ptr = pool.unsafe_buffer_pointer()
    new = jax_write(pool, layout, jmeta, jx)
    assert pool.is_deleted()                            # donated ...
    assert new.unsafe_buffer_pointer() == ptr           # ... and written in place
    torch_write(expected, layout, meta, x)
    assert np.array_equal(bits(new), bits(expected))


@pytest.mark.gpu
@pytest.mark.parametrize("caches", [{}, FP8], ids=["bf16", "fp8"])
def test_cuda_graph_write_cache_and_msa_decode(caches):
    shapes = dict(TP_SLICE, n=1, seq_lens=(3000, 1, 0, 127), **caches)
    layout, meta, x = step_inputs(shapes, "cuda", seed=6)
    pool = random_pool(layout, "cuda", seed=6)
    eager_pool = pool.clone()
    static = {name: t.clone() for name, t in x.items()}
    smeta = StepMetadata(meta.block_table.clone(), meta.seq_lens.clone(), meta.slot_mapping.clone())
    torch_step(pool, layout, smeta, static, shapes)     # warm-up: compiles, creates workspaces and maps
    torch_step(eager_pool, layout, smeta, static, shapes)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_outs = torch_step(pool, layout, smeta, static, shapes)
    g = torch.Generator().manual_seed(7)
    lens = list(shapes["seq_lens"])
    for step in range(4):
        # next token of every live request (the padding row stays empty); the block table has room
        lens = [s + 1 if s else 0 for s in lens]
        slots = []
        for r, s in enumerate(lens):
            slots.append(int(smeta.block_table[r, (s - 1) // PAGE]) * PAGE + (s - 1) % PAGE if s else -1)
        if step == 3:
            slots[1] = -1                                 # a token the engine drops: never written
        smeta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        smeta.slot_mapping.copy_(torch.tensor(slots, dtype=torch.int32))
        for name, t in static.items():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        graph.replay()
        eager_outs = torch_step(eager_pool, layout, smeta, static, shapes)
        torch.cuda.synchronize()
        assert torch.equal(bits_t(pool), bits_t(eager_pool)), f"step {step}: pools differ"
        for got, want in zip(graph_outs, eager_outs):
            assert torch.equal(bits_t(got), bits_t(want)), f"step {step}"
        assert not torch.isnan(graph_outs[1]).any()


def bits_t(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
