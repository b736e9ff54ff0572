"""distlab.gloo_exit: a process whose Comm runs over gloo waits GRACE_S at exit, so a gloo
worker that still releases a finished collective is not cut off by interpreter finalization
(the abort is a race, seen in about 1 run in 20 under load; this checks the guard is armed,
once, and that it is what the process runs at exit)."""

import socket
import subprocess
import sys

from distlab import gloo_exit

SCRIPT = """
import atexit, os, time, torch.distributed as dist
from distlab import gloo_exit
from distlab.comm import Comm
before = atexit._ncallbacks()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
Comm(); Comm()  # two Comms: one guard
print(gloo_exit._armed, atexit._ncallbacks() - before, flush=True)
dist.destroy_process_group()
import distlab.gloo_exit as g
_real = g.time.sleep
g.time.sleep = lambda s: (print("exit wait", s, flush=True), _real(s))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_gloo_comm_arms_the_exit_wait_once():
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(port=_free_port())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    armed, registered = proc.stdout.splitlines()[0].split()
    assert armed == "True" and registered == "1"
    assert proc.stdout.splitlines()[1] == f"exit wait {gloo_exit.GRACE_S}"


def test_without_a_comm_nothing_is_armed():
    proc = subprocess.run([sys.executable, "-c", "import distlab, distlab.gloo_exit as g; "
                           "print(g._armed)"], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr[-2000:]
