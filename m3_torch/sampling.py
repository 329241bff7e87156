"""``sample``: the next token of each row of logits (PyTorch launcher of ``m3_kernels.sampling``).

CUDA tensors run the compiled kernel, CPU tensors the same kernel in Triton's
interpreter. No host synchronisation (a decode step stays graph-capturable).
"""

from __future__ import annotations

import torch

from m3_kernels import step_launches, validate

from . import guards
from .ops import compiled, operand, run

__all__ = ["sample", "apply_token_bitmask"]


def sample(logits, temperature, top_k, top_p, min_p, seeds, counters, *, repetition_penalty=None,
           presence_penalty=None, frequency_penalty=None, prompt_ids=None, output_ids=None, token_bitmask=None):
    """Sample one token per row -> (tokens int32 [L], logprobs float32 [L], lse float32 [L]).

    logits:       [L, V] float32 / bfloat16 / float16, any row stride, unit column stride.
    temperature:  [L] float32; 0 (or below): greedy (argmax of the penalised logits, ties to the lowest id).
    top_k:        [L] int32; <= 0 or >= V: off. Ties at the k-th value are kept.
    top_p:        [L] float32 in (0, 1]; 1: off. Over the softmax renormalised within the top-k set.
    min_p:        [L] float32 in [0, 1); 0: off. Keeps p >= min_p * p_max.
    seeds:        [L] int64 (or int32), >= 0.
    counters:     [L] int32: the token's index in its request's own output (0 for the first).
    repetition_penalty, presence_penalty, frequency_penalty: [L] float32, given together with
                  prompt_ids [L, P] and output_ids [L, O] int32 (token ids in [0, V), padded with -1),
                  or none of them (vLLM's semantics).
    token_bitmask: [L, ceil(V / 32)] int32 or None (structured outputs): token t of row l may be drawn
                  when bit t % 32 of token_bitmask[l, t // 32] is set (bits past V are ignored). The
                  other tokens' logits are -inf before anything else (penalties, temperature, filters,
                  the draw, lse and logprobs). A row that allows no token gets token 0, logprob and lse -inf.

    A sampling row draws ``argmax over kept v of x_v - log(-log(u_v))`` with ``x = penalised / temperature``
    and ``u_v`` from Philox keyed by the row's seed at counter (v, counters[row]): a row's token depends on
    its logits, parameters, seed and counter only, never on the batch. ``lse``: logsumexp of the raw
    logits; ``logprobs``: raw logit of the token - lse.
    """
    penalties = {"repetition_penalty": repetition_penalty, "presence_penalty": presence_penalty,
                 "frequency_penalty": frequency_penalty}
    rows, vocab, has_penalties = validate.check_sample_call(logits, temperature, top_k, top_p, min_p, seeds,
                                                            counters, penalties, prompt_ids, output_ids,
                                                            token_bitmask)
    tensors = dict(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds,
                   counters=counters, prompt_ids=prompt_ids, output_ids=output_ids, token_bitmask=token_bitmask,
                   **penalties)
    guards.check_call("sample", **tensors)
    device = guards.check_devices(**tensors)
    if rows > 0 and vocab > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits: expected a unit column stride, got strides {tuple(logits.stride())}")
    tokens = torch.empty(rows, dtype=torch.int32, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    lse = torch.empty(rows, dtype=torch.float32, device=device)
    if rows == 0:
        return tokens, logprobs, lse
    seed_words = seeds.to(torch.int64).contiguous().view(torch.int32)   # [2 L]: low, high word per row
    launch = step_launches.sample(
        logits=operand(logits), temperature=temperature.contiguous(), top_k=top_k.contiguous(),
        top_p=top_p.contiguous(), min_p=min_p.contiguous(), seed_words=seed_words, counters=counters.contiguous(),
        penalties=tuple(p.contiguous() for p in penalties.values()) if has_penalties else None,
        seen=operand(seen_tokens(prompt_ids, output_ids, vocab)) if has_penalties else None,
        token_bitmask=None if token_bitmask is None else token_bitmask.contiguous(),
        interpret=not compiled(device))
    run(launch, {"tokens": tokens, "logprobs": logprobs, "lse": lse})
    return tokens, logprobs, lse


def seen_tokens(prompt_ids: torch.Tensor, output_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """-> [L, V + 1] int32: ``2 * (count of v in output_ids[l]) + (v in prompt_ids[l])`` at [l, v]
    (column V collects the -1 padding)."""
    seen = torch.zeros(prompt_ids.shape[0], vocab + 1, dtype=torch.int32, device=prompt_ids.device)
    seen.scatter_(1, torch.where(prompt_ids < 0, vocab, prompt_ids).long(), 1)
    out = torch.where(output_ids < 0, vocab, output_ids).long()
    seen.scatter_add_(1, out, torch.full(out.shape, 2, dtype=torch.int32, device=out.device))
    return seen


def apply_token_bitmask(logits: torch.Tensor, token_bitmask: torch.Tensor) -> torch.Tensor:
    """``logits [L, V]`` with the tokens ``token_bitmask [L, ceil(V / 32)]`` int32 disallows set to -inf
    (a new tensor): what ``sample`` does first, for top-N logprobs and ranks over the same logits."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    bits = (token_bitmask[:, cols // 32] >> (cols % 32).to(torch.int32)) & 1
    return logits.masked_fill(bits == 0, float("-inf"))
