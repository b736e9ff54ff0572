"""Nothing kills a run's monitor: a run folder deleted while the run goes on, or a line in an
event log that is not JSON. The ranks and the caller keep their state, wait() returns the real
outcome with every step the ranks reported, and the problem is reported once, as a warning."""

import shutil
import time
import warnings

import pytest

from distlab import RunConfig, launch
from distlab.events import rank_log_path

TINY = dict(global_batch=4, seq_len=8, n_layer=1, n_embd=16, n_head=2, timeout_s=30)


def _wait_for_steps(run, n):
    deadline = time.time() + 60
    while run.steps_done() < n and time.time() < deadline:
        time.sleep(0.05)
    assert run.steps_done() >= n


def test_a_run_folder_deleted_mid_run_still_reports_every_step(tmp_path):
    cfg = RunConfig(strategy="allreduce", world_size=2, steps=30, step_delay_s=0.05,
                    runs_root=str(tmp_path), **TINY)
    run = launch(cfg)
    _wait_for_steps(run, 2)
    shutil.rmtree(run.dir)  # a user cleaning runs/
    with pytest.warns(RuntimeWarning, match="status.json") as seen:
        run.wait(timeout=120)
    assert run.status == "done" and run.error is None
    assert len(run.losses()) == 30  # the ranks' open files were read to their end
    run.wait()  # reported once: a second wait() warns no more
    assert len([w for w in seen if "status.json" in str(w.message)]) == 1


def test_a_corrupt_event_line_is_skipped_and_reported(tmp_path):
    cfg = RunConfig(strategy="allreduce", world_size=2, steps=20, step_delay_s=0.05,
                    runs_root=str(tmp_path), **TINY)
    run = launch(cfg)
    _wait_for_steps(run, 2)
    with open(rank_log_path(run.dir, 1), "a") as f:  # a line no rank wrote
        f.write("{not json\n")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run.wait(timeout=120)
    assert run.status == "done" and len(run.losses()) == 20
    assert any("not JSON" in str(w.message) and "rank1.jsonl" in str(w.message) for w in seen)


def test_wait_shows_a_live_progress_line(capsys):
    """Ranks starting, then step k/n with tokens/s, redrawn in place ("\\r"), ending on the
    outcome; a launch that trains several configs in turn counts all their steps."""
    run = launch(RunConfig(steps=4, n_layer=1, n_embd=16, n_head=2, seq_len=8, global_batch=4,
                           step_delay_s=0.4, timeout_s=60, threads_per_rank=1))
    run.wait(timeout=120, progress=True)
    out = capsys.readouterr().out
    assert out.startswith("\r") and out.endswith("\n")
    lines = [s.strip() for s in out.split("\r") if s.strip()]
    assert lines[-1].startswith("done: 4 steps in ") and "tokens/s" in lines[-1]
    assert any(s.startswith("step ") and "/4" in s for s in lines[:-1]) or \
        any(s.startswith("starting 1 rank") for s in lines[:-1]), lines
    from distlab.caller.run import Run
    # a finished run says how long it ran (4 steps of 0.4 s and more), not how long the
    # caller waited (before: a run waited on after it ended said "in 0.0 s")
    took = f"done: 4 steps in {run.ended - run.started:.1f} s"
    assert Run.load(run.dir).progress_line(2.0).startswith(took) and run.ended - run.started > 1.6
    import distlab.lab  # noqa: F401 - turns progress on in a notebook's kernel, not here
    quiet = launch(run.cfg.replace(step_delay_s=0.0)).wait(timeout=120)
    assert quiet.status == "done" and capsys.readouterr().out == ""  # off by default


def test_the_rate_counts_every_data_parallel_rank():
    # before: rank 0's tokens over its step, a quarter of ddp x 4's rate (issue 25: 1,525 tokens/s
    # shown against about 6,400)
    from distlab.caller.run import Run
    run = launch(RunConfig(strategy="ddp", world_size=2, steps=3, n_layer=1, n_embd=16,
                           n_head=2, seq_len=8, global_batch=4, timeout_s=60)).wait(timeout=120)
    last = run.history("step", rank=0)[-1]
    shown = Run.load(run.dir).progress_line(1.0)
    assert f"{2 * last['tokens'] / last['step_s']:,.0f} tokens/s" in shown, shown
    assert last["tokens"] == 2 * 8  # rank 0 read 2 of the 4 rows of 8 tokens


def _steps(n, tokens, step_s, t0=0.0):
    return [{"kind": "step", "rank": 0, "step": i, "tokens": tokens, "step_s": step_s,
             "time": t0 + i * step_s} for i in range(n)]


def test_the_progress_line_names_the_config_and_never_passes_its_total(tmp_path):
    """One launch training two configs in turn (launch_together): the line says which config
    runs, its own k/n and rate (before: one count over all configs, a rate that swung from
    2,591 to 22 tokens/s between models, and 'step 223/150 ETA -6 s' where a total was off)."""
    from distlab.caller.run import Run
    cfg = RunConfig(steps=5, global_batch=4, seq_len=8)
    run = Run(str(tmp_path), cfg=cfg)
    run._finished.clear()  # as a live run (a Run without processes reads as ended)
    run.config_steps = [5, 5]
    run.events = _steps(5, 32, 0.01) + _steps(3, 32, 0.5, t0=1.0)
    line = run.progress_line(3.0)
    assert line == "config 2/2: step 3/5, 64 tokens/s, ETA 1 s (3 s)", line  # 2 left x 0.5 s
    run.config_steps, run.total_steps = None, 4  # a total that is wrong: 8 steps logged
    assert run.progress_line(3.0).startswith("step 8, 64 tokens/s (3 s)")  # not 8/4
    run.config_steps = [5, 5]
    run.events += _steps(2, 32, 0.5, t0=3.0)
    run._finished.set()
    run.status, run.ended = "done", run.started + 4.0
    assert run.progress_line(9.0) == ("done: 10 steps in 4.0 s (2 configs: 3,200 tokens/s; "
                                      "64 tokens/s)")


def test_a_terminal_progress_line_covers_a_longer_one_before_it(capsys):
    from distlab.caller.run import ProgressOut
    out = ProgressOut()
    out.show("starting 2 rank(s)... 1 s")
    out.show("ended 2 rank(s)... 1 s", final=True)
    shown = capsys.readouterr().out
    assert shown == "\rstarting 2 rank(s)... 1 s\rended 2 rank(s)... 1 s   \n", repr(shown)
