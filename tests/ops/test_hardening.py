"""Hardening: the values the kernels survive and the calls the ops refuse.

* Stale cache rows (NaN/Inf past ``seq_len`` in a request's last page, and whole
  pages of other data behind the table's unused entries) never reach an output.
* ``seq_lens`` past the table behave as the table's width: no op reads a
  neighbour's row of ``block_table``.
* NaN/Inf in ``q`` gives NaN rows on every launch geometry (split-K merge
  included) while padding rows stay zeros; NaN in ``idx_q`` gives NaN scores,
  which lose in selection.
* ``M3_VALIDATE=1`` value checks (eager, and under ``jax.jit``); off by
  default, when negative lengths are padding.
* The CPU path under concurrency: 16 ops in one jitted JAX function, torch ops
  from several threads.
* Inference-only guards (autograd, torch.func, jax.vmap/grad), numpy integer
  arguments, zero-filled pools.

Every case runs in both frameworks, on Triton's interpreter with small shapes
and (``-m gpu``) at MiniMax-M3 TP8 shapes; outputs are compared with the
float64 references of ``m3_torch.reference`` computed on CLEAN caches.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import m3_jax
import m3_torch
from m3_kernels import maps, tuning
from m3_kernels.pool import PoolLayout
from m3_torch import reference as ref

from targets import Target, targets, to_jax, to_torch

PAGE = 128
NAN, INF = float("nan"), float("inf")
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1e-2}
INTERPRETER = [Target("torch", "interpreter"), Target("jax", "interpreter")]

pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # the interpreter's max


def cdiv(a, b):
    return -(-a // b)


# -- inputs ------------------------------------------------------------------------------------

def sizes(target):
    """Head counts, dims and top-k: small on the interpreter, MiniMax-M3 TP8 (one KV head) on the GPU."""
    if target.device == "interpreter":
        return dict(hq=4, hk=1, d=16, topk=2)
    return dict(hq=8, hk=1, d=128, topk=16)


def make_batch(seq_lens, q_lens, *, hq, hk, d, dtype=torch.float32, extra_blocks=1, seed=0, **_):
    """Random inputs (CPU). Each row's visible blocks get distinct pages of a shuffled pool;
    its other table entries point at SPARE pages, which :func:`poison` fills with NaN/Inf."""
    g = torch.Generator().manual_seed(seed)
    used = [cdiv(max(s, 0), PAGE) for s in seq_lens]
    max_blocks = max(used) + extra_blocks
    num_spare = 2
    num_pages = sum(used) + num_spare
    perm = torch.randperm(num_pages, generator=g).int()
    spare = perm[sum(used):]
    table = torch.empty(len(seq_lens), max_blocks, dtype=torch.int32)
    start = 0
    for r, nb in enumerate(used):
        table[r, :nb] = perm[start:start + nb]
        table[r, nb:] = spare[torch.arange(max_blocks - nb) % num_spare]
        start += nb
    num_tokens = sum(q_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return dict(q=randn(num_tokens, hq, d), idx_q=randn(num_tokens, hk, d), k_cache=randn(num_pages, hk, PAGE, d),
                v_cache=randn(num_pages, hk, PAGE, d), index_k_cache=randn(num_pages, PAGE, d), block_table=table,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32))


def poison(x):
    """A copy of ``x`` whose never-visible cache rows hold NaN and Inf: the rows past
    ``seq_len`` in each request's last page, and every page no request sees."""
    y = {name: t.clone() for name, t in x.items()}
    seen = set()
    for r, s in enumerate(x["seq_lens"].tolist()):
        nb = cdiv(max(s, 0), PAGE)
        seen.update(x["block_table"][r, :nb].tolist())
        if s > 0 and s % PAGE:
            page = int(x["block_table"][r, nb - 1])
            y["k_cache"][page, :, s % PAGE:] = NAN
            y["v_cache"][page, :, s % PAGE:] = INF      # 0 * Inf = NaN: caught only if V is masked
            y["index_k_cache"][page, s % PAGE:] = NAN
    for page in set(range(x["k_cache"].shape[0])) - seen:
        y["k_cache"][page], y["v_cache"][page], y["index_k_cache"][page] = INF, NAN, -INF
    return y


def call(target: Target, op: str, *args, **kwargs):
    """``m3_torch.<op>`` or ``m3_jax.<op>`` on ``target`` -> outputs as CPU torch tensors."""
    with target.active():
        if target.framework == "torch":
            def conv(v):
                return v.to(target.torch_device) if isinstance(v, torch.Tensor) else v

            outs = getattr(m3_torch, op)(*map(conv, args), **{k: conv(v) for k, v in kwargs.items()})
            if outs is None:   # write_cache: in place
                return None
            return tuple(o.cpu() for o in outs) if isinstance(outs, tuple) else outs.cpu()

        def conv(v):
            return to_jax(v) if isinstance(v, torch.Tensor) else v

        outs = getattr(m3_jax, op)(*map(conv, args), **{k: conv(v) for k, v in kwargs.items()})
        return tuple(to_torch(o) for o in outs) if isinstance(outs, tuple) else to_torch(outs)


def attention_args(x):
    return x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"]


def msa_args(x):
    return x["q"], x["idx_q"], x["k_cache"], x["v_cache"], x["index_k_cache"], x["block_table"], x["seq_lens"]


def assert_close(out, want, dtype=torch.float32):
    out = out.double()
    assert not out.isnan().any(), "NaN in the output"
    err = float((out - want).norm() / max(float(want.norm()), 1e-30))
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


def assert_nan_rows(out, want, bad, dtype=torch.float32):
    """Rows ``bad`` ([T, Hq] bool) all NaN; every other row finite and close to ``want``."""
    assert out[bad].isnan().all(), "a row with NaN/Inf in q is not all NaN"
    assert_close(out[~bad], want[~bad], dtype)


def clamped_lens(seq_lens, max_blocks):
    """What the kernels treat ``seq_lens`` as: clamped to [0, max_blocks * 128]."""
    return torch.clamp(seq_lens, 0, max_blocks * PAGE)


# -- stale rows ----------------------------------------------------------------------------------

DECODE_STALE = {  # name: (interpreter seq_lens, GPU seq_lens, decode_query_len)
    "decode": ((200, 0, 129, 5), (5000, 0, 2177, 16385), 1),
    # MTP: several tokens per row tile (sparse tiles packed: 2 * max_blocks <= n * topk on the interpreter)
    "mtp": ((200, 131), (3000, 0, 16390), 4),
}


@pytest.mark.parametrize("case", DECODE_STALE)
@pytest.mark.parametrize("target", targets())
def test_stale_cache_rows_never_reach_decode_outputs(target, case):
    small, large, n = DECODE_STALE[case]
    seq_lens = small if target.device == "interpreter" else large
    q_lens = [n] * len(seq_lens)
    sz = sizes(target)
    x = make_batch(seq_lens, q_lens, **sz)
    y = poison(x)
    dense = call(target, "dense_decode", *attention_args(y), decode_query_len=n)
    out, ids = call(target, "msa_decode", *msa_args(y), decode_query_len=n, topk=sz["topk"])
    ref_out, ref_ids = ref.msa_decode_ref(*msa_args(x), q_lens, topk=sz["topk"])
    assert_close(dense, ref.attention_ref(*attention_args(x), q_lens))
    assert torch.equal(ids, ref_ids)
    assert_close(out, ref_out)
    padding = torch.tensor([s == 0 for s in seq_lens]).repeat_interleave(n)
    assert (dense[padding] == 0).all() and (out[padding] == 0).all()


@pytest.mark.parametrize("target", targets())
def test_stale_cache_rows_never_reach_prefill_outputs(target):
    q_lens = (5, 3, 0, 1) if target.device == "interpreter" else (300, 17, 0, 1)
    prefixes = (195, 0, 0, 300) if target.device == "interpreter" else (4000, 0, 0, 9000)
    seq_lens = [q + p for q, p in zip(q_lens, prefixes)]
    cu = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    sz = sizes(target)
    x = make_batch(seq_lens, q_lens, dtype=torch.bfloat16, **sz)
    y = poison(x)
    dense = call(target, "dense_prefill", *attention_args(y), cu_seqlens_q=cu)
    out, ids = call(target, "msa_prefill", *msa_args(y), cu_seqlens_q=cu, topk=sz["topk"])
    ref_out, ref_ids = ref.msa_decode_ref(*msa_args(x), q_lens, topk=sz["topk"])
    assert_close(dense, ref.attention_ref(*attention_args(x), q_lens), torch.bfloat16)
    assert torch.equal(ids, ref_ids)
    assert_close(out, ref_out, torch.bfloat16)


# -- lengths past the table --------------------------------------------------------------------

@pytest.mark.parametrize("row", ["first", "middle", "last"])
@pytest.mark.parametrize("target", targets())
def test_seq_len_past_the_table_reads_only_its_own_row(target, row):
    """A row whose seq_len exceeds max_blocks * 128 attends over its own pages, as if
    seq_len were max_blocks * 128 (before: the middle row read the next row's pages,
    the last row read past the table)."""
    sz, n = sizes(target), 2
    width, seq_lens = (2, (256, 130, 200)) if target.device == "interpreter" else (16, (2048, 1100, 1500))
    x = make_batch([width * PAGE] * 3, [n] * 3, extra_blocks=0, **sz)   # every entry a page of its row
    long = torch.tensor(seq_lens, dtype=torch.int32)
    long[{"first": 0, "middle": 1, "last": 2}[row]] = 1_000_000
    clamped = dict(x, seq_lens=clamped_lens(long, width))
    y = dict(poison(clamped), seq_lens=long)
    out = call(target, "dense_decode", *attention_args(y), decode_query_len=n)
    assert_close(out, ref.attention_ref(*attention_args(clamped), [n] * 3))
    scores = call(target, "index_scores", y["idx_q"], y["index_k_cache"], y["block_table"], y["seq_lens"],
                  decode_query_len=n)
    want = ref.index_scores_ref(x["idx_q"], x["index_k_cache"], x["block_table"], clamped["seq_lens"], [n] * 3)
    torch.testing.assert_close(scores.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target", targets())
def test_seq_lens_past_the_table_msa_and_prefill(target):
    """Every row past the table: the indexer, the selection and sparse attention agree on
    the clamped length; prefill positions count from it too."""
    sz = sizes(target)
    seq_lens = (300, 1000, 257) if target.device == "interpreter" else (3000, 100_000, 4097)
    width = 2 if target.device == "interpreter" else 16
    x = make_batch([min(s, width * PAGE) for s in seq_lens], [1] * 3, extra_blocks=0, **sz)
    y = dict(poison(x), seq_lens=torch.tensor(seq_lens, dtype=torch.int32))
    out, ids = call(target, "msa_decode", *msa_args(y), decode_query_len=1, topk=sz["topk"])
    ref_out, ref_ids = ref.msa_decode_ref(*msa_args(x), [1] * 3, topk=sz["topk"])
    assert torch.equal(ids, ref_ids)
    assert_close(out, ref_out)
    q_lens = (2, 1, 3)
    xp = make_batch(x["seq_lens"].tolist(), q_lens, extra_blocks=0, seed=1, **sz)
    yp = dict(poison(xp), seq_lens=y["seq_lens"])
    cu = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    out = call(target, "dense_prefill", *attention_args(yp), cu_seqlens_q=cu)
    assert_close(out, ref.attention_ref(*attention_args(xp), q_lens))


# -- NaN / Inf in the queries ------------------------------------------------------------------

def num_splits(*, group, sparse, max_blocks, topk, num_tiles, head_dim, interpret):
    tile = maps.decode_tile(group, 1, sparse, max_blocks=max_blocks, topk=topk, num_requests=num_tiles, num_kv_heads=1,
                            interpret=interpret)
    return tuning.attention(tile=tile, num_tiles=num_tiles, num_kv_heads=1, head_dim=head_dim,
                            topk=topk if sparse else 0, max_blocks=max_blocks, sparse=sparse,
                            interpret=interpret).num_splits


@pytest.mark.parametrize("splits", ["one", "several"])
@pytest.mark.parametrize("target", targets())
def test_nan_or_inf_in_q_gives_nan_rows(target, splits):
    """q NaN in one row, Inf in another: exactly those output rows are NaN; a padding row
    with NaN q stays zero; NaN in idx_q makes that token's visible scores NaN (they lose)."""
    sz = dict(sizes(target), topk=4 if target.device == "interpreter" else 16)
    interpreter = target.device == "interpreter"
    if splits == "one":     # every launch one program per (row tile, KV head)
        seq_lens = (200, 0, 129) if interpreter else (4000, 0, 2000)
        context = tuning.override(target_programs=1, sparse_target_programs=1)
    else:                   # batch 1: split-K with a merge, dense and sparse
        seq_lens = (1100,) if interpreter else (20000,)
        context = contextlib.nullcontext()
    x = make_batch(seq_lens, [1] * len(seq_lens), **sz)
    q, idx_q = x["q"].clone(), x["idx_q"].clone()
    bad = torch.zeros(q.shape[:2], dtype=torch.bool)
    q[0, 0, 3], bad[0, 0] = NAN, True
    q[-1, 2, 0], bad[-1, 2] = INF, True
    idx_q[-1, 0, 5] = NAN
    if 0 in seq_lens:
        q[seq_lens.index(0)] = NAN      # padding: zeros all the same
    y = dict(x, q=q, idx_q=idx_q)
    with context:
        for sparse in (False, True):
            got = num_splits(group=sz["hq"], sparse=sparse, max_blocks=x["block_table"].shape[1], topk=sz["topk"],
                             num_tiles=len(seq_lens), head_dim=sz["d"], interpret=interpreter)
            assert (got == 1) == (splits == "one"), f"sparse={sparse}: {got} splits"
        dense = call(target, "dense_decode", *attention_args(y), decode_query_len=1)
        out, ids = call(target, "msa_decode", *msa_args(y), decode_query_len=1, topk=sz["topk"])
        scores = call(target, "index_scores", idx_q, y["index_k_cache"], y["block_table"], y["seq_lens"],
                      decode_query_len=1)
    q_lens = [1] * len(seq_lens)
    assert_nan_rows(dense, ref.attention_ref(*attention_args(x), q_lens), bad)
    ref_out, ref_ids = ref.msa_decode_ref(*msa_args(dict(x, idx_q=idx_q)), q_lens, topk=sz["topk"])
    assert torch.equal(ids, ref_ids)
    assert_nan_rows(out, ref_out, bad)
    want = ref.index_scores_ref(idx_q, x["index_k_cache"], x["block_table"], x["seq_lens"], q_lens)
    assert want[0, -1].isnan().any()
    torch.testing.assert_close(scores.double(), want, rtol=1e-4, atol=1e-4, equal_nan=True)
    if 0 in seq_lens:
        assert (dense[seq_lens.index(0)] == 0).all() and (out[seq_lens.index(0)] == 0).all()


@pytest.mark.parametrize("target", targets())
def test_nan_q_in_a_prefill_tile_stays_in_its_row(target):
    """Tokens sharing a row tile: only the poisoned token's head is NaN."""
    sz = sizes(target)
    q_lens, prefixes = (5, 3), (195, 0)
    seq_lens = [q + p for q, p in zip(q_lens, prefixes)]
    x = make_batch(seq_lens, q_lens, **sz)
    q = x["q"].clone()
    bad = torch.zeros(q.shape[:2], dtype=torch.bool)
    q[2, 1, 0], bad[2, 1] = NAN, True
    q[5, 0, 1], bad[5, 0] = -INF, True
    cu = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    out = call(target, "dense_prefill", *attention_args(dict(x, q=q)), cu_seqlens_q=cu)
    assert_nan_rows(out, ref.attention_ref(*attention_args(x), q_lens), bad)


@pytest.mark.parametrize("target", targets())
def test_inf_in_q_with_only_minus_inf_scores_is_nan_not_empty(target):
    """+Inf in q against keys that are all negative in that dim: every score is -inf,
    which alone would look like a row that sees nothing (zeros)."""
    x = make_batch((3, 200), [1, 1], **sizes(target))
    page = int(x["block_table"][0, 0])
    x["k_cache"][page, :, :3, 0] = -x["k_cache"][page, :, :3, 0].abs() - 0.5
    x["q"][0, 1] = 0.0
    x["q"][0, 1, 0] = INF
    bad = torch.zeros(x["q"].shape[:2], dtype=torch.bool)
    bad[0, 1] = True
    out = call(target, "dense_decode", *attention_args(x), decode_query_len=1)
    assert_nan_rows(out, ref.attention_ref(*attention_args(dict(x, q=x["q"].nan_to_num(posinf=0.0))), [1, 1]), bad)


# -- M3_VALIDATE=1 ---------------------------------------------------------------------------

def validation_batch():
    """Valid metadata with garbage (-1, huge ids) in every table entry past the visible blocks."""
    x = make_batch((200, 5, 0), [1, 1, 1], hq=2, hk=1, d=16)   # 3 columns, 5 pages
    x["block_table"][0, 2] = -1
    x["block_table"][1, 1:] = 10 ** 6
    x["block_table"][2, :] = -7
    return x


def _dense(x):
    return "dense_decode", attention_args(x), dict(decode_query_len=1)


def _msa(x):
    return "msa_decode", msa_args(x), dict(decode_query_len=1, topk=2)


def _sparse(x):
    ids = torch.tensor([[[0, 1], [0, -1], [-1, -1]]], dtype=torch.int32)
    return "sparse_decode", (x["q"], x["k_cache"], x["v_cache"], x.get("block_ids", ids), x["block_table"],
                             x["seq_lens"]), dict(decode_query_len=1)


def _prefill(x):
    return "dense_prefill", attention_args(x), dict(cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32))


def _select(x):
    scores = torch.randn(1, 3, 3, generator=torch.Generator().manual_seed(0))
    return "select_blocks", (scores, x["seq_lens"]), dict(decode_query_len=1, topk=2)


def _write(x):
    g = torch.Generator().manual_seed(0)
    k, v, ik = torch.randn(3, 1, 16, generator=g), torch.randn(3, 1, 16, generator=g), torch.randn(3, 16, generator=g)
    slots = x.get("slot_mapping", torch.tensor([5, -1, 5 * PAGE - 1], dtype=torch.int32))
    return "write_cache", (k, v, ik, x["k_cache"], x["v_cache"], x["index_k_cache"], slots), {}


def _set(name, index, value):
    def edit(x):
        x = dict(x)
        if name == "block_ids":
            x[name] = _sparse(x)[1][3].clone()
        elif name == "slot_mapping":
            x[name] = _write(x)[1][6].clone()
        else:
            x[name] = x[name].clone()
        x[name][index] = value
        return x
    return edit


BAD_VALUES = {  # name: (op builder, edit, expected message)
    "seq_len_negative": (_dense, _set("seq_lens", 1, -3), r"dense_decode: seq_lens: row 1 is -3, expected 0 <= "),
    "seq_len_past_table": (_dense, _set("seq_lens", 0, 3 * PAGE + 1),
                           r"seq_lens: row 0 is 385, expected 0 <= seq_len <= 384"),
    "page_too_large": (_msa, _set("block_table", (0, 1), 5), r"msa_decode: block_table: row 0, block 1 is 5, "
                                                              r"expected a page id in \[0, 5\)"),
    "page_negative": (_prefill, _set("block_table", (1, 0), -1), r"dense_prefill: block_table: row 1, block 0 is -1"),
    "block_id": (_sparse, _set("block_ids", (0, 1, 1), 3),
                 r"sparse_decode: block_ids: \[kv head 0, token 1, slot 1\] is 3, expected -1 or a block in \[0, 3\)"),
    "select_seq_len": (_select, _set("seq_lens", 2, 385), r"select_blocks: seq_lens: row 2 is 385"),
    "slot_too_large": (_write, _set("slot_mapping", 1, 5 * PAGE),
                       r"write_cache: slot_mapping: token 1 is 640, expected -1 \(skip\) or a value in \[0, 640\)"),
    "slot_below_minus_one": (_write, _set("slot_mapping", 0, -2), r"write_cache: slot_mapping: token 0 is -2"),
}


@functools.cache
def value_checks_wired(framework) -> bool:
    """Does M3_VALIDATE=1 reach the framework's ops? Probed with a harmless bad value (a negative
    length is padding when unchecked), so that the out-of-range ids below are never launched."""
    try:
        call(Target(framework, "interpreter"), "select_blocks", torch.zeros(1, 1, 1),
             torch.tensor([-1], dtype=torch.int32), decode_query_len=1, topk=1)
    except ValueError:
        return True
    return False


def _jitted(op, args, kwargs):
    """``m3_jax.<op>`` under ``jax.jit``, every array argument traced."""
    arrays = [to_jax(a) if isinstance(a, torch.Tensor) else a for a in args]
    kwargs = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}   # host offsets
    return jax.block_until_ready(jax.jit(functools.partial(getattr(m3_jax, op), **kwargs))(*arrays))


@pytest.mark.parametrize("bad", BAD_VALUES)
@pytest.mark.parametrize("mode", ["torch", "jax", "jax-jit"])
def test_m3_validate_names_the_bad_value(mode, bad, monkeypatch):
    monkeypatch.setenv("M3_VALIDATE", "1")
    if not value_checks_wired(mode.removesuffix("-jit")):
        pytest.fail(f"M3_VALIDATE=1 does not reach the {mode} ops (guards.check_call not called)")
    build, edit, message = BAD_VALUES[bad]
    op, args, kwargs = build(edit(validation_batch()))
    if mode == "jax-jit":
        with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=message):
            _jitted(op, args, kwargs)
    else:
        with pytest.raises(ValueError, match=message):
            call(Target(mode, "interpreter"), op, *args, **kwargs)


@pytest.mark.parametrize("mode", ["torch", "jax", "jax-jit"])
def test_m3_validate_accepts_valid_metadata(mode, monkeypatch):
    """Garbage past the visible blocks is never read, so validation lets it pass."""
    x = validation_batch()
    want = call(Target("torch", "interpreter"), "dense_decode", *attention_args(x), decode_query_len=1)
    monkeypatch.setenv("M3_VALIDATE", "1")
    op, args, kwargs = _dense(x)
    if mode == "jax-jit":
        with jax.default_device(jax.devices("cpu")[0]):
            got = to_torch(_jitted(op, args, kwargs))
    else:
        got = call(Target(mode, "interpreter"), op, *args, **kwargs)
    assert torch.equal(got, want)
    op, args, _ = _write(x)
    call(Target(mode.removesuffix("-jit"), "interpreter"), op, *args)


@pytest.mark.parametrize("target", INTERPRETER)
def test_without_m3_validate_negative_lengths_are_padding(target, monkeypatch):
    monkeypatch.setenv("M3_VALIDATE", "0")
    x = make_batch((200, 130), [1, 1], hq=2, hk=1, d=16)
    y = poison(x)
    y["seq_lens"] = torch.tensor([-5, 130], dtype=torch.int32)
    out = call(target, "dense_decode", *attention_args(y), decode_query_len=1)
    scores = call(target, "index_scores", y["idx_q"], y["index_k_cache"], y["block_table"], y["seq_lens"],
                  decode_query_len=1)
    ids = call(target, "select_blocks", scores, y["seq_lens"], decode_query_len=1, topk=2)
    assert (out[0] == 0).all() and (scores[:, 0] == -INF).all() and (ids[:, 0] == -1).all()
    zero = dict(x, seq_lens=torch.tensor([0, 130], dtype=torch.int32))
    assert_close(out, ref.attention_ref(*attention_args(zero), [1, 1]))


# -- the CPU path under concurrency ------------------------------------------------------------

def test_sixteen_msa_decodes_in_one_jit_on_cpu():
    """XLA runs the host callbacks of independent ops concurrently; the interpreted
    launches must not interfere (before: InterpreterError with 16 ops, fine with 1-3)."""
    x = make_batch((100,), [1], hq=2, hk=1, d=16)
    qs = torch.randn(16, *x["q"].shape, generator=torch.Generator().manual_seed(1))
    args = [to_jax(t) for t in msa_args(x)[1:]]

    def step(qs, *args):
        return [m3_jax.msa_decode(qs[i], *args, decode_query_len=1, topk=1)[0] for i in range(len(qs))]

    with jax.default_device(jax.devices("cpu")[0]):
        outs = [to_torch(o) for o in jax.jit(step)(to_jax(qs), *args)]
        one = to_torch(m3_jax.msa_decode(to_jax(qs[7]), *args, decode_query_len=1, topk=1)[0])
    assert torch.equal(outs[7], one)
    for q, out in zip(qs, outs):
        want, _ = ref.msa_decode_ref(q, *msa_args(x)[1:], [1], topk=1)
        assert_close(out, want)


def test_torch_cpu_ops_from_several_threads_match_one_at_a_time():
    batches = [make_batch((130,), [1], hq=2, hk=1, d=16, seed=s) for s in range(3)]

    def ops(x):
        dense = m3_torch.dense_decode(*attention_args(x), decode_query_len=1)
        out, ids = m3_torch.msa_decode(*msa_args(x), decode_query_len=1, topk=1)
        return dense, out.clone(), ids.clone()

    want = [ops(x) for x in batches]
    got = [None] * len(batches)

    def work(i):
        got[i] = ops(batches[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w, g in zip(want, got):
        assert all(torch.equal(a, b) for a, b in zip(w, g))


# -- inference only, integer arguments, pools ---------------------------------------------------

def test_torch_ops_are_inference_only():
    x = make_batch((130,), [1], hq=2, hk=1, d=16)
    q = x["q"].clone().requires_grad_()
    with pytest.raises(RuntimeError, match=r"m3_torch.dense_decode is inference-only .*q requires grad"):
        m3_torch.dense_decode(q, *attention_args(x)[1:], decode_query_len=1)
    with torch.no_grad():
        out = m3_torch.dense_decode(q, *attention_args(x)[1:], decode_query_len=1)
    assert_close(out, ref.attention_ref(*attention_args(x), [1]))
    rest = attention_args(x)[1:]
    with pytest.raises(TypeError, match=r"m3_torch.dense_decode: q comes from a torch.func transform"):
        torch.func.vmap(lambda q: m3_torch.dense_decode(q, *rest, decode_query_len=1))(q.detach()[None])
    with pytest.raises(TypeError, match=r"m3_torch.dense_decode: q comes from a torch.func transform"):
        torch.func.grad(lambda q: m3_torch.dense_decode(q, *rest, decode_query_len=1).sum())(q.detach())


def test_jax_ops_refuse_vmap_and_grad():
    x = {k: to_jax(v) for k, v in make_batch((130,), [1], hq=2, hk=1, d=16).items()}

    def dense(q):
        return m3_jax.dense_decode(q, x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                   decode_query_len=1)

    with jax.default_device(jax.devices("cpu")[0]):
        with pytest.raises(TypeError, match=r"m3_jax.dense_decode: q is a BatchTracer"):
            jax.vmap(dense)(x["q"][None])
        with pytest.raises(TypeError, match=r"m3_jax.dense_decode: q is a \w*Tracer .*jax.jit only"):
            jax.grad(lambda q: dense(q).sum())(x["q"])


def model_kernel_calls(api, rw, bias, w_gate_up, w_down, ids, top_w, rows):
    """One call of each model kernel and ``sample`` (``rows``: its per-row arguments) on ``x [T, H]``,
    the argument a transform wraps."""
    return {
        "rms_norm": lambda x: api.rms_norm(x, x[0], 1e-6),
        "add_rms_norm": lambda x: api.add_rms_norm(x, x, x[0], 1e-6)[1],
        "moe_route": lambda x: api.moe_route(x, rw, bias, 2)[1],
        "fused_moe": lambda x: api.fused_moe(x, w_gate_up, w_down, ids, top_w, swiglu_alpha=1.7, swiglu_limit=7.0),
        "sample": lambda x: api.sample(x, *rows)[1],
    }


def model_kernel_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, generator=g)
    extra = dict(rw=torch.randn(4, 16, generator=g), bias=torch.zeros(4),
                 w_gate_up=torch.randn(4, 32, 16, generator=g), w_down=torch.randn(4, 16, 16, generator=g),
                 ids=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), top_w=torch.full((2, 2), 0.5))
    rows = (torch.ones(2), torch.zeros(2, dtype=torch.int32), torch.ones(2), torch.zeros(2),
            torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    return x, extra, rows


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "moe_route", "fused_moe", "sample"])
def test_torch_model_kernels_are_inference_only(op):
    x, extra, rows = model_kernel_inputs()
    fn = model_kernel_calls(m3_torch, **extra, rows=rows)[op]
    with pytest.raises(RuntimeError, match=rf"m3_torch.{op} is inference-only .* requires grad"):
        fn(x.clone().requires_grad_())
    with pytest.raises(TypeError, match=rf"m3_torch.{op}: \w+ comes from a torch.func transform"):
        torch.func.vmap(fn)(x[None])
    with pytest.raises(TypeError, match=rf"m3_torch.{op}: \w+: expected a torch.Tensor, got ndarray"):
        fn(x.numpy())


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "moe_route", "fused_moe", "sample"])
def test_jax_model_kernels_refuse_vmap_and_grad(op):
    x, extra, rows = model_kernel_inputs()
    with jax.default_device(jax.devices("cpu")[0]):
        fn = model_kernel_calls(m3_jax, **{k: to_jax(v) for k, v in extra.items()},
                                rows=tuple(to_jax(r) for r in rows))[op]
        with pytest.raises(TypeError, match=rf"m3_jax.{op}: \w+ is a BatchTracer"):
            jax.vmap(fn)(to_jax(x)[None])
        with pytest.raises(TypeError, match=rf"m3_jax.{op}: \w+ is a \w*Tracer .*jax.jit only"):
            jax.grad(lambda a: fn(a).astype(jnp.float32).sum())(to_jax(x))
        with pytest.raises(TypeError, match=rf"m3_jax.{op}: \w+: expected a jax array, got Tensor"):
            fn(x)


@pytest.mark.parametrize("target", INTERPRETER)
def test_numpy_integers_are_accepted(target):
    x = make_batch((200, 5), [2, 2], hq=2, hk=1, d=16)
    scores = call(target, "index_scores", x["idx_q"], x["index_k_cache"], x["block_table"], x["seq_lens"],
                  decode_query_len=np.int32(2))
    ids = call(target, "select_blocks", scores, x["seq_lens"], decode_query_len=np.int64(2), topk=np.int32(2),
               init_blocks=np.int64(0), local_blocks=np.int32(1))
    want = ref.select_blocks_ref(scores, x["seq_lens"], [2, 2], topk=2)
    assert torch.equal(ids, want)
    out = call(target, "dense_decode", *attention_args(x), decode_query_len=np.int64(2))
    assert_close(out, ref.attention_ref(*attention_args(x), [2, 2]))


def test_allocate_pool_is_zero_filled_in_both_frameworks():
    layout = PoolLayout.create(3, sparse=[True, False], num_kv_heads=1, head_dim=16, dtype="bfloat16")
    assert (m3_torch.allocate_pool(layout) == 0).all()
    with jax.default_device(jax.devices("cpu")[0]):
        assert not jnp.any(m3_jax.allocate_pool(layout))


# -- GPU only: CUDA graphs -----------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_graph_capture_without_validation_and_refused_with_it(monkeypatch):
    """The unchecked path syncs with nothing (captures); M3_VALIDATE=1 refuses to capture."""
    monkeypatch.delenv("M3_VALIDATE", raising=False)
    sz = sizes(Target("torch", "gpu"))
    x = make_batch((3000, 0, 16384), [1, 1, 1], extra_blocks=0, **sz)
    y = {k: v.cuda() for k, v in poison(x).items()}
    out, _ = m3_torch.msa_decode(*msa_args(y), decode_query_len=1, topk=sz["topk"])   # warm-up (workspaces)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, ids = m3_torch.msa_decode(*msa_args(y), decode_query_len=1, topk=sz["topk"])
    y["seq_lens"].copy_(torch.tensor([2000, 0, 100_000], dtype=torch.int32))   # the last row past the table
    graph.replay()
    torch.cuda.synchronize()
    clamped = dict(x, seq_lens=torch.tensor([2000, 0, 16384], dtype=torch.int32))
    ref_out, ref_ids = ref.msa_decode_ref(*msa_args(clamped), [1, 1, 1], topk=sz["topk"])
    assert torch.equal(ids.cpu(), ref_ids)
    assert_close(out.cpu(), ref_out)
    monkeypatch.setenv("M3_VALIDATE", "1")
    with pytest.raises(RuntimeError, match="M3_VALIDATE=1 .* CUDA-graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            m3_torch.msa_decode(*msa_args(y), decode_query_len=1, topk=sz["topk"])
