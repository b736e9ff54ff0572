"""All-reduce across a slow link between nodes: the flat ring written here, the hierarchical
all-reduce (distlab.parallel.data_parallel.hierarchical) and the backend's own, timed in the
ranks of a torchrun job and with the bytes each put on this node's link, read from the link's
own counter (/sys/class/net/<GLOO_SOCKET_IFNAME>/statistics). benchmarks/two_tier.py runs it
in simulated nodes (distlab.caller.cluster):

    torchrun --nnodes 2 --nproc-per-node 2 ... -m distlab.studies.two_tier --mib 16

Rank 0 prints one JSON line: per algorithm, the median seconds, every repeat's seconds
("samples"; the algorithms take turns within each repeat) and the link's bytes sent per
all-reduce (node 0's link: every rank of node 0 writes through it); "within a node" is the
node's own ranks alone (the fast tier). Several --mib sizes: one such result per size, under
"sizes" (benchmarks/link_sweep.py fits α and β per tier from them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from distlab.comm import Comm
from distlab.parallel.data_parallel.hierarchical import (hierarchical_all_reduce,
                                                        leader_all_reduce, node_groups)
from distlab.studies import report
from distlab.wire import link_counters


def measure(mib: float, repeats: int) -> dict:
    world, g = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    flat, (intra, inter) = Comm(), node_groups(g)
    dev = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    t = torch.ones(int(mib * 2**20) // 4)
    algorithms = {"flat ring": lambda: flat.ring_all_reduce(t),
                  "hierarchical": lambda: hierarchical_all_reduce(t, intra, inter),
                  "hierarchical, one flow": lambda: leader_all_reduce(t, intra, inter),
                  "backend": lambda: flat.all_reduce(t),
                  # the fast tier alone: the node's ranks over their own loopback
                  "within a node": lambda: intra.all_reduce(t)}
    out = {"world": world, "ranks_per_node": g, "mib": mib, "interface": dev}
    seconds = {name: [] for name in algorithms}
    link = {name: [] for name in algorithms}
    names = list(algorithms)
    # interleaved: each repeat runs every algorithm once, the order turned by one each time, so
    # a load that comes and goes on the machine falls on all of them alike (issue 42: a timing
    # verdict compares spreads, and repeats taken one algorithm after another compare moments)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            # the counter is read before the barrier: after it, the other ranks may already be
            # sending (CI caught 53 KB of a 1.5 MB ring missed that way); the barrier's own few
            # hundred bytes are counted instead
            b0 = link_counters(dev)
            dist.barrier()
            t0 = time.perf_counter()
            algorithms[name]()
            dist.barrier()  # every rank done: the slowest rank's time is the all-reduce's
            seconds[name].append(time.perf_counter() - t0)
            b1 = link_counters(dev)
            link[name].append(None if b0 is None else b1["sent"] - b0["sent"])
    for name in names:
        out[name] = {"seconds": statistics.median(seconds[name]), "samples": seconds[name],
                     "link_sent": None if None in link[name] else statistics.median(link[name])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, nargs="+", default=[16.0],
                    help="all-reduce size(s), MiB; several: one result per size under 'sizes'")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    results = [measure(m, args.repeats) for m in args.mib]
    result = results[0] if len(results) == 1 else {"sizes": results}
    report(result)


if __name__ == "__main__":
    main()
