"""Step time of distlab's DDP (`ddp`) against torch's (`ddp-torch`), side by side.

    .venv/bin/python benchmarks/ddp_overhead.py [--world 2] [--repeats 6] [--steps 30]

One launch of --world ranks trains the same run under each strategy in turn, --repeats times,
alternating the order (A B, B A, ...) so drift in the machine's load falls on both alike. Each
training is --steps steps of the default RunConfig's GPT (4 layers, n_embd 128, 0.82M
parameters, 3.27 MB of gradients) with SGD; the first --warmup steps of each are dropped
(torch's DDP rebuilds its buckets after iteration 0). The step time is rank 0's step_s (the
ranks meet at every all-reduce, so they agree to within a wait).

Buckets: `ddp` cuts them by torch's Reducer rule (a bucket closes once it reaches the cap), so
both make the same buckets at the same bucket_mb (13 at 0.25 MiB; the table shows the counts).
--ddp-bucket-mb sets ddp's cap alone, to see what another bucket count costs.

Prints the median step time of each strategy, the ratio ddp / ddp-torch (target: at most
1.10), the per-repeat ratios, the bytes per rank per step of each (they must be equal), and
ddp's overlap fraction (the part of its communication time hidden under backward; see
distlab.parallel.data_parallel.ddp). `allreduce` (every gradient all-reduced after backward, no buckets, no
overlap) runs alongside as the baseline both improve on.

Runs go to a temporary DISTLAB_RUNS folder, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from _bench import scratch_runs

TARGET_RATIO = 1.10
STRATEGIES = ("ddp", "ddp-torch", "allreduce")


def time_strategies(rank, world, device, log, cfg_dicts: list, repeats: int, warmup: int):
    """Rank function: train each config `repeats` times, alternating the order; per config
    the step times, bytes sent per step and (ddp) overlap fractions of the steps after warmup."""
    from distlab.config import RunConfig
    from distlab.events import StepRecorder
    from distlab.rank.train import train

    out = {d["strategy"]: {"step_s": [], "per_repeat": [], "bytes": [], "overlap": [],
                           "buckets": []} for d in cfg_dicts}
    for rep in range(repeats):
        for d in (cfg_dicts if rep % 2 == 0 else cfg_dicts[::-1]):
            rec = StepRecorder(log)
            train(RunConfig.from_dict(d), rank, world, device, rec)
            steps = rec.steps[warmup:]
            o = out[d["strategy"]]
            o["step_s"] += [e["step_s"] for e in steps]
            o["per_repeat"].append(statistics.median(e["step_s"] for e in steps))
            o["bytes"] += [sum(s["bytes_sent"] for s in e["comm"].values()) for e in steps]
            o["overlap"] += [e["ddp"]["overlap"] for e in steps if "ddp" in e]
            o["buckets"] += [len(e[k]["buckets"]) for e in steps for k in ("ddp", "ddp_torch")
                             if k in e]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--repeats", type=int, default=6, help="trainings per strategy (default 6)")
    p.add_argument("--steps", type=int, default=30, help="steps per training (default 30)")
    p.add_argument("--warmup", type=int, default=3, help="steps dropped per training")
    p.add_argument("--bucket-mb", type=float, default=0.25, help="bucket cap, MiB (default 0.25)")
    p.add_argument("--ddp-bucket-mb", type=float, default=None,
                   help="a different cap for ddp alone (to compare at equal bucket counts)")
    args = p.parse_args(argv)

    with scratch_runs(__file__, "distlab-ddp-bench-") as bench:
        from distlab import RunConfig, run_ranks

        base = RunConfig(strategy="ddp", world_size=args.world, steps=args.steps,
                         optimizer="sgd", lr=0.1, bucket_mb=args.bucket_mb, timeout_s=120)
        cfgs = [base.replace(strategy=s).to_dict() for s in STRATEGIES]
        cfgs[0]["bucket_mb"] = args.ddp_bucket_mb or args.bucket_mb
        print(f"{args.world} ranks, {args.repeats} repeats x {args.steps} steps (first "
              f"{args.warmup} dropped), global batch {base.global_batch}, seq {base.seq_len}, "
              f"bucket_mb {cfgs[0]['bucket_mb']} (ddp), {args.bucket_mb} (others); cpu cores "
              f"{os.cpu_count()}, load average {os.getloadavg()[0]:.1f}\n")
        res = run_ranks(bench.time_strategies, args.world, cfgs, args.repeats, args.warmup,
                        timeout_s=120)[0]
        med = {s: statistics.median(res[s]["step_s"]) for s in STRATEGIES}
        print(f"{'strategy':<10} {'median ms':>9} {'per-repeat medians, ms':<40} bytes/step "
              "buckets")
        for s in STRATEGIES:
            reps = " ".join(f"{1e3 * t:.1f}" for t in res[s]["per_repeat"])
            nbytes = statistics.median(res[s]["bytes"])
            buckets = statistics.median(res[s]["buckets"]) if res[s]["buckets"] else "-"
            print(f"{s:<10} {1e3 * med[s]:>9.1f} {reps:<40} {nbytes:<10.0f} {buckets}")
        ratio = med["ddp"] / med["ddp-torch"]
        per_rep = [a / b for a, b in zip(res["ddp"]["per_repeat"], res["ddp-torch"]["per_repeat"])]
        ov = res["ddp"]["overlap"]
        print(f"\nddp / ddp-torch step time (ratio of medians): {ratio:.3f} (target: at most "
              f"{TARGET_RATIO}); per repeat {' '.join(f'{r:.2f}' for r in per_rep)}, median "
              f"{statistics.median(per_rep):.2f}")
        quartiles = " ".join(f"{q:.2f}" for q in statistics.quantiles(ov, n=4))
        print(f"ddp overlap (communication hidden under backward): median "
              f"{statistics.median(ov):.2f}, quartiles {quartiles}")
        print("\nmet" if ratio <= TARGET_RATIO else "\nNOT met")
        return 0 if ratio <= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
