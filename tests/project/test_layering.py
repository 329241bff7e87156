"""The launch layer's shape: every public op reaches its kernel launch within three of our
own Python frames, in both frameworks, and validates its arguments once per call.

Kernels are replaced by recorders here (nothing is computed), so this runs in
a second; what the kernels compute is the other test files' business.
"""

import inspect
import os

import numpy as np
import pytest
import torch

import m3_jax
import m3_torch
from m3_kernels import planner, validate

ROOTS = tuple(os.path.dirname(m.__file__) + os.sep for m in (m3_torch, m3_jax, validate))
R, N, HQ, HK, D, PAGES, TOPK = 2, 2, 4, 2, 16, 6, 2


def our_frames():
    """Frames of the project's own packages on the current stack (this recorder excluded)."""
    return [f for f in inspect.stack()[2:] if f.filename.startswith(ROOTS)]


@pytest.fixture
def record(monkeypatch):
    """-> {"launches": [(kernel, our frames)], "checks": count}; kernels and JAX calls are recorders."""
    seen = {"launches": [], "checks": 0, "depth": 0}

    class FakeKernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen["launches"].append((self.name, our_frames()))
            return launch

    class FakeModule:
        def __getattr__(self, name):
            return FakeKernel(name)

    def fake_jax_call(args, module, fn, shapes, *rest):
        seen["launches"].append((fn, our_frames()))
        return [np.zeros(s.shape, s.dtype) for s in shapes]

    monkeypatch.setattr(m3_torch.ops, "kernel_module", lambda module, interpret: FakeModule())
    monkeypatch.setattr(m3_jax.ops, "cpu_call", fake_jax_call)
    for name in dir(validate):
        if name.startswith("check_") and (name.endswith("_call") or name == "check_cache_write"):
            original = getattr(validate, name)

            def counted(*args, _original=original, **kwargs):
                seen["checks"] += seen["depth"] == 0   # a check composed of others counts once
                seen["depth"] += 1
                try:
                    return _original(*args, **kwargs)
                finally:
                    seen["depth"] -= 1
            monkeypatch.setattr(validate, name, counted)
    return seen


def inputs():
    g = torch.Generator().manual_seed(0)
    x = dict(q=torch.randn(R * N, HQ, D, generator=g), idx_q=torch.randn(R * N, HK, D, generator=g),
             k_cache=torch.randn(PAGES, HK, 128, D, generator=g), v_cache=torch.randn(PAGES, HK, 128, D, generator=g),
             index_k_cache=torch.randn(PAGES, 128, D, generator=g),
             block_table=torch.arange(R * 3, dtype=torch.int32).reshape(R, 3),
             seq_lens=torch.tensor([200, 300], dtype=torch.int32),
             block_ids=torch.tensor([[[0, 1]] * R * N] * HK, dtype=torch.int32),
             scores=torch.randn(HK, R * N, 3, generator=g),
             cu_seqlens_q=torch.tensor([0, N, 2 * N], dtype=torch.int32))
    return x


def public_calls(m, x):
    """(name, thunk) of every public op of framework module ``m`` on the inputs ``x``."""
    q, iq, k, v, ik, bt, sl, ids, sc, cu = (x[n] for n in ("q", "idx_q", "k_cache", "v_cache", "index_k_cache",
                                                         "block_table", "seq_lens", "block_ids", "scores",
                                                         "cu_seqlens_q"))
    dec, pre = dict(decode_query_len=N), dict(cu_seqlens_q=cu)
    cfg = planner.StepConfig(num_q_heads=HQ, num_kv_heads=HK, head_dim=D, max_batch=4, max_num_tokens=8, max_blocks=3,
                             topk=TOPK)
    plan = planner.StepPlanner(cfg).plan([200, 300], q_lens=[N, N], num_context=1)
    return [
        ("index_scores", lambda: m.index_scores(iq, ik, bt, sl, **dec)),
        ("select_blocks", lambda: m.select_blocks(sc, sl, topk=TOPK, **dec)),
        ("sparse_decode", lambda: m.sparse_decode(q, k, v, ids, bt, sl, **dec)),
        ("dense_decode", lambda: m.dense_decode(q, k, v, bt, sl, **dec)),
        ("msa_decode", lambda: m.msa_decode(q, iq, k, v, ik, bt, sl, topk=TOPK, **dec)),
        ("index_scores_prefill", lambda: m.index_scores_prefill(iq, ik, bt, sl, **pre)),
        ("select_blocks_prefill", lambda: m.select_blocks_prefill(sc, sl, topk=TOPK, **pre)),
        ("sparse_prefill", lambda: m.sparse_prefill(q, k, v, ids, bt, sl, **pre)),
        ("dense_prefill", lambda: m.dense_prefill(q, k, v, bt, sl, **pre)),
        ("msa_prefill", lambda: m.msa_prefill(q, iq, k, v, ik, bt, sl, topk=TOPK, **pre)),
        ("msa_attention_step", lambda: m.msa_attention_step(q, iq, k, v, ik, bt, sl, plan=plan)),
        ("write_cache", lambda: m.write_cache(q[:, :HK], q[:, :HK], iq[:, 0], k, v, ik,
                                              torch.tensor([5, 7, 300, -1], dtype=torch.int32))),
    ]


def to_jax(x):
    return {n: np.asarray(t) for n, t in x.items()}


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_three_frames_to_a_launch_and_one_validation_per_call(record, framework):
    m = m3_torch if framework == "torch" else m3_jax
    x = inputs() if framework == "torch" else to_jax(inputs())
    for name, call in public_calls(m, x):
        record["launches"].clear()
        record["checks"] = 0
        call()
        assert record["launches"], f"{framework} {name}: launched no kernel"
        for kernel, frames in record["launches"]:
            where = [f"{os.path.relpath(f.filename)}:{f.function}" for f in frames]
            assert len(frames) <= 3, f"{framework} {name} -> {kernel}: {len(frames)} frames of ours: {where}"
        assert record["checks"] == 1, f"{framework} {name}: {record['checks']} validations"
