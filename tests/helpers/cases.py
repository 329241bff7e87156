"""The one case list of the op tests (decode and prefill), and the input builders.

A case is a batch: per-request query lengths ``q_lens`` and KV lengths
``seq_lens`` (new tokens included). Decode cases are ``q_lens = [n] * R`` and
run through the ``*_decode`` ops with ``decode_query_len = n``; prefill cases
run through the ``*_prefill`` ops with ``cu_seqlens_q``. Both follow SPEC.md's
position rule: token j of a request with q_len tokens sits at
``seq_len - q_len + j`` and sees nothing when that is negative.

The CPU cases are small (Triton's interpreter runs them) but cover the edges
SPEC.md names: lengths 1/127/128/129/~3000, padding rows (``seq_len = 0``) and
tokens that see nothing (``q_len > seq_len``), MTP n = 2 and 8, GQA groups
1/4/16, head dims 64/128, bf16/fp16/fp32, NHD caches and pool views, forced
init blocks, chunked prefill (``seq_len > q_len``), FP8 caches (float8_e4m3fn
K/V with per-layer scales, index-K, both, an FP8 index query; in byte pools).
``GPU_CASES`` add MiniMax-M3 shapes (64 query / 4 KV heads, D = Di = 128, topk
16, 16k context) that only the GPU runs.

Every builder draws random data (never zeros) from a seed; page tables are a
random permutation of a pool larger than needed, with garbage (-1 or
out-of-range page ids) past each request's blocks, which no kernel may read.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import numpy as np
import torch

PAGE = 128
E4M3 = "float8_e4m3fn"
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                E4M3: torch.float8_e4m3fn}
ITEM_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4, E4M3: 1}
TOLERANCE = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-3}   # SPEC.md, "Numerics"
KV_LAYOUTS = ("HND", "NHD", "pool")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple            # query tokens per request
    seq_lens: tuple          # KV length per request, its new tokens included; 0 = padding row
    decode: bool             # True: *_decode ops (q_lens all equal); False: *_prefill ops
    hq: int = 4
    hk: int = 1              # = Hi
    d: int = 64
    di: int = 64
    dtype: str = "bfloat16"
    topk: int = 4
    init_blocks: int = 0
    local_blocks: int = 1
    kv_layout: str = "HND"   # "NHD": K/V stores [pages, 128, Hk, D]; "pool": views into one flat pool
    one_program: bool = False  # interpreter: one program per row tile (tuning.override), no split-K
    slow: bool = False       # behind the `slow` marker (CI still runs it)
    gpu_only: bool = False   # MiniMax-M3 shapes: too slow for the interpreter
    strided: bool = False    # torch: q / idx_q with stride 2 along the head dim, outputs in transposed buffers
    num_context: int = -1    # a mixed step (msa_attention_step): the first rows are context rows
    kv_dtype: str = "auto"   # E4M3: FP8 K/V caches, stored = saturate(x / scale)
    index_dtype: str = "auto"  # E4M3: FP8 index-K cache (unscaled)
    fp8_idx_q: bool = False  # idx_q in E4M3 too (needs an E4M3 index-K cache)
    kv_scales: tuple | None = None  # FP8 K/V: (k_scale, v_scale) the ops get; None: their default (1.0)

    def __post_init__(self):
        assert len(self.q_lens) == len(self.seq_lens), self.name
        assert not self.decode or len(set(self.q_lens)) == 1, self.name
        assert self.kv_layout in KV_LAYOUTS, self.name
        assert not self.fp8_idx_q or self.index_dtype == E4M3, self.name
        assert not (self.strided and self.fp8_idx_q), self.name

    def __str__(self):
        return self.name

    @property
    def n(self) -> int:
        """decode_query_len of a decode case."""
        assert self.decode, self.name
        return self.q_lens[0]

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def cu_seqlens(self) -> list:
        return [0, *np.cumsum(self.q_lens).tolist()]

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode())

    @property
    def kv_lens(self) -> list:
        """KV length each query token sees (the position rule), request-major."""
        return [max(s - q + j + 1, 0) for q, s in zip(self.q_lens, self.seq_lens) for j in range(q)]

    @property
    def fp8(self) -> bool:
        """Any FP8 cache."""
        return E4M3 in (self.kv_dtype, self.index_dtype)

    @property
    def cache_dtypes(self) -> tuple:
        """(K/V cache dtype, index-K cache dtype): "auto" resolved to the case's dtype."""
        return tuple(self.dtype if x == "auto" else x for x in (self.kv_dtype, self.index_dtype))

    @property
    def scales(self) -> tuple:
        """(k_scale, v_scale) the caches were quantised with, as float32 values (1.0: a default or non-FP8 cache)."""
        return tuple(float(np.float32(s)) for s in self.kv_scales or (1.0, 1.0))

    @property
    def empty_tokens(self) -> list:
        """Tokens that see nothing (padding rows, ``q_len > seq_len``): zero output, all -1 ids."""
        return [t for t, kv in enumerate(self.kv_lens) if kv == 0]


def decode(name, seq_lens, n=1, **kw) -> Case:
    return Case(name, (n,) * len(seq_lens), tuple(seq_lens), decode=True, **kw)


def prefill(name, q_lens, seq_lens, **kw) -> Case:
    return Case(name, tuple(q_lens), tuple(seq_lens), decode=False, **kw)


def step(name, q_lens, seq_lens, num_context, **kw) -> Case:
    """A mixed step: ``num_context`` context rows, then generation rows (one query length)."""
    return Case(name, tuple(q_lens), tuple(seq_lens), decode=False, num_context=num_context, **kw)


CASES = [
    # -- decode: q_lens = [n] * R
    decode("edges_n1_g4", (1, 127, 128, 129), strided=True),
    decode("pad_n2_g1_fp16", (0, 300, 129), n=2, hq=2, hk=2, dtype="float16", topk=2),
    decode("long_n1_g16_d128", (3000, 0), hq=16, d=128, di=128, topk=16),
    decode("mtp8_g4_fp32", (1000, 8, 9), n=8, hq=8, hk=2, dtype="float32", topk=3),
    decode("nhd_init_g4", (520, 257), hq=8, hk=2, kv_layout="NHD", topk=3, init_blocks=1),
    decode("pool_n2_g2", (300, 129, 0), n=2, hq=4, hk=2, kv_layout="pool", topk=2),
    # -- prefill: chunks (seq_len > q_len), varlen, empty requests
    prefill("varlen_300_5_1", (300, 5, 1), (557, 205, 1), hq=2, d=16, di=16, dtype="float32",
            one_program=True, slow=True),
    prefill("gqa_bf16_nhd_init", (5, 0, 17, 1), (205, 0, 146, 1001), hq=4, hk=2, d=32, di=32, topk=3,
            init_blocks=1, kv_layout="NHD", strided=True),
    prefill("chunk_fp16_g4", (40, 3), (600, 4), d=16, di=16, dtype="float16"),
    # non-GQA; request 0's first 3 tokens and all of request 2 (a padding row with tokens) see nothing
    prefill("kv0_g1_pool", (7, 2, 3), (4, 131, 0), hq=2, hk=2, d=16, di=16, topk=2, kv_layout="pool"),
    # -- FP8 caches: K/V (scaled, in a byte pool beside a bf16 index-K), index-K, both (+ an FP8 index query)
    decode("fp8_kv_pool_n2", (300, 129, 0), n=2, hq=4, hk=2, d=16, di=16, topk=2, kv_layout="pool",
           kv_dtype=E4M3, kv_scales=(0.02, 0.01)),
    prefill("fp8_index_fp16_nhd", (3, 9, 1), (130, 9, 640), hq=4, hk=2, d=16, di=16, topk=3, dtype="float16",
            kv_layout="NHD", index_dtype=E4M3),
    prefill("fp8_both_fp32_pool", (7, 2, 3), (4, 131, 0), hq=2, hk=2, d=16, di=16, topk=2, dtype="float32",
            kv_layout="pool", kv_dtype=E4M3, index_dtype=E4M3, fp8_idx_q=True),
]

M3 = dict(hq=64, hk=4, d=128, di=128, topk=16, gpu_only=True)
TP8 = dict(hq=8, hk=1, d=128, di=128, topk=16, gpu_only=True)   # one tensor-parallel rank of M3
GPU_CASES = [
    decode("m3_n1", (1, 127, 128, 129, 3000, 0, 2049, 16384), **M3),
    decode("m3_n2_nhd_strided", (1, 127, 128, 129, 3000, 0, 2049, 5000), n=2, kv_layout="NHD", strided=True, **M3),
    decode("m3_n8_pool", (16384, 0, 129, 8, 2049), n=8, kv_layout="pool", **M3),
    decode("tp8_fp16", (700, 129, 4000), dtype="float16", **TP8),
    decode("tp8_fp32", (700, 129, 16384), dtype="float32", **TP8),
    prefill("m3_prefill", (300, 128, 5, 1, 0, 16), (1300, 129, 205, 1, 0, 16384), **M3),
    prefill("m3_prefill_fp16_nhd", (300, 128, 5, 1, 4, 64), (1300, 129, 205, 1, 2, 3064), dtype="float16",
            kv_layout="NHD", **M3),
    # FP8 caches at M3 shapes
    decode("m3_fp8_kv_n1", (1, 127, 128, 129, 3000, 0, 2049, 16384), kv_dtype=E4M3, kv_scales=(0.02, 0.01), **M3),
    decode("m3_fp8_both_n2_pool", (1, 127, 128, 129, 3000, 0, 2049, 5000), n=2, kv_layout="pool", kv_dtype=E4M3,
           index_dtype=E4M3, kv_scales=(0.05, 0.02), **M3),
    decode("tp8_fp8_index_fp16", (700, 129, 4000), dtype="float16", index_dtype=E4M3, **TP8),
    prefill("m3_fp8_prefill_nhd", (300, 128, 5, 1, 0, 16), (1300, 129, 205, 1, 0, 16384), kv_layout="NHD",
            kv_dtype=E4M3, index_dtype=E4M3, fp8_idx_q=True, kv_scales=(0.03, 0.01), **M3),
]

# mixed steps: context rows first, generation rows (one query length) last, a padding row at the end
STEP_CASES = [
    step("mixed_n2", (20, 5, 2, 2, 2, 2), (220, 1005, 300, 129, 2, 0), num_context=2, hq=2, d=16, di=16,
         dtype="float32", topk=3),
    step("context_only", (3, 4, 1), (133, 4, 0), num_context=3, hq=2, d=16, di=16, dtype="float32", topk=3),
    step("generation_only", (1, 1, 1), (131, 1, 0), num_context=0, hq=2, d=16, di=16, dtype="float32", topk=3),
    # the generation span's attention launch has one split, so it selects into block_ids[:, 25:] itself (2 KV heads)
    step("mixed_hk2_one_split", (20, 5, 1, 1, 1), (220, 1005, 300, 1300, 0), num_context=2, hq=4, hk=2, d=16,
         di=16, dtype="float32", topk=3, one_program=True),
    step("m3_mixed_n2", (300, 64, 2, 2, 2, 2), (1300, 64, 5002, 129, 3, 0), num_context=2, **M3),
    step("fp8_mixed", (4, 1, 1), (133, 140, 0), num_context=1, hq=2, d=16, di=16, topk=3,
         kv_dtype=E4M3, index_dtype=E4M3, kv_scales=(0.02, 0.03)),
    step("m3_fp8_mixed_n2", (300, 64, 2, 2, 2, 2), (1300, 64, 5002, 129, 3, 0), num_context=2, kv_dtype=E4M3,
         index_dtype=E4M3, kv_scales=(0.02, 0.01), **M3),
]

ALL_CASES = CASES + GPU_CASES

# The MSA ops select each token's blocks inside the attention launch when it has one-token tiles and
# one split (m3_kernels.launches.Selection). The interpreter splits these small batches, so these
# copies run with one program per row tile; batch 32 at M3 shapes has one split on a GPU. The prefill
# case's tiles hold one token (its tokens would share few of their 12 blocks: maps.prefill_tile_kind).
ONE_SPLIT_CASES = [dataclasses.replace(c, name=f"{c.name}_one_split", one_program=True) for c in CASES
                   if c.name in ("edges_n1_g4", "pad_n2_g1_fp16", "nhd_init_g4", "fp8_kv_pool_n2")] + [
    prefill("token_tiles_one_split", (3, 2, 1), (1300, 1500, 0), hq=4, hk=2, d=16, di=16, topk=2, one_program=True),
    decode("m3_n1_batch32", (1, 127, 128, 129, 3000, 0, 2049, 16384) * 4, **M3)]


# -- inputs --------------------------------------------------------------------------------

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


@dataclasses.dataclass(frozen=True)
class PoolView:
    """A cache as a strided view of a flat pool: ``pool.view(dtype)[offset + sum(i * stride)]``."""
    offset: int
    shape: tuple
    strides: tuple
    dtype: str


def pool_layout(num_pages, hk, d, di, lead=16, kv_dtype="bfloat16", index_dtype="bfloat16"):
    """Two layers per slot, the caches of layer 1 used: K sub-page [Hk, 128, D] (HND), V sub-page
    [128, Hk, D] (NHD), index-K sub-page [128, Di]; the pool starts ``lead`` elements (of the wider
    cache dtype) in. A pool with an FP8 cache is bytes; offsets and strides count each cache's elements.
    -> (pool numel, k, v, index_k PoolViews)."""
    kv_size, ik_size = ITEM_SIZE[kv_dtype], ITEM_SIZE[index_dtype]
    unit = 1 if E4M3 in (kv_dtype, index_dtype) else kv_size       # the pool's element size
    kv, ik = hk * PAGE * d * kv_size, PAGE * di * ik_size           # bytes of a sub-page
    slot = 2 * (2 * kv + ik)
    lead *= max(kv_size, ik_size)
    base = lead + 2 * kv + ik
    shape = (num_pages, hk, PAGE, d)
    k = PoolView(base // kv_size, shape, (slot // kv_size, PAGE * d, d, 1), kv_dtype)
    v = PoolView((base + kv) // kv_size, shape, (slot // kv_size, d, hk * d, 1), kv_dtype)
    index_k = PoolView((base + 2 * kv) // ik_size, (num_pages, PAGE, di), (slot // ik_size, di, 1), index_dtype)
    return (lead + num_pages * slot) // unit, k, v, index_k


def quantise(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """torch's own saturating FP8 cast: ``saturate(x / scale)`` as float8_e4m3fn, rounded to nearest even."""
    return (x.float() / torch.tensor(scale, dtype=torch.float32)).clamp(-448, 448).to(torch.float8_e4m3fn)


@functools.cache
def make_inputs(case: Case, device: str = "cpu") -> dict:
    """A case's random inputs as torch tensors on ``device`` (memoized: never modify them).

    q [T, Hq, D], idx_q [T, Hk, Di], k_cache/v_cache [pages, Hk, 128, D] (HND
    order whatever the storage: NHD stores and pool views are permuted/strided
    views), index_k_cache [pages, 128, Di], block_table [R, max_blocks] and
    seq_lens [R] int32, cu_seqlens_q [R + 1] int32; ``pool`` is the flat buffer
    of a "pool" case (elsewhere NaN: read by no kernel). FP8 caches hold random
    data quantised with the case's scales (``quantise``).
    """
    g = torch.Generator().manual_seed(case.seed)
    dtype = TORCH_DTYPES[case.dtype]
    block_table, num_pages = shuffled_block_table(case.seq_lens, g)
    kv_dtype, index_dtype = case.cache_dtypes
    k_scale, v_scale = case.scales

    def randn(*shape, cache=None, scale=1.0):
        x = torch.randn(*shape, generator=g).to(dtype)
        return (quantise(x, scale) if cache == E4M3 else x).to(device)

    def kv(*shape, scale):
        return randn(*shape, cache=kv_dtype, scale=scale)

    x = dict(q=randn(case.num_tokens, case.hq, case.d),
             idx_q=randn(case.num_tokens, case.hk, case.di, cache=E4M3 if case.fp8_idx_q else None))
    if case.kv_layout == "pool":
        numel, *views = pool_layout(num_pages, case.hk, case.d, case.di, kv_dtype=kv_dtype, index_dtype=index_dtype)
        if E4M3 in (kv_dtype, index_dtype):   # bytes: 0xFF is NaN as float8_e4m3fn and as bf16 / fp16 / fp32
            pool = torch.full((numel,), 0xFF, dtype=torch.uint8, device=device)
        else:
            pool = torch.full((numel,), torch.nan, dtype=dtype, device=device)
        data = (kv(*views[0].shape, scale=k_scale), kv(*views[1].shape, scale=v_scale),
                randn(*views[2].shape, cache=index_dtype))
        for name, view, values in zip(("k_cache", "v_cache", "index_k_cache"), views, data):
            x[name] = pool.view(TORCH_DTYPES[view.dtype]).as_strided(view.shape, view.strides, view.offset)
            x[name].copy_(values)
        x["pool"] = pool
    else:
        if case.kv_layout == "NHD":
            k = kv(num_pages, PAGE, case.hk, case.d, scale=k_scale).permute(0, 2, 1, 3)
            v = kv(num_pages, PAGE, case.hk, case.d, scale=v_scale).permute(0, 2, 1, 3)
        else:
            k = kv(num_pages, case.hk, PAGE, case.d, scale=k_scale)
            v = kv(num_pages, case.hk, PAGE, case.d, scale=v_scale)
        x.update(k_cache=k, v_cache=v, index_k_cache=randn(num_pages, PAGE, case.di, cache=index_dtype))
    x["block_table"] = block_table.to(device)
    x["seq_lens"] = torch.tensor(case.seq_lens, dtype=torch.int32, device=device)
    x["cu_seqlens_q"] = torch.tensor(case.cu_seqlens, dtype=torch.int32, device=device)
    return x


@functools.cache
def random_block_ids(case: Case) -> torch.Tensor:
    """Valid selections [Hk, T, topk] int32 (CPU): the token's last visible block and random
    other visible blocks, distinct, ascending, then -1."""
    rng = np.random.default_rng(case.seed)
    ids = np.full((case.hk, case.num_tokens, case.topk), -1, np.int32)
    for t, kv_len in enumerate(case.kv_lens):
        nb = -(-kv_len // PAGE)
        k = min(case.topk, nb)
        for h in range(case.hk if k else 0):
            others = rng.choice(nb - 1, size=k - 1, replace=False)
            ids[h, t, :k] = np.sort(np.append(others, nb - 1))
    return torch.from_numpy(ids)


def rel_err(out, ref) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN anywhere -> inf."""
    out, ref = out.double().cpu(), ref.double().cpu()
    if torch.isnan(out).any():
        return float("inf")
    denom = ref.norm()
    return float((out - ref).norm() / (denom if denom > 0 else 1.0))
