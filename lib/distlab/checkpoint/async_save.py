"""Asynchronous saves (RunConfig.checkpoint_async): the step is blocked only while the state is
staged, a copy in memory, and a thread writes the copy while training goes on, as
torch.distributed.checkpoint.async_save does with its staging and its background writer.

    staged = staged_copy(state)                    the step waits for this copy only
    save = BackgroundSave(staged, tmp, ...)        a thread: the files, fsynced, then its record
    ...training goes on...
    save.wait()                                    before the next save, and at the end

The commit needs every rank's file records (meta.json lists them). A collective from the thread
would interleave with the training's own on the same process group, so each rank's thread
writes its records to `<tmp>/written/rank<r>.json` instead, and rank 0's thread, once it has
them all, commits as a synchronous save does (meta.json, rename, prune). Nothing is committed
before every rank's files are on disk: a writer that dies leaves the temporary folder, which a
resume never reads and the next commit's prune removes; one whose write fails (a full disk)
removes it, so the partial save does not hold the disk. Either error is raised in the training
loop at the next save or at the end (`wait`), naming the step, a full disk as such.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time

import torch

from distlab.checkpoint.store import commit, fsync_dir, write_file
from distlab.parallel.state import CheckpointError

WRITTEN = "written"  # the ranks' file records, inside the temporary folder until the commit
POLL_S = 0.05


def staged_copy(obj):
    """A copy of `obj` that training can no longer change: every tensor copied to the CPU (the
    optimizer steps the originals in place), containers rebuilt, plain values kept."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: staged_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(staged_copy(v) for v in obj)
    return obj


class BackgroundSave:
    """One rank's write of one staged save, on a thread. files: {path relative to tmp: object};
    rank 0 also gets the commit's arguments (meta without its "files", the final folder)."""

    def __init__(self, files: dict, tmp: str, rank: int, world: int, steps_done: int,
                 timeout_s: float, commit_to: dict | None = None):
        self.tmp, self.rank, self.world, self.steps_done = tmp, rank, world, steps_done
        self.timeout_s, self.commit_to = timeout_s, commit_to
        self.error: BaseException | None = None
        self.records: dict = {}
        self.write_s = 0.0
        self._thread = threading.Thread(target=self._run, args=(files,), daemon=True,
                                        name=f"distlab-save-{steps_done}")
        self._thread.start()

    def _run(self, files: dict) -> None:
        t0 = time.perf_counter()
        try:
            self.records = {rel: write_file(os.path.join(self.tmp, rel), obj, self.rank)
                            for rel, obj in files.items()}
            self._publish()
            if self.commit_to is not None:
                self._commit()
        except BaseException as e:  # noqa: BLE001 - raised in the loop by wait()
            self.error = e
            if isinstance(e, OSError):  # this rank's write failed: the partial save must not
                shutil.rmtree(self.tmp, ignore_errors=True)  # hold the disk (as a sync save)
        self.write_s = time.perf_counter() - t0

    def _publish(self) -> None:
        path = os.path.join(self.tmp, WRITTEN, f"rank{self.rank}.json")
        with open(path + ".part", "w", encoding="utf-8") as f:
            json.dump(self.records, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(path + ".part", path)  # whole or absent

    def _commit(self) -> None:
        """Rank 0: every rank's records, then the commit of a synchronous save."""
        folder = os.path.join(self.tmp, WRITTEN)
        deadline = time.monotonic() + self.timeout_s
        while len([n for n in os.listdir(folder) if n.endswith(".json")]) < self.world:
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world)
                           if not os.path.exists(os.path.join(folder, f"rank{r}.json"))]
                raise TimeoutError(f"rank(s) {missing} did not finish writing within "
                                   f"{self.timeout_s:g} s; the save was not committed")
            time.sleep(POLL_S)
        files = {}
        for r in range(self.world):
            with open(os.path.join(folder, f"rank{r}.json"), encoding="utf-8") as f:
                files.update(json.load(f))
        shutil.rmtree(folder)
        fsync_dir(self.tmp)
        c = self.commit_to
        commit(self.tmp, c["final"], c["root"], {**c["meta"], "files": files}, c["keep_last"])

    def wait(self) -> float:
        """Join the thread; raise its error, naming the step. Returns its write seconds."""
        self._thread.join()
        if isinstance(self.error, OSError) and self.error.errno == errno.ENOSPC:
            raise CheckpointError(
                f"no space left on device writing step {self.steps_done}'s checkpoint in the "
                f"background ({os.path.dirname(self.tmp)}): free some space or set "
                "checkpoint_dir to a larger disk; the partial save was removed, and the "
                "checkpoint before it is intact") from self.error
        if self.error is not None:
            raise RuntimeError(f"the background save of step {self.steps_done} failed: "
                               f"{type(self.error).__name__}: {self.error}; the checkpoint "
                               "before it is intact") from self.error
        return self.write_s
