"""Bad inputs get a ValueError / TypeError naming the argument, in both frameworks (SPEC.md, "Errors")."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import m3_jax
import m3_torch
from m3_jax import PagedView
from m3_kernels import planner
from m3_kernels.pool import PoolLayout

from cases import E4M3, STEP_CASES, decode, make_inputs, pool_layout, prefill, random_block_ids
from targets import targets, to_jax

DECODE = decode("errors", (130, 5), hq=4, hk=2)
PREFILL = prefill("errors_prefill", (5, 0, 17, 1), (205, 0, 146, 1001), hq=4, hk=2, d=32, di=32, topk=3)


def api(target):
    return m3_torch if target.framework == "torch" else m3_jax


def inputs(target, case, **over):
    """The case's inputs in ``target``'s framework, with ``over`` (torch CPU tensors, or other values)
    replacing some. JAX gets int64 / float64 tensors as numpy arrays (jax would narrow them)."""
    x = {**make_inputs(case), "block_ids": random_block_ids(case), **over}
    if target.framework == "torch":
        return {k: v.to(target.torch_device) if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    j = {}
    for k, v in x.items():
        if isinstance(v, torch.Tensor):
            j[k] = v.numpy() if v.dtype in (torch.int64, torch.float64) else to_jax(v)
        else:
            j[k] = v
    j["cu_seqlens_q"] = over.get("cu_seqlens_q", np.asarray(case.cu_seqlens, np.int32))
    if isinstance(j["cu_seqlens_q"], torch.Tensor):
        j["cu_seqlens_q"] = j["cu_seqlens_q"].numpy()
    return j


def sparse_decode(target, x, n=1):
    return api(target).sparse_decode(x["q"], x["k_cache"], x["v_cache"], x["block_ids"], x["block_table"],
                                     x["seq_lens"], decode_query_len=n)


# -- decode attention: both frameworks --------------------------------------------------------

@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("over, exc, words", [
    (lambda x: dict(block_table=x["block_table"].long()), TypeError, "block_table"),
    (lambda x: dict(seq_lens=x["seq_lens"].float()), TypeError, "seq_lens"),
    (lambda x: dict(seq_lens=x["seq_lens"][:1]), ValueError, "seq_lens"),
    (lambda x: dict(q=x["q"][0]), ValueError, "q"),
    (lambda x: dict(q=x["q"][:, :3]), ValueError, "Hq=3"),
    (lambda x: dict(k_cache=x["k_cache"][:, :, :64]), ValueError, "page size"),
    (lambda x: dict(v_cache=x["v_cache"].float()), TypeError, "v_cache"),
    (lambda x: dict(block_ids=x["block_ids"][:1]), ValueError, "block_ids"),
    (lambda x: dict(block_ids=x["block_ids"].float()), TypeError, "block_ids"),
], ids=["table_int64", "lens_float", "lens_rows", "q_rank", "q_heads", "page_size", "v_dtype", "ids_heads",
        "ids_dtype"])
def test_decode_attention_errors(target, over, exc, words):
    x = dict(make_inputs(DECODE), block_ids=random_block_ids(DECODE))
    with target.active(), pytest.raises(exc, match=words):
        sparse_decode(target, inputs(target, DECODE, **over(x)))


@pytest.mark.parametrize("target", targets())
def test_decode_query_len_must_divide_tokens(target):
    with target.active(), pytest.raises(ValueError, match="decode_query_len"):
        sparse_decode(target, inputs(target, DECODE), n=2)


@pytest.mark.parametrize("target", targets())
def test_index_select_msa_errors(target):
    ops = api(target)
    with target.active():
        j = inputs(target, DECODE)
        with pytest.raises(ValueError, match="Di"):
            ops.index_scores(j["idx_q"], j["index_k_cache"][..., :32], j["block_table"], j["seq_lens"],
                             decode_query_len=1)
        with pytest.raises(ValueError, match="index_k_cache"):
            ops.index_scores(j["idx_q"], j["index_k_cache"][:, :64], j["block_table"], j["seq_lens"],
                             decode_query_len=1)
        with pytest.raises(ValueError, match="init_blocks"):
            scores = inputs(target, DECODE, s=torch.randn(2, 2, 3))["s"]
            ops.select_blocks(scores, j["seq_lens"], decode_query_len=1, topk=2, init_blocks=2)
        with pytest.raises(TypeError, match="scores"):
            scores = inputs(target, DECODE, s=torch.randn(2, 2, 3).bfloat16())["s"]
            ops.select_blocks(scores, j["seq_lens"], decode_query_len=1, topk=2)
        with pytest.raises(ValueError, match="Hi=1"):
            ops.msa_decode(j["q"], j["idx_q"][:, :1], j["k_cache"], j["v_cache"], j["index_k_cache"],
                           j["block_table"], j["seq_lens"], decode_query_len=1)
        with pytest.raises(TypeError, match="index_k_cache"):
            ops.index_scores(j["idx_q"], None, j["block_table"], j["seq_lens"], decode_query_len=1)


@pytest.mark.parametrize("target", targets())
def test_arguments_of_another_framework_and_bad_sm_scale(target):
    """A numpy array to a torch op, a torch tensor to a JAX op, a non-number ``sm_scale``: a TypeError
    naming the argument (before anything reads them)."""
    x = inputs(target, DECODE)
    other = x["seq_lens"].cpu().numpy() if target.framework == "torch" else make_inputs(DECODE)["seq_lens"]
    expected = "a torch.Tensor, got ndarray" if target.framework == "torch" else "a jax array, got Tensor"
    with target.active():
        with pytest.raises(TypeError, match=f"m3_{target.framework}.sparse_decode: seq_lens: expected {expected}"):
            sparse_decode(target, {**x, "seq_lens": other})
        with pytest.raises(TypeError, match="sm_scale: expected a float or None"):
            api(target).dense_decode(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                      decode_query_len=1, sm_scale="0.5")
        # a cache of the other framework, of the right dtype: named before the MSA ops read its strides
        k = make_inputs(DECODE)["k_cache"]
        k_other, expected = ((k.view(torch.int16).numpy().view(ml_dtypes.bfloat16), "a torch.Tensor, got ndarray")
                             if target.framework == "torch" else (k, "a jax array or PagedView, got Tensor"))
        with pytest.raises(TypeError, match=f"k_cache: expected {expected}"):
            api(target).msa_decode(x["q"], x["idx_q"], k_other, x["v_cache"], x["index_k_cache"], x["block_table"],
                                   x["seq_lens"], decode_query_len=1, topk=2)


# -- torch only: out=, strides, devices ---------------------------------------------------------

@pytest.mark.parametrize("target", targets(["torch"]))
@pytest.mark.parametrize("over, exc, words", [
    (lambda x, dev: dict(out=torch.empty(1, 4, 64, dtype=torch.bfloat16, device=dev)), ValueError, "out"),
    (lambda x, dev: dict(out=torch.empty_like(x["q"], dtype=torch.float32)), TypeError, "out"),
    (lambda x, dev: dict(out=torch.empty_like(x["q"], device="meta")), ValueError, "device"),
    # rows 65 elements apart: the kernels need cache strides that are multiples of 16
    (lambda x, dev: dict(k_cache=torch.randn(x["k_cache"].numel() * 2, device=dev).to(torch.bfloat16).as_strided(
        x["k_cache"].shape, (2 * 128 * 65, 128 * 65, 65, 1))), ValueError, "k_cache: element offset and strides"),
], ids=["out_shape", "out_dtype", "out_device", "unaligned_strides"])
def test_torch_out_and_stride_errors(target, over, exc, words):
    x = inputs(target, DECODE)
    a = {**x, "out": None, **over(x, target.torch_device)}
    with pytest.raises(exc, match=words):
        m3_torch.sparse_decode(a["q"], a["k_cache"], a["v_cache"], a["block_ids"], a["block_table"], a["seq_lens"],
                               decode_query_len=1, out=a["out"])


# -- JAX only: layouts, views ---------------------------------------------------------------------

@pytest.mark.parametrize("target", targets(["jax"]))
@pytest.mark.parametrize("over, exc, words", [
    (lambda j: dict(k_cache=np.asarray(j["k_cache"]).tolist()), TypeError, "k_cache"),
    (lambda j: dict(k_cache=j["k_cache"][0]), ValueError, "k_cache"),
    (lambda j: dict(kv_layout="NDH"), ValueError, "kv_layout"),
    (lambda j: dict(kv_layout="NHD"), ValueError, "k_cache"),   # an HND store read as NHD: page size 2
], ids=["cache_list", "cache_rank", "bad_layout", "wrong_layout"])
def test_jax_layout_errors(target, over, exc, words):
    with target.active():
        j = inputs(target, DECODE)
        a = {**j, "kv_layout": "HND", **over(j)}
        with pytest.raises(exc, match=words):
            m3_jax.sparse_decode(a["q"], a["k_cache"], a["v_cache"], a["block_ids"], a["block_table"],
                                 a["seq_lens"], decode_query_len=1, kv_layout=a["kv_layout"])


@pytest.mark.parametrize("target", targets(["jax"]))
def test_jax_view_errors(target):
    with pytest.raises(ValueError, match="PagedView"):
        PagedView(jnp.zeros(100), 10, (10, 10), (10, 1))   # past the buffer
    with pytest.raises(ValueError, match="PagedView"):
        PagedView(jnp.zeros(100), 0, (10, 10), (10,))      # rank mismatch
    # a pool whose layer starts 5 elements in: the kernels need offsets that are multiples of 16
    case = DECODE
    x = make_inputs(case)
    num_pages = x["k_cache"].shape[0]
    numel, k, v, index_k = pool_layout(num_pages, case.hk, case.d, case.di, lead=5)
    with target.active():
        pool = jnp.ones(numel, jnp.bfloat16)
        views = [PagedView(pool, w.offset, w.shape, w.strides) for w in (k, v, index_k)]
        j = inputs(target, case)
        with pytest.raises(ValueError, match="element offset"):
            m3_jax.msa_decode(j["q"], j["idx_q"], *views, j["block_table"], j["seq_lens"], decode_query_len=1, topk=2)


@pytest.mark.parametrize("target", targets())
def test_msa_ops_check_kv_strides_before_the_indexer_runs(target, monkeypatch):
    """A K cache whose rows are 65 elements apart (index-K aligned): msa_decode's ValueError comes before
    any launch, the indexer's included (its attention launch alone would find it after the scores ran)."""
    x = make_inputs(DECODE)
    k = x["k_cache"]
    with target.active():
        j = inputs(target, DECODE)
        if target.framework == "torch":
            # made on the device: moving a strided view to another device would make it contiguous
            k_bad = torch.randn(k.numel() * 2, device=target.torch_device).to(k.dtype).as_strided(
                k.shape, (k.shape[1] * 128 * 65, 128 * 65, 65, 1))
            monkeypatch.setattr(m3_torch.ops, "run", lambda *a, **kw: pytest.fail("a launch ran"))
        else:
            buffer = to_jax(torch.randn(k.numel() + 5).to(k.dtype))
            k_bad = PagedView(buffer, 5, tuple(k.shape), tuple(int(s) for s in k.stride()))   # starts 5 elements in
            for call in ("cpu_call", "gpu_call"):   # what m3_jax.ops.run launches with
                monkeypatch.setattr(m3_jax.ops, call, lambda *a, **kw: pytest.fail("a launch ran"))
        with pytest.raises(ValueError, match="k_cache: element offset and strides"):
            api(target).msa_decode(j["q"], j["idx_q"], k_bad, j["v_cache"], j["index_k_cache"], j["block_table"],
                                   j["seq_lens"], decode_query_len=1, topk=2)


# -- prefill ------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("over, exc, words", [
    (lambda x: dict(cu_seqlens_q=x["cu_seqlens_q"].long()), TypeError, "cu_seqlens_q"),
    (lambda x: dict(cu_seqlens_q=x["cu_seqlens_q"][:-1]), ValueError, "cu_seqlens_q"),
    (lambda x: dict(cu_seqlens_q=x["cu_seqlens_q"] + 1), ValueError, "starting at 0"),
    (lambda x: dict(q=x["q"][:-1], block_ids=x["block_ids"][:, :-1]), ValueError, "cu_seqlens_q"),
    (lambda x: dict(cu_seqlens_q=None), ValueError, "cu_seqlens_q"),
    (lambda x: dict(cu_seqlens_q=None, plan=planner.prefill_plan([0, 5])), ValueError, "plan"),
], ids=["cu_int64", "cu_rows", "cu_start", "cu_tokens", "cu_missing", "plan_rows"])
def test_prefill_errors(target, over, exc, words):
    x = dict(make_inputs(PREFILL), block_ids=random_block_ids(PREFILL))
    with target.active():
        a = {"plan": None, **inputs(target, PREFILL, **over(x))}
        with pytest.raises(exc, match=words):
            api(target).sparse_prefill(a["q"], a["k_cache"], a["v_cache"], a["block_ids"], a["block_table"],
                                       a["seq_lens"], cu_seqlens_q=a["cu_seqlens_q"], plan=a["plan"])


@pytest.mark.parametrize("target", targets(["torch"]))
def test_torch_cu_seqlens_q_is_a_tensor(target):
    x = inputs(target, PREFILL)
    with pytest.raises(TypeError, match="cu_seqlens_q: expected an int32 tensor .R \\+ 1., got list"):
        m3_torch.dense_prefill(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                               cu_seqlens_q=list(PREFILL.cu_seqlens))


@pytest.mark.parametrize("target", targets(["jax"]))
def test_jax_prefill_errors(target):
    with target.active():
        j = inputs(target, PREFILL)
        args = (j["q"], j["k_cache"], j["v_cache"], j["block_table"], j["seq_lens"])

        @jax.jit
        def traced(q, k, v, bt, sl, cu):
            return m3_jax.dense_prefill(q, k, v, bt, sl, cu_seqlens_q=cu)

        with pytest.raises(TypeError, match="traced"):
            traced(*args, jnp.asarray(PREFILL.cu_seqlens, jnp.int32))
        maps = m3_jax.prefill_maps(PREFILL.cu_seqlens, heads=(1,))   # attention needs GROUP = 2
        with pytest.raises(ValueError, match="heads"):
            m3_jax.dense_prefill(*args, plan=maps)


# -- steps --------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", targets())
def test_step_errors(target):
    case = STEP_CASES[0]
    cfg = planner.StepConfig(num_q_heads=case.hq, num_kv_heads=case.hk, head_dim=case.d, max_batch=8,
                             max_num_tokens=64, max_blocks=make_inputs(case)["block_table"].shape[1], topk=case.topk)
    plan = planner.StepPlanner(cfg).plan(case.seq_lens, q_lens=case.q_lens, num_context=case.num_context)
    x = make_inputs(case)

    def run(sparse=True, **over):
        a = inputs(target, case, **over)
        return api(target).msa_attention_step(a["q"], a["idx_q"] if sparse else None, a["k_cache"], a["v_cache"],
                                              a["index_k_cache"] if sparse else None, a["block_table"],
                                              a["seq_lens"], plan=plan, sparse=sparse)

    with target.active():
        with pytest.raises(ValueError, match="rows"):
            run(block_table=x["block_table"][:-1], seq_lens=x["seq_lens"][:-1])
        with pytest.raises(ValueError, match="tokens"):
            run(sparse=False, q=x["q"][:-1])
        with pytest.raises(ValueError, match="columns"):
            run(block_table=x["block_table"][:, :3])
        with pytest.raises(ValueError, match="idx_q"):
            run(idx_q=None)
        with pytest.raises(ValueError, match="planned"):
            run(sparse=False, q=x["q"][:, :1])
        if target.framework == "jax":
            spec, _ = m3_jax.step_inputs(plan)
            j = inputs(target, case)
            with pytest.raises(ValueError, match="maps"):
                m3_jax.msa_attention_step(j["q"], j["idx_q"], j["k_cache"], j["v_cache"], j["index_k_cache"],
                                          j["block_table"], j["seq_lens"], plan=spec)


# -- FP8 caches ----------------------------------------------------------------------------------

FP8_DECODE = decode("errors_fp8", (130, 5), hq=4, hk=2, kv_dtype=E4M3, index_dtype=E4M3)
E5M2 = torch.float8_e5m2


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("case, over, exc, words", [
    (FP8_DECODE, lambda x: dict(k_cache=x["k_cache"].to(E5M2), v_cache=x["v_cache"].to(E5M2)), TypeError,
     "k_cache: FP8 caches must be float8_e4m3fn, got float8_e5m2"),
    (FP8_DECODE, lambda x: dict(v_cache=x["v_cache"].bfloat16()), TypeError, "v_cache: expected dtype float8_e4m3fn"),
    (FP8_DECODE, lambda x: dict(k_scale=torch.ones(2)), ValueError, "k_scale: expected one scale per layer"),
    (FP8_DECODE, lambda x: dict(v_scale=torch.ones((), dtype=torch.float64)), TypeError, "v_scale: expected dtype "
     "float32"),
    (FP8_DECODE, lambda x: dict(k_scale="0.5"), TypeError, "k_scale: expected a float"),
    (DECODE, lambda x: dict(k_scale=0.5), ValueError, "k_scale: scales apply to float8_e4m3fn K/V caches only"),
], ids=["e5m2_kv", "mixed_kv", "per_head_scale", "float64_scale", "str_scale", "scale_on_bf16"])
def test_fp8_attention_errors(target, case, over, exc, words):
    x = make_inputs(case)
    a = inputs(target, case, block_ids=random_block_ids(case), **over(x))
    scales = {n: a[n] for n in ("k_scale", "v_scale") if n in a}
    with target.active(), pytest.raises(exc, match=words):
        api(target).sparse_decode(a["q"], a["k_cache"], a["v_cache"], a["block_ids"], a["block_table"],
                                  a["seq_lens"], decode_query_len=1, **scales)


@pytest.mark.parametrize("target", targets())
def test_fp8_index_and_write_errors(target):
    x = make_inputs(FP8_DECODE)
    with target.active():
        a = inputs(target, FP8_DECODE, idx_e5m2=x["index_k_cache"].to(E5M2), idx_bf16=x["index_k_cache"].bfloat16(),
                   idx_q8=x["idx_q"].to(torch.float8_e4m3fn), k=x["q"][:, :2], k_scale=torch.ones(()))
        ops = api(target)
        meta = (a["block_table"], a["seq_lens"])
        with pytest.raises(TypeError, match="index_k_cache: FP8 caches must be float8_e4m3fn"):
            ops.index_scores(a["idx_q"], a["idx_e5m2"], *meta, decode_query_len=1)
        with pytest.raises(TypeError, match="index_k_cache: expected dtype float8_e4m3fn, got bfloat16"):
            ops.index_scores(a["idx_q8"], a["idx_bf16"], *meta, decode_query_len=1)   # an FP8 query: FP8 keys
        slots = inputs(target, FP8_DECODE, s=torch.tensor([0, 1], dtype=torch.int32))["s"]
        bf16 = inputs(target, DECODE)
        with pytest.raises(ValueError, match="k_scale: scales apply to float8_e4m3fn"):
            ops.write_cache(a["k"], a["k"], None, bf16["k_cache"], bf16["v_cache"], None, slots, k_scale=a["k_scale"])
        with pytest.raises(TypeError, match="index_k_cache: FP8 caches must be float8_e4m3fn"):
            ops.write_cache(a["k"], a["k"], a["k"][:, 0], a["k_cache"], a["v_cache"], a["idx_e5m2"], slots)
        if target.framework == "torch":
            with pytest.raises(ValueError, match="v_scale: expected device"):
                ops.dense_decode(a["q"], a["k_cache"], a["v_cache"], *meta, decode_query_len=1,
                                 v_scale=torch.ones((), device="meta"))


@pytest.mark.parametrize("option", ["kv_cache_dtype", "index_cache_dtype"])
def test_pool_cache_dtype_errors(option):
    with pytest.raises(TypeError, match=f"{option}: .*float8_e4m3fn"):
        PoolLayout.create(4, sparse=(True,), num_kv_heads=1, head_dim=16, **{option: "fp8_e5m2"})
    with pytest.raises(TypeError, match=option):
        PoolLayout.create(4, sparse=(True,), num_kv_heads=1, head_dim=16, **{option: "float16"})
