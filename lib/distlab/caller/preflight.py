"""What launch() checks on this machine before it starts a rank.

RunConfig checks what a config can say about itself (types, ranges, combinations). What depends
on the machine is checked here, by launch(), in the launching process:

    runs_root, checkpoint_dir   folders, or paths where one can be made and written to
    resume_from                 a complete checkpoint there, compatible with the config
                                ("auto": checked by the ranks, its folder is the run's own)
    init_from                   a file
    model, data                 a model of your own: imported and one forward run
                                (distlab.models.factory)
    memory                      the estimated bytes of every rank of the run (model states and
                                activations, distlab.theory.estimate) fit in this machine's RAM

Under torchrun the ranks may run on machines the caller never sees, so `python -m distlab`
checks only the factories there; the paths are checked by each rank where it opens them
(distlab.checkpoint raises CheckpointError, torch.load FileNotFoundError), and reported with
the rank's traceback.
"""

from __future__ import annotations

import os

from distlab.models import factory


def check(cfg, runs_root: str) -> None:
    """ValueError (CheckpointError is one) naming the field, before any process starts.
    runs_root: the folder cfg's run goes under (distlab.caller.launch.runs_root)."""
    _writable_folder("runs_root", runs_root)
    if cfg.checkpoint_dir:
        _writable_folder("checkpoint_dir", cfg.checkpoint_dir)
    if cfg.resume_from and cfg.resume_from != "auto":
        _checkpoint(cfg)
    if cfg.init_from and not os.path.isfile(cfg.init_from):
        raise ValueError(f"init_from={cfg.init_from!r}: no such file (a model state dict .pt)")
    if factory.is_spec(cfg.model):
        factory.check(cfg)
    fits_in_memory(cfg)


def _writable_folder(field: str, path: str) -> None:
    """A folder we can write into, or a path where one can be made."""
    path = os.path.abspath(path)
    probe = path
    while not os.path.exists(probe):  # the nearest existing ancestor decides
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"{field}={path!r}: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{field}={path!r}: {probe} is not writable by this user")


def _checkpoint(cfg) -> None:
    """A complete checkpoint (its meta.json written last), that cfg can resume. The files' CRCs
    are the ranks' to check as they load (distlab.caller.resume checks them here too)."""
    from distlab.checkpoint.store import check_compatible, read_meta, resolve
    path = resolve(cfg.resume_from, cfg.resume_from)  # CheckpointError if none is there
    check_compatible(read_meta(path), cfg, path)


def machine_ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return None


def estimated_bytes(cfg) -> int | None:
    """Every rank's model states and activations (distlab.theory.estimate; fp32, our GPT), summed:
    what the run holds on one machine. None where the estimator has no model (bnnet, yours)."""
    if cfg.model != "gpt":
        return None
    from distlab.theory.estimate import estimate_run
    total = 0
    for rank in range(cfg.processes):
        try:
            total += sum(v or 0 for v in estimate_run(cfg, rank).values())
        except (NotImplementedError, ValueError, KeyError):  # a layout it does not model
            return None
    return total


def fits_in_memory(cfg) -> None:
    need, have = estimated_bytes(cfg), machine_ram_bytes()
    if need is None or have is None or need <= have:
        return
    gib = 2 ** 30
    raise ValueError(f"n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, global_batch="
                     f"{cfg.global_batch}, seq_len={cfg.seq_len} on {cfg.processes} ranks: the "
                     f"estimate is {need / gib:.1f} GiB (model states and activations, "
                     f"distlab.theory.estimate), more than this machine's {have / gib:.1f} GiB of RAM")
