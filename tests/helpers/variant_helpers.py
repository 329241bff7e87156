"""The Triton kernel variants the torch engine's steps launch, recorded on the CPU without a GPU
(``m3_torch.ops.record_variants``: meta tensors stand for an H200's): the variants the start-up
warm-up compiles (``warm_up_shapes`` and the sampling variants) against those of the steps the
scheduler produces for a varied workload."""

from __future__ import annotations

import torch

from m3_engine.buckets import StepBuckets
from m3_engine.dummy_weights import dummy_tensors
from m3_engine.model_config import M3TextConfig
from m3_engine.scheduler import Scheduler, SchedulerConfig
from m3_kernels.pool import PoolLayout
from m3_torch.cache import allocate_pool, layer_caches
from m3_torch.model import M3Model, StepTensors
from m3_torch.ops import record_variants
from m3_torch.rank import graph_inputs, step_arrays
from m3_torch.runner import sample_on_device, sampling_variants, warm_up_shapes
from m3_torch.staging import upload

META = torch.device("meta")


class MetaEngine:
    """``config``'s model, pool and step buckets on the meta device (bfloat16, no weights read), with
    the limits of ``SchedulerConfig.from_engine_args(**limits)``; CUDA graphs as a GPU engine has them."""

    def __init__(self, config: M3TextConfig, **limits):
        self.config = config
        self.scheduler_config = SchedulerConfig.from_engine_args(config, num_gpu_blocks_override=None, **limits)
        self.buckets = StepBuckets.from_config(self.scheduler_config, None, pad_prefill=False, pad_decode=True)
        weights = {t.name: torch.empty(t.shape, dtype=torch.bfloat16, device=META) for t in dummy_tensors(config, 0)}
        self.model = M3Model(config, weights)
        layout = PoolLayout.create(self.scheduler_config.max_blocks, sparse=config.sparse_layers,
                                   num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                                   index_head_dim=config.index_head_dim, dtype="bfloat16")
        pool = allocate_pool(layout, META)
        self.caches = [layer_caches(pool, layout, i) for i in range(config.num_hidden_layers)]

    def scheduler(self) -> Scheduler:
        return Scheduler(self.scheduler_config, self.config)

    def tensors(self, step) -> StepTensors:
        """The step's inputs as the runner gives them (slices of one buffer: their alignment picks variants
        too): a graph's static inputs for a pure decode step, one upload (``m3_torch.staging``) for any
        other."""
        plan = step.plan
        if plan.cuda_graph:
            rows, n = plan.generation.num_rows, plan.generation.decode_query_len
            return graph_inputs(rows, n, self.scheduler_config.max_blocks, META)[1]
        return StepTensors(*upload(step_arrays(step), META))

    def record(self, steps, sampling=()) -> set:
        """The variant keys of the forwards of ``steps`` and of sampling ``L`` logits rows in each
        ``(L, SamplingBatch)`` of ``sampling``."""
        with record_variants() as recording:
            for step in steps:
                self.model.forward(self.tensors(step), step.plan, self.caches, ())
            for rows, batch in sampling:
                sample_on_device(torch.empty((rows, self.config.vocab_size), device=META), batch)
        return recording.variants

    def warm_up_variants(self) -> set:
        """What the engine's warm-up compiles: its steps' forwards and the sampling variants."""
        builder = self.scheduler().builder
        steps = [builder.dummy(shape, kv_len) for shape, kv_len in
                 warm_up_shapes(self.buckets, self.scheduler_config.max_blocks, True)]
        return self.record(steps, [(1, batch) for batch in sampling_variants(self.config.vocab_size)])
