"""What the CuTeDSL backends' tests need to know of the machine: the package, the GPU.

Importing this module on a machine without a GPU sets ``CUTE_DSL_ARCH=sm_90a`` (unless set): the
compile tests target Hopper, and cutlass reads it when it is first imported.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAVE_CUTEDSL = importlib.util.find_spec("cutlass") is not None
GPU_CAPABILITY = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
if GPU_CAPABILITY is None:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
needs_cutedsl = pytest.mark.skipif(not HAVE_CUTEDSL, reason="nvidia-cutlass-dsl is not installed (pip install -e "
                                                            "'.[cutedsl]'; README: CuteDSL indexer backend)")
