"""The run's event log: one JSON object per line, one file per rank.

A rank appends and flushes each event as it happens, so the events it wrote survive if it dies
a moment later (a flushed write is in the kernel's page cache even if the process is killed).
The caller reads the files while they grow, taking only complete lines.
"""

from __future__ import annotations

import json
import os
import time

from distlab import wire


class EventLog:
    """Writer side, in a rank: `log.write("step", step=3, loss=1.2)`.

    Each event is one append (os.write) of one line. A write that fails (a full disk) costs
    that event, not the run: the rank counts what it could not write and, at its next write
    that succeeds (or at close), logs a "dropped" event saying how many and why, which the
    caller reports as a warning. A line cut short by a full disk is ended by the next write's
    leading newline, so the reader skips it and reads on."""

    def __init__(self, path: str, rank: int):
        self.path, self.rank = path, rank
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.last_step = -1
        self.dropped, self._why = 0, ""  # events not written since the last "dropped" event
        self._torn = False  # the last write stopped mid-line

    def write(self, kind: str, **fields) -> dict:
        event = {"kind": kind, "rank": self.rank, "time": time.time(), **fields}
        if kind == "step":
            self.last_step = fields.get("step", self.last_step)
        if self.dropped:
            self._report_dropped()
        if not self._append(json.dumps(event) + "\n"):
            self.dropped += 1
        return event

    def _append(self, line: str) -> bool:
        data = (b"\n" if self._torn else b"") + line.encode()
        try:
            n = os.write(self._fd, data)
        except OSError as e:
            self._why = f"{e.strerror} ({self.path})"
            return False
        wire.note_own_write(n)  # a file write, not network traffic
        self._torn = n < len(data)
        if self._torn:
            self._why = f"a write cut short: the disk is full ({self.path})"
        return not self._torn

    def _report_dropped(self):
        note = {"kind": "dropped", "rank": self.rank, "time": time.time(),
                "events": self.dropped, "why": self._why}
        if self._append(json.dumps(note) + "\n"):
            self.dropped = 0

    def close(self):
        if self.dropped:
            self._report_dropped()
        os.close(self._fd)


class LogTail:
    """Reader side: returns the complete lines appended to one file since the last call.

    The file stays open once it has been opened, so a run folder deleted while the run goes on
    (a user cleaning runs/) does not hide what the ranks still write: the open handle reads the
    unlinked file to its end. A line that is not JSON (a disk that filled mid-line, an edit by
    hand) is skipped and described in `skipped`, never raised: the reader is a monitor thread.
    """

    def __init__(self, path: str):
        self.path, self._partial = path, b""
        self._f = None
        self._closed = False
        self.skipped: list[str] = []

    def read_new(self) -> list[dict]:
        if self._closed:  # reopening would read the file again from its start
            return []
        if self._f is None:
            try:
                self._f = open(self.path, "rb")
            except FileNotFoundError:
                return []
        data = self._partial + self._f.read()
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an incomplete last line waits for the next read
        events = []
        for line in lines:
            if not line.strip():
                continue
            try:
                events.append(json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                self.skipped.append(f"{self.path}: skipped a line that is not JSON ({e}): "
                                    f"{line[:80]!r}")
        return events

    def read_all(self) -> list[dict]:
        """Every complete line now, then close: for a file read once."""
        try:
            return self.read_new()
        finally:
            self.close()

    def close(self):
        self._closed = True
        if self._f is not None:
            self._f.close()
            self._f = None


def rank_log_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank{rank}.jsonl")


def rank_stderr_path(run_dir: str, rank: int) -> str:
    """A launched rank's stderr: what a backend prints before it aborts, Python's warnings, and
    the stack a silent rank dumps when the caller asks (distlab.caller.run)."""
    return os.path.join(run_dir, f"rank{rank}.stderr")


def tail(path: str, nbytes: int = 4000) -> str:
    """The last `nbytes` of a text file ("" if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def step_events_per_run(run_dir: str, rank: int) -> list[list[dict]]:
    """A rank's step events from its log, one list per training run in it: a launch that
    trains several configs one after another (train_with_state) starts each with "start"."""
    runs: list[list[dict]] = []
    for e in LogTail(rank_log_path(run_dir, rank)).read_all():
        if e["kind"] == "start":
            runs.append([])
        elif e["kind"] == "step":
            runs[-1].append(e)
    return runs


class StepRecorder:
    """An EventLog stand-in that writes through to `log` and also keeps the step events, for
    rank functions that want them back without reading the log file (the benchmarks)."""

    def __init__(self, log):
        self.log, self.steps = log, []

    def write(self, kind, **fields):
        if kind == "step":
            self.steps.append(fields)
        return self.log.write(kind, **fields)

    def __getattr__(self, name):
        return getattr(self.log, name)
