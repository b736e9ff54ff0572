"""Step time of distlab's tensor parallelism (`tp`) against torch's DTensor TP (`tp-torch`),
side by side, without and with sequence parallelism (sp=True).

    .venv/bin/python benchmarks/tp_overhead.py [--tp 2] [--repeats 5] [--steps 15]

One launch of --tp ranks trains the same run under each of tp, tp-torch, tp sp, tp-torch sp in
turn, --repeats times, alternating the order (A B C D, D C B A, ...) so drift in the machine's
load falls on all alike. Each training is --steps steps of the default RunConfig's GPT (4
layers, n_embd 128, 4 heads, batch 16 x seq 64, 0.82M parameters) with SGD; the first --warmup
steps of each are dropped. Every TP rank sees the whole batch. The step time is rank 0's
step_s (ranks meet at every all-reduce / all-gather, so they agree to within a wait).

Prints each config's median step time and per-repeat medians, the ratios tp / tp-torch (and
tp sp / tp-torch sp) of the medians and per repeat (target: at most 1.15, as for ddp), and the
bytes each rank sends per step by Comm's count (tp-torch's collectives are torch's own: not
counted).

Runs go to a temporary DISTLAB_RUNS folder, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from _bench import scratch_runs

TARGET_RATIO = 1.15
NAMES = ("tp", "tp-torch", "tp sp", "tp-torch sp")
PAIRS = (("tp", "tp-torch"), ("tp sp", "tp-torch sp"))


def time_configs(rank, world, device, log, cfg_dicts: list, repeats: int, warmup: int):
    """Rank function: train each config `repeats` times, alternating the order; per config (its
    name) the step times and bytes sent after warmup and each repeat's median."""
    from distlab.config import RunConfig
    from distlab.events import StepRecorder
    from distlab.rank.train import train

    out = {d["name"]: {"step_s": [], "per_repeat": [], "bytes": []} for d in cfg_dicts}
    for rep in range(repeats):
        for d in (cfg_dicts if rep % 2 == 0 else cfg_dicts[::-1]):
            rec = StepRecorder(log)
            train(RunConfig.from_dict(d), rank, world, device, rec)
            steps = rec.steps[warmup:]
            o = out[d["name"]]
            o["step_s"] += [e["step_s"] for e in steps]
            o["per_repeat"].append(statistics.median(e["step_s"] for e in steps))
            o["bytes"] += [sum(s["bytes_sent"] for s in e["comm"].values()) for e in steps]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    ap.add_argument("--repeats", type=int, default=5, help="trainings per config (default 5)")
    ap.add_argument("--steps", type=int, default=15, help="steps per training (default 15)")
    ap.add_argument("--warmup", type=int, default=3, help="steps dropped per training")
    ap.add_argument("--quick", action="store_true", help="3 repeats x 8 steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup = 3, 8, 2

    with scratch_runs(__file__, "distlab-tp-bench-") as bench:
        from distlab import RunConfig, run_ranks

        base = RunConfig(strategy="tp", world_size=args.tp, tp=args.tp, steps=args.steps,
                         optimizer="sgd", lr=0.1, timeout_s=120)
        runs = {"tp": base, "tp-torch": base.replace(strategy="tp-torch"),
                "tp sp": base.replace(sp=True),
                "tp-torch sp": base.replace(strategy="tp-torch", sp=True)}
        cfgs = [c.replace(name=n).to_dict() for n, c in runs.items()]
        print(f"tp={args.tp}, {args.repeats} repeats x {args.steps} steps (first {args.warmup} "
              f"dropped), GPT {base.n_layer} layers n_embd {base.n_embd} {base.n_head} heads, "
              f"batch {base.global_batch} x seq {base.seq_len}; cpu cores {os.cpu_count()}, "
              f"load average {os.getloadavg()[0]:.1f}\n")
        res = run_ranks(bench.time_configs, args.tp, cfgs, args.repeats, args.warmup,
                        timeout_s=120, wall_timeout_s=600)[0]
        med = {n: statistics.median(res[n]["step_s"]) for n in NAMES}
        print(f"{'config':<12} {'median ms':>9}  {'per-repeat medians, ms':<36} bytes/step/rank")
        for n in NAMES:
            reps = " ".join(f"{1e3 * t:.1f}" for t in res[n]["per_repeat"])
            nbytes = statistics.median(res[n]["bytes"])
            print(f"{n:<12} {1e3 * med[n]:>9.1f}  {reps:<36} {nbytes:.0f}"
                  + (" (torch's own collectives: not counted)" if "torch" in n else ""))
        ok = True
        for a, b in PAIRS:
            ratio = med[a] / med[b]
            per_rep = [x / y for x, y in zip(res[a]["per_repeat"], res[b]["per_repeat"])]
            ok &= ratio <= TARGET_RATIO
            print(f"\n{a} / {b} step time (ratio of medians): {ratio:.3f} (target: at most "
                  f"{TARGET_RATIO}); per repeat {' '.join(f'{r:.2f}' for r in per_rep)}, "
                  f"median {statistics.median(per_rep):.2f}")
        print(f"\nsp / no sp: tp {med['tp sp'] / med['tp']:.2f}, tp-torch "
              f"{med['tp-torch sp'] / med['tp-torch']:.2f}")
        print("\nmet" if ok else "\nNOT met")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
