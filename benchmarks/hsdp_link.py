"""HSDP against sharding over every rank, across a slow link, in simulated nodes on this
machine (distlab.caller.cluster: root only).

    .venv/bin/python benchmarks/hsdp_link.py [--nodes 2] [--ranks 2] [--mbit 100] [--steps 6]

Starts one torchrun agent per node running distlab.studies.hsdp: our fully_shard and FSDP2,
each as HSDP (shard inside a node, replicate across) and over all ranks, training the default
GPT with SGD on the same batches. Prints per way: seconds per step, node 0's link bytes per step
(frames, and the payload: frames less their headers), the formula's payload for HSDP
(g x 2(n-1)/n x the gradient shard bytes), and the target:

    HSDP's inter-node payload per step equal to its formula within 2%, ours and FSDP2's

and the largest loss difference between the ways (all four compute the same SGD steps). Exit
status 0 when met, 1 when missed, 0 with a line saying why where simulated nodes cannot be made.
"""

from __future__ import annotations

import argparse
import sys

from distlab.caller.cluster import available
from distlab.lab.multi_node import hsdp_study

TARGET = 0.02


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2, help="ranks per node")
    ap.add_argument("--mbit", type=float, default=100.0)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    why = available()
    if why is not None:
        print(f"no simulated nodes here: {why}")
        return 0
    res = hsdp_study(args.nodes, args.ranks, args.mbit, args.steps)
    print(f"{args.nodes} nodes x {args.ranks} ranks, {args.mbit:g} Mbit/s links; per step, "
          "node 0's link:")
    print(f"{'way':<24}{'seconds':>9}{'frames MB':>11}{'payload MB':>12}{'formula MB':>12}"
          f"{'payload / formula':>19}")
    ok = True
    for name, r in res.items():
        f = r["formula"]
        ratio = None if f is None else r["payload"] / f
        print(f"{name:<24}{r['seconds']:>9.3f}{r['frames'] / 1e6:>11.3f}"
              f"{r['payload'] / 1e6:>12.3f}{'-' if f is None else f'{f / 1e6:.3f}':>12}"
              f"{'-' if ratio is None else f'{ratio:.4f}':>19}")
        if ratio is not None:
            ok &= abs(ratio - 1) <= TARGET
    losses = [r["losses"] for r in res.values()]
    worst = max(abs(a - b) for run in losses for a, b in zip(run, losses[0]))
    hsdp, full = res["FSDP2, HSDP"], res["FSDP2, over all ranks"]
    print(f"FSDP2: HSDP's link payload per step is {hsdp['payload'] / full['payload']:.2f}x "
          f"sharding over all ranks', its step {hsdp['seconds'] / full['seconds']:.2f}x")
    print(f"largest loss difference between the ways over {args.steps} steps: {worst:.1e}")
    print(f"target: HSDP's payload within {TARGET:.0%} of its formula: "
          f"{'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
