"""Every snippet of docs/your_model.md (the README's until the reference moved to docs/) that
says "run with torchrun --nproc_per_node=2" runs as written, on 2 processes, in ONE torchrun
job: a driver runs the snippets one after another in the same two ranks (each snippet makes
its process group, in a store of its own, and destroys it at its end). A torchrun job costs
an agent and two ranks that each import torch, about 8 CPU-seconds on CI's 2 cores; seven
jobs cost more than any of the snippets' training.

Each snippet is checked for what it prints (rank 0's loss per step). A snippet that fails ends
the job at once (so no rank waits for a peer that left), with its traceback in its test; the
snippets after it are reported as not run, naming the one that failed."""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import subprocess
import sys

import psutil
import pytest

pytestmark = pytest.mark.slow
PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "your_model.md"
# the scripts, in the page's order of the features they show
SCRIPTS = ("train_ddp.py", "train_zero.py", "train_fsdp.py", "train_nanogpt.py", "train_tp.py",
           "train_pp.py", "train_long.py", "train_mixtral.py")
MARK = "=== snippet "
JOB_TIMEOUT_S = 400  # the eight take ~25 s alone, ~60 s inside the loaded suite
DRIVER = f'''\
import os, runpy, sys, traceback
from datetime import timedelta
import torch.distributed as dist
# torchrun's ranks rendezvous through the agent's store (TORCHELASTIC_USE_AGENT_STORE). Each
# snippet gets a store of its own: a group made in a store the snippet before used would read
# that group's stale addresses (gloo: "Connection refused" on the second init).
agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                      is_master=False, timeout=timedelta(seconds=120))
rank0 = os.environ["RANK"] == "0"
for i, script in enumerate(sys.argv[1:]):
    if rank0:
        fresh = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        agent.set(f"port {{i}}", str(fresh.port))
        print("{MARK}" + script, flush=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = agent.get(f"port {{i}}").decode()
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(1)  # torchrun ends the other rank, which would wait for this one
    sys.stdout.flush()
'''


def snippet(script: str) -> str:
    marker = f"# {script}: run with"
    text = PAGE.read_text()
    assert marker in text, f"docs/your_model.md's {script} snippet moved (no line '{marker}')"
    return marker + text.split(marker, 1)[1].split("```")[0]


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> dict:
    """What rank 0 printed per snippet; a snippet that did not finish maps to an error text."""
    folder = tmp_path_factory.mktemp("readme")
    for script in SCRIPTS:
        (folder / script).write_text(snippet(script))
    (folder / "driver.py").write_text(DRIVER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "driver.py", *SCRIPTS]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=folder, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        stdout, stderr = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # a snippet that hangs: end torchrun and its ranks, by id
        for child in psutil.Process(proc.pid).children(recursive=True) + [proc]:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                child.kill()
        stdout, stderr = proc.communicate()
        stderr += f"\n(the job did not end within {JOB_TIMEOUT_S} s: ended, with its ranks)"
    chunks = stdout.split(MARK)[1:]
    out = {c.split("\n", 1)[0]: c.split("\n", 1)[1].splitlines() for c in chunks}
    if proc.returncode != 0:
        last = chunks[-1].split("\n", 1)[0] if chunks else SCRIPTS[0]
        out[last] = f"{last} failed (torchrun exit {proc.returncode}):\n{stderr[-4000:]}"
        for script in SCRIPTS[SCRIPTS.index(last) + 1:]:
            out[script] = f"not run: {last}, before it in the same job, failed"
    return out


def lines_of(printed: dict, script: str) -> list[str]:
    got = printed[script]
    assert not isinstance(got, str), got
    assert [line.split(":")[0] for line in got] == [f"step {s}" for s in range(10)], got
    return got


@pytest.mark.parametrize("script", ["train_ddp.py", "train_zero.py", "train_fsdp.py",
                                    "train_tp.py", "train_pp.py"])
def test_the_api_snippet_trains_ten_steps(printed, script):
    lines_of(printed, script)


def test_the_nanogpt_shaped_fully_shard_snippet_learns(printed):
    losses = [float(line.split("loss ")[1].split(",")[0])
              for line in lines_of(printed, "train_nanogpt.py")]
    assert losses[-1] < losses[0], losses  # it learns (4.31 -> 4.16 when written)


def test_the_long_sequence_and_experts_snippet_learns(printed):
    """A user's own attention module through distlab.ContextParallel and a distlab.MoE spread
    by expert_parallel, each rank holding half of every sequence and half of the experts:
    every step's loss (rank 0 prints the mean over the ranks) is finite, and it learns the task
    (each token 3 more than the last: the last loss below half the first)."""
    losses = [float(line.split("loss ")[1]) for line in lines_of(printed, "train_long.py")]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0], losses  # 2.97 -> 0.05 when written


def test_a_users_mixtral_block_under_expert_parallel_learns(printed):
    """The page's Mixtral-shaped block (the user's router and SwiGLU experts) spread by
    expert_parallel: finite losses, and it learns the task (each target 3 more than its
    token: the last loss below half the first)."""
    losses = [float(line.split("loss ")[1]) for line in lines_of(printed, "train_mixtral.py")]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0], losses
