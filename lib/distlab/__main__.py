"""Command line: `python -m distlab --strategy allreduce --world-size 2 --steps 50`.

Under torchrun the same `train` runs with env:// rendezvous, one process per rank:

    torchrun --nproc_per_node=2 -m distlab --strategy allreduce --steps 50 --run-dir runs/x

Without torchrun's environment it launches the ranks itself, as a notebook would.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys

from distlab.config import SECTIONS, RunConfig
from distlab.config.declare import declared


def parse_config(argv) -> tuple[dict, str | None, int]:
    """RunConfig's fields from the command line, and this command's own two flags."""
    args = vars(parser().parse_args(argv))
    return args, args.pop("run_dir"), args.pop("log_every")


def parser() -> argparse.ArgumentParser:
    """One flag per RunConfig field, grouped by section (distlab.config.SECTIONS), each with
    its declared help, choices and default; then this command's own."""
    p = argparse.ArgumentParser(prog="python -m distlab", description=__doc__,
                                usage="%(prog)s [--field VALUE | --flag | --no-flag ...]",
                                formatter_class=_Help)
    for title, section in SECTIONS.items():  # one group per section, its fields in order
        group = p.add_argument_group(title, inspect.getdoc(section))
        for f in dataclasses.fields(section):
            _add_field(group, f)
    mine = p.add_argument_group("this command")
    mine.add_argument("--run-dir", default=None, help="folder for the run's events")
    mine.add_argument("--log-every", type=int, default=10,
                      help="print progress every this many steps (0: only the final JSON line)")
    return p


def _add_field(group, f) -> None:
    """A RunConfig field as a flag: --seq-len 64; a bool as --sp / --no-sp. Its help, choices
    and default are the field's declaration; RunConfig checks the value (choices are shown,
    not enforced here, so every refusal reads the same)."""
    d = declared(f)
    flag = "--" + f.name.replace("_", "-")
    help = d.help.replace("%", "%%")  # argparse formats help with %
    if f.type in ("bool", bool):
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                           help=help)
        return
    choices = d.options()
    metavar = "{" + ",".join(str(c) or "''" for c in choices) + "}" if choices else None
    kind = {"int": int, "float": float, "str": str}[str(f.type)]
    group.add_argument(flag, type=kind, default=f.default, metavar=metavar, help=help)


class _Help(argparse.RawDescriptionHelpFormatter):
    """The module's docstring as written, and each flag's default after its help."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)r)"


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
