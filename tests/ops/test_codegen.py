"""The hot loops must compile to pipelined (cp.async) loads for sm_90 under BOTH launchers.

Triton learns "divisible by 16" from the integer arguments torch passes;
jax-triton 0.3.1 passes integer scalars without that fact. The kernels restate
it for the cache strides and offsets (without that, the JAX launch of the same
kernel ran about 2x slower on an H200, benchmarks/results/*jax-vs-torch*) and,
when the launch's ALIGNED says so, for the q / out / block-id row strides
(without that, 8-token tiles ran 1.4x slower).
These tests compile for Hopper on the CPU (Triton ships ptxas), no GPU needed.
"""

import os
import re

import numpy as np
import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import m3_kernels
from m3_kernels import launches, maps
from m3_kernels.launches import Operand

HOPPER = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*fp32", "lse_ptr": "*fp32",
                 "scores_ptr": "*fp32", "index_k_ptr": "*bf16", "pool_in_ptr": "*bf16", "pool_ptr": "*bf16"}


def compile_for_hopper(fn, constexprs, num_warps, num_stages, scalars_divisible, pointer_types=None):
    """Compile ``fn`` like torch (ints marked divisible by 16) or like jax-triton (no facts); with
    ``PDL`` True unless given (both runners pass it on an sm_90 GPU)."""
    names = fn.arg_names
    constexprs = dict(constexprs)
    fp_fusion = constexprs.pop("enable_fp_fusion", True)   # a compile option, where the launch config sets it
    if "PDL" in names:
        constexprs = {"PDL": True, **constexprs}
    pointer_types = {**POINTER_TYPES, **(pointer_types or {})}
    sig = {}
    for a in names:
        if a in constexprs:
            sig[a] = "constexpr"
        elif a.endswith("_ptr"):
            sig[a] = pointer_types.get(a, "*i32")
        else:
            sig[a] = "fp32" if a == "qk_scale" else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
             if sig[a].startswith("*") or (scalars_divisible and sig[a] == "i32")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=HOPPER, options=dict(num_warps=num_warps, num_stages=num_stages,
                                                           enable_fp_fusion=fp_fusion))


def operand(*shape, dtype="bfloat16"):
    return Operand(None, 0, shape, maps.contiguous_strides(shape), dtype)


def attention_case(sparse, kv_dtype="bfloat16", batch=64, select=False, tokens=1, max_blocks=141):
    """The launch of M3 decode at batch 64 (or ``batch``), 18k context (141 blocks), as both frameworks build it.
    ``select``: as the MSA ops launch it, choosing the blocks from the scores itself (batch 64: one split).
    ``tokens``: decode_query_len (8 tokens at batch 32 and 36 blocks: 8-token tiles of 128 rows)."""
    num_tokens = batch * tokens
    tile = maps.decode_tile(16, tokens, sparse, max_blocks=max_blocks, topk=16, num_requests=batch, num_kv_heads=4,
                            interpret=False)
    tile_map, _ = maps.decode_maps(batch, tokens, tile.tokens_per_tile)
    selection = launches.Selection(operand(4, num_tokens, max_blocks), None, 16, 0, 1, (num_tokens * 16, 16, 1)) \
        if select else None
    launch = launches.paged_attention(
        q=operand(num_tokens, 64, 128), k=operand(9000, 4, 128, 128, dtype=kv_dtype),
        v=operand(9000, 4, 128, 128, dtype=kv_dtype),
        block_ids=operand(4, num_tokens, 16) if sparse and not select else None,
        block_table=operand(batch, max_blocks), seq_lens=None, tile_map=tile_map, tile=tile, sm_scale=1.0,
        out_dtype="bfloat16", out_strides=(64 * 128, 128, 1), interpret=False, k_scale=1, v_scale=1,
        select=selection)
    assert launch.kernel == "attention.paged_attention_kernel" and launch.constexprs["SELECT"] == select
    consts = dict(launch.constexprs, stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1, stride_is=1, stride_bb=1,
                  stride_sb=1)
    return m3_kernels.kernel_module("attention", False).paged_attention_kernel, consts, launch


def index_case(index_dtype="bfloat16", skip_blocks=0, query_dtype="bfloat16", tokens=1):
    """M3's indexer at 64 tokens: decode (one token per request) or ``tokens`` per tile (prefill: 32)."""
    launch = launches.index_scores(idx_q=operand(64, 4, 128, dtype=query_dtype),
                                   index_k=operand(9000, 128, 128, dtype=index_dtype),
                                   block_table=operand(64, 141), seq_lens=None, tile_map=np.zeros((64, 4), np.int32),
                                   tile=maps.index_tile(4, tokens), out_strides=(64 * 141, 141, 1), dtype=query_dtype,
                                   interpret=False, skip_blocks=skip_blocks)
    consts = dict(launch.constexprs, stride_qd=1, stride_kd=1, stride_bb=1, stride_sb=1)
    return m3_kernels.kernel_module("index", False).index_scores_kernel, consts, launch


@pytest.fixture(scope="module", autouse=True)
def fresh_compile_after_an_interpreted_op(tmp_path_factory):
    """Compile from scratch (an empty Triton cache) after an interpreted (CPU) op
    ran in this process: the interpreter patches triton.language while it runs
    and must leave it as it found it, or these compiles fail."""
    import torch
    import m3_torch
    m3_torch.select_blocks(torch.randn(1, 1, 3), torch.tensor([300], dtype=torch.int32), decode_query_len=1, topk=2)
    with triton.knobs.cache.scope():
        triton.knobs.cache.dir = str(tmp_path_factory.mktemp("triton_cache"))
        yield


def write_case():
    launch = launches.write_cache(k=operand(64, 4, 128), v=operand(64, 4, 128), index_k=operand(64, 128),
                                  slot_mapping=None, pool=None, pool_shape=(1 << 20,), pool_dtype="bfloat16",
                                  k_cache=operand(16, 4, 128, 128), v_cache=operand(16, 4, 128, 128),
                                  index_k_cache=operand(16, 128, 128), interpret=False)
    consts = dict(launch.constexprs, stride_kd=1, stride_vd=1, stride_id=1, stride_ckd=1, stride_cvd=1, stride_cid=1)
    return m3_kernels.kernel_module("cache_write", False).cache_write_kernel, consts, launch


def global_accesses(ptx: str) -> tuple:
    """(global loads, global stores, async copies) in ``ptx``: a row loaded or stored element by element
    instead of in 16-byte vectors shows as more of the first two."""
    return ptx.count("ld.global"), ptx.count("st.global"), ptx.count("cp.async.cg") + ptx.count("cp.async.ca")


@pytest.mark.parametrize("case", ["sparse_n1", "sparse_select_n1", "sparse_split_b1", "sparse_n8_tiles", "dense_n1",
                                  "index", "index_msa", "index_prefill", "cache_write"])
def test_loads_pipeline_without_divisibility_facts(case):
    """The same loads and stores under both launchers (``ALIGNED``, ``multiple_of_16``). index_msa: the scorer
    variant of the MSA ops, which skips tiles that see at most topk blocks; index_prefill: its 128-row tiles;
    sparse_select_n1: the attention variant of the MSA ops that selects the blocks itself; sparse_split_b1: batch
    1, split K/V with float32 partials; sparse_n8_tiles: 8-token tiles (MTP steps, batch 32, 4k)."""
    if case.startswith("index"):
        fn, consts, launch = index_case(skip_blocks=16 if case == "index_msa" else 0,
                                        tokens=32 if case == "index_prefill" else 1)
    elif case == "cache_write":
        fn, consts, launch = write_case()
    elif case == "sparse_split_b1":
        fn, consts, launch = attention_case(True, batch=1)
        assert launch.constexprs["NUM_SPLITS"] > 1
    elif case == "sparse_n8_tiles":
        fn, consts, launch = attention_case(True, batch=32, tokens=8, max_blocks=36)
        assert launch.constexprs["TOKENS_PER_TILE"] == 8
    else:
        fn, consts, launch = attention_case(case != "dense_n1", select=case == "sparse_select_n1")
    assert launch.constexprs["ALIGNED"]
    kernels = [compile_for_hopper(fn, consts, launch.num_warps, launch.num_stages, divisible)
               for divisible in (True, False)]
    as_torch, as_jax = (global_accesses(k.asm["ptx"]) for k in kernels)
    assert case == "cache_write" or as_torch[2] > 0, "the torch-style build lost its pipelined loads"
    assert as_jax == as_torch, f"jax-triton-style build: {as_jax} (loads, stores, async copies), torch-style: {as_torch}"
    assert kernels[0].metadata.shared == kernels[1].metadata.shared


def test_aligned_is_false_for_a_view_whose_rows_are_not_multiples_of_16():
    """A torch view with odd row strides compiles the variant without the restated facts (its launcher
    tells Triton what holds); a JAX array (contiguous) with head dim 128 always gets them."""
    fn, consts, launch = attention_case(True)
    odd = launches.paged_attention(
        q=Operand(None, 0, (64, 64, 128), (64 * 136, 136, 1), "bfloat16"), k=operand(9000, 4, 128, 128),
        v=operand(9000, 4, 128, 128), block_ids=operand(4, 64, 16), block_table=operand(64, 141), seq_lens=None,
        tile_map=np.zeros((64, 4), np.int32), tile=maps.decode_tile(16, 1, True, max_blocks=141, topk=16,
                                                                     num_requests=64, num_kv_heads=4, interpret=False),
        sm_scale=1.0, out_dtype="bfloat16", out_strides=(64 * 128, 128, 1), interpret=False, k_scale=1, v_scale=1)
    assert launch.constexprs["ALIGNED"] and odd.constexprs["ALIGNED"] is False
    assert m3_kernels.common.aligned(16, 32, 0) and not m3_kernels.common.aligned(16, 8)


@pytest.mark.parametrize("max_blocks", [141, 1024])   # one-level and two-level top-k
def test_select_and_cache_write_compile_for_hopper(max_blocks):
    """The GPU variants (one token per program) of the kernels the CPU tests run with many."""
    select = launches.select_blocks(scores=operand(4, 64, max_blocks), seq_lens=None, token_map=None, topk=16,
                                    init_blocks=0, local_blocks=1, out_strides=(64 * 16, 16, 1), interpret=False)
    assert select.constexprs["BLOCK_T"] == 1 and select.constexprs["CHUNK"] == (16 if max_blocks == 1024 else 0)
    fn = m3_kernels.kernel_module("index", False).select_blocks_kernel
    compile_for_hopper(fn, dict(select.constexprs, stride_sb=1, stride_ok=1), select.num_warps, 1, True)
    write = launches.write_cache(k=operand(8, 4, 128), v=operand(8, 4, 128), index_k=operand(8, 128),
                                 slot_mapping=None, pool=None, pool_shape=(1 << 20,), pool_dtype="bfloat16",
                                 k_cache=operand(16, 4, 128, 128), v_cache=operand(16, 4, 128, 128),
                                 index_k_cache=operand(16, 128, 128), interpret=False)
    assert write.constexprs["BLOCK_T"] == 1
    fn = m3_kernels.kernel_module("cache_write", False).cache_write_kernel
    compile_for_hopper(fn, dict(write.constexprs, stride_kd=1, stride_vd=1, stride_id=1), write.num_warps, 1, True)


def test_programmatic_dependent_launch_only_on_nvidia_sm90():
    """PDL is a device fact both runners derive alike: NVIDIA compute capability 9.0 and up; not
    older GPUs, not the interpreter, not a JAX device whose capability is not "major.minor" (ROCm)."""
    from m3_jax._triton_call import cuda_capability

    assert launches.grid_dependency((9, 0)) == launches.grid_dependency((10, 0)) == {"PDL": True}
    assert launches.grid_dependency((8, 9)) == launches.grid_dependency(None) == {"PDL": False}
    assert cuda_capability("9.0") == (9, 0) and cuda_capability("12.1") == (12, 1)
    assert cuda_capability("gfx942") is None and cuda_capability(None) is None


# What a kernel reads before it waits (common.wait_for_previous_grid), as the source lines of its loads:
# its row of the tile map (one line: common.tile_row) or of the token map (select: two lines); nothing
# else, not even seq_lens or slot_mapping (a kernel just before ours may have written them).
METADATA_LOADS = {"attention": 1, "attention_select": 1, "index": 1, "select": 2, "cache_write": 0, "merge": 0}
METADATA = ("return tl.load(row), tl.load(row + 1)", "token_map_ptr")
KERNEL_DIR = os.path.dirname(m3_kernels.__file__)


def source_lines_of_loads(ptx: str):
    """The kernel source line of each global load in ``ptx`` (from the ``.loc`` comment before it)."""
    where = None
    for line in ptx.splitlines():
        loc = re.search(r"\.loc\s.*// (\w+\.py):(\d+):\d+", line)
        if loc:
            where = loc.groups()
        elif "ld.global" in line:
            with open(os.path.join(KERNEL_DIR, where[0])) as f:
                yield f.read().splitlines()[int(where[1]) - 1].strip()


@pytest.mark.parametrize("kernel", sorted(METADATA_LOADS))
def test_programmatic_dependent_launch_waits_before_reading_earlier_kernels_outputs(kernel):
    """With PDL (sm_90: torch launches every kernel as a programmatic dependent of the one before),
    a kernel first releases the next one (griddepcontrol.launch_dependents before any memory
    access), reads only its tile or token map row (loads on METADATA_LOADS[kernel] source lines;
    no cp.async, no store), then waits for the previous kernel (griddepcontrol.wait) before
    anything else. Without PDL (older GPUs, the interpreter) neither
    instruction is emitted."""
    if kernel.startswith("attention"):
        fn, consts, launch = attention_case(True, select=kernel == "attention_select")
    elif kernel == "merge":
        _, _, attention = attention_case(True, batch=1)
        launch = attention.then
        assert launch is not None, "batch 1 splits: the launch ends in a merge"
        fn = m3_kernels.kernel_module("merge", False).merge_splits_kernel
        consts = dict(launch.constexprs, stride_pd=1, stride_od=1)
    elif kernel == "index":
        fn, consts, launch = index_case()
    elif kernel == "select":
        launch = launches.select_blocks(scores=operand(4, 64, 141), seq_lens=None, token_map=None, topk=16,
                                        init_blocks=0, local_blocks=1, out_strides=(64 * 16, 16, 1), interpret=False)
        fn, consts = m3_kernels.kernel_module("index", False).select_blocks_kernel, dict(launch.constexprs,
                                                                                       stride_sb=1, stride_ok=1)
    else:
        launch = launches.write_cache(k=operand(8, 4, 128), v=operand(8, 4, 128), index_k=operand(8, 128),
                                      slot_mapping=None, pool=None, pool_shape=(1 << 20,), pool_dtype="bfloat16",
                                      k_cache=operand(16, 4, 128, 128), v_cache=operand(16, 4, 128, 128),
                                      index_k_cache=operand(16, 128, 128), interpret=False)
        fn = m3_kernels.kernel_module("cache_write", False).cache_write_kernel
        consts = dict(launch.constexprs, stride_kd=1, stride_vd=1, stride_id=1)
    for pdl in (True, False):
        ptx = compile_for_hopper(fn, dict(consts, PDL=pdl), launch.num_warps, launch.num_stages, True).asm["ptx"]
        body = ptx[ptx.index(".entry"):]
        if not pdl:
            assert "griddepcontrol" not in body
            continue
        wait, release = body.find("griddepcontrol.wait"), body.find("griddepcontrol.launch_dependents")
        first_access = min(i for i in (body.find("ld.global"), body.find("cp.async"), body.find("st.global"))
                           if i >= 0)
        assert 0 <= release < first_access and 0 <= wait, (release, first_access, wait)
        before = body[:wait]
        assert "cp.async" not in before and "st.global" not in before and "atom" not in before
        # each load's source line (the PTX's .loc comments): the map row only
        sources = set(source_lines_of_loads(before))
        assert all(any(name in text for name in METADATA) for text in sources), sources
        assert len(sources) == METADATA_LOADS[kernel], sources
        assert body.count("griddepcontrol.wait") == 1 and body.count("griddepcontrol.launch_dependents") == 1
        if kernel == "merge":   # unrolled: each split's lse and partial row load once, none in a loop
            assert body.count("ld.global") >= 2 * launch.constexprs["NUM_SPLITS"] and "bra" not in body


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["sparse", "index", "index_fp8_query", "cache_write"])
def test_fp8_variants_compile_for_hopper_from_a_byte_pool(kernel):
    """FP8 caches read and written through a uint8 pointer (a JAX byte pool), without divisibility
    facts (jax-triton): the variants compile for sm_90, the K/V and index-K loads still pipeline, and
    with a bf16 query the FP8 tiles widen to float16 (one cvt per pair), not through float16 to bfloat16
    (one more cvt per element, which made the FP8 kernels ALU-bound). index_fp8_query: an e4m3 index
    query (its NaN check once failed to lower: an fcmp on i8)."""
    fp8, byte_pool = "float8_e4m3fn", {"k_ptr": "*u8", "v_ptr": "*u8", "pool_in_ptr": "*u8", "pool_ptr": "*u8",
                                       "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    if kernel == "cache_write":
        write = launches.write_cache(k=operand(8, 4, 128), v=operand(8, 4, 128), index_k=operand(8, 128),
                                     slot_mapping=None, pool=None, pool_shape=(1 << 20,), pool_dtype="uint8",
                                     k_cache=operand(16, 4, 128, 128, dtype=fp8),
                                     v_cache=operand(16, 4, 128, 128, dtype=fp8),
                                     index_k_cache=operand(16, 128, 128, dtype=fp8), interpret=False, k_scale=1,
                                     v_scale=1)
        fn = m3_kernels.kernel_module("cache_write", False).cache_write_kernel
        ptx = compile_for_hopper(fn, dict(write.constexprs, stride_kd=1, stride_vd=1, stride_id=1), write.num_warps,
                                 1, False, byte_pool).asm["ptx"]
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx
        return
    if kernel.startswith("index"):
        fn, consts, launch = index_case(fp8, query_dtype=fp8 if kernel == "index_fp8_query" else "bfloat16")
        byte_pool["q_ptr"] = "*fp8e4nv" if kernel == "index_fp8_query" else "*bf16"
    else:
        fn, consts, launch = attention_case(True, fp8)
    ptx = compile_for_hopper(fn, consts, launch.num_warps, launch.num_stages, False, byte_pool).asm["ptx"]
    assert ptx.count("cp.async.cg") + ptx.count("cp.async.ca") > 0
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.bf16.f16" not in ptx


@pytest.mark.parametrize("case", ["sparse_select_n1", "index"])
def test_lean_launch_payload_compiles_to_the_same_machine_code(case, tmp_path):
    """m3_jax hands jaxlib the PTX without its debug information (``lean_ptx``: jaxlib hashes the whole
    payload at every launch): ptxas must make the very same instructions from it, and the payload must shrink."""
    import subprocess
    import zlib

    from triton.backends.nvidia.compiler import get_ptxas

    from m3_jax._triton_call import lean_ptx

    fn, consts, launch = index_case() if case == "index" else attention_case(True, select=True)
    ptx = compile_for_hopper(fn, consts, launch.num_warps, launch.num_stages, False).asm["ptx"]
    lean = lean_ptx(ptx)
    assert ".loc" in ptx and ".debug_info" in ptx, "the kernels no longer carry line info: lean_ptx has nothing to do"
    directives = {line.split()[0] for line in lean.splitlines() if line.split()}
    assert not directives & {".loc", ".file", ".section"} and ".entry" in lean
    assert len(zlib.compress(lean.encode())) < 0.85 * len(zlib.compress(ptx.encode()))
    ptxas = get_ptxas(90).path
    cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
    sass = []
    for name, text in (("full", ptx), ("lean", lean)):
        (tmp_path / f"{name}.ptx").write_text(text)
        subprocess.run([ptxas, "-arch=sm_90a", str(tmp_path / f"{name}.ptx"), "-o", str(tmp_path / f"{name}.cubin")],
                       check=True)
        sass.append(subprocess.run([cuobjdump, "-sass", str(tmp_path / f"{name}.cubin")], capture_output=True,
                                   text=True, check=True).stdout)
    assert sass[0].count("/*0") > 100 and sass[0] == sass[1]


def test_lean_kernels_make_jaxlibs_kernel_without_ttir_and_debug_info():
    from jax_helpers import FakeTritonKernels
    from m3_jax._triton_call import _LeanKernels

    lib = FakeTritonKernels()
    kept = ".version 8.7\n.entry k()\n{\n\t.local .align 8 .b8 \t__local_depot0[16];\n\tret;\n}\n"
    ptx = kept.replace("{\n", "{\n\t.loc\t1 2 3\n// %bb.0:\n").replace(".entry", ".file\t1 \"a.py\"\n.entry") + \
        "\t.section\t.debug_info\n\t{\n.b8 1 // DW_TAG\n\t}\n\t.section\t.debug_macinfo\t{\t}\n"
    assert _LeanKernels(lib).TritonKernel("k", 4, 1, 1024, ptx, "TTIR", 90) == "kernel"
    assert lib.calls == [("k", 4, 1, 1024, kept, "", 90)]
    assert _LeanKernels(lib).other == 7   # everything else is jaxlib's
