"""Which step each rank has begun, kept in the process group's store, so that a collective that
fails can say when the ranks disagree about the step count.

A rank that runs one more step than its peers waits in a collective that nobody else joins:
gloo then says only "Timed out waiting ... for recv" once the whole timeout has passed, or
"Connection closed by peer" if the peer has already exited, and neither names the cause.
Each wrapper (DistributedDataParallel, fully_shard, ZeroOptimizer, PipelineSchedule) writes
"<wrapper> <step>" under this rank's key as each of its steps begins: one store write (25 µs
with a FileStore on the 2-core CPU machine, measured; the store travels on the side, not through
the collectives). When a collective of distlab.comm.Comm fails, the failing rank reads its
group's entries (without waiting for a missing one) and, if they differ, the error starts with
them: "ranks are at different steps: rank 0 began DistributedDataParallel step 3, rank 1 step 2".

**Peers that failed or left.** A rank also writes its state when it stops training: "failed:
<the error>" (an exception that ends the process, or launch()'s rank that failed), "finished"
(launch()'s rank done with its function, in the closing barrier), "in torch.distributed.barrier"
(while a script's own dist.barrier() blocks, once a wrapper has begun a step) and "exited"
(atexit). A rank blocked in a collective reads its group's states every second
(distlab.comm.wait_watching): a peer that failed is named as the cause, and a peer that left
its loop ends the wait at once, instead of the process group's timeout (torch's default for
gloo: 30 minutes), with the step mismatch said where there is one. Measured before (torchrun,
2 ranks, rank 1 one DistributedDataParallel step more, rank 0 ending with dist.barrier()): both
ranks waited until the timeout.
"""

from __future__ import annotations

import atexit
import functools
import re
import shutil
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from distlab.units import FULL_DISK_BYTES

PREFIX = "distlab/step/"
STATE = "distlab/state/"  # a rank's state once it stops training (mark)
_disk = {"folder": None}  # where the launcher's FileStore lives (watch_disk)


def watch_disk(folder: str) -> None:
    """The default store is a FileStore in `folder` (distlab's launcher): the ledger touches it
    only while the disk has room. On a full disk a FileStore operation can block for good
    (measured: a launched rank writing its ledger hung at step 9 of 40 in 2 of 7 runs on a
    full 512 KiB tmpfs under load, none with the ledger off)."""
    _disk["folder"] = folder


def _store():
    folder = _disk["folder"]
    if folder is not None:
        try:
            if shutil.disk_usage(folder).free < FULL_DISK_BYTES:
                return None
        except OSError:
            return None
    try:  # the default group's store: torch's own, not a public name (torch 2.6 to 2.13)
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


class StepCounter:
    """One wrapper's step count on this rank; begin() counts a step and writes it down."""

    def __init__(self, owner: str):
        self.owner, self.step, self.off = owner, 0, False

    def begin(self) -> None:
        self.step += 1
        store = None if self.off else _store()
        if store is None:
            return
        try:
            store.set(f"{PREFIX}{dist.get_rank()}", f"{self.owner} {self.step}")
        except RuntimeError:  # a FileStore on a full disk: the ledger stops, not the run
            self.off = True
            return
        _watch_the_end()

    def note_rows(self, rows: int) -> None:
        """This rank's rows in the step begun (a data-parallel wrapper's batch)."""
        store = None if self.off else _store()
        if store is not None:
            try:
                store.set(f"{PREFIX}rows/{dist.get_rank()}", f"{self.step} {rows}")
            except RuntimeError:
                self.off = True

    def uneven_rows(self, group, rows: int) -> str | None:
        """The peers that wrote another row count for this same step, in words, else None.
        Called once this step's collectives completed: every peer has written this step's
        count by then (or a later step's, which is skipped)."""
        if self.off:
            return None
        other = {}
        for r, entry in _entries(f"{PREFIX}rows/", group).items():
            step, n = map(int, entry.split())
            if r != dist.get_rank() and step == self.step and n != rows:
                other[r] = n
        if not other:
            return None
        theirs = ", ".join(f"rank {r} {n}" for r, n in sorted(other.items()))
        return (f"ranks fed different numbers of rows in {self.owner} step {self.step}: rank "
                f"{dist.get_rank()} {rows}, {theirs}. Data parallelism averages the ranks' "
                "gradients with equal weight (torch's DDP too), so a row on a rank with fewer "
                "weighs more and the result is not the gradient of the global batch's mean "
                "loss. Give every rank the same number of rows (DistributedSampler with "
                "drop_last=True), or scale each rank's loss by its rows x world / total rows")


def _entries(prefix: str, group) -> dict[int, str]:
    """{rank: entry} of the group's ranks that wrote `prefix`<rank>; {} when there is no store
    or it went with its host (no report, and no new error on top of the one being reported)."""
    store = _store()
    if store is None:
        return {}
    seen = {}
    try:
        for r in dist.get_process_group_ranks(group or dist.group.WORLD):
            key = f"{prefix}{r}"
            if store.check([key]):  # get() would wait for a key that is never written
                seen[r] = store.get(key).decode()
    except (RuntimeError, ValueError):
        return {}
    return seen


def disagreement(group=None) -> str | None:
    """'ranks are at different steps: ...' when the group's ranks wrote different steps, else
    None (all equal, or nothing written: a loop that uses none of the wrappers)."""
    seen = _entries(PREFIX, group)
    if len(set(seen.values())) < 2:
        return None
    parts = [f"rank {r} began {v.rsplit(' ', 1)[0]} step {v.rsplit(' ', 1)[1]}"
             for r, v in sorted(seen.items())]
    return ("ranks are at different steps: " + ", ".join(parts) + ". Every rank must run the "
            "same number of steps (split the data evenly, e.g. DistributedSampler with "
            "drop_last=True, and end the loop on the same condition on every rank)")


# -- peers that failed or left their loop ------------------------------------------------------
class PeersLeft(RuntimeError):
    """A collective that cannot complete: a peer of its group failed or left its loop."""


# Final states never change once written; the others ("in torch.distributed.barrier",
# "waiting: ...") are cleared when the call returns, so a reader acts on one only when two
# reads WATCH_S apart saw it (a state read just before its rank cleared it is not a deadlock).
FINAL = ("failed", "finished", "exited")
WATCH_S = 1.0  # between two reads of the peers' states while a wait blocks (wait_watching)

_state = {"mine": "", "watching": False}
# gloo's words when the other end of a connection went away: the echo of a failure elsewhere
CONNECTION_LOST = re.compile(r"Connection closed by peer|Connection reset|Broken pipe|"
                             r"remote worker crash|ECONNRESET|peer has closed", re.I)
TIMED_OUT = re.compile(r"time[sd]? ?out", re.I)  # a wait that timed out, as gloo says it
_blocked: dict = {}  # the point-to-point wait the main thread is in: what, since, published


def mark(state: str) -> None:
    """Write this rank's state for its peers ("failed: ...", "finished", "exited", "in
    torch.distributed.barrier", "waiting: recv from rank 1"; "" clears it). A failure is not
    overwritten."""
    if _state["mine"].startswith("failed") or not dist.is_initialized():
        return
    store = _store()
    if store is None:
        return
    state = state.splitlines()[0][:300] if state else ""  # a state, not a traceback
    try:
        store.set(f"{STATE}{dist.get_rank()}", state)
        _state["mine"] = state
    except RuntimeError:
        pass


def _watch_the_end() -> None:
    """Once per process, when a wrapper first writes the ledger: note how the process ends
    (an uncaught exception, an exit) and while a script's dist.barrier() blocks."""
    if _state["watching"]:
        return
    _state["watching"] = True
    atexit.register(mark, "exited")
    hook = sys.excepthook

    def failed(kind, value, tb):  # torchrun's ranks end here on an uncaught exception
        mark(f"failed: {kind.__name__}: {value}")
        hook(kind, value, tb)
    sys.excepthook = failed
    dist.barrier = functools.wraps(dist.barrier)(functools.partial(_noted_barrier,
                                                                   dist.barrier))


def _noted_barrier(barrier, group=None, async_op=False, device_ids=None):
    """The script's own dist.barrier(): its loop may be over, so say so while it blocks, and
    wait watching the peers (a peer that failed is named)."""
    if async_op:
        return barrier(group=group, async_op=True, device_ids=device_ids)
    before = _state["mine"]
    if not before:
        mark("in torch.distributed.barrier")
    try:
        wait_watching(barrier(group=group, async_op=True, device_ids=device_ids), group)
    except PeersLeft:
        raise
    except RuntimeError as e:  # a peer's failure or exit: named, as distlab's waits do
        why = peers_left(group, own_error=str(e))
        if why is None:
            raise
        raise RuntimeError(f"{why}.\n{e}") from e
    finally:
        if not before:
            mark("")


def wait_watching(work, group, unsliced: str | None = None) -> None:
    """work.wait() that ends early, saying why, when a peer of `group` failed or left its
    loop (peers_left), instead of at the group's timeout. gloo's collectives take a timed
    wait and can be waited on again after it. Its sends and receives cannot (a timed-out
    receive closes the connection), nor its reduce-scatter (its wait ignores the timeout):
    for those (`unsliced`: "recv from rank 1", "reduce_scatter on ranks 0,1") a watcher
    thread publishes the wait once it has lasted WATCH_S, and a peer that left its loop reads
    it and ends the run. NCCL's wait is a stream dependency, not a block: waited on plainly."""
    if _backend(group) != "gloo" or _store() is None:
        work.wait()
        return
    if unsliced is not None:
        _wait_published(work, unsliced)
        return
    seen: dict = {}
    while True:
        try:
            work.wait(timeout=timedelta(seconds=WATCH_S))
            return
        except RuntimeError:
            if work.is_completed():  # it ended (in an error, or just now): its own outcome
                work.wait()
                return
        why, seen = _stuck(group, seen)
        if why is not None:
            raise PeersLeft(why)


def _wait_published(work, what: str) -> None:
    _blocked.update(what=what, since=time.monotonic(), published=False)
    _start_watcher()
    try:
        work.wait()
    finally:
        if _blocked.get("published"):
            mark("")  # the watcher said this rank was waiting: it is not any more
        _blocked.clear()


def _start_watcher() -> None:
    if _state.get("watcher") is None:
        _state["watcher"] = threading.Thread(target=_watch_p2p, name="distlab-p2p-watch",
                                             daemon=True)
        _state["watcher"].start()


def _watch_p2p() -> None:
    """Publish an unsliced wait that has blocked for WATCH_S (the main thread cannot: it is
    inside gloo's wait)."""
    while True:
        time.sleep(WATCH_S / 2)
        since, what = _blocked.get("since"), _blocked.get("what")
        if what and not _blocked.get("published") and time.monotonic() - since >= WATCH_S:
            _blocked["published"] = True
            mark(f"waiting: {what}")


_BACKENDS: dict = {}


def _backend(group) -> str:
    key = id(group)
    if key not in _BACKENDS:
        try:
            _BACKENDS[key] = str(dist.get_backend(group))
        except (RuntimeError, ValueError):
            _BACKENDS[key] = ""
    return _BACKENDS[key]


def _states(group) -> dict[int, str]:
    return {r: v for r, v in _entries(STATE, group).items() if v and r != dist.get_rank()}


def _stuck(group, seen: dict) -> tuple[str | None, dict]:
    """peers_left's answer while this rank blocks in a collective of `group`: a final state
    at once, another only once two reads saw it; and this read, for the next."""
    now = _states(group)
    settled = {r: v for r, v in now.items() if v.startswith(FINAL) or seen.get(r) == v}
    return (peers_left(group, settled) if settled else None), now


def _ranks_of(waiting: str) -> list[int]:
    """The ranks a published wait needs: "recv from rank 1" -> [1], "... on ranks 0,1" ->
    [0, 1]."""
    tail = waiting.rsplit(" ", 1)[-1]
    return [int(r) for r in tail.split(",") if r.isdigit()]


def peers_left(group=None, states: dict | None = None, own_error: str = "") -> str | None:
    """Why a collective of `group` cannot complete, if a peer failed, left its loop or waits
    for a message from this rank (its state, its last step, and the step mismatch when there
    is one); else None.

    own_error: this rank's error, when it has one. If it is a timeout, a peer that failed
    only because its connection closed is not the cause: gloo closes a connection when a wait
    on it times out, so the peer's loss is this rank's timeout seen from the other end
    (measured: 1 run in 10 of 02's uneven-inputs hang under load named the peer's
    "Connection closed by peer" as the cause of this rank's own timeout)."""
    states = _states(group) if states is None else states
    if TIMED_OUT.search(own_error):
        states = {r: v for r, v in states.items()
                  if not (v.startswith("failed") and CONNECTION_LOST.search(v))}
    me = dist.get_rank()
    # a peer blocked on a call that needs this rank: hopeless once this rank left its loop
    left = _state["mine"] in ("finished", "in torch.distributed.barrier")
    states = {r: v for r, v in states.items()
              if v.startswith(FINAL) or v == "in torch.distributed.barrier"
              or (left and v.startswith("waiting:") and me in _ranks_of(v))}
    if not states:
        return None
    steps = {r: "{} step {}".format(*v.rsplit(" ", 1))
             for r, v in _entries(PREFIX, group).items()}
    began = lambda r: (f"its last step began: {steps[r]}" if r in steps  # noqa: E731
                       else "before any step")
    for r, v in sorted(states.items()):
        if v.startswith("failed"):
            return (f"rank {r} failed ({v.removeprefix('failed: ')}; {began(r)}), so this "
                    f"rank's collective cannot complete: the cause is rank {r}'s error")
    r, v = sorted(states.items())[0]
    said = {"finished": "finished its run", "exited": "exited",
            "in torch.distributed.barrier": "left its loop: it waits in dist.barrier()"}
    mine = steps.get(me, "no step")
    if v.startswith("waiting:"):  # this rank is the one that left
        out = (f"rank {r} waits in {v.removeprefix('waiting: ')} ({began(r)}), which needs "
               f"this rank, and this rank has left its loop (its last step began: {mine})")
    else:
        out = (f"rank {r} {said.get(v, v)} ({began(r)}) while this rank waits in a collective "
               f"(its last step began: {mine})")
    why = disagreement(group)
    return out + (f". {why}" if why else "")
