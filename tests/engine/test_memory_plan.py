"""m3_engine.memory_plan: the per-GPU plan against the tensors a rank loads and the pool a rank allocates."""

import dataclasses

import pytest

from m3_engine import checkpoint
from m3_engine.memory_plan import (WEIGHT_PARTS, kv_budget_bytes, kv_pool_slots, m3_config, main, plan_memory,
                                   weight_part)
from m3_engine.model_config import load_config
from m3_engine.tiny_model import write_tiny_checkpoint
from m3_engine.tp import TPPlan
from m3_kernels.pool import PoolLayout

GIB = 1 << 30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), dtype="bfloat16")
    return path, load_config(path)


@pytest.mark.parametrize("tp", [1, 2])
def test_tiny_weights_equal_the_tensors_each_rank_loads(tiny, tp):
    path, config = tiny
    plan = plan_memory(config, tensor_parallel_size=tp, max_model_len=1024, max_num_seqs=2)
    for rank in range(tp):
        shard = TPPlan(config, tp).rank(rank) if tp > 1 else None
        loaded = dict.fromkeys(WEIGHT_PARTS, 0)
        for name, tensor in checkpoint.iter_weights(path, config, shard=shard):
            loaded[weight_part(name)] += tensor.nbytes
        assert plan.weights == loaded, rank
    if tp == 1:
        assert plan.num_parameters * 2 == plan.weight_bytes


def test_kv_pool_is_the_pool_layouts(tiny):
    _, config = tiny
    for tp in (1, 2):
        plan = plan_memory(config, tensor_parallel_size=tp, max_model_len=1000, max_num_seqs=3,
                           kv_cache_dtype="fp8")
        assert plan.num_slots == 3 * 8
        layout = PoolLayout.create(plan.num_slots, sparse=config.sparse_layers, num_kv_heads=2 // tp,
                                   head_dim=config.head_dim, index_head_dim=config.index_head_dim,
                                   dtype="bfloat16", kv_cache_dtype="fp8")
        assert plan.kv_bytes == layout.nbytes
        # by hand: K and V of every layer at the rank's heads in fp8, index-K of the 3 sparse layers in bf16
        assert plan.kv_slot_parts == {"K/V": 128 * 4 * 2 * (2 // tp) * 32, "index-K": 128 * 3 * 32 * 2}


def test_m3_parameters_and_tp8_replicates_kv_heads():
    config = m3_config()
    plans = {tp: plan_memory(config, tensor_parallel_size=tp, max_model_len=131072, max_num_seqs=8)
             for tp in (2, 4, 8)}
    # 60 x attention, 57 x indexer, 3 dense MLPs, 57 MoE (128 experts + shared + router), norms, embed, head
    assert plans[8].num_parameters == 426_174_572_928
    index_k = 57 * 128 * 128 * 2
    for tp, plan in plans.items():
        assert plan.kv_slot_parts == {"K/V": 60 * 2 * max(1, 4 // tp) * 128 * 128 * 2, "index-K": index_k}
    assert plans[8].kv_slot_bytes == plans[4].kv_slot_bytes   # one KV head a rank, replicated on 2 ranks at TP8
    assert plans[8].weights["routed experts"] * 8 == plans[2].weights["routed experts"] * 2
    assert plans[8].weights["embeddings"] * 8 == plans[2].weights["embeddings"] * 2 == 200064 * 6144 * 2   # vocab split


def test_fp8_halves_the_experts_plus_scales_and_expert_parallel_keeps_the_bytes():
    config = m3_config()
    kwargs = dict(tensor_parallel_size=4, max_model_len=8192, max_num_seqs=4)
    bf16 = plan_memory(config, **kwargs)
    fp8 = plan_memory(config, weight_dtype="fp8", **kwargs)
    assert 2 * fp8.weights["routed experts"] == bf16.weights["routed experts"]
    for part in ("router", "norms", "embeddings", "lm_head"):
        assert fp8.weights[part] == bf16.weights[part], part
    # float32 per 128x128 block of every FP8 matrix a rank holds
    blocks = (60 * (16 * 48 + 2 * 48 + 48 * 16)                  # q (16 heads), k, v (1 head), o
              + 57 * (1 * 48 + 1 * 48)                           # indexer q (1 head), k
              + 3 * (2 * 24 * 48 + 48 * 24)                      # dense gate_up, down (12288 / 4 rows)
              + 57 * 129 * (2 * 6 * 48 + 48 * 6))                # 128 experts + the shared one (3072 / 4 rows)
    assert fp8.weights["FP8 scales"] == 4 * blocks
    expert_parallel = plan_memory(config, weight_dtype="fp8", enable_expert_parallel=True, **kwargs)
    assert expert_parallel.weights == fp8.weights
    assert "32 whole routed experts a rank" in expert_parallel.table()
    replicated = plan_memory(config, vocab_parallel=False, **kwargs)
    assert 4 * bf16.weights["lm_head"] == replicated.weights["lm_head"] == 200064 * 6144 * 2


def test_verdict_and_the_kv_budget():
    plan = plan_memory(m3_config(), tensor_parallel_size=8, weight_dtype="fp8", max_model_len=131072,
                       max_num_seqs=8)
    assert plan.fits is None and plan.kv_free_bytes is None
    used = plan.weight_bytes + plan.workspace_bytes
    exact = dataclasses.replace(plan, gpu_memory_bytes=used + plan.kv_bytes, gpu_memory_utilization=1.0)
    assert exact.fits and exact.kv_slots_fit == plan.num_slots
    short = dataclasses.replace(exact, gpu_memory_bytes=exact.gpu_memory_bytes - 1)
    assert not short.fits and short.kv_slots_fit == plan.num_slots - 1
    h200 = dataclasses.replace(plan, gpu_memory_bytes=139 * GIB)
    assert h200.kv_free_bytes == int(139 * GIB * 0.9) - used
    assert h200.fits and "verdict: fits" in h200.table()
    assert not plan_memory(m3_config(), tensor_parallel_size=4, weight_dtype="fp8", max_model_len=131072,
                           max_num_seqs=8, gpu_memory_bytes=139 * GIB).fits
    assert kv_budget_bytes(100, 0.5, 60) == -10 and kv_pool_slots(-10, 7) == 0 and kv_pool_slots(20, 7) == 2


def test_bad_arguments_name_themselves():
    config = m3_config()
    cases = [(dict(tensor_parallel_size=3), "tensor_parallel_size=3"),
             (dict(weight_dtype="int4"), "weight_dtype"),
             (dict(max_model_len=2 << 20), "max_model_len"),
             (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
             (dict(tensor_parallel_size=16, weight_dtype="fp8"), "not whole 128-row blocks")]
    for change, message in cases:
        kwargs = dict(tensor_parallel_size=8, max_model_len=4096, max_num_seqs=1) | change
        with pytest.raises(ValueError, match=message):
            plan_memory(config, **kwargs)


def test_command_line(tiny, capsys):
    path, _ = tiny
    assert main(["--model", str(path), "--tensor-parallel-size", "2", "--max-model-len", "1024",
                 "--max-num-seqs", "2", "--gpu-memory-gib", "4"]) == 0
    out = capsys.readouterr().out
    assert "tensor_parallel_size=2" in out and "verdict: fits" in out
    assert "embeddings and lm_head split over the vocabulary (the engines' split)" in out
