"""How long a notebook waits between Run and the first point on its live plot, and how long a step
of the default model takes.

    .venv/bin/python benchmarks/launch_latency.py [--repeats 3] [--steps 50]

For 1, 2, 4 and 8 ranks: the time from calling `launch(cfg)` until the first "step" event is
visible in the caller (`run.history("step")` non-empty; the run's monitor thread reads the event
logs every distlab.caller.run.POLL_S = 0.1 s, so that is the resolution). It covers starting the
processes, rendezvous, building the model and data, and one training step. 1 rank runs strategy
"single", the others "allreduce".

    cold   the first launch of a fresh Python process (a kernel's first Run): it starts the fork
           server, which imports torch and distlab once (distlab.caller.launch.rank_context); one
           fresh process per figure, median over --repeats
    warm   every later launch in the same process: ranks are forked from that server, with
           torch already imported; median over --repeats
    spawn  DISTLAB_START=spawn, the old way: every rank a fresh interpreter importing torch

Then the step time of `single`: the median step_s over the step events of one --steps-step run of
the default RunConfig (model, batch, optimizer).

Runs go to a temporary DISTLAB_RUNS folder, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_RANKS, TARGET_S = 4, 1.5  # target: a warm launch of 4 ranks within 1.5 s (2 cores)
WORLDS = (1, 2, 4, 8)


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


def config(world: int):
    from distlab import RunConfig
    return RunConfig(strategy="single" if world == 1 else "allreduce", world_size=world,
                     global_batch=16 if world < 8 else 32, steps=3, name=f"latency-w{world}")


def cold_latency(world: int, start: str = "forkserver") -> float:
    """first_step_latency of the first launch in a new Python process."""
    code = ("import sys; sys.path.insert(0, %r); import launch_latency as b; "
            "print(b.first_step_latency(b.config(%d))[0])" % (os.path.dirname(__file__), world))
    env = {**os.environ, "DISTLAB_START": start}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="launches per world size (default 3)")
    p.add_argument("--steps", type=int, default=50, help="steps of the single run (default 50)")
    args = p.parse_args(argv)

    root = tempfile.mkdtemp(prefix="distlab-latency-")
    os.environ["DISTLAB_RUNS"] = root
    try:
        from distlab import RunConfig, launch

        print(f"launch(cfg) -> first step event visible in the caller, seconds; median of "
              f"{args.repeats} (cpu cores: {os.cpu_count()})\n")
        header = (f"{'ranks':>5}  {'cold':>6}  {'warm':>6}  {'spawn':>6}  "
                  f"{'warm, every repeat':<24}  target")
        print(header + "\n" + "-" * len(header))
        first_step_latency(config(1))  # this process's fork server: started here, not below
        for world in WORLDS:
            cold = statistics.median(cold_latency(world) for _ in range(args.repeats))
            spawn = statistics.median(cold_latency(world, "spawn") for _ in range(args.repeats))
            warm = [first_step_latency(config(world))[0] for _ in range(args.repeats)]
            med = statistics.median(warm)
            target = ""
            if world == TARGET_RANKS:
                verdict = "met" if med <= TARGET_S else "MISSED"
                target = f"warm {TARGET_RANKS} ranks within {TARGET_S:g} s: {verdict}"
            print(f"{world:>5}  {cold:>6.2f}  {med:>6.2f}  {spawn:>6.2f}  "
                  f"{', '.join(f'{v:.2f}' for v in warm):<24}  {target}", flush=True)

        cfg = RunConfig(steps=args.steps, name="latency-single-steps")
        run = launch(cfg, block=True)
        step_s = [e["step_s"] for e in run.history("step")]
        info = (f"{run.info('n_params'):,} params, batch {cfg.global_batch}x{cfg.seq_len}, "
                f"{cfg.optimizer}")
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
