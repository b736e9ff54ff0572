"""Fewer bytes over a slow link (issue 26 item 3): DDP against top-k compression, PyTorch's
PowerSGD hook, local SGD and DiLoCo, on 2 simulated nodes x 2 ranks, as loss against time.

    .venv/bin/python benchmarks/slow_link_ways.py [--link 25] [--steps 40]

Each way trains the default GPT (0.82M parameters, AdamW) on the same global batches. Printed
per way: seconds per step (rank 0's wall clock over the run, averaging steps included), the
bytes each node's link sent per step (its interface's counter) against the gradients' bytes,
the loss over the last 5 steps, and the wall-clock seconds until the loss (averaged over 5
steps) first reaches the loss DDP had half-way through its run (a loss DDP reached), with the
speed-up over DDP's own time to it. Needs root (the simulated nodes); without it the
script says so and stops.
"""

from __future__ import annotations

import argparse
import sys

from _bench import scratch_runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link", type=float, default=25.0, help="Mbit/s")
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    with scratch_runs(__file__, "distlab-slow-link-"):
        from distlab import RunConfig
        from distlab.caller import cluster
        from distlab.lab.multi_node import (race_target, reach_time, slow_link_race,
                                            slow_link_ways)

        why = cluster.available()
        if why is not None:
            print(f"simulated nodes unavailable: {why}")
            return 1
        base = RunConfig(strategy="ddp", world_size=4, nodes=2, link_mbit=args.link,
                         steps=args.steps, timeout_s=600)
        rows = slow_link_race(slow_link_ways(base))
        target = race_target(rows[0])
        ddp_t = reach_time(rows[0], target)
        print(f"{args.link:g} Mbit/s, 2 nodes x 2 ranks, {args.steps} steps; target: DDP's loss "
              f"half-way, {target:.3f}, reached by DDP at {ddp_t:.1f} s")
        for r in rows:
            t = reach_time(r, target)
            reach = "never" if t is None else f"{t:5.1f} s ({ddp_t / t:4.1f}x DDP)"
            print(f"{r.name:24s} {1e3 * r.step_s:6.0f} ms/step  link {r.link_bytes / 1e6:6.3f} MB "
                  f"per step ({r.link_bytes / r.grad_bytes:.3f}x gradients)  final loss "
                  f"{r.final_loss():.3f}  reaches the target at {reach} (run "
                  f"{r.seconds[-1]:.1f} s)")
        return 0


if __name__ == "__main__":
    sys.exit(main())
