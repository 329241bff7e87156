"""m3_jax's MiniMax-M3 model and engine against transformers 5.23 (the semantic reference).

CPU, float32, the tiny random checkpoint of ``m3_engine.tiny_model`` (layer 0
dense attention + dense MLP, layers 1-3 MSA + MoE, top-2 blocks of 128: the
selection matters from 257 tokens on). The reference is
``MiniMaxM3VLForCausalLM`` with eager attention (tests/helpers/hf_reference.py, shared
with the torch and cross-framework tests). Tokens are compared up to the first
step whose reference top-2 margin is below 1e-3 (a near-tie tests nothing).

Every kernel runs in Triton's interpreter: the long prompts cost minutes, so
the 700-token generation is marked ``slow``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import m3_jax
from m3_jax import model as jm
from m3_engine import checkpoint
from m3_kernels import planner, tuning
from m3_engine.model_config import load_config
from m3_engine.scheduler import Scheduler
from m3_engine.tiny_model import write_tiny_checkpoint

import hf_reference
from jax_helpers import _jax_device, jax_gpu_ready  # noqa: F401  (autouse: CPU tests run on JAX's CPU device)
from engine_helpers import generate_ids

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m3_tiny_jax"), seed=0, form="text")


@pytest.fixture(scope="module")
def config(model_dir):
    return load_config(model_dir)


@pytest.fixture(scope="module")
def params(model_dir, config):
    with jax.default_device(jax.devices("cpu")[0]):
        return {n: jnp.asarray(w) for n, w in checkpoint.iter_weights(model_dir, config, framework="numpy")}


@pytest.fixture
def one_program_per_tile():
    """Fewer interpreter programs (no split-K): the model tests pay per program."""
    with tuning.override(target_programs=1, sparse_target_programs=1):
        yield


def prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 512, n).tolist()   # 0-2 are pad/bos/eos


def forward_prompt(params, config, tokens, chunks, *, dtype="float32", seed=0):
    """Logits ``[len(tokens), vocab]`` of one request prefilled in ``chunks`` (jitted model.forward over a
    NaN-filled pool with shuffled slots: a read of a row nobody wrote would poison the logits)."""
    num_slots = 8
    max_blocks = -(-len(tokens) // 128)
    layout = jm.pool_layout(config, num_slots, dtype)
    pool = jnp.full(layout.shape, jnp.nan, jnp.dtype(dtype))
    table = np.random.default_rng(seed).permutation(num_slots).astype(np.int32)[None, :max_blocks]
    plans = planner.StepPlanner(planner.StepConfig(
        num_q_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
        max_batch=1, max_num_tokens=len(tokens), max_blocks=max_blocks, topk=config.index_topk_blocks))
    step = jax.jit(jm.forward, static_argnames=("config", "layout", "spec"), donate_argnames=("pool",))
    ids, logits, start = np.asarray(tokens, np.int32), [], 0
    for q in chunks:
        pos = np.arange(start, start + q, dtype=np.int32)
        spec, maps = m3_jax.step_inputs(plans.plan([start + q], q_lens=[q], num_context=1))
        batch = jm.StepBatch(ids[pos], pos, (table[0, pos // 128] * 128 + pos % 128).astype(np.int32), table,
                             np.asarray([start + q], np.int32), np.arange(q, dtype=np.int32))
        out, pool = step(params, pool, batch, maps, config=config, layout=layout, spec=spec)
        logits.append(np.asarray(out))
        start += q
    return np.concatenate(logits)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


# -- building blocks against transformers' modules ------------------------------------------------

def test_layers_match_transformers_modules(model_dir, config):
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf

    model = hf_reference.reference_model(model_dir)
    layer = model.model.layers[1]                      # MSA + MoE
    x = torch.randn(37, config.hidden_size)
    xj = jnp.asarray(x.numpy())

    def close(got, want, tol=1e-5):
        assert rel_err(got, want.detach().numpy()) < tol

    with torch.no_grad():
        close(jm.rms_norm(xj, jnp.asarray(layer.input_layernorm.weight.numpy()), config.rms_norm_eps),
              layer.input_layernorm(x))
        p = {n: jnp.asarray(t.numpy()) for n, t in layer.mlp.named_parameters()}
        p["gate.e_score_correction_bias"] = jnp.asarray(layer.mlp.gate.e_score_correction_bias.numpy())
        close(jm.moe(p, xj, config), layer.mlp(x[None])[0])
        dense = model.model.layers[0].mlp
        close(jm.mlp(xj, jnp.asarray(dense.gate_up_proj.weight.numpy()), jnp.asarray(dense.down_proj.weight.numpy()),
                      config), dense(x))
        # partial RoPE, with the table transformers builds (rotary_dim of head_dim channels)
        positions = torch.arange(300, 337)[None]
        cos, sin = model.model.rotary_emb(x[None], positions)
        q, k = torch.randn(1, 4, 37, config.head_dim), torch.randn(1, 2, 37, config.head_dim)
        want_q, want_k = hf.apply_rotary_pos_emb(q, k, cos, sin)
        jcos, jsin = jm.rope_cos_sin(jnp.asarray(positions[0].numpy()), jm.inv_freq(config), jnp.float32)
        assert jcos.shape[-1] == config.rotary_dim < config.head_dim
        close(jm.apply_rope(jnp.asarray(q[0].transpose(0, 1).numpy()), jcos, jsin), want_q[0].transpose(0, 1))
        close(jm.apply_rope(jnp.asarray(k[0].transpose(0, 1).numpy()), jcos, jsin), want_k[0].transpose(0, 1))


def test_indexer_selection_matches_transformers(model_dir, config):
    """Our index_scores + select_blocks kernels pick, per index head and token, the same SET of blocks as
    transformers' MiniMaxM3VLIndexer (which lists them by descending score, ours ascending)."""
    model = hf_reference.reference_model(model_dir)
    indexer = model.model.layers[2].self_attn.indexer
    T, Di, topk = 300, config.index_head_dim, config.index_topk_blocks
    h = torch.randn(1, T, config.hidden_size)
    positions = torch.arange(T)[None]
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(h, positions)
        want = indexer(h, (cos, sin), None, positions)[0].numpy()            # [Hi, T, topk], -1 padded

    p = {n: jnp.asarray(t.detach().numpy()) for n, t in indexer.named_parameters()}
    x = jnp.asarray(h[0].numpy())
    jcos, jsin = jm.rope_cos_sin(jnp.arange(T), jm.inv_freq(config), jnp.float32)
    jcos, jsin = jcos[:, :Di], jsin[:, :Di]
    idx_q = jm.apply_rope(jm.rms_norm((x @ p["q_proj.weight"].T).reshape(T, -1, Di), p["q_norm.weight"],
                                      config.rms_norm_eps), jcos, jsin)
    idx_k = jm.apply_rope(jm.rms_norm((x @ p["k_proj.weight"].T).reshape(T, 1, Di), p["k_norm.weight"],
                                      config.rms_norm_eps), jcos, jsin)[:, 0]
    pages = np.array([2, 0, 3], np.int32)                                    # shuffled pages, one spare
    cache = np.full((4, 128, Di), np.nan, np.float32)
    for b, page in enumerate(pages):
        rows = np.asarray(idx_k[b * 128:(b + 1) * 128])
        cache[page, :len(rows)] = rows
    meta = (jnp.asarray(pages[None]), jnp.asarray([T], jnp.int32))
    cu = np.array([0, T], np.int32)
    scores = m3_jax.index_scores_prefill(idx_q, jnp.asarray(cache), *meta, cu_seqlens_q=cu)
    got = np.asarray(m3_jax.select_blocks_prefill(scores, meta[1], cu_seqlens_q=cu, topk=topk, init_blocks=0,
                                                  local_blocks=config.index_local_blocks))
    for i in range(want.shape[0]):
        for t in range(T):
            assert set(got[i, t]) - {-1} == set(want[i, t]) - {-1}, (i, t, got[i, t], want[i, t])
    assert (got[:, 256:] >= 0).all() and len(set(got[:, 256:, 0].ravel())) > 1  # the selection mattered


# -- the model and the engine against transformers -------------------------------------------------

@pytest.mark.parametrize("n, chunks", [(1, (1,)), (130, (100, 30)),
                                       pytest.param(300, (172, 128), marks=pytest.mark.long)],
                         ids=["1", "130_chunked", "300_chunked"])
def test_prompt_logits_match_transformers(model_dir, config, params, n, chunks, one_program_per_tile):
    tokens = prompt(n, seed=n)
    got = forward_prompt(params, config, tokens, chunks)
    want = hf_reference.reference_prompt_logits(model_dir, tokens).numpy()
    assert np.isfinite(got).all()
    assert rel_err(got, want) < 1e-4
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.long
def test_generate_matches_transformers(model_dir, one_program_per_tile):
    """Prompts of 1, 127, 129 and 700 tokens in one batch: a first step with every prompt (the 700-token one
    chunked), a mixed step (its last chunk + three generation rows), then decode steps that cross block
    boundaries. Greedy tokens equal transformers'; the decode step compiled once per batch size."""
    prompts = [prompt(n, seed=n) for n in (1, 127, 129, 700)]
    llm = m3_jax.LLM(model_dir, max_num_seqs=4, max_model_len=1024, prefill_chunk=500)
    outputs = generate_ids(llm, prompts, max_new_tokens=NEW_TOKENS)
    checked = [hf_reference.assert_tokens_match(hf_reference.reference_generate(model_dir, p, NEW_TOKENS), out)
               for p, out in zip(prompts, outputs)]
    assert sum(checked) >= 2 * NEW_TOKENS
    decode = [s.generation_rows for s in llm.runner.compiled_forwards if s.context_rows == 0]
    assert sorted(decode) == sorted(set(decode)), decode        # one compilation per decode batch size, whatever
    assert len(decode) < NEW_TOKENS // 2                        # the lengths (127 + 16 crosses a block)
    assert any(s.context_rows and s.generation_rows for s in llm.runner.compiled_forwards)   # a mixed step ran


@pytest.mark.long
def test_batching_is_invisible(model_dir, monkeypatch, one_program_per_tile):
    """Another order, prefill chunk and batch size than the transformers test, and a pool too small for all
    three requests at once: the third waits for freed slots. The pool starts NaN and every slot freed by a
    finished request is poisoned with NaN before it is reused: no stale row is ever read."""
    prompts = [prompt(1, seed=1), prompt(127, seed=127), prompt(129, seed=129)]
    llm = m3_jax.LLM(model_dir, max_num_seqs=2, max_model_len=256, num_gpu_blocks_override=3, prefill_chunk=64)
    llm.runner.pool = jnp.full(llm.runner.pool.shape, jnp.nan, llm.runner.pool.dtype)
    freed, finish = [], Scheduler._finish

    def poison(scheduler, request):
        freed.append(request.slots.tolist())
        slots = llm.runner.pool.reshape(llm.runner.pool_layout.num_slots, -1)
        llm.runner.pool = slots.at[jnp.asarray(request.slots)].set(jnp.nan).reshape(-1)
        finish(scheduler, request)

    monkeypatch.setattr(Scheduler, "_finish", poison)
    outputs = generate_ids(llm, prompts, max_new_tokens=6)
    assert len(freed) == 3 and set(freed[2]) & (set(freed[0]) | set(freed[1]))   # the last one reused slots
    decode = [s.generation_rows for s in llm.runner.compiled_forwards if s.context_rows == 0]
    assert sorted(decode) == sorted(set(decode))   # one decode compilation per batch size, though 127 + 6 crosses
    for p, out in zip(prompts, outputs):
        ref = hf_reference.reference_generate(model_dir, p, NEW_TOKENS)
        cut = dataclasses.replace(ref, tokens=ref.tokens[:6], margins=ref.margins[:6])
        hf_reference.assert_tokens_match(cut, out)


# -- the engine's contract ---------------------------------------------------------------------

def test_bad_input_fails_before_any_work(model_dir):
    llm = m3_jax.LLM(model_dir, max_num_seqs=2, max_model_len=256)
    good = prompt(4, seed=4)
    for bad, match in (([[]], "empty"), ([prompt(257, seed=1)], "max_model_len"), ([good + [512]], "vocabulary"),
                       ([good, [-1]], "vocabulary")):
        with pytest.raises(ValueError, match=match):
            generate_ids(llm, bad, max_new_tokens=2)
    for kwargs, match in ((dict(max_new_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
                          (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p")):
        with pytest.raises(ValueError, match=match):
            generate_ids(llm, [good], **kwargs)
    with pytest.raises(TypeError, match="seed"):
        generate_ids(llm, [good], seed=1.5)
    assert not llm.engine.scheduler.has_unfinished() and not llm.runner.compiled_forwards  # nothing queued, nothing ran

    with pytest.raises(ValueError, match="num_gpu_blocks_override"):
        m3_jax.LLM(model_dir, max_num_seqs=2, max_model_len=1024, num_gpu_blocks_override=7)
    with pytest.raises(ValueError, match="dtype"):
        m3_jax.LLM(model_dir, dtype="int8")
    with pytest.raises(TypeError, match="dtype"):
        m3_jax.LLM(model_dir, dtype=object())
    with pytest.raises(ValueError, match="max_num_seqs"):
        m3_jax.LLM(model_dir, max_num_seqs=0)


def test_dtype_and_device_arguments(model_dir):
    cpu = jax.devices("cpu")[0]
    for dtype in ("bfloat16", jnp.bfloat16, jnp.dtype("bfloat16")):
        llm = m3_jax.LLM(model_dir, dtype=dtype, device=cpu, max_num_seqs=1, max_model_len=128)
        assert llm.runner.dtype == "bfloat16" and llm.runner.pool.dtype == jnp.bfloat16
        assert {w.dtype for w in llm.runner.params.values()} == {jnp.dtype(jnp.bfloat16)}
    llm = m3_jax.LLM(model_dir, device="cpu:0", max_num_seqs=1, max_model_len=128)
    assert llm.runner.dtype == "float32" and llm.runner.pool.devices() == {cpu}


@pytest.mark.long
def test_seeded_generation_is_reproducible(model_dir, one_program_per_tile):
    llm = m3_jax.LLM(model_dir, max_num_seqs=2, max_model_len=128)
    prompts = [prompt(5, seed=5), prompt(2, seed=2)]
    kwargs = dict(max_new_tokens=3, temperature=5.0, top_p=0.9)
    first = generate_ids(llm, prompts, seed=11, **kwargs)
    assert generate_ids(llm, prompts[:1], seed=11, **kwargs)[0] == first[0]   # alone or batched: same tokens
    # (a different seed gives different draws: test_sampling)


# -- GPU --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not jax_gpu_ready(), reason="needs a JAX GPU backend and jax_triton")
def test_gpu_bf16_against_transformers(tmp_path):
    """bf16 weights and activations on the GPU: logits within a bf16 tolerance of the fp32 reference;
    the token agreement rate of the engine's greedy tokens is reported."""
    model_dir = write_tiny_checkpoint(tmp_path / "bf16", seed=0, form="text", dtype="bfloat16")
    config = load_config(model_dir)
    gpu = jax.devices("gpu")[0]
    with jax.default_device(gpu):
        params = {n: jnp.asarray(w) for n, w in checkpoint.iter_weights(model_dir, config, framework="numpy")}
        tokens = prompt(700, seed=700)
        got = forward_prompt(params, config, tokens, (300, 400), dtype="bfloat16")
    want = hf_reference.reference_prompt_logits(model_dir, tokens).numpy()
    yardstick = hf_reference.own_half_precision_error(model_dir, tokens, torch.bfloat16)
    err = rel_err(got, want)
    print(f"bf16 prompt logits rel. error {err:.2e}, transformers' own bf16 {yardstick:.2e}")
    assert err <= 2 * yardstick + 1e-3
    prompts = [prompt(n, seed=n) for n in (1, 127, 129, 700)]
    llm = m3_jax.LLM(model_dir, device=gpu, max_num_seqs=4, max_model_len=1024, prefill_chunk=500)
    outputs = generate_ids(llm, prompts, max_new_tokens=NEW_TOKENS)
    agree = total = 0
    for p, out in zip(prompts, outputs):
        ref = hf_reference.reference_generate(model_dir, p, NEW_TOKENS).tokens
        n = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        agree, total = agree + n, total + len(ref)
    print(f"bf16 JAX engine vs fp32 transformers: {agree}/{total} greedy tokens agree before the first divergence")
    decode = [s.generation_rows for s in llm.runner.compiled_forwards if s.context_rows == 0]
    assert sorted(decode) == sorted(set(decode))   # one decode compilation per batch size


def test_step_inputs_travel_packed_in_one_array():
    """pack_inputs / unpack_inputs: every array of the step's pytree comes back with its shape, dtype and
    bits (float32 NaN payloads, -0.0 and infinities included), the structure (NamedTuple, dict, None) too."""
    from m3_jax.runner import pack_inputs, unpack_inputs

    rng = np.random.default_rng(5)
    special = np.array([np.nan, -0.0, np.inf, -np.inf], np.float32)
    special[0] = np.frombuffer(np.uint32(0x7FC01234).tobytes(), np.float32)[0]   # a NaN with a payload
    batch = jm.StepBatch(*(rng.integers(-2 ** 31, 2 ** 31 - 1, shape, dtype=np.int32)
                           for shape in ((7,), (7,), (7,), (3, 5), (3,), (3,))))
    tree = (batch, None, {"temperature": np.concatenate([rng.random(6, np.float32), special]),
                          "seeds": rng.integers(0, 2 ** 31, (10, 2), dtype=np.int32), "scalar": np.int32(4)})
    flat, packing = pack_inputs(tree)
    assert flat.dtype == np.int32 and flat.ndim == 1
    got = jax.jit(unpack_inputs, static_argnums=1)(jnp.asarray(flat), packing)
    want_leaves, want_def = jax.tree_util.tree_flatten(tree)
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    assert got_def == want_def and isinstance(got[0], jm.StepBatch) and got[1] is None
    for g, w in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype and g.tobytes() == w.tobytes()
    assert all(offset % 4 == 0 for _, _, offset in packing.leaves)   # 16-byte aligned slices (Triton operands)
    with pytest.raises(TypeError, match="int32 / float32"):
        pack_inputs({"ids": np.zeros(3, np.int64)})


@pytest.mark.parametrize("num_logprobs", [None, 0, 3])
def test_step_outputs_travel_packed_in_one_array(num_logprobs):
    """pack_outputs (traced) / unpack_outputs (host): the sampled outputs, float32 bits included."""
    from m3_jax.runner import pack_outputs, unpack_outputs

    rng = np.random.default_rng(6)
    rows = 5
    out = {"tokens": rng.integers(0, 2 ** 31, rows, dtype=np.int32),
           "logprobs": np.concatenate([-rng.random(rows - 2, np.float32), np.array([-0.0, -np.inf], np.float32)])}
    if num_logprobs is not None:
        out["ranks"] = rng.integers(1, 100, rows, dtype=np.int32)
        if num_logprobs:
            out["top_ids"] = rng.integers(0, 1000, (rows, num_logprobs), dtype=np.int32)
            out["top_logprobs"] = -rng.random((rows, num_logprobs), np.float32)
    flat = jax.jit(pack_outputs, static_argnums=1)({k: jnp.asarray(v) for k, v in out.items()}, num_logprobs)
    assert flat.dtype == jnp.int32 and flat.ndim == 1
    got = unpack_outputs(np.asarray(flat), rows, num_logprobs)
    assert sorted(got) == sorted(out)
    for name, want in out.items():
        assert got[name].shape == want.shape and got[name].dtype == want.dtype
        assert got[name].tobytes() == want.tobytes(), name
