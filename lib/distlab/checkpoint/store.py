"""The on-disk format of a training checkpoint (see distlab.checkpoint): finding checkpoints,
checking them (files, sizes, CRC-32, the config that wrote them), reading one whole, and the
atomic commit of a save. Nothing here knows a strategy's state: strategies declare their layout
(Strategy.checkpoint_layout) and build their state (Strategy.checkpoint_state).
"""

from __future__ import annotations

import glob
import io
import json
import os
import re
import shutil
import signal
import tempfile
import zlib

import numpy as np
import torch
import torch.distributed as dist

from distlab.config import RunConfig, declarations
from distlab.parallel import strategies, strategy_class
from distlab.parallel.state import CheckpointError

META, STATE, RNG_DIR, DCP_DIR = "meta.json", "state.pt", "rng", "dcp"
FORMAT_VERSION = 1
# RunConfig fields a resumed run may change (each declares it: distlab.config.declare's
# may_change): the update is the same, only where, how fast and what is logged differ.
# Everything else must match.
MAY_CHANGE = frozenset(name for name, d in declarations().items() if d.may_change)
_NAME = re.compile(r"^step_(\d{6,})$")


# the layouts distlab.checkpoint.reshard reads per parameter, so that another strategy resumes them
REPLICATED, ZERO_UNITS, FSDP2 = "replicated", "ZeRO units", "FSDP2 DTensors"


def family(layout: str) -> str | None:
    """The per-parameter reader of a layout ("ZeRO units: one per block" and "...: the whole
    model" cut their units differently; the meta says how), or None when there is none."""
    for name in (REPLICATED, ZERO_UNITS, FSDP2):
        if layout.startswith(name):
            return name
    return None


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


def crc32_file(path: str) -> int:
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
        crc = crc32_file(f)
        if crc != rec["crc32"]:
            raise CheckpointError(f"{f}: CRC-32 {crc:08x} is not meta.json's "
                                  f"{rec['crc32']:08x}: the file is corrupt")
    return meta


def check_compatible(meta: dict, cfg: RunConfig, path: str = "checkpoint"):
    """Raise CheckpointError unless `cfg` can resume this checkpoint, naming what differs."""
    saved_strategy = meta["strategy"]
    saved_layout = strategy_class(saved_strategy).checkpoint_layout

    def reads(s: str) -> bool:  # its own layout, or any with a per-parameter reader
        c = strategy_class(s)
        return c.checkpoint_layout == saved_layout or (c.loads_canonical
                                                       and family(saved_layout) is not None)
    if not reads(cfg.strategy):
        readers = [s for s in strategies("checkpoint") if reads(s)]
        raise CheckpointError(
            f"{path}: written by strategy {saved_strategy!r} (layout: "
            f"{saved_layout}); strategy {cfg.strategy!r} cannot read it. Strategies "
            f"that can: {', '.join(readers)}")
    defaults = RunConfig().to_dict()
    saved, now = meta["config"], cfg.to_dict()
    diffs = []
    for name, value in now.items():
        if name in MAY_CHANGE:
            continue
        old = saved.get(name, defaults[name])  # a field newer than the checkpoint: its default
        if old != value:
            diffs.append(f"{name}: saved {old!r}, now {value!r}")
    if diffs:
        raise CheckpointError(f"{path} was written by a run whose config differs in fields a "
                              f"resume must keep: {'; '.join(diffs)}. Fields that may change: "
                              f"{', '.join(sorted(MAY_CHANGE))}")
    if cfg.dataset_size and meta["world_size"] != cfg.world_size:
        from distlab.data.sampler import resume_changes_samples
        why = resume_changes_samples(cfg, meta["world_size"], meta["steps_done"])
        if why:
            raise CheckpointError(
                f"{path}: dataset_size={cfg.dataset_size}: the data position would not carry "
                f"over from {meta['world_size']} ranks to {cfg.world_size}: {why}. Resume at "
                f"world_size={meta['world_size']}, pick a dataset_size that divides into "
                f"global batches, or use endless data (dataset_size=0)")

def torch_load(path: str, map_location="cpu"):
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
        state = torch_load(os.path.join(path, STATE))
        tensors = _flatten(state)
        model = dict(state["model"])
    else:
        tensors = dcp_tensors(os.path.join(path, DCP_DIR))
        model = _model_from_sharded(tensors, meta)
    rng = {int(re.search(r"(\d+)", os.path.basename(f)).group(1)): torch_load(f)
           for f in glob.glob(os.path.join(path, RNG_DIR, "rank*.pt"))}
    return {"meta": meta, "tensors": tensors, "model": model, "rng": rng}


def dcp_tensors(dcp_dir: str) -> dict:
    """Every tensor a DCP checkpoint holds, by its flattened key ("optim/u0/exp_avg"), read in
    this process (torch's dcp_to_torch_save, through a temporary file)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(dcp_dir, os.path.join(tmp, "all.pt"))
        return _flatten(torch_load(os.path.join(tmp, "all.pt")))


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


def cut_unit(flat: torch.Tensor, params: list) -> dict:
    """A ZeRO unit's flat vector cut back into its parameters: params is the meta's [name,
    shape] list, in flat order (Strategy.checkpoint_meta); views, not copies."""
    out, offset = {}, 0
    for name, shape in params:
        n = int(np.prod(shape))
        out[name] = flat[offset: offset + n].view(shape)
        offset += n
    return out


def _model_from_sharded(tensors: dict, meta: dict) -> dict:
    model = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    for unit, params in meta.get("units", []):  # ZeRO: cut each flat unit into its parameters
        model.update(cut_unit(model.pop(unit), params))
    for group in ("frozen/", "buffer/"):  # LoRA's frozen base, BatchNorm's running statistics
        model.update({k[len(group):]: v for k, v in tensors.items() if k.startswith(group)})
    return model


# -- writing ---------------------------------------------------------------------------------
def fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str, obj, rank: int, kill_halfway: bool = False) -> dict:
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


def record(path: str, rank: int) -> dict:
    return {"bytes": os.path.getsize(path), "crc32": crc32_file(path), "rank": rank}


def commit(tmp: str, final: str, root: str, meta: dict, keep_last: int):
    """Rank 0's commit of a save: meta.json into the temporary folder, every folder fsynced,
    then the rename that makes the checkpoint exist, then pruning to keep_last."""
    with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for d in (os.path.join(tmp, RNG_DIR), tmp):
        fsync_dir(d)
    if meta["format"] == "sharded":
        fsync_dir(os.path.join(tmp, DCP_DIR))
    trash = None
    if os.path.exists(final):  # the same step saved again (a resumed run re-ran it)
        trash = final + ".old"
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
    os.rename(tmp, final)  # the commit: atomic within one filesystem
    fsync_dir(root)
    if trash:
        shutil.rmtree(trash, ignore_errors=True)
    prune(root, keep_last)


def prune(root: str, keep_last: int):
    """Keep the last keep_last complete checkpoints; drop unfinished saves' temporaries."""
    for _, path in list_checkpoints(root)[: -keep_last]:
        shutil.rmtree(path, ignore_errors=True)
    for path in glob.glob(os.path.join(root, ".step_*.tmp")):
        shutil.rmtree(path, ignore_errors=True)


def storage_writer(path: str, kill: bool):
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
