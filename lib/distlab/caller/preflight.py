"""What launch() checks on this machine before it starts a rank.

RunConfig checks what a config can say about itself (types, ranges, combinations). What depends
on the machine is checked here, by launch(), in the launching process:

    runs_root, checkpoint_dir   folders, or paths where one can be made and written to
    resume_from                 a complete checkpoint there, compatible with the config
                                ("auto": checked by the ranks, its folder is the run's own)
    init_from                   a file
    model, data                 a model of your own: imported and one forward run
                                (distlab.models.factory), in a process of its own with a
                                time limit (RunConfig.timeout_s): a factory that hangs, exits
                                or starts processes cannot take the caller with it, and what
                                it started ends with that process
    fp32_modules                each name is a module of the model
    memory                      the estimated bytes of every rank of the run (model states and
                                activations, distlab.theory.estimate) fit in this machine's RAM

Under torchrun the ranks may run on machines the caller never sees, so `python -m distlab`
checks only the factories there; the paths are checked by each rank where it opens them
(distlab.checkpoint raises CheckpointError, torch.load FileNotFoundError), and reported with
the rank's traceback.
"""

from __future__ import annotations

import os

from distlab.caller import fork_server
from distlab.models import factory


def check(cfg, runs_root: str, processes) -> None:
    """ValueError (CheckpointError is one) naming the field, before any process starts.
    runs_root: the folder cfg's run goes under (distlab.caller.launch.runs_root); processes:
    the multiprocessing context the ranks start from (distlab.caller.launch.rank_context)."""
    _writable_folder("runs_root", runs_root)
    if cfg.checkpoint_dir:
        _writable_folder("checkpoint_dir", cfg.checkpoint_dir)
    if cfg.resume_from and cfg.resume_from != "auto":
        _checkpoint(cfg)
    if cfg.init_from and not os.path.isfile(cfg.init_from):
        raise ValueError(f"init_from={cfg.init_from!r}: no such file (a model state dict .pt)")
    if factory.is_spec(cfg.model):
        check_factory_apart(cfg, processes)
    elif cfg.fp32_modules:
        _fp32_modules(cfg)
    fits_in_memory(cfg)


def _fp32_modules(cfg) -> None:
    """Every RunConfig.fp32_modules name is a module of the built-in model (built on the meta
    device: names only, no memory)."""
    import torch

    from distlab.modules import find_module
    from distlab.rank.build import build_model
    with torch.device("meta"):
        model = build_model(cfg)
    for name in (n.strip() for n in cfg.fp32_modules.split(",") if n.strip()):
        try:
            find_module(model, name)
        except ValueError as e:
            raise ValueError(f"fp32_modules={cfg.fp32_modules!r}: {e}") from None


def check_factory_apart(cfg, processes) -> None:
    """distlab.models.factory.check in a child process (forked from the ranks' fork server, so
    it imports what the ranks import) leading a process group of its own: the factory's
    exception comes back and is raised here; a factory that runs past RunConfig.timeout_s, or
    kills or exits its process, is a ValueError saying so; the group is ended either way."""
    receive, send = processes.Pipe(duplex=False)
    p = processes.Process(target=_factory_check_child, daemon=True,
                          args=(cfg.to_dict(), dict(os.environ), send),
                          name="distlab-factory-check")
    fork_server.start(p.start)  # a new fork server if the last one died
    send.close()
    what = f"model={cfg.model!r}" + (f", data={cfg.data!r}" if cfg.data else "")
    try:
        if not receive.poll(cfg.timeout_s):
            raise ValueError(f"{what}: building the model and data and one forward did not "
                             f"finish within {cfg.timeout_s:g} s (RunConfig.timeout_s): does "
                             "the factory wait on something (a download, a lock, input())?")
        outcome = receive.recv()
    except EOFError:
        p.join(5.0)
        raise ValueError(f"{what}: the process checking the factory ended (exit code "
                         f"{p.exitcode}) before it finished: the factory killed or exited "
                         "it") from None
    finally:
        receive.close()
        _end_group(p)
    if outcome is not None:
        raise outcome


def _factory_check_child(cfg_dict: dict, env: dict, send) -> None:
    import signal
    import traceback

    from distlab.config import RunConfig
    os.setpgid(0, 0)
    os.environ.clear()  # the caller's environment now, as the ranks get it
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller's Ctrl-C ends the check, not this
    cfg = RunConfig.from_dict(cfg_dict)
    try:
        factory.check(cfg)
        outcome = None
    except SystemExit as e:  # would end the caller's script without a word
        outcome = ValueError(f"model={cfg.model!r}: the factory called sys.exit({e.code!r}) "
                             "while building; raise an exception to refuse a config instead")
    except BaseException as e:  # noqa: BLE001 - the caller raises it
        outcome = e
        try:
            import pickle
            pickle.loads(pickle.dumps(e))
        except Exception:  # noqa: BLE001 - an exception that cannot travel: its text does
            outcome = RuntimeError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    send.send(outcome)
    send.close()
    os._exit(0)  # no atexit handlers of the factory's libraries in a forked child


def _end_group(p) -> None:
    """End the check's process and everything it started: its process group, whose id is its
    pid (a group of that id exists only if it made one, so no other group is hit)."""
    import signal
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except OSError:  # no such group: it died before making it, or nothing is left
        pass
    if p.exitcode is None:
        p.kill()
    p.join(5.0)


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
