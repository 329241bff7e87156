"""The engine options' one table: ``EngineArgs`` fields -> the flags of ``m3-generate`` and ``m3-serve``
(same flags, defaults, help), vLLM's option names, and the KV pool sizing of ``gpu_memory_utilization``."""

import argparse
import dataclasses

import pytest

from m3_engine import cli
from m3_engine.args import EngineArgs, RENAMED_OPTIONS, add_engine_flags, check_option_names, engine_options, \
    kv_cache_pages

ENGINE_FIELDS = [f for f in dataclasses.fields(EngineArgs) if f.name != "model"]
GIB = 1 << 30


def engine_actions(parser: argparse.ArgumentParser) -> dict:
    """dest -> (option strings, default, help, type, choices) of the parser's engine flags."""
    names = {f.name for f in ENGINE_FIELDS}
    return {a.dest: (tuple(a.option_strings), a.default, a.help, a.type, a.choices)
            for a in parser._actions if a.dest in names}


def test_both_command_lines_take_every_engine_flag_alike():
    pytest.importorskip("fastapi")
    from m3_engine.server.cli import build_parser as serve_parser

    generate, serve = engine_actions(cli.build_parser()), engine_actions(serve_parser())
    assert set(generate) == {f.name for f in ENGINE_FIELDS}
    assert generate == serve
    for f in ENGINE_FIELDS:
        flags, default, help_, _, _ = generate[f.name]
        assert "--" + f.name.replace("_", "-") in flags and default == f.default and help_


def test_flags_are_vllm_spellings_and_read_back_as_options():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--max-num-seqs", "4", "--max-model-len", "1024", "--max-num-batched-tokens", "512",
                              "-tp", "2", "--gpu-memory-utilization", "0.5", "--enforce-eager", "--seed", "3",
                              "--dtype", "bfloat16", "--graph-batch-sizes", "1,2",
                              "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    options = engine_options(args)
    assert set(options) == {f.name for f in ENGINE_FIELDS}
    assert (options["max_num_seqs"], options["max_model_len"], options["max_num_batched_tokens"],
            options["tensor_parallel_size"], options["gpu_memory_utilization"], options["enforce_eager"],
            options["seed"], options["dtype"], options["graph_batch_sizes"]) == \
        (4, 1024, 512, 2, 0.5, True, 3, "bfloat16", [1, 2])
    assert options["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    assert engine_options(parser.parse_args([])) == {f.name: f.default for f in ENGINE_FIELDS}


@pytest.mark.parametrize("old", sorted(RENAMED_OPTIONS))
def test_old_option_names_name_the_new_one(old):
    with pytest.raises(TypeError, match=f"^{old}: renamed {RENAMED_OPTIONS[old]}"):
        check_option_names({old: 1})
    assert RENAMED_OPTIONS[old] in {f.name for f in ENGINE_FIELDS}
    check_option_names({RENAMED_OPTIONS[old]: 1})


def test_kv_cache_pages_from_memory():
    """vLLM's rule: utilization x total, less what weights and activations use, in whole pages."""
    page = 3 << 20   # 3 MiB a page (all layers)
    pages = kv_cache_pages(total_bytes=80 * GIB, used_bytes=30 * GIB, gpu_memory_utilization=0.9, page_bytes=page,
                           max_model_len=8192)
    assert pages == (72 * GIB - 30 * GIB) // page == 14336
    assert kv_cache_pages(total_bytes=80 * GIB, used_bytes=30 * GIB, gpu_memory_utilization=0.5, page_bytes=page,
                          max_model_len=8192) == (10 * GIB) // page
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: 0.4 .* max_model_len=8192 tokens needs 64"):
        kv_cache_pages(total_bytes=80 * GIB, used_bytes=32 * GIB, gpu_memory_utilization=0.4, page_bytes=page,
                       max_model_len=8192)
