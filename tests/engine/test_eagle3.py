"""EAGLE-3 draft heads: the published format (m3_engine.eagle3) and the layer in torch and JAX
(m3_torch.eagle3, m3_jax.eagle3) against a float64 numpy reference.

The target is the tiny M3 config (m3_engine.tiny_model: 4 layers, hidden 128,
vocabulary 512); the drafts are random heads written by ``write_random_eagle3``
in the published layouts. The layer runs on the project's paged kernels (Triton's
interpreter): a prefill step of two requests of 5 and 129 tokens (two pages for
the second), a decode step of 2 tokens per request (aux-state input, as after a
verify step) and one of 1 token (the draft's own ``h_out`` as input). Pages are
shuffled, the pool starts NaN and the block-table entries past each request's
pages hold -1 and an out-of-range page id: a read of any row the steps did not
write poisons the outputs. The reference attends causally over each request's
whole sequence at once.

CPU budget: the interpreter pays per program, so the main draft has 2 KV heads
(full MHA, as the published M3 drafts: group size 1), torch runs the main
scenario by default and JAX runs it under ``long`` (~10 s on one core); by
default JAX runs a short scenario (3 + 2 prompt tokens, the same three kinds of
step) beside torch, and the variants run short sequences in torch.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import m3_jax
from m3_engine import eagle3
from m3_engine.model_config import M3TextConfig
from m3_engine.tiny_model import tiny_text_config
from m3_jax import eagle3 as jax_eagle3
from m3_jax.model import StepBatch
from m3_kernels import planner, tuning
from m3_torch.eagle3 import Eagle3Draft, allocate_draft_cache
from m3_torch.model import StepTensors

from jax_helpers import _jax_device  # noqa: F401  (autouse: CPU tests run on JAX's CPU device)

TARGET = M3TextConfig.from_dict(tiny_text_config())
DRAFT_VOCAB = 200
AUX_IDS = (0, 2, 3)
NUM_SLOTS, MAX_BLOCKS, BAD_PAGE = 8, 4, 7777
DRAFT_SHAPES = dict(num_attention_heads=2, head_dim=32, intermediate_size=96)


@pytest.fixture(autouse=True)
def one_program_per_tile():
    """No split-K in the interpreter (the kernels' own tests cover it): fewer programs."""
    with tuning.override(target_programs=1, sparse_target_programs=1):
        yield


def write_draft(path, **overrides):
    options = dict(seed=1, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=AUX_IDS, **DRAFT_SHAPES)
    return eagle3.write_random_eagle3(path, TARGET, **{**options, **overrides})


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return write_draft(tmp_path_factory.mktemp("eagle3"))


# -- the format ------------------------------------------------------------------------------------

@pytest.mark.parametrize("names", ["midlayer", "layers", "model"])
@pytest.mark.parametrize("ids_in", ["eagle_config", "top", "none"])
def test_published_forms_load_to_the_same_canonical_tensors(tmp_path, draft_dir, names, ids_in):
    path = write_draft(tmp_path, names=names, ids_in=ids_in)
    stored = set(load_file(path / "model.safetensors"))
    assert ("midlayer.mlp.up_proj.weight" in stored) == (names == "midlayer")
    assert ("model.fc.weight" in stored) == (names == "model")
    config = eagle3.Eagle3Config.from_dir(path, TARGET)
    want_ids = AUX_IDS if ids_in != "none" else eagle3.default_aux_layer_ids(TARGET.num_hidden_layers)
    assert config.aux_layer_ids == want_ids
    assert (config.draft_vocab_size, config.has_d2t, config.has_embedding, config.has_lm_head) == (
        DRAFT_VOCAB, True, True, True)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2, 2, 32)
    weights = eagle3.load_eagle3_weights(path, config)
    reference = eagle3.load_eagle3_weights(draft_dir, eagle3.Eagle3Config.from_dir(draft_dir, TARGET))
    assert sorted(weights) == sorted(reference) == sorted(eagle3.expected_eagle3_shapes(config))
    for name, tensor in reference.items():
        np.testing.assert_array_equal(weights[name], tensor, err_msg=name)


def test_default_aux_layers_are_the_runtimes_defaults():
    """vLLM and SGLang capture the inputs of layers (2, L // 2, L - 3): the outputs of these."""
    assert eagle3.default_aux_layer_ids(60) == (1, 29, 56)          # MiniMax-M3
    assert eagle3.default_aux_layer_ids(62) == tuple(i - 1 for i in (2, 31, 59))


def test_input_convention_shifts_the_ids(draft_dir):
    config = json.loads((draft_dir / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]     # vLLM's reading: inputs
    parsed = eagle3.Eagle3Config.from_dict(config, TARGET, aux_layer_convention="input")
    assert parsed.aux_layer_ids == (0, 2, 3)
    with pytest.raises(ValueError, match=r"layers \[4\]"):                     # output 4: no such layer
        eagle3.Eagle3Config.from_dict(config, TARGET)
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    with pytest.raises(ValueError, match="embedding"):
        eagle3.Eagle3Config.from_dict(config, TARGET, aux_layer_convention="input")


def test_speculators_format(draft_dir):
    """vLLM's speculators config: the Llama layer nested, norm_before_residual on by default."""
    flat = json.loads((draft_dir / "config.json").read_text())
    layer_keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                  "rms_norm_eps", "rope_theta", "vocab_size", "hidden_act", "num_hidden_layers")
    config = {"speculators_model_type": "eagle3", "transformer_layer_config": {k: flat[k] for k in layer_keys},
              "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": TARGET.hidden_size,
              "eagle_aux_hidden_state_layer_ids": list(AUX_IDS),
              "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}]}}
    names = eagle3.expected_eagle3_shapes(eagle3.Eagle3Config.from_dir(draft_dir, TARGET))
    parsed = eagle3.Eagle3Config.from_dict(config, TARGET, tensor_names=list(names))
    assert parsed.norm_before_residual and parsed.aux_layer_ids == AUX_IDS
    assert dataclasses.replace(parsed, norm_before_residual=False, max_position_embeddings=None, dtype=None) == \
        dataclasses.replace(eagle3.Eagle3Config.from_dir(draft_dir, TARGET), max_position_embeddings=None, dtype=None)


def _edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def _drop(name):
    return lambda t: t.pop(name)


def _set(name, value):
    def edit(t):
        t[name] = value(t)
    return edit


def _d2t(index, value):
    def edit(t):
        t["d2t"] = t["d2t"].copy()
        t["d2t"][index] = value(t["d2t"])
    return edit


@pytest.mark.parametrize("edit, message", [
    (_drop("midlayer.self_attn.q_proj.weight"), r"missing .*'layers\.0\.self_attn\.q_proj\.weight'"),
    (_drop("norm.weight"), r"missing .*'norm\.weight'"),
    (_set("midlayer.self_attn.q_norm.weight", lambda t: np.ones(32, np.float32)),
     r"unexpected .*'midlayer\.self_attn\.q_norm\.weight'"),
    (_set("fc.weight", lambda t: t["fc.weight"][:, :256].copy()), r"'fc\.weight'.*expected shape \(128, 384\)"),
    (_set("model.fc.weight", lambda t: t["fc.weight"]), r"'fc\.weight' is stored twice"),
    (_d2t(-1, lambda d: 10 ** 6), r"'d2t': draft id 199 maps to target id .* outside the vocabulary"),
    (_d2t(1, lambda d: d[0] - 1), r"'d2t': two draft ids map to the same target id"),
    (_set("t2d", lambda t: ~t["t2d"]), r"'t2d' disagrees with 'd2t'"),
    (_set("d2t", lambda t: t["d2t"].astype(np.float32)), r"'d2t': expected integer offsets"),
], ids=["missing_q_proj", "missing_norm", "extra", "shape", "twice", "d2t_range", "d2t_duplicate", "t2d",
        "d2t_dtype"])
def test_bad_checkpoints_name_the_tensor(tmp_path, edit, message):
    path = write_draft(tmp_path)
    _edit_tensors(path, edit)
    with pytest.raises(ValueError, match=message):
        eagle3.load_eagle3_weights(path, eagle3.Eagle3Config.from_dir(path, TARGET))


def _config_edit(key, value):
    def edit(config):
        config[key] = value
    return edit


def _ids(ids):
    def edit(config):
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    return edit


@pytest.mark.parametrize("edit, message", [
    (_config_edit("vocab_size", 1000), r"vocab_size=1000, but the target's vocabulary has 512"),
    (_config_edit("target_hidden_size", 64), r"target_hidden_size=64, but the target's hidden size is 128"),
    (_ids([0, 1, 4]), r"layers \[4\] .* not layers of the target \(0\.\.3\)"),
    (_ids([0, 1]), r"EAGLE-3 fuses 3 target layers"),
    (_config_edit("num_hidden_layers", 2), r"exactly 1 layer"),
    (_config_edit("rope_scaling", {"rope_type": "yarn", "factor": 4.0}), r"'yarn' is not supported"),
    (_config_edit("hidden_act", "gelu"), r"hidden_act"),
    (_config_edit("architectures", ["LlamaForCausalLM"]), r"architectures: expected one of"),
    (_config_edit("attention_bias", True), r"attention_bias"),
], ids=["vocab", "target_hidden", "layer_range", "two_layers", "num_layers", "yarn", "act", "arch", "bias"])
def test_bad_configs_name_the_key_and_file(tmp_path, edit, message):
    path = write_draft(tmp_path)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as info:
        eagle3.Eagle3Config.from_dir(path, TARGET)
    assert str(path / "config.json") in str(info.value)


def test_a_config_that_disagrees_with_the_tensors(tmp_path):
    """No draft_vocab_size: the head would cover the whole vocabulary, but d2t has 200 entries."""
    path = write_draft(tmp_path)
    config = json.loads((path / "config.json").read_text())
    del config["draft_vocab_size"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tensor 'd2t' .*expected shape \(512,\), got \(200,\)"):
        eagle3.load_eagle3_weights(path, eagle3.Eagle3Config.from_dir(path, TARGET))


def test_shared_tensors_need_a_matching_target(tmp_path):
    with pytest.raises(ValueError, match=r"no embed_tokens\.weight.*hidden_size=64"):
        eagle3.Eagle3Config.from_dir(write_draft(tmp_path / "a", with_embedding=False, hidden_size=64), TARGET)
    compressed = write_draft(tmp_path / "b")
    _edit_tensors(compressed, _drop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"no lm_head\.weight.*draft_vocab_size=200"):
        eagle3.Eagle3Config.from_dir(compressed, TARGET)
    path = write_draft(tmp_path / "c", with_embedding=False, with_lm_head=False, draft_vocab_size=None)
    config = eagle3.Eagle3Config.from_dir(path, TARGET)
    assert not (config.has_embedding or config.has_lm_head or config.has_d2t)
    weights = eagle3.load_eagle3_weights(path, config)
    with pytest.raises(ValueError, match="target_embed: the draft has no 'embed_tokens.weight'"):
        Eagle3Draft(config, {n: torch.from_numpy(t) for n, t in weights.items()})
    with pytest.raises(ValueError, match="target_lm_head: the draft has no 'lm_head.weight'"):
        jax_eagle3.params_from_weights(config, weights, target_embed=np.zeros((512, 128), np.float32))


# transformers 5.23's ROPE_INIT_FUNCTIONS for head_dim 32 (the values printed by it, float32): "llama3"
# with theta 5e5, factor 8, low/high frequency factors 1 and 4 and an original context of 64 tokens
# (frequencies in all three regimes), and "linear" with theta 1e4 and factor 4.
ROPE_GOLDEN = [
    ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64},
     [1.0, 0.44036662578582764, 0.07940301299095154, 0.010674637742340565, 0.004700753837823868,
      0.0020700551103800535, 0.0009115831344388425, 0.00040143076330423355, 0.00017677668074611574,
      7.784655463183299e-05, 3.428102354519069e-05, 1.5096217794052791e-05, 6.647869668086059e-06,
      2.927499735960737e-06, 1.289173155782919e-06, 5.677088097399974e-07]),
    ({"type": "linear", "factor": 4.0, "rope_theta": 10000.0},
     [0.25, 0.14058533310890198, 0.07905694097280502, 0.04445698484778404, 0.02500000037252903,
      0.014058532193303108, 0.007905694656074047, 0.004445698577910662, 0.0024999999441206455,
      0.0014058533124625683, 0.0007905694656074047, 0.00044456985779106617, 0.0002500000118743628,
      0.00014058532542549074, 7.905694656074047e-05, 4.4456985051510856e-05]),
]


@pytest.mark.parametrize("rope, golden", ROPE_GOLDEN, ids=["llama3", "linear"])
def test_rope_scaling_matches_transformers(draft_dir, rope, golden):
    config = json.loads((draft_dir / "config.json").read_text())
    config["rope_scaling"] = rope
    parsed = eagle3.Eagle3Config.from_dict(config, TARGET)
    np.testing.assert_allclose(parsed.inv_freq(), golden, rtol=1e-6)
    assert parsed.rope_theta == rope.get("rope_theta")


# -- the layer: scenario and float64 reference ------------------------------------------------------

@dataclasses.dataclass
class Step:
    """One step's host arrays (the engine's), for both frameworks."""
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_table: np.ndarray
    seq_lens: np.ndarray
    q_lens: list
    num_context: int
    hidden: np.ndarray
    requests: np.ndarray     # request of each token

    def torch(self) -> StepTensors:
        return StepTensors(*(torch.from_numpy(a) for a in (self.input_ids, self.positions, self.slot_mapping,
                                                           self.block_table, self.seq_lens)),
                           logits_rows=torch.zeros(0, dtype=torch.int64))

    def jax(self) -> StepBatch:
        return StepBatch(*(jnp.asarray(a) for a in (self.input_ids, self.positions, self.slot_mapping,
                                                    self.block_table, self.seq_lens)), jnp.zeros(0, jnp.int32))


def scenario(config: eagle3.Eagle3Config, steps, *, seed=0) -> list[Step]:
    """``steps``: per step ``(q_lens, num_context, "aux" | "h")`` (the hidden input: the target's
    aux states or the draft's own h_out); requests start at position 0 and own shuffled pages;
    unused block-table entries hold -1 and BAD_PAGE."""
    rng = np.random.default_rng(seed)
    num_requests = len(steps[0][0])
    pages = rng.permutation(NUM_SLOTS).astype(np.int32)
    table = np.full((num_requests, MAX_BLOCKS), BAD_PAGE, np.int32)
    table[:, 1::2] = -1
    total = np.sum([q for q, _, _ in steps], axis=0)
    used = 0
    for r, n in enumerate(total):
        blocks = -(-int(n) // 128)
        table[r, :blocks] = pages[used:used + blocks]
        used += blocks
    out, start = [], np.zeros(num_requests, np.int64)
    for q_lens, num_context, kind in steps:
        width = config.fc_in_features if kind == "aux" else config.hidden_size
        requests = np.repeat(np.arange(num_requests), q_lens)
        positions = np.concatenate([np.arange(s, s + q) for s, q in zip(start, q_lens)]).astype(np.int32)
        slots = (table[requests, positions // 128] * 128 + positions % 128).astype(np.int32)
        start = start + np.asarray(q_lens)
        out.append(Step(rng.integers(3, TARGET.vocab_size, len(positions)).astype(np.int32), positions, slots,
                        table, start.astype(np.int32), list(q_lens), num_context,
                        rng.standard_normal((len(positions), width)).astype(np.float32), requests))
    return out


def draft_planner(config: eagle3.Eagle3Config) -> planner.StepPlanner:
    target = planner.StepConfig(num_q_heads=TARGET.num_attention_heads, num_kv_heads=TARGET.num_key_value_heads,
                                head_dim=TARGET.head_dim, max_batch=2, max_num_tokens=256, max_blocks=MAX_BLOCKS,
                                topk=TARGET.index_topk_blocks)
    return planner.StepPlanner(eagle3.draft_step_config(config, target))


def _f64(weights, name):
    return np.asarray(weights[name], np.float64)


def ref_rms(x, weight, eps):
    return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def ref_rope(x, positions, inv_freq):
    angles = positions[:, None] * inv_freq.astype(np.float64)[None, :]
    cos, sin = np.cos(np.concatenate([angles] * 2, -1))[:, None], np.sin(np.concatenate([angles] * 2, -1))[:, None]
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def ref_layer(c: eagle3.Eagle3Config, w: dict, ids, positions, h):
    """The draft layer over ONE request's tokens at positions 0..T-1 (float64, causal attention)."""
    L, eps, T = eagle3.LAYER, c.rms_norm_eps, len(ids)
    hq, hk, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    normed = ref_rms(h, _f64(w, L + "hidden_norm.weight"), eps)
    x = np.concatenate([ref_rms(_f64(w, "embed_tokens.weight")[ids], _f64(w, L + "input_layernorm.weight"), eps),
                        normed], -1)
    proj = {n: x @ _f64(w, L + f"self_attn.{n}_proj.weight").T for n in "qkv"}
    q = ref_rope(proj["q"].reshape(T, hq, d), positions, c.inv_freq())
    k = np.repeat(ref_rope(proj["k"].reshape(T, hk, d), positions, c.inv_freq()), hq // hk, axis=1)
    v = np.repeat(proj["v"].reshape(T, hk, d), hq // hk, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) * d ** -0.5 + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    attn = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), v).reshape(T, hq * d)
    r = (normed if c.norm_before_residual else h) + attn @ _f64(w, L + "self_attn.o_proj.weight").T
    n = ref_rms(r, _f64(w, L + "post_attention_layernorm.weight"), eps)
    gate, up = n @ _f64(w, L + "mlp.gate_proj.weight").T, n @ _f64(w, L + "mlp.up_proj.weight").T
    return r + (gate / (1 + np.exp(-gate)) * up) @ _f64(w, L + "mlp.down_proj.weight").T


def reference(c: eagle3.Eagle3Config, w: dict, steps: list[Step]) -> list[np.ndarray]:
    """Each step's h_out rows, from each request's whole sequence run at once."""
    fused = [s.hidden.astype(np.float64) if s.hidden.shape[1] == c.hidden_size
             else s.hidden.astype(np.float64) @ _f64(w, "fc.weight").T for s in steps]
    requests, positions, ids = (np.concatenate([getattr(s, a) for s in steps])
                                for a in ("requests", "positions", "input_ids"))
    h, out = np.concatenate(fused), np.zeros((len(ids), c.hidden_size))
    for r in np.unique(requests):
        rows = np.flatnonzero(requests == r)
        assert (positions[rows] == np.arange(len(rows))).all()
        out[rows] = ref_layer(c, w, ids[rows], positions[rows].astype(np.float64), h[rows])
    return np.split(out, np.cumsum([len(s.input_ids) for s in steps])[:-1])


def ref_heads(c: eagle3.Eagle3Config, w: dict, h_out):
    """-> (draft-vocab logits, the draft's greedy token as a target id)."""
    head = _f64(w, "lm_head.weight" if "lm_head.weight" in w else "embed_tokens.weight")
    logits = ref_rms(h_out, _f64(w, "norm.weight"), c.rms_norm_eps) @ head.T
    ids = eagle3.draft_to_target_ids(w["d2t"]) if "d2t" in w else np.arange(c.vocab_size)
    return logits, ids[logits.argmax(-1)]


def run_torch(draft: Eagle3Draft, steps: list[Step], dtype="float32") -> list[np.ndarray]:
    cache = allocate_draft_cache(draft.config, NUM_SLOTS, dtype)
    cache.pool.fill_(float("nan"))
    plans = draft_planner(draft.config)
    outs = []
    for s in steps:
        plan = plans.plan(s.seq_lens, q_lens=s.q_lens, num_context=s.num_context)
        h = draft.forward(s.torch(), plan, cache.caches, torch.from_numpy(s.hidden).to(draft.dtype))
        outs.append(h.float().numpy())
    return outs


def run_jax(config: eagle3.Eagle3Config, params: dict, steps: list[Step], *, jit=False) -> list[np.ndarray]:
    layout = jax_eagle3.pool_layout(config, NUM_SLOTS, "float32")
    pool = jnp.full(layout.shape, jnp.nan, jnp.float32)
    plans = draft_planner(config)
    forward = jax.jit(jax_eagle3.forward, static_argnames=("config", "layout", "spec"),
                      donate_argnames=("pool",)) if jit else jax_eagle3.forward
    outs = []
    for s in steps:
        spec, maps = m3_jax.step_inputs(plans.plan(s.seq_lens, q_lens=s.q_lens, num_context=s.num_context))
        h, pool = forward(params, pool, s.jax(), maps, jnp.asarray(s.hidden), config=config, layout=layout, spec=spec)
        outs.append(np.asarray(h))
    return outs


def assert_close(got, want, tol, what):
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < tol, f"{what}: relative error {err:.2e}"


# The main scenario: requests of 5 and 129 prompt tokens, then a 2-token and a 1-token decode step.
STEPS = [((5, 129), 2, "aux"), ((2, 2), 0, "aux"), ((1, 1), 0, "h")]


# -- the layer in torch and JAX ---------------------------------------------------------------------

def main_case(draft_dir):
    config = eagle3.Eagle3Config.from_dir(draft_dir, TARGET)
    weights = eagle3.load_eagle3_weights(draft_dir, config)
    steps = scenario(config, STEPS)
    return config, weights, steps, reference(config, weights, steps)


def test_torch_draft_matches_reference(draft_dir):
    """Every step's h_out, the draft logits and the greedy tokens mapped through d2t."""
    config, weights, steps, want = main_case(draft_dir)
    assert config.num_kv_groups == 1                                        # full MHA, as the M3 drafts
    draft = Eagle3Draft.load(draft_dir, TARGET, dtype=torch.float32)
    got = run_torch(draft, steps)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, 1e-5, f"step {i}")
    ref_logits, ref_tokens = ref_heads(config, weights, np.concatenate(want))
    check_torch_heads(draft, torch.from_numpy(np.concatenate(got)), weights, ref_logits, ref_tokens)


@pytest.mark.long
def test_jax_draft_matches_reference(draft_dir):
    """The same steps in jitted JAX (pool donated): ~10 s of interpreter on one core (the short
    scenario of ``test_torch_and_jax_agree`` runs by default)."""
    config, weights, steps, want = main_case(draft_dir)
    params = jax_eagle3.params_from_weights(config, weights)
    got = run_jax(config, params, steps, jit=True)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, 1e-5, f"step {i}")
    ref_logits, ref_tokens = ref_heads(config, weights, np.concatenate(want))
    check_jax_heads(config, params, jnp.asarray(np.concatenate(got)), ref_logits, ref_tokens)


def test_torch_and_jax_agree(tmp_path):
    """A GQA draft (group 2) with the norm before the residual, the short scenario: torch and jitted
    JAX against the reference and within float32 rounding of each other."""
    path = write_draft(tmp_path, num_key_value_heads=1, norm_before_residual=True)
    config = eagle3.Eagle3Config.from_dir(path, TARGET)
    assert config.num_kv_groups == 2 and config.norm_before_residual
    weights = eagle3.load_eagle3_weights(path, config)
    steps = scenario(config, SHORT, seed=6)
    want = reference(config, weights, steps)
    draft = Eagle3Draft(config, {n: torch.from_numpy(t) for n, t in weights.items()})
    params = jax_eagle3.params_from_weights(config, weights)
    got_torch, got_jax = run_torch(draft, steps), run_jax(config, params, steps, jit=True)
    for i, (t, j, w) in enumerate(zip(got_torch, got_jax, want)):
        assert_close(t, w, 1e-5, f"torch step {i}")
        assert_close(j, w, 1e-5, f"JAX step {i}")
        np.testing.assert_allclose(j, t, rtol=1e-5, atol=1e-5, err_msg=f"step {i}: JAX vs torch")
    ref_logits, ref_tokens = ref_heads(config, weights, np.concatenate(want))
    check_torch_heads(draft, torch.from_numpy(np.concatenate(got_torch)), weights, ref_logits, ref_tokens)
    check_jax_heads(config, params, jnp.asarray(np.concatenate(got_jax)), ref_logits, ref_tokens)


def check_torch_heads(draft: Eagle3Draft, h_out, weights, ref_logits, ref_tokens):
    rows = torch.arange(h_out.shape[0])
    draft_logits = draft.draft_logits(h_out, rows)
    assert_close(draft_logits.numpy(), ref_logits, 1e-5, "torch draft logits")
    tokens = draft.draft_tokens(h_out, rows)
    assert tokens.tolist() == ref_tokens.tolist()
    draft_ids = draft_logits.argmax(-1)
    assert (tokens == draft_ids + torch.from_numpy(weights["d2t"])[draft_ids]).all()
    assert (tokens != draft_ids).any()                                      # the map is not the identity
    full = draft.logits(h_out, rows)                                        # over the target vocabulary
    mapped = torch.from_numpy(eagle3.draft_to_target_ids(weights["d2t"])).long()
    assert full.shape == (h_out.shape[0], TARGET.vocab_size)
    assert torch.equal(full[:, mapped], draft_logits)
    off = torch.ones(TARGET.vocab_size, dtype=torch.bool)
    off[mapped] = False
    assert torch.isneginf(full[:, off]).all() and torch.equal(full.argmax(-1), tokens)


def check_jax_heads(config, params, h_out, ref_logits, ref_tokens):
    @jax.jit
    def heads(params, h_out):   # one compilation: eager ops compile one by one on the CPU backend
        return (jax_eagle3.draft_logits(params, h_out, config=config),
                jax_eagle3.draft_tokens(params, h_out, config=config), jax_eagle3.logits(params, h_out, config=config))

    draft_logits, tokens, full = (np.asarray(a) for a in heads(params, h_out))
    assert_close(draft_logits, ref_logits, 1e-5, "JAX draft logits")
    assert tokens.tolist() == ref_tokens.tolist()
    assert (np.isfinite(full).sum(-1) == DRAFT_VOCAB).all() and (full.argmax(-1) == tokens).all()
    np.testing.assert_allclose(full[:, np.asarray(params["draft_to_target"])], draft_logits, rtol=1e-5, atol=1e-5)


# -- variants (short sequences) ---------------------------------------------------------------------

SHORT = [((3, 2), 2, "aux"), ((2, 2), 0, "aux"), ((1, 1), 0, "h")]
TWO_STEPS = [SHORT[0], SHORT[-1]]


@pytest.mark.parametrize("variant", [
    dict(with_embedding=False, with_lm_head=False, draft_vocab_size=None),     # the target's embedding and head
    dict(hidden_size=64, head_dim=16),                                         # a draft narrower than the target
], ids=["target_embed_and_head", "narrow"])
def test_variants_match_reference(tmp_path, variant):
    path = write_draft(tmp_path, **variant)
    config = eagle3.Eagle3Config.from_dir(path, TARGET)
    weights = eagle3.load_eagle3_weights(path, config)
    rng = np.random.default_rng(3)
    shared = {n: rng.standard_normal((TARGET.vocab_size, TARGET.hidden_size)).astype(np.float32)
              for n in ("embed_tokens.weight", "lm_head.weight") if n not in weights}
    full = {**weights, **shared}
    steps = scenario(config, TWO_STEPS, seed=4)
    want = reference(config, full, steps)
    draft = Eagle3Draft(config, {n: torch.from_numpy(t) for n, t in weights.items()},
                        target_embed=_maybe_torch(shared.get("embed_tokens.weight")),
                        target_lm_head=_maybe_torch(shared.get("lm_head.weight")))
    got = run_torch(draft, steps)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, 1e-5, f"step {i}")
    _, ref_tokens = ref_heads(config, full, want[-1])
    assert draft.draft_tokens(torch.from_numpy(got[-1]), torch.arange(len(got[-1]))).tolist() == ref_tokens.tolist()


def _maybe_torch(array):
    return None if array is None else torch.from_numpy(array)


def test_bfloat16_torch_within_rounding(tmp_path):
    path = write_draft(tmp_path)
    config = eagle3.Eagle3Config.from_dir(path, TARGET)
    steps = scenario(config, TWO_STEPS, seed=5)
    want = reference(config, eagle3.load_eagle3_weights(path, config), steps)
    draft = Eagle3Draft.load(path, TARGET, dtype=torch.bfloat16)
    assert draft.dtype == torch.bfloat16
    for i, (g, w) in enumerate(zip(run_torch(draft, steps, "bfloat16"), want)):
        assert_close(g, w, 2e-2, f"bf16 step {i}")
