"""Prefix caching: the block manager and the scheduler alone, then both engines with caching on and off.

A full 128-token block is shared only when its whole token prefix is equal (a
chained sha256); the block of a prompt's last token is always computed; cached
blocks nobody holds stay until the pool needs their slots (LRU). With caching
on, the engines must produce the tokens they produce with caching off.
"""

import numpy as np
import pytest

from m3_engine import SamplingParams
from m3_engine.block_manager import BlockManager, block_hashes
from m3_engine.model_config import load_config
from m3_engine.scheduler import Scheduler, SchedulerConfig
from m3_engine.tiny_model import write_tiny_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m3_prefix"), seed=0, num_hidden_layers=2)


def ids(n, seed):
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def run(scheduler, token=7):
    while scheduler.has_unfinished():
        step = scheduler.schedule()
        scheduler.update(step, [token] * len(step.logits_indices))


def scheduler(model_dir, num_slots=8, caching=True, max_context=512):
    config = SchedulerConfig(max_batch=2, max_context=max_context, num_slots=num_slots,
                             enable_prefix_caching=caching)
    return Scheduler(config, load_config(model_dir))


# -- the block manager and the scheduler ---------------------------------------------------------

def test_block_hashes_chain_the_whole_prefix():
    a, b = np.arange(300, dtype=np.int32), np.arange(300, dtype=np.int32)
    b[5] = 999                                              # differs in block 0 only
    ha, hb = block_hashes(a, 2), block_hashes(b, 2)
    assert ha[0] != hb[0] and ha[1] != hb[1]                # block 1's tokens are equal, its prefix is not
    assert block_hashes(a, 2, ha[:1]) == ha                 # extending known hashes gives the same chain
    assert len({*ha, *hb}) == 4


def test_block_manager_lru_eviction_and_reference_counts():
    m = BlockManager(4, caching=True)
    first = m.admit([], 2, prompt_tokens=256)
    for slot, h in zip(first, (b"a", b"b")):
        m.register(int(slot), h)
    assert m.match([b"a", b"b", b"c"]) == first.tolist() and m.num_cached == 2
    m.release(first.tolist())
    assert m.num_evictable == 2 and m.num_available == 4
    shared = m.admit(m.match([b"a"]), 1, prompt_tokens=200)  # holds cached "a" plus one fresh slot
    assert shared[0] == first[0] and m.hit_tokens == 128 and m.num_evictable == 1
    assert m.can_admit([], 2) and not m.can_admit([], 3)      # one free slot and "b" (evictable); "a" is held
    taken = m.admit([], 2, prompt_tokens=1)                   # the free slot first, then evicts "b"
    assert taken[1] == first[1] and m.match([b"a", b"b"]) == [first[0]] and m.num_cached == 1
    m.release(shared.tolist())
    m.release(taken.tolist())
    assert m.num_available == 4


def test_scheduler_reuses_a_cached_prefix_and_computes_the_rest(model_dir):
    s = scheduler(model_dir)
    prefix = ids(300, 1)
    s.add_request(prefix + [5, 6], 3)
    run(s)
    assert s.blocks.num_cached == 2 and s.blocks.hit_tokens == 0
    s.add_request(prefix + [9], 2)
    step = s.schedule()
    [(request, q)] = step.rows
    assert request.prefix_hit_tokens == 256 and q == 301 - 256        # prefill starts after two cached blocks
    assert step.positions[0] == 256 and s.blocks.hit_tokens == 256
    s.update(step, [7])
    run(s)
    assert s.num_free_slots == 8 and not s.has_unfinished()


def test_last_block_is_never_taken_from_the_cache(model_dir):
    s = scheduler(model_dir)
    prompt = ids(256, 2)                                  # exactly two full blocks
    s.add_request(prompt, 2)
    run(s)
    assert s.blocks.num_cached == 2
    s.add_request(prompt, 2)                              # entirely cached: the last block is recomputed
    step = s.schedule()
    assert step.rows[0][1] == 128 and step.positions[0] == 128 and s.blocks.hit_tokens == 128
    s.update(step, [7])
    run(s)


def test_prefixes_that_differ_in_their_last_block_share_the_others(model_dir):
    s = scheduler(model_dir)
    base = ids(400, 3)
    other = base[:300] + ids(100, 4)                      # blocks 0, 1 equal; block 2 differs
    s.add_request(base, 2)
    run(s)
    s.add_request(other, 2)
    step = s.schedule()
    assert step.positions[0] == 256 and s.blocks.hit_tokens == 256
    s.update(step, [7])
    run(s)


def test_without_caching_nothing_is_kept(model_dir):
    s = scheduler(model_dir, caching=False)
    prefix = ids(300, 5)
    for _ in range(2):
        s.add_request(prefix + [5], 2)
        run(s)
    assert s.blocks.num_cached == 0 and s.blocks.hit_tokens == 0 and s.num_free_slots == 8


def test_pool_pressure_evicts_then_recomputes(model_dir):
    s = scheduler(model_dir, num_slots=4)
    a, b = ids(300, 6), ids(300, 7)
    s.add_request(a, 2)
    run(s)
    s.add_request(b, 2)                                   # needs 3 slots: evicts one of a's cached blocks
    run(s)
    s.add_request(a, 2)
    step = s.schedule()
    assert step.positions[0] == 0 and s.blocks.hit_tokens == 0   # a's block 0 was evicted: no prefix left
    s.update(step, [7])
    run(s)
    assert s.num_free_slots == 4


# -- both engines: caching changes nothing but the work ------------------------------------------

FRAMEWORKS = ["torch", "jax"]


def engines(model_dir, framework, **kwargs):
    from m3_engine import engine_class

    kwargs = {"device": "cpu", "max_num_seqs": 2, "max_model_len": 512, **kwargs}
    LLM = engine_class(framework)
    return LLM(model_dir, enable_prefix_caching=True, **kwargs), LLM(model_dir, **kwargs)


def tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("framework", ["torch", pytest.param("jax", marks=pytest.mark.long)])
def test_a_cached_prefix_gives_the_tokens_of_a_computed_one(model_dir, framework):
    """The short version of the next test (CI): a prefix cached by one call, reused by the next."""
    on, off = engines(model_dir, framework, max_model_len=256)
    prefix = ids(130, 30)
    params = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=2, ignore_eos=True)]
    tokens(on, [prefix + [5]], params[0])
    got = tokens(on, [prefix + [6], prefix + [7]], params)
    assert got == tokens(off, [prefix + [6], prefix + [7]], params) and sum(map(len, got)) == 4
    assert on.engine.stats["prefix_cache_hit_tokens"] == 256 and off.engine.stats["prefix_cache_hit_tokens"] == 0
    assert on.engine.stats["free_pages"] == on.engine.stats["total_pages"]


@pytest.mark.long
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_engine_outputs_equal_with_caching_on_and_off(model_dir, framework):
    on, off = engines(model_dir, framework, num_gpu_blocks_override=6)
    prefix = ids(260, 10)
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=3, ignore_eos=True)
    rounds = [
        [prefix + ids(5, 11), prefix + ids(9, 12)],       # two requests of one batch sharing a prefix
        [prefix + ids(7, 13)],                            # reuses the blocks cached by the round before
        [prefix[:256]],                                   # entirely cached: its last block is recomputed
        [prefix[:200] + ids(90, 14)],                     # differs from the cached prefix in block 1
        [ids(500, 15)],                                   # pool pressure: evicts the cached prefix
        [prefix + ids(3, 16)],                            # recomputed after the eviction
    ]
    compared, hits = 0, []
    for prompts in rounds:
        for params in (greedy, seeded):
            before = on.engine.stats["prefix_cache_hit_tokens"]
            got, want = tokens(on, prompts, params), tokens(off, prompts, params)
            assert got == want, (prompts[0][:4], params)
            compared += sum(map(len, got))
            hits.append(on.engine.stats["prefix_cache_hit_tokens"] - before)
    assert compared == 2 * 3 * 7
    # (greedy, seeded) per round: the batch caches nothing before it runs, then both of its requests hit
    # 2 blocks; the next prompt hits 2 blocks; the entirely cached one 1 (its last block is recomputed);
    # the one differing in block 1 hits block 0 only (then its own block 1); the random prompt nothing
    assert hits[:8] == [0, 512, 256, 256, 128, 128, 128, 256] and hits[8] == 0, hits
    assert off.engine.stats["prefix_cache_hit_tokens"] == 0
    for llm in (on, off):
        assert llm.engine.scheduler.num_free_slots == 6 and not llm.engine.has_unfinished_requests()
        llm.close()


@pytest.mark.long
def test_fp8_caches_with_prefix_caching(model_dir):
    on, off = engines(model_dir, "torch", kv_cache_dtype="fp8", index_cache_dtype="fp8")
    prefix = ids(200, 20)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    tokens(on, [prefix + [5]], params)
    got, want = tokens(on, [prefix + [6, 7]], params), tokens(off, [prefix + [6, 7]], params)
    assert got == want and len(got[0]) == 3
    assert on.engine.stats["prefix_cache_hit_tokens"] == 128
