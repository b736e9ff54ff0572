"""Caller-side helpers of the checkpoints notebook (workbook/09_checkpoints_and_faults): the fault
drills' curves, torchrun's command line for a RunConfig, what a checkpoint holds and what saving
it cost each rank, and a damaged checkpoint with the errors it gives.

Nothing here runs inside a rank; it reads what the runs logged and what the checkpoints hold.

    first = launch(cfg.replace(fault="kill", fault_rank=1, fault_step=7))   # dies: RunError
    again = distlab.resume(first).wait()                                    # from its latest
    drill_figure(reference, first, again, "SIGKILL at step 7").show()
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import plotly.graph_objects as go
import psutil
from plotly.subplots import make_subplots

from distlab.checkpoint import (CheckpointError, checkpoint_root, latest_checkpoint,
                                list_checkpoints, load_full, read_meta)
from distlab.config import RunConfig
from distlab.lab.common import RUN_COLORS as COLORS, byte_unit
from distlab.events import LogTail, rank_log_path
from distlab.caller.launch import launch
from distlab.caller.flags import cli_args
from distlab.caller.run import Run, RunError


# -- torchrun ----------------------------------------------------------------------------------
def torchrun(cfg: RunConfig, run_dir: str, max_restarts: int = 1,
             timeout_s: float = 240) -> subprocess.CompletedProcess:
    """Run cfg under `torchrun --standalone --nproc_per_node=world_size --max-restarts=N -m
    distlab`, as on a cluster node, and wait for it. Its workers write their events in run_dir;
    a worker torchrun restarts appends to the same rank<r>.jsonl."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={cfg.world_size}", f"--max-restarts={max_restarts}",
           "--monitor-interval=0.2", "-m", "distlab", *cli_args(cfg), "--run-dir", run_dir]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def attempts(run_dir: str, rank: int = 0) -> list[list[dict]]:
    """A rank's events cut at each "start": one list per worker process torchrun started, or
    per config of a launch that trained several in turn."""
    out: list[list[dict]] = []
    for e in LogTail(rank_log_path(run_dir, rank)).read_all():
        if e["kind"] == "start":
            out.append([])
        if out:
            out[-1].append(e)
    return out


def attempt_rows(tries: list[list[dict]]) -> list[list]:
    """One row per worker process of attempts(): its index, its pid, the steps done it resumed
    from ("fresh" if it did not resume), the steps it ran, and how it ended (its first "error"
    or "done" event; "?" if neither came)."""
    rows = []
    for i, evs in enumerate(tries):
        steps = [e["step"] for e in evs if e["kind"] == "step"]
        res = [e["steps_done"] for e in evs if e["kind"] == "resume"]
        end = next((e["kind"] for e in evs if e["kind"] in ("error", "done")), "?")
        rows.append([i, evs[0]["pid"], res[0] if res else "fresh",
                     f"{steps[0]}..{steps[-1]}", end])
    return rows


# -- the drills ------------------------------------------------------------------------------------
def saved_steps(root: str) -> list[int]:
    """Steps done of each complete checkpoint under a checkpoint folder, oldest first."""
    return [n for n, _ in list_checkpoints(root)]


def final_checkpoint(run: Run) -> dict:
    """The latest complete checkpoint of a run, read whole (distlab.checkpoint.load_full)."""
    return load_full(latest_checkpoint(checkpoint_root(run.cfg, run.dir)))


def failed_run(cfg: RunConfig, timeout_s: float = 300.0) -> tuple[Run, RunError]:
    """Launch a drill that must fail (an injected fault) and return the run with its RunError.
    A run that finishes instead is itself a failed drill: AssertionError."""
    run = launch(cfg)
    try:
        run.wait(timeout=timeout_s)
    except RunError as e:
        return run, e
    raise AssertionError(f"fault={cfg.fault!r} at step {cfg.fault_step}: the run finished "
                         "without the failure the drill injects")


def wait_for_steps(run: Run, n: int, timeout_s: float = 120.0) -> Run:
    """Block until every rank of a live run has logged n steps."""
    deadline = time.time() + timeout_s
    while run.steps_done() < n:
        if run.done or time.time() > deadline:
            raise RuntimeError(f"run {run.dir} ended or stalled before {n} steps: {run.status}")
        time.sleep(0.05)
    return run


def detect_seconds(run: Run) -> float:
    """Seconds from a killed rank's `fault` event to the run's end (the caller's RunError)."""
    return run.ended - run.history("fault")[0]["time"]


def kill_drill(cfg: RunConfig, rank: int, step: int) -> tuple[Run, RunError, bool]:
    """One SIGKILL drill (fault="kill" of `rank` at the start of `step`): the run, its
    RunError, and whether it was reported as it should be (that rank, that step, SIGKILL) with
    no process left."""
    run, err = failed_run(cfg.replace(fault="kill", fault_rank=rank, fault_step=step))
    ok = err.rank == rank and err.step == step and "SIGKILL" in err.message
    return run, err, ok and not alive(run.pids)


def dead_rank_claim(reported: bool, detect_s: list[float], bound_s: float = 10.0) -> dict:
    """"A dead rank is reported, not hung on", timed: every drill reported (`reported`), and
    the seconds from the kill to the caller's RunError under `bound_s` over the drills
    (distlab.lab.timed.within; one drill leaves it undecided)."""
    from distlab.lab.timed import all_of, timed_claim, within
    return timed_claim(
        "a dead rank is reported, not hung on", "distlab.caller.launch; "
        "tests/test_process_safety.py", all_of(reported, within(detect_s, hi=bound_s)),
        {"SIGKILL to the caller's RunError": detect_s}, scale=1, unit="s", digits=2,
        interleaved_=False,
        note=f"every drill named the rank and the step and left no process: {reported}; "
             f"yes needs under {bound_s:g} s")


def alive(pids) -> list[int]:
    """The pids still running (a zombie counts as gone only once reaped: it counts as alive)."""
    return [p for p in pids if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over every tensor two checkpoints hold (load_full(...)["tensors"]); they
    must hold the same keys and shapes."""
    if a.keys() != b.keys():
        raise ValueError(f"different keys: {sorted(a.keys() ^ b.keys())[:5]}")
    return max(((x.double() - b[k].double()).abs().max().item() if x.numel() else 0.0)
               for k, x in a.items())


def final_checkpoint_diff(run: Run, reference: Run) -> float:
    """max_abs_diff over every tensor of two runs' final checkpoints: 0.0 when a resumed run
    ended bit for bit where the uninterrupted one did."""
    return max_abs_diff(final_checkpoint(run)["tensors"], final_checkpoint(reference)["tensors"])


def steps_losses(run: Run) -> tuple[list[int], list[float]]:
    """(steps, mean loss over ranks) of the steps a run logged: a resumed run starts late."""
    steps = sorted({e["step"] for e in run.history("step")})
    return steps, run.losses()


def drill_figure(reference: Run, first: Run, resumed: Run, title: str) -> go.Figure:
    """The uninterrupted run's loss, the interrupted run's up to where it stopped, and the
    resumed run's from its checkpoint on: the last retraces the first exactly (open rings
    around its points keep it visible on top of the other two)."""
    fig = go.Figure()
    for i, (label, run, width, dash) in enumerate((
            ("uninterrupted", reference, 6, None), ("interrupted", first, 3, None),
            ("resumed from the checkpoint", resumed, 2, "dot"))):
        x, y = steps_losses(run)
        marker = (dict(size=11, symbol="circle-open", line=dict(width=2.5)) if run is resumed
                  else dict(size=5))
        fig.add_scatter(x=x, y=y, mode="lines+markers", name=label, marker=marker,
                        line=dict(color=COLORS[i], width=width, dash=dash))
    start = resumed.history("resume")[0]["steps_done"]
    fig.add_vline(x=start - 0.5, line_dash="dash", line_color="#555",
                  annotation_text=f"checkpoint: {start} steps done", annotation_position="top")
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="loss (nats)", height=340,
                      template="plotly_white")
    return fig


# -- what a checkpoint holds, and what it cost -------------------------------------------------
def contents_rows(tensors: dict, meta: dict) -> list[list]:
    """One row per group of stored tensors (model, optimizer state by kind, loss scaler):
    count, elements, bytes; from load_full(path)."""
    groups: dict[str, list] = {}
    for key, t in tensors.items():
        parts = key.split("/")
        if parts[0] in ("model", "frozen", "buffer", "scaler"):
            group = parts[0]
        elif "param_groups" in parts:
            group = "optimizer: param_groups (lr, betas, eps, ...)"
        else:  # optimizer state by kind: exp_avg, exp_avg_sq, step
            group = f"optimizer: {parts[-1]}"
        g = groups.setdefault(group, [0, 0, 0])
        g[0] += 1
        g[1] += t.numel()
        g[2] += t.numel() * t.element_size()
    return [[meta["strategy"], meta["format"], k, n, f"{e:,}", f"{b:,}"]
            for k, (n, e, b) in sorted(groups.items())]


def overhead_row(tensors: dict, meta: dict) -> list:
    """Tensor bytes against the bytes of the state files on disk (RNG files left out): what
    the format adds. DCP stores each tensor as a record of its own."""
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    disk = sum(r["bytes"] for rel, r in meta["files"].items() if not rel.startswith("rng/"))
    return [meta["strategy"], len(tensors), f"{data:,}", f"{disk:,}",
            f"{(disk - data) / len(tensors):,.0f}"]


def file_rows(meta: dict) -> list[list]:
    """Each file of a checkpoint: who wrote it and its size (from meta.json)."""
    return [[meta["strategy"], rel, rec["rank"], f"{rec['bytes']:,}"]
            for rel, rec in sorted(meta["files"].items())]


def reshard_row(saved: str, resumed: Run, diff: float) -> list:
    """One row of the resharding table: the strategy that wrote the checkpoint at `saved`, its
    shard files (.distcp), the ranks that saved it (as the resumed run read it), the strategy
    and ranks that resumed it, and the worst parameter diff given."""
    meta = read_meta(saved)
    shards = [rel for rel in meta["files"] if rel.endswith(".distcp")]
    return [meta["strategy"], len(shards), resumed.history("resume")[0]["saved_world_size"],
            resumed.cfg.strategy, resumed.cfg.world_size, f"{diff:.1e}"]


def save_cost(runs: dict[str, Run]) -> dict[str, dict[int, dict]]:
    """{label: {rank: {"bytes": per save, "seconds": median per save}}} from "checkpoint"
    events (the final save included)."""
    out: dict[str, dict[int, dict]] = {}
    for label, run in runs.items():
        for rank in range(run.world_size):
            evs = run.history("checkpoint", rank=rank)
            secs = sorted(e["seconds"] for e in evs)
            out.setdefault(label, {})[rank] = {"bytes": evs[-1]["bytes"],
                                               "seconds": secs[len(secs) // 2], "saves": len(evs)}
    return out


def save_cost_figure(cost: dict[str, dict[int, dict]]) -> go.Figure:
    """Bytes each rank wrote per checkpoint, and the seconds a save stalled training, per rank:
    full (rank 0 writes everything) beside sharded (each rank its part)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("bytes written per save, by rank",
                                                        "seconds per save (median), by rank"))
    scale, unit = byte_unit([v["bytes"] for ranks in cost.values() for v in ranks.values()])
    for i, (label, ranks) in enumerate(cost.items()):
        x = [f"rank {r}" for r in ranks]
        for col, key, div in ((1, "bytes", scale), (2, "seconds", 1)):
            fig.add_bar(x=x, y=[v[key] / div for v in ranks.values()], name=label, row=1,
                        col=col, marker_color=COLORS[i % len(COLORS)], showlegend=col == 1,
                        legendgroup=label, customdata=[v[key] for v in ranks.values()],
                        hovertemplate=f"{label}, %{{x}}: " + (
                            f"%{{y:.3g}} {unit} (%{{customdata:,}} bytes)" if key == "bytes"
                            else "%{y:.3f} s") + "<extra></extra>")
    fig.update_yaxes(title_text=f"written per save ({unit})", row=1, col=1)
    fig.update_yaxes(title_text="seconds per save", row=1, col=2)
    fig.update_layout(barmode="group", height=360, template="plotly_white",
                      title="What one checkpoint costs each rank")
    return fig


# -- a bad checkpoint --------------------------------------------------------------------------
def flip_byte(path: str, offset: int = 1000) -> None:
    """Invert one byte of a file in place, its size unchanged, as a bad disk or a faulty copy
    would: only a checksum (meta.json's CRC-32) can tell."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def checkpoint_errors(attempts, hide: str, limit: int = 300) -> list[str]:
    """The CheckpointError message of each call in `attempts` that raises one (a call that
    succeeds adds none), with `hide` (a long run folder) shown as "…" and each cut at `limit`
    characters: what the reader needs of it is the first lines."""
    messages = []
    for attempt in attempts:
        try:
            attempt()
        except CheckpointError as e:
            msg = str(e).replace(hide, "…")
            messages.append(msg if len(msg) <= limit else msg[:limit] + " …")
    return messages
