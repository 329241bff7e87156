"""The torch and JAX engines give the same greedy tokens on the same checkpoint.

CPU, float32, the tiny random checkpoint in its release form (nested VL config,
original tensor names). Both engines run the same Triton kernels (in the
interpreter) with the same plans; the dense math (XLA vs torch) may round
differently in the last bit, so, as for transformers, tokens are compared up to
the first step where the reference's top-2 margin is below 1e-3.
"""

from __future__ import annotations

import numpy as np
import pytest

import m3_jax
import m3_torch
from m3_kernels import tuning
from m3_engine.tiny_model import write_tiny_checkpoint

import hf_reference
from jax_helpers import _jax_device, jax_gpu_ready  # noqa: F401  (autouse: CPU tests run on JAX's CPU device)
from engine_helpers import generate_ids


def prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 512, n).tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m3_tiny_cross"), seed=1, form="vl")


def generate_both(model_dir, prompts, max_new_tokens, **kwargs):
    with tuning.override(target_programs=1, sparse_target_programs=1):   # fewer interpreter programs
        torch_out = generate_ids(m3_torch.LLM(model_dir, **kwargs), prompts, max_new_tokens=max_new_tokens)
        jax_out = generate_ids(m3_jax.LLM(model_dir, **kwargs), prompts, max_new_tokens=max_new_tokens)
    return torch_out, jax_out


def assert_same_tokens(model_dir, prompts, torch_out, jax_out, max_new_tokens):
    for p, t, j in zip(prompts, torch_out, jax_out):
        ref = hf_reference.reference_generate(model_dir, p, max_new_tokens)
        n = hf_reference.checked_steps(ref)
        assert t[:n] == j[:n], f"prompt of {len(p)} tokens: torch {t} vs jax {j} (checked {n} steps)"
        if n == len(ref.tokens):
            assert len(t) == len(j) == n


@pytest.mark.long
def test_engines_agree_short_prompts(model_dir):
    """A 1-token and a 130-token prompt (chunked across a block boundary), 4 tokens each."""
    prompts = [prompt(1, seed=1), prompt(130, seed=130)]
    torch_out, jax_out = generate_both(model_dir, prompts, 4, max_num_seqs=2, max_model_len=256, prefill_chunk=100)
    assert_same_tokens(model_dir, prompts, torch_out, jax_out, 4)


@pytest.mark.long
def test_engines_agree_with_selection(model_dir):
    """Prompts of 1, 129 and 300 tokens (top-2 of 3 blocks: the indexer's choice matters), 16 tokens each,
    chunked prefill and a mixed step on both sides."""
    prompts = [prompt(1, seed=1), prompt(129, seed=129), prompt(300, seed=300)]
    torch_out, jax_out = generate_both(model_dir, prompts, 16, max_num_seqs=4, max_model_len=512, prefill_chunk=200)
    assert_same_tokens(model_dir, prompts, torch_out, jax_out, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not jax_gpu_ready(), reason="needs a JAX GPU backend and jax_triton")
def test_gpu_bf16_engines_agree(tmp_path):
    """bf16 on the GPU: the two frameworks' dense math rounds differently, so tokens may part after a
    while; report the agreement rate and require most of them to agree."""
    import jax

    model_dir = write_tiny_checkpoint(tmp_path / "bf16", seed=1, form="vl", dtype="bfloat16")
    prompts = [prompt(n, seed=n) for n in (1, 127, 129, 700)]
    kwargs = dict(max_num_seqs=4, max_model_len=1024, prefill_chunk=500)
    torch_out = generate_ids(m3_torch.LLM(model_dir, device="cuda", **kwargs), prompts, max_new_tokens=16)
    jax_out = generate_ids(m3_jax.LLM(model_dir, device=jax.devices("gpu")[0], **kwargs), prompts, max_new_tokens=16)
    agree = sum(next((i for i, (a, b) in enumerate(zip(t, j)) if a != b), min(len(t), len(j)))
                for t, j in zip(torch_out, jax_out))
    total = sum(max(len(t), len(j)) for t, j in zip(torch_out, jax_out))
    print(f"bf16 torch vs JAX engines: {agree}/{total} greedy tokens agree before the first divergence")
    assert agree >= total // 2


@pytest.mark.long   # ~36 s on the interpreter: `make test` stays under 10 minutes on 2 cores
def test_engines_agree_with_fp8_caches(model_dir):
    """Both engines with e4m3 K/V and index-K caches (a byte pool): the same greedy tokens for a prompt
    chunked across a block boundary."""
    import torch
    prompts = [prompt(130, seed=131)]
    kwargs = dict(max_num_seqs=1, max_model_len=256, prefill_chunk=100, kv_cache_dtype="fp8", index_cache_dtype="fp8")
    with tuning.override(target_programs=1, sparse_target_programs=1):
        llm = m3_torch.LLM(model_dir, **kwargs)
        assert llm.runner.pool.dtype == torch.uint8
        assert {c.k_cache.dtype for c in llm.runner.caches} == {torch.float8_e4m3fn}
        assert {c.index_k_cache.dtype for c in llm.runner.caches if c.index_k_cache is not None} == {torch.float8_e4m3fn}
        torch_out = generate_ids(llm, prompts, max_new_tokens=2)
        jax_llm = m3_jax.LLM(model_dir, **kwargs)
        assert jax_llm.runner.pool.dtype == np.uint8
        jax_out = generate_ids(jax_llm, prompts, max_new_tokens=2)
    assert_same_tokens(model_dir, prompts, torch_out, jax_out, 2)


@pytest.mark.long   # ~15 s on the interpreter (JAX compiles each step); test_sampling covers the runners' hunk
def test_engines_agree_on_a_constrained_request(model_dir):
    """Structured outputs through both runners (the token bitmask in the sampling kernel): a seeded
    sampled request constrained to a choice gives the same tokens, one of the choices, and logprobs over
    the allowed tokens only (the final eos, the one token allowed there, has logprob 0)."""
    pytest.importorskip("xgrammar")
    from m3_engine import SamplingParams
    from m3_engine.structured_outputs import StructuredOutputsParams

    choices = ["yes", "no", "maybe"]
    params = SamplingParams(seed=7, temperature=0.8, max_tokens=8, logprobs=2,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    outs = []
    with tuning.override(target_programs=1, sparse_target_programs=1):
        for llm in (m3_torch.LLM(model_dir, max_num_seqs=1, max_model_len=128),
                    m3_jax.LLM(model_dir, max_num_seqs=1, max_model_len=128)):
            out = llm.generate([prompt(5, seed=5)], params, use_tqdm=False)[0].outputs[0]
            assert out.text in choices and out.finish_reason == "stop", (out.text, out.finish_reason)
            assert out.logprobs[-1][out.token_ids[-1]].logprob == 0.0
            outs.append(out)
    assert outs[0].token_ids == outs[1].token_ids
    for t, j in zip(outs[0].logprobs, outs[1].logprobs):
        assert list(t) == list(j)
        np.testing.assert_allclose([v.logprob for v in t.values()], [v.logprob for v in j.values()], atol=1e-4)
