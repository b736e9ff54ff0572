"""A bad day, caused on purpose: ranks that vanish, abort, stop or never return, factories that
hang, exit or leave processes behind, and inputs that used to pass the config and fail in the
ranks. Each test asserts the error's text (the cause, and the rank where one is at fault), how
long it took to come, and that no process is left. (Ranks that disagree: tests/test_agree.py;
a rank stuck in a collective, a killed rank, a killed launcher: tests/test_process_safety.py.)

The misbehaving factories are in tests/hostile_models.py; the environment selects what each
does (DISTLAB_HOSTILE = "<behaviour>:<rank>:<step>"), and every process of a run inherits it.
"""

import os
import signal
import time

import psutil
import pytest
from test_process_safety import assert_all_gone, wait_for_step

from distlab import RunConfig, RunError, launch
from distlab.caller import run as run_module

HOSTILE = RunConfig(strategy="ddp", world_size=2, steps=6, optimizer="sgd", lr=0.1,
                    global_batch=8, timeout_s=3, model="hostile_models:make_model",
                    data="factory_models:make_data")


@pytest.fixture
def hostile(monkeypatch, tmp_path):
    """Set what the factory does; returns the folder where it notes the pids it starts."""
    monkeypatch.setenv("DISTLAB_HOSTILE_DIR", str(tmp_path))
    monkeypatch.setenv("DISTLAB_RUNS", str(tmp_path / "runs"))

    def choose(behaviour, rank=-1, step=-1):
        monkeypatch.setenv("DISTLAB_HOSTILE", f"{behaviour}:{rank}:{step}")
        return tmp_path
    return choose


def failure(cfg, within_s=60):
    """Launch cfg, wait for its RunError; (error, seconds from launch to error, run)."""
    t0 = time.time()
    run = launch(cfg)
    with pytest.raises(RunError) as e:
        run.wait(timeout=within_s)
    return e.value, time.time() - t0, run


@pytest.mark.slow
def test_a_rank_that_leaves_with_status_0_is_the_cause(hostile):
    hostile("exit0", rank=1, step=2)
    err, took, run = failure(HOSTILE)
    assert err.rank == 1 and err.step == 2, err
    assert "exited with status 0 in the middle of the run (after step 1)" in err.message
    assert "Connection closed" not in err.message  # not the peer's consequence
    assert took < 20  # measured ~3 s: the ranks' start-up, then one poll
    assert_all_gone(run.pids)


@pytest.mark.slow
def test_an_abort_says_what_the_rank_wrote_before_it(hostile):
    hostile("abort", rank=1, step=2)
    err, took, run = failure(HOSTILE)
    assert err.rank == 1 and "killed by SIGABRT" in err.message
    assert "gloo::IoException" in err.message and "made here to test the message" in err.message
    assert took < 20
    assert_all_gone(run.pids)


@pytest.mark.slow
def test_a_stopped_rank_is_named_not_the_rank_that_waited(hostile):
    hostile("none")
    run = launch(HOSTILE.replace(steps=100_000, step_delay_s=0.01))
    wait_for_step(run, 2)
    os.kill(run.pids[1], signal.SIGSTOP)
    t0 = time.time()
    with pytest.raises(RunError) as e:
        run.wait(timeout=60)
    took = time.time() - t0
    assert e.value.rank == 1, e.value
    assert "rank 1 never joined the collective rank 0 waited for" in e.value.message
    assert "stopped (process state T" in e.value.message
    assert took < HOSTILE.timeout_s + 10  # the peer's timeout, then the failure grace
    assert_all_gone(run.pids)  # a stopped process too


@pytest.mark.slow
def test_ranks_that_never_return_from_the_factory_end_with_their_stack(hostile, monkeypatch):
    # no collective is pending, so no timeout fires: the caller's watch on silent ranks does
    monkeypatch.setattr(run_module, "SILENCE_GRACE_S", 2.0)
    hostile("sleep_in_ranks")
    err, took, run = failure(HOSTILE)
    assert "logged nothing for" in err.message and "neither stepping nor failing" in err.message
    assert "hostile_models.py" in err.traceback and "make_model" in err.traceback
    assert took < HOSTILE.timeout_s + 2.0 + 15  # the limit, the stack dump, start-up
    assert_all_gone(run.pids)


@pytest.mark.slow
@pytest.mark.parametrize("behaviour, message", [
    ("sleep_in_check", r"did not finish within 3 s \(RunConfig.timeout_s\)"),
    ("exit_in_check", r"the factory called sys.exit\(3\)"),
    ("die_in_check", r"ended \(exit code 9\) before it finished"),
])
def test_a_factory_that_hangs_or_exits_in_the_check_is_refused(hostile, behaviour, message):
    folder = hostile(behaviour)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t0 = time.time()
    with pytest.raises(ValueError, match=message):
        launch(HOSTILE)
    assert time.time() - t0 < HOSTILE.timeout_s + 10
    assert not (folder / "runs").exists() or not any((folder / "runs").iterdir())
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert_all_gone(sorted(left))  # (the fork server is the ranks', started before)


@pytest.mark.slow
def test_processes_a_factory_starts_end_with_the_run(hostile):
    folder = hostile("child")
    run = launch(HOSTILE).wait(timeout=60)
    assert run.status == "done"
    started = [int(p.read_text()) for p in folder.glob("*.pid")]
    assert len(started) == 1 + HOSTILE.world_size  # the check's, and one per rank
    assert_all_gone(started)


@pytest.mark.parametrize("fields, message", [
    (dict(seed=-1), "seed=-1 must be >= 0"),
    (dict(name="../outside"), "no '/'"),
    (dict(name=".."), "not '.' or '..'"),
])
def test_inputs_the_ranks_would_refuse_are_refused_by_the_config(fields, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(**fields)


def test_an_unknown_fp32_module_is_refused_before_any_rank_starts(tmp_path):
    cfg = RunConfig(precision="bf16", fp32_modules="head,no_such_block", runs_root=str(tmp_path))
    with pytest.raises(ValueError, match="fp32_modules='head,no_such_block': no module named "
                                         "'no_such_block'"):
        launch(cfg)
    assert not any(tmp_path.iterdir())


def _listening(pid: int) -> set:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN}


@pytest.mark.slow
def test_a_local_run_listens_on_loopback_only(hostile):
    # Before: the caller's TCPStore listened on '::' (every interface, v4 and v6) although
    # 127.0.0.1 was passed. Now the rendezvous is a file and the caller opens no port; the
    # ranks' gloo sockets are bound to the loopback interface. (On this machine the hostname
    # resolves to 127.0.0.1, so the ranks' half also held before; on a laptop whose hostname
    # resolves to its LAN address it did not.)
    hostile("none")
    before = _listening(os.getpid())
    run = launch(HOSTILE.replace(steps=100_000, step_delay_s=0.01))
    try:
        wait_for_step(run, 2)
        assert _listening(os.getpid()) - before == set()
        ranks = set().union(*(_listening(pid) for pid in run.pids))
        assert ranks and {ip for ip, _ in ranks} <= {"127.0.0.1", "::1"}, ranks
    finally:
        run.stop()
    assert not os.path.exists(os.path.join(run.dir, "rendezvous.store"))
    assert_all_gone(run.pids)
