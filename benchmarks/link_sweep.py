"""What the slow link changes: all-reduces across simulated nodes over a sweep of link speeds,
with α and β fitted per tier from the run (distlab.caller.cluster: root only).

    .venv/bin/python benchmarks/link_sweep.py [--mbit 25 50 100 200] [--mib 1 4 16]

For each link speed, one torchrun job of 2 nodes x 2 ranks (distlab.studies.two_tier) times
the flat ring, the hierarchical all-reduce, the backend's and the node's own ranks alone, at
each size. Then, per speed, the α-β model (comm.fit_alpha_beta: t = m·α + B/β, least squares
over the sizes) is fitted on each tier:

    across nodes   the flat ring: m = 2(N-1) dependent messages, B = the bytes node 0's link
                   carried (its own counter)
    within a node  the node's ranks alone: m = 2(g-1), B = 2(g-1)/g of the buffer per rank

The fitted β of the slow tier is set beside the configured link rate (tbf, bytes/s), and the
fast tier's beside the slow one's. Then the two-tier model predicts every algorithm from those
two fits, phase by phase (each phase: its dependent messages x α of its tier, plus the bytes
on its tier's busiest link / β), with S the buffer, N = n·g ranks, n nodes of g:

    flat ring         2(N-1) steps, each crossing the link with S/N:  2(N-1)(α_s + S/N/β_s)
    hierarchical      reduce-scatter in the node (g-1)(α_f + S/g/β_f), the g rings across
                      2(n-1)(α_s + S/n/β_s) (g flows of S/(g·n) share the link), all-gather
                      in the node (g-1)(α_f + S/g/β_f)
    one flow          all-reduce in the node 2(g-1)(α_f + S/g/β_f), the leaders' ring across
                      2(n-1)(α_s + S/n/β_s), broadcast in the node α_f + S/β_f
    backend           gloo's choice, modelled as the flat ring

The flat ring's prediction is in-sample (the slow tier is fitted on it); the others are not.
Target (issue: a cluster on your laptop): every measured collective within 1.3x of its
prediction. Exit status 1 when missed.
"""

from __future__ import annotations

import argparse
import sys

from distlab.caller.cluster import available
from distlab.comm import fit_alpha_beta
from distlab.studies import run_in_nodes

NODES, RANKS = 2, 2
TARGET = 1.3  # every collective within this factor of the two-tier model


def one_speed(mbit: float, mibs: list[float]) -> list[dict]:
    res = run_in_nodes("distlab.studies.two_tier", ["--mib", *[str(m) for m in mibs]], NODES,
                       RANKS, mbit)
    return res["sizes"] if "sizes" in res else [res]


def fit_tiers(results: list[dict]) -> dict:
    N, g = NODES * RANKS, RANKS
    slow = fit_alpha_beta([r["flat ring"]["link_sent"] for r in results],
                          [r["flat ring"]["seconds"] for r in results],
                          [2 * (N - 1)] * len(results))
    fast = fit_alpha_beta([2 * (g - 1) / g * r["mib"] * 2**20 for r in results],
                          [r["within a node"]["seconds"] for r in results],
                          [2 * (g - 1)] * len(results))
    return {"across nodes": slow, "within a node": fast}


def predict(fit: dict, mib: float) -> dict:
    """Seconds each algorithm takes by the two-tier α-β model (the module docstring)."""
    (a_s, b_s), (a_f, b_f) = fit["across nodes"], fit["within a node"]
    S, n, g = mib * 2**20, NODES, RANKS
    N = n * g
    in_node = 2 * (g - 1) * (a_f + S / g / b_f)  # reduce-scatter + all-gather, or all-reduce
    across = 2 * (n - 1) * (a_s + S / n / b_s)
    ring = 2 * (N - 1) * (a_s + S / N / b_s)
    return {"flat ring": ring, "hierarchical": in_node + across,
            "hierarchical, one flow": in_node + across + a_f + S / b_f, "backend": ring}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbit", type=float, nargs="+", default=[25.0, 50.0, 100.0, 200.0])
    ap.add_argument("--mib", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    args = ap.parse_args()
    why = available()
    if why is not None:
        print(f"no simulated nodes here: {why}")
        return 0
    print(f"{NODES} nodes x {RANKS} ranks; all-reduce sizes {args.mib} MiB")
    print(f"{'link':>10} {'size MiB':>8} {'flat ring s':>11} {'hierarch. s':>11} "
          f"{'backend s':>9} {'in node s':>9}")
    fits, measured = {}, {}
    for mbit in args.mbit:
        results = measured[mbit] = one_speed(mbit, args.mib)
        for r in results:
            print(f"{mbit:>6g} Mb/s {r['mib']:>8g} {r['flat ring']['seconds']:>11.3f} "
                  f"{r['hierarchical']['seconds']:>11.3f} {r['backend']['seconds']:>9.3f} "
                  f"{r['within a node']['seconds']:>9.4f}")
        fits[mbit] = fit_tiers(results)
    print("\nα-β fitted per tier (t = m·α + B/β over the sizes):")
    print(f"{'link':>10} {'slow α ms':>9} {'slow β MB/s':>11} {'link rate MB/s':>14} "
          f"{'β / rate':>8} {'fast α ms':>9} {'fast β MB/s':>11}")
    for mbit, f in fits.items():
        (sa, sb), (fa, fb) = f["across nodes"], f["within a node"]
        rate = mbit * 1e6 / 8
        print(f"{mbit:>6g} Mb/s {sa * 1e3:>9.2f} {sb / 1e6:>11.2f} {rate / 1e6:>14.2f} "
              f"{sb / rate:>8.2f} {fa * 1e3:>9.3f} {fb / 1e6:>11.0f}")
    names = ("flat ring", "hierarchical", "hierarchical, one flow", "backend")
    print("\nmeasured / predicted by the two-tier model (the flat ring is in-sample):")
    print(f"{'link':>10} {'size MiB':>8} " + " ".join(f"{k:>22}" for k in names))
    worst = 1.0
    for mbit, results in measured.items():
        for r in results:
            p = predict(fits[mbit], r["mib"])
            ratios = [r[k]["seconds"] / p[k] for k in names]
            worst = max([worst] + [max(x, 1 / x) for x in ratios])
            print(f"{mbit:>6g} Mb/s {r['mib']:>8g} " + " ".join(f"{x:>22.2f}" for x in ratios))
    ok = worst <= TARGET
    print(f"worst measured/predicted (either way): {worst:.2f}x; target every collective within "
          f"{TARGET}x: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
