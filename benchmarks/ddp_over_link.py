"""DDP's step time across two simulated nodes over a sweep of link speeds (issue 26 item 3).

    .venv/bin/python benchmarks/ddp_over_link.py [--links 25 50 100 200] [--steps 8]

Each run is RunConfig(strategy="ddp", world_size=4, nodes=2, link_mbit=L): two torchrun agents
with two ranks each, the default GPT (0.82M parameters). Printed per link: rank 0's median step
time (first --warmup steps dropped), and the bytes each node's link sent per step (its
interface's counter, distlab.caller.cluster_run).

The model: over a slow link the step is compute plus the gradient bytes that cross the link at
its rate, t(L) = t0 + bytes_per_step · 8 / L (DDP can hide communication only behind backward,
and at these rates the transfer is many backwards long). A least-squares line through the
measured (1/L, t) points gives its slope, seconds per step per (1/Mbit/s); the model says the
slope is the bytes each link carries per step in Mbit. Both are printed: the measured slope over
the counted bytes is how much of the link's rate the step gets (1.0: all of it). Needs root (the
simulated nodes); without it the script says so and stops.
"""

from __future__ import annotations

import argparse
import sys

from _bench import scratch_runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--links", type=float, nargs="+", default=[25, 50, 100, 200])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    with scratch_runs(__file__, "distlab-ddp-link-"):
        from distlab import RunConfig
        from distlab.caller import cluster
        from distlab.lab.multi_node import fit_link, link_sweep

        why = cluster.available()
        if why is not None:
            print(f"simulated nodes unavailable: {why}")
            return 1
        cfg = RunConfig(strategy="ddp", world_size=4, nodes=2, steps=args.steps, timeout_s=300)
        rows = link_sweep(cfg, args.links, args.warmup)
        for r in rows:
            print(f"link {r.link_mbit:6.0f} Mbit/s: step {1e3 * r.step_s:8.1f} ms (median), each "
                  f"link sent {r.link_bytes / 1e6:.3f} MB per step ({r.link_bytes / r.grad_bytes:.2f}x "
                  f"the {r.grad_bytes / 1e6:.3f} MB of gradients)")
        fit = fit_link(rows)
        print(f"\nfit t = t0 + slope / L: t0 {1e3 * fit.t0:.1f} ms (the step without the link), "
              f"slope {fit.slope:.3f} s·Mbit/s")
        print(f"model: slope = the Mbit each link carries per step = {fit.counted:.3f}; "
              f"measured slope / model = {fit.ratio:.2f} (1.0: the step gets the link's whole "
              "rate)")
        for r in rows:
            model = fit.predict(r.link_mbit)
            print(f"  {r.link_mbit:6.0f} Mbit/s: measured {1e3 * r.step_s:8.1f} ms, t0 + bits/rate "
                  f"{1e3 * model:8.1f} ms ({r.step_s / model:.2f}x)")
        return 0


if __name__ == "__main__":
    sys.exit(main())
