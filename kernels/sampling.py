"""Token sampling: a token bitmask, penalties, temperature, top-k / top-p / min-p, one Gumbel-max draw per row.

One program per row of logits (``BLOCK_R`` rows in the interpreter, whose cost
is per program), looping over the vocabulary in chunks:

0. (``MASKED``: structured outputs) each raw logit whose token's bit is 0 in
   the row's bitmask becomes -inf as it is loaded, before anything below: a
   disallowed token is a token of logit -inf everywhere, lse included. A row
   that allows no token draws token 0 with logprob and lse -inf.
1. (always) the raw logits' log-sum-exp; the processed logits
   ``x = penalised / temperature`` (greedy rows: ``x = penalised``) and their
   maximum. A greedy row takes its argmax here, and so does a sampling row
   with no filter on (argmax of ``x + gumbel``): one pass over V. A row with
   a filter on stores ``x`` in the float32 workspace instead.
2. (top-k on) the k-th largest ``x``, by a search over the order-preserving
   int32 key of its float32 bits: each pass counts ``key >= pivot`` for
   PIVOTS pivots at once, so the key interval shrinks PIVOTS-fold per pass
   (8 passes cover the 2^32 keys with 16 pivots); the threshold is exact.
3. (top-p on) the same search on the softmax mass of ``key >= pivot`` inside
   the top-k set (the mass at the first pass's lowest pivot is that set's).
4. (any filter on) the draw: argmax of ``x + gumbel`` over the kept tokens,
   ``key >= threshold`` and ``exp(x - max) >= min_p``.

The Gumbel noise of token v is a function of (row seed, v, row counter) only
(Triton's Philox), so a row's draw never depends on its position or batch.

Same bits from torch and JAX: each lane of a chunk (a fixed offset in it)
accumulates its own sums, counts, maxima and argmaxes across the chunks,
elementwise; a row combines its lanes once per pass, and those cross-lane sums
are exact (int64; softmax terms as multiples of 2^-40), maxima and argmaxes
(ties: lowest id) exact anyway. So no result depends on the reduction order
the compiler picks (torch and jax-triton give it different divisibility
facts, hence different layouts). Divisions round as IEEE (``div_rn``).

The host side (shapes and dtypes only) is shared by both launchers:
``validate.check_sample_call``, ``tuning.sample``, ``step_launches.sample``.
"""

import triton
import triton.language as tl

from .common import release_next_grid, wait_for_previous_grid

# softmax terms (each in [0, 1]) are summed exactly as int64 multiples of 2^-40; V <= MAX_VOCAB keeps a row's
# sum below 2^62
FIXED_ONE = tl.constexpr(2.0 ** 40)
FIXED_UNIT = tl.constexpr(2.0 ** -40)
MAX_VOCAB = 1 << 22
FLOAT_MAX = tl.constexpr(3.4028234663852886e38)
# key(-inf): no key of a float32 (NaN aside) is smaller
KEY_NEG_INF = tl.constexpr(-2139095041)


@triton.jit
def float_key(x):
    """The int32 whose order is the order of the float32 ``x`` (-0.0 and +0.0 both give 0)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(x == 0.0, 0, key)


@triton.jit
def gumbel_noise(seed, ids, counter):
    """``-log(-log(u))`` [R, B] for token ids ``ids`` [R, B] int32; ``u`` in (0, 1) from Philox keyed by
    the row's ``seed`` [R, 1] int64 at counter ``(token id, counter [R, 1] int32, 0, 0)``."""
    zero = tl.zeros_like(ids)
    bits, _, _, _ = tl.philox(seed, ids, zero + counter, zero, zero)
    u = ((bits >> 8).to(tl.float32) + 0.5) * (2.0 ** -24)
    return -tl.log(-tl.log(u))


@triton.jit
def pivots_between(lo, hi, PIVOTS: tl.constexpr):
    """-> (pivots [R, PIVOTS] int64: ``lo + floor((hi - lo) * j / PIVOTS)`` for the intervals [lo, hi) [R]
    (the first pivot is ``lo``; for ``hi - lo <= PIVOTS`` every key of the interval), j [1, PIVOTS])."""
    j = tl.arange(0, PIVOTS).to(tl.int64)[None, :]
    return lo[:, None] + ((hi - lo)[:, None] * j) // PIVOTS, j


@triton.jit
def narrow(lo, hi, pivots, j, ok, PIVOTS: tl.constexpr):
    """-> (lo, hi) [R] after a search pass. ``ok`` [R, PIVOTS]: where the kept set ``key >= pivot`` is still
    big enough (monotone, true at ``pivots[:, 0] == lo``). The new interval runs from the last such pivot
    to the next one (or ``hi``); ``hi - lo == 1`` stays as it is."""
    n_ok = tl.sum(ok.to(tl.int32), axis=1)
    new_lo = tl.sum(tl.where(j == n_ok[:, None] - 1, pivots, 0), axis=1)
    new_hi = tl.sum(tl.where(j == n_ok[:, None], pivots, 0), axis=1)
    return new_lo, tl.where(n_ok < PIVOTS, new_hi, hi)


@triton.jit
def take_best(lane_best, lane_id, score, cols):
    """Fold a chunk's ``score`` [R, B] (``cols`` [B] its token ids) into each lane's running maximum and
    its id ``(lane_best, lane_id)`` [R, B]: a lane sees its ids in increasing order, so only a strictly
    larger score replaces its maximum (ties: the lowest id)."""
    take = score > lane_best
    return tl.where(take, score, lane_best), tl.where(take, cols[None, :], lane_id)


@triton.jit
def row_best(lane_best, lane_id, vocab):
    """-> [R] int32: the argmax of each row over its lanes ``(lane_best, lane_id)`` [R, B], ties to the
    lowest id (a row of -inf: 0)."""
    best = tl.max(lane_best, axis=1)
    return tl.min(tl.where(lane_best == best[:, None], lane_id, vocab), axis=1)


@triton.jit(do_not_specialize=["num_rows", "vocab", "stride_logits", "stride_seen"])
def sample_kernel(
    logits_ptr,        # [L, V] fp32 / bf16 / fp16, row stride stride_logits, unit column stride
    temperature_ptr,   # [L] fp32; <= 0: greedy
    top_k_ptr,         # [L] int32; <= 0 or >= V: off
    top_p_ptr,         # [L] fp32 in (0, 1]; 1: off
    min_p_ptr,         # [L] fp32 in [0, 1]; 0: off
    seed_ptr,          # [L, 2] int32: the int64 seed's low and high words
    counter_ptr,       # [L] int32: the token's index in its request's output
    repetition_ptr,    # [L] fp32 (read when HAS_PENALTIES)
    presence_ptr,      # [L] fp32 (read when HAS_PENALTIES)
    frequency_ptr,     # [L] fp32 (read when HAS_PENALTIES)
    seen_ptr,          # [L, >= V] int32, row stride stride_seen: 2 * count in output + (in prompt) (HAS_PENALTIES)
    bitmask_ptr,       # [L, ceil(V / 32)] int32, contiguous: bit t % 32 of word t // 32 = token t allowed (MASKED)
    num_rows, vocab, stride_logits, stride_seen,
    token_ptr,         # [L] int32 out
    logprob_ptr,       # [L] fp32 out: raw logit of the token - lse (MASKED: -inf for a disallowed token)
    lse_ptr,           # [L] fp32 out: logsumexp of the raw logits (MASKED: of the allowed tokens')
    work_ptr,          # [L, V] fp32 scratch: x of the rows with a filter on
    HAS_PENALTIES: tl.constexpr,
    BLOCK_R: tl.constexpr,     # rows per program (1 on GPUs; the interpreter's cost is per program)
    BLOCK_V: tl.constexpr,     # chunk of the first and the last pass: a multiple of 32 (whole bitmask words)
    BLOCK_S: tl.constexpr,     # chunk of the search passes ([BLOCK_R, BLOCK_S, PIVOTS] comparisons)
    PIVOTS: tl.constexpr,      # thresholds tried per search pass
    MASKED: tl.constexpr = False,   # read bitmask_ptr: disallowed tokens' logits are -inf
    PDL: tl.constexpr = False,
):
    release_next_grid(PDL)
    wait_for_previous_grid(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = rows < num_rows
    rows64 = rows.to(tl.int64)
    # [BLOCK_R] each; rows past L are greedy rows that store nothing
    temperature = tl.load(temperature_ptr + rows, mask=m_r, other=0.0)
    top_k = tl.load(top_k_ptr + rows, mask=m_r, other=0)
    top_p = tl.load(top_p_ptr + rows, mask=m_r, other=1.0)
    min_p = tl.load(min_p_ptr + rows, mask=m_r, other=0.0)
    seed_lo = tl.load(seed_ptr + 2 * rows, mask=m_r, other=0)
    seed_hi = tl.load(seed_ptr + 2 * rows + 1, mask=m_r, other=0)
    seed = ((seed_hi.to(tl.int64) << 32) | (seed_lo.to(tl.int64) & 0xFFFFFFFF))[:, None]
    counter = tl.load(counter_ptr + rows, mask=m_r, other=0)[:, None]
    sampled = temperature > 0.0
    top_k_on = sampled & (top_k > 0) & (top_k < vocab)
    top_p_on = sampled & (top_p < 1.0)
    min_p_on = sampled & (min_p > 0.0)
    filtered = top_k_on | top_p_on | min_p_on
    draw_now = sampled & ~filtered
    divisor = tl.where(sampled, temperature, 1.0)[:, None]
    logits_rows = logits_ptr + rows64[:, None] * stride_logits
    work_rows = work_ptr + rows64[:, None] * vocab
    if HAS_PENALTIES:
        repetition = tl.load(repetition_ptr + rows, mask=m_r, other=1.0)[:, None]
        presence = tl.load(presence_ptr + rows, mask=m_r, other=0.0)[:, None]
        frequency = tl.load(frequency_ptr + rows, mask=m_r, other=0.0)[:, None]
        seen_rows = seen_ptr + rows64[:, None] * stride_seen
    if MASKED:
        tl.static_assert(BLOCK_V % 32 == 0, "BLOCK_V: expected whole bitmask words (a multiple of 32)")
        bitmask_rows = bitmask_ptr + rows64[:, None] * ((vocab + 31) // 32)

    # -- pass 1: raw lse, x and its max; the draw of unfiltered rows. Each lane (element of a chunk)
    # accumulates its own sum, maximum and argmax; rows combine their lanes once, at the end.
    raw_max = tl.full([BLOCK_R], float("-inf"), tl.float32)           # running row maximum
    lane_sum = tl.zeros([BLOCK_R, BLOCK_V], tl.float32)               # sum of exp(raw - raw_max)
    lane_x_max = tl.full([BLOCK_R, BLOCK_V], float("-inf"), tl.float32)
    lane_best = tl.full([BLOCK_R, BLOCK_V], float("-inf"), tl.float32)
    lane_id = tl.zeros([BLOCK_R, BLOCK_V], tl.int32)
    any_draw_now = tl.max(draw_now.to(tl.int32), axis=0) > 0
    any_filtered = tl.max(filtered.to(tl.int32), axis=0) > 0
    for start in tl.range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        m_rv = m_r[:, None] & (cols < vocab)[None, :]
        # [BLOCK_R, BLOCK_V]
        raw = tl.load(logits_rows + cols[None, :], mask=m_rv, other=float("-inf")).to(tl.float32)
        if MASKED:
            # the chunk's BLOCK_V / 32 words in one contiguous load, each spread over its 32 tokens
            word_ids = start // 32 + tl.arange(0, BLOCK_V // 32)
            words = tl.load(bitmask_rows + word_ids[None, :],
                            mask=m_r[:, None] & (word_ids < (vocab + 31) // 32)[None, :], other=0)
            bits = (words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1
            raw = tl.where(tl.reshape(bits, [BLOCK_R, BLOCK_V]) != 0, raw, float("-inf"))
        new_max = tl.maximum(raw_max, tl.max(raw, axis=1))
        shift = tl.maximum(new_max, -FLOAT_MAX)   # finite: no NaN from -inf - -inf
        rescale = tl.exp(tl.maximum(raw_max, -FLOAT_MAX) - shift)
        lane_sum = lane_sum * rescale[:, None] + tl.exp(raw - shift[:, None])
        raw_max = new_max
        x = raw
        if HAS_PENALTIES:
            # [BLOCK_R, BLOCK_V]
            seen = tl.load(seen_rows + cols[None, :], mask=m_rv, other=0)
            count = (seen >> 1).to(tl.float32)
            scaled = tl.where(x > 0.0, tl.div_rn(x, repetition + tl.zeros_like(x)), x * repetition)
            x = tl.where(seen != 0, scaled, x)
            x = x - (frequency * count + presence * (count > 0.0).to(tl.float32))
        x = tl.where(m_rv, tl.div_rn(x, divisor + tl.zeros_like(x)), float("-inf"))
        lane_x_max = tl.maximum(lane_x_max, x)
        score = x
        if any_draw_now:
            ids = tl.zeros([BLOCK_R, BLOCK_V], tl.int32) + cols[None, :]
            score = tl.where(draw_now[:, None], x + gumbel_noise(seed, ids, counter), x)
        lane_best, lane_id = take_best(lane_best, lane_id, score, cols)
        if any_filtered:
            tl.store(work_rows + cols[None, :], x, mask=m_rv & filtered[:, None])
    # the lanes' sums added exactly (int64 multiples of 2^-40): the same bits whatever the reduction order
    raw_sum = tl.sum((lane_sum * FIXED_ONE).to(tl.int64), axis=1).to(tl.float32) * FIXED_UNIT
    lse = raw_max + tl.log(tl.where(raw_sum > 0.0, raw_sum, 1.0))   # an all -inf row: -inf
    x_max = tl.max(lane_x_max, axis=1)
    best_id = row_best(lane_best, lane_id, vocab)

    if any_filtered:
        # the kept set of a row is key(x) >= lo; a search runs while some row's hi - lo > 1
        x_top = tl.where(x_max == float("-inf"), 0.0, x_max)[:, None]
        lo = tl.full([BLOCK_R], KEY_NEG_INF, tl.int64)
        top = float_key(x_max).to(tl.int64) + 1
        # -- top-k: the largest key K with #(key >= K) >= k
        hi = tl.where(top_k_on, top, lo + 1)
        while tl.max(hi - lo, axis=0) > 1:
            pivots, j = pivots_between(lo, hi, PIVOTS)
            lane_counts = tl.zeros([BLOCK_R, BLOCK_S, PIVOTS], tl.int32)
            for start in tl.range(0, vocab, BLOCK_S):
                cols = start + tl.arange(0, BLOCK_S)
                m_rv = m_r[:, None] & (cols < vocab)[None, :]
                # [BLOCK_R, BLOCK_S]
                key = float_key(tl.load(work_rows + cols[None, :], mask=m_rv, other=float("-inf")))
                # [BLOCK_R, BLOCK_S, PIVOTS]
                hit = (key[:, :, None] >= pivots.to(tl.int32)[:, None, :]) & m_rv[:, :, None]
                lane_counts += hit.to(tl.int32)
            counts = tl.sum(lane_counts, axis=1)
            lo, hi = narrow(lo, hi, pivots, j, (counts >= top_k[:, None]) | ~top_k_on[:, None], PIVOTS)
        # -- top-p: the largest key K whose mass(key >= K) reaches top_p of the top-k set's mass
        hi = tl.where(top_p_on, top, lo + 1)
        kept_mass = tl.full([BLOCK_R], -1, tl.int64)
        while tl.max(hi - lo, axis=0) > 1:
            pivots, j = pivots_between(lo, hi, PIVOTS)
            lane_mass = tl.zeros([BLOCK_R, BLOCK_S, PIVOTS], tl.int64)
            for start in tl.range(0, vocab, BLOCK_S):
                cols = start + tl.arange(0, BLOCK_S)
                m_rv = m_r[:, None] & (cols < vocab)[None, :]
                # [BLOCK_R, BLOCK_S]
                x = tl.load(work_rows + cols[None, :], mask=m_rv, other=float("-inf"))
                e = (tl.exp(x - x_top) * FIXED_ONE).to(tl.int64)
                # [BLOCK_R, BLOCK_S, PIVOTS]
                hit = (float_key(x)[:, :, None] >= pivots.to(tl.int32)[:, None, :]) & m_rv[:, :, None]
                lane_mass += tl.where(hit, e[:, :, None], 0)
            mass = tl.sum(lane_mass, axis=1)
            # the first pass's first pivot is the top-k threshold: its mass is the top-k set's
            kept_mass = tl.where(kept_mass < 0, tl.sum(tl.where(j == 0, mass, 0), axis=1), kept_mass)
            target = top_p.to(tl.float64) * kept_mass.to(tl.float64)
            ok = (mass.to(tl.float64) >= target[:, None]) | ~top_p_on[:, None]
            lo, hi = narrow(lo, hi, pivots, j, ok, PIVOTS)
        # -- the draw over the kept tokens (min-p: exp(x - max) >= min_p)
        min_ratio = tl.where(min_p_on, min_p, 0.0)[:, None]
        lane_best = tl.full([BLOCK_R, BLOCK_V], float("-inf"), tl.float32)
        lane_id = tl.zeros([BLOCK_R, BLOCK_V], tl.int32)
        for start in tl.range(0, vocab, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            m_rv = m_r[:, None] & (cols < vocab)[None, :] & filtered[:, None]
            # [BLOCK_R, BLOCK_V]
            x = tl.load(work_rows + cols[None, :], mask=m_rv, other=float("-inf"))
            keep = m_rv & (float_key(x) >= lo[:, None]) & (tl.exp(x - x_top) >= min_ratio)
            ids = tl.zeros([BLOCK_R, BLOCK_V], tl.int32) + cols[None, :]
            score = tl.where(keep, x + gumbel_noise(seed, ids, counter), float("-inf"))
            lane_best, lane_id = take_best(lane_best, lane_id, score, cols)
        best_id = tl.where(filtered, row_best(lane_best, lane_id, vocab), best_id)

    token_logit = tl.load(logits_ptr + rows64 * stride_logits + best_id, mask=m_r, other=0.0).to(tl.float32)
    logprob = token_logit - lse
    if MASKED:
        # a row that allows no token draws token 0 (the argmax of a row of -inf, lse -inf): logprob -inf, not
        # its raw logit - -inf or -inf - -inf
        word = tl.load(bitmask_ptr + rows64 * ((vocab + 31) // 32) + best_id // 32, mask=m_r, other=0)
        allowed = (((word >> (best_id % 32)) & 1) != 0) & (token_logit > float("-inf"))
        logprob = tl.where(allowed, logprob, float("-inf"))
    tl.store(token_ptr + rows, best_id, mask=m_r)
    tl.store(logprob_ptr + rows, logprob, mask=m_r)
    tl.store(lse_ptr + rows, lse, mask=m_r)
