"""Shared by the model tests: greedy (or seeded) generation as lists of token ids."""

from m3_engine import SamplingParams


def generate_ids(llm, prompts, max_new_tokens=16, *, temperature=0.0, top_p=1.0, seed=None, **params):
    """``llm.generate`` with one ``SamplingParams`` for every prompt -> the new token ids per prompt
    (greedy by default, as the model comparisons with transformers need)."""
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, **params)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
