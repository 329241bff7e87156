"""sample: one sampling kernel from torch and JAX, against a float64 numpy reference.

CPU tests run the interpreted kernel (torch CPU tensors; JAX arrays eagerly and
under ``jax.jit``); the ``gpu`` test runs the compiled one at the full
vocabulary. The reference computes the penalised logits, each row's kept set
(greedy: the argmax) and the raw logsumexp; a sampled token must lie in its
row's kept set, and the draws must follow softmax(x / T) on it (chi-square).
A token bitmask (structured outputs) makes the reference's raw logits -inf
where it disallows a token (``apply_token_bitmask``), before all of that.
"""

from __future__ import annotations

import importlib.util
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import m3_jax
import m3_torch
from m3_engine.structured_outputs import apply_token_bitmask
from jax_helpers import _jax_device  # noqa: F401  (autouse: CPU tests run on JAX's CPU device)

FRAMEWORKS = ("torch", "jax", "jax-jit")
PER_ROW = ("temperature", "top_k", "top_p", "min_p", "seeds", "counters")
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty", "prompt_ids", "output_ids")
KEYWORDS = PENALTIES + ("token_bitmask",)
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


# -- inputs, the two launchers, the reference ---------------------------------------------------

def make_inputs(seed, rows, vocab, *, dtype="float32", temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                penalties=False, seeds=None, counters=None, logits=None) -> dict:
    """Numpy inputs of ``sample``: random logits (scale 2; or ``logits``, a row broadcast to all rows),
    per-row parameters (scalars are broadcast), random seeds and counters unless given; ``penalties``:
    random penalties, prompts, and outputs that repeat tokens from each row's top 20, -1 padded."""
    rng = np.random.default_rng(seed)
    if logits is None:
        logits = rng.standard_normal((rows, vocab)) * 2.0
    logits = np.broadcast_to(np.asarray(logits, np.float32), (rows, vocab)).astype(DTYPES[dtype])

    def per_row(value, dtype):
        return np.ascontiguousarray(np.broadcast_to(np.asarray(value, dtype), (rows,)))

    inputs = {"logits": logits, "temperature": per_row(temperature, np.float32), "top_k": per_row(top_k, np.int32),
              "top_p": per_row(top_p, np.float32), "min_p": per_row(min_p, np.float32),
              "seeds": per_row(rng.integers(0, 2 ** 31, rows) if seeds is None else seeds, np.int64),
              "counters": per_row(rng.integers(0, 1000, rows) if counters is None else counters, np.int32)}
    if penalties:
        top = np.argsort(-logits.astype(np.float32), axis=1)[:, :20]
        outputs = np.take_along_axis(top, rng.integers(0, 20, (rows, 16)), axis=1).astype(np.int32)
        outputs[rng.random(outputs.shape) < 0.2] = -1
        prompts = rng.integers(0, vocab, (rows, 24)).astype(np.int32)
        prompts[:, -rng.integers(1, 8):] = -1
        inputs.update(repetition_penalty=rng.uniform(1.05, 1.8, rows).astype(np.float32),
                      presence_penalty=rng.uniform(0.1, 1.0, rows).astype(np.float32),
                      frequency_penalty=rng.uniform(0.1, 0.6, rows).astype(np.float32),
                      prompt_ids=prompts, output_ids=outputs)
    return inputs


def take_rows(inputs: dict, index) -> dict:
    return {k: np.ascontiguousarray(v[index]) for k, v in inputs.items()}


def _torch(a: np.ndarray, device) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(a.copy()).to(device)


def _jax(name, a: np.ndarray):
    if name == "seeds" and a.dtype == np.int64 and not jax.config.jax_enable_x64:   # int32 seeds: the same draws
        assert a.max(initial=0) < 2 ** 31
        a = a.astype(np.int32)
    return jnp.asarray(a)


def run(framework: str, inputs: dict, device="cpu"):
    """``sample`` of ``framework`` on ``inputs`` -> (tokens, logprobs, lse) as numpy arrays."""
    if framework == "torch":
        t = {k: _torch(v, device) for k, v in inputs.items()}
        out = m3_torch.sample(t["logits"], *(t[k] for k in PER_ROW), **{k: t[k] for k in KEYWORDS if k in t})
        return tuple(o.cpu().numpy() for o in out)
    j = {k: _jax(k, v) for k, v in inputs.items()}
    fn = jax.jit(m3_jax.sample) if framework == "jax-jit" else m3_jax.sample
    out = fn(j["logits"], *(j[k] for k in PER_ROW), **{k: j[k] for k in KEYWORDS if k in j})
    return tuple(np.asarray(o) for o in out)


def reference(inputs: dict) -> dict:
    """float64: raw logits [L, V] (-inf where ``token_bitmask`` disallows a token), penalised logits [L, V],
    the kept set [L, V] (greedy rows: the argmax), raw lse [L]."""
    raw = inputs["logits"].astype(np.float64)
    if "token_bitmask" in inputs:
        raw = apply_token_bitmask(raw, inputs["token_bitmask"])
    rows, vocab = raw.shape
    pen = raw.copy()
    if "output_ids" in inputs:
        for r in range(rows):
            out, prompt = inputs["output_ids"][r], inputs["prompt_ids"][r]
            count = np.bincount(out[out >= 0], minlength=vocab).astype(np.float64)
            occurs = count > 0
            occurs[prompt[prompt >= 0]] = True
            rep = float(inputs["repetition_penalty"][r])
            pen[r] = np.where(occurs, np.where(pen[r] > 0, pen[r] / rep, pen[r] * rep), pen[r])
            pen[r] -= float(inputs["frequency_penalty"][r]) * count + float(inputs["presence_penalty"][r]) * (count > 0)
    kept = np.zeros((rows, vocab), bool)
    for r in range(rows):
        temperature = float(inputs["temperature"][r])
        if temperature <= 0:
            kept[r, np.argmax(pen[r])] = True
            continue
        x = pen[r] / temperature
        keep = np.ones(vocab, bool)
        k = int(inputs["top_k"][r])
        if 0 < k < vocab:
            keep &= x >= np.sort(x)[::-1][k - 1]
        top_p = float(inputs["top_p"][r])
        if top_p < 1:
            p = np.where(keep, np.exp(x - x.max()), 0.0)
            order = np.argsort(-x, kind="stable")
            mass = np.cumsum(p[order]) / p.sum()
            keep &= x >= x[order[np.argmax(mass >= top_p)]]
        min_p = float(inputs["min_p"][r])
        if min_p > 0:
            keep &= np.exp(x - x.max()) >= min_p
        kept[r] = keep
    m = raw.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(raw - m).sum(axis=1))
    return {"raw": raw, "penalised": pen, "kept": kept, "lse": lse, "greedy": np.argmax(pen, axis=1)}


def check(inputs: dict, out, ref=None) -> dict:
    """Assert ``out`` against the reference: greedy rows its argmax, sampled rows in the kept set,
    lse and logprobs (rtol 1e-5)."""
    ref = reference(inputs) if ref is None else ref
    tokens, logprobs, lse = out
    rows = inputs["logits"].shape[0]
    assert tokens.dtype == np.int32 and tokens.shape == (rows,)
    assert logprobs.dtype == np.float32 and lse.dtype == np.float32
    greedy = inputs["temperature"] <= 0
    np.testing.assert_array_equal(tokens[greedy], ref["greedy"][greedy])
    outside = ~ref["kept"][np.arange(rows), tokens]
    assert not outside.any(), f"rows {np.flatnonzero(outside)} drew tokens outside their kept set"
    np.testing.assert_allclose(lse, ref["lse"], rtol=1e-5)
    raw = ref["raw"][np.arange(rows), tokens]
    np.testing.assert_allclose(logprobs, raw - ref["lse"], rtol=1e-5, atol=1e-5)
    return ref


# -- greedy ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_greedy_rows_take_the_penalised_argmax(framework):
    rows, vocab = 8, 1000
    inputs = make_inputs(1, rows, vocab, temperature=0.0, top_k=[0, 5, 0, 1, 0, 0, 3, 0],
                         top_p=[1, 1, 0.5, 1, 1, 1, 0.9, 1], min_p=[0, 0, 0, 0, 0.2, 0, 0.1, 0], penalties=True)
    logits = inputs["logits"]
    # row 0: a tie at the maximum (ids 3 and 700; 700 first in no order) -> the lowest id
    logits[0, 700] = logits[0, 3] = logits[0].max() + 1.0
    inputs["output_ids"][0] = -1
    inputs["prompt_ids"][0] = -1
    # row 1: its raw argmax is in the output, penalised away
    best = int(np.argmax(logits[1]))
    inputs["output_ids"][1, :4] = best
    inputs["frequency_penalty"][1] = 10.0
    out = run(framework, inputs)
    ref = check(inputs, out)
    assert out[0][0] == 3
    assert out[0][1] != best and ref["greedy"][1] != best


@pytest.mark.parametrize("framework", ("torch", "jax"))
def test_top_k_1_and_tiny_top_p_are_greedy(framework):
    rows, vocab = 16, 1000
    inputs = make_inputs(2, rows, vocab, temperature=0.8, top_k=np.where(np.arange(rows) < 8, 1, 0),
                         top_p=np.where(np.arange(rows) < 8, 1.0, 1e-6), penalties=True)
    tokens, *_ = out = run(framework, inputs)
    ref = check(inputs, out)
    np.testing.assert_array_equal(tokens, ref["greedy"])


# -- the kept set ----------------------------------------------------------------------------------

FILTERS = {"top_k": dict(top_k=[3, 20, 50, 7]), "top_p": dict(top_p=[0.5, 0.8, 0.95, 0.3]),
           "min_p": dict(min_p=[0.05, 0.2, 0.01, 0.5]), "all": dict(top_k=[30, 8, 60, 5], top_p=[0.9, 0.7, 0.95, 0.99],
                                                               min_p=[0.02, 0.1, 0.001, 0.05])}


@pytest.mark.parametrize("penalties", (False, True), ids=("plain", "penalties"))
@pytest.mark.parametrize("filters", FILTERS)
@pytest.mark.parametrize("framework", ("torch", "jax"))
def test_sampled_tokens_lie_in_the_kept_set(framework, filters, penalties):
    # 4 rows of logits and parameters, each drawn at 6 counters
    base = make_inputs(3 + len(filters), 4, 400, temperature=[1.0, 0.7, 1.3, 0.9], penalties=penalties,
                       **FILTERS[filters])
    inputs = take_rows(base, np.repeat(np.arange(4), 6))
    inputs["counters"] = np.tile(np.arange(6, dtype=np.int32), 4)
    tokens, *_ = out = run(framework, inputs)
    ref = check(inputs, out)
    # the draws are not all the top token: rows whose kept set has several tokens vary over counters
    several = ref["kept"].sum(axis=1) > 3
    assert several.any()
    assert any(len(set(tokens[r:r + 6])) > 1 for r in range(0, 24, 6) if several[r])


@pytest.mark.parametrize("framework,vocab,dtype", [("torch", 50, "float16"), ("jax", 50, "float16"),
                                                   ("torch", 1000, "bfloat16"), ("jax", 1000, "bfloat16"),
                                                   ("torch", 9000, "float32")])
def test_vocab_sizes(framework, vocab, dtype):
    # V not a multiple of the chunk; V = 9000 spans three chunks of the interpreter's 4096
    rows = 6
    inputs = make_inputs(4, rows, vocab, dtype=dtype, temperature=[0.0, 1.0, 0.8, 1.2, 0.0, 0.6],
                         top_k=[0, 0, 10, 0, 0, 25], top_p=[1, 1, 1, 0.8, 1, 0.9], min_p=[0, 0, 0, 0, 0, 0.05],
                         penalties=True)
    # a tie at the maximum far apart (different chunks at V = 9000): the lowest id
    inputs["logits"][4, [vocab - 1, 7]] = inputs["logits"][4].max() + 2   # exact in every dtype
    inputs["output_ids"][4] = -1
    inputs["prompt_ids"][4] = -1
    tokens, *_ = out = run(framework, inputs)
    check(inputs, out)
    assert tokens[4] == 7


# -- the draw depends on (logits, parameters, seed, counter) only ---------------------------------

def mixed_inputs(seed, rows, vocab, dtype="float32"):
    """Rows of every kind: greedy, plain temperature, each filter, all filters; with penalties."""
    kind = np.arange(rows) % 6
    return make_inputs(seed, rows, vocab, dtype=dtype, temperature=np.where(kind == 0, 0.0, 0.9),
                       top_k=np.where(kind == 2, 15, np.where(kind == 5, 40, 0)),
                       top_p=np.where(kind == 3, 0.8, np.where(kind == 5, 0.9, 1.0)),
                       min_p=np.where(kind == 4, 0.1, np.where(kind == 5, 0.02, 0.0)), penalties=True)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_draws_do_not_depend_on_row_position_or_batch(framework):
    inputs = mixed_inputs(5, 12, 300)
    tokens, logprobs, lse = run(framework, inputs)
    check(inputs, (tokens, logprobs, lse))
    index = np.random.default_rng(6).permutation(12)[:7]
    sub_tokens, sub_logprobs, sub_lse = run(framework, take_rows(inputs, index))
    np.testing.assert_array_equal(sub_tokens, tokens[index])
    np.testing.assert_array_equal(sub_logprobs, logprobs[index])
    np.testing.assert_array_equal(sub_lse, lse[index])


@pytest.mark.parametrize("framework", ("torch", "jax"))
def test_counters_and_seeds_change_the_draw(framework):
    rows = 32
    inputs = make_inputs(7, rows, 200, temperature=1.0, logits=np.random.default_rng(8).standard_normal(200),
                         seeds=1234, counters=np.arange(rows))
    tokens, *_ = run(framework, inputs)
    assert len(set(tokens.tolist())) > 4
    reseeded, *_ = run(framework, dict(inputs, seeds=np.full(rows, 4321, np.int64)))
    assert (reseeded != tokens).sum() > rows // 2
    again, *_ = run(framework, inputs)
    np.testing.assert_array_equal(again, tokens)


def test_seed_high_word_counts():
    inputs = make_inputs(9, 32, 200, temperature=1.0, logits=np.random.default_rng(10).standard_normal(200),
                         seeds=77, counters=np.arange(32))
    low, *_ = run("torch", inputs)
    high, *_ = run("torch", dict(inputs, seeds=np.full(32, 77 + 2 ** 32, np.int64)))
    assert (low != high).sum() > 16


@pytest.mark.parametrize("case", ("all_kept", "filtered"))
@pytest.mark.parametrize("framework", ("torch", "jax"))
def test_draws_follow_the_softmax_on_the_kept_set(framework, case):
    draws, vocab, temperature = 3000, 8, 0.8
    logits = np.random.default_rng(11).standard_normal(vocab)
    filters = dict(top_k=6, top_p=0.97, min_p=0.02) if case == "filtered" else {}
    inputs = make_inputs(12, draws, vocab, temperature=temperature, logits=logits, seeds=20251201,
                         counters=np.arange(draws), **filters)
    tokens, *_ = run(framework, inputs)
    kept = reference(take_rows(inputs, [0]))["kept"][0]
    assert np.isin(tokens, np.flatnonzero(kept)).all()
    x = inputs["logits"][0].astype(np.float64) / temperature
    p = np.where(kept, np.exp(x - x.max()), 0.0)
    expected = draws * p[kept] / p.sum()
    observed = np.bincount(tokens, minlength=vocab)[kept]
    assert kept.sum() >= 4 and expected.min() > 20
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    p_value = torch.special.gammaincc(torch.tensor((kept.sum() - 1) / 2, dtype=torch.float64),
                                      torch.tensor(chi2 / 2, dtype=torch.float64)).item()
    assert p_value > 1e-3, (observed, expected, chi2)


# -- the two frameworks ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_torch_and_jax_give_the_same_bits(dtype):
    inputs = mixed_inputs(13, 12, 700, dtype=dtype)
    want = run("torch", inputs)
    check(inputs, want)
    for framework in ("jax", "jax-jit"):
        got = run(framework, inputs)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert g.tobytes() == w.tobytes(), framework


def test_torch_any_row_stride():
    inputs = mixed_inputs(14, 6, 300)
    wide = np.concatenate([inputs["logits"], np.full((6, 20), np.nan, np.float32)], axis=1)
    t = {k: torch.from_numpy(v) for k, v in inputs.items()}
    strided = torch.from_numpy(wide)[:, :300]
    assert strided.stride() == (320, 1)
    out = m3_torch.sample(strided, *(t[k] for k in PER_ROW), **{k: t[k] for k in PENALTIES})
    want = run("torch", inputs)
    for g, w in zip(out, want):
        assert g.numpy().tobytes() == w.tobytes()


# -- the token bitmask (structured outputs) ---------------------------------------------------------

def pack_bitmask(allowed: np.ndarray) -> np.ndarray:
    """allowed [L, V] bool -> the token bitmask [L, ceil(V / 32)] int32, with the bits past V set (the
    kernel ignores them)."""
    rows, vocab = allowed.shape
    bits = np.ones((rows, 32 * -(-vocab // 32)), bool)
    bits[:, :vocab] = allowed
    return np.packbits(bits, axis=1, bitorder="little").view("<i4")


def masked_inputs(seed, rows, vocab, dtype="float32"):
    """``mixed_inputs`` with a token bitmask: each row allows ~15% of the tokens, never its unmasked greedy
    token; the last row allows every token."""
    inputs = mixed_inputs(seed, rows, vocab, dtype=dtype)
    allowed = np.random.default_rng(seed).random((rows, vocab)) < 0.15
    allowed[np.arange(rows), reference(inputs)["greedy"]] = False
    allowed[-1] = True
    inputs["token_bitmask"] = pack_bitmask(allowed)
    return inputs


@pytest.mark.parametrize("framework", ("torch", "jax"))
def test_masked_rows_draw_allowed_tokens_only(framework):
    # rows of every kind (greedy, plain, each filter, all filters; penalties), each drawn at 16 counters;
    # V = 300 is not a multiple of 32
    base = masked_inputs(30, 7, 300)
    inputs = take_rows(base, np.repeat(np.arange(7), 16))
    inputs["counters"] = np.tile(np.arange(16, dtype=np.int32), 7)
    tokens, *_ = out = run(framework, inputs)
    ref = check(inputs, out)   # greedy rows: the argmax over the allowed tokens; the others: in the kept set
    assert np.isfinite(ref["raw"][np.arange(len(tokens)), tokens]).all(), "a disallowed token was drawn"
    unmasked = reference({k: v for k, v in inputs.items() if k != "token_bitmask"})
    assert (tokens[:96:16] != unmasked["greedy"][:96:16]).all()
    assert sum(len(set(tokens[r:r + 16])) > 1 for r in range(16, 96, 16)) >= 4   # the sampled rows vary


def test_masked_torch_and_jax_give_the_same_bits():
    inputs = masked_inputs(31, 12, 700, dtype="bfloat16")
    want = run("torch", inputs)
    check(inputs, want)
    for framework in ("jax", "jax-jit"):
        got = run(framework, inputs)
        for g, w in zip(got, want):
            assert g.tobytes() == w.tobytes(), framework


@pytest.mark.parametrize("framework", ("torch", "jax"))
def test_rows_that_allow_one_token_or_none(framework):
    # every kind of row twice: rows 0-5 allow no token, rows 6-8 token 31 (a sign bit), rows 9-11 token 99
    # (in the last, partial word of V = 100)
    inputs = mixed_inputs(32, 12, 100)
    allowed = np.zeros((12, 100), bool)
    allowed[6:9, 31] = allowed[9:, 99] = True
    inputs["token_bitmask"] = pack_bitmask(allowed)
    tokens, logprobs, lse = run(framework, inputs)
    np.testing.assert_array_equal(tokens, [0] * 6 + [31] * 3 + [99] * 3)
    assert np.isneginf(logprobs[:6]).all() and np.isneginf(lse[:6]).all()
    np.testing.assert_array_equal(logprobs[6:], 0.0)
    np.testing.assert_array_equal(lse[6:], inputs["logits"][np.arange(6, 12), tokens[6:]])


@pytest.mark.parametrize("framework", ("torch", "jax"))
def test_runners_sample_with_the_step_token_bitmask(framework):
    """The runners' sampling of a step (``sample_logits``): SamplingBatch.token_bitmask reaches the kernel,
    and the top-N logprobs and ranks are over the allowed tokens, like the sampled token's logprob."""
    from m3_engine.runner import SamplingBatch
    inputs = masked_inputs(34, 6, 100)
    batch = SamplingBatch(**{k: v for k, v in inputs.items() if k != "logits"}, num_logprobs=3)
    if framework == "torch":
        from m3_torch.runner import sample_logits
        out = sample_logits(torch.from_numpy(inputs["logits"]), batch)
        out = {k: getattr(out, k) for k in ("tokens", "logprobs", "top_ids", "top_logprobs", "ranks")}
    else:
        from m3_jax.runner import sample_logits
        from m3_jax.sampling import seed_words
        arrays = {k: jnp.asarray(seed_words(v) if k == "seeds" else v) for k, v in inputs.items() if k != "logits"}
        step = jax.jit(sample_logits, static_argnums=2)   # as the runner calls it: inside its jitted step
        out = {k: np.asarray(v) for k, v in step(jnp.asarray(inputs["logits"]), arrays, 3).items()}
    tokens = out["tokens"]
    ref = reference(inputs)
    greedy = inputs["temperature"] <= 0
    np.testing.assert_array_equal(tokens[greedy], ref["greedy"][greedy])
    assert ref["kept"][np.arange(6), tokens].all() and np.isfinite(ref["raw"][np.arange(6), tokens]).all()
    np.testing.assert_allclose(out["logprobs"], ref["raw"][np.arange(6), tokens] - ref["lse"], rtol=1e-5, atol=1e-5)
    order = np.argsort(-ref["raw"], axis=1, kind="stable")[:, :3]
    np.testing.assert_array_equal(out["top_ids"], order)
    assert np.isfinite(np.take_along_axis(ref["raw"], order, axis=1)).all()   # three allowed tokens at least
    np.testing.assert_allclose(out["top_logprobs"], np.take_along_axis(ref["raw"], order, axis=1) - ref["lse"][:, None],
                               rtol=1e-5, atol=1e-5)
    chosen = ref["raw"][np.arange(6), tokens]
    np.testing.assert_array_equal(out["ranks"], (ref["raw"] > chosen[:, None]).sum(axis=1) + 1)


# -- arguments ---------------------------------------------------------------------------------------

BAD = [
    ("logits", lambda x: x["logits"][0], ValueError, "logits: expected rank 2"),
    ("logits", lambda x: x["logits"].astype(np.int32), TypeError, "logits: expected dtype"),
    ("temperature", lambda x: x["temperature"][:, None], ValueError, "temperature: expected rank 1"),
    ("top_k", lambda x: x["top_k"].astype(np.int16), TypeError, "top_k: expected dtype int32"),
    ("counters", lambda x: x["counters"].astype(np.float32), TypeError, "counters: expected dtype int32"),
    ("seeds", lambda x: x["seeds"].astype(np.float32), TypeError, "seeds: expected dtype int64 or int32"),
    ("min_p", lambda x: x["min_p"][:-1], ValueError, "min_p: expected L (rows of logits) = 5"),
    ("counters", lambda x: np.concatenate([x["counters"], x["counters"]]), ValueError, "counters: expected L"),
    ("prompt_ids", lambda x: x["prompt_ids"][:, 0], ValueError, "prompt_ids: expected rank 2"),
    ("output_ids", lambda x: x["output_ids"][:3], ValueError, "output_ids: expected L"),
    ("presence_penalty", lambda x: x["presence_penalty"].astype(np.float16), TypeError,
     "presence_penalty: expected dtype float32"),
    ("frequency_penalty", lambda x: None, ValueError, "frequency_penalty missing"),
    ("token_bitmask", lambda x: np.full((5, 3), -1, np.int32), ValueError,
     "token_bitmask: expected ceil(V / 32) (V = 64) = 2"),
    ("token_bitmask", lambda x: np.full((5, 2), -1, np.float32), TypeError, "token_bitmask: expected dtype int32"),
]


@pytest.mark.parametrize("name,mutate,error,message", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
@pytest.mark.parametrize("framework", ("torch", "jax"))
def test_bad_arguments_name_the_argument(framework, name, mutate, error, message):
    inputs = mixed_inputs(15, 5, 64)
    bad = mutate(inputs)
    inputs = {k: v for k, v in inputs.items() if k != name}
    if bad is not None:
        inputs[name] = bad
    with pytest.raises(error, match=re.escape(message)):
        run(framework, inputs)


def test_jax_refuses_int64_seeds_and_seed_lists():
    inputs = mixed_inputs(18, 4, 64)
    j = {k: jnp.asarray(v) for k, v in inputs.items() if k != "seeds"}
    with pytest.raises(TypeError, match="seeds: int64 seeds need jax_enable_x64"):
        m3_jax.sample(j["logits"], *(j[k] if k != "seeds" else inputs["seeds"] for k in PER_ROW))
    with pytest.raises(TypeError, match="m3_jax.sample: seeds: expected a jax array, got list"):
        m3_jax.sample(j["logits"], *(j[k] if k != "seeds" else inputs["seeds"].tolist() for k in PER_ROW))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_no_rows(framework):
    inputs = mixed_inputs(16, 0, 100)
    tokens, logprobs, lse = run(framework, inputs)
    assert tokens.shape == logprobs.shape == lse.shape == (0,)
    assert (tokens.dtype, logprobs.dtype, lse.dtype) == (np.int32, np.float32, np.float32)


# -- GPU ------------------------------------------------------------------------------------------------

def _jax_gpu_ready() -> bool:
    return jax.default_backend() == "gpu" and importlib.util.find_spec("jax_triton") is not None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
def test_gpu_full_vocabulary(dtype):
    inputs = mixed_inputs(17, 64, 200064, dtype=dtype)
    want = run("torch", inputs, device="cuda")
    ref = check(inputs, want)
    again = run("torch", take_rows(inputs, np.arange(64)[::-1]), device="cuda")
    np.testing.assert_array_equal(again[0], want[0][::-1])
    # the compiled kernel draws from the same kept sets as the interpreter (exact thresholds)
    assert (ref["kept"].sum(axis=1) > 1).sum() >= 40
    assert_jax_gpu_same_bits(inputs, want)


@pytest.mark.gpu
def test_gpu_masked_full_vocabulary():
    inputs = masked_inputs(33, 64, 200064, dtype="bfloat16")
    want = run("torch", inputs, device="cuda")
    ref = check(inputs, want)
    assert np.isfinite(ref["raw"][np.arange(64), want[0]]).all(), "a disallowed token was drawn"
    assert_jax_gpu_same_bits(inputs, want)


def assert_jax_gpu_same_bits(inputs, want):
    """JAX on the GPU (eager and jitted) gives the torch GPU run's outputs bit for bit (skips without a
    JAX GPU backend)."""
    if not _jax_gpu_ready():
        pytest.skip("needs a JAX GPU backend and jax_triton for the JAX half")
    for framework in ("jax", "jax-jit"):
        with jax.default_device(jax.devices("gpu")[0]):
            got = run(framework, inputs)
        for g, w in zip(got, want):
            assert g.tobytes() == w.tobytes(), framework
