"""Training checkpoints: a run's whole state on disk, so that it can stop and go on exactly.

A checkpoint is one folder per save, named by the steps done:

    <checkpoint_dir>/step_000006/          checkpoint_dir "" means <run dir>/checkpoints
        meta.json        steps done, world size, strategy, format, the run's config, the torch
                         version, and each file's size, CRC-32 and writer rank. Written last:
                         a folder without it is not a checkpoint.
        state.pt         format "full": model, optimizer, loss scaler; rank 0 writes it
        dcp/             format "sharded": torch.distributed.checkpoint, one __<r>_0.distcp
                         per rank (its shard) plus .metadata (where each piece lives)
        rng/rank<r>.pt   every rank's random-number states (torch, CUDA, numpy, python)

Formats, by strategy:

    full     single, allreduce, ddp, ddp-torch: every rank holds the same model and optimizer,
             so rank 0 writes one copy and the others wait at a barrier. zero1-torch: torch's
             ZeroRedundancyOptimizer.consolidate_state_dict gathers its partitions on rank 0.
    sharded  zero1/2/3: each unit's flat shard of parameters and of optimizer state, saved as a
             DTensor slice Shard(0) of the unit's unpadded flat vector (our shard r is exactly
             DTensor's chunk r: both cut ceil(n/N) entries per rank), so DCP can cut it again
             for another world size. fsdp-torch: FSDP2's DTensor parameters and
             get_optimizer_state_dict's DTensor state. Every rank writes only its own shard.

Atomic: every rank writes into `.step_000006.tmp/` and fsyncs; rank 0 then writes meta.json,
fsyncs, renames the folder to `step_000006` (a rename within one filesystem is atomic) and
fsyncs the parent. A crash before the rename leaves a temporary that `list_checkpoints`
ignores; the previous checkpoint is untouched. (The ranks must share the filesystem, as a
cluster's shared storage.) "latest" is not a pointer file: it is the highest complete step_*
folder, found by scanning.

Saving: with checkpoint_every = k, after steps k-1, 2k-1, ... (0-based) and after the last
step, so a finished run can be extended (resume with a larger `steps`); keep_last complete
checkpoints stay. Resuming: the loop starts at steps_done. Data is a pure function of
(seed, step) (distlab.dataset) and a finite dataset's sampler position is a function of the step
(distlab.sampler), so the step is the data position.

What a resumed run may change is MAY_CHANGE (world size, steps, launch and logging knobs);
every other RunConfig field must match, and `check_compatible` names each one that does not.
Another world size: the sharded format re-cuts; the full format loads on any number of ranks;
a finite dataset's shards depend on the world size, so there it must stay.

Loading uses torch.load(..., weights_only=True): tensors and plain containers, no code. DCP's
own .metadata is a pickle that torch reads with pickle.load; its CRC-32 in meta.json is checked
first, which catches corruption, not forgery: load sharded checkpoints only from storage you
trust.

Preemption: with checkpoint_every > 0, SIGTERM is a notice (a spot instance's two-minute
warning, a scheduler's eviction, torchrun passing it on). At each step boundary the ranks agree
on whether any got one (a 4-byte all-reduce), then save and leave together; the run ends with
status "preempted". `Run.preempt(grace_s)` sends the notice and SIGKILLs after the grace.
`Run.stop()` sends the same SIGTERM, so a stopped checkpointing run saves before it leaves
(its SIGKILL follows 3 s later if a rank cannot reach a step boundary).
"""

from __future__ import annotations

import glob
import io
import json
import os
import random
import re
import shutil
import signal
import tempfile
import threading
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist

from distlab.config import CHECKPOINT_STRATEGIES, RunConfig

META, STATE, RNG_DIR, DCP_DIR = "meta.json", "state.pt", "rng", "dcp"
FORMAT_VERSION = 1
SHARDED = ("zero1", "zero2", "zero3", "fsdp-torch")
# Strategies with the same layout read each other's checkpoints (zero2 and zero3 cut the
# model into the same units; the replicated ones hold the same plain model and optimizer).
LAYOUTS = {"single": "replicated", "allreduce": "replicated", "ddp": "replicated",
           "ddp-torch": "replicated", "zero1-torch": "ZeroRedundancyOptimizer, consolidated",
           "zero1": "ZeRO units: the whole model", "zero2": "ZeRO units: one per block",
           "zero3": "ZeRO units: one per block", "fsdp-torch": "FSDP2 DTensors"}
# RunConfig fields a resumed run may change: the update is the same, only where, how fast and
# what is logged differ (grad_accum, allreduce and bucket_mb change the summation order: equal
# up to rounding, as another world size). Everything else must match.
MAY_CHANGE = frozenset({
    "strategy", "world_size", "steps", "grad_accum", "allreduce", "bucket_mb", "checkpointing",
    "offload", "backend", "device", "timeout_s", "threads_per_rank", "debug", "detect_nan",
    "track_peak", "step_delay_s", "straggler_rank", "straggler_delay_s", "runs_root", "name",
    "fault", "fault_rank", "fault_step", "checkpoint_every", "keep_last", "checkpoint_dir",
    "resume_from", "eval_every", "save_final"})
_EXTRA_MAY_CHANGE = {"fault_module"}
_NAME = re.compile(r"^step_(\d{6,})$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt, or written by an incompatible run."""


# -- finding checkpoints ---------------------------------------------------------------------
def checkpoint_root(cfg: RunConfig, run_dir: str) -> str:
    return os.path.abspath(cfg.checkpoint_dir or os.path.join(run_dir, "checkpoints"))


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(steps_done, folder) of the complete checkpoints under root, oldest first. A folder
    counts once its meta.json exists; an unfinished save's temporary starts with '.'."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _NAME.match(name)
        if m and os.path.isfile(os.path.join(root, name, META)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def latest_checkpoint(root: str) -> str | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def resolve(spec: str, root: str) -> str | None:
    """RunConfig.resume_from as a checkpoint folder: "auto" is the latest under root (None: no
    checkpoint yet, start fresh); a folder is a checkpoint, or a folder of checkpoints (its
    latest)."""
    if not spec:
        return None
    if spec == "auto":
        return latest_checkpoint(root)
    path = os.path.abspath(spec)
    if os.path.isfile(os.path.join(path, META)):
        return path
    latest = latest_checkpoint(path)
    if latest:
        return latest
    if _NAME.match(os.path.basename(path)) and os.path.isdir(path):
        raise CheckpointError(f"{os.path.join(path, META)} is missing: this checkpoint is "
                              "incomplete (its save did not finish)")
    raise CheckpointError(f"resume_from={spec!r}: no complete checkpoint there (a step_NNNNNN "
                          "folder with a meta.json, or a folder holding such)")


# -- reading and checking --------------------------------------------------------------------
def read_meta(path: str) -> dict:
    f = os.path.join(path, META)
    try:
        with open(f, encoding="utf-8") as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{f} is missing: not a checkpoint, or one whose save did not "
                              "finish") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} is corrupt (not JSON): {e}") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{f}: format_version {meta.get('format_version')!r} is not "
                              f"{FORMAT_VERSION}, the one this distlab reads")
    return meta


def _crc32_file(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def verify(path: str, meta: dict | None = None, only=None) -> dict:
    """Check each file meta.json lists (or those `only(rel, record)` picks): present, of its
    size and CRC-32. Returns meta; raises CheckpointError naming the first file that is not."""
    meta = meta or read_meta(path)
    for rel, rec in sorted(meta["files"].items()):
        if only is not None and not only(rel, rec):
            continue
        f = os.path.join(path, rel)
        if not os.path.isfile(f):
            raise CheckpointError(f"{f} is missing (meta.json lists it: {rec['bytes']} bytes "
                                  f"written by rank {rec['rank']})")
        size = os.path.getsize(f)
        if size != rec["bytes"]:
            raise CheckpointError(f"{f} is {size} bytes; meta.json says {rec['bytes']}: "
                                  "truncated or overwritten")
        crc = _crc32_file(f)
        if crc != rec["crc32"]:
            raise CheckpointError(f"{f}: CRC-32 {crc:08x} is not meta.json's "
                                  f"{rec['crc32']:08x}: the file is corrupt")
    return meta


def check_compatible(meta: dict, cfg: RunConfig, path: str = "checkpoint"):
    """Raise CheckpointError unless `cfg` can resume this checkpoint, naming what differs."""
    saved_strategy = meta["strategy"]
    if LAYOUTS.get(cfg.strategy) != LAYOUTS[saved_strategy]:
        readers = [s for s in CHECKPOINT_STRATEGIES if LAYOUTS[s] == LAYOUTS[saved_strategy]]
        raise CheckpointError(
            f"{path}: written by strategy {saved_strategy!r} (layout: "
            f"{LAYOUTS[saved_strategy]}); strategy {cfg.strategy!r} cannot read it. Strategies "
            f"that can: {', '.join(readers)}")
    defaults = RunConfig().to_dict()
    saved, now = meta["config"], cfg.to_dict()
    diffs = []
    for name, value in now.items():
        if name in MAY_CHANGE:
            continue
        old = saved.get(name, defaults[name])  # a field newer than the checkpoint: its default
        if name == "extra":
            old, value = ({k: v for k, v in d.items() if k not in _EXTRA_MAY_CHANGE}
                          for d in (old, value))
        if old != value:
            diffs.append(f"{name}: saved {old!r}, now {value!r}")
    if diffs:
        raise CheckpointError(f"{path} was written by a run whose config differs in fields a "
                              f"resume must keep: {'; '.join(diffs)}. Fields that may change: "
                              f"{', '.join(sorted(MAY_CHANGE))}")
    if cfg.dataset_size and meta["world_size"] != cfg.world_size:
        raise CheckpointError(
            f"{path}: dataset_size={cfg.dataset_size}: the sampler's shards depend on the world "
            f"size (saved at {meta['world_size']}, now {cfg.world_size}), so the data position "
            f"would not carry over; resume at world_size={meta['world_size']} or use endless "
            "data (dataset_size=0)")


def _torch_load(path: str, map_location="cpu"):
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - every way a file fails to load gets its name
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        why = (f"it holds an object of class {found.group(1)}, which could run code when "
               "unpickled" if found else f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        raise CheckpointError(f"{path} cannot be read by torch.load(weights_only=True), which "
                              f"allows tensors and plain containers only: {why}") from None


def load_full(path: str) -> dict:
    """A checkpoint read whole in this process, no process group needed: {"meta", "tensors":
    every stored tensor by key (for bitwise comparisons), "model": the weights under the names
    `single` uses (ZeRO's flat units cut back into parameters), "rng": {rank: states}}."""
    meta = verify(path)
    if meta["format"] == "full":
        state = _torch_load(os.path.join(path, STATE))
        tensors = _flatten(state)
        model = dict(state["model"])
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(os.path.join(path, DCP_DIR), os.path.join(tmp, "all.pt"))
            tensors = _flatten(_torch_load(os.path.join(tmp, "all.pt")))
        model = _model_from_sharded(tensors, meta)
    rng = {int(re.search(r"(\d+)", os.path.basename(f)).group(1)): _torch_load(f)
           for f in glob.glob(os.path.join(path, RNG_DIR, "rank*.pt"))}
    return {"meta": meta, "tensors": tensors, "model": model, "rng": rng}


def _flatten(d, prefix="") -> dict:
    out = {}
    for k, v in (d.items() if isinstance(d, dict) else enumerate(d)):
        key = f"{prefix}{k}"
        if isinstance(v, (dict, list, tuple)):
            out.update(_flatten(v, key + "/"))
        elif torch.is_tensor(v):
            out[key] = v
        elif isinstance(v, (int, float)) and not isinstance(v, bool):  # the scaler's numbers
            out[key] = torch.tensor(v, dtype=torch.float64)
    return out


def _model_from_sharded(tensors: dict, meta: dict) -> dict:
    model = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    for unit, params in meta.get("units", []):  # ZeRO: cut each flat unit into its parameters
        flat, offset = model.pop(unit), 0
        for name, shape in params:
            n = int(np.prod(shape))
            model[name] = flat[offset: offset + n].view(shape)
            offset += n
    for group in ("frozen/", "buffer/"):  # LoRA's frozen base, BatchNorm's running statistics
        model.update({k[len(group):]: v for k, v in tensors.items() if k.startswith(group)})
    return model


# -- writing ---------------------------------------------------------------------------------
def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: str, obj, rank: int, kill_halfway: bool = False) -> dict:
    """torch.save `obj` to `path`, fsynced; its record for meta.json. kill_halfway (the drill
    'kill_in_save'): write the first half of the bytes, then SIGKILL this process."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2] if kill_halfway else data)
        f.flush()
        os.fsync(f.fileno())
        if kill_halfway:
            os.kill(os.getpid(), signal.SIGKILL)
    return {"bytes": len(data), "crc32": zlib.crc32(data), "rank": rank}


def _record(path: str, rank: int) -> dict:
    return {"bytes": os.path.getsize(path), "crc32": _crc32_file(path), "rank": rank}


def rng_state(device: torch.device) -> dict:
    """Every random-number state a rank may draw from, as tensors and plain numbers."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device):
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _materialize_optimizer_state(optimizer):
    """Create the optimizer's state tensors (AdamW's moments) so a checkpoint can be loaded
    into them in place: one step with zero gradients at lr 0, which leaves every parameter
    bitwise unchanged (p·(1 - 0·wd) and p - 0·m/(√v+ε) are p). torch's
    torch.distributed.checkpoint.state_dict does the same (_init_optim_state)."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads, lrs = [p.grad for p in params], [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for p, grad in zip(params, grads):
        p.grad = grad
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr


# -- the sharded state: what each rank hands DCP ---------------------------------------------
_MESHES: dict = {}


def _mesh(device: torch.device, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    key = (device.type, world)
    if key not in _MESHES:  # 1-D over every rank: it reuses the default process group
        _MESHES[key] = init_device_mesh(device.type, (world,))
    return _MESHES[key]


def _flat_slice(t: torch.Tensor, numel: int, rank: int, world: int):
    """Rank r's shard of a unit's padded flat vector as a DTensor piece of the unpadded one:
    entries [r·S, r·S + valid) of `numel`, S = ceil(numel / N), DTensor's own Shard(0) cut.
    (The mesh is the tensor's device's: ZeRO-Offload keeps the optimizer's shards on the CPU.)"""
    from torch.distributed.tensor import DTensor, Shard
    mesh = _mesh(t.device, world)
    S = t.numel()
    valid = max(0, min(S, numel - rank * S))
    return DTensor.from_local(t.detach()[:valid], mesh, [Shard(0)], run_check=False,
                              shape=torch.Size([numel]), stride=(1,))


def _scaler_tensors(scaler) -> dict:
    return {f"scaler/{k}": torch.tensor(v, dtype=torch.float64)
            for k, v in scaler.state_dict().items()}


def _persistent_buffers(model) -> dict:
    out = {}
    for mod_name, mod in model.named_modules():
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and name not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{name}" if mod_name else name] = b
    return out


# -- a rank's side, in the training loop -----------------------------------------------------
class Checkpointer:
    """Checkpointing inside distlab.train's loop, on one rank:

        ckpt = Checkpointer.for_run(cfg, ...)    None when the run neither saves nor resumes
        start = ckpt.restore()                    steps already done (0: a fresh start)
        after each step's update:  if ckpt.after_step(step): break    (preempted)
    """

    def __init__(self, cfg, rank, world, device, strategy, model, optimizer, scaler, log):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.strategy, self.model, self.optimizer, self.scaler = strategy, model, optimizer, scaler
        self.log, self.comm = log, strategy.comm
        self.root = checkpoint_root(cfg, os.path.dirname(os.path.abspath(log.path)))
        self.format = "sharded" if cfg.strategy in SHARDED else "full"
        self.notice = PreemptionNotice() if cfg.checkpoint_every else None

    @classmethod
    def for_run(cls, cfg, *args):
        return cls(cfg, *args) if (cfg.checkpoint_every or cfg.resume_from) else None

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
        if self.notice is not None:
            self.notice.close()
            self.notice = None

    # -- save --------------------------------------------------------------------------------
    def save(self, step: int, reason: str = "periodic") -> str:
        """Write the state after `step` as <root>/step_<step+1>: every rank its files into a
        temporary folder, then rank 0 commits it (meta.json, rename). A collective."""
        t0 = time.perf_counter()
        steps_done = step + 1
        name = f"step_{steps_done:06d}"
        final, tmp = os.path.join(self.root, name), os.path.join(self.root, f".{name}.tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed save of this step
            os.makedirs(os.path.join(tmp, RNG_DIR))
        dist.barrier()
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
        files[rng_rel] = _write(os.path.join(tmp, rng_rel), rng_state(self.device), self.rank,
                                kill_halfway=kill and rng_rel == self._kill_target)
        gathered = [None] * self.world
        dist.all_gather_object(gathered, files)
        if self.rank == 0:
            self._commit(tmp, final, step, reason, {k: v for d in gathered for k, v in d.items()})
        dist.barrier()  # nobody goes on before the checkpoint exists
        self.log.write("checkpoint", step=step, steps_done=steps_done, reason=reason,
                       format=self.format, seconds=time.perf_counter() - t0,
                       bytes=sum(r["bytes"] for r in files.values()),
                       files={rel: r["bytes"] for rel, r in files.items()}, path=final)
        return final

    @property
    def _kill_target(self) -> str:
        """The file the drill 'kill_in_save' cuts short: the rank's largest."""
        if self.format == "sharded":
            return "dcp"
        return STATE if self.rank == 0 else f"{RNG_DIR}/rank{self.rank}.pt"

    def _save_full(self, tmp: str, kill: bool) -> dict:
        module = getattr(self.model, "module", self.model)  # torch DDP wraps the model
        if self.cfg.strategy == "zero1-torch":  # a collective: partitions gathered on rank 0
            self.optimizer.consolidate_state_dict(to=0)
        if self.rank != 0:
            return {}
        state = {"model": module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scaler": self.scaler.state_dict() if self.scaler is not None else None}
        return {STATE: _write(os.path.join(tmp, STATE), state, self.rank,
                              kill_halfway=kill and self._kill_target == STATE)}

    def _save_sharded(self, tmp: str, kill: bool) -> dict:
        import torch.distributed.checkpoint as dcp
        dcp.save(self._sharded_state(for_load=False),
                 storage_writer=_storage_writer(os.path.join(tmp, DCP_DIR), kill))
        mine = glob.glob(os.path.join(tmp, DCP_DIR, f"__{self.rank}_*.distcp"))
        if self.rank == 0:
            mine.append(os.path.join(tmp, DCP_DIR, ".metadata"))
        return {os.path.relpath(f, tmp): _record(f, self.rank) for f in mine}

    def _commit(self, tmp, final, step, reason, files):
        meta = {"format_version": FORMAT_VERSION, "format": self.format, "steps_done": step + 1,
                "step": step, "reason": reason, "world_size": self.world,
                "strategy": self.cfg.strategy, "layout": LAYOUTS[self.cfg.strategy],
                "optimizer_state": bool(self.optimizer.state), "units": self._unit_table(),
                "config": self.cfg.to_dict(), "torch": torch.__version__, "time": time.time(),
                "files": files}
        with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        for d in (os.path.join(tmp, RNG_DIR), tmp):
            _fsync_dir(d)
        if self.format == "sharded":
            _fsync_dir(os.path.join(tmp, DCP_DIR))
        trash = None
        if os.path.exists(final):  # the same step saved again (a resumed run re-ran it)
            trash = final + ".old"
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(final, trash)
        os.rename(tmp, final)  # the commit: atomic within one filesystem
        _fsync_dir(self.root)
        if trash:
            shutil.rmtree(trash, ignore_errors=True)
        self._prune()

    def _prune(self):
        """Keep the last keep_last complete checkpoints; drop unfinished saves' temporaries."""
        for _, path in list_checkpoints(self.root)[: -self.cfg.keep_last]:
            shutil.rmtree(path, ignore_errors=True)
        for path in glob.glob(os.path.join(self.root, ".step_*.tmp")):
            shutil.rmtree(path, ignore_errors=True)

    def _unit_table(self) -> list:
        """ZeRO: each unit's parameters (name, shape) in flat order, so `load_full` can cut the
        flat vectors back into parameters."""
        units = getattr(self.strategy, "units", None)
        if self.cfg.strategy not in ("zero1", "zero2", "zero3") or not units:
            return []
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [[u.name, [[names[id(p)], list(p.shape)] for p in u.params]] for u in units]

    def _sharded_state(self, for_load: bool) -> dict:
        """What this rank hands DCP: views of its own shards (loaded into in place)."""
        state = self._scaler_state()
        if self.cfg.strategy == "fsdp-torch":
            return {**state, **self._fsdp_state(for_load)}
        names = {id(p): n for n, p in self.model.named_parameters()}
        for u in self.strategy.units:
            state[f"model/{u.name}"] = _flat_slice(u.master, u.numel, self.rank, self.world)
            for key, v in self.optimizer.state.get(u.master, {}).items():
                if not torch.is_tensor(v):
                    raise CheckpointError(f"optimizer state {key!r} is {type(v).__name__}, not "
                                          "a tensor: the sharded format holds tensors only")
                state[f"optim/{u.name}/{key}"] = (
                    _flat_slice(v, u.numel, self.rank, self.world)
                    if v.shape == u.master.shape else v)  # AdamW's step: the same everywhere
        for p in self.strategy.frozen:  # not trained (LoRA's base): the same on every rank
            state[f"frozen/{names[id(p)]}"] = p.detach()
        for name, b in _persistent_buffers(self.model).items():
            state[f"buffer/{name}"] = b
        return state

    def _fsdp_state(self, for_load: bool) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        state = {f"model/{n}": p.detach() for n, p in self.model.named_parameters()}
        state.update({f"buffer/{n}": b for n, b in _persistent_buffers(self.model).items()})
        if self.optimizer.state or for_load:  # for_load: torch creates the state to fill
            state["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        return state

    def _scaler_state(self) -> dict:
        return _scaler_tensors(self.scaler) if self.scaler is not None else {}

    # -- restore -----------------------------------------------------------------------------
    def restore(self) -> int:
        """Load cfg.resume_from into this rank's model, optimizer, loss scaler and RNGs; return
        the steps it had done (where the loop starts). 0 when there is nothing to resume."""
        path = resolve(self.cfg.resume_from, self.root)
        if path is None:
            return 0
        t0 = time.perf_counter()
        meta = read_meta(path)
        check_compatible(meta, self.cfg, path)
        rng_file = self._rng_file(meta)
        verify(path, meta, only=lambda rel, rec: self._reads(rel, rec, rng_file))
        if meta["format"] == "full":
            self._load_full(path)
        else:
            self._load_sharded(path, meta)
        set_rng_state(_torch_load(os.path.join(path, rng_file)), self.device)
        dist.barrier()
        self.comm.take_step_stats()  # loading's traffic (ZeRO's all-gathers) is not a step's
        self.log.write("resume", path=path, steps_done=meta["steps_done"],
                       saved_world_size=meta["world_size"], saved_strategy=meta["strategy"],
                       rng_from=rng_file, seconds=time.perf_counter() - t0)
        return meta["steps_done"]

    def _rng_file(self, meta) -> str:
        """This rank's own RNG states; at another world size, those of rank r mod the old N."""
        return f"{RNG_DIR}/rank{self.rank % meta['world_size']}.pt"

    def _reads(self, rel: str, rec: dict, rng_file: str) -> bool:
        """The files this rank checks before loading: the ones everyone reads, its RNG file,
        and the shards of saved ranks r with r mod N = this rank (the work split N ways)."""
        if rel in (STATE, f"{DCP_DIR}/.metadata", rng_file):
            return True
        return rel.startswith(DCP_DIR + "/") and rec["rank"] % self.world == self.rank

    def _load_full(self, path):
        state = _torch_load(os.path.join(path, STATE), map_location=self.device)
        module = getattr(self.model, "module", self.model)
        try:
            module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (KeyError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{os.path.join(path, STATE)} does not fit this model or "
                                  f"optimizer: {e}") from None
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])

    def _load_sharded(self, path, meta):
        import torch.distributed.checkpoint as dcp
        if meta["optimizer_state"] and self.cfg.strategy != "fsdp-torch":
            _materialize_optimizer_state(self.optimizer)  # tensors for DCP to fill
        state = self._sharded_state(for_load=meta["optimizer_state"])
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(os.path.join(path, DCP_DIR)))
        except Exception as e:  # noqa: BLE001 - name the checkpoint in whatever DCP raised
            raise CheckpointError(f"{os.path.join(path, DCP_DIR)}: DCP could not load it into "
                                  f"this model: {type(e).__name__}: {str(e)[:800]}") from None
        if self.scaler is not None:
            self.scaler.load_state_dict({k.split("/", 1)[1]: v.item() for k, v in state.items()
                                         if k.startswith("scaler/")})
        if self.cfg.strategy == "fsdp-torch":
            if "optim" in state:
                from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
                set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
            return
        for u in self.strategy.units:
            if u.master is not u.shard:  # offloaded: the CPU master was loaded
                u.shard.copy_(u.master.detach())
            if self.strategy.stage < 3:  # every rank's full parameters from the loaded shards
                self.comm.all_gather(u.full, u.shard)


def _storage_writer(path: str, kill: bool):
    """DCP's FileSystemWriter; for the drill 'kill_in_save' one that, once this rank's shard is
    written, cuts it to half its bytes and SIGKILLs the rank before the checkpoint is committed:
    what a kill halfway through the write leaves on disk."""
    import torch.distributed.checkpoint as dcp
    if not kill:
        return dcp.FileSystemWriter(path)

    class KillHalfway(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            super().write_data(plan, planner).wait()
            for f in glob.glob(os.path.join(path, f"__{dist.get_rank()}_*.distcp")):
                os.truncate(f, os.path.getsize(f) // 2)
            os.kill(os.getpid(), signal.SIGKILL)

    return KillHalfway(path)


class PreemptionNotice:
    """SIGTERM as a preemption notice: note when it came; the loop saves and leaves at the next
    step boundary (Checkpointer.after_step). Python runs the handler in the main thread between
    bytecodes, so a rank inside a collective takes the notice once that collective returns:
    every rank gets the signal, so every collective still completes."""

    def __init__(self):
        self.received: float | None = None
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame):
        if self.received is None:
            self.received = time.time()

    def close(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


# -- the caller's side -----------------------------------------------------------------------
def resume(source, block: bool = False, **changes):
    """Launch a run again from its latest checkpoint and return the new Run.

    source: a Run, its folder, a checkpoint folder or a folder of checkpoints. changes: RunConfig
    fields to change (those in MAY_CHANGE, e.g. world_size=2, steps=200). The checkpoint is
    checked here first (files, CRCs, config), so a bad one fails before any process starts.
    New checkpoints go on into the same folder; the injected fault is not repeated."""
    from distlab.launch import launch

    path, cfg, root = _locate(source)
    label = cfg.name or f"{cfg.strategy}-w{cfg.world_size}"
    new = cfg.replace(**{"resume_from": path, "checkpoint_dir": root, "fault": "none",
                         "name": label if label.endswith("-resumed") else label + "-resumed",
                         **changes})
    meta = verify(path)
    check_compatible(meta, new, path)
    if meta["steps_done"] >= new.steps:  # nothing would train: say so instead of a no-op run
        raise CheckpointError(f"{path} has {meta['steps_done']} steps done and the run asks for "
                              f"steps={new.steps}; pass steps=N with N > {meta['steps_done']} "
                              "to train on")
    return launch(new, block=block)


def _locate(source) -> tuple[str, RunConfig, str]:
    """(checkpoint folder, the config that wrote it, the checkpoints root) for `resume`."""
    run_dir = getattr(source, "dir", None) or os.path.abspath(str(source))
    config_file = os.path.join(run_dir, "config.json")
    if os.path.isfile(config_file):  # a run's folder
        with open(config_file, encoding="utf-8") as f:
            cfg = RunConfig.from_dict(json.load(f))
        root = checkpoint_root(cfg, run_dir)
        path = latest_checkpoint(root)
        if path is None:
            raise CheckpointError(f"run {run_dir} has no complete checkpoint under {root} "
                                  "(was checkpoint_every > 0? did a save finish?)")
        return path, cfg, root
    path = resolve(run_dir, run_dir)
    return path, RunConfig.from_dict(read_meta(path)["config"]), os.path.dirname(path)
