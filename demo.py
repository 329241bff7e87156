"""`make demo`: one MSA decode step through PyTorch and JAX, checked and timed.

CPU (default here): small shapes through Triton's interpreter. GPU: MiniMax-M3
shapes (64 query heads, 4 KV heads, head_dim 128, 4 index heads of dim 128,
16 of N blocks). Prints the error against the float64 reference, whether torch
and JAX agree bit for bit, and the time per step.
"""

import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import m3_jax  # noqa: E402
import m3_torch  # noqa: E402
from m3_torch import reference  # noqa: E402

PAGE = 128


def main():
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    if gpu:
        shape = dict(lens=[8192, 5000, 129, 16000], hq=64, hk=4, d=128, topk=16, dtype=torch.bfloat16)
    else:
        shape = dict(lens=[700, 129, 1], hq=8, hk=2, d=64, topk=4, dtype=torch.bfloat16)
    lens, hq, hk, d, topk, dtype = (shape[k] for k in ("lens", "hq", "hk", "d", "topk", "dtype"))
    print(f"MSA decode step on {'GPU ' + torch.cuda.get_device_name() if gpu else 'CPU (Triton interpreter)'}: "
          f"{len(lens)} requests, KV lengths {lens}, {hq} q heads, {hk} KV heads, head_dim {d}, top-{topk} blocks")

    g = torch.Generator().manual_seed(0)
    R, max_blocks = len(lens), max(-(-s // PAGE) for s in lens)
    pages = R * max_blocks
    x = dict(
        q=torch.randn(R, hq, d, generator=g), idx_q=torch.randn(R, hk, d, generator=g),
        k_cache=torch.randn(pages, hk, PAGE, d, generator=g), v_cache=torch.randn(pages, hk, PAGE, d, generator=g),
        index_k_cache=torch.randn(pages, PAGE, d, generator=g))
    x = {k: v.to(device, dtype) for k, v in x.items()}
    x["block_table"] = torch.randperm(pages, generator=g).int().reshape(R, max_blocks).to(device)
    x["seq_lens"] = torch.tensor(lens, dtype=torch.int32, device=device)
    order = ["q", "idx_q", "k_cache", "v_cache", "index_k_cache", "block_table", "seq_lens"]

    def torch_step():
        return m3_torch.msa_decode(*(x[k] for k in order), decode_query_len=1, topk=topk)

    out, ids = torch_step()
    expected = reference.attention_ref(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                       [1] * R, ids.cpu())
    err = float((out.double().cpu() - expected).norm() / expected.norm())
    print(f"torch: relative error vs float64 reference {err:.2e} (bf16 bound 1e-2): {'OK' if err < 1e-2 else 'FAIL'}")

    jax_args = [jax.numpy.asarray(_np(x[k])) for k in order]
    jax_step = jax.jit(lambda *a: m3_jax.msa_decode(*a, decode_query_len=1, topk=topk))
    jout, jids = jax_step(*jax_args)
    same = np.array_equal(_np(out), np.asarray(jout)) and np.array_equal(_np(ids), np.asarray(jids))
    print(f"jax:   output and block ids bit-identical to torch: {same}")

    reps = 20 if gpu else 1
    for name, step in (("torch", torch_step), ("jax (jit)", lambda: jax_step(*jax_args)[0].block_until_ready())):
        step()
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        if gpu:
            torch.cuda.synchronize()
        print(f"{name:10s} {(time.perf_counter() - t0) / reps * 1e3:9.2f} ms per step")
    if not (err < 1e-2 and same):
        raise SystemExit(1)


def _np(t):
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


if __name__ == "__main__":
    main()
