"""m3_engine.scheduler on its own: admission, chunked prefill, row order, slots, padding, stops, bad input.

A fake model checks the metadata end to end: it writes each step's token ids
into a fake paged cache at ``slot_mapping`` and, for each logits row, reads the
row's whole sequence back through ``block_table`` / ``seq_lens`` and hashes it
into the next token. Freed slots are poisoned. Any mistake in positions, slots,
tables, chunking or slot reuse changes the tokens against a one-prompt-at-a-time
reference. The steps are built (``m3_engine.step_inputs``) with torch's padding
(decode steps only) or JAX's (every step: ``pad_prefill``).
"""

import numpy as np
import pytest

from m3_engine.buckets import StepBuckets
from m3_engine.model_config import M3TextConfig
from m3_engine.scheduler import Scheduler, SchedulerConfig
from m3_engine.step_inputs import StepBuilder
from m3_kernels.planner import StepConfig

PAGE = 128
VOCAB, EOS = 1000, 999


def model_config(**overrides):
    text = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, index_n_heads=2, index_head_dim=32, index_topk_blocks=2, eos_token_id=EOS,
                layer_types=["full_attention", "minimax_m3_sparse"])
    return M3TextConfig.from_dict(dict(text, **overrides))


def scheduler(pad_prefill=False, **limits):
    """A scheduler of these limits; ``pad_prefill``: its steps padded as JAX's (every step), else as
    the default (decode steps only)."""
    config = SchedulerConfig(**dict(dict(max_batch=4, max_context=1024, num_slots=16, max_num_tokens=256), **limits))
    model = model_config()
    if not pad_prefill:
        return Scheduler(config, model)
    heads = StepConfig(num_q_heads=4, num_kv_heads=2, head_dim=32, max_batch=config.max_batch,
                       max_num_tokens=config.max_num_tokens, max_blocks=config.max_blocks, topk=2)
    buckets = StepBuckets.from_config(config, None, pad_prefill=True, pad_decode=True)
    return Scheduler(config, model, builder=StepBuilder(buckets, heads))


def next_token(seen: np.ndarray) -> int:
    """The fake model: a hash of the whole sequence (never EOS)."""
    weights = np.arange(1, len(seen) + 1, dtype=np.int64) * 7919
    return int((np.dot(seen.astype(np.int64), weights) + len(seen) * 31) % (VOCAB - 1))


def reference(prompt, max_new_tokens, max_context=10 ** 9):
    seq, out = list(prompt), []
    while len(out) < max_new_tokens and len(seq) <= max_context:
        out.append(next_token(np.asarray(seq)))
        seq.append(out[-1])
    return out


def check_step(s, step):
    """Invariants of every step's metadata."""
    cfg, plan = s.config, step.plan
    T, R = step.num_tokens, step.num_rows
    assert all(a.dtype == np.int32 for a in (step.input_ids, step.positions, step.slot_mapping, step.block_table,
                                             step.seq_lens, step.cu_seqlens_q, step.logits_indices))
    assert step.input_ids.shape == step.positions.shape == step.slot_mapping.shape == (T,)
    assert step.block_table.shape == (R, cfg.max_blocks) and step.seq_lens.shape == (R,)
    assert step.cu_seqlens_q[0] == 0 and step.cu_seqlens_q[-1] == T and len(step.cu_seqlens_q) == R + 1
    buckets = s.builder.buckets
    assert R <= buckets.max_rows and T <= buckets.max_tokens
    real_rows = len(step.rows)
    assert real_rows <= cfg.max_batch and sum(q for _, q in step.rows) <= cfg.max_num_tokens
    q_lens = np.diff(step.cu_seqlens_q)
    # context rows first, generation rows (one token each) last
    assert (q_lens[step.num_context:] == 1).all()
    np.testing.assert_array_equal(q_lens[step.row_index], [q for _, q in step.rows])
    assert plan.context.num_rows == step.num_context and plan.num_rows == R
    for row in range(R):
        toks = slice(step.cu_seqlens_q[row], step.cu_seqlens_q[row + 1])
        if step.seq_lens[row] == 0:  # padding: reads and writes nothing
            assert (step.slot_mapping[toks] == -1).all() and (step.block_table[row] == -1).all()
            assert (step.input_ids[toks] == 0).all()
            continue
        q, L = q_lens[row], step.seq_lens[row]
        pos = step.positions[toks]
        np.testing.assert_array_equal(pos, np.arange(L - q, L))  # the position rule
        slots = step.block_table[row, pos // PAGE]
        assert (slots >= 0).all()
        np.testing.assert_array_equal(step.slot_mapping[toks], slots * PAGE + pos % PAGE)
    # no slot is held by two rows
    held = step.block_table[step.block_table >= 0]
    assert len(np.unique(held)) == len(held)


def run(s, prompts, max_new_tokens, *, poison=True):
    """Drive the scheduler with the fake model; -> (outputs, steps)."""
    cache = np.full(s.config.num_slots * PAGE, -1, np.int64)
    ids = s.add_requests(prompts, max_new_tokens)
    steps = []
    while s.has_unfinished():
        step = s.schedule()
        check_step(s, step)
        steps.append(step)
        written = step.slot_mapping >= 0
        cache[step.slot_mapping[written]] = step.input_ids[written]
        tokens = []
        for t in step.logits_indices:
            row = int(np.searchsorted(step.cu_seqlens_q, t, side="right")) - 1
            assert t == step.cu_seqlens_q[row + 1] - 1  # a row's last token
            pos = np.arange(step.seq_lens[row])
            seen = cache[step.block_table[row, pos // PAGE] * PAGE + pos % PAGE]
            assert (seen >= 0).all(), "read a poisoned or never-written cache row"
            tokens.append(next_token(seen))
        s.update(step, tokens)
        if poison:  # every slot no running request holds
            held = np.zeros(s.config.num_slots, bool)
            for r in s.requests.values():
                held[r.slots] = True
            cache.reshape(-1, PAGE)[~held] = -1
    return [s.output(i) for i in ids], steps


def q_lens(step):
    return np.diff(step.cu_seqlens_q).tolist()


# -- end to end with the fake model ----------------------------------------------------

@pytest.mark.parametrize("limits", [
    dict(),                                                     # everything at once
    dict(max_num_tokens=64),                                    # small step budget: long prompts chunked
    dict(prefill_chunk=50, max_batch=2),                        # chunked, few rows
    dict(num_slots=8, graph_batch_sizes=(1, 2, 4)),             # slots scarce: waits, reuse; decode padding
    dict(pad_prefill=True, max_num_tokens=64, graph_batch_sizes=(1, 2, 4)),   # JAX's padding: every step
    dict(pad_prefill=True, prefill_chunk=50, max_batch=3, num_slots=8, graph_batch_sizes=(2,)),
], ids=str)
def test_outputs_equal_one_prompt_at_a_time(limits):
    rng = np.random.default_rng(0)
    lengths = [1, 127, 129, 300, 5, 700, 64]
    prompts = [rng.integers(0, VOCAB - 1, n).tolist() for n in lengths]
    outputs, steps = run(scheduler(**limits), prompts, 9)
    assert outputs == [reference(p, 9) for p in prompts]
    assert any(st.num_context and st.num_rows > st.num_context for st in steps)  # mixed steps happened


def test_arrival_order_does_not_matter():
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB - 1, n).tolist() for n in (3, 200, 129, 40)]
    a, _ = run(scheduler(max_num_tokens=100), prompts, 6)
    b, _ = run(scheduler(max_num_tokens=100), prompts[::-1], 6)
    assert a == b[::-1]


# -- the pieces, step by step ----------------------------------------------------------

def test_chunked_prefill_and_row_order():
    s = scheduler(max_num_tokens=200, prefill_chunk=150)
    a, b, c = s.add_requests([[1] * 5, [2] * 250, [3] * 129], 3)
    st = s.schedule()  # a whole, b's first chunk (150), c what the budget leaves (45)
    assert q_lens(st) == [5, 150, 45] and st.seq_lens.tolist() == [5, 150, 45] and st.num_context == 3
    assert st.logits_indices.tolist() == [4] and st.request_ids.tolist() == [a] and st.output_index.tolist() == [0]
    s.update(st, [10])
    st = s.schedule()  # a generates (the last row, budgeted first); b and c finish their prompts
    assert q_lens(st) == [100, 84, 1] and st.seq_lens.tolist() == [250, 129, 6] and st.num_context == 2
    assert st.input_ids[-1] == 10 and st.positions[-1] == 5
    assert st.logits_indices.tolist() == [99, 183, 184] and st.request_ids.tolist() == [b, c, a]
    assert st.output_index.tolist() == [0, 0, 1]
    s.update(st, [20, 30, 11])
    st = s.schedule()
    assert q_lens(st) == [1, 1, 1] and st.request_ids.tolist() == [a, b, c] and st.is_decode
    assert st.input_ids.tolist() == [11, 20, 30] and st.positions.tolist() == [6, 250, 129]
    assert s.output(a) == [10, 11]


def test_decode_steps_are_padded_to_graph_batch_sizes():
    s = scheduler(graph_batch_sizes=(1, 2, 4))
    s.add_requests([[1, 2], [3], [4, 5, 6]], 4)
    st = s.schedule()
    assert st.num_context == 3 and st.num_rows == 3  # prefill is never padded
    s.update(st, [7, 8, 9])
    st = s.schedule()
    assert st.is_decode and st.plan.cuda_graph
    assert st.num_rows == 4 and st.num_tokens == 4 and st.seq_lens.tolist() == [3, 2, 4, 0]
    assert st.slot_mapping[3] == -1 and (st.block_table[3] == -1).all() and st.input_ids[3] == 0
    assert st.logits_indices.tolist() == [0, 1, 2]  # padding rows produce no logits


def test_slots_are_reserved_freed_and_reused():
    s = scheduler(num_slots=4, max_context=512, max_num_tokens=512)
    a, b, c = s.add_requests([[1] * 200, [2] * 130, [3] * 10], 2)  # need 2, 2 and 1 slots
    st = s.schedule()
    assert s.requests[a].slots.tolist() == [0, 1] and s.requests[b].slots.tolist() == [2, 3]
    assert st.request_ids.tolist() == [a, b] and s.num_free_slots == 0  # c waits for slots
    assert s.update(st, [5, 6]) == []
    st = s.schedule()
    assert st.request_ids.tolist() == [a, b]
    assert sorted(s.update(st, [7, 8])) == [a, b] and s.num_free_slots == 4
    st = s.schedule()
    assert s.requests[c].slots.tolist() == [0] and st.block_table[0, 0] == 0  # the lowest freed slot
    s.update(st, [9])
    assert s.forget(a) == [5, 7] and s.forget(b) == [6, 8] and set(s.requests) == {c}
    with pytest.raises(ValueError, match="has not finished"):
        s.forget(c)


def test_reservation_covers_only_what_the_cache_holds():
    """prompt + max_new_tokens - 1 tokens live in the cache (the last token is never written)."""
    s = scheduler(num_slots=16)
    a, b = s.add_requests([[1] * 128, [1] * 127], 1)
    s.schedule()
    assert len(s.requests[a].slots) == 1 and len(s.requests[b].slots) == 1
    s = scheduler(num_slots=16)
    [c] = s.add_requests([[1] * 127], 3)
    s.schedule()
    assert len(s.requests[c].slots) == 2


def test_stop_at_eos_and_free():
    s = scheduler()
    a, b = s.add_requests([[1, 2, 3], [4]], 10)
    st = s.schedule()
    assert s.update(st, [EOS, 5]) == [a]
    assert s.requests[a].finish_reason == "stop" and s.output(a) == [EOS] and len(s.requests[a].slots) == 0
    st = s.schedule()
    assert st.request_ids.tolist() == [b]


def test_stop_at_max_new_tokens_and_full_cache():
    s = scheduler(max_context=130)
    a, b = s.add_requests([[1] * 128, [2] * 3], 5)  # a's cache fills at 130 tokens: 3 new tokens
    for _ in range(5):
        st = s.schedule()
        s.update(st, [7] * len(st.request_ids))
    assert s.output(a) == [7, 7, 7] and s.requests[a].finish_reason == "length"
    assert s.output(b) == [7] * 5 and s.requests[b].finish_reason == "length"
    assert not s.has_unfinished()
    s = scheduler(max_context=130)
    [c] = s.add_requests([[1] * 130], 4)  # a prompt of max_context tokens still gives one token
    s.update(s.schedule(), [8])
    assert s.output(c) == [8] and not s.has_unfinished()


def test_more_generation_rows_than_max_batch_wait_their_turn():
    s = scheduler(max_batch=2, num_slots=8)
    ids = s.add_requests([[1], [2], [3]], 2)
    st = s.schedule()
    assert st.request_ids.tolist() == ids[:2]
    s.update(st, [4, 5])
    st = s.schedule()  # two generation rows take both rows: the third prompt waits
    assert st.request_ids.tolist() == ids[:2] and st.is_decode
    s.update(st, [6, 7])
    st = s.schedule()
    assert st.request_ids.tolist() == [ids[2]]


# -- bad input and misuse ------------------------------------------------------------------

GOOD = [5, 6]


@pytest.mark.parametrize("prompts, max_new, exc, words", [
    ([GOOD, []], 4, ValueError, r"prompts\[1\]: empty prompt"),
    ([GOOD, [1] * 1025], 4, ValueError, r"prompts\[1\]: 1025 tokens, longer than max_model_len=1024"),
    ([GOOD, [1, 2, VOCAB]], 4, ValueError,
     rf"prompts\[1\]\[2\]: token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"),
    ([GOOD, [3, -1]], 4, ValueError, r"prompts\[1\]\[1\]: token id -1"),
    ([GOOD], 0, ValueError, "max_new_tokens: expected >= 1, got 0"),
    ([GOOD], 2.0, TypeError, "max_new_tokens"),
    ([GOOD, [1.5, 2]], 4, TypeError, r"prompts\[1\]: expected integer token ids"),
    ([GOOD, "hello"], 4, TypeError, r"prompts\[1\]"),
    ([GOOD, [[1, 2]]], 4, ValueError, r"prompts\[1\]: expected a 1-D"),
    ([1, 2], 4, TypeError, r"prompts\[0\]"),
    ("hello", 4, TypeError, "prompts: expected a list"),
])
def test_bad_input_raises_before_any_work(prompts, max_new, exc, words):
    s = scheduler()
    with pytest.raises(exc, match=words):
        s.add_requests(prompts, max_new)
    assert not s.has_unfinished() and not s.requests  # nothing was queued, not even the good prompt


def test_pool_too_small_for_one_request():
    with pytest.raises(ValueError, match=r"num_slots=3 is too small for one request of max_context=400 tokens: "
                                         r"it needs 4 slots"):
        SchedulerConfig(max_batch=4, max_context=400, num_slots=3)


@pytest.mark.parametrize("limits, words", [
    (dict(max_batch=0), "max_batch"),
    (dict(max_context=-5), "max_context"),
    (dict(graph_batch_sizes=(1, 8)), "graph_batch_sizes"),
    (dict(prefill_chunk=0), "prefill_chunk"),
])
def test_bad_limits(limits, words):
    with pytest.raises(ValueError, match=words):
        SchedulerConfig(**dict(dict(max_batch=4, max_context=1024, num_slots=16, max_num_tokens=256), **limits))


def test_default_graph_batch_sizes_fit_max_num_batched_tokens():
    """A step runs at most max_num_batched_tokens generation rows: the default sizes stop there."""
    config = SchedulerConfig.from_engine_args(model_config(), max_num_seqs=8, max_model_len=1024,
                                              num_gpu_blocks_override=None, max_num_batched_tokens=4)
    assert config.graph_batch_sizes == (1, 2, 4)
    config = SchedulerConfig.from_engine_args(model_config(), max_num_seqs=32, max_model_len=1024,
                                              num_gpu_blocks_override=None)
    assert config.graph_batch_sizes == (1, 2, 4, 8, 16, 32)


def test_defaults():
    cfg = SchedulerConfig(max_batch=4, max_context=1000, num_slots=8)
    assert (cfg.max_num_tokens, cfg.prefill_chunk, cfg.max_blocks) == (2048, 2048, 8)


def test_misuse():
    s = scheduler()
    with pytest.raises(RuntimeError, match="no unfinished requests"):
        s.schedule()
    s.add_requests([[1, 2]], 2)
    st = s.schedule()
    ahead = s.schedule()   # before st's token is back (async scheduling): one step ahead at most
    with pytest.raises(RuntimeError, match="update"):
        s.schedule()
    with pytest.raises(ValueError, match="next_tokens: expected 1 tokens"):
        s.update(st, [1, 2])
    with pytest.raises(ValueError, match="oldest step"):
        s.update(ahead, [3])
    s.update(st, [3])
    with pytest.raises(ValueError, match="oldest step"):
        s.update(st, [3])
    s.update(ahead, [4])
    assert s.output(0) == [3, 4] and not s.has_unfinished()
