"""Flat ring against hierarchical all-reduce (and the backend's) across a slow link, in
simulated nodes on this machine (distlab.caller.cluster: root only).

    .venv/bin/python benchmarks/two_tier.py [--nodes 2] [--ranks 2] [--mbit 100] [--mib 16]

Starts one torchrun agent per node running distlab.studies.two_tier, which times each
algorithm on a --mib all-reduce (median of 3, barrier to barrier) and reads node 0's link
counter. Prints seconds and link bytes per algorithm, the bytes the formula predicts on node
0's link (flat ring: 2(N-1)/N x S per ring edge that leaves the node, one per node; hierarchical:
2(n-1)/n x S for the node's g ranks together), and the target:

    hierarchical at least 1.3x faster than the flat ring (the link bytes predict 1.5x at 2 x 2),
    both variants (g rings across the link, and one flow of the node's leaders)

Exit status 0 when met, 1 when missed, 0 with a line saying why where simulated nodes cannot be
made (not root).
"""

from __future__ import annotations

import argparse
import sys

from distlab.caller.cluster import available
from distlab.studies import run_in_nodes
from distlab.theory.comm_bytes import all_reduce_link_bytes

TARGET = 1.3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2, help="ranks per node")
    ap.add_argument("--mbit", type=float, default=100.0)
    ap.add_argument("--mib", type=float, default=16.0)
    args = ap.parse_args()
    why = available()
    if why is not None:
        print(f"no simulated nodes here: {why}")
        return 0
    try:
        res = run_in_nodes("distlab.studies.two_tier", ["--mib", str(args.mib)], args.nodes,
                           args.ranks, args.mbit, timeout_s=600)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    n, g = args.nodes, args.ranks
    predicted = {**all_reduce_link_bytes(args.mib * 2**20, g, n), "backend": None}
    print(f"{n} nodes x {g} ranks, {args.mbit:g} Mbit/s links, all-reduce of {args.mib:g} MiB")
    print(f"{'algorithm':<24}{'seconds':>9}{'link MiB sent':>15}{'formula MiB':>13}")
    for name in ("flat ring", "hierarchical", "hierarchical, one flow", "backend"):
        r, p = res[name], predicted[name]
        link = "n/a" if r["link_sent"] is None else f"{r['link_sent'] / 2**20:.2f}"
        print(f"{name:<24}{r['seconds']:>9.3f}{link:>15}"
              f"{'-' if p is None else f'{p / 2**20:.2f}':>13}")
    ok = True
    for name in ("hierarchical", "hierarchical, one flow"):
        speedup = res["flat ring"]["seconds"] / res[name]["seconds"]
        ok &= speedup >= TARGET
        print(f"{name}: {speedup:.2f}x faster than the flat ring (target at least {TARGET}x; "
              f"the formula's bytes predict {predicted['flat ring'] / predicted[name]:.2f}x): "
              f"{'met' if speedup >= TARGET else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
