"""One launch path: every Triton kernel of ``m3_kernels`` has a launch description builder
(``launches.py``, ``step_launches.py``), and the frameworks launch kernels only through their one
``run`` (``m3_torch.ops.run``, ``m3_jax.ops.run``).

Nothing is compiled or run here: the kernels are found in the kernel modules' source, the builders
are called on shapes alone and the frameworks' modules are read as source.
"""

import ast
import importlib
import pathlib
import textwrap

import pytest
from triton.runtime.jit import JITFunction

import m3_jax
import m3_kernels
import m3_torch
from m3_kernels import launches, step_launches, validate

from test_codegen import attention_case, index_case, operand, write_case

KERNELS = pathlib.Path(m3_kernels.__file__).parent


def jit_functions() -> dict:
    """``"<module>.<name>"`` -> JITFunction, every ``@triton.jit`` function defined in a kernel module."""
    found = {}
    for path in sorted(KERNELS.glob("*.py")):
        if "@triton.jit" not in path.read_text():
            continue
        module = importlib.import_module(f"m3_kernels.{path.stem}")
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                found[f"{path.stem}.{name}"] = value
    return found


def called_names(fn: JITFunction) -> set:
    """Names ``fn``'s body calls (``f(...)`` and ``module.f(...)``)."""
    calls = (node.func for node in ast.walk(ast.parse(textwrap.dedent(fn.src))) if isinstance(node, ast.Call))
    return {f.id if isinstance(f, ast.Name) else f.attr for f in calls if isinstance(f, (ast.Name, ast.Attribute))}


def launched_kernels() -> set:
    """The jit functions no jit function calls: the kernels, launched with a grid (helpers are called
    from inside kernels)."""
    functions = jit_functions()
    called = set().union(*(called_names(fn) for fn in functions.values()))
    return {key for key in functions if key.split(".")[1] not in called}


def chain(launch) -> list:
    out = []
    while launch is not None:
        out.append(launch)
        launch = launch.then
    return out


def described_launches() -> list:
    """The launches the builders make, for shapes that reach every kernel of each family."""
    made = [attention_case(sparse=True, batch=1)[2], index_case()[2], write_case()[2],   # attention: merge too
            launches.select_blocks(scores=operand(4, 64, 141), seq_lens=None, token_map=None, topk=16,
                                   init_blocks=0, local_blocks=1, out_strides=(64 * 16, 16, 1), interpret=False)]
    made.append(step_launches.rms_norm(x=operand(5, 48), residual=operand(5, 48), weight=None, eps=1e-6,
                                       interpret=False))
    made.append(step_launches.moe_route(x=operand(5, 200), router_weight=operand(40, 200), bias=None, top_k=4,
                                        interpret=False))
    made.append(step_launches.qk_norm_rope(
        call=validate.QKRopeCall(3, 4, 2, 32, 16, 16, 16, 1e-6), qkv=operand(3, 240), positions=None, inv_freq=None,
        q_norm=None, k_norm=None, index_q_norm=None, index_k_norm=None, slot_mapping=None,
        k_cache=operand(3, 2, 128, 32), v_cache=operand(3, 2, 128, 32), index_k_cache=operand(3, 128, 16),
        pool=operand(1 << 16), interpret=False))
    made.append(step_launches.fused_moe(
        x=operand(5, 64), w_gate_up=operand(8, 64, 64), w_down=operand(8, 64, 32),
        topk_ids=operand(5, 2, dtype="int32"), topk_weights=None, shared_gate_up=None, shared_down=None,
        swiglu_alpha=1.0, swiglu_limit=7.0, routed_scaling_factor=1.0, interpret=False))
    e4m3 = dict(dtype="float8_e4m3fn")
    made.append(step_launches.fp8_linear(x=operand(5, 1000), weight=operand(96, 1000, **e4m3), weight_scale=None,
                                         interpret=False))   # 8 K blocks: split, then summed
    made.append(step_launches.fused_moe_fp8(
        x=operand(5, 128), w_gate_up=operand(8, 256, 128, **e4m3), w_gate_up_scale=None,
        w_down=operand(8, 128, 128, **e4m3), w_down_scale=None, topk_ids=operand(5, 2, dtype="int32"),
        topk_weights=None, shared_gate_up=None, shared_gate_up_scale=None, shared_down=None,
        shared_down_scale=None, swiglu_alpha=1.0, swiglu_limit=7.0, routed_scaling_factor=1.0, interpret=False))
    made.append(step_launches.sample(logits=operand(3, 100, dtype="float32"), temperature=None, top_k=None,
                                     top_p=None, min_p=None, seed_words=None, counters=None, penalties=None,
                                     seen=None, interpret=False))
    return [step for launch in made for step in chain(launch)]


def test_the_kernels_are_found():
    """The discovery below sees the kernels of every family and none of their helpers."""
    kernels = launched_kernels()
    assert {"attention.paged_attention_kernel", "merge.merge_splits_kernel", "index.select_blocks_kernel",
            "norm.rms_norm_kernel", "router.router_topk_kernel", "moe.sum_kernel",
            "sampling.sample_kernel", "fp8_linear.quantize_act_kernel", "fp8_linear.sum_splits_kernel",
            "fp8_moe.fp8_down_kernel"} <= kernels
    assert not kernels & {"norm.inv_rms", "qk_rope.norm_rope", "common.mma", "moe.pair_experts",
                          "sampling.gumbel_noise", "fp8_linear.quantize_groups", "fp8_linear.prefetch_l2",
                          "moe.block_rows"}


def test_every_kernel_has_a_launch_description():
    """Each kernel launched with a grid is the kernel of some builder's Launch, and takes PDL
    (``launches.grid_dependency``, which ``run`` adds to every launch)."""
    functions = jit_functions()
    kernels = launched_kernels()
    described = {launch.kernel for launch in described_launches()}
    assert kernels - described == set(), "kernels without a launch description builder"
    assert described <= kernels, "a builder launches a function that other jit functions call"
    for key in kernels:
        assert "PDL" in functions[key].arg_names, f"{key}: no PDL parameter"


def test_launch_arguments_match_the_kernel_signatures():
    """A Launch's args and outputs fill the kernel's non-constexpr parameters, its constexprs name the rest."""
    functions = jit_functions()
    for launch in described_launches():
        fn = functions[launch.kernel]
        constexprs = {name for name in launch.constexprs if name != "enable_fp_fusion"}
        params = [name for i, name in enumerate(fn.arg_names) if i not in fn.constexprs]
        assert len(launch.args) + len(launch.outputs) == len(params), launch.kernel
        assert constexprs <= set(fn.arg_names) - set(params), launch.kernel


def framework_modules():
    for package in (m3_torch, m3_jax):
        for path in sorted(pathlib.Path(package.__file__).parent.glob("*.py")):
            yield package.__name__, path


@pytest.mark.parametrize("package,path", list(framework_modules()), ids=lambda v: getattr(v, "name", v))
def test_frameworks_launch_only_through_run(package, path):
    """No ``kernel[grid](...)``, ``triton_call(...)`` or ``kernel_module(...)`` in the frameworks' modules
    outside ``ops.run`` (and the JAX launcher ``_triton_call`` that run calls)."""
    if path.name == "_triton_call.py":
        return
    tree = ast.parse(path.read_text())
    allowed = set()
    if path.name == "ops.py":
        run = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "run")
        allowed = {id(node) for node in ast.walk(run)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or id(node) in allowed:
            continue
        where = f"{package}/{path.name}:{node.lineno}"
        assert not isinstance(node.func, ast.Subscript), f"{where}: a kernel[grid](...) launch outside ops.run"
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        assert name not in ("triton_call", "kernel_module", "gpu_call", "cpu_call"), \
            f"{where}: {name}(...) outside ops.run"


def test_the_launch_check_fails_on_a_launch_around_run(tmp_path):
    """The source check above catches a direct launch."""
    bad = tmp_path / "bad.py"
    bad.write_text("def op(x):\n    kernel_module('norm', False).rms_norm_kernel[(1,)](x)\n")
    with pytest.raises(AssertionError, match="launch outside ops.run"):
        test_frameworks_launch_only_through_run("m3_torch", bad)
