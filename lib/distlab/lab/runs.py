"""Running several configs as one launch, and comparing what they trained.

Bringing up ranks costs seconds (1.4 / 2.0 / 3.4 s for 1 / 2 / 4 ranks measured on a 2-core
machine; benchmarks/launch_latency.py prints this machine's), far more than a short run of a small model, so configs
with the same number of processes train one after another in one launch
(distlab.rank.train.train_with_state), and the launch's event log is cut back into one Run per config.

    runs = launch_together({"single": cfg, "dp": cfg.replace(strategy="dp", world_size=4)})
    runs["dp"].history("step")        # a Run per config, as if each had been launched alone
    runs["dp"].states[0]              # and each rank's final parameters
"""

from __future__ import annotations

import statistics
from typing import Callable

from distlab.config import RunConfig
from distlab.caller.launch import new_run_dir, run_ranks, runs_root
from distlab.caller.run import Run
from distlab.parallel.state import CheckpointError


def launch_together(cfgs: dict[str, RunConfig], name: str = "together",
                    wall_timeout_s: float | None = None,
                    on_start: Callable[[Run], None] | None = None) -> dict[str, Run]:
    """Train every config in turn in ONE launch and return {name: Run}, each Run holding only
    its own config's events (finished, nothing left running) plus `states`: each rank's final
    state_dict (under single's names: Strategy.full_state_dict). All configs must need the same
    number of processes; the launch uses the largest timeout_s and the first config's
    threads_per_rank. A failing config raises RunError, like Run.wait().

    on_start(run): called with the whole launch's live Run as soon as its ranks started (its
    progress_line counts the steps of every config; run.stop() ends it, and this call then
    raises distlab.caller.run.RunStopped)."""
    cfgs = dict(cfgs)
    worlds = {c.processes for c in cfgs.values()}
    if len(worlds) != 1:
        raise ValueError(f"launch_together needs configs with the same number of processes; "
                         f"got {sorted(worlds)} for {list(cfgs)}")
    (world,) = worlds
    from distlab.rank.train import train_with_state

    first = next(iter(cfgs.values()))
    run_dir = new_run_dir(runs_root(first.runs_root), f"{name}-w{world}")
    each = [steps_to_train(c) for c in cfgs.values()]

    def started(run: Run):
        run.total_steps = sum(each)  # rank 0 logs every config's steps in turn
        run.config_steps = each  # the line says which runs
        if on_start is not None:
            on_start(run)

    results = run_ranks(train_with_state, world, [c.to_dict() for c in cfgs.values()],
                        timeout_s=max(c.timeout_s for c in cfgs.values()),
                        threads=first.threads_per_rank, run_dir=run_dir,
                        wall_timeout_s=wall_timeout_s, on_start=started)
    events = split_configs(Run.load(run_dir).events, len(cfgs))
    runs = {}
    for i, (label, cfg) in enumerate(cfgs.items()):
        run = Run(run_dir, cfg=cfg)
        run.events = events[i]
        run.status = "done"
        run.states = [results[r][i]["state"] for r in range(world)]
        runs[label] = run
    return runs


def steps_to_train(cfg) -> int:
    """The steps a config trains: all of them, or those after the checkpoint it resumes (its
    meta says how many were done; "auto" resolves when the ranks start, so it counts all)."""
    from distlab.checkpoint.store import read_meta, resolve
    if not cfg.resume_from or cfg.resume_from == "auto":
        return cfg.steps
    try:
        return cfg.steps - read_meta(resolve(cfg.resume_from, ""))["steps_done"]
    except (CheckpointError, OSError):
        return cfg.steps  # the ranks will say what is wrong with it


def split_configs(events: list[dict], n_configs: int) -> list[list[dict]]:
    """Events of a launch that trained several configs in turn (distlab.rank.train.train_with_state),
    one list per config: each rank's events are cut at its "start" events."""
    out: list[list[dict]] = [[] for _ in range(n_configs)]
    index: dict[int, int] = {}
    for e in sorted(events, key=lambda e: (e["rank"], e["time"])):
        if e["kind"] == "start":
            index[e["rank"]] = index.get(e["rank"], -1) + 1
        i = index.get(e["rank"], -1)
        if 0 <= i < n_configs:
            out[i].append(e)
    return out


def worst_param_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over every entry of two state_dicts with the same keys (buffers too)."""
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


def bytes_per_step(run: Run, kind: str, field: str = "bytes_sent", rank: int = 0) -> list:
    """One rank's bytes of one collective kind, step by step (0 where it did not use it)."""
    return [e.get("comm", {}).get(kind, {}).get(field, 0)
            for e in sorted(run.history("step", rank=rank), key=lambda e: e["step"])]


def median_step_change(losses: list[float]) -> float:
    """The median |loss[t+1] - loss[t]| of one curve: how far the loss moves in a step. A
    tolerance on the gap between two runs means something only if it sits well below this."""
    return statistics.median(abs(b - a) for a, b in zip(losses, losses[1:]))


def in_rank_step_order(events: list[dict]) -> list[dict]:
    """Step events sorted by (rank, step): the order in which two reads of one run compare equal
    (the ranks' log lines interleave differently from one read to the next)."""
    return sorted(events, key=lambda e: (e["rank"], e["step"]))


def max_step_loss_diff(a: list[float], b: list[float]) -> float:
    """Largest per-step difference of two loss curves of the same length."""
    if len(a) != len(b):
        raise ValueError(f"loss curves of different lengths: {len(a)} and {len(b)}")
    return max(abs(x - y) for x, y in zip(a, b))
