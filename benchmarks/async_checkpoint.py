"""How long a save blocks the step: synchronous against asynchronous (checkpoint_async), the
figure issue 47 asks for.

    .venv/bin/python benchmarks/async_checkpoint.py [--repeats 3] [--steps 8]
                                                    [--strategies ddp,tp,pp]

The workbook's largest GPT trained here (03's: 4 blocks, width 512, AdamW, so a checkpoint is
the model and two moments, ~150 MB) under ddp on 2 ranks, saving every 2 steps, once with
synchronous saves and once with asynchronous ones, --repeats times each. Printed: each periodic
save's blocked seconds (the step waits for them: the whole save, or the staging copy), the
background writes' seconds, and `async / sync <ratio>` of the median blocked times. Target:
at most 0.10. Exit status 0 when met; the runs and checkpoints go to a temporary folder,
removed at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from _bench import scratch_runs

TARGET = 0.10


DEGREES = {"tp": {"tp": 2}, "pp": {"pp": 2}}  # on the 2 ranks


def blocked(strategy: str, steps: int, background: bool,
            root: str) -> tuple[list[float], list[float]]:
    """(blocked seconds of each periodic save on rank 0, the background writes' seconds)."""
    from distlab import RunConfig, launch
    cfg = RunConfig(strategy=strategy, world_size=2, steps=steps, n_layer=4, n_embd=512,
                    n_head=8, seq_len=64, global_batch=8, optimizer="adamw", checkpoint_every=2,
                    keep_last=1, checkpoint_dir=root, checkpoint_async=background,
                    timeout_s=300, **DEGREES.get(strategy, {}))
    run = launch(cfg).wait()
    saves = [e for e in run.history("checkpoint", rank=0) if e["reason"] == "periodic"]
    return ([e["seconds"] for e in saves],
            [e["write_s"] for e in run.history("checkpoint_written", rank=0)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--strategies", default="ddp",
                    help="comma-separated: ddp, tp, pp (they save the full format; tp and pp "
                         "gather their blocks and stages while the step waits)")
    args = ap.parse_args()
    met = True
    for strategy in args.strategies.split(","):
        print(f"{strategy}:")
        met &= measure(strategy, args.repeats, args.steps)
    return 0 if met else 1


def measure(strategy: str, repeats: int, steps: int) -> bool:
    root = os.environ["DISTLAB_RUNS"]
    got = {"sync": [], "async": [], "written": []}
    for i in range(repeats):
        for name in ("sync", "async"):
            secs, written = blocked(strategy, steps, name == "async",
                                    os.path.join(root, f"{strategy}-{name}{i}"))
            got[name] += secs
            got["written"] += written
    for name in ("sync", "async"):
        s = got[name]
        print(f"{name:>5}: blocked {statistics.median(s):.3f} s median (min {min(s):.3f}, max "
              f"{max(s):.3f}) over {len(s)} periodic saves")
    w = got["written"]
    print(f"async: written in the background in {statistics.median(w):.3f} s median (min "
          f"{min(w):.3f}, max {max(w):.3f})")
    ratio = statistics.median(got["async"]) / statistics.median(got["sync"])
    print(f"async / sync {ratio:.3f}   target: at most {TARGET}: "
          f"{'met' if ratio <= TARGET else 'NOT met'}")
    return ratio <= TARGET

if __name__ == "__main__":
    with scratch_runs(__file__, "distlab-bench-async-ckpt-") as bench:
        sys.exit(bench.main())
