"""A rank left waiting, under torchrun, on the public API (distlab.step_ledger's states, read
by distlab.comm's waits every second). Each test asserts the error's text, how long it took to
come and that no process is left:

  rank 1 runs one DistributedDataParallel step more; rank 0 ends with dist.barrier()
      before: both ranks waited for the process group's timeout (torch's default for gloo:
      30 minutes; 70 s and still waiting when measured). Now rank 1 ends within seconds:
      rank 0 left its loop, and the ranks are at different steps
  rank 1 raises in its step 2
      before: rank 0 said "ranks are at different steps ... split the data evenly", a data
      split that was not the cause. Now rank 0 names rank 1's error as the cause

The same under launch() (rank_body's closing barrier, a peer's failure), for DDP, ZeroOptimizer,
fully_shard and PipelineSchedule (whose sends and receives are published by a watcher thread):
tests/test_agree.py.
"""

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

SCRIPT = textwrap.dedent("""
    import sys, torch, torch.nn as nn, torch.nn.functional as F
    import torch.distributed as dist
    from distlab import DistributedDataParallel
    dist.init_process_group("gloo")  # torch's default timeout: 30 minutes
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for step in range(1, 4 + (rank == 1 and sys.argv[1] == "extra")):
        if sys.argv[1] == "crash" and rank == 1 and step == 2:
            raise ValueError("boom in step 2")
        F.mse_loss(model(x), y).backward()
    print(f"rank {rank} left its loop", flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")


def torchrun(tmp_path, mode: str):
    """(torchrun's exit code, its stderr, seconds it took); no process of it may be left."""
    script = tmp_path / f"waits_{mode}.py"
    script.write_text(SCRIPT)
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(script), mode], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    took = time.time() - t0
    left = [p.pid for p in psutil.process_iter(["cmdline"])
            if str(script) in " ".join(p.info["cmdline"] or [])]
    assert left == [], left
    return proc.returncode, proc.stderr, took


@pytest.mark.slow
def test_a_rank_left_waiting_on_a_peer_that_left_its_loop_ends_within_seconds(tmp_path):
    code, err, took = torchrun(tmp_path, "extra")
    assert code != 0
    assert ("rank 0 left its loop: it waits in dist.barrier() (its last step began: "
            "DistributedDataParallel step 3) while this rank waits in a collective (its last "
            "step began: DistributedDataParallel step 4)") in err, err[-3000:]
    assert ("ranks are at different steps: rank 0 began DistributedDataParallel step 3, "
            "rank 1 began DistributedDataParallel step 4") in err
    assert took < 30  # measured ~6 s: start-up, two reads a second apart, the exit


@pytest.mark.slow
def test_a_peer_that_crashed_is_named_not_a_data_split(tmp_path):
    code, err, took = torchrun(tmp_path, "crash")
    assert code != 0
    rank0 = "\n".join(line for line in err.splitlines() if line.startswith("[rank0]"))
    assert ("rank 1 failed (ValueError: boom in step 2; its last step began: "
            "DistributedDataParallel step 1), so this rank's collective cannot complete: the "
            "cause is rank 1's error") in rank0, err[-3000:]
    assert "different steps" not in rank0 and "DistributedSampler" not in rank0
    assert took < 30  # measured ~4 s


ECHO = textwrap.dedent("""
    import torch.distributed as dist
    from distlab import step_ledger
    store = dist.FileStore(r"{store}", 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    lost = {{1: "failed: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:3"}}
    crashed = {{1: "failed: ValueError: boom in step 2"}}
    timeout = "[unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"
    print(step_ledger.peers_left(None, lost, own_error=timeout))
    print(step_ledger.peers_left(None, lost, own_error="Connection closed by peer"))
    print(step_ledger.peers_left(None, crashed, own_error=timeout))
    dist.destroy_process_group()
""")


def test_a_timeout_is_not_blamed_on_the_peer_whose_connection_it_closed(tmp_path):
    """gloo closes a connection whose wait timed out, so the peer fails with "Connection closed
    by peer" a moment before this rank reads the ledger: that peer is not the cause (02's
    uneven-inputs hang named it so in 1 run of 10 under load). A peer's own error still is."""
    code = ECHO.format(store=tmp_path / "store")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()
    assert out[0] == "None"  # the echo of this rank's own timeout
    assert out[1].startswith("rank 1 failed (RuntimeError: [pair.cc:553] Connection closed")
    assert out[2].startswith("rank 1 failed (ValueError: boom in step 2; before any step)")
    assert out[2].endswith("the cause is rank 1's error")


def _report_after(run_dir, rank, delay_s, error):
    """A stand-in rank: after delay_s, log an error event (as launch's rank body does) and exit 1."""
    from distlab.events import EventLog, rank_log_path
    time.sleep(delay_s)
    EventLog(rank_log_path(run_dir, rank), rank).write("error", step=2, error=error, traceback="")
    os._exit(1)


def test_the_caller_waits_past_an_echo_for_the_report_that_caused_it(tmp_path):
    """Rank 0 reports a lost connection at once; rank 1, whose timeout closed it, takes 2.5 s
    to write its own report (a loaded machine: it reads the ledger first). The caller waits
    past its 1 s grace while every report is an echo, and names rank 1's. Before: rank 0's
    "Connection closed by peer" was the run's error, and the uneven-inputs report was lost."""
    import multiprocessing as mp
    from distlab import RunConfig
    from distlab.caller.run import FAILURE_GRACE_S, Run
    ctx = mp.get_context("fork")
    said = "RuntimeError: rank 1 timed out at its end-of-data barrier: uneven inputs"
    procs = [ctx.Process(target=_report_after, args=(str(tmp_path), 0, 0.0,
                         "RuntimeError: Connection closed by peer [127.0.0.1]:1")),
             ctx.Process(target=_report_after, args=(str(tmp_path), 1, 2.5 * FAILURE_GRACE_S,
                                                     said))]
    for p in procs:
        p.start()
    run = Run(str(tmp_path), RunConfig(strategy="ddp", world_size=2, timeout_s=3), procs)
    procs[0].join(10)
    run._read()
    run._fail()
    assert run.error.rank == 1 and said in run.error.message, run.error
    assert all(p.exitcode is not None for p in procs)
