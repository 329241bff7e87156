"""The speculation gate on a model of the workload: ``python3 -m benchmarks.speculation_gate`` (CPU).

Runs the engine's own :class:`m3_engine.speculative.SpeculationGate` over one
request's steps, with drafts of ``k`` tokens each accepted with probability
``alpha`` while the ones before it were (independently, a fixed seed), and
prices each step: a plain step 1, a verify step ``--verify-cost`` (1.6: the
H200's 4-layer M3-shape model at batch 1, k = 4, docs/PERF.md). Prints the
speedup over plain decoding (plain steps / priced steps for the same output
length) per acceptance and output length: where the gate stops a request that
cannot pay and where it keeps one that can. A model, not a measurement.
"""

from __future__ import annotations

import argparse

import numpy as np

from m3_engine.speculative import SpeculationGate


def speedup(alpha: float, tokens: int, k: int, verify_cost: float, runs: int, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    cost = 0.0
    for _ in range(runs):
        gate, out, step = SpeculationGate(), 0, 0
        while out < tokens:
            step += 1
            if gate.wants_drafts(step):
                accepted = 0
                while accepted < k and rng.random() < alpha:
                    accepted += 1
                gate.record(k, accepted)
                out, cost = out + accepted + 1, cost + verify_cost
            else:
                out, cost = out + 1, cost + 1
    return tokens * runs / cost


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--verify-cost", type=float, default=1.6)
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 1.0])
    parser.add_argument("--runs", type=int, default=400)
    a = parser.parse_args(argv)
    print(f"speedup over plain decoding, k = {a.k}, a verify step = {a.verify_cost} plain steps")
    print("| acceptance per draft | " + " | ".join(f"{t} tokens" for t in a.tokens) + " |")
    print("|---|" + "---|" * len(a.tokens))
    for alpha in a.alphas:
        cells = (f"{speedup(alpha, t, a.k, a.verify_cost, a.runs):.2f}x" for t in a.tokens)
        print(f"| {alpha:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
