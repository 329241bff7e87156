"""FP8 weights in the engines: ``quantization="fp8"`` (quantized at load), FP8 and MXFP8 checkpoints.

CPU, the tiny model in its 128-aligned form (``tiny_fp8_config``: every quantized weight is whole
128 x 128 blocks, as the FP8 kernels need), float32. The FP8 kernels run in Triton's interpreter.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import m3_jax
import m3_torch
from m3_engine import SamplingParams, checkpoint, quantization
from m3_engine.args import EngineArgs
from m3_engine.model_config import load_config
from m3_engine.tiny_model import tiny_fp8_config, write_tiny_checkpoint
from m3_engine.tp import TPPlan
from m3_kernels import tuning
from m3_torch import fp8 as tfp8
from m3_torch.reference import dequantize_fp8_ref

import hf_reference
from jax_helpers import _jax_device, jax_gpu_ready  # noqa: F401  (autouse: CPU tests run on JAX's CPU device)

# FP8 weights move this model's next-token logprobs by up to ~0.2 (its random weights give flat logits
# whose top-2 margins are often smaller than that): the bound the tests hold it to
FP8_LOGPROB_ERROR = 0.3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same random weights unquantized, as an FP8 checkpoint and as an MXFP8 checkpoint."""
    root = tmp_path_factory.mktemp("m3_tiny_fp8")
    return {q: write_tiny_checkpoint(root / str(q), seed=1, form="vl", quantization=q, **tiny_fp8_config())
            for q in (None, "fp8", "mxfp8")}


def prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 512, n).tolist()


def generate(llm, prompts, max_tokens, logprobs=2):
    """Greedy -> per prompt (tokens, [per step {token: logprob} of the top ``logprobs``])."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    return [(o.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.logprobs]) for o in outs]


def checked_steps(logprobs, near_tie) -> int:
    """hf_reference's rule on an engine's own top-2 logprobs: the steps before the first near tie."""
    top2 = [sorted(step.values(), reverse=True)[:2] for step in logprobs]
    steps = SimpleNamespace(tokens=top2, margins=[a - b for a, b in top2])   # what checked_steps reads
    return hf_reference.checked_steps(steps, near_tie)


def layer_weights(llm, i=1):
    return llm.runner.model.layers[i]


# -- options and checks --------------------------------------------------------------------------

def test_quantization_option_checks(checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"quantization: expected None .* \('fp8',\), got 'awq'"):
        EngineArgs(model=str(checkpoints[None]), quantization="awq").check()
    assert EngineArgs(model=str(checkpoints[None]), quantization="fp8").check().quantization == "fp8"
    assert EngineArgs(model=str(checkpoints[None])).check().quantization is None
    for q in ("fp8", "mxfp8"):   # unset: as the checkpoint says; "fp8" agrees with either
        args = EngineArgs(model=str(checkpoints[q])).check()
        assert (args.quantization, args.checkpoint_quantization) == ("fp8", q)
        assert EngineArgs(model=str(checkpoints[q]), quantization="fp8").check().quantization == "fp8"
    other = write_tiny_checkpoint(tmp_path / "awq", seed=1, form="text", **tiny_fp8_config())
    config = (other / "config.json").read_text()
    (other / "config.json").write_text(config[:-1] + ', "quantization_config": {"quant_method": "awq"}}')
    with pytest.raises(ValueError, match=r"quant_method: expected one of \('fp8', 'mxfp8'\), got 'awq'"):
        EngineArgs(model=str(other)).check()
    # the default tiny model's K/V projections are 64 rows: not whole 128 x 128 blocks
    small = write_tiny_checkpoint(tmp_path / "small", seed=1, form="text")
    with pytest.raises(ValueError, match=r"k_proj.weight' must split into whole 128 x 128 blocks"):
        EngineArgs(model=str(small), quantization="fp8").check()


def test_tp_keeps_whole_blocks(checkpoints, tmp_path):
    """TP 2 halves the 128-wide MLPs (64 columns of down_proj a rank): refused; a 256-wide model splits on block
    edges and a rank reads exactly its blocks' scales."""
    config = load_config(checkpoints["fp8"])
    with pytest.raises(ValueError, match=r"down_proj.weight.* \(tensor_parallel_size=2\) is \(128, 64\)"):
        quantization.check_fp8_shapes(TPPlan(config, 2), checkpoint.expected_shapes(config))
    with pytest.raises(ValueError, match=r"tensor_parallel_size"):
        EngineArgs(model=str(checkpoints["fp8"]), tensor_parallel_size=2).check()

    wide = write_tiny_checkpoint(tmp_path / "wide", seed=2, form="vl", quantization="fp8",
                                 **{**tiny_fp8_config(), "intermediate_size": 256, "shared_intermediate_size": 256,
                                    "dense_intermediate_size": 256})
    plan = TPPlan(load_config(wide), 2)
    whole = checkpoint.load_weights(wide, framework="pt", concatenate=torch.cat)
    ranks = [checkpoint.load_weights(wide, framework="pt", concatenate=torch.cat, shard=plan.rank(r))
             for r in range(2)]
    gate_up = "model.layers.1.mlp.experts.gate_up_proj_scale_inv"
    assert whole[gate_up].shape == (4, 4, 1) and ranks[1][gate_up].shape == (4, 2, 1)
    for r in range(2):
        for name, tensor in ranks[r].items():
            cut = plan.slice(quantization.weight_name(name), r)
            if cut is not None and quantization.is_scale(name):
                cut = quantization.scale_slice(cut, tensor.dim())
            want = whole[name] if cut is None else cut.take(whole[name], torch.cat)
            assert torch.equal(tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor,
                               want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want), name


def test_dummy_weights_follow_the_config(checkpoints):
    """load_format="dummy" with an FP8 checkpoint's config.json: random weights, quantized as they are made."""
    llm = m3_torch.LLM(checkpoints["fp8"], load_format="dummy", max_num_seqs=1, max_model_len=128)
    layer = layer_weights(llm)
    assert isinstance(layer.qkv, m3_torch.model.Fp8Weight) and isinstance(layer.experts_down, m3_torch.model.Fp8Weight)
    assert layer.experts_down.scale.shape == (4, 1, 1) and layer.router.dtype == torch.float32


# -- the models ----------------------------------------------------------------------------------

def test_fp8_checkpoint_is_quantize_at_load(checkpoints):
    """The FP8 checkpoint's tensors are what quantize-at-load makes of the unquantized ones (bit for bit),
    the router / norms / embeddings / lm_head stay unquantized, and the greedy tokens are the same."""
    prompts = [prompt(5, seed=2)]
    with tuning.override(target_programs=1, sparse_target_programs=1):
        at_load = m3_torch.LLM(checkpoints[None], quantization="fp8", max_num_seqs=1, max_model_len=128)
        stored = m3_torch.LLM(checkpoints["fp8"], max_num_seqs=1, max_model_len=128)
        for a, b in zip(at_load.runner.model.layers, stored.runner.model.layers):
            for field in ("qkv", "o_proj", "mlp_gate_up", "mlp_down", "experts_gate_up", "experts_down",
                          "shared_gate_up", "shared_down"):
                wa, wb = getattr(a, field), getattr(b, field)
                if wa is None:
                    continue
                assert isinstance(wa, m3_torch.model.Fp8Weight) and wa.weight.dtype == torch.float8_e4m3fn
                assert torch.equal(wa.weight.view(torch.uint8), wb.weight.view(torch.uint8)), field
                assert torch.equal(wa.scale, wb.scale), field
            assert a.router is None or a.router.dtype == torch.float32
        assert at_load.runner.model.lm_head.dtype == torch.float32
        assert generate(at_load, prompts, 1)[0][0] == generate(stored, prompts, 1)[0][0]


@pytest.mark.long   # ~20 s on the interpreter
def test_fp8_tokens_follow_unquantized(checkpoints):
    """quantization="fp8" vs the unquantized model: the first step's logprobs within the FP8 error, and the
    same greedy tokens up to the first step whose top-2 margin that error may flip (twice the measured
    error: each of the two logprobs may move by it)."""
    prompts = [prompt(n, seed=n) for n in (1, 5, 9, 17, 40, 130)]
    kwargs = dict(max_num_seqs=len(prompts), max_model_len=256)
    with tuning.override(target_programs=1, sparse_target_programs=1):
        ref = generate(m3_torch.LLM(checkpoints[None], **kwargs), prompts, 4, logprobs=5)
        out = generate(m3_torch.LLM(checkpoints[None], quantization="fp8", **kwargs), prompts, 4, logprobs=5)
    error = max(abs(r[1][0][t] - o[1][0][t]) for r, o in zip(ref, out) for t in r[1][0].keys() & o[1][0].keys())
    print(f"FP8 vs unquantized: first-step logprobs differ by up to {error:.3f}")
    assert 0 < error <= FP8_LOGPROB_ERROR
    checked = 0
    for (ref_tokens, ref_logprobs), (tokens, _) in zip(ref, out):
        n = checked_steps(ref_logprobs, 2 * error)
        assert tokens[:n] == ref_tokens[:n], f"fp8 {tokens} vs unquantized {ref_tokens} (checked {n} steps)"
        checked += n
    assert checked >= 1   # the comparison checks something


@pytest.mark.long   # ~14 s on the interpreter (JAX compiles its steps)
def test_engines_agree_with_fp8_weights(checkpoints):
    """torch and JAX on the FP8 checkpoint: the same kernels on the same codes and scales, the same greedy
    tokens up to the first near tie (the dense math may round differently in the last bit)."""
    prompts = [prompt(20, seed=2)]
    kwargs = dict(max_num_seqs=1, max_model_len=128)
    with tuning.override(target_programs=1, sparse_target_programs=1):
        (torch_tokens, torch_logprobs), = generate(m3_torch.LLM(checkpoints["fp8"], **kwargs), prompts, 3)
        (jax_tokens, _), = generate(m3_jax.LLM(checkpoints["fp8"], **kwargs), prompts, 3)
    n = checked_steps(torch_logprobs, hf_reference.NEAR_TIE)
    assert n >= 1 and torch_tokens[:n] == jax_tokens[:n], f"torch {torch_tokens} vs jax {jax_tokens}"


@pytest.mark.long   # ~15 s: a worker process, the interpreter on both ranks
def test_tp2_fp8_gives_the_tokens_of_tp1(tmp_path):
    """TP 2 of an FP8 checkpoint whose MLPs split into whole blocks: each rank reads its blocks' codes and
    scales (column slices made contiguous for the kernels), and the greedy tokens are TP 1's."""
    model_dir = write_tiny_checkpoint(tmp_path / "wide", seed=3, form="vl", quantization="fp8",
                                      **{**tiny_fp8_config(), "num_attention_heads": 4, "num_key_value_heads": 2,
                                         "intermediate_size": 256, "shared_intermediate_size": 256,
                                         "dense_intermediate_size": 256})
    prompts, kwargs = [prompt(5, seed=5)], dict(device="cpu", max_num_seqs=1, max_model_len=128)
    with tuning.override(target_programs=1, sparse_target_programs=1):
        (want, logprobs), = generate(m3_torch.LLM(model_dir, **kwargs), prompts, 3)
        with m3_torch.LLM(model_dir, tensor_parallel_size=2, **kwargs) as tp2:
            (got, _), = generate(tp2, prompts, 3)
    n = checked_steps(logprobs, hf_reference.NEAR_TIE)
    assert n >= 1 and got[:n] == want[:n], f"tp2 {got} vs tp1 {want}"


# -- MXFP8 ---------------------------------------------------------------------------------------

def mxfp8(w: torch.Tensor):
    """float32 [..., N, K] -> (e4m3 codes, uint8 UE8M0 exponents [..., N, K / 32]): the smallest power of two
    per 1 x 32 block that brings its amax within 448."""
    blocks = w.unflatten(-1, (-1, quantization.MX_BLOCK))
    exponent = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp_min(2.0 ** -126) / 448.0)).clamp(-127, 127)
    codes = (blocks / torch.exp2(exponent)[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes.flatten(-2), (exponent + 127).to(torch.uint8)


def test_mxfp8_conversion_error():
    """MXFP8 -> 128 x 128 blocks on random weights: each element within half an e4m3 step of its block's
    scale (the requantization's rounding), ~2-3% relative error in norm vs the MXFP8 values (the same as
    quantizing BF16 weights directly); JAX's dequantization gives torch's bits."""
    w = torch.randn(2, 256, 384, generator=torch.Generator().manual_seed(0)) / 384 ** 0.5
    w[0, :128, :128] *= 100.0   # a block with a larger range than its neighbours
    codes, exponents = mxfp8(w)
    original = tfp8.dequantize_mxfp8(codes, exponents)
    assert torch.equal(original, codes.float() * torch.exp2(exponents.float() - 127).repeat_interleave(32, -1))
    new_codes, scale = tfp8.quantize_weight(original)
    converted = torch.stack([dequantize_fp8_ref(new_codes[e], scale[e]) for e in range(2)]).float()
    per_element = scale.repeat_interleave(128, -2).repeat_interleave(128, -1) * 16.0   # half of e4m3's top step
    assert ((converted - original).abs() <= per_element * (1 + 1e-6)).all()   # (float32 rounding of the bound)
    error = (torch.linalg.norm(converted - original) / torch.linalg.norm(original)).item()
    direct = torch.stack([dequantize_fp8_ref(*[t[e] for t in tfp8.quantize_weight(w)]) for e in range(2)]).float()
    direct_error = (torch.linalg.norm(direct - w) / torch.linalg.norm(w)).item()
    print(f"MXFP8 -> 128x128 FP8: relative error {error:.4f} vs the MXFP8 values "
          f"(direct FP8 quantization of the weights: {direct_error:.4f})")
    assert error < 0.04 and error < 1.5 * direct_error

    import jax.numpy as jnp
    from m3_jax import fp8 as jfp8
    jax_original = jfp8.dequantize_mxfp8(jnp.asarray(codes.view(torch.uint8).numpy()).view(jnp.float8_e4m3fn),
                                         jnp.asarray(exponents.numpy()))
    assert np.array_equal(np.asarray(jax_original), original.numpy())


def test_mxfp8_checkpoint_loads_converted(checkpoints):
    """An MXFP8 checkpoint loads as 128 x 128 FP8: each weight is quantize_weight of its dequantized MXFP8
    tensors (the per-expert pieces merged)."""
    stored = checkpoint.load_weights(checkpoints["mxfp8"], framework="pt", concatenate=torch.cat)
    assert stored["model.layers.1.mlp.experts.gate_up_proj_scale"].dtype == torch.uint8
    with tuning.override(target_programs=1, sparse_target_programs=1):
        llm = m3_torch.LLM(checkpoints["mxfp8"], max_num_seqs=1, max_model_len=128)
        layer = layer_weights(llm)
        for field, name in (("experts_gate_up", "mlp.experts.gate_up_proj"),
                            ("o_proj", "self_attn.o_proj.weight")):
            name = "model.layers.1." + name
            codes, scale = tfp8.quantize_weight(tfp8.dequantize_mxfp8(stored[name], stored[name + "_scale"]))
            assert torch.equal(getattr(layer, field).weight.view(torch.uint8), codes.view(torch.uint8)), field
            assert torch.equal(getattr(layer, field).scale, scale), field
