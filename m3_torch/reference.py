"""Plain-torch float64 references for every op (slow; for tests and demos).

They follow SPEC.md literally: gather each token's visible positions from the
page table, compute in float64, one request at a time. Token positions come
from per-request query lengths, so decode (``q_lens = [n] * R``) and prefill
(``q_lens`` from ``cu_seqlens_q``) share them.
"""

from __future__ import annotations

import math

import torch

PAGE_SIZE = 128


def token_positions(seq_lens, q_lens):
    """-> list of (request, position) per query token, request-major."""
    out = []
    for r, (seq_len, q_len) in enumerate(zip(seq_lens.tolist(), q_lens)):
        out.extend((r, seq_len - q_len + j) for j in range(q_len))
    return out


def _scale(scale) -> float:
    """A K/V scale (None, float or one-element tensor) as a Python float."""
    return 1.0 if scale is None else float(scale.reshape(()) if isinstance(scale, torch.Tensor) else scale)


def _gather(cache, block_table, r, num_blocks, scale=None):
    """Request r's first blocks as float64 token rows on the CPU (times ``scale``: FP8 K/V).

    index-K [pages, 128, Di] -> [nb*128, Di]; K/V [pages, Hk, 128, D] -> [nb*128, Hk, D].
    """
    pages = block_table[r, :num_blocks].long().to(cache.device)
    rows = cache[pages].double().cpu() * _scale(scale)
    if rows.dim() == 4:
        rows = rows.permute(0, 2, 1, 3)
    return rows.reshape(num_blocks * PAGE_SIZE, *rows.shape[2:])


class _Rows:
    """``_gather`` once per request (at its last token's length); each token slices its prefix.
    A prefill token then costs its dot products, not a gather of its whole context. Tokens
    come request by request, so only the current request's rows are kept."""

    def __init__(self, cache, block_table, seq_lens, scale=None):
        self.args, self.scale, self.request, self.rows = (cache, block_table), scale, None, None
        width = block_table.shape[1]
        self.blocks = [min(-(-max(int(s), 0) // PAGE_SIZE), width) for s in seq_lens.tolist()]

    def __call__(self, r, num_blocks):
        if r != self.request or self.rows.shape[0] < num_blocks * PAGE_SIZE:
            self.request = r
            self.rows = _gather(*self.args, r, max(self.blocks[r], num_blocks), self.scale)
        return self.rows[:num_blocks * PAGE_SIZE]


def index_scores_ref(idx_q, index_k_cache, block_table, seq_lens, q_lens):
    num_heads, max_blocks = idx_q.shape[1], block_table.shape[1]
    scores = torch.full((num_heads, idx_q.shape[0], max_blocks), -math.inf, dtype=torch.float64)
    index_rows = _Rows(index_k_cache, block_table, seq_lens)
    for t, (r, pos) in enumerate(token_positions(seq_lens, q_lens)):
        kv_len = max(pos + 1, 0)
        if kv_len == 0:
            continue
        nb = -(-kv_len // PAGE_SIZE)
        keys = index_rows(r, nb)                                        # [nb*128, Di]
        dots = idx_q[t].double().cpu() @ keys.T                         # [Hi, nb*128]
        dots[:, kv_len:] = -math.inf
        scores[:, t, :nb] = dots.reshape(num_heads, nb, PAGE_SIZE).amax(-1)
    return scores


def select_blocks_ref(scores, seq_lens, q_lens, topk=16, init_blocks=0, local_blocks=1):
    scores = scores.double().cpu()
    num_heads, num_tokens, _ = scores.shape
    ids = torch.full((num_heads, num_tokens, topk), -1, dtype=torch.int32)
    for t, (r, pos) in enumerate(token_positions(seq_lens, q_lens)):
        nb = -(-max(pos + 1, 0) // PAGE_SIZE)
        for i in range(num_heads):
            forced = {b for b in range(nb) if b < init_blocks or b >= nb - local_blocks}
            row = scores[i, t].tolist()
            # highest score first, NaN last, ties -> lower id
            rest = sorted((b for b in range(nb) if b not in forced),
                          key=lambda b: (math.isnan(row[b]), -row[b] if not math.isnan(row[b]) else 0.0, b))
            chosen = sorted(forced | set(rest[:max(min(topk, nb) - len(forced), 0)]))
            ids[i, t, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return ids


def attention_ref(q, k_cache, v_cache, block_table, seq_lens, q_lens, block_ids=None, sm_scale=None, k_scale=None,
                  v_scale=None):
    """Dense (block_ids None) or block-sparse paged GQA attention, float64 [T, Hq, D].

    FP8 caches: K = stored * k_scale, V = stored * v_scale (None: 1.0)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float64)
    key_rows = _Rows(k_cache, block_table, seq_lens, k_scale)
    value_rows = _Rows(v_cache, block_table, seq_lens, v_scale)
    for t, (r, pos) in enumerate(token_positions(seq_lens, q_lens)):
        kv_len = max(pos + 1, 0)
        if kv_len == 0:
            continue
        nb = -(-kv_len // PAGE_SIZE)
        keys = key_rows(r, nb)                                    # [nb*128, Hk, D]
        values = value_rows(r, nb)
        for kh in range(num_kv_heads):
            allowed = torch.zeros(nb * PAGE_SIZE, dtype=torch.bool)
            allowed[:kv_len] = True
            if block_ids is not None:
                chosen = torch.zeros(nb * PAGE_SIZE, dtype=torch.bool)
                for b in block_ids[kh, t].tolist():
                    if 0 <= b < nb:
                        chosen[b * PAGE_SIZE:(b + 1) * PAGE_SIZE] = True
                allowed &= chosen
            if not allowed.any():
                continue
            heads = slice(kh * group, (kh + 1) * group)
            logits = scale * q[t, heads].double().cpu() @ keys[allowed, kh].T   # [G, n_allowed]
            out[t, heads] = torch.softmax(logits, dim=-1) @ values[allowed, kh]
    return out


def msa_decode_ref(q, idx_q, k_cache, v_cache, index_k_cache, block_table, seq_lens, q_lens, topk=16,
                   init_blocks=0, local_blocks=1, sm_scale=None, k_scale=None, v_scale=None):
    scores = index_scores_ref(idx_q, index_k_cache, block_table, seq_lens, q_lens)
    ids = select_blocks_ref(scores, seq_lens, q_lens, topk, init_blocks, local_blocks)
    return attention_ref(q, k_cache, v_cache, block_table, seq_lens, q_lens, ids, sm_scale, k_scale, v_scale), ids


# -- block-scaled FP8 weights (m3_torch.fp8) ----------------------------------------------------

FP8_BLOCK = 128


def quantize_activation_ref(x):
    """``x [T, K]`` -> (e4m3 codes [T, K], float32 scales [T, ceil(K / 128)]) as ``m3_torch.fp8.quantize_activation``:
    per token and 128 channels ``scale = max(amax without NaN, 1e-12) / 448``, ``codes = saturate(x / scale)``
    rounded to nearest even, in float32."""
    tokens, k = x.shape
    groups = -(-k // FP8_BLOCK)
    x = torch.nn.functional.pad(x.float().cpu(), (0, groups * FP8_BLOCK - k)).reshape(tokens, groups, FP8_BLOCK)
    amax = torch.where(x.isnan(), 0.0, x.abs()).amax(-1)
    scale = amax.clamp_min(1e-12) / 448.0
    codes = (x / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes.reshape(tokens, groups * FP8_BLOCK)[:, :k], scale


def dequantize_fp8_ref(codes, scale):
    """e4m3 weight ``codes [..., N, K]`` times their block scales ``[..., ceil(N / 128), ceil(K / 128)]`` -> float64 on
    the CPU."""
    n, k = codes.shape[-2:]
    full = scale.double().cpu().repeat_interleave(FP8_BLOCK, -2).repeat_interleave(FP8_BLOCK, -1)
    return codes.double().cpu() * full[..., :n, :k]


def dequantize_activation_ref(codes, scale):
    """e4m3 activation ``codes [T, K]`` times their scales ``[T, ceil(K / 128)]`` -> float64 on the CPU."""
    return codes.double().cpu() * scale.double().cpu().repeat_interleave(FP8_BLOCK, -1)[:, :codes.shape[1]]


def fp8_linear_ref(x, weight, weight_scale):
    """``fp8_linear``: x quantized as the kernel does, both operands dequantized, the product in float64 [T, N]."""
    return dequantize_activation_ref(*quantize_activation_ref(x)) @ dequantize_fp8_ref(weight, weight_scale).T
