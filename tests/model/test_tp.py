"""m3_engine.tp (how the model splits over tensor-parallel ranks) and the checkpoint's sliced reads."""

import numpy as np
import pytest

from m3_engine import checkpoint
from m3_engine.model_config import M3TextConfig, load_config
from m3_engine.tiny_model import tiny_text_config, write_tiny_checkpoint
from m3_engine.tp import TPPlan, TensorSlice

M3 = M3TextConfig.from_dict({"num_hidden_layers": 4, "layer_types": ["full_attention"] + ["minimax_m3_sparse"] * 3,
                             "mlp_layer_types": ["dense"] + ["sparse"] * 3})


def tiny_config(**overrides) -> M3TextConfig:
    return M3TextConfig.from_dict(tiny_text_config(**overrides))


@pytest.mark.parametrize("tp, q, kv, replicas", [(1, 64, 4, 1), (2, 32, 2, 1), (4, 16, 1, 1), (8, 8, 1, 2)])
def test_m3_heads_per_rank(tp, q, kv, replicas):
    """The split of the heads: 64/tp query heads, max(1, 4/tp) KV (= index-q) heads, replicated once tp > 4."""
    plan = TPPlan(M3, tp)
    assert (plan.num_q_heads, plan.num_kv_heads, plan.kv_replicas) == (q, kv, replicas)
    local = plan.local_config
    assert (local.num_attention_heads, local.num_key_value_heads, local.index_n_heads) == (q, kv, kv)
    assert local.intermediate_size == 3072 // tp and local.dense_intermediate_size == 12288 // tp
    for r in range(tp):   # a rank's query heads all read the KV heads it holds
        kv_of_q = {h // (64 // 4) for h in plan.q_heads(r)}
        assert kv_of_q <= set(plan.kv_heads(r)), (r, kv_of_q, plan.kv_heads(r))
    if tp == 8:
        assert [plan.kv_heads(r).start for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_m3_slices():
    plan = TPPlan(M3, 8)
    p = "model.layers.2."
    assert plan.slice(p + "self_attn.q_proj.weight", 3) == TensorSlice(0, ((3 * 8 * 128, 4 * 8 * 128),))
    assert plan.slice(p + "self_attn.k_proj.weight", 3) == TensorSlice(0, ((128, 256),))        # KV head 1
    assert plan.slice(p + "self_attn.indexer.q_proj.weight", 3) == TensorSlice(0, ((128, 256),))
    assert plan.slice(p + "self_attn.o_proj.weight", 3) == TensorSlice(1, ((3 * 1024, 4 * 1024),))
    assert plan.slice(p + "mlp.experts.gate_up_proj", 1) == TensorSlice(1, ((384, 768), (3072 + 384, 3072 + 768)))
    assert plan.slice(p + "mlp.experts.down_proj", 1) == TensorSlice(2, ((384, 768),))
    assert plan.slice("model.layers.0.mlp.gate_up_proj.weight", 7) == \
        TensorSlice(0, ((7 * 1536, 8 * 1536), (12288 + 7 * 1536, 12288 + 8 * 1536)))
    for replicated in ("self_attn.indexer.k_proj.weight", "self_attn.q_norm.weight", "mlp.gate.weight",
                       "mlp.gate.e_score_correction_bias", "input_layernorm.weight"):
        assert plan.slice(p + replicated, 5) is None, replicated
    assert plan.slice("model.norm.weight", 5) is None
    for name in ("model.embed_tokens.weight", "lm_head.weight"):   # vocab-parallel: 200064 / 8 rows a rank
        assert plan.slice(name, 5) == TensorSlice(0, ((5 * 25008, 6 * 25008),))
    assert TPPlan(M3, 1).slice(p + "self_attn.q_proj.weight", 0) is None
    assert TPPlan(M3, 1).slice("lm_head.weight", 0) is None


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_m3_expert_parallel_slices(tp):
    """Expert parallel: rank r holds the whole experts [r * 128/tp, (r + 1) * 128/tp), every rank's disjoint and
    together all of them; the shared expert and the dense MLP are still split inside, the router replicated."""
    plan = TPPlan(M3, tp, expert_parallel=True)
    per_rank = 128 // tp
    assert plan.num_experts == per_rank and [plan.experts(r) for r in range(tp)] == \
        [range(r * per_rank, (r + 1) * per_rank) for r in range(tp)]
    p = "model.layers.2.mlp."
    for r in range(tp):
        for name in ("experts.gate_up_proj", "experts.down_proj"):
            assert plan.slice(p + name, r) == TensorSlice(0, ((r * per_rank, (r + 1) * per_rank),)), name
        assert plan.rank(r).shape(p + "experts.gate_up_proj", (128, 6144, 6144)) == (per_rank, 6144, 6144)
        assert plan.slice(p + "shared_experts.down_proj.weight", r) == TPPlan(M3, tp).slice(
            p + "shared_experts.down_proj.weight", r)
        assert plan.slice(p + "gate.weight", r) is None
    local = plan.local_config
    assert (local.intermediate_size, local.num_local_experts) == (3072, 128)   # whole experts; the router's E
    assert local.shared_intermediate_size == TPPlan(M3, tp).local_config.shared_intermediate_size
    assert TPPlan(M3, tp).experts(tp - 1) == range(128)   # without: every rank a slice of every expert


def test_vocab_ranges_pad_the_last_rank():
    """A vocabulary tp does not divide: ceil(V / tp) rows a rank, the last one's real rows fewer (its held
    shape padded); the ranges cover the vocabulary once."""
    plan = TPPlan(tiny_config(vocab_size=509, num_attention_heads=8, num_key_value_heads=2), 4)
    assert plan.vocab_rows == 128
    assert [plan.vocab(r) for r in range(4)] == [range(0, 128), range(128, 256), range(256, 384), range(384, 509)]
    assert plan.slice("lm_head.weight", 3) == TensorSlice(0, ((384, 509),))
    assert plan.rank(3).shape("lm_head.weight", (509, 128)) == (128, 128)          # held: padded
    assert plan.rank(3).shape("model.embed_tokens.weight", (509, 128)) == (128, 128)
    assert TPPlan(tiny_config(), 1).vocab(0) == range(512)


@pytest.mark.parametrize("overrides, tp, ep, error, words", [
    ({}, 1, True, ValueError, r"enable_expert_parallel: needs tensor_parallel_size > 1"),
    (dict(num_local_experts=6, num_attention_heads=8), 4, True, ValueError,
     r"enable_expert_parallel: tensor_parallel_size=4 does not divide num_local_experts=6"),
    ({}, 2, 1, TypeError, r"enable_expert_parallel: expected a bool, got 1"),
    (dict(vocab_size=5, num_attention_heads=8), 4, False, ValueError,
     r"tensor_parallel_size=4 leaves a rank no row of vocab_size=5"),
])
def test_expert_and_vocab_splits_that_do_not_exist(overrides, tp, ep, error, words):
    with pytest.raises(error, match=words):
        TPPlan(tiny_config(**overrides), tp, expert_parallel=ep)


def test_expert_parallel_lifts_the_experts_width_rule():
    """Whole experts: intermediate_size need not divide by tp (the shared expert's still must)."""
    TPPlan(tiny_config(intermediate_size=30), 4, expert_parallel=True)
    with pytest.raises(ValueError, match="does not divide intermediate_size=30"):
        TPPlan(tiny_config(intermediate_size=30), 4)


@pytest.mark.parametrize("overrides, tp, words", [
    (dict(num_attention_heads=6, num_key_value_heads=3), 2, r"tensor_parallel_size=2 and num_key_value_heads=3"),
    (dict(num_attention_heads=6, num_key_value_heads=2), 4, r"does not divide num_attention_heads=6"),
    (dict(intermediate_size=30), 4, r"does not divide intermediate_size=30"),
    (dict(shared_intermediate_size=18), 4, r"does not divide shared_intermediate_size=18"),
    (dict(dense_intermediate_size=66), 4, r"does not divide dense_intermediate_size=66"),
    ({}, 0, r"tensor_parallel_size: expected an int >= 1"),
    ({}, 2.0, r"tensor_parallel_size: expected an int >= 1"),
])
def test_splits_that_do_not_exist_are_rejected(overrides, tp, words):
    with pytest.raises(ValueError, match=words):
        TPPlan(tiny_config(**overrides), tp)


def test_rank_out_of_range():
    with pytest.raises(ValueError, match=r"rank: expected an int in \[0, 2\)"):
        TPPlan(tiny_config(), 2).rank(2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """bf16: the VL form (gate/up and expert pieces, one file) and the text form (merged tensors, 3 shards)."""
    root = tmp_path_factory.mktemp("tp")
    return (write_tiny_checkpoint(root / "vl", seed=4, dtype="bfloat16"),
            write_tiny_checkpoint(root / "text", seed=4, dtype="bfloat16", form="text", num_shards=3))


@pytest.mark.parametrize("form", [0, 1], ids=["vl_pieces", "text_merged"])
@pytest.mark.parametrize("tp, ep", [(2, False), (4, False), (4, True)],
                         ids=["tp2", "tp4", "tp4_ep"])   # 4 > 2 KV heads: each KV head on two ranks
def test_sharded_reads_are_the_slices(checkpoints, monkeypatch, form, tp, ep):
    """Each rank reads exactly its slice of every tensor, and never a whole sharded tensor (under expert
    parallelism: only its experts' pieces, whole); the bytes read per rank add up to the checkpoint's
    replicated tensors once per rank plus the sharded ones once in all."""
    model_dir = checkpoints[form]
    config = load_config(model_dir)
    whole = checkpoint.load_weights(model_dir, config)
    plan = TPPlan(config, tp, expert_parallel=ep)
    reads = []
    get = checkpoint.TensorReader.get

    def recording_get(self, path, stored, dim=None, start=0, stop=0):
        tensor = get(self, path, stored, dim, start, stop)
        reads.append((stored, dim, tensor.nbytes))
        return tensor

    monkeypatch.setattr(checkpoint.TensorReader, "get", recording_get)
    ranks, read_bytes = [], []
    for r in range(tp):
        reads.clear()
        local = checkpoint.load_weights(model_dir, config, shard=plan.rank(r))
        for name, w in whole.items():
            cut = plan.slice(name, r)
            want = w if cut is None else cut.take(w)
            assert local[name].shape == want.shape, name
            np.testing.assert_array_equal(local[name].view(np.uint16), want.view(np.uint16), err_msg=name)
        sharded = {stored for stored, _, _ in reads if plan.slice(checkpoint.canonical_name(stored)[0], r)}
        whole_pieces = {stored for stored, dim, _ in reads if dim is None}
        if ep and form == 0:   # the VL form stores each expert apart: a rank reads its experts' whole pieces
            experts = {int(stored.split(".experts.")[1].split(".")[0]) for stored in whole_pieces & sharded}
            assert experts == set(plan.experts(r)), (r, sorted(experts))
            whole_pieces -= {s for s in whole_pieces if ".experts." in s}
        assert len(sharded) > 20 and not whole_pieces & sharded, sorted(whole_pieces & sharded)[:3]
        assert sum(n for _, _, n in reads) == sum(w.nbytes for w in local.values())   # nothing read twice
        read_bytes.append(sum(n for _, _, n in reads))
        ranks.append(local)
        for part in (".mlp.experts.", "embed_tokens", "lm_head"):   # a 1 / tp share of each, EP or not
            share = sum(w.nbytes for n, w in local.items() if part in n)
            assert share * tp == sum(w.nbytes for n, w in whole.items() if part in n), (r, part)
    print(f"tp={tp} ep={ep}: bytes read per rank {read_bytes} of {sum(w.nbytes for w in whole.values())}")
    if tp == 2:   # the ranks' slices put back together are the tensors (one copy of each KV head)
        for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                     "model.layers.1.mlp.experts.down_proj"):
            dim = plan.slice(name, 0).dim
            np.testing.assert_array_equal(np.concatenate([x[name] for x in ranks], dim).view(np.uint16),
                                          whole[name].view(np.uint16))
    else:         # ranks 0 and 1 share KV head 0, ranks 2 and 3 KV head 1
        name = "model.layers.2.self_attn.v_proj.weight"
        assert np.array_equal(ranks[0][name].view(np.uint16), ranks[1][name].view(np.uint16))
        assert not np.array_equal(ranks[1][name].view(np.uint16), ranks[2][name].view(np.uint16))


def test_shard_of_another_config(checkpoints):
    config = load_config(checkpoints[0])
    other = TPPlan(tiny_config(num_attention_heads=8), 2)
    with pytest.raises(ValueError, match="shard: its TPPlan was made for another model config"):
        checkpoint.load_weights(checkpoints[0], config, shard=other.rank(0))
