"""The semantic reference of the model tests: transformers 5.23's ``MiniMaxM3VLForCausalLM``.

float32, eager attention, on the CPU, weights loaded by transformers itself
(never by ``m3_engine.checkpoint``), from either checkpoint form: the VL form
(original tensor names) goes through ``MiniMaxM3SparseForConditionalGeneration``
and its conversion mapping, the text form through ``MiniMaxM3VLForCausalLM``.

    ref = reference_generate(model_dir, prompt, 16)   # greedy; cached per (dir, prompt, n)
    n = assert_tokens_match(ref, engine_tokens)       # equal up to the first near-tie
    logits = reference_prompt_logits(model_dir, prompt)   # [len(prompt), vocab]

Greedy decoding recomputes the whole sequence at every step (no KV cache):
the logits of step ``i`` are exactly the model's function of ``prompt +
tokens[:i]``. Results are cached for the session, so the torch, JAX and
cross-framework tests share one reference run per prompt.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

NEAR_TIE = 1e-3  # token equality is asserted up to the first step whose top-2 margin is below this

__all__ = ["reference_model", "reference_prompt_logits", "reference_generate", "Reference", "checked_steps",
           "assert_tokens_match", "NEAR_TIE"]


@dataclasses.dataclass(frozen=True, eq=False)
class Reference:
    """Greedy generation of the reference model for one prompt.

    tokens:  new tokens, at most ``max_new_tokens``, ending at the first eos id (kept).
    logits:  ``[len(tokens), vocab]`` float32: the logits each token was chosen from
             (row 0 = the prompt's last position).
    margins: top-1 minus top-2 logit of each step.
    """
    prompt: tuple
    tokens: list
    logits: torch.Tensor
    margins: list


@functools.lru_cache(maxsize=None)
def reference_model(model_dir):
    """``MiniMaxM3VLForCausalLM`` (float32, eager attention) with the checkpoint's weights; cached per directory."""
    import transformers
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as modeling

    transformers.logging.set_verbosity_error()
    model_dir = Path(model_dir)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    if hasattr(config, "text_config"):  # VL checkpoint: original names, mapped by transformers
        vl = modeling.MiniMaxM3SparseForConditionalGeneration.from_pretrained(model_dir, **kwargs)
        model = transformers.MiniMaxM3VLForCausalLM(vl.config.text_config)
        model.model, model.lm_head = vl.model.language_model, vl.lm_head
    else:
        model = transformers.MiniMaxM3VLForCausalLM.from_pretrained(model_dir, **kwargs)
    assert model.config._attn_implementation == "eager"
    return model.eval()


@functools.lru_cache(maxsize=None)
def _prompt_logits(model_dir, prompt: tuple) -> torch.Tensor:
    model = reference_model(model_dir)
    with torch.no_grad():
        return model(torch.tensor([prompt]), use_cache=False).logits[0].float()


def reference_prompt_logits(model_dir, prompt) -> torch.Tensor:
    """``[len(prompt), vocab]`` float32 logits of one forward over the prompt (cached)."""
    return _prompt_logits(str(model_dir), tuple(int(t) for t in prompt))


@functools.lru_cache(maxsize=None)
def _generate(model_dir, prompt: tuple, max_new_tokens: int) -> Reference:
    model = reference_model(model_dir)
    eos = model.generation_config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else eos or [])
    sequence, tokens, logits = list(prompt), [], []
    with torch.no_grad():
        while len(tokens) < max_new_tokens:
            last = model(torch.tensor([sequence]), use_cache=False, logits_to_keep=1).logits[0, -1].float()
            logits.append(last)
            tokens.append(int(last.argmax()))
            sequence.append(tokens[-1])
            if tokens[-1] in eos:
                break
    logits = torch.stack(logits)
    top2 = logits.topk(2, dim=-1).values
    return Reference(prompt, tokens, logits, (top2[:, 0] - top2[:, 1]).tolist())


def reference_generate(model_dir, prompt, max_new_tokens: int) -> Reference:
    """Greedy generation of up to ``max_new_tokens`` tokens, stopping at the config's eos ids (cached)."""
    return _generate(str(model_dir), tuple(int(t) for t in prompt), int(max_new_tokens))


def checked_steps(ref: Reference, near_tie: float = NEAR_TIE) -> int:
    """Steps whose tokens must agree: those before the first step with a top-2 margin below ``near_tie``."""
    return next((i for i, m in enumerate(ref.margins) if m < near_tie), len(ref.tokens))


def assert_tokens_match(ref: Reference, tokens, near_tie: float = NEAR_TIE) -> int:
    """Assert ``tokens`` equal the reference's up to the first near-tie step (and have the same
    length when there is none: both stop at the same eos or at the budget). -> steps checked."""
    tokens = [int(t) for t in tokens]
    n = checked_steps(ref, near_tie)
    if tokens[:n] != ref.tokens[:n]:
        first = next((i for i, (a, b) in enumerate(zip(tokens, ref.tokens[:n])) if a != b), min(len(tokens), n))
        raise AssertionError(f"prompt of {len(ref.prompt)} tokens: tokens differ from step {first} (checked {n} "
                             f"steps; reference margins {[round(m, 4) for m in ref.margins[:n]]})\n"
                             f"  got       {tokens}\n  reference {ref.tokens}")
    if n == len(ref.tokens) and len(tokens) != n:
        raise AssertionError(f"got {len(tokens)} tokens, the reference stopped after {n}: {tokens} vs {ref.tokens}")
    return n


def own_half_precision_error(model_dir, prompt, dtype) -> float:
    """transformers' own prompt-logit error (||x - ref|| / ||ref||) in ``dtype`` against its float32 run:
    the yardstick of a half-precision engine (in bf16 a random tiny MoE model flips some expert choices,
    and its logits at later positions move by ~10%)."""
    import copy

    model = copy.deepcopy(reference_model(str(model_dir))).to(dtype)
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt)]), use_cache=False).logits[0].double()
    ref = reference_prompt_logits(model_dir, prompt).double()
    return float((logits - ref).norm() / ref.norm())
