"""m3_torch.LLM / m3_torch.model against transformers 5.23's MiniMaxM3VLForCausalLM (fp32, eager attention).

The tiny random checkpoint (``m3_engine.tiny_model``, original MiniMax-M3 VL
names): layer 0 dense attention + dense MLP, layers 1-3 MSA + MoE, 2 KV heads,
top-2 blocks of 128, so prompts of 700 tokens select among 6 blocks. Greedy
tokens are compared up to the first step where the reference's top-2 logit
margin is below 1e-3 (``hf_reference.assert_tokens_match``).

CPU budget: every prompt token costs a few interpreted Triton programs per
layer, so the model tests' prompts (1, 127, 129, 700 tokens) run ONCE, in one
batch, and the batching / slot-reuse runs use shorter prompts.
"""

import copy

import numpy as np
import pytest
import torch

import m3_torch
from m3_kernels import tuning
from m3_engine.tiny_model import write_tiny_checkpoint
from engine_helpers import generate_ids

hf_reference = pytest.importorskip("hf_reference")
pytest.importorskip("transformers")

PROMPT_LENS = (1, 127, 129, 700)
NEW_TOKENS = 16


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m3_torch_tiny"), seed=0)


@pytest.fixture(scope="session")
def gpu_tiny_dir(tmp_path_factory):
    """Head dims of 64 (the GPU kernels' smallest tuned size)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m3_torch_tiny_gpu"), seed=0, head_dim=64, index_head_dim=64,
                                 rotary_dim=32)


@pytest.fixture
def one_program_per_tile():
    """Interpreter: one program per row tile, no split-K (the kernels' own tests cover split-K)."""
    with tuning.override(target_programs=1, sparse_target_programs=1):
        yield


def prompt(length, seed):
    """Random ids, never the special tokens 0-2 (pad, bos, eos)."""
    return np.random.default_rng(seed).integers(3, 512, length).tolist()


def record_prompt_logits(llm):
    """Make ``llm`` compute logits for EVERY token of its context rows; -> {request id: {position: logits}}."""
    seen = {}
    step_logits = llm.runner.step_logits

    def all_rows(step, carried=None):
        if step.num_context == 0:
            return step_logits(step, carried)
        rows = np.arange(step.num_tokens, dtype=np.int32)
        logits = llm.runner.model.forward(llm.runner.step_tensors(step, logits_rows=rows), step.plan, llm.runner.caches).float()
        for i, (request, _) in enumerate(step.rows[:step.num_context]):
            for t in range(step.cu_seqlens_q[i], step.cu_seqlens_q[i + 1]):
                seen.setdefault(request.id, {})[int(step.positions[t])] = logits[t]
        return logits[torch.from_numpy(step.logits_indices).long()]

    llm.runner.step_logits = all_rows
    return seen


def stacked(by_position: dict, length: int) -> torch.Tensor:
    assert sorted(by_position) == list(range(length))
    return torch.stack([by_position[p] for p in range(length)]).cpu()


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def transformers_errors(model_dir, prompts, dtype) -> list:
    """transformers' own prompt-logit error in ``dtype`` against its float32 run, per prompt: the
    yardstick of a half-precision engine (in bf16 a random tiny MoE model flips some expert choices,
    and its logits at later positions move by ~10%)."""
    model = copy.deepcopy(hf_reference.reference_model(str(model_dir))).to(dtype)
    errors = []
    with torch.no_grad():
        for p in prompts:
            logits = model(torch.tensor([p]), use_cache=False).logits[0].float()
            errors.append(rel_err(logits, hf_reference.reference_prompt_logits(model_dir, p)))
    return errors


# -- the model's building blocks vs transformers' modules (no kernels) ---------------------------

def test_mlps_match_transformers(tiny_dir):
    llm = m3_torch.LLM(tiny_dir, device="cpu", max_num_seqs=1, max_model_len=128)
    ref = hf_reference.reference_model(str(tiny_dir))
    h = torch.randn(37, llm.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for i in range(llm.config.num_hidden_layers):   # layer 0: dense SwiGLU-OAI; 1-3: MoE + shared expert
        with torch.no_grad():
            expected = ref.model.layers[i].mlp(h[None])[0]
        torch.testing.assert_close(llm.runner.model.mlp(i, h), expected, rtol=1e-5, atol=1e-5)


def test_block_selection_matches_transformers_indexer(tiny_dir):
    """Our index projections + index_scores/select_blocks choose the blocks transformers' indexer
    chooses, per token and index head, as SETS (transformers lists them by score, SPEC ascending)."""
    llm = m3_torch.LLM(tiny_dir, device="cpu", max_num_seqs=1, max_model_len=512)
    ref = hf_reference.reference_model(str(tiny_dir))
    c, layer, T = llm.config, 2, 420                    # 4 blocks, top-2: selection matters from token 256
    h = torch.randn(T, c.hidden_size, generator=torch.Generator().manual_seed(5))
    positions = torch.arange(T)
    _, _, _, idx_q, idx_k = llm.runner.model.projections(layer, h, positions)
    index_k_cache = torch.full((4, 128, c.index_head_dim), float("nan"))   # rows past T stay NaN
    index_k_cache.view(-1, c.index_head_dim)[:T] = idx_k
    table, lens, cu = (torch.arange(4, dtype=torch.int32)[None], torch.tensor([T], dtype=torch.int32),
                       torch.tensor([0, T], dtype=torch.int32))
    scores = m3_torch.index_scores_prefill(idx_q, index_k_cache, table, lens, cu_seqlens_q=cu)
    ours = m3_torch.select_blocks_prefill(scores, lens, cu_seqlens_q=cu, topk=c.index_topk_blocks,
                                          init_blocks=c.index_init_blocks, local_blocks=c.index_local_blocks)
    with torch.no_grad():
        cos, sin = ref.model.rotary_emb(h[None], positions[None])
        theirs = ref.model.layers[layer].self_attn.indexer(h[None], (cos, sin), None, positions[None])[0]
    unused = torch.iinfo(torch.int32).max           # -1 (no block) sorts last in both
    as_sets = [x.long().masked_fill(x < 0, unused).sort(dim=-1).values for x in (ours, theirs)]
    assert torch.equal(*as_sets)
    own_block = positions // 128                    # the forced local block: transformers lists it first (+inf
    assert (theirs[:, :, 0] == own_block).all()     # score), we list it last (ascending ids)
    assert (ours[:, 128:, -1] == own_block[128:]).all()


# -- prompt logits and greedy tokens vs transformers -----------------------------------------------

@pytest.mark.parametrize("lengths, new_tokens", [((1, 127, 129), 6),
                                                 pytest.param(PROMPT_LENS, NEW_TOKENS, marks=pytest.mark.long)],
                         ids=["1-129", "1-700"])
def test_prompt_logits_and_greedy_tokens_match_transformers(tiny_dir, one_program_per_tile, lengths, new_tokens):
    """Prompts of 1, 127, 129 (and 700, 16 tokens each: a long run) tokens in one batch (chunked
    prefill, mixed steps)."""
    prompts = [prompt(n, seed=n) for n in lengths]
    llm = m3_torch.LLM(tiny_dir, device="cpu", max_num_seqs=4, max_model_len=1024, prefill_chunk=384)
    assert llm.runner.dtype == torch.float32
    seen = record_prompt_logits(llm)
    outputs = generate_ids(llm, prompts, max_new_tokens=new_tokens)
    for request_id, (p, tokens) in enumerate(zip(prompts, outputs)):
        ours = stacked(seen[request_id], len(p))
        expected = hf_reference.reference_prompt_logits(tiny_dir, p)
        assert rel_err(ours, expected) < 1e-5, f"prompt of {len(p)} tokens"
        torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
        ref = hf_reference.reference_generate(tiny_dir, p, new_tokens)
        checked = hf_reference.assert_tokens_match(ref, tokens)
        assert checked == new_tokens, f"prompt of {len(p)} tokens: only {checked} steps checked (near tie or eos)"


# -- batching, chunking and slot reuse are invisible -----------------------------------------------

BATCH_LENS = (40, 260, 1)   # 260: 3 blocks, top-2 selection matters
BATCH_NEW = 5


def poison_free_slots(llm, reused):
    """Before every step: NaN into every pool slot no running request holds; note slots that changed hands."""
    pool = llm.runner.pool.view(llm.runner.layout.num_slots, llm.runner.layout.slot_numel)
    owners: dict = {}
    step_logits = llm.runner.step_logits

    def poisoned_step(step, carried=None):
        held = set()
        for request in llm.engine.scheduler.requests.values():
            if not request.finished:
                held.update(request.slots.tolist())
                for slot in request.slots.tolist():
                    owners.setdefault(slot, set()).add(request.id)
        pool[sorted(set(range(llm.runner.layout.num_slots)) - held)] = float("nan")
        reused[:] = [s for s, ids in owners.items() if len(ids) > 1]
        return step_logits(step, carried)

    pool.fill_(float("nan"))
    llm.runner.step_logits = poisoned_step


@pytest.mark.parametrize("order, chunk, max_num_seqs, pages", [
    pytest.param((0, 1, 2), 64, 3, None, marks=pytest.mark.long),   # all at once, prompts in 64-token chunks
    ((2, 1, 0), 100, 2, 4),       # two rows, 4 pages: the 40-token prompt waits, then reuses a freed (NaN) slot
], ids=["batch3_chunk64", "batch2_chunk100_pages4"])
def test_batching_is_invisible(tiny_dir, one_program_per_tile, order, chunk, max_num_seqs, pages):
    """Each prompt's tokens inside a batch (any order, chunk size, slot reuse) are those of the prompt
    alone: transformers' for all of them, and our engine's for the 40-token prompt."""
    prompts = [prompt(n, seed=100 + n) for n in BATCH_LENS]
    llm = m3_torch.LLM(tiny_dir, device="cpu", max_num_seqs=max_num_seqs, max_model_len=384, prefill_chunk=chunk,
                       num_gpu_blocks_override=pages)
    reused: list = []
    poison_free_slots(llm, reused)
    outputs = dict(zip(order, generate_ids(llm, [prompts[i] for i in order], max_new_tokens=BATCH_NEW)))
    refs = [hf_reference.reference_generate(tiny_dir, p, BATCH_NEW) for p in prompts]
    for i, ref in enumerate(refs):
        hf_reference.assert_tokens_match(ref, outputs[i])
    if pages is not None:
        assert reused, "no slot changed hands: the test did not exercise freed slots"
    else:
        alone = generate_ids(m3_torch.LLM(tiny_dir, device="cpu", max_num_seqs=1, max_model_len=384),
                             [prompts[0]], max_new_tokens=BATCH_NEW)[0]
        n = hf_reference.checked_steps(refs[0])
        assert n > 0 and alone[:n] == outputs[0][:n]


# -- sampling --------------------------------------------------------------------------------------

@pytest.mark.long
def test_sampling_is_reproducible_and_batch_independent(tiny_dir, one_program_per_tile):
    llm = m3_torch.LLM(tiny_dir, device="cpu", max_num_seqs=2, max_model_len=128)
    prompts = [prompt(3, seed=7), prompt(5, seed=8)]
    kw = dict(max_new_tokens=3, temperature=1.5, top_p=0.95)
    first = generate_ids(llm, prompts, seed=11, **kw)
    assert generate_ids(llm, prompts[:1], seed=11, **kw)[0] == first[0]       # same seed, alone
    assert generate_ids(llm, prompts, seed=12, **kw) != first
    nucleus_of_one = generate_ids(llm, prompts, max_new_tokens=3, temperature=1.0, top_p=1e-6, seed=3)
    for p, tokens in zip(prompts, nucleus_of_one):                        # = greedy
        hf_reference.assert_tokens_match(hf_reference.reference_generate(tiny_dir, p, 3), tokens)


# -- dtypes and bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", torch.float16])
def test_half_precision_engine(tiny_dir, one_program_per_tile, dtype):
    llm = m3_torch.LLM(tiny_dir, dtype=dtype, device="cpu", max_num_seqs=1, max_model_len=128)
    want = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    assert llm.runner.dtype == want and llm.runner.pool.dtype == want and llm.runner.model.embed.dtype == want
    p = prompt(20, seed=9)
    seen = record_prompt_logits(llm)
    tokens = generate_ids(llm, [p], max_new_tokens=2)[0]
    assert len(tokens) == 2
    err = rel_err(stacked(seen[0], len(p)), hf_reference.reference_prompt_logits(tiny_dir, p))
    [yardstick] = transformers_errors(tiny_dir, [p], want)
    assert err <= 2 * yardstick + 1e-3, f"{err:.2e} vs transformers' own {yardstick:.2e}"


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(dtype="int8"), ValueError, "dtype"),
    (dict(dtype=3), TypeError, "dtype"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    (dict(max_model_len=10 ** 6), ValueError, "max_model_len"),
    (dict(max_model_len=1024, num_gpu_blocks_override=7), ValueError, "num_gpu_blocks_override"),
])
def test_bad_engine_arguments(tiny_dir, kwargs, exc, words):
    with pytest.raises(exc, match=words):
        m3_torch.LLM(tiny_dir, device="cpu", **kwargs)


@pytest.mark.parametrize("args, kwargs, exc, words", [
    (([[]],), {}, ValueError, "empty"),
    (([[5] * 200],), {}, ValueError, "max_model_len"),
    (([[5, 512]],), {}, ValueError, "vocabulary"),
    (([[5, -1]],), {}, ValueError, "vocabulary"),
    (([[5]],), dict(max_new_tokens=0), ValueError, "max_tokens"),
    (([[5]],), dict(temperature=-1.0), ValueError, "temperature"),
    (([[5]],), dict(top_p=0.0), ValueError, "top_p"),
    (([[5]],), dict(top_p=1.5), ValueError, "top_p"),
    (([[5]],), dict(seed=-2), ValueError, "seed"),
    (([[5], 3.5],), {}, TypeError, "prompt"),
])
def test_bad_generate_input_fails_before_any_work(tiny_dir, args, kwargs, exc, words):
    llm = m3_torch.LLM(tiny_dir, device="cpu", max_num_seqs=2, max_model_len=128)

    def no_work(step, carried=None):
        raise AssertionError("a step ran")

    llm.runner.step_logits = no_work
    with pytest.raises(exc, match=words):
        generate_ids(llm, *args, **kwargs)
    assert generate_ids(llm, [], max_new_tokens=3) == []


# -- GPU (bf16, CUDA graphs) --------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_bf16_matches_transformers(gpu_tiny_dir):
    prompts = [prompt(n, seed=n) for n in PROMPT_LENS]
    llm = m3_torch.LLM(gpu_tiny_dir, dtype="bfloat16", device="cuda", max_num_seqs=4, max_model_len=1024,
                       prefill_chunk=384)
    seen = record_prompt_logits(llm)
    outputs = generate_ids(llm, prompts, max_new_tokens=NEW_TOKENS)
    yardsticks = transformers_errors(gpu_tiny_dir, prompts, torch.bfloat16)
    agree, total = 0, 0
    for request_id, (p, tokens, yardstick) in enumerate(zip(prompts, outputs, yardsticks)):
        err = rel_err(stacked(seen[request_id], len(p)), hf_reference.reference_prompt_logits(gpu_tiny_dir, p))
        assert err <= 2 * yardstick + 1e-3, \
            f"prompt of {len(p)} tokens: bf16 logits rel. error {err:.2e}, transformers' own bf16 {yardstick:.2e}"
        ref = hf_reference.reference_generate(gpu_tiny_dir, p, NEW_TOKENS)
        agree += sum(a == b for a, b in zip(tokens, ref.tokens))
        total += len(ref.tokens)
        print(f"prompt {len(p):4d}: logits rel. err {err:.2e} (transformers bf16: {yardstick:.2e}), "
              f"tokens {tokens} vs reference {ref.tokens}")
    print(f"bf16 greedy token agreement with transformers fp32: {agree}/{total} = {agree / total:.0%}")
    llm.close()   # its pool took this process's share of the GPU: the next test's engine sizes its own from it


@pytest.mark.gpu
def test_gpu_cuda_graph_decode_equals_eager(gpu_tiny_dir):
    llm = m3_torch.LLM(gpu_tiny_dir, dtype="bfloat16", device="cuda", max_num_seqs=8, max_model_len=1024)
    graphs, compared = llm.runner.graphs, []
    replay = graphs.run

    def run(step, carried=None):
        gen = step.plan.generation
        captured = (gen.num_rows, gen.decode_query_len, gen.max_blocks) in graphs.graphs
        logits = replay(step, carried)
        if captured:  # a replay: run the same step eagerly (rewrites the same K/V rows) and compare
            eager = llm.runner.model.forward(llm.runner.step_tensors(step), step.plan, llm.runner.caches)
            compared.append((logits.float().clone(), eager.float()))
        return logits

    graphs.run = run
    prompts = [prompt(n, seed=300 + n) for n in (5, 120, 250)]   # decode batch 3 -> graph batch 4; bounds 2, 4
    outputs = generate_ids(llm, prompts, max_new_tokens=24)
    assert len(graphs.graphs) >= 2 and len(compared) >= 10, (sorted(graphs.graphs), len(compared))
    for graph_logits, eager_logits in compared:
        torch.testing.assert_close(graph_logits, eager_logits, rtol=2e-2, atol=2e-2)
    llm.close()   # its pool took this process's share of the GPU (gpu_memory_utilization)
    eager_llm = m3_torch.LLM(gpu_tiny_dir, dtype="bfloat16", device="cuda", max_num_seqs=8, max_model_len=1024,
                             enforce_eager=True)
    assert eager_llm.runner.graphs is None
    agree = sum(a == b for o, e in zip(outputs, generate_ids(eager_llm, prompts, max_new_tokens=24)) for a, b in zip(o, e))
    print(f"CUDA-graph vs eager engine tokens: {agree}/{sum(map(len, outputs))} equal")


def test_a_dropped_engine_frees_its_pool_at_once(tmp_path):
    """``del llm`` frees the engine's pool without the garbage collector, also after generate(): torch
    imports torch._dynamo on the first custom-op call, and that import leaves a frame cycle holding the
    calling stack (m3_torch.rank imports it up front). A fresh process, the collector off."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import gc, sys, weakref
        gc.disable()
        import m3_torch
        from m3_engine.tiny_model import write_tiny_checkpoint
        llm = m3_torch.LLM(write_tiny_checkpoint({str(tmp_path)!r}, seed=0), device="cpu", max_num_seqs=2,
                           max_model_len=256)
        llm.generate([[5, 6, 7]], m3_torch.SamplingParams(max_tokens=1), use_tqdm=False)
        pool = weakref.ref(llm.runner.pool)
        del llm
        sys.exit(0 if pool() is None else 3)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"the pool outlived its engine (exit {done.returncode})\n{done.stderr[-2000:]}"
