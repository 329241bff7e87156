"""gpu_memory_utilization sizes the KV pool from the memory left after the weights (no GPU needed:
the device's memory numbers are faked); num_gpu_blocks_override and a CPU keep the scheduler's."""

from __future__ import annotations

import types

import pytest
import torch

from m3_engine.args import EngineArgs
from m3_engine.tiny_model import write_tiny_checkpoint
from m3_jax import runner as jax_runner
from m3_torch.rank import RankRunner

GIB = 1 << 30


def test_torch_pages_from_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * GIB, 100 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 70 * GIB)   # this process: the weights
    rank = types.SimpleNamespace(device=torch.device("cuda", 0), max_blocks=4)
    pages = RankRunner._pages_from_memory(rank, GIB // 4, 0.9, 512, tp_size=1)
    assert pages == (90 - 70) * 4   # (0.9 * 100 - 70) GiB of quarter-GiB pages
    with pytest.raises(ValueError, match="^gpu_memory_utilization: 0.7 of 100.0 GiB leaves 0.00 GiB"):
        RankRunner._pages_from_memory(rank, GIB // 4, 0.7, 512, tp_size=1)


def test_torch_pages_count_this_process_and_fit_the_free_memory(monkeypatch):
    """Another process's memory is not the engine's (its weights are what it reserved), but the pool
    never takes more than is free."""
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 10 * GIB)
    rank = types.SimpleNamespace(device=torch.device("cuda", 0), max_blocks=4)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * GIB, 100 * GIB))   # 30 GiB another's
    assert RankRunner._pages_from_memory(rank, GIB // 4, 0.9, 512, tp_size=1) == 60 * 4   # free, not 80 GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (85 * GIB, 100 * GIB))
    assert RankRunner._pages_from_memory(rank, GIB // 4, 0.9, 512, tp_size=1) == (90 - 10) * 4


def test_jax_pages_from_memory_fewest_device():
    class Device:
        def __init__(self, in_use):
            self.in_use = in_use

        def memory_stats(self):
            return {"bytes_limit": 100 * GIB, "bytes_in_use": self.in_use}

    pages = [jax_runner._pages_from_memory(d, GIB, 0.5, 128) for d in (Device(10 * GIB), Device(20 * GIB))]
    assert pages == [40, 30]


def test_cpu_and_override_keep_the_scheduler_pages(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path, seed=0)
    args = EngineArgs(model_dir, device="cpu", max_num_seqs=2, max_model_len=256).check()
    assert args.num_gpu_blocks_override is None and args.scheduler.num_slots == 2 * 2
    args = EngineArgs(model_dir, device="cpu", max_model_len=256, num_gpu_blocks_override=7).check()
    assert args.num_gpu_blocks_override == 7 and args.scheduler.num_slots == 7
