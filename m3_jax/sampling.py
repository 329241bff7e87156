"""``sample``: the next token of each row of logits (JAX launcher of ``m3_kernels.sampling``).

The same kernel as ``m3_torch.sample``: compiled through jax-triton on a GPU
backend, interpreted inside ``jax.pure_callback`` on a CPU backend; works
under ``jax.jit``. Identical inputs give torch's bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from m3_kernels import step_launches, validate

from . import guards
from ._triton_call import on_gpu
from .ops import operand, run

__all__ = ["sample", "apply_token_bitmask"]


def sample(logits, temperature, top_k, top_p, min_p, seeds, counters, *, repetition_penalty=None,
           presence_penalty=None, frequency_penalty=None, prompt_ids=None, output_ids=None, token_bitmask=None):
    """Sample one token per row -> (tokens int32 [L], logprobs float32 [L], lse float32 [L]).

    Arguments and semantics as ``m3_torch.sample`` (logits [L, V] float32 / bfloat16 / float16; per row
    temperature, top_p, min_p float32, top_k, counters int32, seeds int64 or, as JAX runs without x64,
    int32 (the same value draws the same token) or [L, 2] int32: an int64 seed's low and high words;
    optional penalties float32 [L] with prompt_ids [L, P] and output_ids [L, O] int32 padded with -1,
    all five or none; optional token_bitmask [L, ceil(V / 32)] int32).
    """
    penalties = {"repetition_penalty": repetition_penalty, "presence_penalty": presence_penalty,
                 "frequency_penalty": frequency_penalty}
    guards.check_call("sample", logits=logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                      seeds=seeds, counters=counters, prompt_ids=prompt_ids, output_ids=output_ids,
                      token_bitmask=token_bitmask, **penalties)
    words = seeds.ndim == 2
    if words and (seeds.shape[1] != 2 or str(seeds.dtype) != "int32"):
        raise TypeError(f"seeds: expected [L] int64/int32 or [L, 2] int32 (low, high words), got "
                        f"{seeds.dtype}{list(seeds.shape)}")
    rows, vocab, has_penalties = validate.check_sample_call(logits, temperature, top_k, top_p, min_p,
                                                            seeds[:, 0] if words else seeds, counters, penalties,
                                                            prompt_ids, output_ids, token_bitmask)
    if str(seeds.dtype) == "int64" and not jax.config.jax_enable_x64:   # numpy seeds JAX would narrow
        raise TypeError("seeds: int64 seeds need jax_enable_x64 (JAX would narrow them); pass int32 seeds "
                        "(the same value draws the same token)")
    if rows == 0:
        return jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32)
    pen = tuple(penalties.values()) + (prompt_ids, output_ids) if has_penalties else ()
    return _sample(logits, temperature, top_k, top_p, min_p, seeds, counters, token_bitmask, *pen,
                   interpret=not on_gpu())


@functools.partial(jax.jit, static_argnames=("interpret",))
def _sample(logits, temperature, top_k, top_p, min_p, seeds, counters, token_bitmask, *penalties, interpret):
    """The checked call (``token_bitmask``: an array or None; ``penalties``: the five penalty arrays or
    none), one jitted function: eager callers compile it once per shape instead of dispatching its pieces
    one by one."""
    vocab = logits.shape[1]
    if penalties:
        *pen, prompt_ids, output_ids = penalties
        pen, seen = tuple(pen), operand(seen_tokens(prompt_ids, output_ids, vocab))
    else:
        pen = seen = None
    out = run(step_launches.sample(logits=operand(logits), temperature=temperature, top_k=top_k, top_p=top_p,
                                   min_p=min_p, seed_words=_seed_words(seeds), counters=counters, penalties=pen,
                                   seen=seen, token_bitmask=token_bitmask, interpret=interpret))
    return out["tokens"], out["logprobs"], out["lse"]


def seed_words(seeds: np.ndarray) -> np.ndarray:
    """Host int64 seeds [L] -> [L, 2] int32 (low, high words): how a jitted step passes int64 seeds
    through JAX without x64."""
    return np.ascontiguousarray(seeds, "<i8").view("<i4").reshape(-1, 2)


def _seed_words(seeds):
    """seeds [L] int64 / int32 (or already [L, 2] words) -> [L, 2] int32: the int64 value's low and high
    words (int32 sign-extended, as torch's ``seeds.to(torch.int64)``)."""
    if seeds.ndim == 2:
        return seeds
    if seeds.dtype == jnp.int32:
        return jnp.stack([seeds, seeds >> 31], axis=1)
    low = jax.lax.convert_element_type(seeds & 0xFFFFFFFF, jnp.uint32)
    high = jax.lax.convert_element_type(seeds >> 32, jnp.int32)
    return jnp.stack([jax.lax.bitcast_convert_type(low, jnp.int32), high], axis=1)


def seen_tokens(prompt_ids, output_ids, vocab: int):
    """-> [L, V + 1] int32: ``2 * (count of v in output_ids[l]) + (v in prompt_ids[l])`` at [l, v]
    (column V collects the -1 padding)."""
    rows = jnp.arange(prompt_ids.shape[0], dtype=jnp.int32)[:, None]
    seen = jnp.zeros((prompt_ids.shape[0], vocab + 1), jnp.int32)
    seen = seen.at[rows, jnp.where(prompt_ids < 0, vocab, prompt_ids)].set(1)
    return seen.at[rows, jnp.where(output_ids < 0, vocab, output_ids)].add(2)


def apply_token_bitmask(logits, token_bitmask):
    """``logits [L, V]`` with the tokens ``token_bitmask [L, ceil(V / 32)]`` int32 disallows set to -inf:
    what ``sample`` does first, for top-N logprobs and ranks over the same logits."""
    cols = jnp.arange(logits.shape[1], dtype=jnp.int32)
    bits = (token_bitmask[:, cols // 32] >> (cols % 32)) & 1
    return jnp.where(bits != 0, logits, -jnp.inf)
