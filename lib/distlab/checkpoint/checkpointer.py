"""Checkpointing inside distlab.rank.train's loop, on one rank: save when due (or when the job got a
preemption notice), restore at the start. The format on disk is distlab.checkpoint.store's;
what a rank's state is, its strategy says (Strategy.checkpoint_state / load_checkpoint_state)."""

from __future__ import annotations

import errno
import glob
import os
import shutil
import time
import warnings

import torch
import torch.distributed as dist

from distlab.checkpoint.async_save import WRITTEN, BackgroundSave, staged_copy
from distlab.checkpoint.preemption import PreemptionNotice
from distlab.checkpoint.state import rng_state, scaler_tensors, set_rng_state
from distlab.checkpoint.store import (DCP_DIR, FORMAT_VERSION, RNG_DIR, STATE, CheckpointError,
                                      check_compatible, checkpoint_root, commit, read_meta,
                                      record, resolve, storage_writer, torch_load, verify,
                                      write_file)
from distlab.modules import tensors_in
from distlab.units import FULL_DISK_BYTES, tensor_bytes


def no_space_left(e: BaseException) -> bool:
    """Whether a full disk is behind `e`: an OSError with errno ENOSPC anywhere in its chain,
    or among DCP's per-rank failures (CheckpointException.failures), whose own message may
    not say it."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(x):
            return True
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo.extend(f for f in failures.values() if isinstance(f, BaseException))
        todo.extend([x.__cause__, x.__context__])
    return False




def _free_bytes(path: str) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:  # the folder is gone (removed by a peer's cleanup): ask its parent
        parent = os.path.dirname(path)
        return _free_bytes(parent) if parent != path else 1 << 62


class Checkpointer:
    """One rank's checkpointing, as the loop uses it:

        ckpt = Checkpointer.for_run(cfg, ...)    NoCheckpoints() if it neither saves nor resumes
        start = ckpt.restore()                    steps already done (0: a fresh start)
        after each step's update:  if ckpt.after_step(step): break    (preempted)
    """

    def __init__(self, cfg, rank, world, device, strategy, model, optimizer, scaler, log):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.strategy, self.model, self.optimizer, self.scaler = strategy, model, optimizer, scaler
        self.log, self.comm = log, strategy.comm
        self.root = checkpoint_root(cfg, os.path.dirname(os.path.abspath(log.path)))
        self.format = strategy.checkpoint_format
        self.notice = PreemptionNotice() if cfg.checkpoint_every else None
        self.pending: BackgroundSave | None = None  # an asynchronous save being written

    @classmethod
    def for_run(cls, cfg, *args):
        return cls(cfg, *args) if (cfg.checkpoint_every or cfg.resume_from) else NoCheckpoints()

    # -- in the loop -----------------------------------------------------------------------
    def after_step(self, step: int) -> bool:
        """Save if this step is due (or the job was preempted). True: leave the loop now."""
        k, last = self.cfg.checkpoint_every, step == self.cfg.steps - 1
        due = bool(k) and ((step + 1) % k == 0 or last)
        preempted = self._preempt_agreed()
        if due or preempted:
            self.save(step, "preempted" if preempted else "final" if last else "periodic")
        if preempted:
            got = self.notice.received
            self.log.write("preempted", step=step, steps_done=step + 1, notice_here=got is not None,
                           notice_to_exit_s=None if got is None else time.time() - got)
        if preempted or last:
            self.close()
        return preempted

    def _preempt_agreed(self) -> bool:
        """Did any rank get the notice? All must agree, or some would save (a collective)
        while the others run the next step's."""
        if self.notice is None:
            return False
        flag = torch.tensor([float(self.notice.received is not None)], device=self.device)
        if self.world > 1:
            self.comm.all_reduce_async(flag, kind="preempt.flag").wait()
        return bool(flag.item() > 0)

    def close(self):
        self.finish_pending()
        if self.notice is not None:
            self.notice.close()
            self.notice = None

    def finish_pending(self) -> float:
        """Wait for an asynchronous save still being written (its error is raised here) and log
        that it was written; the seconds waited."""
        if self.pending is None:
            return 0.0
        t0, save = time.perf_counter(), self.pending
        self.pending = None
        write_s = save.wait()
        self.log.write("checkpoint_written", steps_done=save.steps_done, write_s=write_s)
        return time.perf_counter() - t0

    # -- save --------------------------------------------------------------------------------
    def save(self, step: int, reason: str = "periodic") -> str:
        """Write the state after `step` as <root>/step_<step+1>: every rank its files into a
        temporary folder, then rank 0 commits it (meta.json, rename). A collective."""
        t0 = time.perf_counter()
        waited = self.finish_pending()  # one save at a time: the previous one first
        steps_done = step + 1
        name = f"step_{steps_done:06d}"
        final, tmp = os.path.join(self.root, name), os.path.join(self.root, f".{name}.tmp")
        background = self.cfg.checkpoint_async and reason == "periodic"  # the run goes on
        try:
            if background:
                self._stage(step, reason, final, tmp)
            else:
                self._write(step, reason, final, tmp)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            # a full disk, said by errno or not (torch's zip writer reports "unexpected pos")
            full = no_space_left(e) or _free_bytes(self.root) < FULL_DISK_BYTES
            if isinstance(e, OSError) or full:  # this rank's write failed: the partial save
                shutil.rmtree(tmp, ignore_errors=True)  # must not hold the disk
            # (a peer that died mid-save leaves the temporary, as a killed job would: the next
            # save's prune removes it, and a resume never reads it)
            if full:  # numbered as its folder is (and as the RunError's step): steps done
                raise CheckpointError(
                    f"no space left on device saving step {steps_done}'s checkpoint ({name}) "
                    f"under {self.root} ({_free_bytes(self.root):,} bytes free): free some "
                    "space or set checkpoint_dir to a larger disk; the partial save was "
                    "removed") from e
            raise
        # seconds: what the step was blocked for (a synchronous save: all of it)
        self.log.write("checkpoint", step=step, steps_done=steps_done, reason=reason,
                       format=self.format, seconds=time.perf_counter() - t0,
                       bytes=self._bytes, files=self._files, path=final,
                       background=background, waited_s=waited)
        return final

    def _stage(self, step: int, reason: str, final: str, tmp: str) -> None:
        """An asynchronous save: the folder made, the state copied, a thread to write it."""
        self._prepare(tmp, background=True)
        state = self.strategy.checkpoint_state(self.model, self.optimizer)  # may gather
        files = {f"{RNG_DIR}/rank{self.rank}.pt": rng_state(self.device)}
        commit_to = None
        if self.rank == 0:
            state["scaler"] = self.scaler.state_dict() if self.scaler.enabled else None
            files[STATE] = staged_copy(state)
            commit_to = {"final": final, "root": self.root, "keep_last": self.cfg.keep_last,
                         "meta": self._meta(step, reason, [])}
        self.pending = BackgroundSave(files, tmp, self.rank, self.world, step + 1,
                                      self.cfg.timeout_s, commit_to)
        self._bytes = sum(tensor_bytes(t) for t in tensors_in(files))
        self._files = {}  # known once written (checkpoint_written, meta.json)

    def _prepare(self, tmp: str, background: bool = False) -> None:
        """Rank 0 makes the temporary folder (a crashed save of this step removed), then all
        meet: nobody writes into a folder that is not there."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, RNG_DIR))
            if background:  # where the ranks' threads leave their records (async_save)
                os.makedirs(os.path.join(tmp, WRITTEN))
        dist.barrier()

    def _write(self, step: int, reason: str, final: str, tmp: str) -> None:
        self._prepare(tmp)
        kill = (self.cfg.fault == "kill_in_save" and self.rank == self.cfg.fault_rank
                and step == self.cfg.fault_step
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")
        if kill:
            self.log.write("fault", fault="kill_in_save", step=step)
        if self.format == "full":
            files = self._save_full(tmp, kill)
        else:
            files = self._save_sharded(tmp, kill)
        rng_rel = f"{RNG_DIR}/rank{self.rank}.pt"
        files[rng_rel] = write_file(os.path.join(tmp, rng_rel), rng_state(self.device),
                                    self.rank, kill_halfway=kill and rng_rel == self._kill_target)
        gathered = [None] * self.world
        dist.all_gather_object(gathered, files)
        if self.rank == 0:
            commit(tmp, final, self.root, self._meta(step, reason, gathered), self.cfg.keep_last)
        dist.barrier()  # nobody goes on before the checkpoint exists
        self._bytes = sum(r["bytes"] for r in files.values())
        self._files = {rel: r["bytes"] for rel, r in files.items()}

    @property
    def _kill_target(self) -> str:
        """The file the drill 'kill_in_save' cuts short: the rank's largest."""
        if self.format == "sharded":
            return "dcp"
        return STATE if self.rank == 0 else f"{RNG_DIR}/rank{self.rank}.pt"

    def _save_full(self, tmp: str, kill: bool) -> dict:
        state = self.strategy.checkpoint_state(self.model, self.optimizer)  # every rank: may gather
        if self.rank != 0:
            return {}
        state["scaler"] = self.scaler.state_dict() if self.scaler.enabled else None
        return {STATE: write_file(os.path.join(tmp, STATE), state, self.rank,
                                  kill_halfway=kill and self._kill_target == STATE)}

    def _save_sharded(self, tmp: str, kill: bool) -> dict:
        import torch.distributed.checkpoint as dcp
        dcp.save(self._sharded_state(for_load=False),
                 storage_writer=storage_writer(os.path.join(tmp, DCP_DIR), kill))
        mine = glob.glob(os.path.join(tmp, DCP_DIR, f"__{self.rank}_*.distcp"))
        if self.rank == 0:
            mine.append(os.path.join(tmp, DCP_DIR, ".metadata"))
        return {os.path.relpath(f, tmp): record(f, self.rank) for f in mine}

    def _meta(self, step, reason, gathered) -> dict:
        return {"format_version": FORMAT_VERSION, "format": self.format, "steps_done": step + 1,
                "step": step, "reason": reason, "world_size": self.world,
                "strategy": self.cfg.strategy, "layout": self.strategy.checkpoint_layout,
                "optimizer_state": bool(self.optimizer.state),
                **self.strategy.checkpoint_meta(self.model),
                "config": self.cfg.to_dict(), "torch": torch.__version__, "time": time.time(),
                "files": {k: v for d in gathered for k, v in d.items()}}

    def _sharded_state(self, for_load: bool) -> dict:
        """What this rank hands DCP: the loss scaler's numbers and its strategy's shards (views
        that DCP loads into in place)."""
        state = scaler_tensors(self.scaler) if self.scaler.enabled else {}
        return {**state, **self.strategy.checkpoint_state(self.model, self.optimizer, for_load)}

    # -- restore -----------------------------------------------------------------------------
    def restore(self) -> int:
        """Load cfg.resume_from into this rank's model, optimizer, loss scaler and RNGs; return
        the steps it had done (where the loop starts). 0 when there is nothing to resume."""
        t0 = time.perf_counter()
        if self.cfg.resume_from == "auto":
            path = self._newest_that_verifies()
        else:
            path = resolve(self.cfg.resume_from, self.root)
            if path is not None:
                self._check(path)
        if path is None:
            return 0
        meta = read_meta(path)
        rng_file = self._rng_file(meta)
        if meta["layout"] != self.strategy.checkpoint_layout:
            self._load_canonical(path, meta)
        elif meta["format"] == "full":
            self._load_full(path)
        else:
            self._load_sharded(path, meta)
        set_rng_state(torch_load(os.path.join(path, rng_file)), self.device)
        dist.barrier()
        self.comm.take_step_stats()  # loading's traffic (ZeRO's all-gathers) is not a step's
        self.log.write("resume", path=path, steps_done=meta["steps_done"],
                       saved_world_size=meta["world_size"], saved_strategy=meta["strategy"],
                       rng_from=rng_file, seconds=time.perf_counter() - t0)
        return meta["steps_done"]

    def _check(self, path: str) -> None:
        """CheckpointError unless `path` is complete, fits this run, and the files this rank
        reads are intact (sizes and CRC-32)."""
        meta = read_meta(path)
        check_compatible(meta, self.cfg, path)
        rng_file = self._rng_file(meta)
        verify(path, meta, only=lambda rel, rec: self._reads(rel, rec, rng_file, meta))

    def _newest_that_verifies(self) -> str | None:
        """resume_from="auto": the newest checkpoint under root that every rank verified (each
        checks the files it reads; the ranks compare, so all pick the same one). Newer ones that
        fail are skipped with a warning; if none verifies, CheckpointError says why each failed.
        None: no checkpoint yet (a fresh start)."""
        from distlab.checkpoint.store import list_checkpoints
        candidates = [p for _, p in reversed(list_checkpoints(self.root))]
        mine = []
        for path in candidates:
            try:
                self._check(path)
                mine.append(None)
            except CheckpointError as e:
                mine.append(str(e))
        every = [None] * self.world
        dist.all_gather_object(every, mine)
        skipped = []
        for i, path in enumerate(candidates):
            bad = [(r, problems[i]) for r, problems in enumerate(every) if problems[i]]
            if not bad:
                if skipped and self.rank == 0:
                    message = (f"resume_from='auto' skipped {len(skipped)} newer checkpoint(s) "
                               f"that do not verify and resumed {path}: " + "; ".join(skipped))
                    # stderr (under torchrun, the terminal); a launched rank also forwards it to
                    # the caller's Run (distlab.caller.launch.forward_warnings)
                    warnings.warn(message, RuntimeWarning)
                return path
            skipped.append(f"{os.path.basename(path)}: {bad[0][1]} (rank {bad[0][0]})")
        if candidates:
            raise CheckpointError(f"resume_from='auto': none of the {len(candidates)} "
                                  f"checkpoint(s) under {self.root} verifies: "
                                  + "; ".join(skipped))
        return None

    def _rng_file(self, meta) -> str:
        """This rank's own RNG states; at another world size, those of rank r mod the old N."""
        return f"{RNG_DIR}/rank{self.rank % meta['world_size']}.pt"

    def _reads(self, rel: str, rec: dict, rng_file: str, meta: dict) -> bool:
        """The files this rank checks before loading: the ones everyone reads, its RNG file,
        and the shards of saved ranks r with r mod N = this rank (the work split N ways);
        under another layout, every shard (each rank reads them all: reshard.canonical)."""
        if rel in (STATE, f"{DCP_DIR}/.metadata", rng_file):
            return True
        if meta["layout"] != self.strategy.checkpoint_layout:
            return rel.startswith(DCP_DIR + "/")
        return rel.startswith(DCP_DIR + "/") and rec["rank"] % self.world == self.rank

    def _load_full(self, path):
        state = torch_load(os.path.join(path, STATE), map_location=self.device)
        try:
            self.strategy.load_checkpoint_state(self.model, self.optimizer, state)
        except (KeyError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{os.path.join(path, STATE)} does not fit this model or "
                                  f"optimizer: {e}") from None
        if self.scaler.enabled:
            self.scaler.load_state_dict(state["scaler"])

    def _load_canonical(self, path, meta):
        """A checkpoint of another layout: read whole, named per parameter, and this strategy
        takes its part (distlab.checkpoint.reshard)."""
        from distlab.checkpoint.reshard import canonical
        state = canonical(path, meta, self.strategy.trainable_order(self.model))
        try:
            self.strategy.load_canonical(self.model, self.optimizer, state)
        except (KeyError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{path} (layout {meta['layout']!r}) does not fit this model "
                                  f"under strategy {self.cfg.strategy!r}: "
                                  f"{type(e).__name__}: {e}") from None
        if self.scaler.enabled and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])

    def _load_sharded(self, path, meta):
        import torch.distributed.checkpoint as dcp
        state = self._sharded_state(for_load=meta["optimizer_state"])
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(os.path.join(path, DCP_DIR)))
        except Exception as e:  # noqa: BLE001 - name the checkpoint in whatever DCP raised
            raise CheckpointError(f"{os.path.join(path, DCP_DIR)}: DCP could not load it into "
                                  f"this model: {type(e).__name__}: {str(e)[:800]}") from None
        if self.scaler.enabled:
            self.scaler.load_state_dict({k.split("/", 1)[1]: v.item() for k, v in state.items()
                                         if k.startswith("scaler/")})
        self.strategy.load_checkpoint_state(self.model, self.optimizer, state)


class NoCheckpoints:
    """The loop's checkpointer when the run neither saves nor resumes: it starts at step 0 and
    never asks the loop to leave."""

    def restore(self) -> int:
        return 0

    def after_step(self, step: int) -> bool:
        return False
