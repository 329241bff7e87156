"""m3_engine.checkpoint: original / transformers tensor names -> one canonical naming, and its errors."""

import json
import logging

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from m3_engine import checkpoint
from m3_engine.model_config import load_config
from m3_engine.tiny_model import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model in both forms: VL (original names, one file) and text (canonical names, 3 shards)."""
    root = tmp_path_factory.mktemp("tiny")
    return write_tiny_checkpoint(root / "vl", seed=3), write_tiny_checkpoint(root / "text", seed=3, form="text",
                                                                            num_shards=3)


def rewrite(model_dir, change):
    """Apply ``change(tensors)`` to a single-file checkpoint."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def test_both_forms_load_the_same_weights(tiny):
    vl, text = (checkpoint.load_weights(d) for d in tiny)
    shapes = checkpoint.expected_shapes(load_config(tiny[0]))
    assert list(vl) == list(shapes) == list(text)  # every tensor, in expected_shapes' order
    for name, shape in shapes.items():
        assert vl[name].shape == shape and vl[name].dtype == np.float32, name
        np.testing.assert_array_equal(vl[name], text[name], err_msg=name)
    assert np.std(vl["model.layers.1.mlp.experts.gate_up_proj"]) > 0.05  # random, never zeros


def test_merged_pieces_are_in_transformers_order(tiny):
    """experts.gate_up_proj[e] = [w1; w3] of expert e, down_proj[e] = w2, gate_up_proj = [gate_proj; up_proj]."""
    w = checkpoint.load_weights(tiny[0])
    raw = load_file(tiny[0] / "model.safetensors")
    p = "language_model.model.layers.2."
    np.testing.assert_array_equal(w["model.layers.2.mlp.experts.gate_up_proj"][3],
                                  np.concatenate([raw[p + "block_sparse_moe.experts.3.w1.weight"],
                                                  raw[p + "block_sparse_moe.experts.3.w3.weight"]]))
    np.testing.assert_array_equal(w["model.layers.2.mlp.experts.down_proj"][1],
                                  raw[p + "block_sparse_moe.experts.1.w2.weight"])
    np.testing.assert_array_equal(w["model.layers.0.mlp.gate_up_proj.weight"],
                                  np.concatenate([raw["language_model.model.layers.0.mlp.gate_proj.weight"],
                                                  raw["language_model.model.layers.0.mlp.up_proj.weight"]]))
    np.testing.assert_array_equal(w["model.layers.2.self_attn.indexer.q_proj.weight"],
                                  raw[p + "self_attn.index_q_proj.weight"])
    np.testing.assert_array_equal(w["model.layers.2.mlp.gate.e_score_correction_bias"],
                                  raw[p + "block_sparse_moe.e_score_correction_bias"])
    np.testing.assert_array_equal(w["lm_head.weight"], raw["language_model.lm_head.weight"])


def test_torch_loader_matches_numpy(tiny):
    ours = checkpoint.load_weights(tiny[0])
    pt = checkpoint.load_weights(tiny[0], framework="pt", concatenate=torch.cat)
    assert list(pt) == list(ours)
    for name, t in pt.items():
        assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
        assert torch.equal(t, torch.from_numpy(ours[name])), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints(tmp_path, dtype):
    write_tiny_checkpoint(tmp_path, dtype=dtype)
    config = load_config(tmp_path)
    assert config.dtype == dtype
    np_w = checkpoint.load_weights(tmp_path, config)
    pt_w = checkpoint.load_weights(tmp_path, config, framework="pt", concatenate=torch.cat)
    for name, t in pt_w.items():
        assert t.dtype == getattr(torch, dtype) and np_w[name].dtype.name == dtype
        bits = torch.int16
        assert torch.equal(t.view(bits), torch.from_numpy(np.ascontiguousarray(np_w[name]).view(np.int16))), name


def test_skipped_tensors_are_logged_once(tiny, caplog):
    with caplog.at_level(logging.INFO, logger="m3_engine.checkpoint"):
        checkpoint.load_weights(tiny[0])
    records = [r for r in caplog.records if r.name == "m3_engine.checkpoint"]
    assert len(records) == 1
    assert "skipped 12 tensors" in records[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="m3_engine.checkpoint"):
        checkpoint.load_weights(tiny[1])  # nothing to skip: nothing logged
    assert not [r for r in caplog.records if r.name == "m3_engine.checkpoint"]


def test_canonical_names():
    cases = {
        "language_model.model.layers.4.block_sparse_moe.experts.7.w3.weight":
            ("model.layers.4.mlp.experts.gate_up_proj", (7, 1)),
        "language_model.model.layers.4.block_sparse_moe.experts.7.w2.weight":
            ("model.layers.4.mlp.experts.down_proj", (7,)),
        "language_model.model.layers.4.block_sparse_moe.e_score_correction_bias":
            ("model.layers.4.mlp.gate.e_score_correction_bias", ()),
        "language_model.model.layers.4.block_sparse_moe.shared_experts.up_proj.weight":
            ("model.layers.4.mlp.shared_experts.gate_up_proj.weight", (1,)),
        "language_model.model.layers.1.self_attn.index_k_norm.weight":
            ("model.layers.1.self_attn.indexer.k_norm.weight", ()),
        "model.language_model.layers.1.self_attn.indexer.q_proj.weight":
            ("model.layers.1.self_attn.indexer.q_proj.weight", ()),
        "language_model.lm_head.weight": ("lm_head.weight", ()),
        "model.layers.0.mlp.gate_proj.weight": ("model.layers.0.mlp.gate_up_proj.weight", (0,)),
        "model.norm.weight": ("model.norm.weight", ()),
    }
    for stored, expected in cases.items():
        assert checkpoint.canonical_name(stored) == expected, stored
    for skipped in ("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", "multi_modal_projector.linear_1.bias",
                    "patch_merge_mlp.linear_2.weight", "mtp.layers.0.eh_proj.weight",
                    "language_model.model.mtp.norm.weight", "model.vision_tower.layers.0.mlp.fc1.weight"):
        assert checkpoint.canonical_name(skipped) is None, skipped


# -- errors -------------------------------------------------------------------------------

def test_unknown_tensor_is_named(tmp_path):
    write_tiny_checkpoint(tmp_path)
    rewrite(tmp_path, lambda t: t.update({"language_model.model.layers.0.self_attn.rel_bias.weight": np.ones(3)}))
    with pytest.raises(ValueError, match=r"unknown tensor.*layers\.0\.self_attn\.rel_bias\.weight"):
        checkpoint.load_weights(tmp_path)


def test_tensor_of_a_missing_layer_type_is_unknown(tmp_path):
    """An indexer on a dense layer is not silently dropped."""
    write_tiny_checkpoint(tmp_path)
    rewrite(tmp_path, lambda t: t.update({"language_model.model.layers.0.self_attn.index_k_norm.weight": np.ones(32)}))
    with pytest.raises(ValueError, match=r"unknown.*layers\.0\.self_attn\.index_k_norm"):
        checkpoint.load_weights(tmp_path)


@pytest.mark.parametrize("stored, words", [
    ("language_model.model.layers.3.self_attn.k_norm.weight", r"missing.*model\.layers\.3\.self_attn\.k_norm\.weight"),
    ("language_model.lm_head.weight", r"missing.*lm_head\.weight"),
    ("language_model.model.layers.2.block_sparse_moe.experts.3.w3.weight",
     r"layers\.2\.mlp\.experts\.gate_up_proj.*missing.*experts\.3\.w3\.weight"),
    ("language_model.model.layers.0.mlp.up_proj.weight", r"layers\.0\.mlp\.gate_up_proj\.weight.*up_proj\.weight"),
])
def test_missing_tensor_is_named(tmp_path, stored, words):
    write_tiny_checkpoint(tmp_path)
    rewrite(tmp_path, lambda t: t.pop(stored))
    with pytest.raises(ValueError, match=words):
        checkpoint.load_weights(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    write_tiny_checkpoint(tmp_path)
    name = "language_model.model.layers.1.self_attn.index_q_proj.weight"
    rewrite(tmp_path, lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(ValueError, match=r"indexer\.q_proj\.weight.*index_q_proj.*expected shape \(64, 128\)"):
        checkpoint.load_weights(tmp_path)


def test_tensor_stored_under_two_names(tmp_path):
    write_tiny_checkpoint(tmp_path)
    rewrite(tmp_path, lambda t: t.update({"model.norm.weight": t["language_model.model.norm.weight"]}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*stored twice"):
        checkpoint.load_weights(tmp_path)


def test_expert_beyond_the_config(tmp_path):
    write_tiny_checkpoint(tmp_path)
    name = "language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight"
    rewrite(tmp_path, lambda t: t.update({name.replace("experts.0", "experts.4"): t[name]}))
    with pytest.raises(ValueError, match=r"unexpected pieces.*experts\.4\.w2.*4 experts"):
        checkpoint.load_weights(tmp_path)


def test_tied_embeddings(tmp_path):
    write_tiny_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    rewrite(tmp_path, lambda t: t.pop("language_model.lm_head.weight"))
    w = checkpoint.load_weights(tmp_path)
    assert w["lm_head.weight"] is w["model.embed_tokens.weight"]


def test_files_and_index(tiny, tmp_path):
    vl, text = tiny
    assert checkpoint.checkpoint_files(vl) == [vl / "model.safetensors"]
    shards = checkpoint.checkpoint_files(text)
    assert [p.name for p in shards] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = checkpoint.checkpoint_index(text)
    assert index["model.norm.weight"] in shards and len(index) == 67
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        checkpoint.checkpoint_files(tmp_path)
    broken = write_tiny_checkpoint(tmp_path / "broken", num_shards=2)
    (broken / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        checkpoint.checkpoint_files(broken)


def test_bad_arguments(tiny):
    with pytest.raises(ValueError, match="framework"):
        checkpoint.load_weights(tiny[0], framework="tf")
    with pytest.raises(ValueError, match="concatenate.*torch.cat"):
        checkpoint.load_weights(tiny[0], framework="pt")


# -- against transformers ------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl
    transformers.logging.set_verbosity_error()
    return transformers, modeling_minimax_m3_vl


def assert_same(ours: dict, theirs: dict, prefix="model."):
    """ours (canonical) vs a transformers state dict whose text model lives under ``prefix``."""
    theirs = {("model." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in theirs.items()
              if k.startswith(prefix) or k == "lm_head.weight"}
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        assert torch.equal(torch.from_numpy(np.asarray(t)), theirs[name]), name


def test_transformers_loads_our_tiny_checkpoint(tiny, hf):
    transformers, modeling = hf
    vl_dir, text_dir = tiny
    vl = modeling.MiniMaxM3SparseForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32)
    assert_same(checkpoint.load_weights(vl_dir), vl.state_dict(), prefix="model.language_model.")
    text = transformers.MiniMaxM3VLForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    assert_same(checkpoint.load_weights(text_dir), text.state_dict())


@pytest.mark.parametrize("cls_name", ["MiniMaxM3VLForCausalLM", "MiniMaxM3SparseForConditionalGeneration"])
def test_we_load_transformers_save_pretrained(tiny, hf, tmp_path, cls_name):
    """Both naming forms that save_pretrained writes: canonical (text class) and original (VL class)."""
    transformers, modeling = hf
    config = transformers.AutoConfig.from_pretrained(tiny[0])  # the VL config of the tiny model
    torch.manual_seed(0)
    if cls_name == "MiniMaxM3VLForCausalLM":
        model, prefix = transformers.MiniMaxM3VLForCausalLM(config.text_config), "model."
    else:
        model, prefix = modeling.MiniMaxM3SparseForConditionalGeneration(config), "model.language_model."
    with torch.no_grad():  # transformers initialises norms to zeros and biases to zeros: make every tensor random
        for p in model.parameters():
            p.normal_()
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_()
    model.save_pretrained(tmp_path)
    stored = set(checkpoint.checkpoint_index(tmp_path))
    assert ("language_model.model.norm.weight" in stored) == (prefix != "model.")  # VL saves the original names
    assert_same(checkpoint.load_weights(tmp_path), model.state_dict(), prefix=prefix)


# -- the tiny checkpoint itself ---------------------------------------------------------------

def test_tiny_tokenizer_covers_any_text_and_the_vocabulary(tiny):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tiny[0] / "tokenizer.json"))
    assert tok.get_vocab_size() == load_config(tiny[0]).vocab_size == 512
    assert [tok.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [0, 1, 2]
    text = "Sparse attention, naïve café: 128 tokens!"
    assert tok.decode(tok.encode(text).ids) == text  # byte-level: nothing is unknown


def test_tiny_checkpoint_options(tmp_path):
    d = write_tiny_checkpoint(tmp_path, seed=1, hidden_size=64, num_hidden_layers=3, num_dense_layers=2,
                              num_local_experts=8, vocab_size=300)
    config = load_config(d)
    assert (config.hidden_size, config.num_local_experts, config.vocab_size) == (64, 8, 300)
    assert config.sparse_layers == (False, False, True) and config.moe_layers == (False, False, True)
    w = checkpoint.load_weights(d)
    other = checkpoint.load_weights(write_tiny_checkpoint(tmp_path / "seed2", seed=2, hidden_size=64,
                                                          num_hidden_layers=3, num_dense_layers=2,
                                                          num_local_experts=8, vocab_size=300))
    name = "model.layers.2.self_attn.q_proj.weight"
    assert not np.array_equal(w[name], other[name])
    with pytest.raises(ValueError, match="dtype"):
        write_tiny_checkpoint(tmp_path, dtype="float64")
    with pytest.raises(ValueError, match="form"):
        write_tiny_checkpoint(tmp_path, form="gguf")
    with pytest.raises(ValueError, match="vocab_size"):
        write_tiny_checkpoint(tmp_path, vocab_size=100)


# -- tests/helpers/hf_reference.py (the model tests' reference) -------------------------------------

def test_reference_is_the_same_model_from_both_forms(tiny, hf):
    import hf_reference
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 512, 300).tolist()
    vl, text = (hf_reference.reference_prompt_logits(d, prompt) for d in tiny)
    assert vl.shape == (300, 512) and torch.equal(vl, text)
    ref = hf_reference.reference_generate(tiny[0], prompt, 6)
    assert hf_reference.reference_generate(tiny[0], prompt, 6) is ref  # cached
    assert len(ref.tokens) <= 6 and ref.logits.shape == (len(ref.tokens), 512)
    torch.testing.assert_close(ref.logits[0], vl[-1], rtol=1e-5, atol=1e-5)
    # recomputing the sequence at every step == transformers' own cached greedy decoding
    model = hf_reference.reference_model(str(tiny[0]))
    out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    assert out[0, 300:].tolist() == ref.tokens


def test_reference_near_tie_rule():
    from hf_reference import Reference, assert_tokens_match, checked_steps
    ref = Reference((1, 2), [5, 6, 7, 2], torch.zeros(4, 8), [0.5, 0.2, 1e-4, 0.3])
    assert checked_steps(ref) == 2
    assert assert_tokens_match(ref, [5, 6, 9]) == 2  # step 2 is a near-tie: anything goes from there
    with pytest.raises(AssertionError, match="differ from step 1"):
        assert_tokens_match(ref, [5, 4, 7, 2])
    sure = Reference((1,), [5, 6], torch.zeros(2, 8), [0.5, 0.5])
    assert assert_tokens_match(sure, [5, 6]) == 2
    with pytest.raises(AssertionError, match="the reference stopped after 2"):
        assert_tokens_match(sure, [5, 6, 3])
