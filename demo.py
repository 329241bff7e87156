"""`make demo`: a tiny random MiniMax-M3 model generating through the MSA kernels, in PyTorch and in JAX.

Writes a tiny random M3 checkpoint in the Hugging Face format (config.json with
a nested text_config, safetensors with the original tensor names,
tokenizer.json, a chat template; 4 layers: 1 dense + 3 MSA with top-2 blocks of
128 tokens, MoE with 4 experts) to ``$XDG_CACHE_HOME/m3-msa/tiny-m3`` (default
``~/.cache/m3-msa/tiny-m3``), then completes a few text prompts of different
lengths greedily with ``m3_torch.LLM`` and ``m3_jax.LLM`` (the same engine,
continuous batching, chunked prefill, CUDA graphs / a jitted decode step), and
prints the texts, whether the two frameworks agree token for token, tokens/s
and, where transformers is installed, whether both match its
``MiniMaxM3VLForCausalLM`` greedy tokens. The model is random: its text is
noise; the point is that every framework produces the same noise. Uses the
GPU where there is one; on a CPU the kernels run in Triton's interpreter (slow:
short prompts).
"""

import os
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from m3_engine import SamplingParams, engine_class  # noqa: E402
from m3_engine.tiny_model import write_tiny_checkpoint  # noqa: E402

NEAR_TIE = 1e-3   # a step whose top-2 logits are closer than this may go either way in float32
TEXT = ("MiniMax M3 reads long documents with sparse attention: a light indexer scores every block of one "
        "hundred and twenty eight cached tokens and keeps the best ones. ")


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "m3-msa" / "tiny-m3"


def transformers_tokens(model_dir, prompts_ids, max_tokens):
    """transformers' own greedy tokens (float32, eager attention) and each step's top-2 logit margin,
    or None where transformers is not installed."""
    try:
        import torch
        import transformers
        from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as modeling
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    vl = modeling.MiniMaxM3SparseForConditionalGeneration.from_pretrained(model_dir, **kwargs)  # original names
    model = transformers.MiniMaxM3VLForCausalLM(vl.config.text_config)
    model.model, model.lm_head = vl.model.language_model, vl.lm_head
    out = []
    with torch.no_grad():
        for ids in prompts_ids:
            tokens, margins = [], []
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids + tokens]), use_cache=False).logits[0, -1]
                top2 = logits.topk(2).values
                tokens.append(int(logits.argmax()))
                margins.append(float(top2[0] - top2[1]))
            out.append((tokens, margins))
    return out


def main():
    import torch

    gpu = torch.cuda.is_available()
    repeats, max_tokens = ((1, 4, 30), 32) if gpu else ((1, 2), 6)  # the interpreter: a few minutes at most
    prompts = ["The quick brown fox"] + [TEXT * n for n in repeats]
    model_dir = write_tiny_checkpoint(cache_dir(), seed=0, dtype="float32")
    where = f"GPU {torch.cuda.get_device_name()}" if gpu else "CPU (Triton interpreter)"
    print(f"tiny random MiniMax-M3 checkpoint: {model_dir}\n  4 layers (1 dense + 3 MSA, top-2 blocks of 128), "
          f"MoE 4 experts top-2, float32, on {where}")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    results = {}
    for framework in ("torch", "jax"):
        with engine_class(framework)(model_dir, max_num_seqs=4, max_model_len=4096) as llm:
            if gpu:  # compile / capture first, then time
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
        results[framework] = outputs
        total = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(f"{framework:5s}: {total} tokens in {seconds:.2f} s = {total / seconds:.1f} tok/s"
              f"{'' if gpu else ' (includes compilation)'}")

    print()
    agree = True
    for t, j in zip(results["torch"], results["jax"]):
        a, b = t.outputs[0].token_ids, j.outputs[0].token_ids
        agree &= a == b
        print(f"prompt of {len(t.prompt_token_ids):4d} tokens -> {t.outputs[0].text!r}")
        if a != b:
            print(f"{'':22s}jax: {j.outputs[0].text!r}  <- differs at token "
                  f"{next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)}")
    print(f"\ntorch and JAX agree token for token: {'yes' if agree else 'NO'}")

    reference = transformers_tokens(model_dir, [o.prompt_token_ids for o in results["torch"]], max_tokens)
    if reference is None:
        print("transformers is not installed: no reference check")
    else:
        same, compared = [], 0
        for o, (tokens, margins) in zip(results["torch"], reference):
            n = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(tokens))  # up to a near-tie
            same.append(o.outputs[0].token_ids[:n] == tokens[:n])
            compared += n
        print(f"transformers' greedy tokens equal ours for {sum(same)} of {len(same)} prompts "
              f"({compared} tokens compared, up to the first top-2 logit margin below {NEAR_TIE})")
        agree &= all(same)
    if not agree:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
