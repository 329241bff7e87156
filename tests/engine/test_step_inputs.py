"""The one padding policy (m3_engine.buckets) and the step builder (m3_engine.step_inputs). Host only.

Over a varied workload (prompts of mixed lengths, chunked prefill, mixed
steps, decode at several batch sizes, speculative verify steps) every step the
builder makes has a shape :meth:`StepBuckets.shapes` lists, within the
planner's limits; JAX's policy keeps that set small.
"""

import numpy as np
import pytest

from m3_engine.buckets import StepBuckets, StepShape, token_buckets
from m3_engine.model_config import M3TextConfig
from m3_engine.scheduler import Scheduler, SchedulerConfig
from m3_engine.speculative import SpeculativeConfig
from m3_engine.step_inputs import StepBuilder
from m3_kernels.planner import StepConfig

VOCAB, EOS = 1000, 999
PATTERN = (11, 12, 13, 14)   # every request generates this period: n-gram drafts get accepted


def model_config():
    return M3TextConfig.from_dict(dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, index_n_heads=2, index_head_dim=32, index_topk_blocks=2, eos_token_id=EOS,
        layer_types=["full_attention", "minimax_m3_sparse"]))


def shape_of(step) -> StepShape:
    plan = step.plan
    return StepShape(plan.context.num_rows, plan.context.num_tokens, plan.generation.num_rows,
                     plan.generation.decode_query_len)


def run_workload(pad_prefill: bool):
    """-> (buckets, the shape of every step built). Two waves of prompts: the second arrives while the
    first decodes (mixed steps); requests finish at different lengths (decode at several batch sizes)."""
    config = SchedulerConfig(max_batch=6, max_context=512, num_slots=24, max_num_tokens=64, prefill_chunk=48,
                             graph_batch_sizes=(1, 2, 4))
    speculative = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                               "disable_by_batch_size": 4})
    buckets = StepBuckets.from_config(config, speculative, pad_prefill=pad_prefill, pad_decode=True)
    step_config = StepConfig(num_q_heads=4, num_kv_heads=2, head_dim=32, max_batch=config.max_batch,
                             max_num_tokens=config.max_num_tokens, max_blocks=config.max_blocks, topk=2)
    s = Scheduler(config, model_config(), builder=StepBuilder(buckets, step_config), speculative=speculative)
    rng = np.random.default_rng(0)
    waves = [[1, 5, 40, 130], [3, 300, 9, 70, 2]]
    shapes = []
    for w, lengths in enumerate(waves):
        for i, n in enumerate(lengths):
            s.add_request(rng.integers(0, 500, n).tolist(), max_new_tokens=6 + 5 * i + 7 * w)
        for _ in range(6 if w == 0 else 10 ** 4):
            if not s.has_unfinished():
                break
            step = s.schedule()
            shapes.append((shape_of(step), step.num_verify_rows > 0, len(step.rows)))
            tokens = [PATTERN[(int(r) + o) % 4] for r, o in zip(step.request_ids, step.output_index)]
            s.update(step, tokens)
    assert not s.has_unfinished()
    return buckets, shapes


@pytest.mark.parametrize("pad_prefill", [True, False], ids=["jax", "torch"])
def test_enumerated_shapes_cover_every_built_step(pad_prefill):
    buckets, built = run_workload(pad_prefill)
    listed = set(buckets.shapes())
    shapes = {shape for shape, _, _ in built}
    assert shapes <= listed, sorted(shapes - listed)
    assert all(s.num_rows <= buckets.max_rows and s.num_tokens <= buckets.max_tokens for s in listed)
    # the workload covers what it claims: verify steps, mixed steps, decode at several batch sizes (padded)
    assert any(verify for _, verify, _ in built)
    assert any(s.context_rows and s.generation_rows for s in shapes)
    assert {s.generation_rows for s in shapes if not s.context_rows} >= {1, 2, 4}
    assert any(not s.context_rows and s.generation_rows > rows for s, _, rows in built)
    if pad_prefill:   # padded: context tokens on buckets, context rows powers of two, a small set
        assert all(s.context_tokens in buckets.context_token_buckets for s in shapes if s.context_rows)
        assert all(s.context_rows & (s.context_rows - 1) == 0 for s in shapes)
        assert len(listed) < 250
    else:
        assert any(s.context_tokens not in token_buckets(64) for s in shapes if s.context_rows)


def test_shape_rule():
    b = StepBuckets(max_batch=8, max_num_tokens=100, prefill_chunk=100, decode_batch_sizes=(2, 4), pad_prefill=True,
                    verify_query_len=3, max_verify_rows=8)
    assert token_buckets(100) == (8, 12, 16, 24, 32, 48, 64, 96, 100)
    assert b.shape(0, 0, 3, 1) == StepShape(0, 0, 4, 1)          # decode: the next decode batch size
    assert b.shape(0, 0, 5, 3) == StepShape(0, 0, 5, 3)          # more rows than the largest: as they are
    # 17 tokens -> 24 (+ a padding row); context rows -> the most a 24-token step holds (max_batch + 1 -> 16);
    # verify rows -> the most a mixed step holds (7: more than the largest decode size, as they are)
    assert b.shape(3, 17, 1, 3) == StepShape(16, 24, 7, 3)
    assert b.shape(2, 24, 0, 1) == StepShape(16, 24, 0, 0)       # a bucket exactly: no padding row
    assert b.shape(1, 5, 0, 0) == StepShape(8, 8, 0, 0)          # a bucket of 8 tokens holds 8 rows at most
    assert b.shape(1, 5, 1, 1) == StepShape(8, 8, 7, 1)          # one token a generation row: 7 rows, as they are
    eager = StepBuckets(max_batch=8, max_num_tokens=100, prefill_chunk=100, decode_batch_sizes=(2, 4))
    assert eager.shape(3, 17, 1, 1) == StepShape(3, 17, 1, 1)    # steps with context rows keep their shape
    assert eager.max_rows == 8 and eager.max_tokens == 100


def test_bad_policy():
    with pytest.raises(ValueError, match=r"decode_batch_sizes: expected sizes in \[1, max_batch=4\], got \(2, 8\)"):
        StepBuckets(max_batch=4, max_num_tokens=64, prefill_chunk=64, decode_batch_sizes=(8, 2))
    with pytest.raises(ValueError, match="verify_query_len"):
        StepBuckets(max_batch=4, max_num_tokens=64, prefill_chunk=64, verify_query_len=1)
    with pytest.raises(ValueError, match="max_num_tokens"):
        StepBuckets(max_batch=4, max_num_tokens=0, prefill_chunk=64)
