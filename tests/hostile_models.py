"""Model factories that misbehave on purpose, named by import path in tests/test_adversarial.py
(a module, not a test file, so the ranks and the factory check import it by name too).

What each does is set by the environment the test launches with, which every process of the
run inherits: DISTLAB_HOSTILE = "<behaviour>:<rank>:<step>", and DISTLAB_HOSTILE_DIR, a folder
where a factory notes the pids of the processes it starts. "In a rank" means inside a launched
rank (its process group is up); "in the check" means in launch()'s factory check.
"""

import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from factory_models import Blobs, Classifier


def _setting():
    parts = os.environ.get("DISTLAB_HOSTILE", "none:-1:-1").split(":") + ["-1"] * 2
    what, rank, step = parts[:3]
    return what, int(rank), int(step)


def _in_a_rank() -> bool:
    return dist.is_available() and dist.is_initialized()


def _start_a_child():
    """A process the factory starts and never ends (a data loader worker, a server)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(os.environ["DISTLAB_HOSTILE_DIR"], f"{child.pid}.pid"), "w") as f:
        f.write(str(child.pid))


class Hostile(Classifier):
    """At training forward number `step` on `rank`: leave with status 0, or abort (SIGABRT)
    after writing a line to stderr, as a backend's "terminate called ..." does."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x, y):
        what, rank, step = _setting()
        if torch.is_grad_enabled() and _in_a_rank():
            if dist.get_rank() == rank and self.calls == step:
                if what == "exit0":
                    os._exit(0)
                if what == "abort":
                    print("terminate called after throwing an instance of 'gloo::IoException'"
                          "  what():  made here to test the message", file=sys.stderr,
                          flush=True)
                    os.abort()
            self.calls += 1
        return super().forward(x, y)


def make_model(cfg):
    what, rank, _ = _setting()
    in_rank = _in_a_rank()
    if what == "sleep_in_check" and not in_rank:
        time.sleep(600)
    if what == "sleep_in_ranks" and in_rank:
        time.sleep(600)
    if what == "exit_in_check" and not in_rank:
        sys.exit(3)
    if what == "die_in_check" and not in_rank:
        os._exit(9)
    if what == "child":
        _start_a_child()
    torch.manual_seed(cfg.seed)
    return Hostile()


class NanInLastRow(Blobs):
    """Data whose last row holds a NaN at step 2: under data parallelism, the last rank's."""

    def global_batch(self, step, batch):
        x, y = super().global_batch(step, batch)
        if step == 2:
            x[-1, 0] = float("nan")
        return x, y


def nan_data():
    return NanInLastRow()
