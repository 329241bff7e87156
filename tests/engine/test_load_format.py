"""``load_format="dummy"`` (vLLM's name and meaning): random weights made on the device from ``config.json`` alone.

The model folder here holds ``config.json`` and nothing else (no safetensors,
no tokenizer): a dummy engine of each framework builds and generates from it
(finite logprobs, neither flat nor one-hot; token ids in the vocabulary), the
same seed gives the same weights and another seed others, ``"auto"`` still
reads the checkpoint (and so fails without one), and an unknown format is a
``ValueError`` in both frameworks and on the command line. A two-layer tiny
config (one dense, one MSA + MoE layer) keeps each engine's steps short.
"""

import json
import math

import numpy as np
import pytest
import torch

import m3_jax
import m3_torch
from m3_engine import SamplingParams, cli
from m3_engine.args import EngineArgs
from m3_engine.dummy_weights import dummy_tensors
from m3_engine.model_config import M3TextConfig
from m3_engine.tiny_model import tiny_text_config
from m3_engine.tp import TPPlan

from jax_helpers import _jax_device  # noqa: F401  (autouse: JAX on its CPU device)

LLM_CLASSES = {"torch": m3_torch.LLM, "jax": m3_jax.LLM}
TEXT = tiny_text_config(num_hidden_layers=2)
KW = dict(device="cpu", max_num_seqs=2, max_model_len=64, graph_batch_sizes=[2], load_format="dummy")


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    path = tmp_path_factory.mktemp("dummy")
    (path / "config.json").write_text(json.dumps(TEXT))
    return path


def weights(llm) -> dict:
    """name -> numpy float32 copy of every weight an engine holds."""
    if llm.framework == "jax":
        return {name: np.asarray(w, np.float32) for name, w in llm.runner.params.items()}
    model = llm.runner.model
    out = {"embed": model.embed, "norm": model.norm, "lm_head": model.lm_head}
    for i, layer in enumerate(model.layers):
        out.update({f"{i}.{k}": v for k, v in vars(layer).items() if isinstance(v, torch.Tensor)})
    return {name: w.float().numpy() for name, w in out.items()}


@pytest.mark.parametrize("framework", ["torch", pytest.param("jax", marks=pytest.mark.long)])   # JAX: ~30 s
def test_dummy_engine_generates_from_config_json_alone(framework, config_only):
    llm = LLM_CLASSES[framework](config_only, seed=3, **KW)
    assert llm.get_tokenizer() is None
    outs = llm.generate([[1, 5, 7, 9], [1, 3]], SamplingParams(max_tokens=2, temperature=0, logprobs=1),
                        use_tqdm=False)
    vocab = TEXT["vocab_size"]
    for out in outs:
        ids = out.outputs[0].token_ids
        assert len(ids) == 2 and all(0 <= t < vocab for t in ids)
        for token, logprobs in zip(ids, out.outputs[0].logprobs):
            top = logprobs[token].logprob
            assert math.isfinite(top) and -math.log(vocab) + 0.5 < top < -0.5, top   # neither flat nor one-hot

    w = weights(llm)
    assert all(np.isfinite(a).all() for a in w.values())
    same = weights(LLM_CLASSES[framework](config_only, seed=3, **KW))
    other = weights(LLM_CLASSES[framework](config_only, seed=4, **KW))
    assert w.keys() == same.keys() == other.keys()
    assert all(np.array_equal(w[n], same[n]) for n in w)
    assert not any(np.array_equal(w[n], other[n]) for n in w)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_auto_reads_the_checkpoint_and_unknown_formats_are_errors(framework, config_only):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM_CLASSES[framework](config_only, **{**KW, "load_format": "auto"})
    for bad in ("npz", "DUMMY", None, 1):
        with pytest.raises(ValueError, match=r"load_format: expected one of \('auto', 'dummy'\)"):
            LLM_CLASSES[framework](config_only, **{**KW, "load_format": bad})


def test_the_command_line_passes_the_load_format(config_only, monkeypatch, capsys):
    seen = []

    class Recorder:
        def __init__(self, model, **options):
            seen.append(options)
            raise ValueError("load_format: recorded")

    monkeypatch.setattr(cli, "engine_class", lambda framework: Recorder)
    assert cli.main(["--model", str(config_only), "--prompt-ids", "1,2", "--load-format", "dummy"]) == 2
    assert seen[0]["load_format"] == "dummy"
    assert "--load-format: recorded" in capsys.readouterr().err
    assert cli.main(["--model", str(config_only), "--prompt-ids", "1,2", "--load-format", "npz"]) == 2
    assert "invalid choice: 'npz'" in capsys.readouterr().err
    assert EngineArgs(config_only).check().load_format == "auto"


def test_ranks_draw_their_own_slices_and_replicate_the_rest():
    config = M3TextConfig.from_dict(tiny_text_config(num_key_value_heads=2, num_attention_heads=4))
    whole = {t.name: t for t in dummy_tensors(config, 0)}
    plan = TPPlan(config, 4)   # 4 ranks over 2 KV heads: each KV head on two ranks
    ranks = [{t.name: t for t in dummy_tensors(config, 0, shard=plan.rank(r))} for r in range(4)]
    for name, t in whole.items():
        cut = plan.slice(name, 0)
        for r in range(4):
            assert ranks[r][name].shape == (t.shape if cut is None else plan.rank(r).shape(name, t.shape))
            assert ranks[r][name].std == t.std
        seeds = [ranks[r][name].seed for r in range(4)]
        if cut is None:
            assert seeds == [t.seed] * 4, name          # replicated: the same tensor on every rank
        elif ".k_proj" in name or ".v_proj" in name or "indexer.q_proj" in name:
            assert seeds[0] == seeds[1] != seeds[2] == seeds[3], name   # ranks sharing a KV head
        else:
            assert len(set(seeds)) == 4, name
