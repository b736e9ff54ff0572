"""Run: the handle a notebook holds on a run, live or finished.

A background thread reads the ranks' event logs while they grow and watches the processes.
When a rank fails it picks the root cause, ends every other rank and records a RunError; the
caller sees it from `wait()`, `error` or `status`. `Run.load(path)` reopens a finished run from
its folder.

Folder layout: config.json, rank<r>.jsonl (one per rank), rank<r>.stderr (what the rank wrote
to stderr), status.json (written at the end), checkpoints/ (distlab.checkpoint, when the run
saves them).
"""

from __future__ import annotations

import atexit
import glob
import json
import math
import os
import re
import signal
import threading
import time
import warnings
import weakref

from distlab.config import RunConfig
from distlab.events import LogTail, rank_log_path, rank_stderr_path, tail
from distlab.step_ledger import CONNECTION_LOST

POLL_S = 0.1
FAILURE_GRACE_S = 1.0  # after a first failure, how long to wait for the other ranks' reports
# ... and longer while every report is an echo (a lost connection): the peer whose timeout closed
# it is still writing its own (measured: 1 run in 10 of the uneven-inputs hang under load lost
# that report, and with it the cause, after 1 s)
ECHO_GRACE_S = 10.0
TERMINATE_GRACE_S = 3.0  # SIGTERM, then SIGKILL after this long
# A training rank that logs nothing for RunConfig.timeout_s + this long is stalled: a peer waiting
# on it in a collective would have timed out by then, and with no peer waiting (one rank, or
# every rank inside a model factory) nothing else would ever end the run.
SILENCE_GRACE_S = 15.0
STACK_WAIT_S = 1.0  # after SIGUSR1, how long a rank gets to dump its stack (faulthandler)
# A live line while wait() blocks: "starting 4 ranks", then step k/n with tokens/s and ETA.
# It starts with "\r", which terminals and Jupyter's output area redraw in place. Off by default
# (scripts and tests stay quiet); distlab.lab turns it on inside a notebook's kernel, and
# wait(progress=True) asks for it once. Only the main thread prints it by default: a print from
# another thread (an explorer's run behind a button) lands in whichever cell is executing.
SHOW_PROGRESS = False
PROGRESS_EVERY_S = 1.0

# Errors that are usually consequences of another rank failing, not causes.
_SECONDARY = re.compile(CONNECTION_LOST.pattern + r"|the cause is rank \d+'s error",
                        re.I)  # step_ledger.peers_left's
_TIMEOUT = re.compile(r"timed out|timeout", re.I)

_live_runs: "weakref.WeakSet[Run]" = weakref.WeakSet()

# gloo aborts the process (from its own thread: no Python error) when a peer's tensor has
# another size than this rank's
# ("op.preamble.length <= op.nbytes. 20 vs 16. Received data size doesn't match ...")
_SIZE_MISMATCH = re.compile(r"(\d+) vs (\d+)\. Received data size doesn't match")


def _size_mismatch_hint(stderr: str) -> str:
    """What a SIGABRT for gloo's size mismatch means, and how to have the tensor named."""
    m = _SIZE_MISMATCH.search(stderr or "")
    if not m:
        return ""
    return (f": gloo received a message of {m.group(1)} bytes for this rank's buffer of "
            f"{m.group(2)}, so the ranks passed tensors of different sizes to one "
            "collective (e.g. rows dropped inside forward differently per rank, under tensor "
            "parallelism). To have the layer and both shapes named, set "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL (RunConfig(debug=True), run_ranks(..., debug=True)) "
            "or pass check_shapes=True to parallelize_module")


class RunError(RuntimeError):
    """A run failed. `rank` is the rank whose failure came first; `traceback` is its own;
    `step` is the step it was in (the steps before it finished and are in the log)."""

    def __init__(self, rank: int, message: str, traceback: str = "", step: int | None = None):
        self.rank, self.message, self.traceback, self.step = rank, message, traceback, step
        where = f" at step {step}" if step is not None and step >= 0 else ""
        super().__init__(f"rank {rank} failed{where}: {message}"
                         + (f"\n\n--- traceback of rank {rank} ---\n{traceback}" if traceback else ""))

    def as_dict(self):
        return {"rank": self.rank, "message": self.message, "traceback": self.traceback,
                "step": self.step}


class RunStopped(RuntimeError):
    """The run was stopped (Run.stop, an explorer's Stop button) before its ranks returned what
    the caller waits for (distlab.caller.launch.run_ranks)."""


class Run:
    def __init__(self, run_dir: str, cfg: RunConfig | None = None, processes=None,
                 rendezvous: str | None = None,
                 world_size: int | None = None):
        self.dir = run_dir
        self.cfg = cfg
        self.world_size = world_size or (cfg.processes if cfg else 1)  # rank processes
        # steps rank 0 will log: the progress line's n (a launch of several configs in turn,
        # distlab.lab.runs.launch_together, sets the sum of theirs)
        self.total_steps: int | None = cfg.steps if cfg else None
        # each config's steps when a launch trains several in turn (launch_together): the
        # progress line then says which config runs, and its own step count and rate
        self.config_steps: list[int] | None = None
        self.processes = list(processes or [])
        self.pids = [p.pid for p in self.processes]
        self.events: list[dict] = []
        self.error: RunError | None = None
        self.status = "running" if self.processes else "loaded"
        self.started = time.time()
        self.ended: float | None = None
        self._rendezvous = rendezvous  # the ranks' FileStore; removed when the run ends
        self._tails = [LogTail(rank_log_path(run_dir, r)) for r in range(self.world_size)]
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._stopping = False
        self._last_heard = [self.started] * self.world_size  # when each rank last logged
        self.problems: list[str] = []  # what went wrong around the run, not in it (reported once)
        self.unrecorded_steps = 0  # steps of a finished run whose events no log holds
        self._reported = False
        if self.processes:
            _live_runs.add(self)
            self._monitor = threading.Thread(target=self._watch, daemon=True,
                                             name=f"distlab-monitor-{os.path.basename(run_dir)}")
            self._monitor.start()
        else:
            self._finished.set()

    # -- reading ---------------------------------------------------------------------------
    def _read(self) -> list[dict]:
        new = [e for t in self._tails for e in t.read_new()]
        now = time.time()
        for e in new:
            if 0 <= e.get("rank", -1) < self.world_size:
                self._last_heard[e["rank"]] = now
            if e.get("kind") == "dropped":  # distlab.events.EventLog: a full disk, survived
                self.problems.append(f"rank {e['rank']} could not write {e['events']} event(s) "
                                     f"to its log: {e['why']}; the run went on")
            elif e.get("kind") == "warning":  # a rank's own (resume_from="auto" fell back)
                self.problems.append(f"rank {e['rank']}: {e['message']}")
        for t in self._tails:
            self.problems += t.skipped
            t.skipped = []
        if new:
            with self._lock:
                self.events.extend(new)
        return new

    def history(self, kind: str = "step", rank: int | None = None) -> list[dict]:
        with self._lock:
            return [e for e in self.events
                    if e["kind"] == kind and (rank is None or e["rank"] == rank)]

    def losses(self) -> list[float]:
        """Loss per step, averaged over the ranks that logged it: with equal per-rank slices this
        is the loss of the whole global batch."""
        by_step: dict[int, list[float]] = {}
        for e in self.history("step"):
            if e.get("loss") is not None:  # a parameter server logs steps without a loss
                by_step.setdefault(e["step"], []).append(e["loss"])
        return [sum(v) / len(v) for _, v in sorted(by_step.items())]

    def steps_done(self, until: float | None = None) -> int:
        """Steps every rank has finished (by time `until`, from the events' own times)."""
        last = {r: -1 for r in range(self.world_size)}
        for e in self.history("step"):
            if until is None or e["time"] <= until:
                last[e["rank"]] = max(last[e["rank"]], e["step"])
        return min(last.values()) + 1

    def info(self, key: str, default=None):
        """A field of rank 0's start event (n_params, loss_floor, device, backend, ...)."""
        starts = self.history("start", rank=0)
        return starts[0].get(key, default) if starts else default

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    # -- watching --------------------------------------------------------------------------
    def _watch(self):
        try:
            while True:
                self._read()
                codes = [p.exitcode for p in self.processes]
                if self._stopping:
                    return
                failed = any(c not in (None, 0) for c in codes) or any(
                    e["kind"] == "error" for e in self.events) or self._vanished(codes)
                if failed:
                    return self._fail()
                stalled = self._stalled()
                if stalled is not None:
                    return self._fail(stalled)
                if all(c == 0 for c in codes):
                    self._read()
                    # ranks that left on a preemption notice saved first (distlab.checkpoint)
                    return self._finish("preempted" if self.history("preempted") else "done")
                time.sleep(POLL_S)
        except BaseException as e:  # noqa: BLE001 - the monitor must never die silently
            self.error = RunError(-1, f"run monitor crashed: {e!r}")
            try:
                self._end_processes()
            finally:
                self._finish("failed")

    def _fail(self, cause: "RunError | None" = None):
        start = time.time()
        while (cause is None and any(p.exitcode is None for p in self.processes)
               and time.time() < start + (ECHO_GRACE_S if self._only_echoes() else FAILURE_GRACE_S)):
            self._read()  # give other ranks a moment to report: the earliest report is the cause
            time.sleep(POLL_S)
        codes = {r: p.exitcode for r, p in enumerate(self.processes)}
        if cause is None:
            cause = self._behind_a_timeout(codes)  # asks a live rank for its stack: before the end
        self._end_processes()
        self._read()
        self.error = cause or self._root_cause(codes)
        self._finish("failed")

    def _only_echoes(self) -> bool:
        """Every error reported so far is a consequence of another rank's (a lost connection)."""
        errors = self.history("error")
        return bool(errors) and all(_SECONDARY.search(e["error"]) for e in errors)

    # -- what the events cannot say: ranks that vanished, stopped or went silent ------------
    def _vanished(self, codes) -> bool:
        """A rank that exited with status 0 without logging "done" left the run midway."""
        if not any(c == 0 for c in codes):
            return False
        self._read()  # its "done" may have landed since the loop's read
        done = {e["rank"] for e in self.history("done")}
        if not any(c == 0 and r not in done for r, c in enumerate(codes)):
            return False
        if disk_full(self.dir):  # "done" could not be written: a full disk, not a vanished rank
            note = (f"the disk holding {self.dir} is full: a rank that exited with status 0 "
                    "could not log that it finished")
            if note not in self.problems:
                self.problems.append(note)
            return False
        return True

    def _stalled(self) -> "RunError | None":
        """A training rank silent past its limit: stopped (SIGSTOP, a debugger), or running
        somewhere it never leaves. Named with its stack when it can dump one."""
        if self.cfg is None:  # run_ranks' functions log nothing until they return
            return None
        limit = self.cfg.timeout_s + SILENCE_GRACE_S
        now = time.time()
        for r, p in enumerate(self.processes):
            quiet = now - self._last_heard[r]
            if p.exitcode is None and quiet > limit:
                return self._stuck_rank_error(r, f"logged nothing for {quiet:.0f} s "
                                                 f"(RunConfig.timeout_s + {SILENCE_GRACE_S:g} s)")
        return None

    def _stuck_rank_error(self, r: int, what: str, more: str = "") -> "RunError":
        last = self.last_steps().get(r, -1)
        state = process_state(self.pids[r])
        if state in ("T", "t"):
            how = ("it is stopped (process state T: SIGSTOP, Ctrl-Z or a debugger), so it "
                   "can neither step nor time out")
            stack = ""
        else:
            how = "it is alive and neither stepping nor failing; its stack below"
            stack = self._dump_stack(r)
        return RunError(r, f"rank {r} {what}; {how}. Last step it logged: {last}{more}", stack,
                        last + 1)

    def _dump_stack(self, r: int) -> str:
        """SIGUSR1 makes a launched rank write every thread's stack to its stderr file."""
        path = rank_stderr_path(self.dir, r)
        before = len(tail(path, 1 << 20))
        try:
            os.kill(self.pids[r], signal.SIGUSR1)
        except OSError:
            return ""
        time.sleep(STACK_WAIT_S)
        dump = tail(path, 1 << 20)[before:]
        return dump[-6000:]

    def _behind_a_timeout(self, codes: dict) -> "RunError | None":
        """A collective timed out: name the rank it waited for, not the rank that waited. A
        peer that finished the run means the ranks ran different numbers of steps; a stopped
        or silent live peer is the one at fault."""
        errors = [e for e in self.history("error") if _TIMEOUT.search(
            e["error"] + e["traceback"][-2000:]) and not _SECONDARY.search(e["error"])]
        if not errors or self.cfg is None:
            return None
        waited = min(errors, key=lambda e: e["time"])
        w, last = waited["rank"], self.last_steps()
        failed = {e["rank"] for e in self.history("error")}
        done = sorted({e["rank"] for e in self.history("done")})
        live = [r for r, c in codes.items() if c is None and r not in failed]
        if done and not live:
            return RunError(w, f"a collective timed out after {self.cfg.timeout_s:g} s "
                               f"(RunConfig.timeout_s) after rank(s) "
                               f"{', '.join(map(str, done))} had finished the run: the ranks "
                               f"ran different numbers of steps (last step logged per rank: "
                               f"{_per_rank(last)}). Every rank must take the same steps.\n"
                               f"{waited['error']}", waited["traceback"], waited.get("step"))
        if not live:
            return None
        stopped = [r for r in live if process_state(self.pids[r]) in ("T", "t")]
        r = (stopped or sorted(live, key=lambda r: (last.get(r, -1), r)))[0]
        return self._stuck_rank_error(r, f"never joined the collective rank {w} waited for "
                                         f"(it timed out after {self.cfg.timeout_s:g} s, "
                                         f"RunConfig.timeout_s)",
                                      f". Last step logged per rank: {_per_rank(last)}")

    def _root_cause(self, codes: dict) -> RunError:
        import signal as _signal
        last = self.last_steps()
        # A rank killed by a signal (OOM killer, preemption) writes nothing; it is the cause.
        server = _lost_fork_server()
        if server and any(c not in (None, 0) for c in codes.values()):
            # its ranks look "exited 255" (multiprocessing can no longer learn their status)
            r = next(r for r, c in codes.items() if c not in (None, 0))
            return RunError(r, f"the fork server the ranks were started from (pid {server}) is "
                               "gone, and the kernel ends its ranks with it (PR_SET_PDEATHSIG); "
                               f"rank {r} was the first to go. The next launch starts a new "
                               "fork server", "", last.get(r, -1) + 1)
        for r, c in codes.items():
            if c is not None and c < 0:
                name = _signal.Signals(-c).name
                said = tail(rank_stderr_path(self.dir, r), 3000).strip()
                return RunError(r, f"rank {r} was killed by {name} (exit code {c}); "
                                   f"last step it logged: {last.get(r, -1)}"
                                   + _size_mismatch_hint(said)
                                   + (f"; the last it wrote to stderr:\n{said}" if said else ""),
                                "", last.get(r, -1) + 1)
        done = {e["rank"] for e in self.history("done")}
        for r, c in codes.items():
            if c == 0 and r not in done:
                return RunError(r, f"rank {r} exited with status 0 in the middle of the run "
                                   f"(after step {last.get(r, -1)}), without an error: its code "
                                   "returned or called os._exit early, and its peers were left "
                                   "without it", "", last.get(r, -1) + 1)
        errors = self.history("error")
        primary = [e for e in errors if not _SECONDARY.search(e["error"])] or errors
        if not primary:
            r, c = next((r, c) for r, c in codes.items() if c not in (None, 0))
            said = tail(rank_stderr_path(self.dir, r), 3000).strip()
            return RunError(r, f"exited with code {c} before it could report an error: it failed "
                               "while starting (a script that launches runs needs `if __name__ "
                               "== '__main__':`); "
                               + (f"its stderr:\n{said}" if said else "it wrote no stderr"),
                            "", last.get(r, -1) + 1)
        e = min(primary, key=lambda e: e["time"])
        msg = e["error"]
        if _TIMEOUT.search(msg + e["traceback"][-2000:]) and self.cfg is not None:
            behind = _per_rank(last)
            msg = (f"a collective timed out after {self.cfg.timeout_s:g} s "
                   f"(RunConfig.timeout_s): a peer never joined it. It had stalled, died or run "
                   f"a different collective. Last step logged per rank: {behind}.\n{msg}")
        return RunError(e["rank"], msg, e["traceback"], e.get("step"))

    def last_steps(self) -> dict:
        last = {r: -1 for r in range(self.world_size)}
        for e in self.history("step"):
            last[e["rank"]] = max(last[e["rank"]], e["step"])
        return last

    def _end_processes(self):
        """SIGTERM to every live rank's process group (the rank and what it started), SIGKILL
        after TERMINATE_GRACE_S; then SIGKILL to what is left of the groups."""
        alive = [p for p in self.processes if p.exitcode is None]
        for p in alive:
            self._signal_rank(p, signal.SIGTERM)
        deadline = time.time() + TERMINATE_GRACE_S
        for p in alive:
            p.join(max(0.0, deadline - time.time()))
        for p in alive:
            if p.exitcode is None:
                self._signal_rank(p, signal.SIGKILL)
                p.join(5.0)
        self._end_groups()

    def _signal_rank(self, p, sig):
        """`sig` to the rank's process group (distlab.caller.launch makes each rank lead one,
        whose id is its pid), or to the rank alone if it has none yet."""
        try:
            os.killpg(p.pid, sig)
            if sig != signal.SIGKILL and process_state(p.pid) in ("T", "t"):
                os.killpg(p.pid, signal.SIGCONT)  # a stopped rank acts on SIGTERM once resumed
            return
        except OSError:
            pass
        (p.kill if sig == signal.SIGKILL else p.terminate)()

    def _end_groups(self):
        """Whatever a rank started and left behind (a model factory's workers) ends with it:
        a group whose id is a rank's pid exists only if that rank made it."""
        for pid in self.pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:  # no such group: nothing was left
                pass

    def _finish(self, status: str):
        """Record the outcome. Never raises: a folder deleted, made read-only or on a full disk
        costs status.json (noted in `problems`), not the outcome."""
        if self._finished.is_set():
            return
        try:
            for p in self.processes:
                p.join(5.0)
            self._end_groups()
            self._note_non_finite_loss()
            if status == "done":
                self._note_unrecorded_steps()
            self.status = status
            self.ended = time.time()
            self._remove_rendezvous()
            for t in self._tails:
                t.close()
            with open(os.path.join(self.dir, "status.json"), "w") as f:
                json.dump({"status": status, "started": self.started, "ended": self.ended,
                           "pids": self.pids,
                           "error": self.error.as_dict() if self.error else None}, f, indent=1)
        except OSError as e:
            self.problems.append(f"could not write {self.dir}/status.json ({e}): the run "
                                 f"ended {status}, but Run.load will not know it")
        finally:  # nothing may leave wait() hanging
            self._finished.set()

    def _note_non_finite_loss(self):
        """A run whose loss went NaN or inf still "succeeds": say so, once, as a warning."""
        bad = [e for e in self.history("step") if isinstance(e.get("loss"), float)
               and not math.isfinite(e["loss"])]
        if bad:
            first = min(bad, key=lambda e: (e["step"], e["rank"]))
            self.problems.append(f"the loss was {first['loss']} at step {first['step']} on rank "
                                 f"{first['rank']} ({len(bad)} step events in all): "
                                 "RunConfig(detect_nan=True) names the step, the rank and the "
                                 "module (or the input batch) where it was born")

    def _note_unrecorded_steps(self):
        """A run that ended "done" trained all its steps, but a full disk may have kept their
        events out of the logs (distlab.events.EventLog drops what it cannot write, and says so
        only at a later write that succeeds): count the steps no rank recorded, and say so."""
        trained = self._steps_trained()
        missing = len(trained - {e["step"] for e in self.history("step")})
        why = self._why_events_were_lost()
        if missing and why:  # (a rank out of data may step on without logging: no cause)
            self.unrecorded_steps = missing
            self.problems.append(f"events of {missing} of {len(trained)} steps were not "
                                 f"recorded: {why}; run.losses() holds the other "
                                 f"{len(trained) - missing}")

    def _why_events_were_lost(self) -> str | None:
        if disk_full(self.dir):
            return f"the run folder's disk is full ({self.dir})"
        if self.history("dropped"):  # the disk filled and was freed again
            return "the ranks could not write them to their logs"
        return None

    def _steps_trained(self) -> set[int]:
        """The step numbers a finished training run took: from its resume point (0 on a fresh
        start) to the last step its ranks said they finished, or the config's last. Empty where
        the logs cannot say (a run_ranks function; a resume whose "resume" event was lost and
        no step recorded)."""
        if self.cfg is None:
            return set()
        resumed = [e["steps_done"] for e in self.history("resume")]
        recorded = [e["step"] for e in self.history("step")]
        if resumed:
            first = resumed[0]
        elif not self.cfg.resume_from:
            first = 0
        elif recorded:
            first = min(recorded)  # at most the resume point: never counts a step too many
        else:
            return set()
        done = [e["last_step"] for e in self.history("done") if e.get("last_step") is not None]
        last = max(done) if done else self.cfg.steps - 1
        return set(range(first, last + 1))

    def _remove_rendezvous(self):
        try:
            if self._rendezvous:
                os.remove(self._rendezvous)
        except OSError:  # never made (a rank failed first), or the folder is gone
            pass

    # -- control ---------------------------------------------------------------------------
    def wait(self, timeout: float | None = None, progress: bool | None = None) -> "Run":
        """Block until the run ends; raise its RunError if it failed. On KeyboardInterrupt (a
        kernel interrupt) or when `timeout` seconds pass, stop the run first, then raise.
        `progress`: print a live progress line while waiting (default: SHOW_PROGRESS)."""
        show = progress if progress is not None else (
            SHOW_PROGRESS and threading.current_thread() is threading.main_thread())
        out, t0 = PROGRESS_OUT() if show else None, time.time()
        try:
            while not self._finished.wait(PROGRESS_EVERY_S if show else timeout):
                if timeout is not None and time.time() - t0 >= timeout:
                    self.stop()
                    raise TimeoutError(f"run {self.dir} did not finish within {timeout} s; "
                                       "stopped it")
                if out:
                    out.show(self.progress_line(time.time() - t0))
        except BaseException:
            self.stop()
            raise
        if out:
            out.show(self.progress_line(time.time() - t0), final=True)
        self._report_problems()
        if self.error is not None:
            raise self.error
        return self

    def progress_line(self, elapsed: float) -> str:
        """One line on where the run is: ranks starting, or step k/n, tokens/s and the ETA
        (rank 0's steps); when one launch trains several configs in turn (config_steps),
        which config runs, its step k/n and its own rate. At the end: how many steps in how
        long, and each config's rate. A count never passes its total (an unknown total is
        left out)."""
        steps = self.history("step", rank=0)
        if not steps:
            verb = "ended" if self.done else "starting"
            return f"{verb} {self.world_size} rank(s)... {elapsed:.0f} s"
        parts = _by_config(steps, self.config_steps)
        if self.done:  # the run's own duration, not how long this wait() took
            took = (self.ended or time.time()) - self.started
            rates = [r for r in (self._rate(p) for p in parts) if r]
            each = (", " + ", ".join(rates) if len(parts) == 1 else
                    f" ({len(parts)} configs: " + "; ".join(rates) + ")") if rates else ""
            return f"{self.status}: {len(steps)} steps in {took:.1f} s{each}"
        here, n = parts[-1], (self.config_steps[len(parts) - 1] if self.config_steps
                              and len(self.config_steps) >= len(parts) else self.total_steps)
        k = len(here)
        n = n if n and k <= n else None  # a count never passes its total
        which = f"config {len(parts)}/{len(self.config_steps)}: " if parts[1:] or (
            self.config_steps and len(self.config_steps) > 1) else ""
        rate = self._rate(here)
        took = max(here[-1]["time"] - here[0]["time"], 1e-9)
        left = (sum(self.config_steps) - len(steps) if self.config_steps
                else (n - k if n else None))
        eta = f", ETA {left * took / (k - 1):.0f} s" if left is not None and k > 1 else ""
        return (f"{which}step {k}{f'/{n}' if n else ''}" + (f", {rate}" if rate else "")
                + f"{eta} ({elapsed:.0f} s)")

    def _rate(self, steps: list) -> str:
        """tokens/s of the last of `steps`: rank 0's tokens times the data-parallel ranks
        reading as many (tensor- and pipeline-parallel ranks read the same rows, so they add
        none)."""
        last = steps[-1] if steps else {}
        dp = self.cfg.dp_degree if self.cfg is not None else 1
        return (f"{dp * last['tokens'] / last['step_s']:,.0f} tokens/s"
                if last.get("step_s") and last.get("tokens") else "")

    def _report_problems(self):
        """Once, in the caller's thread: what went wrong around the run (its folder deleted,
        a full disk, a corrupt event line), as a warning; the outcome is still the ranks'."""
        if self.problems and not self._reported:
            self._reported = True
            warnings.warn(f"run {os.path.basename(self.dir)}: " + "; ".join(self.problems),
                          RuntimeWarning, stacklevel=3)

    def preempt(self, grace_s: float = 120.0) -> "Run":
        """Preempt the whole job as a cloud reclaims a spot instance: SIGTERM to every rank (the
        notice), SIGKILL to any still alive grace_s later. A run with checkpoint_every > 0
        saves at the next step boundary and ends with status "preempted"; resume it with
        distlab.caller.resume. Without checkpointing, SIGTERM simply ends the ranks."""
        for p in self.processes:
            if p.exitcode is None:
                p.terminate()
        reclaim = threading.Timer(grace_s, self._reclaim)
        reclaim.daemon = True  # a caller that exits earlier is not held up by it
        reclaim.start()
        return self

    def _reclaim(self):
        if not self._finished.is_set():  # the grace is over: what is left is killed
            for p in self.processes:
                if p.exitcode is None:
                    p.kill()

    def stop(self) -> "Run":
        """End every rank now (SIGTERM, then SIGKILL). Events written so far are kept."""
        if self._finished.is_set():
            return self
        self._stopping = True
        self._monitor.join(5.0)
        self._end_processes()
        self._read()
        if not self._finished.is_set():
            self._finish("stopped")
        return self

    # -- reopening -------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str) -> "Run":
        """Reopen a run from its folder (finished or not; nothing is started)."""
        path = os.path.abspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no run folder at {path}")
        cfg = None
        if os.path.exists(os.path.join(path, "config.json")):
            with open(os.path.join(path, "config.json")) as f:
                cfg = RunConfig.from_dict(json.load(f))
        world = cfg.processes if cfg else len(glob.glob(os.path.join(path, "rank*.jsonl")))
        run = cls(path, cfg=cfg, world_size=world)
        run._read()
        for t in run._tails:  # a snapshot: the files are not watched
            t.close()
        status_path = os.path.join(path, "status.json")
        if os.path.exists(status_path):
            with open(status_path) as f:
                st = json.load(f)
            run.status = st["status"]
            run.started, run.ended = st.get("started", run.started), st.get("ended")
            if st.get("error"):
                run.error = RunError(**st["error"])
        return run

    def __repr__(self):
        return (f"Run({os.path.basename(self.dir)}, status={self.status}, "
                f"steps={self.steps_done()}/{self.cfg.steps if self.cfg else '?'})")

    def _repr_markdown_(self) -> str:
        """What a notebook shows for a cell ending in a run: a sentence, not the repr."""
        line = self.progress_line(0.0) if self.done else f"{self.status}"
        return f"run `{os.path.basename(self.dir)}`: {line}"


def process_state(pid: int) -> str:
    """The kernel's one-letter state of a process (R running, S sleeping, T stopped, Z zombie),
    from /proc; "" where there is no /proc or no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def _lost_fork_server() -> int | None:
    """The pid of multiprocessing's fork server (distlab.caller.launch.rank_context) if this
    process started one and it has died since (gone, or a zombie not yet reaped)."""
    from multiprocessing import forkserver
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    return pid if pid and process_state(pid) in ("", "Z") else None


def disk_full(path: str, slack: int = 64 * 1024) -> bool:
    """Less than `slack` bytes free for this user on the filesystem holding `path`."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < slack


def _per_rank(last: dict) -> str:
    return ", ".join(f"rank {r}: {s}" for r, s in sorted(last.items()))


@atexit.register
def _stop_live_runs():
    for run in list(_live_runs):
        run.stop()


def _by_config(steps: list[dict], config_steps: list[int] | None) -> list[list[dict]]:
    """Rank 0's step events cut into the configs a launch trained in turn (config_steps: how
    many each), the last one possibly unfinished; one part without config_steps."""
    if not config_steps or len(config_steps) < 2:
        return [steps]
    parts, i = [], 0
    for n in config_steps:
        if i >= len(steps):
            break
        parts.append(steps[i:i + n])
        i += n
    return parts



class ProgressOut:
    """Where wait()'s progress line goes: one terminal line rewritten with a carriage return,
    padded over the longer one before it. In a notebook distlab.lab swaps in one that updates
    a single output in place (this layer does not import IPython)."""

    def __init__(self):
        self.width = 0

    def show(self, line: str, final: bool = False) -> None:
        pad, self.width = max(self.width - len(line), 0), max(self.width, len(line))
        print("\r" + line + " " * pad, end="\n" if final else "", flush=True)


PROGRESS_OUT = ProgressOut  # what wait() makes for its line (distlab.lab's in a notebook)
