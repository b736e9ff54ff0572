"""Command line: `python -m distlab --strategy allreduce --world-size 2 --steps 50`.

Under torchrun the same `train` runs with env:// rendezvous, one process per rank:

    torchrun --nproc_per_node=2 -m distlab --strategy allreduce --steps 50 --run-dir runs/x

Without torchrun's environment it launches the ranks itself, as a notebook would.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from distlab.config import RunConfig


def parse_config(argv) -> tuple[dict, str | None, int]:
    p = argparse.ArgumentParser(prog="python -m distlab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(RunConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            p.add_argument(flag, type=kind, default=f.default)
    p.add_argument("--run-dir", default=None, help="folder for the run's events")
    p.add_argument("--log-every", type=int, default=10,
                   help="print progress every this many steps (0: only the final JSON line)")
    args = vars(p.parse_args(argv))
    return args, args.pop("run_dir"), args.pop("log_every")


def main(argv=None) -> int:
    from distlab.models import factory
    from distlab.caller.launch import launch, rank_body, runs_root
    from distlab.caller.progress import train_rank_with_progress
    from distlab.caller.run import RunError

    fields, run_dir, every = parse_config(sys.argv[1:] if argv is None else argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        fields["world_size"] = world
        cfg = RunConfig(**fields)
        if factory.is_spec(cfg.model):  # a clean error from every rank, before rendezvous
            factory.check(cfg)
        run_dir = os.path.abspath(run_dir or os.path.join(
            runs_root(cfg.runs_root), "torchrun-" + os.environ.get("TORCHELASTIC_RUN_ID", "job")))
        os.makedirs(run_dir, exist_ok=True)
        if rank == 0:
            with open(os.path.join(run_dir, "config.json"), "w") as f:
                f.write(cfg.to_json())
        spec = {"fn": train_rank_with_progress, "args": (cfg.to_dict(), every),
                "run_dir": run_dir, "backend": cfg.backend, "device": cfg.device,
                "timeout_s": cfg.timeout_s, "threads": cfg.threads_per_rank, "debug": cfg.debug}
        rank_body(rank, world, spec, {"env": True})  # exits non-zero on failure
        sys.stdout.flush()
        os._exit(0)  # logged and flushed: skip teardown (see launch._spawned_rank)
    try:
        cfg = RunConfig(**fields)
        run = launch(cfg, block=True, run_dir=run_dir and os.path.abspath(run_dir),
                     progress_every=every)
    except (RunError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    losses = run.losses()
    print(json.dumps({"run_dir": run.dir, "steps": len(losses), "first_loss": losses[0],
                      "final_loss": losses[-1]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
