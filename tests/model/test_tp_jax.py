"""m3_jax.LLM with tensor_parallel_size=2: a Mesh over 2 devices, NamedSharding, shard_map; TP=2 tokens = TP=1's.

CPU: two fake CPU devices need ``XLA_FLAGS=--xla_force_host_platform_device_count=2``
before JAX initialises, so the TP run happens in a subprocess (with
``PJRT_NPROC=3``: JAX's CPU client needs a thread more than the devices for the
interpreted kernels' callbacks, see ``m3_jax.runner._check_cpu_threads``). The
tiny checkpoint, fp32; tokens are compared up to the first step whose
reference (transformers) top-2 margin is below 1e-3, as in the other model
tests. GPU (2 devices): bf16, TP=2 vs TP=1 in this process.
"""

import json
import multiprocessing
import os
import subprocess
import sys

import numpy as np
import pytest

import m3_jax
from m3_engine.tiny_model import write_tiny_checkpoint

import hf_reference
from engine_helpers import generate_ids
from jax_helpers import _jax_device, jax_gpu_ready  # noqa: F401  (autouse: JAX on its CPU device)

NEW_TOKENS = 2

# Runs in the subprocess: argv = model_dir, prompts (JSON), new tokens. Prints one JSON line.
SCRIPT = r"""
import json, os, sys
import jax, numpy as np
import m3_jax
from m3_kernels import tuning

def generate_ids(llm, prompts, max_new_tokens):
    params = m3_jax.SamplingParams(temperature=0, max_tokens=max_new_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

model_dir, prompts, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
kwargs = dict(device="cpu", max_num_seqs=2, max_model_len=256)

def caches(llm, flat, layer, slots):
    # a layer's K, V, index-K pages of one shard's flat pool, as numpy
    view = llm.runner.pool_layout.layer(layer)
    def take(sub):
        a = np.lib.stride_tricks.as_strided(flat[sub.offset:], sub.shape, [s * flat.itemsize for s in sub.strides])
        return a[slots].copy()
    return [take(view.k), take(view.v), take(view.index_k)]

out = {"devices": len(jax.devices())}
with tuning.override(target_programs=1, sparse_target_programs=1):
    tp1 = m3_jax.LLM(model_dir, **kwargs)
    out["tp1"] = generate_ids(tp1, prompts, max_new_tokens=new)
    c1 = caches(tp1, np.asarray(tp1.runner.pool), 1, [0, 1])

    saved = os.environ.get("PJRT_NPROC")
    os.environ["PJRT_NPROC"] = "2"          # the guard reads it: too few threads for 2 devices -> ValueError
    try:
        m3_jax.LLM(model_dir, tensor_parallel_size=2, **kwargs)
        out["guard"] = None
    except ValueError as e:
        out["guard"] = str(e)
    os.environ["PJRT_NPROC"] = saved

    tp2 = m3_jax.LLM(model_dir, tensor_parallel_size=2, **kwargs)
    out["tp2"] = generate_ids(tp2, prompts, max_new_tokens=new)
    out["specs"] = {n: str(tp2.runner.params[n].sharding.spec) for n in (
        "model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.self_attn.indexer.q_proj.weight", "model.layers.1.self_attn.indexer.k_proj.weight",
        "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
        "model.layers.1.mlp.gate.weight")}
    out["shapes"] = {n: list(tp2.runner.params[n].shape) for n in out["specs"]}
    out["pool"] = [list(tp2.runner.pool.shape), str(tp2.runner.pool.sharding.spec), len(tp2.runner.pool.devices())]
    out["shard_devices"] = sorted(s.device.id for s in tp2.runner.pool.addressable_shards)
    pool2 = np.asarray(tp2.runner.pool)
    diffs, index_k = [], []
    for rank in range(2):
        k, v, ik = caches(tp2, pool2[rank], 1, [0, 1])
        head = slice(rank, rank + 1)
        diffs.append([float(np.abs(k - c1[0][:, head]).max()), float(np.abs(v - c1[1][:, head]).max()),
                      float(np.abs(ik - c1[2]).max()), float(np.abs(ik).sum())])
        index_k.append(ik)
    out["cache_diffs"] = diffs
    out["index_k_equal"] = bool(np.array_equal(*index_k))
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Two layers (dense attention + dense MLP, MSA + MoE): every layer type at half the interpreter time."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m3_tp_jax"), seed=1, form="text", num_hidden_layers=2)


def prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 512, n).tolist()


@pytest.mark.long   # ~26 s on the interpreter: `make test` stays under 10 minutes on 2 cores
def test_tp2_gives_the_tokens_of_tp1(model_dir):
    """In a subprocess with 2 fake CPU devices: TP=1 and TP=2 greedy tokens, the weights' shardings, the
    pool ([2, one shard's flat pool], one row per device), each shard's caches against the TP=1 pool."""
    prompts = [prompt(5, seed=5), prompt(40, seed=40)]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", PJRT_NPROC="3",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), json.dumps(prompts), str(NEW_TOKENS)],
                         env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, f"subprocess failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["devices"] == 2

    for p, want, got in zip(prompts, out["tp1"], out["tp2"]):
        ref = hf_reference.reference_generate(model_dir, p, NEW_TOKENS)
        n = hf_reference.checked_steps(ref)
        assert n >= 2 and got[:n] == want[:n], f"prompt of {len(p)}: TP=2 {got} vs TP=1 {want} (checked {n})"
        hf_reference.assert_tokens_match(ref, want)

    assert "PJRT_NPROC=3" in out["guard"]
    specs, shapes = out["specs"], out["shapes"]
    tp_rows, tp_cols, rep = "P('tp', None)", "P(None, 'tp')", "P()"
    assert specs["model.embed_tokens.weight"] == tp_rows and specs["model.layers.1.mlp.gate.weight"] == rep
    assert specs["model.layers.1.self_attn.indexer.k_proj.weight"] == rep   # the one index-K head: replicated
    assert specs["lm_head.weight"] == tp_rows                               # vocab-parallel head
    for name in ("q_proj", "k_proj", "indexer.q_proj"):
        assert specs[f"model.layers.1.self_attn.{name}.weight"] == tp_rows, name
    assert specs["model.layers.1.self_attn.o_proj.weight"] == tp_cols
    assert specs["model.layers.1.mlp.experts.gate_up_proj"] == "P(None, 'tp', None)"
    assert specs["model.layers.1.mlp.experts.down_proj"] == "P(None, None, 'tp')"
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == [2 * 32, 128]   # one KV head per shard
    (rows, numel), spec, num_devices = out["pool"]
    assert rows == 2 and spec in ("P('tp',)", "P('tp', None)") and num_devices == 2
    assert out["shard_devices"] == [0, 1]
    for rank, (dk, dv, dik, ik_sum) in enumerate(out["cache_diffs"]):   # shard r: KV head r, the whole index-K
        assert max(dk, dv, dik) < 1e-4 and ik_sum > 0, (rank, dk, dv, dik)
    assert out["index_k_equal"]


# Runs in a subprocess with 8 CPU devices: argv = model_dir, prompts (JSON), new tokens, runs (JSON [[tp, ep], ...]).
M3_SCALE_SCRIPT = r"""
import json, sys, time
import m3_jax
from m3_kernels import tuning

model_dir, prompts, new, runs = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
params = m3_jax.SamplingParams(temperature=0, max_tokens=new)
out = {}
with tuning.override(target_programs=1, sparse_target_programs=1):
    for tp, ep in [[1, False]] + runs:
        start = time.monotonic()
        llm = m3_jax.LLM(model_dir, device="cpu", max_num_seqs=len(prompts), max_model_len=256,
                         tensor_parallel_size=tp, enable_expert_parallel=ep)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        specs = {} if tp == 1 else {n: str(llm.runner.params[n].sharding.spec) for n in (
            "model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.experts.gate_up_proj")}
        out[f"{tp},{ep}"] = dict(tokens=tokens, seconds=time.monotonic() - start, specs=specs)
        del llm
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def m3_shaped_dir(tmp_path_factory):
    """16 query heads over 2 KV heads, 8 experts (tests/test_tp_torch.py's M3-shaped model)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m3_tp_jax_shaped"), seed=3, form="text",
                                 num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=2,
                                 num_local_experts=8)


@pytest.mark.long   # 8 devices of interpreted kernels on 2 cores: minutes
def test_m3_scale_tp_gives_the_tokens_of_tp1(m3_shaped_dir):
    """In a subprocess with 8 fake CPU devices: TP=4 + expert parallel, TP=8 + expert parallel and TP=8 give
    the greedy tokens of TP=1 (checked up to transformers' near ties); the embedding and head are split over
    the vocabulary, the experts over their axis under expert parallelism, inside otherwise."""
    prompts = [prompt(7, seed=7), prompt(150, seed=150)]
    new = 4
    runs = [[4, True], [8, True], [8, False]]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", PJRT_NPROC="9",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, "-c", M3_SCALE_SCRIPT, str(m3_shaped_dir), json.dumps(prompts), str(new),
                          json.dumps(runs)], env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, f"subprocess failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    out = json.loads(lines[-1].removeprefix("RESULT "))
    print({key: round(r["seconds"]) for key, r in out.items()})
    want = out["1,False"]["tokens"]
    for p, w in zip(prompts, want):
        ref = hf_reference.reference_generate(m3_shaped_dir, p, new)
        hf_reference.assert_tokens_match(ref, w)
    for tp, ep in runs:
        result = out[f"{tp},{ep}"]
        for p, w, g in zip(prompts, want, result["tokens"]):
            n = hf_reference.checked_steps(hf_reference.reference_generate(m3_shaped_dir, p, new))
            assert n >= 2 and g[:n] == w[:n], f"TP={tp} EP={ep}, prompt of {len(p)}: {g} vs TP=1 {w} (checked {n})"
        specs = result["specs"]
        assert specs["model.embed_tokens.weight"] == specs["lm_head.weight"] == "P('tp', None)"
        assert specs["model.layers.1.mlp.experts.gate_up_proj"] == ("P('tp', None, None)" if ep
                                                                     else "P(None, 'tp', None)")


def test_too_few_devices(model_dir):
    """This process has one CPU device."""
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 devices.*xla_force_host_platform"):
        m3_jax.LLM(model_dir, tensor_parallel_size=2, device="cpu", max_num_seqs=1, max_model_len=128)


@pytest.mark.parametrize("overrides, tp, words", [
    (dict(num_attention_heads=6, num_key_value_heads=3), 2, r"tensor_parallel_size=2 and num_key_value_heads=3"),
    (dict(intermediate_size=30), 4, r"tensor_parallel_size=4 does not divide intermediate_size=30"),
], ids=["kv3_tp2", "experts30_tp4"])
def test_splits_that_do_not_exist_are_rejected(tmp_path, overrides, tp, words):
    model_dir = write_tiny_checkpoint(tmp_path, seed=0, form="text", num_hidden_layers=2, **overrides)
    with pytest.raises(ValueError, match=words):
        m3_jax.LLM(model_dir, tensor_parallel_size=tp, max_num_seqs=1, max_model_len=128)
    assert not multiprocessing.active_children()


# -- GPU: two devices, bf16 ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory):
    """Head dims of 64 (the GPU kernels' smallest tuned size), bf16 weights."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m3_tp_jax_gpu"), seed=0, head_dim=64, index_head_dim=64,
                                 rotary_dim=32, dtype="bfloat16")


@pytest.mark.gpu
def test_gpu_tp2_jax_bf16_gives_the_tokens_of_tp1(gpu_model_dir):
    import jax

    if not jax_gpu_ready() or len(jax.devices("gpu")) < 2:
        pytest.skip("needs a JAX GPU backend with 2 devices and jax_triton")
    prompts = [prompt(n, seed=n) for n in (1, 127, 129, 700)]
    kwargs = dict(dtype="bfloat16", max_num_seqs=4, max_model_len=1024, prefill_chunk=500)
    want = generate_ids(m3_jax.LLM(gpu_model_dir, device=jax.devices("gpu")[0], **kwargs), prompts, max_new_tokens=16)
    tp2 = m3_jax.LLM(gpu_model_dir, device="gpu", tensor_parallel_size=2, **kwargs)
    got = generate_ids(tp2, prompts, max_new_tokens=16)
    agree = sum(next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), len(w)) for w, g in zip(want, got))
    total = sum(map(len, want))
    print(f"bf16 JAX TP=2 vs TP=1: {agree}/{total} greedy tokens agree before the first divergence")
    assert agree >= total // 2
    decode = [s.generation_rows for s in tp2.runner.compiled_forwards if s.context_rows == 0]
    assert sorted(decode) == sorted(set(decode))   # one decode compilation per batch size
