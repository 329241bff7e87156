"""Every public op of a framework on small CPU inputs (the layering and backend-switch tests)."""

from __future__ import annotations

import torch

from m3_kernels import planner

R, N, HQ, HK, D, PAGES, TOPK = 2, 2, 4, 2, 16, 6, 2


def inputs():
    g = torch.Generator().manual_seed(0)
    x = dict(q=torch.randn(R * N, HQ, D, generator=g), idx_q=torch.randn(R * N, HK, D, generator=g),
             k_cache=torch.randn(PAGES, HK, 128, D, generator=g), v_cache=torch.randn(PAGES, HK, 128, D, generator=g),
             index_k_cache=torch.randn(PAGES, 128, D, generator=g),
             block_table=torch.arange(R * 3, dtype=torch.int32).reshape(R, 3),
             seq_lens=torch.tensor([200, 300], dtype=torch.int32),
             block_ids=torch.tensor([[[0, 1]] * R * N] * HK, dtype=torch.int32),
             scores=torch.randn(HK, R * N, 3, generator=g),
             cu_seqlens_q=torch.tensor([0, N, 2 * N], dtype=torch.int32),
             slot_mapping=torch.tensor([5, 7, 300, -1], dtype=torch.int32))
    return x


def public_calls(m, x):
    """(name, thunk) of every public op of framework module ``m`` on the inputs ``x``."""
    q, iq, k, v, ik, bt, sl, ids, sc, cu, slots = (x[n] for n in ("q", "idx_q", "k_cache", "v_cache",
                                                                  "index_k_cache", "block_table", "seq_lens",
                                                                  "block_ids", "scores", "cu_seqlens_q",
                                                                  "slot_mapping"))
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
        ("write_cache", lambda: m.write_cache(q[:, :HK], q[:, :HK], iq[:, 0], k, v, ik, slots)),
    ]
