"""Prefill / mixed-step test cases shared by the torch and JAX suites, and input builders.

Varlen batches cover query lengths 1, 5, 128, 300 (and 0: a padding request),
cached prefixes 0, 1, 200, 1000 (chunked prefill: ``seq_len > q_len``), GQA
groups 1/2/4, three float dtypes, NHD caches and forced init blocks. Head
counts and dims stay small: the CPU runs go through Triton's interpreter.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cases import PAGE, TORCH_DTYPES, shuffled_block_table


@dataclasses.dataclass(frozen=True)
class PrefillCase:
    name: str
    q_lens: tuple            # query tokens per request (0 = padding request)
    prefixes: tuple          # tokens already cached per request
    hq: int = 2
    hk: int = 1
    d: int = 16
    di: int = 16
    dtype: str = "float32"
    topk: int = 4
    init_blocks: int = 0
    local_blocks: int = 1
    nhd: bool = False        # K/V stored [pages, 128, Hk, D]
    few_programs: bool = False  # CPU: launch with a small program target (no split-K), see test files

    def __str__(self):
        return self.name

    @property
    def seq_lens(self):
        return tuple(q + p for q, p in zip(self.q_lens, self.prefixes))

    @property
    def cu_seqlens(self):
        return [0, *np.cumsum(self.q_lens).tolist()]

    @property
    def num_tokens(self):
        return int(sum(self.q_lens))


BIG = PrefillCase("varlen_300_128_5_1", (300, 128, 5, 1), (1000, 1, 200, 0), few_programs=True)
GQA = PrefillCase("gqa_bf16_nhd_init", (5, 0, 17, 1), (200, 0, 129, 1000), hq=4, hk=2, d=32, dtype="bfloat16",
                  topk=3, init_blocks=1, nhd=True)
FP16 = PrefillCase("chunk_fp16_g4", (40, 3), (1000, 1), hq=4, hk=1, dtype="float16")

PREFILL_CASES = [BIG, GQA]   # every op
MSA_CASES = [GQA, FP16]      # the fused index -> select -> attention path


def make_prefill_inputs(case: PrefillCase, seed: int, device="cpu"):
    """Random inputs (never zeros) as torch tensors; ``cu_seqlens_q`` int32 ``[R + 1]``.

    Page-table entries past each request's last block hold garbage (-1 or
    out-of-range ids), which the kernels must never read.
    """
    g = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPES[case.dtype]
    block_table, num_pages = shuffled_block_table(case.seq_lens, g)
    T = case.num_tokens

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    if case.nhd:
        k_cache = randn(num_pages, PAGE, case.hk, case.d).permute(0, 2, 1, 3)
        v_cache = randn(num_pages, PAGE, case.hk, case.d).permute(0, 2, 1, 3)
    else:
        k_cache, v_cache = randn(num_pages, case.hk, PAGE, case.d), randn(num_pages, case.hk, PAGE, case.d)
    inputs = dict(
        q=randn(T, case.hq, case.d), idx_q=randn(T, case.hk, case.di),
        k_cache=k_cache, v_cache=v_cache, index_k_cache=randn(num_pages, PAGE, case.di),
        block_table=block_table, seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor(case.cu_seqlens, dtype=torch.int32),
    )
    return {k: v.to(device) for k, v in inputs.items()}


def token_kv_lens(seq_lens, q_lens):
    """KV length each query token sees (position rule), request-major."""
    return [max(int(s) - q + j + 1, 0) for s, q in zip(seq_lens, q_lens) for j in range(q)]


def random_block_ids(hk, topk, seq_lens, q_lens, seed):
    """Valid selections [Hk, T, topk]: the token's own last (diagonal) block, random other
    visible blocks, ascending, -1 tail."""
    rng = np.random.default_rng(seed)
    kv = token_kv_lens(seq_lens, q_lens)
    ids = np.full((hk, len(kv), topk), -1, np.int32)
    for t, kv_len in enumerate(kv):
        nb = -(-kv_len // PAGE)
        for h in range(hk):
            k = min(topk, nb)
            if k:
                others = rng.choice(nb - 1, size=k - 1, replace=False) if k > 1 else []
                ids[h, t, :k] = np.sort(np.append(others, nb - 1))
    return torch.from_numpy(ids)
