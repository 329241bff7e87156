"""The decode test cases, shared by the torch and JAX suites, and input builders.

Cases are small (the CPU runs go through Triton's interpreter) but cover the
edges SPEC.md names: lengths 1/127/128/129/~3000, padding rows, MTP
(decode_query_len 2 and 8), GQA groups 1/4/16, head dims 64/128, all three
float dtypes, NHD caches, forced init blocks.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

PAGE = 128


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    seq_lens: tuple          # per request; 0 = padding row
    n: int = 1               # decode_query_len
    hq: int = 4
    hk: int = 1
    d: int = 64
    di: int = 64
    dtype: str = "bfloat16"
    topk: int = 4
    init_blocks: int = 0
    local_blocks: int = 1
    nhd: bool = False        # K/V stored [pages, 128, Hk, D]

    def __str__(self):
        return self.name

    @property
    def q_lens(self):
        return [self.n] * len(self.seq_lens)


CASES = [
    Case("edges_n1_g4", (1, 127, 128, 129)),
    Case("pad_n2_g1_fp16", (0, 300, 129), n=2, hq=2, hk=2, dtype="float16", topk=2),
    Case("long_n1_g16_d128", (3000, 0), hq=16, hk=1, d=128, di=128, topk=16),
    Case("mtp8_g4_fp32", (1000, 8, 9), n=8, hq=8, hk=2, dtype="float32", topk=3),
    Case("nhd_init_g4", (520, 257), hq=8, hk=2, nhd=True, topk=3, init_blocks=1, local_blocks=1),
]

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOLERANCE = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-3}


def shuffled_block_table(seq_lens, g):
    """-> (block_table [R, max_blocks] int32, num_pages): a random permutation of a
    pool larger than needed; entries past each request's last block hold garbage
    (-1 or out-of-range page ids), which the kernels must never read."""
    num_req = len(seq_lens)
    max_blocks = max(-(-s // PAGE) for s in seq_lens) + 1
    num_pages = num_req * max_blocks + 3
    perm = torch.randperm(num_pages, generator=g).int()
    block_table = perm[:num_req * max_blocks].reshape(num_req, max_blocks).clone()
    for r, s in enumerate(seq_lens):
        used = -(-s // PAGE)
        garbage = torch.randint(-5, 10 * num_pages, (max_blocks - used,), generator=g, dtype=torch.int32)
        garbage[::2] = -1
        block_table[r, used:] = garbage
    return block_table, num_pages


def make_inputs(case: Case, seed: int, device="cpu"):
    """Random inputs (never zeros) for one case, as torch tensors on ``device``.

    The page table is a random permutation of a pool larger than needed; entries
    past each request's last block hold garbage (-1 or out-of-range page ids),
    which the kernels must never read.
    """
    g = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPES[case.dtype]
    num_req = len(case.seq_lens)
    block_table, num_pages = shuffled_block_table(case.seq_lens, g)
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32)
    T = num_req * case.n

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    if case.nhd:
        k_store, v_store = randn(num_pages, PAGE, case.hk, case.d), randn(num_pages, PAGE, case.hk, case.d)
        k_cache, v_cache = k_store.permute(0, 2, 1, 3), v_store.permute(0, 2, 1, 3)
    else:
        k_cache, v_cache = randn(num_pages, case.hk, PAGE, case.d), randn(num_pages, case.hk, PAGE, case.d)
    inputs = dict(
        q=randn(T, case.hq, case.d),
        idx_q=randn(T, case.hk, case.di),
        k_cache=k_cache, v_cache=v_cache,
        index_k_cache=randn(num_pages, PAGE, case.di),
        block_table=block_table, seq_lens=seq_lens,
    )
    return {k: v.to(device) for k, v in inputs.items()}


def random_block_ids(case: Case, seq_lens, seed: int):
    """Valid random selections [Hk, T, topk]: distinct visible blocks ascending, -1 tail."""
    rng = np.random.default_rng(seed)
    T = len(case.seq_lens) * case.n
    ids = np.full((case.hk, T, case.topk), -1, np.int32)
    for t in range(T):
        r, j = divmod(t, case.n)
        kv_len = max(int(seq_lens[r]) - case.n + j + 1, 0)
        nb = -(-kv_len // PAGE)
        for h in range(case.hk):
            k = min(case.topk, nb)
            ids[h, t, :k] = np.sort(rng.choice(nb, size=k, replace=False)) if k else []
    return torch.from_numpy(ids)


def rel_err(out, ref):
    out = out.double().cpu()
    ref = ref.double().cpu()
    if torch.isnan(out).any():
        return float("inf")
    denom = ref.norm()
    return float((out - ref).norm() / (denom if denom > 0 else 1.0))
