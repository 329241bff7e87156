"""Helpers shared by the JAX test files: same-bits conversions, device placement."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch


def jax_gpu_ready():
    return jax.default_backend() == "gpu" and importlib.util.find_spec("jax_triton") is not None


@pytest.fixture(autouse=True)
def _jax_device(request):
    """CPU tests run JAX on its CPU device, also on a GPU machine (where torch's CPU
    tensors run the interpreter too, so the bit-identity checks still hold)."""
    if "gpu" in request.keywords:
        yield
    else:
        with jax.default_device(jax.devices("cpu")[0]):
            yield


def to_jax(t: torch.Tensor) -> jax.Array:
    """A torch tensor -> a jax array with the same bits (bf16 through int16)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.view(torch.int16).numpy().view(jnp.bfloat16))
    return jnp.asarray(t.numpy())


def to_torch(a) -> torch.Tensor:
    """A jax array -> a CPU torch tensor with the same bits."""
    a = np.asarray(a)
    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def jax_inputs(case, x: dict) -> dict:
    """A case's torch inputs as jax arrays; NHD cases pass the NHD store itself (kv_layout="NHD")."""
    j = {k: to_jax(v) for k, v in x.items()}
    if case.nhd:  # x["k_cache"] is the HND permutation of a [pages, 128, Hk, D] store
        j["k_cache"] = to_jax(x["k_cache"].permute(0, 2, 1, 3))
        j["v_cache"] = to_jax(x["v_cache"].permute(0, 2, 1, 3))
    j["kv_layout"] = "NHD" if case.nhd else "HND"
    return j


def assert_bit_identical(jax_out, torch_out):
    got = to_torch(jax_out)
    want = torch_out.detach().cpu().contiguous()
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), \
        "JAX and torch launches of the same kernel differ"
