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
"""

from __future__ import annotations

import shutil

import torch.distributed as dist

from distlab.units import FULL_DISK_BYTES

PREFIX = "distlab/step/"
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
