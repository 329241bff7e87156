"""No Triton kernel compiles on the request path: every kernel variant (Triton's specialisation key:
constexprs, warps, stages, integer and alignment classes) that the scheduler's steps of a
benchmark-like workload launch, the torch engine's start-up warm-up compiled. Recorded on the CPU,
without a GPU (``m3_torch.ops.record_variants``), at M3's attention shapes (``benchmarks.e2e``'s model:
the variants depend on shapes only)."""

from __future__ import annotations

import dataclasses

import numpy as np

from m3_engine.model_config import M3TextConfig
from m3_engine.tiny_model import tiny_text_config

from m3_torch.runner import sampling_variants
from variant_helpers import MetaEngine

# benchmarks.e2e's M3_SHAPES (the warm_start benchmark's model)
M3_SHAPES = dict(hidden_size=6144, num_attention_heads=64, num_key_value_heads=4, head_dim=128, rotary_dim=64,
                 index_head_dim=128, index_topk_blocks=16, num_hidden_layers=4, num_dense_layers=1,
                 vocab_size=32768, dense_intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2,
                 intermediate_size=256, shared_intermediate_size=256, rope_theta=5e6)


def scheduled_steps(engine, prompt_lengths, new_tokens):
    """Every step the scheduler makes for these prompts (each step's tokens taken as sampled)."""
    scheduler = engine.scheduler()
    rng = np.random.default_rng(0)
    for n in prompt_lengths:
        scheduler.add_request(rng.integers(3, 1000, n).tolist(), new_tokens)
    steps = []
    while scheduler.has_unfinished():
        step = scheduler.schedule()
        steps.append(step)
        scheduler.update(step, [5] * len(step.logits_indices))
    return steps


def test_request_path_compiles_nothing():
    """The warm_start benchmark's workload (64 rows, 2048 tokens of context, 96 prompts of 1024 tokens:
    chunked prefill, mixed and decode steps) and prompts of other lengths (one token, just past a
    page, long ones): no variant beyond the warm-up's."""
    engine = MetaEngine(M3TextConfig.from_dict(tiny_text_config(dtype="bfloat16", **M3_SHAPES)),
                        max_num_seqs=64, max_model_len=2048)
    warm = engine.warm_up_variants()
    steps = scheduled_steps(engine, [1024] * 96 + [1, 130, 700, 1500, 2000], 8)
    # each step's sampling at its own row count, in the variants a request can ask for
    rows = sorted({len(step.logits_indices) for step in steps})
    sampling = [(n, dataclasses.replace(batch, **{k: np.repeat(v, n, axis=0) for k, v in vars(batch).items()
                                                  if isinstance(v, np.ndarray)}))
                for n in rows for batch in sampling_variants(M3_SHAPES["vocab_size"])]
    cold = engine.record(steps, sampling) - warm
    assert not cold, f"{len(cold)} kernel variants compile on the request path: " \
                     f"{sorted({key[0] for key in cold})}, e.g. {sorted(cold, key=str)[0]}"
