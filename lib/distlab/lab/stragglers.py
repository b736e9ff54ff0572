"""Stragglers: one slow worker, and three answers to it, run side by side.

A synchronous step is as slow as its slowest rank: with `allreduce` (or `ps-sync` without backup
workers) every step waits for the straggler's gradient. Two answers:

* backup workers (Chen et al. 2016): run N+b workers and use the first N gradients of each step;
  the slowest b are dropped, so the step no longer waits for them (`ps-sync`, backup_workers=b).
* asynchrony (Dean et al. 2012): apply each gradient when it comes (`ps-async`); nobody waits,
  but the straggler's gradients are stale by the number of updates made meanwhile.

    rows = compare(straggler_configs(base, workers=2, delay_s=0.3))   # one launch per config
    table(rows)

Each row is measured from the run's events: `update_s` is the median time between updates of
the model (for ps-async an update applies one worker's gradient, and since every worker does
cfg.steps steps, the fast workers finish early and the straggler's slow updates fill the end of
the run: read its `worker_step_s`), `worker_step_s` the median step time of the workers that are
not the straggler, `straggler_step_s` the straggler's, plus gradients used per update, gradients
dropped and the staleness the server recorded; `update_samples_s` keeps every time between
updates after the first, the repeats a timed claim reads (distlab.lab.timed).
"""

from __future__ import annotations

import statistics

from distlab.config import RunConfig
from distlab.parallel import strategy_class


def straggler_configs(base: RunConfig, workers: int = 2, delay_s: float = 0.3,
                      backup_workers: int = 1) -> dict[str, RunConfig]:
    """The four runs to compare, each with `workers` gradients per update (N) and the last
    worker rank sleeping `delay_s` per step: allreduce (N ranks), ps-sync (1+N), ps-sync with
    backup workers (1+N+b), ps-async (1+N)."""
    def slow(cfg):  # the last rank is a worker in every layout (rank 0 is a server in ps)
        return cfg.replace(straggler_rank=cfg.world_size - 1, straggler_delay_s=delay_s)
    return {
        "allreduce": slow(base.replace(strategy="allreduce", world_size=workers)),
        "ps-sync": slow(base.replace(strategy="ps-sync", world_size=workers + 1)),
        f"ps-sync + {backup_workers} backup": slow(base.replace(
            strategy="ps-sync", world_size=workers + 1 + backup_workers,
            backup_workers=backup_workers)),
        "ps-async": slow(base.replace(strategy="ps-async", world_size=workers + 1)),
    }


def summarize_events(events: list[dict], cfg: RunConfig) -> dict:
    """Step times, gradients used/dropped and staleness of one run, from its events."""
    med = statistics.median
    steps = [e for e in events if e["kind"] == "step"]
    server = [e for e in steps if e.get("role") == "server"]
    workers = [e for e in steps if e.get("role") != "server"]
    straggler = cfg.straggler_rank
    row = {"strategy": cfg.strategy, "world_size": cfg.world_size, "workers":
           cfg.processes - strategy_class(cfg.strategy).servers,
           "grads_per_update": 1 if getattr(strategy_class(cfg.strategy), "ASYNC", False)
           else cfg.dp_degree,
           "backup_workers": cfg.backup_workers, "straggler_rank": straggler,
           "delay_s": cfg.straggler_delay_s if straggler >= 0 else 0.0}
    if server:
        intervals = [e["step_s"] for e in server]
    else:  # every rank takes part in every update: the update takes as long as the slowest
        by_step: dict[int, float] = {}
        for e in workers:
            by_step[e["step"]] = max(by_step.get(e["step"], 0.0), e["step_s"])
        intervals = [by_step[s] for s in sorted(by_step)]
    row["update_s"] = med(intervals) if intervals else None
    # how much the time between updates varies (the first update warms up): the noise a
    # straggler's delay must stand out from
    later = intervals[1:]
    row["update_spread_s"] = max(later) - min(later) if len(later) >= 2 else None
    row["update_samples_s"] = later  # one per update after the first: a timed row's repeats
    fast = [e["step_s"] for e in workers if e["rank"] != straggler]
    slow = [e["step_s"] for e in workers if e["rank"] == straggler]
    row["worker_step_s"] = med(fast) if fast else None
    row["straggler_step_s"] = med(slow) if slow else None
    done = [e for e in events if e["kind"] == "server_done"]
    if done:
        d = done[0]
        row.update(updates=d["updates"], used=d["used"], dropped=d["dropped"],
                   staleness_mean=d["staleness_mean"], staleness_max=d["staleness_max"])
        row["used_per_update"] = sorted({e["grads_used"] for e in server})
    else:
        row.update(updates=len(intervals), used=len(workers), dropped=0,
                   staleness_mean=0.0, staleness_max=0)
    by_step: dict[int, list[float]] = {}
    for e in workers:
        if e.get("loss") is not None:
            by_step.setdefault(e["step"], []).append(e["loss"])
    losses = [sum(v) / len(v) for _, v in sorted(by_step.items())]
    row["first_loss"] = losses[0] if losses else None
    row["final_loss"] = sum(losses[-3:]) / len(losses[-3:]) if losses else None
    return row


def summarize(run) -> dict:
    """summarize_events for a finished Run (launch(cfg) or Run.load(folder))."""
    row = summarize_events(run.events, run.cfg)
    if run.ended is not None:
        row["wall_s"] = run.ended - run.started
    return row


def compare(cfgs: dict[str, RunConfig]) -> list[dict]:
    """Launch each config in turn (one launch each: their world sizes differ), wait, and
    summarize. Runs one at a time, so they do not share the cores."""
    from distlab.caller.launch import launch
    rows = []
    for name, cfg in cfgs.items():
        run = launch(cfg.replace(name=cfg.name or name.replace(" ", "")), block=True)
        rows.append({"name": name, **summarize(run), "run": run})
    return rows


def summary_text(rows: list[dict]) -> str:
    """The comparison as text (a notebook may prefer pandas.DataFrame(rows))."""
    cols = [("name", "{}"), ("world_size", "{}"), ("grads_per_update", "{}"),
            ("update_s", "{:.3f}"), ("worker_step_s", "{:.3f}"),
            ("straggler_step_s", "{:.3f}"), ("dropped", "{}"), ("staleness_mean", "{:.2f}"),
            ("staleness_max", "{}"), ("final_loss", "{:.3f}")]
    head = " | ".join(c for c, _ in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(" | ".join("-" if r.get(c) is None else f.format(r[c]) for c, f in cols))
    return "\n".join(lines)
