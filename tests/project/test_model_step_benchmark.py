"""``benchmarks/model_step.py --tiny``: the M3-shape model-step benchmark's code path on the CPU.

One batch at one context and one token count for the pieces, both frameworks
(each through ``load_format="dummy"``), in this process; checks that the JSON
and markdown it writes carry every field the GPU run reports; and the byte
floor and the memory plan at M3's shapes (pure arithmetic).
"""

import json

import pytest

from benchmarks import model_step

from jax_helpers import _jax_device  # noqa: F401  (autouse: JAX on its CPU device)

ROW_FIELDS = {"batch", "context", "torch_step_us", "torch_kernels", "torch_dense_layer_us", "torch_msa_layer_us",
              "torch_rest_us", "experts_touched", "jax_step_us", "jax_pipelined_us", "jax_launches",
              "jax_launches_per_layer", "jax_compile_s", "floor_bytes", "floor_us", "torch_step_pct_floor",
              "jax_step_pct_floor", "experts_expected", "extrap_60l_tp8_us", "floor_60l_tp8_us"}
PIECES = {"projections", "msa_attention", "dense_attention", "o_proj", "moe", "dense_mlp", "lm_head"}


@pytest.mark.long   # ~40 s of interpreted model steps: not in `make test`
def test_tiny_run_writes_every_field(tmp_path):
    result = model_step.main(["--tiny", "--layers", "2", "--batches", "1", "--contexts", "128", "--piece-tokens", "1",
                              "--quantization", "none,fp8", "--out", str(tmp_path)])
    [json_file] = tmp_path.glob("*-cpu-model-step.json")
    saved = json.loads(json_file.read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["errors"] == [] and saved["copy_bandwidth_TBps"] > 0 and "--tiny" in saved["command"]
    bf16, fp8 = saved["rows"]
    assert (bf16["quantization"], fp8["quantization"]) == (None, "fp8")
    for row in (bf16, fp8):
        assert ROW_FIELDS <= row.keys() and row["jax_launches"] > 0 and row["floor_us"] > 0
    assert fp8["floor_bytes"] < bf16["floor_bytes"]
    [speedup] = saved["fp8_speedups"]
    assert speedup["torch_step_speedup"] > 0 and speedup["jax_over_torch_fp8"] > 0
    assert {p["piece"] for p in saved["pieces"] if p["quantization"] is None} == PIECES
    assert {p["piece"] for p in saved["pieces"] if p["quantization"] == "fp8"} == PIECES
    assert all(p["us"] > 0 and p["floor_bytes"] > 0 for p in saved["pieces"])
    md = json_file.with_suffix(".md").read_text()
    assert "| 1 | 128 |" in md and "EXTRAPOLATION" in md and "| moe | 1 |" in md


def test_the_floor_and_the_grid():
    c = model_step.M3TextConfig.from_dict(model_step.text_config(model_step.M3_DIMS, 4, 131072))
    assert 49e9 < model_step.weight_bytes(c) < 52e9                     # 4 layers of M3: ~51 GB
    assert round(model_step.expected_experts(64, 128, 4)) == 111         # BENCH_ANCHORS: 111 of 128 at 64 tokens
    runs, skipped = model_step.plan_grid(c, (64, 128), (32768, 131072), memory=143771 << 20)   # an H200
    assert runs == {32768: [64, 128], 131072: [64]} and list(skipped) == [(128, 131072)]
    # batch 1 at 4k reads about the weights once: all but the untouched experts, plus a little KV
    weights = model_step.weight_bytes(c) - 3 * (128 - 4) * 2 * 3 * 3072 * 6144 - 2 * 200063 * 6144
    assert weights < model_step.step_floor_bytes(c, 1, 4096) < 1.01 * weights
    # FP8: the quantized weights at a byte (+ scales); embeddings, lm_head, router and norms stay bf16
    head = 2 * 200064 * 6144   # lm_head (the one embedding row read is in the slack)
    fp8 = model_step.step_floor_bytes(c, 1, 4096, quantization="fp8")
    assert 0.5 * (weights - head) + head < fp8 < 0.51 * (weights - head) + head + 0.01 * weights
    embed_and_head = 2 * 2 * 200064 * 6144
    assert model_step.weight_bytes(c, "fp8") < 0.501 * (model_step.weight_bytes(c) - embed_and_head) + embed_and_head


def test_full_model_memory():
    """M3 at its dimensions (~440 B parameters): FP8 on 4 GPUs holds what bf16 needs 8 for."""
    h200 = 143771 << 20
    bf16_tp8, fp8_tp4 = (model_step.full_model_memory(model_step.M3_DIMS, q, tp, h200)
                         for q, tp in ((None, 8), ("fp8", 4)))
    assert 400 < bf16_tp8["params_B"] < 460 and bf16_tp8["params_B"] == fp8_tp4["params_B"]
    assert 100 < bf16_tp8["weights_per_gpu_GB"] < 115 and 100 < fp8_tp4["weights_per_gpu_GB"] < 115
    assert fp8_tp4["kv_room_per_gpu_GB"] > 0 and fp8_tp4["kv_tokens"] > 0


HLO = """HloModule m, entry_computation_layout={(f32[2]{0})->f32[2]{0}}

%fused (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %n = f32[2]{0} negate(%p)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (t: (s32[], f32[2])) -> (s32[], f32[2]) {
  %t = (s32[], f32[2]{0}) parameter(0)
  %x = f32[2]{0} get-tuple-element(%t), index=1
  %f = f32[2]{0} fusion(%x), kind=kLoop, calls=%fused
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[2]{0}) tuple(%i, %f)
}

%cond (t: (s32[], f32[2])) -> pred[] {
  %t = (s32[], f32[2]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%command_buffer (a: f32[2]) -> f32[2] {
  %a = f32[2]{0} parameter(0)
  ROOT %g = f32[2]{0} custom-call(%a), custom_call_target="__cublas$gemm"
}

ENTRY %main (a: f32[2]) -> f32[2] {
  %a = f32[2]{0} parameter(0)
  %c = f32[2]{0} call(%a), to_apply=%command_buffer
  %k = (f32[2]{0}, s32[2]{0}) custom-call(%c), custom_call_target="TopK", called_computations={%add}
  %z = s32[] constant(0)
  %t = (s32[], f32[2]{0}) tuple(%z, %c)
  %w = (s32[], f32[2]{0}) while(%t), condition=%cond, body=%body
  ROOT %o = f32[2]{0} get-tuple-element(%w), index=1
}
"""


def test_hlo_launch_sites():
    # the GEMM inside the command buffer, the TopK custom call, the fusion in the while body (once);
    # not the fusion's body, the comparator, parameters, constants, tuples, the call or the while
    assert model_step.hlo_launches(HLO) == 3
