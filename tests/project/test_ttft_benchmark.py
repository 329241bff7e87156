"""``benchmarks/ttft.py``: which kernels count as attention (against the kernels' names in kernels/), the
dense / sparse split by launch order, and (long) its ``--tiny`` run on the CPU."""

import json
import re
from pathlib import Path

import pytest

from benchmarks import ttft

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
ATTENTION = {   # kernels/ file -> its attention kernels and their kind
    "index.py": {"index_scores_kernel": "indexer", "select_blocks_kernel": "selection"},
    "attention.py": {"paged_attention_kernel": "attention"},
    "merge.py": {"merge_splits_kernel": "attention"},
    "cute_index.py": {"index_scores_kernel": "indexer"},
    "cute_prefill.py": {"prefill_kernel": "attention"},
}


def test_the_patterns_name_the_attention_kernels_and_no_other():
    for file in sorted(KERNELS.glob("*.py")):
        kernels = set(re.findall(r"^def (\w+_kernel)\(", file.read_text(), re.M))
        expected = ATTENTION.get(file.name, {})
        assert set(expected) <= kernels, file.name
        for name in kernels:
            assert ttft.kernel_kind(name) == expected.get(name), (file.name, name)
            # the CuTe DSL's name of a kernel: its function's, prefixed and followed by its arguments' types
            assert ttft.kernel_kind(f"kernel_cutlass_{name}_CopyAtom_ThrID10_bf16") == expected.get(name)


def test_dense_and_sparse_attention_by_launch_order():
    dense_layer = [("qkv_gemm", 1.0), ("qk_norm_rope_kernel", 1.0), ("paged_attention_kernel", 10.0),
                   ("o_proj_gemm", 1.0), ("mlp_gemm", 1.0)]
    msa_layer = [("qkv_gemm", 1.0), ("qk_norm_rope_kernel", 1.0), ("index_scores_kernel", 3.0), ("fill", 0.5),
                 ("select_blocks_kernel", 0.25), ("paged_attention_kernel", 5.0), ("merge_splits_kernel", 0.25),
                 ("o_proj_gemm", 1.0), ("moe_gemm", 1.0)]
    step = dense_layer + 2 * msa_layer
    us = ttft.attention_split(2 * step)    # two chunks: a dense layer after an MSA one starts unscored again
    assert us == dict(dense_attention=20.0, indexer=12.0, selection=1.0, sparse_attention=21.0, other=26.0,
                      total=80.0)


def test_the_share_and_the_extrapolation():
    c = ttft.M3TextConfig.from_dict(ttft.model_step.text_config({}, 4, 256))   # 1 dense + 3 MSA layers
    kernels = [("gemm", 4.0e3), ("paged_attention_kernel", 2.0e3), ("gemm", 4.0e3)] + 3 * [
        ("index_scores_kernel", 1.0e3), ("paged_attention_kernel", 1.0e3), ("gemm", 4.0e3)]
    p = ttft.attention_share(kernels, c)
    assert (p["kernel_ms"], p["attention_ms"], p["dense_attention_ms"], p["sparse_attention_ms"]) == (28, 8, 2, 3)
    # (60 x 20/4 ms of other kernels a layer + 3 x 2 + 57 x 2) / 8
    assert p["extrap_60l_tp8_ms"] == pytest.approx((60 * 5 + 3 * 2 + 57 * 2) / 8)
    assert p["attention_kernels"] == ["index_scores_kernel", "paged_attention_kernel"]


def test_prefill_env_sets_and_restores(monkeypatch):
    monkeypatch.setenv("M3_DENSE_PREFILL", "triton")
    monkeypatch.delenv("M3_SPARSE_PREFILL", raising=False)
    with ttft.prefill_env("cutedsl"):
        assert [ttft.os.environ.get(v) for v in ttft.PREFILL_ENV_VARS] == ["cutedsl", "cutedsl"]
    with ttft.prefill_env("triton"):
        assert [ttft.os.environ.get(v) for v in ttft.PREFILL_ENV_VARS] == [None, None]
    assert [ttft.os.environ.get(v) for v in ttft.PREFILL_ENV_VARS] == ["triton", None]


@pytest.mark.long   # ~30 s of interpreted prefill: not in `make test`
def test_tiny_run_writes_every_field(tmp_path):
    result = ttft.main(["--tiny", "--lens", "130", "--out", str(tmp_path)])
    [json_file] = tmp_path.glob("*-cpu-ttft.json")
    saved = json.loads(json_file.read_text())
    assert saved == json.loads(json.dumps(result)) and saved["errors"] == [] and "--tiny" in saved["command"]
    assert saved["copy_bandwidth_TBps"] > 0 and saved["matmul_TFLOPs"] > 0
    [row] = saved["rows"]
    assert row["chunks"] == 1 and row["prefill_chunk"] == 2048 and row["ttft_ms"] > 0
    assert row["dense_prefill_backend"] == "triton" and row["prefill_backends"] == "triton"
    p = row["profile"]
    assert p["dense_attention_ms"] > 0 and p["indexer_ms"] > 0 and p["sparse_attention_ms"] > 0
    assert 0 < p["attention_pct"] < 100 and p["extrap_60l_tp8_ms"] > 0
    assert "| triton (dense triton" in json_file.with_suffix(".md").read_text()
