"""How long a notebook waits between Run and the first point on its live plot, and how long a step
of the default model takes.

    .venv/bin/python benchmarks/launch_latency.py [--repeats 3] [--steps 50]

For 1, 2 and 4 ranks: the time from calling `launch(cfg)` until the first "step" event is visible
in the caller (`run.history("step")` non-empty; the run's monitor thread reads the event logs every
distlab.run.POLL_S = 0.1 s, so that is the resolution), median over --repeats launches. It covers
spawning the processes (each imports torch), rendezvous, building the model and data, and one
training step. 1 rank runs strategy "single", 2 and 4 run "allreduce".

Then the step time of `single`: the median step_s over the step events of one --steps-step run of
the default RunConfig (model, batch, optimizer).

Runs go to a temporary DISTLAB_RUNS folder, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

TARGET_RANKS, TARGET_S = 4, 8.0  # target: 4 ranks under 8 s on the 2-core machine


def first_step_latency(cfg) -> tuple[float, float]:
    """Seconds from launch(cfg) to the first visible step event, and that step's own step_s."""
    from distlab import launch

    t0 = time.perf_counter()
    run = launch(cfg)
    while not run.history("step"):
        if run.done:
            run.wait()  # raises the run's error; a run that ends without steps is a bug
            raise RuntimeError(f"run {run.dir} ended without a step event")
        time.sleep(0.005)
    latency = time.perf_counter() - t0
    step0 = max(e["step_s"] for e in run.history("step") if e["step"] == 0)
    run.wait(timeout=120)
    return latency, step0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="launches per world size (default 3)")
    p.add_argument("--steps", type=int, default=50, help="steps of the single run (default 50)")
    args = p.parse_args(argv)

    root = tempfile.mkdtemp(prefix="distlab-latency-")
    os.environ["DISTLAB_RUNS"] = root
    try:
        from distlab import RunConfig, launch

        print(f"launch(cfg) -> first step event visible in the caller; median of {args.repeats} "
              f"(cpu cores: {os.cpu_count()})\n")
        header = f"{'ranks':>5}  {'median s':>8}  {'all repeats (s)':<24}  {'step 0 s':>8}  target"
        print(header + "\n" + "-" * len(header))
        for world in (1, 2, 4):
            cfg = RunConfig(strategy="single" if world == 1 else "allreduce", world_size=world,
                            steps=3, name=f"latency-w{world}")
            got = [first_step_latency(cfg) for _ in range(args.repeats)]
            lat = [g[0] for g in got]
            med = statistics.median(lat)
            target = ""
            if world == TARGET_RANKS:
                verdict = "met" if med < TARGET_S else "MISSED"
                target = f"{TARGET_RANKS} ranks under {TARGET_S:g} s on the 2-core machine: {verdict}"
            print(f"{world:>5}  {med:>8.2f}  {', '.join(f'{v:.2f}' for v in lat):<24}  "
                  f"{statistics.median(g[1] for g in got):>8.3f}  {target}", flush=True)

        cfg = RunConfig(steps=args.steps, name="latency-single-steps")
        run = launch(cfg, block=True)
        step_s = [e["step_s"] for e in run.history("step")]
        info = f"{run.info('n_params'):,} params, batch {cfg.global_batch}x{cfg.seq_len}, {cfg.optimizer}"
        print(f"\nstep time of `single` (default RunConfig: {info}; {len(step_s)} steps, "
              f"{run.info('threads')} threads):")
        print(f"  median {statistics.median(step_s) * 1e3:.1f} ms   "
              f"min {min(step_s) * 1e3:.1f} ms   max {max(step_s) * 1e3:.1f} ms   "
              f"first step {step_s[0] * 1e3:.1f} ms")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
