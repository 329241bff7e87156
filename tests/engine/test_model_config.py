"""m3_engine.model_config: config.json (flat, nested, legacy keys) -> M3TextConfig, and the RoPE-width rule."""

import copy
import json

import pytest

from m3_engine.model_config import M3TextConfig, load_config
from m3_engine.tiny_model import tiny_text_config, write_tiny_checkpoint


def legacy_text():
    return tiny_text_config()  # the checkpoint's form: sparse_attention_config, moe_layer_freq


def flat_text():
    """The same text config with transformers' flat keys."""
    text = legacy_text()
    sparse = text.pop("sparse_attention_config")
    text.update(layer_types=["minimax_m3_sparse" if f else "full_attention" for f in sparse["sparse_attention_freq"]],
                mlp_layer_types=["sparse" if f else "dense" for f in text.pop("moe_layer_freq")],
                index_n_heads=sparse["sparse_num_index_heads"], index_head_dim=sparse["sparse_index_dim"],
                index_block_size=sparse["sparse_block_size"], index_topk_blocks=sparse["sparse_topk_blocks"],
                index_local_blocks=sparse["sparse_local_block"])
    return text


def test_flat_nested_and_legacy_forms_agree():
    flat = M3TextConfig.from_dict(flat_text())
    assert M3TextConfig.from_dict(legacy_text()) == flat
    assert M3TextConfig.from_dict({"model_type": "minimax_m3_vl", "text_config": legacy_text()}) == flat
    assert flat.layer_types == ("full_attention",) + ("minimax_m3_sparse",) * 3
    assert flat.mlp_layer_types == ("dense",) + ("sparse",) * 3
    assert flat.sparse_layers == (False, True, True, True) and flat.moe_layers == (False, True, True, True)
    assert (flat.index_n_heads, flat.index_head_dim, flat.index_topk_blocks, flat.index_local_blocks) == (2, 32, 2, 1)
    assert (flat.rotary_dim, flat.rope_theta, flat.eos_token_ids, flat.dtype) == (16, 10000.0, (2,), "float32")


def test_load_config_reads_the_tiny_checkpoint(tmp_path):
    write_tiny_checkpoint(tmp_path / "vl")
    write_tiny_checkpoint(tmp_path / "text", form="text")
    assert load_config(tmp_path / "vl") == load_config(tmp_path / "text") == M3TextConfig.from_dict(flat_text())


def test_legacy_keys_win_over_flat_ones_as_in_transformers():
    text = flat_text()
    text["sparse_attention_config"] = {"sparse_topk_blocks": 4, "sparse_attention_freq": [1, 1, 0, 0]}
    text["index_topk_blocks"] = 3
    cfg = M3TextConfig.from_dict(text)
    assert cfg.index_topk_blocks == 4
    assert cfg.layer_types == tuple(flat_text()["layer_types"])  # given layer_types beat sparse_attention_freq


def test_defaults_are_the_full_model():
    cfg = M3TextConfig.from_dict({"moe_layer_freq": [0] * 3 + [1] * 57,
                                  "sparse_attention_config": {"sparse_attention_freq": [0] * 3 + [1] * 57}})
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (6144, 64, 4, 128)
    assert (cfg.index_topk_blocks, cfg.index_n_heads, cfg.num_local_experts, cfg.vocab_size) == (16, 4, 128, 200064)
    assert cfg.sparse_layers.count(True) == 57 and cfg.rotary_dim == 128  # no width given: the whole head
    bare = M3TextConfig.from_dict({})
    assert bare.layer_types == ("full_attention",) * 60 and bare.mlp_layer_types == ("sparse",) * 60


@pytest.mark.parametrize("rope, expected", [
    (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.25}), 8),   # factor only
    (dict(partial_rotary_factor=0.5), 16),                                            # legacy top-level factor
    (dict(rotary_dim=24), 24),                                                        # rotary_dim only
    (dict(), 32),                                                                     # neither: the whole head
    (dict(rotary_dim=16, rope_parameters={"partial_rotary_factor": 0.5}), 16),       # both, consistent
])
def test_rotary_width_rule(rope, expected):
    text = flat_text()
    text.pop("rotary_dim")
    text.pop("rope_parameters")
    text.update(rope)
    assert M3TextConfig.from_dict(text).rotary_dim == expected


def test_rotary_width_disagreement_is_a_value_error():
    text = flat_text()
    text["rotary_dim"] = 8  # partial_rotary_factor 0.5 of head_dim 32 says 16
    with pytest.raises(ValueError, match=r"rotary_dim=8 disagrees with partial_rotary_factor=0.5"):
        M3TextConfig.from_dict(text)


def test_theta_from_legacy_key_and_unsupported_rope_type():
    text = flat_text()
    del text["rope_parameters"]["rope_theta"]
    text["rope_theta"] = 123.0
    assert M3TextConfig.from_dict(text).rope_theta == 123.0
    text["rope_parameters"]["rope_type"] = "yarn"
    with pytest.raises(ValueError, match="rope_type.*yarn"):
        M3TextConfig.from_dict(text)


def test_eos_dtype_tie_and_head_dim_sources():
    text = flat_text()
    text.update(eos_token_id=[2, 7], torch_dtype="bfloat16", head_dim=None)
    del text["dtype"]
    cfg = M3TextConfig.from_dict({"text_config": text, "tie_word_embeddings": True},
                                 generation_config={"eos_token_id": [7, 9]})
    assert cfg.eos_token_ids == (2, 7, 9)
    assert cfg.dtype == "bfloat16" and cfg.tie_word_embeddings
    assert cfg.head_dim == 128 // 4  # null head_dim: hidden / heads


def test_load_config_merges_generation_config(tmp_path):
    write_tiny_checkpoint(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2]}))
    assert load_config(tmp_path).eos_token_ids == (2, 5)


@pytest.mark.parametrize("change, words", [
    (lambda t: t.update(layer_types=t["layer_types"][:3]), "layer_types: expected one entry per layer"),
    (lambda t: t["layer_types"].__setitem__(1, "sliding_attention"), r"layer_types\[1\]"),
    (lambda t: t["mlp_layer_types"].__setitem__(0, "moe"), r"mlp_layer_types\[0\]"),
    (lambda t: t.update(index_n_heads=1), "index_n_heads=1 must equal num_key_value_heads=2"),
    (lambda t: t.update(index_block_size=64), "index_block_size"),
    (lambda t: t.update(num_attention_heads=3), "multiple of"),
    (lambda t: t.update(num_experts_per_tok=5), "num_experts_per_tok=5"),
    (lambda t: t.update(dtype="float64"), "dtype"),
    (lambda t: t.update(vocab_size=0), "vocab_size"),
])
def test_bad_configs_raise_naming_the_field(change, words):
    text = flat_text()
    change(text)
    with pytest.raises(ValueError, match=words):
        M3TextConfig.from_dict(text)


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_config(tmp_path)
    with pytest.raises(TypeError, match="config"):
        M3TextConfig.from_dict([1, 2])
    with pytest.raises(TypeError, match="eos_token_id"):
        M3TextConfig.from_dict(dict(flat_text(), eos_token_id="</s>"))


def test_derived_values():
    cfg = M3TextConfig.from_dict(flat_text())
    assert cfg.index_init_blocks == 0 and cfg.num_kv_groups == 2
    assert cfg.attention_scale == pytest.approx(32 ** -0.5)
    assert cfg.index_rotary_dim == 16
    assert M3TextConfig.from_dict(dict(flat_text(), index_head_dim=16, rotary_dim=32,
                                       rope_parameters={"rope_theta": 1e4})).index_rotary_dim == 16


# -- against transformers' own config class ----------------------------------------------

FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
          "rms_norm_eps", "index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks",
          "index_local_blocks", "dense_intermediate_size", "intermediate_size", "shared_intermediate_size",
          "num_local_experts", "num_experts_per_tok", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit",
          "tie_word_embeddings", "max_position_embeddings")


@pytest.mark.parametrize("form", ["legacy", "flat", "nested"])
def test_matches_transformers_config_class(form):
    transformers = pytest.importorskip("transformers")
    text = legacy_text() if form != "flat" else flat_text()
    if form == "nested":
        theirs = transformers.MiniMaxM3VLConfig(text_config=copy.deepcopy(text)).text_config
        ours = M3TextConfig.from_dict({"text_config": text})
    else:
        theirs = transformers.MiniMaxM3VLTextConfig(**copy.deepcopy(text))
        ours = M3TextConfig.from_dict(text)
    for name in FIELDS:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert list(ours.layer_types) == theirs.layer_types
    assert list(ours.mlp_layer_types) == theirs.mlp_layer_types
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    # the tiny config gives both widths consistently: transformers' width is ours
    assert ours.rotary_dim == int(theirs.head_dim * theirs.rope_parameters.get("partial_rotary_factor", 1.0))
    assert ours.eos_token_ids == (theirs.eos_token_id,)
