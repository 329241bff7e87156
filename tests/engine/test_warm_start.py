"""Ready means ready: ``precompile`` makes every step program before ``LLM()`` returns, so a varied
workload after it compiles (JAX) or warms (torch) nothing new; the compile cache folder
(``m3_engine.compile_cache``) resolves option > ``M3_CACHE_DIR`` > XDG > ``~/.cache``, and a second
start in a new process reads what the first wrote. CPU, the tiny checkpoint, few buckets."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from m3_engine.compile_cache import resolve_cache_dir
from m3_engine.tiny_model import write_tiny_checkpoint

from jax_helpers import _jax_device  # noqa: F401  (autouse: CPU tests run on JAX's CPU device)
from engine_helpers import generate_ids

ROOT = Path(__file__).resolve().parents[1]
# few buckets: 2 rows, 8 tokens a step (JAX: 4 step shapes), 128 KV tokens
SMALL = dict(max_num_seqs=2, max_model_len=128, max_num_batched_tokens=8, device="cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m3_tiny_warm"), seed=0, form="text", num_hidden_layers=2)


@pytest.fixture
def one_program_per_tile():
    """Fewer interpreter programs (no split-K): the warm-up's steps pay per program."""
    from m3_kernels import tuning

    with tuning.override(target_programs=1, sparse_target_programs=1):
        yield


def varied_workload(llm):
    """Prompts of 1 and 10 tokens (the second chunked): prefill, mixed and decode steps at both batch
    sizes, logprob-free sampling (the variant the warm-up compiles)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, n).tolist() for n in (1, 10)]
    return generate_ids(llm, prompts, max_new_tokens=3)


def test_cache_dir_resolution(tmp_path):
    env = {"HOME": "/home/u"}
    assert resolve_cache_dir(None, env) == Path("/home/u/.cache/m3-msa/compile")
    env["XDG_CACHE_HOME"] = "/xdg"
    assert resolve_cache_dir(None, env) == Path("/xdg/m3-msa/compile")
    env["M3_CACHE_DIR"] = str(tmp_path / "env")
    assert resolve_cache_dir(None, env) == tmp_path / "env"
    assert resolve_cache_dir(tmp_path / "option", env) == tmp_path / "option"
    with pytest.raises(TypeError, match="compile_cache_dir"):
        resolve_cache_dir(3, env)


def test_jax_compiles_nothing_after_precompile(model_dir, one_program_per_tile):
    import m3_jax

    llm = m3_jax.LLM(model_dir, precompile=True, **SMALL)
    forwards, sampling = list(llm.runner.compiled_forwards), list(llm.runner.compiled_sampling)
    shapes = len(set(llm.runner.buckets.shapes()))
    assert len(forwards) == shapes
    masked = [key for key in sampling if "token_bitmask" in str(key[1].treedef)]   # key: (rows, packing, ...)
    assert len(sampling) == 2 * len(masked) == 2 * len({key[0] for key in sampling})   # plain + masked a rows
    assert llm.startup_times["programs"] == len(forwards) + len(sampling)
    assert llm.startup_times["compile"] > 0 and llm.startup_times["total"] >= llm.startup_times["load"]
    varied_workload(llm)
    generate_ids(llm, [[5, 6, 7]], max_new_tokens=2, min_tokens=1)   # masked steps: the token bitmask comes late
    assert llm.runner.compiled_forwards == forwards   # every step hit a program the warm-up compiled
    assert llm.runner.compiled_sampling == sampling
    llm.close()


def test_torch_runs_nothing_cold_after_precompile(model_dir, one_program_per_tile):
    import m3_torch

    llm = m3_torch.LLM(model_dir, precompile=True, **SMALL)
    runner = llm.runner
    assert runner.warm_programs and llm.startup_times["programs"] > 0
    assert {("context", 1, 1), ("context", 1, 8), ("generation", 2, 1, 1)} <= runner.warm_programs
    varied_workload(llm)
    assert runner.cold_programs == []
    llm.close()
    assert llm.startup_times["capture"] == 0.0   # a CPU: no graphs
    gc.unfreeze()
    off = m3_torch.LLM(model_dir, **SMALL)   # a CPU: no precompile by default
    assert off.runner.warm_programs is None and off.startup_times["programs"] == 0
    assert gc.get_freeze_count() > 0   # the start-up's objects are out of the collector's way
    off.close()


def test_compile_only_needs_a_gpu():
    """``ops.compile_only`` (the GPU warm-up's compile pass) refuses the interpreter's launches: on the
    CPU there is nothing to compile, and the step would silently run nothing."""
    import torch
    from m3_torch import fused, ops

    x = torch.ones(2, 16)
    with ops.compile_only(1):
        with pytest.raises(ValueError, match="compile_only: the kernels run in Triton's interpreter on cpu"):
            fused.rms_norm(x, torch.zeros(16), 1e-6)
    assert fused.rms_norm(x, torch.zeros(16), 1e-6).shape == (2, 16)   # outside: launched again


FIRST_START = """
import json, sys
import jax
from jax import monitoring
hits = []
monitoring.register_event_listener(lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None)
import m3_jax
llm = m3_jax.LLM(sys.argv[1], max_num_seqs=1, max_model_len=128, device="cpu", load_format="dummy",
                 compile_cache_dir=sys.argv[2])
print(json.dumps(dict(hits=len(hits), dir=jax.config.jax_compilation_cache_dir)))
"""


@pytest.mark.long
def test_second_start_reads_the_jax_cache(model_dir, tmp_path):
    """Two processes, one cache folder: the first writes JAX cache entries (on a CPU the step's
    interpreted kernels are host callbacks, which JAX never caches; the weights' random draws and
    the pool's programs are cached), the second loads them."""
    cache = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests' / 'helpers'}")
    run = [sys.executable, "-c", FIRST_START, str(model_dir), str(cache)]
    first = json.loads(subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    entries = sorted(p.name for p in (cache / "jax").iterdir())
    assert first["dir"] == str(cache / "jax") and entries
    second = json.loads(subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    assert second["hits"] >= len([e for e in entries if e.endswith("-cache")]) > 0 and first["hits"] == 0


class _Ttir:
    """An MLIR module as jax-triton's compile takes it: its text is ``str()``, and the passes rewrite it."""

    def __init__(self, text):
        self.text = text

    def __str__(self):
        return self.text


class _Hashed:
    """A Triton backend or its compile options, as ``get_cache_key`` reads them."""

    def __init__(self, digest):
        self.digest = digest

    def hash(self):
        return self.digest


@dataclasses.dataclass
class _Compiled:   # jax_triton.triton_lib.CompilationResult's fields
    binary: str
    name: str
    shared_mem_bytes: int
    ttgir: object
    llir: object


def test_jax_triton_compiles_are_read_back_by_a_new_process(tmp_path, monkeypatch):
    """``m3_jax._triton_call._disk_cached`` around jax-triton's TTIR -> PTX compile: a second wrapper (a new
    process's) reads the first one's PTX back instead of compiling; another TTIR, compile option, backend or
    capability compiles; the key is the TTIR before the passes rewrite it; ``TRITON_ALWAYS_COMPILE`` and
    jax-triton's stage dumps compile every time; threads asking for one key compile it once."""
    import threading
    import time

    import triton

    from m3_jax._triton_call import _disk_cached

    compiles = []

    def compile_ttir(ttir, backend, options, capability, platform):
        compiles.append(str(ttir))
        time.sleep(0.05)   # long enough for waiting threads to pile up on one key
        result = _Compiled(f"ptx of {ttir} {options.hash()} {capability}", "kern", 4096 + len(compiles), "g", "l")
        ttir.text = "rewritten by the passes"
        return result

    backend, options = _Hashed("ptxas-12.8-90"), _Hashed("nw4")
    with triton.knobs.cache.scope():
        triton.knobs.cache.dir = str(tmp_path / "triton")
        first = _disk_cached(compile_ttir, _Compiled)
        made = first(_Ttir("module A"), backend, options, 90, "cuda")
        assert made.binary == "ptx of module A nw4 90" and first.stats == {"compiled": 1, "read": 0}
        second = _disk_cached(compile_ttir, _Compiled)
        read = second(_Ttir("module A"), backend, options, 90, "cuda")
        assert (read.binary, read.name, read.shared_mem_bytes) == (made.binary, "kern", made.shared_mem_bytes)
        assert read.ttgir is None and len(compiles) == 1 and second.stats == {"compiled": 0, "read": 1}
        for call in [("module B", backend, options, 90), ("module A", backend, _Hashed("nw8"), 90),
                     ("module A", _Hashed("ptxas-13.0-90"), options, 90), ("module A", backend, options, 100)]:
            second(_Ttir(call[0]), *call[1:], "cuda")
        assert len(compiles) == 5 and second.stats == {"compiled": 4, "read": 1}
        monkeypatch.setenv("TRITON_ALWAYS_COMPILE", "1")
        second(_Ttir("module A"), backend, options, 90, "cuda")
        monkeypatch.delenv("TRITON_ALWAYS_COMPILE")
        _disk_cached(compile_ttir, _Compiled, dumping=lambda: True)(_Ttir("module A"), backend, options, 90, "cuda")
        assert len(compiles) == 7

        compiles.clear()
        triton.knobs.cache.dir = str(tmp_path / "empty")
        threaded = _disk_cached(compile_ttir, _Compiled)
        results = []
        workers = [threading.Thread(target=lambda: results.append(
            threaded(_Ttir("module C"), backend, options, 90, "cuda").binary)) for _ in range(6)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert compiles == ["module C"] and threaded.stats == {"compiled": 1, "read": 5}
    assert results == ["ptx of module C nw4 90"] * 6


GPU_START = """
import json, sys
import m3_jax
from m3_jax._triton_call import kernel_cache_stats
llm = m3_jax.LLM(sys.argv[1], max_num_seqs=2, max_model_len=128, max_num_batched_tokens=8, load_format="dummy",
                 num_gpu_blocks_override=8, compile_cache_dir=sys.argv[2], precompile=True)   # a small pool
print(json.dumps(kernel_cache_stats()))
"""


@pytest.mark.gpu
def test_second_jax_start_compiles_no_triton_kernel(model_dir, tmp_path):
    """On a GPU: two JAX engines in two processes over one cache folder; the first compiles its Triton
    kernels to PTX (its threads that wait for a kernel another compiles read it back), the second reads
    every one back (jax-triton alone compiles them again in each process)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    run = [sys.executable, "-c", GPU_START, str(model_dir), str(tmp_path / "cache")]

    def start() -> dict:
        done = subprocess.run(run, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout.splitlines()[-1])

    first, second = start(), start()
    assert first["compiled"] > 0
    assert second["compiled"] == 0 and second["read"] >= first["compiled"]


def test_precompile_and_cache_flags():
    from m3_engine.args import ArgumentParser, add_engine_flags, engine_options

    p = ArgumentParser()
    add_engine_flags(p)
    assert engine_options(p.parse_args([]))["precompile"] is None   # the runner decides: on a GPU
    assert engine_options(p.parse_args(["--no-precompile"]))["precompile"] is False
    options = engine_options(p.parse_args(["--precompile", "--compile-cache-dir", "/c"]))
    assert options["precompile"] is True and options["compile_cache_dir"] == "/c"
