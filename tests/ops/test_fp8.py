"""FP8 caches (SPEC.md, "FP8 caches") beyond the op grids of tests/helpers/cases.py: the bytes cache
writes store, how scales reach the kernels, and what FP8 index keys do to block selection.

Every op with every cache-dtype mix is in the shared case list (the ``fp8_*`` cases run
through test_attention / test_index_scores / test_msa / test_step); errors are in
test_errors.py, byte pools in test_pool.py and test_interop.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import m3_jax
import m3_torch
from m3_kernels import interpreter
from m3_kernels.pool import PoolLayout
from m3_torch import reference as ref

from cases import PAGE, TOLERANCE, decode, make_inputs, quantise, rel_err
from targets import targets, to_jax, to_torch

E4M3 = torch.float8_e4m3fn
E4M3_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3)


def e4m3_grid() -> torch.Tensor:
    """The finite non-negative float8_e4m3fn values, ascending (float32)."""
    values = E4M3_CODES[:127].float()
    return values[torch.isfinite(values)]


def hard_values(n: int, g) -> torch.Tensor:
    """float32 values an FP8 cast must get right: every grid point, the halfway points between
    neighbours (ties: to even) and their float32 neighbours, past +-448, +-inf, -0.0, subnormals."""
    grid = e4m3_grid()
    mids = (grid[1:] + grid[:-1]) / 2
    special = torch.tensor([448.0, 464.0, 465.0, 1e4, float("inf"), 0.0, -0.0, 2.0 ** -10, 2.0 ** -9 * 1.5])
    values = torch.cat([grid, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(0.0)), special])
    values = torch.cat([values, -values, torch.randn(n, generator=g) * 100])
    return values[torch.randperm(values.numel(), generator=g)][:n]


def test_interpreter_converts_e4m3_like_torch():
    """Triton 3.6's interpreter rounds to FP8 wrongly; m3_kernels.interpreter replaces its conversion.
    Saturating (as sm_90's cvt.rn.satfinite) and round-to-nearest-even, checked against torch."""
    values = interpreter._e4m3_values()
    want = E4M3_CODES.double().numpy()
    assert np.array_equal(np.isnan(values), np.isnan(want))
    assert np.array_equal(values[~np.isnan(values)], want[~np.isnan(want)])
    x = hard_values(2000, torch.Generator().manual_seed(0))
    codes = interpreter._to_e4m3(x.double().numpy(), toward_zero=False)
    assert np.array_equal(codes, x.clamp(-448, 448).to(E4M3).view(torch.uint8).numpy())
    nan = interpreter._to_e4m3(np.array([np.nan, -np.nan]), toward_zero=False)
    assert np.isnan(values[nan]).all()


# -- cache writes ------------------------------------------------------------------------------

SCALE_FORMS = {"tensor": lambda s, dev: torch.tensor(s, dtype=torch.float32, device=dev),
               "tensor1": lambda s, dev: torch.tensor([s], dtype=torch.float32, device=dev),
               "float": lambda s, dev: s}


@pytest.mark.parametrize("kv_cache_dtype, index_cache_dtype, scale_form", [
    ("fp8", "fp8", "tensor"), ("fp8", "auto", "float"), ("auto", "fp8", None), ("fp8", "auto", "tensor1")])
@pytest.mark.parametrize("target", targets())
def test_write_cache_stores_torchs_saturating_cast(target, kv_cache_dtype, index_cache_dtype, scale_form):
    """The bytes written to FP8 caches (in a byte pool) are torch's own saturating cast of x / scale;
    JAX writes the same bytes into its pool; NaN stays NaN; no other byte changes."""
    layout = PoolLayout.create(3, sparse=(True,), num_kv_heads=2, head_dim=16, kv_cache_dtype=kv_cache_dtype,
                               index_cache_dtype=index_cache_dtype)
    g = torch.Generator().manual_seed(1)
    T = 24
    k, v = ((hard_values(T * 32, g).reshape(T, 2, 16) * 0.5).bfloat16() for _ in range(2))
    index_k = hard_values(T * 16, g).reshape(T, 16).bfloat16()
    k[0, 0, 0] = index_k[1, 3] = float("nan")
    scales = (0.5, 0.25) if scale_form else (1.0, 1.0)   # powers of two: x / scale is exact, ties stay ties
    slots = torch.randperm(3 * PAGE, generator=g)[:T].int()
    slots[5] = -1

    pool = torch.full(layout.shape, 0x5A, dtype=torch.uint8)   # poison: every byte not written stays 0x5A
    expected = pool.clone()
    for t, s in enumerate(slots.tolist()):   # plain torch: quantise, scatter into typed views of a copy
        if s < 0:
            continue
        ek, ev, eik = m3_torch.layer_caches(expected, layout, 0)
        for cache, rows, scale in ((ek, k, scales[0]), (ev, v, scales[1])):
            cache[s // PAGE, :, s % PAGE] = quantise(rows[t], scale) if cache.dtype == E4M3 else rows[t]
        eik[s // PAGE, s % PAGE] = quantise(index_k[t]) if eik.dtype == E4M3 else index_k[t]
    kw = {} if scale_form is None else {name: SCALE_FORMS[scale_form](s, target.torch_device)
                                        for name, s in zip(("k_scale", "v_scale"), scales)}
    with target.active():
        if target.framework == "torch":
            dev = target.torch_device
            pool = pool.to(dev)
            m3_torch.write_cache(k.to(dev), v.to(dev), index_k.to(dev), *m3_torch.layer_caches(pool, layout, 0),
                                 slots.to(dev), **kw)
            got = pool.cpu()
        else:
            kw = {n: s if isinstance(s, float) else to_jax(s) for n, s in kw.items()}
            got = to_torch(m3_jax.write_layer(to_jax(pool), layout, 0, to_jax(k), to_jax(v), to_jax(index_k),
                                              to_jax(slots), **kw))
    got_k, _, got_index_k = m3_torch.layer_caches(got, layout, 0)
    assert torch.isnan(got_k[slots[0] // PAGE, 0, slots[0] % PAGE, 0].float())
    assert torch.isnan(got_index_k[slots[1] // PAGE, slots[1] % PAGE, 3].float())
    for pool_ in (got, expected):   # NaN codes may differ in sign (torch vs a GPU's conversion): one code
        for cache in m3_torch.layer_caches(pool_, layout, 0):
            if cache.dtype == E4M3:
                code = cache.view(torch.uint8)
                code[code == 0xFF] = 0x7F
    assert torch.equal(got, expected)


def test_write_cache_into_standalone_fp8_caches():
    """FP8 caches outside a pool (an NHD K store, an HND V cache, a bf16 index-K): one launch each,
    in both frameworks, the same bytes; JAX returns each cache as the kind it was given."""
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(5, 2, 16, generator=g).bfloat16() for _ in range(2))
    index_k = torch.randn(5, 16, generator=g).bfloat16()
    slots = torch.tensor([0, 1, 200, -1, 383], dtype=torch.int32)
    k_store, v_cache = torch.zeros(3, PAGE, 2, 16, dtype=E4M3), torch.zeros(3, 2, PAGE, 16, dtype=E4M3)
    index_cache = torch.zeros(3, PAGE, 16, dtype=torch.bfloat16)
    m3_torch.write_cache(k, v, index_k, k_store.permute(0, 2, 1, 3), v_cache, index_cache, slots, k_scale=0.5,
                         v_scale=torch.tensor([0.25]))
    assert torch.equal(k_store[1, 72].view(torch.uint8), quantise(k[2], 0.5).view(torch.uint8))
    assert torch.equal(v_cache[2, :, 127].view(torch.uint8), quantise(v[4], 0.25).view(torch.uint8))
    assert torch.equal(index_cache[0, 1], index_k[1])
    with jax.default_device(jax.devices("cpu")[0]):
        caches = (jnp.zeros(k_store.shape, jnp.float8_e4m3fn),
                  m3_jax.PagedView.of_array(jnp.zeros(v_cache.shape, jnp.float8_e4m3fn)),
                  jnp.zeros(index_cache.shape, jnp.bfloat16))
        jk, jv, jik = m3_jax.write_cache(to_jax(k), to_jax(v), to_jax(index_k), *caches, to_jax(slots), kv_layout="NHD",
                                         k_scale=0.5, v_scale=jnp.float32(0.25))
    assert isinstance(jv, m3_jax.PagedView) and jv.dtype == jnp.float8_e4m3fn
    for got, want in ((jk, k_store), (jv.buffer, v_cache), (jik, index_cache)):
        assert torch.equal(to_torch(got).view(torch.uint8), want.view(torch.uint8))


# -- scales --------------------------------------------------------------------------------------

def scaled_case():
    """One request of 600 tokens: dense decode splits it (split-K, then the merge) in the interpreter."""
    return decode("fp8_scales", (600,), hq=4, hk=1, d=32, di=16, kv_dtype="float8_e4m3fn", kv_scales=(0.02, 0.01))


@pytest.mark.parametrize("target", targets())
def test_scales_are_read_from_memory(target):
    """Each scale form gives the reference's output, bit-identical to a float32 tensor; a new
    value written into the same tensor (torch) or passed to the same jitted step (JAX) takes
    effect without recompiling. The output is linear in V: doubling v_scale doubles it exactly,
    split-K partials included."""
    case = scaled_case()
    x = make_inputs(case)
    args = ("q", "k_cache", "v_cache", "block_table", "seq_lens")
    expected = ref.attention_ref(*(x[n] for n in args), case.q_lens, k_scale=case.scales[0],
                                 v_scale=case.scales[1])
    with target.active():
        if target.framework == "torch":
            dev = target.torch_device
            a = [x[n].to(dev) for n in args]
            k_scale, v_scale = (torch.tensor([s], dtype=torch.float32, device=dev) for s in case.scales)
            out = m3_torch.dense_decode(*a, decode_query_len=1, k_scale=k_scale, v_scale=v_scale).cpu()
            assert rel_err(out, expected) < TOLERANCE["bfloat16"]
            same = m3_torch.dense_decode(*a, decode_query_len=1, k_scale=case.scales[0],
                                         v_scale=v_scale.reshape(())).cpu()
            assert torch.equal(same, out)
            v_scale.mul_(2)   # in memory, as an engine updates a captured graph's scale
            doubled = m3_torch.dense_decode(*a, decode_query_len=1, k_scale=k_scale, v_scale=v_scale).cpu()
            unit = m3_torch.dense_decode(*a, decode_query_len=1, k_scale=k_scale).cpu()   # v_scale None: 1.0
        else:
            a = [to_jax(x[n]) for n in args]
            step = jax.jit(lambda *a: m3_jax.dense_decode(*a[:5], decode_query_len=1, k_scale=a[5], v_scale=a[6]))
            k_scale, v_scale = (jnp.float32(s) for s in case.scales)
            out = to_torch(step(*a, k_scale, v_scale))
            assert rel_err(out, expected) < TOLERANCE["bfloat16"]
            same = to_torch(m3_jax.dense_decode(*a, decode_query_len=1, k_scale=case.scales[0],
                                                v_scale=jnp.asarray([case.scales[1]], jnp.float32)))
            assert torch.equal(same, out)
            doubled = to_torch(step(*a, k_scale, v_scale * 2))
            assert step._cache_size() == 1
            unit = to_torch(m3_jax.dense_decode(*a, decode_query_len=1, k_scale=k_scale))   # v_scale None: 1.0
    assert torch.equal(doubled, out * 2)   # exact: the scale's power of two commutes with every rounding
    assert rel_err(unit, out.double() / case.scales[1]) < TOLERANCE["bfloat16"]


# -- queries past float16's range ----------------------------------------------------------------

@pytest.mark.parametrize("target", targets())
def test_queries_of_any_magnitude_with_fp8_caches(target):
    """With FP8 caches the kernels widen tiles to float16 and move a bf16 query there too
    (common.fp16_operand), each row scaled by its own power of two. In one token, one head's q and
    idx_q are 2^17 times the usual (past float16's 65504) and its neighbour's, in the same tiles,
    2^-20 times (below float16's normal range); the other token is ordinary. Every score row and
    every output row matches the references on its own scale."""
    from test_hardening import call, msa_args

    case = decode("fp8_q_range", (300, 129), hq=4, hk=2, d=32, di=16, topk=2, kv_dtype="float8_e4m3fn",
                  index_dtype="float8_e4m3fn", kv_scales=(0.02, 0.01))
    x = dict(make_inputs(case))
    scale = {"q": torch.ones(2, 4, 1), "idx_q": torch.ones(2, 2, 1)}
    scale["q"][0, 0], scale["q"][0, 1] = 2.0 ** 17, 2.0 ** -20       # one KV head's group: one tile
    scale["idx_q"][0, 0], scale["idx_q"][0, 1] = 2.0 ** 17, 2.0 ** -20
    for name, sc in scale.items():
        x[name] = (x[name].float() * sc).to(x[name].dtype)
    assert x["idx_q"][0, 0].float().abs().max() > 65504 and x["idx_q"][0, 1].float().abs().max() < 2 ** -14
    scales = dict(k_scale=torch.tensor(case.scales[0]), v_scale=torch.tensor(case.scales[1]))
    scores = call(target, "index_scores", x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"],
                  decode_query_len=1)
    want = ref.index_scores_ref(x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"], case.q_lens)
    assert torch.equal(torch.isfinite(scores), torch.isfinite(want))
    for h in range(2):
        for t in range(2):
            got_row, want_row = scores[h, t], want[h, t]
            finite = torch.isfinite(want_row)
            torch.testing.assert_close(got_row[finite].double(), want_row[finite], rtol=1e-3,
                                       atol=1e-3 * want_row[finite].abs().max(), msg=f"head {h} token {t}")
    out, ids = call(target, "msa_decode", *msa_args(x), decode_query_len=1, topk=case.topk, **scales)
    ref_out, ref_ids = ref.msa_decode_ref(*msa_args(x), case.q_lens, topk=case.topk, **scales)
    assert torch.equal(ids, ref_ids)
    for t in range(2):
        for h in range(4):
            assert rel_err(out[t, h], ref_out[t, h]) < TOLERANCE["bfloat16"], (t, h)


# -- stale rows -----------------------------------------------------------------------------------

@pytest.mark.parametrize("target", targets())
def test_nan_codes_in_stale_fp8_rows_never_reach_outputs(target):
    """FP8 caches whose never-visible rows hold NaN codes (a reused page, the tail of a last page):
    the masked loads keep them out, as for bf16 caches (test_hardening.py)."""
    from test_hardening import call, make_batch, msa_args, poison, sizes

    seq_lens, n = ((200, 0, 129), (5000, 0, 2177, 16385))[target.device != "interpreter"], 1
    sz = sizes(target)
    x = make_batch(seq_lens, [n] * len(seq_lens), dtype=torch.bfloat16, **sz)
    stale = {name: ~torch.isfinite(t.float()) for name, t in poison(x).items() if name.endswith("cache")}
    scales = dict(k_scale=torch.tensor(0.02), v_scale=torch.tensor(0.01))
    clean = dict(x, k_cache=quantise(x["k_cache"], 0.02), v_cache=quantise(x["v_cache"], 0.01),
                 index_k_cache=quantise(x["index_k_cache"]))
    dirty = dict(clean)
    for name, mask in stale.items():
        code = clean[name].view(torch.uint8).clone()
        code[mask] = 0x7F   # NaN
        dirty[name] = code.view(E4M3)
    out, ids = call(target, "msa_decode", *msa_args(dirty), decode_query_len=n, topk=sz["topk"], **scales)
    ref_out, ref_ids = ref.msa_decode_ref(*msa_args(clean), [n] * len(seq_lens), topk=sz["topk"], **scales)
    assert torch.equal(ids, ref_ids)
    assert rel_err(out, ref_out) < TOLERANCE["bfloat16"]


@pytest.mark.parametrize("target", targets())
def test_nan_in_an_fp8_index_query_scores_nan(target):
    """An e4m3 index query with a NaN code in one token's head: that row's visible blocks score NaN,
    every other score equals the reference on the same e4m3 data (the query widens before the check)."""
    from test_hardening import call, make_batch, sizes

    seq_lens = (300, 0, 129) if target.device == "interpreter" else (5000, 0, 2177)
    x = make_batch(seq_lens, [1] * len(seq_lens), dtype=torch.bfloat16, **sizes(target))
    idx_q, index_k = x["idx_q"].to(E4M3), quantise(x["index_k_cache"])
    codes = idx_q.view(torch.uint8).clone()
    codes[0, -1, 3] = 0x7F   # NaN in token 0's last index head
    idx_q = codes.view(E4M3)
    scores = call(target, "index_scores", idx_q, index_k, x["block_table"], x["seq_lens"], decode_query_len=1)
    want = ref.index_scores_ref(idx_q, index_k, x["block_table"], x["seq_lens"], [1] * len(seq_lens))
    assert want[-1, 0, :-(-seq_lens[0] // PAGE)].isnan().all() and not want[:, 2].isnan().any()
    torch.testing.assert_close(scores.double(), want, rtol=1e-4, atol=1e-4, equal_nan=True)


# -- block selection from FP8 index keys ----------------------------------------------------------

def rms_normalised(x):
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


@pytest.mark.parametrize("target", targets())
def test_planted_blocks_are_selected_from_e4m3_index_keys(target):
    """Blocks holding a key aligned with the query always win, through an FP8 index-K cache."""
    g = torch.Generator().manual_seed(2)
    num_blocks, topk, di = 24, 16, 32
    keys = rms_normalised(torch.randn(num_blocks, PAGE, di, generator=g))
    idx_q = rms_normalised(torch.randn(2, 1, di, generator=g))        # two MTP tokens, one index head
    planted = sorted(torch.randperm(num_blocks - 1, generator=g)[:topk - 1].tolist())
    for b in planted:   # one row per planted block nearly parallel to both queries
        keys[b, int(torch.randint(PAGE, (1,), generator=g))] = rms_normalised(idx_q[0, 0] + idx_q[1, 0]) * 2
    cache = keys.to(E4M3)
    block_table = torch.arange(num_blocks, dtype=torch.int32)[None]
    seq_lens = torch.tensor([num_blocks * PAGE], dtype=torch.int32)
    with target.active():
        if target.framework == "torch":
            dev = target.torch_device
            scores = m3_torch.index_scores(idx_q.bfloat16().to(dev), cache.to(dev), block_table.to(dev),
                                           seq_lens.to(dev), decode_query_len=2).cpu()
        else:
            scores = to_torch(m3_jax.index_scores(to_jax(idx_q.bfloat16()), to_jax(cache), to_jax(block_table),
                                                  to_jax(seq_lens), decode_query_len=2))
    ids = ref.select_blocks_ref(scores, seq_lens, [2], topk)   # the selection rule (its kernel: test_select_blocks)
    for t in range(2):
        assert ids[0, t].tolist() == planted + [num_blocks - 1]   # the planted blocks and the local one


def top16_overlap(context: int, num_queries: int, scores_of) -> float:
    """Average overlap of the top-16 blocks scored from e4m3 and from bf16 index keys (RMS-normalised
    random keys and queries, Di = 128); ``scores_of(queries, keys) -> [queries, blocks]``."""
    g = torch.Generator().manual_seed(context)
    keys = rms_normalised(torch.randn(context // PAGE, PAGE, 128, generator=g)).bfloat16()
    queries = rms_normalised(torch.randn(num_queries, 128, generator=g)).bfloat16()
    top_bf16 = scores_of(queries, keys).topk(16, dim=-1).indices
    top_e4m3 = scores_of(queries, keys.float().to(E4M3)).topk(16, dim=-1).indices
    return float(np.mean([len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top_bf16, top_e4m3)]))


@pytest.mark.parametrize("context", [32768, 131072])
def test_e4m3_index_keys_keep_the_bf16_top16(context):
    """Quantising index keys to e4m3 keeps >= 14 of the 16 best blocks on average (float32 scores,
    as the indexer computes them: tests/ops/test_index_scores.py holds the kernel to these)."""
    def scores_of(queries, keys):
        return torch.einsum("qd,bnd->qbn", queries.float(), keys.float()).amax(-1)

    assert top16_overlap(context, 32, scores_of) >= 14


@pytest.mark.gpu
@pytest.mark.parametrize("context", [32768, 131072])
def test_e4m3_index_keys_keep_the_bf16_top16_gpu(context):
    """As above, with the indexer kernel scoring (one request, the queries as its MTP tokens)."""
    def scores_of(queries, keys):
        num_blocks = keys.shape[0]
        scores = m3_torch.index_scores(queries[:, None].cuda(), keys.cuda(),
                                       torch.arange(num_blocks, dtype=torch.int32, device="cuda")[None],
                                       torch.tensor([num_blocks * PAGE], dtype=torch.int32, device="cuda"),
                                       decode_query_len=queries.shape[0])
        return scores[0, :, :-1].cpu()   # the last block is partly hidden from the earlier tokens

    assert top16_overlap(context, 64, scores_of) >= 14
