"""EAGLE-3 speculative decoding in the engine (``speculative_config={"method": "eagle3", ...}``), both frameworks.

The target is a tiny random M3 checkpoint, the draft a random head written by
``m3_engine.eagle3.write_random_eagle3`` (hidden 128, 2 heads of 32, a compressed
vocabulary of 200 ids). What is checked:

* greedy and seeded outputs with speculation equal the plain ones (batches of
  short and long prompts, chunked prefill beside verify steps, prefix caching);
* the draft's first pass fills the draft cache: the drafts the engine makes for a
  request equal the ones a direct ``Eagle3Draft.forward`` over the request's whole
  sequence gives (and the JAX engine's equal the torch engine's);
* acceptance, on a constructed pair: a target whose next token is a fixed function
  of the current one (every attention and MLP output zeroed: the residual stream is
  the token's embedding; the head swaps pairs of ids) and a draft that reads its
  last aux state (the target's last layer) back through an unswapped head. Its
  drafts are right for a request that repeats a token (all accepted) and right
  once per verify step for one that alternates two (draft 1 only).

The engine logic itself (which rows, positions, slots, prefix caching, the gate)
is tested fast over a stand-in model in test_speculative.py. On the CPU each model
step runs the kernels in Triton's interpreter: the long runs are ``long``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from m3_engine import SamplingParams, eagle3
from m3_engine.model_config import load_config
from m3_engine.tiny_model import write_tiny_checkpoint
from m3_kernels import tuning
from m3_kernels.planner import PAGE_SIZE, StepPlanner

K = 3


@pytest.fixture(autouse=True)
def one_program_per_tile(request):
    """No split-K in the interpreter (the kernels' own tests cover it): fewer programs. GPU tests
    keep the default tuning."""
    if request.node.get_closest_marker("gpu"):
        yield
        return
    with tuning.override(target_programs=1, sparse_target_programs=1):
        yield


DRAFT_SHAPES = dict(num_attention_heads=2, head_dim=32, intermediate_size=96)


def write_draft(path, target_dir, aux_layer_ids, **options):
    return eagle3.write_random_eagle3(path, load_config(target_dir), seed=1, aux_layer_ids=aux_layer_ids,
                                      **DRAFT_SHAPES, **options)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """The tiny M3 (4 layers: 1 dense, 3 MSA + MoE)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("eagle3-target") / "m", seed=0)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, target_dir):
    return write_draft(tmp_path_factory.mktemp("eagle3-draft") / "d", target_dir, (0, 2, 3), draft_vocab_size=200)


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory):
    """A 3-layer all-dense target (a quarter of the tiny M3's interpreter time) and its draft."""
    path = tmp_path_factory.mktemp("eagle3-dense")
    target = write_tiny_checkpoint(path / "m", seed=0, num_hidden_layers=3, num_dense_layers=3)
    return target, write_draft(path / "d", target, (0, 1, 2), draft_vocab_size=200)


def eagle(draft_dir, k=K):
    return {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k}


def llm_class(framework):
    return pytest.importorskip(f"m3_{framework}").LLM


def record_drafts(llm) -> list:
    """Wrap ``llm.runner.propose``: -> a list that gets ``(request id, its cached length, its drafts)``
    for each request of each draft pass."""
    recorded, propose = [], llm.runner.propose

    def spy(work):
        drafts = propose(work)
        for request_id, d in zip(work.request_ids.tolist(), drafts.tolist()):
            recorded.append((request_id, llm.engine.scheduler.requests[request_id].num_cached, d))
        return drafts

    llm.runner.propose = spy
    return recorded


def record_steps(llm) -> list:
    """Wrap ``llm.runner.submit``: -> the list of the steps it runs."""
    steps, submit = [], llm.runner.submit

    def spy(step, sampling, previous=None):
        steps.append(step)
        return submit(step, sampling, previous)

    llm.runner.submit = spy
    return steps


# -- the draft cache: engine drafts = a direct forward over the whole sequence ---------------------

def direct_drafts(llm, tokens, states, k):
    """The drafts of the torch engine ``llm``'s draft for a request whose sequence is ``tokens``, at
    each cached length ``N`` of ``states`` (its tokens then: ``tokens[:N + 1]``), computed from one
    target prefill of the whole sequence into fresh pools (aux states), one draft pass over it (row
    ``p`` takes ``tokens[p + 1]``), then each state's chain on that draft cache (largest ``N`` first:
    a chain writes past its own ``N`` only)."""
    from m3_torch.cache import allocate_pool, layer_caches
    from m3_torch.eagle3 import allocate_draft_cache
    from m3_torch.model import StepTensors

    runner = llm.runner
    model, draft = runner.model, runner.proposer.draft
    n = len(tokens) - 1
    table = torch.full((1, llm.scheduler_config.max_blocks), -1, dtype=torch.int32)
    table[0, :-(-n // PAGE_SIZE)] = torch.arange(-(-n // PAGE_SIZE))

    def step(ids, positions):
        positions = torch.as_tensor(positions, dtype=torch.int32)
        return StepTensors(input_ids=torch.as_tensor(ids, dtype=torch.int32), positions=positions,
                           slot_mapping=positions, block_table=table, seq_lens=positions[-1:] + 1,
                           logits_rows=torch.zeros(1, dtype=torch.int64))

    draft_planner = runner.proposer.planner
    caches = [layer_caches(allocate_pool(runner.layout, "cpu"), runner.layout, i)
              for i in range(model.config.num_hidden_layers)]
    plan = StepPlanner(llm.planner.config).plan([n], q_lens=[n], num_context=1)
    _, aux = model.hidden_states(step(tokens[:n], np.arange(n)), plan, caches, draft.config.aux_layer_ids)
    cache = allocate_draft_cache(draft.config, runner.layout.num_slots, "float32")
    plan = draft_planner.plan([n], q_lens=[n], num_context=1)
    h_all = draft.forward(step(tokens[1:n + 1], np.arange(n)), plan, cache.caches, aux)
    first_row = torch.zeros(1, dtype=torch.int64)
    out = {}
    for N in sorted(set(states), reverse=True):
        h = h_all[N - 1:N]
        drafts = [int(draft.draft_tokens(h, first_row))]
        for i in range(k - 1):
            plan = draft_planner.plan([N + i + 1], q_lens=[1], num_context=0)
            h = draft.forward(step([drafts[-1]], [N + i]), plan, cache.caches, h)
            drafts.append(int(draft.draft_tokens(h, first_row)))
        out[N] = drafts
    return out


def draft_run(framework, dense_dirs):
    """Two requests on the dense target, k = 3: a short prompt that verifies drafts beside the second
    chunk (of 4 tokens) of a longer one. -> (the engine, each request's whole sequence, the recorded
    drafts, the steps)."""
    target_dir, draft_dir = dense_dirs
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, 3).tolist(), rng.integers(3, 500, 8).tolist()]
    llm = llm_class(framework)(target_dir, device="cpu", max_num_seqs=2, max_model_len=256, prefill_chunk=4,
                               speculative_config=eagle(draft_dir))
    recorded, steps = record_drafts(llm), record_steps(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    return llm, [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)], recorded, steps


def test_torch_drafts_match_a_direct_forward(dense_dirs):
    """Every draft pass's drafts equal the direct forward's at that length: each position's draft
    K/V row was written, with the token after it, by the first passes (prompt chunks, verify rows
    whose drafts were mostly rejected, both in one step)."""
    llm, sequences, recorded, steps = draft_run("torch", dense_dirs)
    with llm:
        assert any(s.num_context and s.num_verify_rows for s in steps), "expected chunks beside a verify step"
        want = {i: direct_drafts(llm, tokens, [N for r, N, _ in recorded if r == i], K)
                for i, tokens in enumerate(sequences)}
    assert sorted((r, N) for r, N, _ in recorded) == [(0, 3), (0, 4), (1, 8), (1, 9)]
    assert recorded == [(r, N, want[r][N]) for r, N, _ in recorded]


@pytest.mark.long   # ~30 s on the interpreter: the JAX engine compiles a dozen functions
def test_jax_drafts_equal_torch(dense_dirs):
    """The JAX engine's drafts (its first pass runs the target step as padded to its buckets: the
    verify row after the chunk's padding tokens) equal the torch engine's."""
    results = {}
    for framework in ("torch", "jax"):
        llm, sequences, recorded, _ = draft_run(framework, dense_dirs)
        llm.close()
        results[framework] = sequences, recorded
    assert results["jax"] == results["torch"]


# -- acceptance: a constructed target and draft ----------------------------------------------------

SWAP_FROM = 16   # the constructed target maps id t >= 16 to its pair (t ^ 1), and keeps ids below


@pytest.fixture(scope="module")
def constructed_dirs(tmp_path_factory):
    """A target whose greedy next token is ``t ^ 1`` for ``t >= SWAP_FROM`` and ``t`` below (every
    attention and MLP output zeroed: the residual stream is the token's embedding; final norm scale
    1; the head is the embedding with pairs of rows swapped), and a draft that proposes its last aux
    state's token (``fc`` picks the target's last layer, attention and MLP outputs zeroed, the head
    the unswapped embedding): draft ``j`` after a request's tokens ``..., u, v`` is ``u``."""
    path = tmp_path_factory.mktemp("eagle3-constructed")
    target = write_tiny_checkpoint(path / "m", seed=0, form="text", num_hidden_layers=3, num_dense_layers=3)
    tensors = load_file(target / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    ids = np.arange(len(embed))
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = np.zeros_like(tensors[name])
    tensors["model.norm.weight"] = np.zeros_like(tensors["model.norm.weight"])
    tensors["lm_head.weight"] = embed[np.where(ids >= SWAP_FROM, ids ^ 1, ids)].copy()
    save_file(tensors, target / "model.safetensors")
    draft = write_draft(path / "d", target, (0, 1, 2), names="layers")
    tensors = load_file(draft / "model.safetensors")
    hidden = embed.shape[1]
    tensors["fc.weight"] = np.concatenate([np.zeros((hidden, 2 * hidden), np.float32),
                                           np.eye(hidden, dtype=np.float32)], axis=1)
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        tensors[name] = np.zeros_like(tensors[name])
    tensors["norm.weight"] = np.ones_like(tensors["norm.weight"])
    tensors["lm_head.weight"] = embed.copy()
    save_file(tensors, draft / "model.safetensors")
    return target, draft


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_constructed_drafts_are_accepted(constructed_dirs, framework):
    """A request that ends in a fixed point repeats it: every draft is accepted (k + 1 tokens a step);
    one that ends in a swapped id alternates two ids: draft 1 is right (the token two back) and the
    others are not, in the same verify steps."""
    target_dir, draft_dir = constructed_dirs
    with llm_class(framework)(target_dir, device="cpu", max_num_seqs=2, max_model_len=128,
                              speculative_config=eagle(draft_dir)) as llm:
        repeat, alternate = llm.generate([[40, 50, 7], [60, 70, 100]],
                                         [SamplingParams(max_tokens=m, ignore_eos=True) for m in (9, 5)],
                                         use_tqdm=False)
        steps = llm.engine.stats["steps"]
    assert repeat.outputs[0].token_ids == [7] * 9
    assert alternate.outputs[0].token_ids == [101, 100, 101, 100, 101]
    m = repeat.metrics      # 1 + 4 + 4 tokens
    assert m.num_accepted_tokens == m.num_draft_tokens == 2 * K and m.num_verify_steps == 2
    m = alternate.metrics   # 1 + 2 + 2 tokens (the last step has room for 1 draft)
    assert m.num_accepted_tokens == m.num_verify_steps == 2 and m.num_draft_tokens == K + 1
    assert steps == 3


# -- speculative = plain ---------------------------------------------------------------------------

def mixed_prompts():
    """A short prompt, one of two full blocks and more, one prefilled in chunks beside verify steps,
    and (run after the others) one that shares the second one's two full blocks."""
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 500, 2 * PAGE_SIZE + 20).tolist()
    return [rng.integers(3, 500, 7).tolist(), shared, rng.integers(3, 500, 150).tolist(),
            shared[:2 * PAGE_SIZE] + rng.integers(3, 500, 9).tolist()]


def generate_mixed(llm) -> list:
    """Greedy outputs of :func:`mixed_prompts` (the last one in a second batch: it finds the second
    one's blocks in the prefix cache), then a seeded sample of the first."""
    prompts = mixed_prompts()
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=11)
    outs = llm.generate(prompts[:3], greedy, use_tqdm=False) + llm.generate(prompts[3:], greedy, use_tqdm=False)
    outs += llm.generate(prompts[:1], seeded, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


_PLAIN: dict = {}


@pytest.mark.long   # minutes on the interpreter
@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("k", [1, K])
def test_eagle3_matches_plain(target_dir, draft_dir, framework, k):
    """The tiny M3 (MSA + MoE layers) with prefix caching: greedy and seeded outputs with EAGLE-3
    speculation equal the plain ones; a prompt sharing two full blocks with an earlier one reuses
    one (the draft needs the other recomputed)."""
    LLM = llm_class(framework)
    options = dict(device="cpu", max_num_seqs=4, max_model_len=512, prefill_chunk=64, enable_prefix_caching=True)
    if framework not in _PLAIN:
        with LLM(target_dir, **options) as llm:
            _PLAIN[framework] = generate_mixed(llm)
    with LLM(target_dir, speculative_config=eagle(draft_dir, k), **options) as llm:
        steps = record_steps(llm)
        got = generate_mixed(llm)
        stats = llm.engine.stats
    assert got == _PLAIN[framework]
    assert stats["spec_verify_steps"] > 0 and stats["prefix_cache_hit_tokens"] == PAGE_SIZE
    assert any(s.num_context and s.num_verify_rows for s in steps), "expected chunks beside a verify step"
    assert all(s.plan.generation.decode_query_len == k + 1 for s in steps if s.num_verify_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_gpu_eagle3_matches_plain(target_dir, draft_dir, framework):
    """On the GPU (float32; torch: CUDA graphs for decode and verify steps, which return the aux
    states too; JAX: compiled steps): greedy and seeded outputs with EAGLE-3 speculation equal the
    plain ones, the verify steps replay graphs of k + 1 tokens a row, and every pass drafts."""
    LLM = llm_class(framework)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, 40).tolist(), rng.integers(3, 500, 7).tolist(), rng.integers(3, 500, 320).tolist()]
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    seeded = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=11)
    options = dict(dtype="float32", device="cuda", max_num_seqs=4, max_model_len=512, prefill_chunk=32)
    results = {}
    for name, spec in (("plain", None), ("spec", eagle(draft_dir))):
        with LLM(target_dir, speculative_config=spec, **options) as llm:
            recorded = record_drafts(llm) if spec else []
            results[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            results[name + "-seeded"] = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded,
                                                                                       use_tqdm=False)]
            if spec:
                stats = llm.engine.stats
                assert stats["spec_verify_steps"] > 0 and recorded, (framework, stats)
                if framework == "torch":   # verify steps replayed from graphs of k + 1 tokens a row
                    assert any(n == K + 1 for _, n, _ in llm.runner.graphs.graphs)
    assert results["spec"] == results["plain"]
    assert results["spec-seeded"] == results["plain-seeded"]
