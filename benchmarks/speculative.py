"""Speculative decoding against plain decoding, at MiniMax-M3's layer shapes: ``python3 -m benchmarks.speculative``.

The model is the real-shape one of ``benchmarks/model_step.py`` (MiniMax-M3's
per-layer dimensions, ``--layers`` layers, bf16) with random weights drawn on
the GPU (``load_format="dummy"``). A model with random weights does not quote
its prompt, so n-gram lookup finds nothing to draft on it; what a quoting
workload would give is measured with drafts of known quality instead:

* ``oracle``: the draft is the plain greedy output of the same prompt (from a
  plain run first): what n-gram drafting gives when the answer repeats text
  the prompt holds (every draft right unless bf16 rounding makes the
  speculative run leave the plain one);
* ``forced``: the plain output as drafts, each accepted with probability
  ``--acceptance`` while the ones before it were (0.8: 59% of k = 4 drafts
  accepted on average), whatever the target samples, with the same draws in
  every run: the benchmark's stand-in for the engine's acceptance test writes
  the accepted drafts over the sampled tokens, so outputs hold what the cache
  holds. The steps, their shapes and the gate are those of a workload with
  that acceptance. The oracle's acceptance is limited by the random model: a
  verify step's bf16 logits differ in the last bits from a one-token step's,
  and at a near-tie the speculative run leaves the plain one;
* ``wrong``: that output shifted by one token id (every draft wrong): the
  zero-acceptance case, with drafts on every step until the per-request
  acceptance gate turns drafting off;
* ``ngram``: the real n-gram lookup on the same random prompts (what a random
  model gives: almost never a draft).

The drafts are swapped in by replacing the scheduler's n-gram lookup (and, for
``forced``, its acceptance count) in the benchmark's process only; everything
else (verify steps, CUDA graphs / compiled steps, acceptance, the gate) is the
engine's. For each mode and batch (1 and
``--batch``): tokens per second of ``LLM.generate`` (output tokens / wall
time, median of ``--reps`` runs after a warm-up run that captures the graphs
/ compiles the steps) with ``{"method": "ngram", "num_speculative_tokens": k}``
against the same prompts without speculation, the engine's acceptance
counters, and the share of outputs equal to the plain ones. Each framework runs
in a fresh process, one engine at a time.

Writes ``<date>-h200-speculative.{json,md}`` to ``--out`` (default
benchmarks/results/) with the command, the GPU and its copy bandwidth.
``--tiny``: the tiny CPU model, to check the script.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from m3_engine import SamplingParams
from m3_engine.speculative import ngram_draft

from benchmarks.e2e import run_frameworks
from benchmarks.model_step import M3_DIMS, text_config, write_config

MODES = ("off", "oracle", "forced", "wrong", "ngram")


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, length).tolist() for _ in range(count)]


class DraftSource:
    """Stands in for ``m3_engine.scheduler.ngram_draft`` (same signature). Modes: ``off`` (no draft:
    the engine runs plain steps), ``oracle`` (each prompt's greedy output so far, from the previous
    run of this prompt), ``wrong`` (the same shifted by one id), ``ngram`` (the real lookup)."""

    def __init__(self, vocab: int):
        self.by_prompt, self.vocab, self.mode = {}, vocab, "off"
        self.key_len = 32   # a prompt is known by its first tokens (at most its length: nothing of its output)

    def record(self, prompts: list, outputs: list):
        self.key_len = min([self.key_len] + [len(p) for p in prompts])
        self.by_prompt = {tuple(p[:self.key_len]): (len(p), o) for p, o in zip(prompts, outputs)}

    def __call__(self, tokens, k, n_min, n_max):
        if self.mode == "ngram":
            return ngram_draft(tokens, k, n_min, n_max)
        if self.mode == "off":
            return tokens[:0]
        length, known = self.by_prompt[tuple(tokens[:self.key_len].tolist())]
        i = len(tokens) - length                       # tokens[-1] is output i - 1
        draft = np.asarray(known[i:i + k], np.int32)
        return (draft + 1) % self.vocab if self.mode == "wrong" else draft


class ForcedAcceptance:
    """Stands in for ``m3_engine.scheduler.num_accepted``: in mode ``forced`` each draft is accepted with
    probability ``rate`` while the ones before it were, and the accepted drafts are written over the
    sampled tokens (``sampled`` is the scheduler's list for this row; the token after them stays the
    target's); the real test otherwise."""

    def __init__(self, source: DraftSource, rate: float, real):
        self.source, self.rate, self.real = source, rate, real
        self.reset()

    def reset(self):
        """The same draws in every run, so the timed runs likely meet the step shapes of the warm-up (JAX
        compiles a step shape when it first meets it); not certain: the gate's probes follow the engine's
        step count, which runs on across runs."""
        self.rng = np.random.default_rng(0)

    def __call__(self, drafts, sampled) -> int:
        if self.source.mode != "forced":
            return self.real(drafts, sampled)
        n = 0
        while n < len(drafts) and self.rng.random() < self.rate:
            n += 1
        sampled[:n] = [int(d) for d in drafts[:n]]
        return n


def generate(llm, prompts, params) -> tuple:
    """-> (output tokens, seconds, engine counters moved)."""
    before = dict(llm.engine.stats)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.engine.stats
    moved = {key: after[key] - before[key] for key in ("steps", "spec_verify_steps", "spec_draft_tokens",
                                                       "spec_accepted_tokens")}
    return [o.outputs[0].token_ids for o in outs], seconds, moved


def run_framework(framework: str, model_dir: str, args: dict) -> dict:
    """Everything for one framework (run in a fresh process): one engine with speculation, the modes
    interleaved rep by rep (so clock or thermal drift hits every mode alike)."""
    import importlib
    from m3_engine import scheduler
    LLM = importlib.import_module(f"m3_{framework}").LLM
    k, batch, new, reps = args["k"], args["batch"], args["new_tokens"], args["reps"]
    greedy = SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0)
    options = dict(dtype=args["dtype"], max_num_seqs=batch, max_model_len=args["prompt_len"] + new + 16,
                   load_format="dummy", seed=0, device=args["device"], precompile=False)
    rows = []
    with LLM(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": k}, **options) as llm:
        source = DraftSource(llm.config.vocab_size)
        scheduler.ngram_draft = source
        forced = scheduler.num_accepted = ForcedAcceptance(source, args["acceptance"], scheduler.num_accepted)
        prompts = random_prompts(batch, args["prompt_len"], llm.config.vocab_size)
        for b in sorted({1, batch}):
            chosen, runs = prompts[:b], {m: [] for m in MODES}
            source.mode = "off"
            plain = generate(llm, chosen, greedy)[0]        # warm-up; its outputs seed the oracle
            # an oracle run drafts the outputs of the previous oracle run (the first: the plain ones): a
            # verify step's bf16 logits differ in the last bits from a one-token step's, so a speculative
            # run can leave the plain one at a near-tie of the random model, and then follows its own
            last_oracle = plain
            for rep in range(reps + 1):                     # rep 0 warms each mode up (graphs, compilations)
                for mode in MODES:
                    source.mode = mode
                    source.record(chosen, last_oracle if mode == "oracle" else plain)
                    forced.reset()
                    tokens, seconds, moved = generate(llm, chosen, greedy)
                    if mode == "oracle":
                        last_oracle = tokens
                    if rep:
                        runs[mode].append((tokens, seconds, moved))
            base = float(np.median([sec for _, sec, _ in runs["off"]]))
            for mode in MODES:
                seconds = float(np.median([sec for _, sec, _ in runs[mode]]))
                tokens = runs[mode][-1][0]
                moved = {key: sum(m[key] for _, _, m in runs[mode]) / reps for key in runs[mode][0][2]}
                out_tokens = sum(map(len, tokens))
                rows.append(dict(mode=mode, batch=b, tokens_per_s=out_tokens / seconds, speedup=base / seconds,
                                 steps=moved["steps"], verify_steps=moved["spec_verify_steps"],
                                 draft_tokens=moved["spec_draft_tokens"], accepted_tokens=moved["spec_accepted_tokens"],
                                 acceptance_rate=moved["spec_accepted_tokens"] / moved["spec_draft_tokens"]
                                 if moved["spec_draft_tokens"] else None,
                                 same_outputs=float(np.mean([a == p for a, p in zip(tokens, plain)]))))
                print(framework, rows[-1], flush=True)
    return dict(rows=rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frameworks", default="torch,jax")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--acceptance", type=float, default=0.8, help="the forced mode's acceptance per draft")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tiny", action="store_true", help="the tiny CPU model (checks the script)")
    a = parser.parse_args(argv)
    from benchmarks.model_step import device_info
    device = "cpu" if a.tiny else "cuda"
    info = device_info(device)
    with tempfile.TemporaryDirectory() as tmp:
        if a.tiny:
            from m3_engine.tiny_model import tiny_text_config
            text = tiny_text_config()
        else:
            text = text_config(M3_DIMS, a.layers, a.prompt_len + a.new_tokens + 16)
        model_dir = str(write_config(Path(tmp) / "model", text))
        args = dict(k=a.k, batch=a.batch, new_tokens=a.new_tokens, reps=a.reps, prompt_len=a.prompt_len,
                    acceptance=a.acceptance,
                    dtype="float32" if a.tiny else "bfloat16", device=device)
        result = dict(command="python3 -m benchmarks.speculative " + " ".join(argv if argv is not None else
                                                                             sys.argv[1:]),
                      date=datetime.date.today().isoformat(), **info, layers=a.layers, k=a.k, batch=a.batch,
                      model="the tiny test model (float32)" if a.tiny else f"M3 layer shapes, {a.layers} layers, bf16",
                      new_tokens=a.new_tokens, prompt_len=a.prompt_len, reps=a.reps, acceptance=a.acceptance,
                      results={})
        name = f"{result['date']}-{'cpu-tiny' if a.tiny else 'h200'}-speculative"
        return run_frameworks(a.frameworks, run_framework, model_dir, args, result, a.out, name, markdown)


def markdown(r: dict) -> str:
    lines = [f"# Speculative decoding (k = {r['k']}) on {r['name']} ({r['date']})", "",
             f"Command: `{r['command']}`. Copy bandwidth (same run): {r['copy_bandwidth'] / 1e12:.2f} TB/s. Model: "
             f"{r['model']}, random weights; random prompts of {r['prompt_len']} tokens, {r['new_tokens']} new "
             f"tokens each, greedy; one engine with speculation, modes interleaved, median of {r['reps']} runs. Drafts: "
             f"off = none (plain steps), oracle = the output of the previous oracle run (a quoting workload's best "
             f"case), forced = the plain outputs as drafts, each accepted with probability {r['acceptance']:.2f} while "
             f"the ones before it were (by construction, the same draws in every run), wrong = "
             f"never accepted, ngram = the real lookup (random prompts: almost no drafts).", "",
             "| framework | drafts | batch | tok/s | speedup vs off | acceptance | verify / steps | "
             "same outputs as off |", "|---|---|---|---|---|---|---|---|"]
    for fw, res in r["results"].items():
        for row in res["rows"]:
            acc = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
            lines.append(f"| {fw} | {row['mode']} | {row['batch']} | {row['tokens_per_s']:.1f} | "
                         f"{row['speedup']:.2f}x | {acc} | "
                         f"{row['verify_steps']:.0f} / {row['steps']:.0f} | {row['same_outputs']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
