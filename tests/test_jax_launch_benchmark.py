"""benchmarks.jax_launch's pieces that run without a GPU: the stand-ins it puts into jax-triton, its table."""

import zlib

from benchmarks import jax_launch


def test_lean_kernels_drop_only_the_ttir():
    calls = []

    class Lib:
        def TritonKernel(self, *args):  # noqa: N802
            calls.append(args)
            return "kernel"

        other = 7

    lean = jax_launch._LeanKernels(Lib())
    assert lean.TritonKernel("k", 4, 1, 1024, "PTX", "TTIR", 90) == "kernel"
    assert calls == [("k", 4, 1, 1024, "PTX", "", 90)]
    assert lean.other == 7   # everything else is jaxlib's


def test_payloads_record_compressed_sizes():
    payloads = jax_launch._Payloads(zlib)
    data = b"ptx " * 1000
    assert payloads.compress(data) == zlib.compress(data)
    assert payloads.sizes == [len(zlib.compress(data))] and payloads.decompress is zlib.decompress


def test_markdown_lists_every_run():
    row = dict(jax_step_us=2104.3, jax_pipelined_us=1672.4, execute_us=3089.0, payload_bytes=900000,
               payload_max=41000, tokens_hash="abc")
    result = dict(device="NVIDIA H200", date="2026-12-02", command="python3 -m benchmarks.jax_launch", layers=4,
                  context=4096, runs={"lean": dict(rows={"1": row}, lean_rows={"1": dict(row, payload_max=19000)},
                                                   same_bits=True),
                                      "ffi": dict(error="timed out after 240 s")})
    text = jax_launch.markdown(result)
    assert "| lean | 1 | 2104 | 1672 | 3089 | 900000 (41000) | abc |" in text
    assert "| lean (lean payload) | 1 |" in text and "(19000)" in text
    assert "lean = default bit for bit | True" in text and "| ffi | error: timed out after 240 s |" in text
