"""The launcher's promises: failures reach the caller with the failing rank's traceback, a rank
stuck in a collective ends in a timeout error, and no rank process outlives its run."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from distlab import Run, RunConfig, RunError, launch

# A tiny model, so the steps cost milliseconds and the tests measure the launcher.
TINY = RunConfig(strategy="allreduce", world_size=2, steps=8, global_batch=4, seq_len=8,
                 n_layer=1, n_embd=16, n_head=2, timeout_s=30)


def assert_all_gone(pids, within_s=5.0):
    """Every pid has exited (a zombie counts as alive: it was not reaped)."""
    deadline = time.time() + within_s
    alive = pids
    while time.time() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"rank processes still alive: {alive}")


def wait_for_step(run, n=1, timeout=60):
    deadline = time.time() + timeout
    while run.steps_done() < n:
        assert time.time() < deadline, f"no step event within {timeout} s: {run.events[-3:]}"
        assert not run.done, f"run ended early: {run.status} {run.error}"
        time.sleep(0.05)


def test_success_leaves_no_process_and_a_complete_log():
    run = launch(TINY).wait(timeout=120)
    assert run.status == "done" and run.error is None
    assert_all_gone(run.pids)
    assert len(run.losses()) == TINY.steps
    again = Run.load(run.dir)  # the durable log reproduces the history
    assert again.status == "done" and again.losses() == run.losses()


def test_an_exception_in_one_rank_reaches_the_caller_with_its_traceback():
    cfg = TINY.replace(fault="raise", fault_rank=1, fault_step=3)
    run = launch(cfg)
    with pytest.raises(RunError) as e:
        run.wait(timeout=120)
    err = e.value
    assert err.rank == 1 and err.step == 3  # the step it failed in
    assert "injected fault: rank 1 raised at step 3" in err.traceback
    assert "inject_fault" in err.traceback  # rank 1's own frames, not a peer's
    fault_time = run.history("fault")[0]["time"]
    assert run.ended - fault_time < 10.0
    assert_all_gone(run.pids)
    # the events rank 1 wrote before it died are all there
    assert [e["step"] for e in run.history("step", rank=1)] == [0, 1, 2]


def test_a_rank_stuck_on_a_collective_is_named_with_its_stack():
    # rank 1 stops joining collectives at step 2: rank 0 waits in the all-reduce until the
    # process group's timeout; the run fails naming rank 1, the one it waited for, with the
    # stack rank 1 dumped when asked (SIGUSR1, faulthandler), not rank 0's timeout
    cfg = TINY.replace(fault="stall", fault_rank=1, fault_step=2, timeout_s=3)
    t0 = time.time()
    run = launch(cfg)
    with pytest.raises(RunError) as e:
        run.wait(timeout=120)
    assert e.value.rank == 1 and e.value.step == 2
    assert "never joined the collective rank 0 waited for" in str(e.value)
    assert "timed out after 3 s" in str(e.value) and "timeout_s" in str(e.value)
    assert "rank 1: 1" in str(e.value)  # the last step each rank logged
    assert "faults.py" in e.value.traceback and "inject_fault" in e.value.traceback
    assert time.time() - t0 < 60
    assert_all_gone(run.pids)


def test_a_killed_rank_is_named_with_its_signal():
    cfg = TINY.replace(fault="kill", fault_rank=1, fault_step=2)
    run = launch(cfg)
    with pytest.raises(RunError) as e:
        run.wait(timeout=120)
    assert e.value.rank == 1 and e.value.step == 2 and "SIGKILL" in e.value.message
    assert run.ended - run.history("fault")[0]["time"] < 10.0
    assert_all_gone(run.pids)


def test_stop_ends_every_rank():
    run = launch(TINY.replace(steps=100_000, step_delay_s=0.01))
    wait_for_step(run)
    run.stop()
    assert run.status == "stopped"
    assert_all_gone(run.pids)
    assert Run.load(run.dir).status == "stopped"


def test_keyboard_interrupt_in_wait_stops_the_run():
    run = launch(TINY.replace(steps=100_000, step_delay_s=0.01))
    wait_for_step(run)
    # Python's own SIGINT handler, whatever this process inherited: a background job of a
    # non-interactive shell starts with SIGINT ignored, and the interrupt would never come
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            run.wait(timeout=120)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert run.status == "stopped"
    assert_all_gone(run.pids)


def test_ranks_exit_when_the_launching_process_is_killed(tmp_path):
    # A kernel killed with SIGKILL cannot clean up; each rank's watchdog notices the parent
    # is gone and exits, even while blocked in a collective (rank 0 waits on stalled rank 1).
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from distlab import RunConfig, launch
        if __name__ == "__main__":  # spawned ranks re-import this file
            cfg = RunConfig.from_dict({TINY.replace(fault="stall", fault_rank=1, fault_step=1,
                                                     timeout_s=600).to_dict()!r})
            run = launch(cfg)
            while run.steps_done() < 1 and not run.done:
                time.sleep(0.05)
            print(" ".join(map(str, run.pids)) if not run.done else "failed", flush=True)
            time.sleep(120)
    """))
    # rank 0 is blocked in the all-reduce of step 1 a second after the pids are printed
    kill_the_launcher(script, expect=2, settle_s=1.0, within_s=5.0)


def kill_the_launcher(script, expect: int, settle_s: float, within_s: float):
    """Run `script`, which launches a run and prints the pids it watches on one line; SIGKILL
    it `settle_s` later and assert that every printed pid is gone within `within_s`."""
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ})
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == expect and all(pids), pids
        time.sleep(settle_s)
        parent.kill()
        parent.wait()
        assert_all_gone(pids, within_s=within_s)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_two_runs_launched_at_once_do_not_collide():
    a, b = launch(TINY), launch(TINY)
    a.wait(timeout=120), b.wait(timeout=120)
    assert a.status == b.status == "done"
    assert a.dir != b.dir
    assert a.losses() == b.losses()  # same config, same data: the same run twice
    assert_all_gone(a.pids + b.pids)


def test_a_run_inherits_nothing_from_the_previous_one(monkeypatch, tmp_path):
    """Ranks are forked from a fork server started by the first launch: each run must still
    start as a fresh process would, with the launcher's environment of now, its own Python
    and torch random states (seeded from the OS, as a new interpreter's), the thread count
    launch sets, and new processes."""
    from distlab import run_ranks
    from rank_state import what_a_rank_starts_with

    monkeypatch.setenv("DISTLAB_TEST_MARK", "first")
    first = run_ranks(what_a_rank_starts_with, 2, threads=1, run_dir=str(tmp_path / "first"))
    # the return values came back and their files are gone: the caller holds them now
    assert not list((tmp_path / "first").glob("result*.pt"))
    monkeypatch.setenv("DISTLAB_TEST_MARK", "second")  # after the fork server started
    second = run_ranks(what_a_rank_starts_with, 2, threads=2)
    assert [r["env"] for r in first + second] == ["first"] * 2 + ["second"] * 2
    randoms = [r["random"] for r in first + second]
    assert len(set(randoms)) == 4  # fresh seeds, not the server's copied state
    assert len({r["torch_seed"] for r in first + second}) == 4
    assert [r["threads"] for r in first + second] == [1, 1, 2, 2]
    assert {r["pid"] for r in first}.isdisjoint({r["pid"] for r in second})

