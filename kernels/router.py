"""MoE routing: sigmoid router scores, top-k experts with the correction bias, renormalised weights.

Two launches: ``router_logits_kernel`` computes the logits' float32 partial
sums over SPLITS ranges of H (at decode sizes the 1.5 MB router weight of M3
spread over many programs; one range at prefill sizes), ``router_topk_kernel``
(one program per tile of tokens, all E experts of a token in one program) adds
them in order and makes the choice. For token ``t`` of ``x [T, H]``:

    logits[e] = x[t] . router_weight[e]: float32 accumulation (``tl.dot``, H in chunks of BLOCK_H,
                the SPLITS ranges' sums added in order), rounded to x's dtype (as ``F.linear``'s
                output is), then read as float32
    probs[e]  = sigmoid(logits[e]) = 1 / (1 + exp(-logits[e]))      (IEEE division)
    chosen    = the top_k experts by probs[e] + bias[e]: repeatedly the largest remaining score,
                equal scores to the lowest expert id, NaN scores as -inf (they lose)
    ids       = chosen, by DESCENDING score (ties: lowest id first)
    weights   = probs[chosen] / (((probs[c0] + probs[c1]) + probs[c2]) + ...), in that order, float32

the models' router (``M3Model._moe`` / ``m3_jax.model.moe``) before
``routed_scaling_factor``, which the caller applies. Where the models may
differ: they sum the chosen probabilities in torch's / XLA's order, and
torch.topk leaves its ids unsorted (weights: a float32 rounding; ids: their
order); their GEMM accumulates in another order, which can round a logit to
the neighbouring value of the dtype; ``exp`` here is Triton's (on GPUs from
``ex2.approx``), a few float32 ulps from torch's. Only near-equal scores can
change places. float32 inputs multiply in 3xTF32 (``common.mma``), about
float32's accuracy.

Same bits from torch and JAX: each logit is one ``tl.dot`` accumulation over
the same BLOCK_H chunks in the same order with the MMA instruction that the
dtypes, block shape and warps pick (the same constexprs from both launchers),
not the register layout of the loads; compiled for sm_90 as torch and as
jax-triton build it, the two kernels' floating-point and MMA instructions are
the same (only integer address arithmetic differs). The choice uses maxima
and minima (exact), the weights sum in a fixed order. ``ALIGNED``
(``common.aligned``) gives jax-triton's build the divisibility facts torch's has,
so both pipeline their loads. ``test_gpu_moe_route_real_shapes`` checks the
bits on a GPU.

The host side (shapes and dtypes only) is shared by both launchers:
``validate.check_route_call``, ``tuning.router``, ``step_launches.moe_route``.
"""

import triton
import triton.language as tl

from .common import mma, multiple_of_16, release_next_grid, wait_for_previous_grid

MAX_EXPERTS = 256
MAX_TOP_K = 8


@triton.jit(do_not_specialize=["num_tokens"])
def router_logits_kernel(
    x_ptr,              # [T, H] bf16 / fp16 / fp32, strides (stride_xt, stride_xh)
    router_ptr,         # [E, H] x's dtype, strides (stride_re, stride_rh)
    num_tokens,
    stride_xt, stride_xh, stride_re, stride_rh,
    partial_ptr,        # [SPLITS, T, EXPERTS_PAD] fp32 out, contiguous: the logits' partial sums
    HIDDEN: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,  # next power of two >= max(NUM_EXPERTS, 16)
    BLOCK_T: tl.constexpr,      # tokens per program (>= 16, tl.dot's minimum)
    BLOCK_E: tl.constexpr,      # experts per program (>= 16)
    BLOCK_H: tl.constexpr,      # hidden chunk per dot (>= 16)
    CHUNK: tl.constexpr,        # H / SPLITS rounded up to BLOCK_H: one program's range of H (grid axis 2)
    ALIGNED: tl.constexpr,      # the row strides are multiples of 16 (``common.aligned``): stated for the compiler
    PDL: tl.constexpr = False,
):
    """Grid (token tiles, expert groups, splits): ``partial[s, t, e] = x[t, range s] . router[e, range s]``,
    float32 accumulation over BLOCK_H chunks in order; range s is ``[s * CHUNK, (s + 1) * CHUNK)``."""
    release_next_grid(PDL)
    wait_for_previous_grid(PDL)
    if ALIGNED:
        stride_xt, stride_re = multiple_of_16(stride_xt), multiple_of_16(stride_re)
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    split = tl.program_id(2)
    m_t = tokens < num_tokens
    m_e = experts < NUM_EXPERTS
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for h0 in tl.range(split * CHUNK, (split + 1) * CHUNK, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m_h = cols < HIDDEN
        # [BLOCK_T, BLOCK_H]
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + cols[None, :] * stride_xh,
                    mask=m_t[:, None] & m_h[None, :], other=0.0)
        # [BLOCK_H, BLOCK_E]
        w = tl.load(router_ptr + experts[None, :] * stride_re + cols[:, None] * stride_rh,
                    mask=m_h[:, None] & m_e[None, :], other=0.0)
        acc += mma(x, w)
    out = partial_ptr + (split * num_tokens + tokens[:, None]) * EXPERTS_PAD + experts[None, :]
    tl.store(out, acc, mask=m_t[:, None])


@triton.jit(do_not_specialize=["num_tokens"])
def router_topk_kernel(
    partial_ptr,        # [SPLITS, T, EXPERTS_PAD] fp32: router_logits_kernel's
    bias_ptr,           # [E] any float dtype, unit stride: e_score_correction_bias
    num_tokens,
    ids_ptr,            # [T, TOP_K] int32 out, contiguous
    weights_ptr,        # [T, TOP_K] fp32 out, contiguous
    LOGIT_DTYPE: tl.constexpr,  # x's dtype: the logits are rounded to it
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,    # next power of two >= TOP_K
    BLOCK_T: tl.constexpr,      # tokens per program
    SPLITS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid (token tiles): the logits (the partial sums added in split order, rounded to LOGIT_DTYPE),
    sigmoid, the top-k with the bias, the renormalised weights."""
    release_next_grid(PDL)
    wait_for_previous_grid(PDL)
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    m_t = tokens < num_tokens
    experts = tl.arange(0, EXPERTS_PAD)
    m_e = experts < NUM_EXPERTS
    rows = partial_ptr + tokens[:, None] * EXPERTS_PAD + experts[None, :]
    acc = tl.load(rows, mask=m_t[:, None], other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(rows + s * num_tokens * EXPERTS_PAD, mask=m_t[:, None], other=0.0)
    logits = acc.to(LOGIT_DTYPE).to(tl.float32)
    one = tl.full(logits.shape, 1.0, tl.float32)
    probs = tl.div_rn(one, 1.0 + tl.exp(-logits))
    bias = tl.load(bias_ptr + experts, mask=m_e, other=0.0).to(tl.float32)
    score = probs + bias[None, :]
    score = tl.where(score != score, float("-inf"), score)   # NaN loses

    # -- top-k, best first: the largest available score, ties to the lowest id (exact max / min)
    available = m_t[:, None] & m_e[None, :]
    slots = tl.arange(0, TOP_K_PAD)[None, :]
    chosen_p = tl.zeros([BLOCK_T, TOP_K_PAD], tl.float32)
    total = tl.zeros([BLOCK_T], tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.where(available, score, float("-inf")), axis=1)
        pick = tl.min(tl.where(available & (score == best[:, None]), experts[None, :], EXPERTS_PAD), axis=1)
        hit = experts[None, :] == pick[:, None]
        p = tl.sum(tl.where(hit, probs, 0.0), axis=1)   # one term
        available = available & ~hit
        tl.store(ids_ptr + tokens * TOP_K + j, pick, mask=m_t)
        chosen_p = tl.where(slots == j, p[:, None], chosen_p)
        total += p                                        # best first, one add at a time
    total = tl.where(m_t, total, 1.0)                     # rows past T: no 0 / 0
    weights = tl.div_rn(chosen_p, total[:, None] + tl.zeros_like(chosen_p))
    tl.store(weights_ptr + tokens[:, None] * TOP_K + slots, weights, mask=m_t[:, None] & (slots < TOP_K))
