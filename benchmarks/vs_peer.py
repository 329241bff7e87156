"""Our msa_decode beside the peer's (``../shared/BENCH_ANCHORS.md``), by % of floor (CPU, no GPU needed):

    python3 -m benchmarks.vs_peer RESULTS_JSON [--anchors ../shared/BENCH_ANCHORS.md] [--out DIR]

RESULTS_JSON: a ``benchmarks.run`` output covering the anchors' cases (M3, n in 1/2/4/8,
batch 1-128, 1k-128k: ``--ns 1,2,4,8 --batches 1,4,8,32,64,128 --contexts
1024,4096,16384,65536,131072 --configs M3 --no-prefill --no-baselines``). Both sides are put
against the anchors' floor (scaled to each run's copy bandwidth), so % of floor compares runs
of different bandwidths; the time ratio is printed too. Each row is checked against the decode
targets: level with the peer's % of floor (within 3 points, the run-to-run noise) everywhere; at
batch <= 8 and context >= 16k, 1.5x the peer or 85% of the floor, whichever is lower; at
contexts <= 2k, 1.3x the peer or 85% of the floor.
Writes vs_peer.md and vs_peer.json to --out.
"""

import argparse
import json
import math
import os
import re


def anchors(path):
    """-> ({(n, batch, context): (peer us, peer % floor, floor us)}, the anchors' copy TB/s)."""
    out, tbps = {}, None
    for line in open(path):
        m = re.match(r"\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)k\s*\|\s*([\d.]+)\s*\|\s*(\d+)%\s*\|\s*([\d.]+)\s*\|",
                     line)
        if m:
            n, b, k, us, pct, floor = m.groups()
            out[(int(n), int(b), int(k) * 1024)] = (float(us), float(pct), float(floor))
        m = re.match(r"Measured .*copy bandwidth ([\d.]+) TB/s", line)
        tbps = float(m.group(1)) if m else tbps
    return out, tbps


def target(batch, context, peer_us, floor_us):
    """The decode target's time for this row (of its two bars the lower one, i.e. the longer
    time), or None where only 'level' applies."""
    if batch <= 8 and context >= 16384:
        return max(peer_us / 1.5, floor_us / 0.85)
    if context <= 2048:
        return max(peer_us / 1.3, floor_us / 0.85)
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--anchors", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared",
                                                      "BENCH_ANCHORS.md"))
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/latest"))
    args = ap.parse_args()
    run = json.load(open(args.results))
    ours = {(r["n"], r["batch"], r["context"]): r for r in run["rows"]
            if r["op"] == "msa_decode" and r.get("config", "M3") == "M3"}
    peer, peer_tbps = anchors(args.anchors)
    rows, lines = [], []
    for key, (peer_us, peer_pct, peer_floor_us) in sorted(peer.items()):
        r = ours.get(key)
        if r is None:
            continue
        n, batch, context = key
        # the anchors' floor (for n > 1 it counts each request's 16 blocks once, where ours counts the
        # distinct blocks its tokens chose) at this run's copy bandwidth
        floor_us = peer_floor_us * peer_tbps / run["meta"]["copy_tbps"]
        pct = 100 * floor_us / r["us"]
        want = target(batch, context, peer_us, floor_us)
        level = pct >= peer_pct - 3
        met = level and (want is None or r["us"] <= want)
        rows.append(dict(n=n, batch=batch, context=context, peer_us=peer_us, peer_pct=peer_pct, us=r["us"],
                         pct=pct, target_us=want, level=level, met=met))
        lines.append(f"| {n} | {batch} | {context // 1024}k | {peer_us:.1f} ({peer_pct:.0f}%) | {r['us']:.1f} "
                     f"({pct:.0f}%) | {peer_us / r['us']:.2f}x | "
                     f"{'-' if want is None else f'{want:.1f}'} | {'yes' if met else 'NO'} |")
    geo = math.exp(sum(math.log(x["peer_us"] / x["us"]) for x in rows) / max(len(rows), 1))
    meta = run["meta"]
    md = [f"# msa_decode against the peer ({meta['gpu']}, {meta['date']})", "",
          f"Ours: `{meta['command']}`, copy bandwidth {meta['copy_tbps']:.2f} TB/s. Peer: BENCH_ANCHORS.md "
          f"(copy bandwidth {peer_tbps} TB/s there). % of floor: the anchors' floor (bytes / copy bandwidth; for "
          "n > 1 each request's 16 blocks once), scaled to this run's bandwidth. The time ratio (peer us / ours) "
          "drifts with the bandwidth of each run. Target: the decode target's time for the row (level with the peer's % of floor "
          "within 3 points everywhere; batch <= 8 and >= 16k: 1.5x the peer or 85% of the floor, whichever "
          "is lower; <= 2k: 1.3x the peer or 85% of the floor).", "",
          f"{len(rows)} cases; geometric mean peer us / ours {geo:.2f}x; target met in "
          f"{sum(x['met'] for x in rows)}, level or better in {sum(x['level'] for x in rows)}.", "",
          "| n | batch | context | peer us (% floor) | ours us (% floor) | ours vs peer | target us | met |",
          "|---|---|---|---|---|---|---|---|", *lines, ""]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vs_peer.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, geomean=geo), f, indent=1)
    with open(os.path.join(args.out, "vs_peer.md"), "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
