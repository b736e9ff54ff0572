"""The fork server the ranks start from (distlab.caller.launch.rank_context), replaced when it
has died, whenever that was.

multiprocessing keeps one fork server per process (multiprocessing.forkserver._forkserver: its
pid, its socket's address, the pipe that keeps it alive) and asks whether it still runs with
waitpid(WNOHANG). That says "running" until the kernel has made the dead server a zombie, some
milliseconds after a SIGKILL (the more the server imported, the longer): a process started in
that window connects to a socket nobody will answer, and fails with a bare `EOFError:
unexpected EOF` from forkserver.read_signed (measured: 5 of 5 launches started at once after
the kill). A server killed while it forks fails the same way.

`start(begin)` runs `begin`, which starts processes through the server. Before, a server that
is dying (SIGKILL pending) is waited out; after a failure, a server found dead is waited out
and `begin` runs once more: multiprocessing sees the dead server and starts a new one. A
server that died between two of begin's processes (multiprocessing quietly started a new one
for the second) is such a failure too: begin calls `same_server` after each. Nothing
is ended here: the dead server is only waited for (it is this process's child, reaped by
multiprocessing).
"""

from __future__ import annotations

import time
from multiprocessing import forkserver
from typing import Callable, TypeVar

T = TypeVar("T")
DEATH_WAIT_S = 5.0  # how long a killed server may take to become a zombie (measured: ~10 ms)
_SIGKILL_BIT = 1 << (9 - 1)  # SIGKILL in /proc/<pid>/status's pending-signal masks


def start(begin: Callable[[], T]) -> T:
    """begin(), through a live fork server, even if the last one died a moment ago."""
    pid = server_pid()
    if pid is not None and _killed(pid):
        _wait_for_end(pid)  # then multiprocessing's own check sees it dead
    try:
        return begin()
    except (EOFError, OSError) as e:  # read_signed's EOF, a refused connection, a broken pipe
        pid = getattr(e, "dead_server", None) or server_pid()
        if pid is None or not _wait_for_end(pid):
            raise  # the server lives: the failure is something else's
    return begin()


class Replaced(EOFError):
    """Processes of one start came from two fork servers: the first died between them, and
    the processes it had started die with it (PR_SET_PDEATHSIG)."""

    def __init__(self, dead_server: int):
        super().__init__(f"the fork server (pid {dead_server}) died while processes were "
                         "started from it")
        self.dead_server = dead_server


def same_server(first: int | None) -> int | None:
    """Call after each process of a start, with what the last call returned (None at first):
    raises Replaced if the server is no longer the one the earlier processes came from."""
    now = server_pid()
    if first is not None and now != first:
        raise Replaced(first)
    return now


def server_pid() -> int | None:
    """The pid of the fork server this process started, None before the first."""
    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def _killed(pid: int) -> bool:
    """SIGKILL is pending: the process is as good as gone, though waitpid cannot say so yet."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = [int(line.split()[1], 16) for line in f
                     if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (OSError, ValueError, IndexError):  # no /proc, or the process is gone
        return False
    return any(m & _SIGKILL_BIT for m in masks)


def _wait_for_end(pid: int, within_s: float = DEATH_WAIT_S) -> bool:
    """Wait until the server is a zombie or gone; False if it still runs after within_s."""
    from distlab.caller.run import process_state
    deadline = time.time() + within_s
    while process_state(pid) not in ("", "Z", "X"):
        if time.time() > deadline:
            return False
        time.sleep(0.01)
    return True
