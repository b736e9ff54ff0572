"""A bad day, caused on purpose. Each test asserts the error's text (the cause, and the rank
where one is at fault), how long it took to come, and that no process is left:

  a rank that leaves with status 0 midway      named, not its peer's "Connection closed"
  a rank that aborts (SIGABRT)                  what it wrote to stderr before, in the error
  a stopped rank (SIGSTOP)                      named as stopped, not the rank that waited
  every rank hanging in the model factory       named after timeout_s + grace, with its stack
  a factory that hangs, exits or dies in launch()'s check   a ValueError within timeout_s
  processes a factory starts                    ended with the run (the ranks' process groups)
  inputs the ranks used to refuse               refused by the config or launch()
  the sockets of a local run                    loopback only; the caller listens on nothing
  resume_from="auto" with damaged checkpoints   the newest that verifies, with a warning
  a full disk under a sharded save              "no space left" with the path and the step as
                                                its folder numbers it; no partial save
  a full disk under the event logs              a warning, not the run, saying how many steps
                                                the logs lack (also in the dashboard's status)
  NaN in one rank's input                       a warning; with detect_nan, the rank and step
  a lost fork server                            said as such; the next launch starts a new one
  a fork server killed just before a launch,    a new one, and the run trains (before: EOFError)
    or while it starts the ranks
  the launcher killed while a rank is stopped   no rank, fork server or tracker left

Ranks that disagree: tests/test_agree.py; a rank stuck in a collective, a killed rank, a killed
launcher: tests/test_process_safety.py. The misbehaving factories are in
tests/hostile_models.py; the environment selects what each does (DISTLAB_HOSTILE =
"<behaviour>:<rank>:<step>"), and every process of a run inherits it. The full-disk tests mount
a 512 KiB tmpfs: they need root, and are skipped, saying so, without it.
"""

import os
import shutil
import signal
import subprocess
import textwrap
import time

import psutil
import pytest
from test_process_safety import TINY, assert_all_gone, kill_the_launcher, wait_for_step

from distlab import RunConfig, RunError, launch
from distlab.caller import fork_server
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


# -- checkpoints that do not verify, and a disk that fills --------------------------------------
CKPT = RunConfig(strategy="ddp", world_size=2, steps=6, global_batch=8, seq_len=16, n_layer=1,
                 n_embd=32, n_head=2, optimizer="sgd", lr=0.1, timeout_s=10,
                 checkpoint_every=2, keep_last=10)


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, another CRC-32
    path.write_bytes(data)


@pytest.mark.slow
def test_auto_resume_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path):
    cfg = CKPT.replace(checkpoint_dir=str(tmp_path / "ckpt"), runs_root=str(tmp_path / "runs"))
    launch(cfg).wait(timeout=120)  # saves after steps 2, 4 and 6
    uninterrupted = launch(cfg.replace(steps=8, checkpoint_every=0, checkpoint_dir="")).wait(
        timeout=120)
    flip_a_byte(tmp_path / "ckpt" / "step_000006" / "state.pt")
    run = launch(cfg.replace(steps=8, resume_from="auto"))
    with pytest.warns(RuntimeWarning, match=r"skipped 1 newer checkpoint.*step_000006.*CRC-32"):
        run.wait(timeout=120)
    assert run.history("resume")[0]["steps_done"] == 4  # the newest one that verifies
    # ... and from there it trains as the run that never stopped, bit for bit
    assert run.losses() == uninterrupted.losses()[4:]  # steps 4-7
    for step in ("step_000002", "step_000004", "step_000006", "step_000008"):  # 6: saved anew
        flip_a_byte(tmp_path / "ckpt" / step / "state.pt")
    err, _, run = failure(cfg.replace(steps=10, resume_from="auto"))
    assert "none of the 4 checkpoint(s)" in err.message and "CRC-32" in err.message
    assert_all_gone(run.pids)


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs (root only; skipped, with the reason, elsewhere), unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(disk)],
                          capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk, leave_bytes):
    free = shutil.disk_usage(disk).free
    (disk / "filler").write_bytes(b"\0" * max(0, free - leave_bytes))


@pytest.mark.slow
def test_a_full_disk_under_a_sharded_save_says_no_space_and_leaves_no_partial_save(small_disk,
                                                                                   tmp_path):
    cfg = CKPT.replace(strategy="zero3", checkpoint_dir=str(small_disk / "ckpt"),
                       runs_root=str(tmp_path / "runs"))
    fill(small_disk, 16 * 1024)  # a shard of this model is ~40 KiB
    err, took, run = failure(cfg)
    # numbered as the folder is, and as the error's step (before: "step 1's", at step 2)
    assert err.step == 2, err  # the first save, after 2 steps (checkpoint_every=2)
    assert "no space left on device saving step 2's checkpoint (step_000002)" in err.message, err
    assert str(small_disk / "ckpt") in err.message
    assert [p.name for p in (small_disk / "ckpt").iterdir()] == []  # the partial save went
    assert took < 30
    assert_all_gone(run.pids)


@pytest.mark.slow
def test_event_logs_on_a_full_disk_cost_a_warning_not_the_run(small_disk):
    cfg = CKPT.replace(checkpoint_every=0, steps=40, runs_root=str(small_disk / "runs"))
    fill(small_disk, 24 * 1024)  # the config and a few steps' events fit, the rest does not
    t0 = time.time()
    run = launch(cfg)
    with pytest.warns(RuntimeWarning) as warned:
        run.wait(timeout=120)
    took = time.time() - t0
    assert run.status == "done" and run.error is None
    # how many steps the logs lack is said (before: only that "done" could not be logged)
    kept = len(run.losses())
    assert 0 < kept < cfg.steps
    said = (f"events of {cfg.steps - kept} of {cfg.steps} steps were not recorded: the run "
            f"folder's disk is full ({run.dir}); run.losses() holds the other {kept}")
    assert any(said in str(w.message) for w in warned), [str(w.message) for w in warned]
    assert said in run.problems
    from distlab.lab.live import describe  # the dashboard's status line
    status = describe(run, "full")
    assert said in status and f"last recorded loss {run.losses()[-1]:.3f}" in status
    assert took < 30
    assert 0 < len(run.history("step")) < 2 * cfg.steps  # some events were lost, none raised
    assert_all_gone(run.pids)


@pytest.mark.slow
def test_nan_in_one_ranks_input_is_a_warning_or_with_detect_nan_names_the_rank(hostile):
    hostile("none")
    cfg = HOSTILE.replace(data="hostile_models:nan_data")
    run = launch(cfg)
    with pytest.warns(RuntimeWarning, match=r"the loss was nan at step 2 on rank 1"):
        run.wait(timeout=60)  # it spread to every rank's weights: before, "done" and silent
    err, took, run = failure(cfg.replace(detect_nan=True))
    assert err.rank == 1 and err.step == 2, err
    assert "in forward: first in module '(input)'" in err.message
    assert "the batch this rank fed the model: 1 NaN" in err.message
    assert_all_gone(run.pids)


@pytest.mark.slow
def test_a_lost_fork_server_is_said_as_such_and_the_next_launch_starts_a_new_one(hostile):
    from multiprocessing import forkserver
    hostile("none")
    run = launch(HOSTILE.replace(steps=100_000, step_delay_s=0.01))
    wait_for_step(run, 2)
    server = forkserver._forkserver._forkserver_pid
    os.kill(server, signal.SIGKILL)
    with pytest.raises(RunError, match=f"the fork server the ranks were started from \\(pid "
                                       f"{server}\\) is gone"):
        run.wait(timeout=30)
    assert_all_gone(run.pids)
    again = launch(HOSTILE).wait(timeout=60)  # before: EOFError, 3 times out of 3
    assert again.status == "done" and forkserver._forkserver._forkserver_pid != server


def kill_the_fork_server() -> int:
    server = fork_server.server_pid()
    os.kill(server, signal.SIGKILL)
    return server


@pytest.mark.slow
def test_a_launch_right_after_the_fork_server_died_starts_a_new_one_and_trains(hostile,
                                                                                monkeypatch):
    hostile("none")
    launch(HOSTILE).wait(timeout=60)  # a fork server to kill
    # Killed between runs, the next launch at once: multiprocessing's waitpid still says the
    # server runs, and a start fails with "EOFError: unexpected EOF" (before: 5 times of 5)
    relaunch_after(kill_the_fork_server)

    # Killed between two ranks' starts: the first rank dies with it (PR_SET_PDEATHSIG), and
    # multiprocessing quietly starts a new server for the second. Both start again.
    same_server = fork_server.same_server
    killed = []

    def kill_after_the_first_rank(first):
        if not killed:
            killed.append(kill_the_fork_server())
            while run_module.process_state(killed[0]) != "Z":
                time.sleep(0.01)
        return same_server(first)

    monkeypatch.setattr(fork_server, "same_server", kill_after_the_first_rank)
    relaunch_after(lambda: fork_server.server_pid())


def relaunch_after(kill):
    """kill() the fork server (returns its pid), launch at once: a new server, and the run
    trains every step; nothing is left of the dead server or the run."""
    server = kill()
    t0 = time.time()
    run = launch(HOSTILE).wait(timeout=60)
    took = time.time() - t0
    assert run.status == "done" and len(run.losses()) == HOSTILE.steps
    assert fork_server.server_pid() not in (None, server)
    assert took < 30  # measured ~3 s: the new server's imports, the factory check, the ranks
    assert_all_gone(run.pids + [server])  # the dead server reaped, not left a zombie


@pytest.mark.slow
def test_killing_the_launcher_while_a_rank_is_stopped_leaves_nothing(tmp_path):
    # A stopped rank cannot run its own parent watch; the kernel's PR_SET_PDEATHSIG ends it
    # when the fork server (its parent) exits, and the resource tracker exits once no rank
    # holds it. Before: the rank, the fork server and the resource tracker all stayed.
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        from multiprocessing import forkserver, resource_tracker
        from distlab import RunConfig, launch
        if __name__ == "__main__":
            cfg = RunConfig.from_dict({TINY.replace(
                steps=100_000, step_delay_s=0.01, timeout_s=600).to_dict()!r})
            run = launch(cfg)
            while run.steps_done() < 2 and not run.done:
                time.sleep(0.05)
            os.kill(run.pids[1], signal.SIGSTOP)
            helpers = [forkserver._forkserver._forkserver_pid,
                       resource_tracker._resource_tracker._pid]
            print(" ".join(map(str, run.pids + helpers)), flush=True)
            time.sleep(120)
    """))
    kill_the_launcher(script, expect=4, settle_s=0.0, within_s=10.0)  # 2 ranks, 2 helpers
