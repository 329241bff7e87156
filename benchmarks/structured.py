"""Structured outputs' cost at decode: ``python3 -m benchmarks.structured [--frameworks torch,jax] [--batch 64] [--tiny]``.

The model is the real-shape one of ``benchmarks/async_scheduling.py`` (MiniMax-M3's per-layer dimensions and
its vocabulary of 200064, ``--layers`` layers, bf16, random weights drawn on the GPU), with a tokenizer
structured outputs can compile against: no real M3 tokenizer is at hand, so :func:`write_tokenizer` writes a
synthetic byte-level BPE one of the model's vocabulary, made like a real large vocabulary (word pieces, few
tokens holding a quote, a backslash or a control character: the mask of a JSON string costs what it does
with a real tokenizer, Mistral's 150k tekken measured alike). ``--batch``
requests of ``--prompt-len`` random tokens are prefilled (not measured), then their decode-only steps to
``--new-tokens`` tokens each are timed one by one (``llm.engine.step()`` wall time), after a warm-up pass of
the same workload (the engine is built with ``precompile=False``: the warm-up compiles and captures), for:

* (a) ``plain``: every row unconstrained (greedy, ``ignore_eos``);
* (b) ``masked``: every row constrained by the JSON schema :data:`SCHEMA`, an array of at least 1000 strings:
  random weights never complete it within ``--new-tokens`` tokens, so every row stays constrained to the
  end (inside and between strings);

each with ``async_scheduling`` off and on (one engine per framework, built with it on; the core's switch
turned off for the synchronous runs). Reported per framework and setting: the median step of (a) and of
(b), the cost ``(b - a) / a`` against the target (<= 5% at batch 64 on the H200, the mask filled while the
GPU runs the forward), and the host's fill time per step and per row (``m3_engine.structured_outputs.fill_bitmask``,
xgrammar's batched fill on ``FILL_THREADS`` threads). Torch also reports the sampling kernel alone on
``[batch, vocab]`` float32 logits, unmasked and masked (CUDA events, median of 50).

Writes ``<date>-h200-structured.{json,md}`` to ``--out`` (default benchmarks/results/), the device's copy
bandwidth measured first. ``--tiny``: the tiny model on the CPU (checks the script, measures nothing).
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.async_scheduling import (busy_fraction, decode_parser, jax_gpu_intervals, prefill, torch_gpu_intervals,
                                         write_model)
from benchmarks.e2e import run_frameworks

SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 1000}
CONSTRAINT = "JSON schema " + json.dumps(SCHEMA, separators=(",", ":")) + " (never complete within the run)"
TARGET_PCT = 5.0


# what write_tokenizer's word pieces are made of
_ONSETS = ("", "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y", "z",
           "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gr", "pl", "pr", "sh", "sl", "sp", "st", "str", "th",
           "tr", "wh")
_NUCLEI = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "y", "ai", "ea", "ee", "ie", "oo", "ou")
_CODAS = ("", "", "", "", "n", "r", "s", "t", "l", "d", "m", "ng", "nd", "st", "ck", "ght")
_LETTERS = ("абвгдежзийклмнопрстуфхцчшщыьэюя", "αβγδεζηθικλμνξοπρστυφχψω", "àáâäçèéêëíîïñóôöúûüßøå")
_PUNCT = ".,;:!?()[]{}<>=+-*/#_&%$@'|~^`"


def write_tokenizer(model_dir: Path, vocab_size: int, seed: int = 0) -> None:
    """A synthetic byte-level BPE ``tokenizer.json`` (+ ``tokenizer_config.json``) of ``vocab_size`` tokens,
    made like a real large vocabulary (which is what decides how much work xgrammar's mask is): the tiny
    model's special tokens at its ids (pad, bos, eos), the byte alphabet (byte fallback), then word pieces
    drawn from a seeded generator until the vocabulary is full:

    * 58% English-like pieces of 1-3 syllables (60% with a leading space; 17% capitalized, 3% upper case);
    * 30% non-ASCII words: Cyrillic, Greek or accented Latin letters (half with a leading space), or 1-3
      CJK characters;
    * 5% numbers of 1-3 digits;
    * 6% punctuation runs of 1-3 characters, a few with a quote or a backslash, some ending in a newline;
    * 1% whitespace runs (spaces, newlines, tabs).

    As in real 128k-200k vocabularies (Mistral's tekken: 0.4% of its tokens hold a quote, 0.35% a
    backslash, 1% a control character), about 0.25% hold a quote, 0.25% a backslash and 0.8% a newline or tab:
    inside a JSON string almost every token is allowed without running the grammar on it."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from m3_engine.tiny_model import BOS_ID, EOS_ID, PAD_ID

    specials = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab = dict(specials)
    byte_chars = _byte_level_chars()
    for c in sorted(byte_chars.values()):
        vocab[c] = len(vocab)
    rng = random.Random(seed)

    def piece() -> str:
        kind = rng.random()
        space = ""
        if kind < 0.58:
            word = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                           for _ in range(rng.randint(1, 3)))
            case = rng.random()
            word = word.capitalize() if case < 0.17 else word.upper() if case < 0.2 else word
            space = " " if rng.random() < 0.6 else ""
        elif kind < 0.88:
            if rng.random() < 0.25:
                word = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 3)))
            else:
                letters = rng.choice(_LETTERS)
                word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
                space = " " if rng.random() < 0.5 else ""
        elif kind < 0.93:
            word = str(rng.randint(0, 999))
            space = " " if rng.random() < 0.3 else ""
        elif kind < 0.99:
            word = "".join('"' if (r := rng.random()) < 0.025 else "\\" if r < 0.05 else rng.choice(_PUNCT)
                           for _ in range(rng.randint(1, 3)))
            word += "\n" if rng.random() < 0.15 else ""
            space = " " if rng.random() < 0.4 else ""
        else:
            word = rng.choice(" \n\t") * rng.randint(1, 16)
        return "".join(byte_chars[b] for b in (space + word).encode())

    while len(vocab) < vocab_size:
        vocab.setdefault(piece(), len(vocab))
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))


def _byte_level_chars() -> dict:
    """Byte -> the character a byte-level BPE vocabulary spells it with (GPT-2's map: printable
    Latin-1 bytes as themselves, the others from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = (b for b in range(256) if b not in printable)
    return {**{b: chr(b) for b in printable}, **{b: chr(0x100 + i) for i, b in enumerate(others)}}


def decode_pass(llm, prompts: list, params, fills: list) -> dict:
    """Prefill every request (unmeasured), then time each decode step to the end -> the median step
    (seconds), the steps timed, the fill time in them, the rows that ended before max_tokens. ``fills``: the fill calls' seconds,
    appended by the timing wrapper around ``fill_bitmask``."""
    engine = llm.engine
    ids, outputs, step = prefill(llm, prompts, params)
    times, fills[:] = [], []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return dict(step_s=statistics.median(times), steps=len(times), fill_s=sum(fills),
                finished_early=sum(len(outputs[i]) < params.max_tokens for i in ids))


PROFILED_STEPS = 16


def profile_pass(llm, prompts: list, params, framework: str, top: int = 12) -> dict:
    """Async scheduling on: prefill, 4 decode steps, then :data:`PROFILED_STEPS` steps twice: under the
    GPU profiler (torch.profiler / jax.profiler) -> the GPU's busy fraction over them and the wall time
    per step; then under ``cProfile`` -> host time per step of the ``top`` functions by own time (us per
    step, calls per step). The profiler's own overhead is in both."""
    import cProfile
    import pstats

    engine = llm.engine
    _, _, step = prefill(llm, prompts, params)
    for _ in range(4):
        step()
    wall = []

    def run():
        start = time.perf_counter()
        for _ in range(PROFILED_STEPS):
            if engine.has_unfinished_requests():
                step()
        wall.append(time.perf_counter() - start)

    out = {}
    if llm.runner.on_gpu:
        busy, span = busy_fraction((torch_gpu_intervals if framework == "torch" else jax_gpu_intervals)(run))
        out.update(gpu_busy=busy / span if span else None, step_ms_under_gpu_profiler=1e3 * wall[-1] / PROFILED_STEPS)
    host = cProfile.Profile()
    host.enable()
    run()
    host.disable()
    stats = pstats.Stats(host).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    out["host_us_per_step"] = 1e6 * sum(v[2] for v in stats.values()) / PROFILED_STEPS
    out["host_top"] = [dict(function=f"{Path(f).name}:{line} {fn}", calls_per_step=v[1] / PROFILED_STEPS,
                            own_us_per_step=1e6 * v[2] / PROFILED_STEPS) for (f, line, fn), v in rows]
    while engine.has_unfinished_requests():
        step()
    return out


def sampling_kernel_us(batch: int, vocab: int) -> dict:
    """Torch on a GPU: the sampling kernel on ``[batch, vocab]`` float32 logits, unmasked and with a token
    bitmask (half the tokens allowed), median of 50 (CUDA events)."""
    import torch

    from m3_torch.sampling import sample

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(batch, vocab, device="cuda", generator=g)
    rows = dict(temperature=torch.zeros(batch, device="cuda"), top_k=torch.zeros(batch, dtype=torch.int32, device="cuda"),
                top_p=torch.ones(batch, device="cuda"), min_p=torch.zeros(batch, device="cuda"),
                seeds=torch.zeros(batch, dtype=torch.int64, device="cuda"),
                counters=torch.zeros(batch, dtype=torch.int32, device="cuda"))
    bitmask = torch.full((batch, -(-vocab // 32)), 0x55555555, dtype=torch.int32, device="cuda")
    out = {}
    for name, mask in (("unmasked", None), ("masked", bitmask)):
        times = []
        for _ in range(55):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            sample(logits, *rows.values(), token_bitmask=mask)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        out[f"sampling_{name}_us"] = statistics.median(times[5:])
    return out


def run_framework(framework: str, model_dir: str, args: dict) -> dict:
    """Plain and masked decode, async scheduling off and on, for one framework (run in a fresh process)."""
    import importlib

    from m3_engine import SamplingParams, engine_core
    from m3_engine.structured_outputs import FILL_THREADS, StructuredOutputsParams

    fills = []
    fill_bitmask = engine_core.fill_bitmask

    def timed_fill(*a, **kw):
        start = time.perf_counter()
        try:
            return fill_bitmask(*a, **kw)
        finally:
            fills.append(time.perf_counter() - start)

    engine_core.fill_bitmask = timed_fill
    LLM = importlib.import_module(f"m3_{framework}").LLM
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, args["vocab"], args["prompt_len"]).tolist() for _ in range(args["batch"])]
    plain = SamplingParams(max_tokens=args["new_tokens"], ignore_eos=True, temperature=0.0)
    masked = SamplingParams(max_tokens=args["new_tokens"], ignore_eos=True, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    rows = []
    with LLM(model_dir, dtype=args["dtype"], device=args["device"], max_num_seqs=args["batch"],
             max_model_len=args["prompt_len"] + args["new_tokens"] + 16, load_format="dummy", seed=0,
             async_scheduling=True, precompile=False) as llm:
        for on in (False, True):
            llm.engine.core.async_scheduling = on
            runs = {}
            for name, params in (("plain", plain), ("masked", masked)):
                decode_pass(llm, prompts, params, fills)                  # warm-up: compiles, graph captures
                runs[name] = decode_pass(llm, prompts, params, fills)
            a, b = runs["plain"], runs["masked"]
            row = dict(framework=framework, async_scheduling=on, plain_step_ms=1e3 * a["step_s"],
                       masked_step_ms=1e3 * b["step_s"], cost_pct=100 * (b["step_s"] - a["step_s"]) / a["step_s"],
                       fill_ms_per_step=1e3 * b["fill_s"] / b["steps"],
                       fill_us_per_row=1e6 * b["fill_s"] / (b["steps"] * args["batch"]),
                       steps=b["steps"], finished_early=b["finished_early"], fill_threads=FILL_THREADS)
            row["within_target"] = row["cost_pct"] <= TARGET_PCT
            rows.append(row)
            print(row, flush=True)
        llm.engine.core.async_scheduling = True
        profile = {name: profile_pass(llm, prompts, params, framework) for name, params in (("plain", plain),
                                                                                              ("masked", masked))}
    out = dict(rows=rows, profile=profile)
    if framework == "torch" and args["device"] == "cuda":
        out.update(sampling_kernel_us(args["batch"], args["vocab_size"]))
    return out


def markdown(r: dict) -> str:
    lines = [f"# Structured outputs at decode on {r['name']} ({r['date']})", "",
             f"Command: `{r['command']}`. Copy bandwidth (same run): {r['copy_bandwidth'] / 1e12:.2f} TB/s. "
             f"Model: {r['model']}, random weights, a synthetic byte-level BPE tokenizer of the model's vocabulary (word pieces). "
             f"{r['batch']} random prompts of {r['prompt_len']} tokens prefilled, then {r['new_tokens']} greedy "
             f"tokens each; the median decode step (`llm.engine.step()`, after a warm-up pass) of (a) unconstrained "
             f"rows and (b) every row under the {r['constraint']}. Cost = (b - a) / a, target <= {TARGET_PCT:g}%.", "",
             "| framework | async_scheduling | (a) plain step ms | (b) masked step ms | cost | within target | "
             "fill ms / step | fill us / row | fill threads | rows finished early |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for fw, res in r["results"].items():
        for row in res["rows"]:
            lines.append(f"| {fw} | {row['async_scheduling']} | {row['plain_step_ms']:.2f} | "
                         f"{row['masked_step_ms']:.2f} | {row['cost_pct']:+.1f}% | {row['within_target']} | "
                         f"{row['fill_ms_per_step']:.2f} | {row['fill_us_per_row']:.1f} | {row['fill_threads']} | "
                         f"{row['finished_early']} |")
        if "sampling_masked_us" in res:
            lines += ["", f"{fw}: the sampling kernel alone on [{r['batch']}, vocab] float32 logits: "
                          f"{res['sampling_unmasked_us']:.1f} us unmasked, {res['sampling_masked_us']:.1f} us masked."]
        lines += profile_markdown(fw, res["profile"])
    return "\n".join(lines) + "\n"


def profile_markdown(framework: str, profile: dict) -> list:
    """The profiled steps (async scheduling on) of one framework, plain beside masked."""
    plain, masked = profile["plain"], profile["masked"]
    lines = ["", f"### {framework}: {PROFILED_STEPS} profiled decode steps, async scheduling on", ""]
    if "gpu_busy" in plain:
        lines.append(f"GPU busy (union of kernel and copy intervals over the steps): plain {plain['gpu_busy']:.1%}, "
                     f"masked {masked['gpu_busy']:.1%}; step under the GPU profiler: plain "
                     f"{plain['step_ms_under_gpu_profiler']:.2f} ms, masked {masked['step_ms_under_gpu_profiler']:.2f} ms.")
    lines += [f"Host time under cProfile (its overhead included): plain {plain['host_us_per_step']:.0f} us / step, "
              f"masked {masked['host_us_per_step']:.0f} us / step. The masked steps' functions with the most own "
              f"time (plain beside them):", "",
              "| function | masked: calls / step | masked: own us / step | plain: own us / step |", "|---|---|---|---|"]
    plain_us = {row["function"]: row["own_us_per_step"] for row in plain["host_top"]}
    for row in masked["host_top"]:
        other = plain_us.get(row["function"])
        lines.append(f"| `{row['function']}` | {row['calls_per_step']:.2f} | {row['own_us_per_step']:.0f} | "
                     f"{'-' if other is None else f'{other:.0f}'} |")
    return lines


def main(argv=None) -> dict:
    a = decode_parser(__doc__.split("\n")[0]).parse_args(argv)
    from benchmarks.model_step import device_info
    device = "cpu" if a.tiny else "cuda"
    info = device_info(device)   # the copy bandwidth first
    with tempfile.TemporaryDirectory() as tmp:
        text, model_dir = write_model(Path(tmp), a)
        write_tokenizer(model_dir, text["vocab_size"])
        args = dict(batch=a.batch, prompt_len=a.prompt_len, new_tokens=a.new_tokens, vocab=min(text["vocab_size"], 1000),
                    vocab_size=text["vocab_size"], dtype="float32" if a.tiny else "bfloat16", device=device)
        result = dict(command="python3 -m benchmarks.structured " + " ".join(argv if argv is not None else sys.argv[1:]),
                      date=datetime.date.today().isoformat(), **info, layers=a.layers, batch=a.batch,
                      prompt_len=a.prompt_len, new_tokens=a.new_tokens, constraint=CONSTRAINT,
                      target_pct=TARGET_PCT, vocab_size=text["vocab_size"],
                      model="the tiny test model (float32)" if a.tiny else
                      f"M3 layer shapes, {a.layers} layers, vocabulary {text['vocab_size']}, bf16", results={})
        name = f"{result['date']}-{'cpu-tiny' if a.tiny else 'h200'}-structured"
        return run_frameworks(a.frameworks, run_framework, str(model_dir), args, result, a.out, name, markdown)


if __name__ == "__main__":
    main()
