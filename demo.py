"""`make demo`: a tiny random MiniMax-M3 model generating through the MSA kernels, in PyTorch and in JAX.

Writes a tiny random M3 checkpoint in the Hugging Face format (config.json with
a nested text_config, safetensors with the original tensor names, tokenizer.json;
4 layers: 1 dense + 3 MSA with top-2 blocks of 128 tokens, MoE with 4 experts) to
``$XDG_CACHE_HOME/m3-msa/tiny-m3`` (default ``~/.cache/m3-msa/tiny-m3``), then
generates greedily for a handful of prompts of different lengths with
``m3_torch.LLM`` and ``m3_jax.LLM`` (continuous batching, chunked prefill, CUDA
graphs / a jitted decode step) and prints the tokens, whether the two frameworks
agree token for token, and tokens/s. Uses the GPU where there is one (on the GPU
machine run ``python demo.py`` from the checkout); on a CPU the same kernels run
in Triton's interpreter (slow: small prompts).
"""

import os
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from m3_kernels.tiny_model import write_tiny_checkpoint  # noqa: E402



def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "m3-msa" / "tiny-m3"


def main():
    import m3_jax
    import m3_torch

    classes = {"torch": m3_torch.LLM, "jax": m3_jax.LLM}

    gpu = torch.cuda.is_available()
    if gpu:
        lengths, max_new_tokens = [1, 127, 129, 700, 3000], 32
    else:  # the interpreter runs a few programs per token: keep it to a few minutes
        lengths, max_new_tokens = [1, 16, 130], 6
    model_dir = write_tiny_checkpoint(cache_dir(), seed=0, dtype="float32")
    where = f"GPU {torch.cuda.get_device_name()}" if gpu else "CPU (Triton interpreter)"
    print(f"tiny random MiniMax-M3 checkpoint: {model_dir}\n  4 layers (1 dense + 3 MSA, top-2 blocks of 128), "
          f"MoE 4 experts top-2, float32, on {where}")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, n).tolist() for n in lengths]  # ids 0-2 are pad/bos/eos
    print(f"{len(prompts)} prompts of {lengths} tokens, {max_new_tokens} new tokens each (greedy)\n")

    results = {}
    for name, cls in classes.items():
        llm = cls(model_dir)
        if gpu:  # compile / capture first, then time
            llm.generate(prompts, max_new_tokens=2)
        start = time.perf_counter()
        outputs = llm.generate(prompts, max_new_tokens=max_new_tokens)
        seconds = time.perf_counter() - start
        results[name] = outputs
        total = sum(map(len, outputs))
        print(f"{name:5s}: {total} tokens in {seconds:.2f} s = {total / seconds:.1f} tok/s"
              f"{'' if gpu else ' (first run: includes compilation)'}")
        del llm

    print()
    agree = True
    for n, a, b in zip(lengths, results["torch"], results["jax"]):
        same = a == b
        agree &= same
        print(f"prompt of {n:4d} tokens: torch {a}")
        if not same:
            print(f"{'':22s}jax   {b}  <- differs at token {next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)}")
    print(f"\ntorch and JAX agree token for token: {'yes' if agree else 'NO'}")
    if not agree:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
