"""``load_format="dummy"`` in torch: the random weights of ``m3_engine.dummy_weights``, drawn on the device.

Each tensor is ``torch.empty(...).normal_()`` of the model dtype on the rank's
device, with a ``torch.Generator`` of that device seeded per tensor (the seeds,
shapes and scales are ``m3_engine.dummy_weights``'): drawn in place, no host
memory, no temporary copy, nothing compiled.
"""

from __future__ import annotations

from typing import Collection, Iterator, Optional

import torch

from m3_engine.dummy_weights import dummy_tensors
from m3_engine.model_config import M3TextConfig
from m3_engine.tp import RankShard

__all__ = ["iter_dummy_weights"]


def iter_dummy_weights(config: M3TextConfig, *, device: torch.device, dtype: torch.dtype, seed: int,
                       shard: Optional[RankShard] = None, skip: Collection[str] = ()
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(canonical name, tensor)`` as ``checkpoint.iter_weights`` does, each drawn on ``device``."""
    for t in dummy_tensors(config, seed, shard=shard, skip=skip):
        generator = torch.Generator(device=device).manual_seed(t.seed)
        yield t.name, torch.empty(t.shape, dtype=dtype, device=device).normal_(0.0, t.std, generator=generator)
