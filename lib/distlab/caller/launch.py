"""launch(cfg) -> Run: start N rank processes that each run the library's `train`.

How a launch keeps processes safe from a notebook:

* Ranks are never forked from the caller (a notebook's threads and OpenMP pool would be copied
  into them half-held): they are forked from a fork server, a clean process started on the first
  launch that only imported torch and distlab (`rank_context`), or spawned as fresh
  interpreters where there is no fork server. Either way the function they run is the
  library's, because such a process cannot import a notebook's `__main__`. A warm launch of 4
  ranks then skips importing torch four times (benchmarks/launch_latency.py prints the figures).
* Rendezvous is a FileStore in the run's own folder: nothing listens for it, so two runs
  launched at once can never collide on a port, and no port is open to the network (torch's
  TCPStore server listens on every interface whatever host it is given). The ranks' gloo
  sockets are bound to the loopback interface (GLOO_SOCKET_IFNAME, unless you set it), not to
  whatever the hostname resolves to.
* Every collective has a timeout (RunConfig.timeout_s), so a rank waiting on a peer that never
  comes raises instead of hanging for torch's default (30 minutes for gloo, 10 for NCCL).
* Each rank watches its parent and exits when the parent is gone, so killing the kernel leaves
  no rank behind, even one blocked inside a collective (or stopped: the kernel's
  PR_SET_PDEATHSIG). Each rank leads its own process group, and the run ends the group: what
  a rank started (a model factory's workers) does not outlive it.
* Each rank's stderr goes to its run folder (rank<r>.stderr), where the caller reads a
  backend's last words before an abort, and the stack a silent rank dumps on SIGUSR1.
* Each rank ignores SIGINT: a kernel interrupt stops the run only through `Run.wait()` (which
  then ends the ranks), so interrupting some other cell never kills a run started from a button.
* Each rank writes its traceback to its own event log before exiting; the caller picks the root
  cause from those, not from whichever rank happened to fail last.

The same rank body runs under `torchrun -m distlab ...` (env:// rendezvous); see __main__.py.
"""

from __future__ import annotations

import faulthandler
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distlab import step_ledger
from distlab.caller import fork_server
from distlab.comm import set_group_timeout, steps_explained
from distlab.config import RunConfig
from distlab.events import EventLog, rank_log_path, rank_stderr_path

if TYPE_CHECKING:  # for the annotation; launch() and run_ranks() import Run where they use it
    from distlab.caller.run import Run

RUNS_ENV = "DISTLAB_RUNS"
RENDEZVOUS_FILE = "rendezvous.store"  # the ranks' FileStore, in the run folder while it runs


def runs_root(cfg_root: str = "") -> str:
    return os.path.abspath(cfg_root or os.environ.get(RUNS_ENV) or "runs")


def new_run_dir(root: str, label: str) -> str:
    from distlab.caller.retention import apply_default_rule
    apply_default_rule(root)  # old runs go first, so runs/ does not fill the disk
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{label}-{uuid.uuid4().hex[:6]}"
    path = os.path.join(root, name)
    os.makedirs(path)
    return path


def place_rank(device: str, backend: str, local_rank: int, local_world: int,
               n_gpus: int) -> tuple[str, str]:
    """Where a rank runs and which backend carries its collectives: ("cpu" or "cuda:i",
    "gloo" or "nccl"). Pure (n_gpus is torch.cuda.device_count()), so tests check every case
    on a CPU machine. Raises ValueError for a request that cannot work, saying what would.

        device   backend      GPUs vs ranks on this machine     result
        cpu      auto, gloo   any                               cpu, gloo
        cpu      nccl         any                               error: NCCL needs CUDA tensors
        auto     auto, gloo   0, or fewer GPUs than ranks       cpu, gloo
        auto     nccl         0, or fewer GPUs than ranks       error
        auto     any          one GPU per rank                  cuda:local_rank, nccl (auto)
        cuda     any          0                                 error: no CUDA GPU
        cuda     any          one GPU per rank                  cuda:local_rank, nccl (auto)
        cuda     gloo         fewer GPUs than ranks             cuda:(local_rank % GPUs), gloo
        cuda     auto, nccl   fewer GPUs than ranks             error: NCCL needs a GPU per rank

    NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"); gloo
    accepts CUDA tensors for some collectives (torch's backend table lists broadcast and
    all-reduce; distlab.studies.gpu.probe_collectives finds out which on the machine at hand), so
    ranks may share a GPU only when backend='gloo' is asked for. Neither claim has been
    checked on a GPU yet: tests/gpu/test_multirank_one_gpu.py checks both where there is one."""
    if device not in ("auto", "cpu", "cuda") or backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"device={device!r} / backend={backend!r}: device is 'auto', 'cpu' or "
                         "'cuda'; backend 'auto', 'gloo' or 'nccl'")
    enough = n_gpus >= local_world
    if device == "cpu" or (device == "auto" and not enough):
        if backend == "nccl":
            why = ("device='cpu'" if device == "cpu" else
                   f"device='auto' found {n_gpus} GPU(s) for {local_world} rank(s), so it runs "
                   "on the CPU")
            raise ValueError(f"backend='nccl' carries CUDA tensors only, and {why}: use "
                             "backend='gloo' (or 'auto') on the CPU, or device='cuda' with one "
                             "GPU per rank")
        return "cpu", "gloo"
    if n_gpus == 0:
        raise ValueError("device='cuda' but torch sees no CUDA GPU (torch.cuda.is_available() "
                         "is False): use device='cpu' or 'auto'")
    if enough:
        return f"cuda:{local_rank}", "nccl" if backend == "auto" else backend
    if backend == "gloo":  # asked for: ranks share the GPUs, round robin
        return f"cuda:{local_rank % n_gpus}", "gloo"
    raise ValueError(f"device='cuda' with {local_world} ranks on {n_gpus} GPU(s): NCCL needs "
                     f"one GPU per rank (it refuses two ranks on one GPU). Set backend='gloo' "
                     f"to let the ranks share the GPU(s) (gloo takes CUDA tensors for some "
                     f"collectives), or run {n_gpus} rank(s)")


def local_gpu_count() -> int:
    """CUDA GPUs torch sees on this machine (0 without CUDA); does not initialise CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_device(device: str, local_rank: int, local_world: int,
                  backend: str = "auto") -> torch.device:
    """This rank's device (place_rank's rule, with this machine's GPUs); sets the current CUDA
    device when it is one."""
    where, _ = place_rank(device, backend, local_rank, local_world, local_gpu_count())
    if where == "cpu":
        return torch.device("cpu")
    index = int(where.split(":")[1])
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _watch_parent(launcher_pid: int):
    """Exit when the launching process is gone. A spawned rank's parent is the launcher; a
    forked one's is the fork server, which exits when the launcher does: either way the parent
    changes (the rank is re-parented) when the launcher is gone. os._exit works even while the
    main thread is blocked inside a gloo collective, because gloo releases the GIL while it
    waits."""
    parent = os.getppid()
    while True:
        if os.getppid() != parent or not _alive(launcher_pid):
            if os.getpgrp() == os.getpid():  # and what the rank started: its own group,
                os.killpg(0, signal.SIGKILL)  # never the caller's
            os._exit(3)
        time.sleep(0.5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: no signal, only the check that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else (the pid was reused)
        return False
    return True


def preload() -> list[str]:
    """What the fork server imports once, so each rank forked from it starts with them loaded:
    torch, the training loop and every strategy's module (with FSDP2, DTensor and pipelining
    behind the torch variants), and torch._dynamo, which the first torch.optim optimizer
    imports (2.2 s of a rank's 2.4 s setup, measured on the 2-core machine)."""
    from distlab.parallel import REGISTRY
    return (["torch", "torch.distributed", "torch._dynamo", "distlab.rank.train", "distlab.caller.launch"]
            + sorted({path.split(":")[0] for path in REGISTRY.values()}))
START_ENV = "DISTLAB_START"  # "spawn" forces a fresh interpreter per rank


def rank_context():
    """Where the platform has one (Linux, macOS), a fork server: one clean process, started on
    the first launch, that has imported torch and distlab (`preload()`) and forks every rank from
    itself. Importing torch costs each spawned rank ~1.5 s of CPU; a forked rank shares the
    server's imported modules, so a launch no longer pays it per rank. The server never runs a
    notebook's threads or an OpenMP pool (it is not the notebook's process; it only imports),
    so forking it is as safe as spawning. Elsewhere (Windows), or with DISTLAB_START=spawn,
    each rank is a fresh interpreter."""
    method = os.environ.get(START_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_ENV}={method!r} is not 'forkserver' nor 'spawn'")
    if method == "forkserver" and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(preload())
        return ctx
    return mp.get_context("spawn")


def rank_body(rank: int, world: int, spec: dict, init: dict) -> None:
    """What every rank does: set up, run `spec['fn']`, log the outcome. Never returns on error.

    init: {"file": path} to join the launcher's FileStore, or {"env": True} under torchrun.
    """
    log = EventLog(rank_log_path(spec["run_dir"], rank), rank)
    forward_warnings(log)
    try:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        threads = spec["threads"] or max(1, (os.cpu_count() or 1) // local_world)
        torch.set_num_threads(threads)  # before any op: oversubscribed cores slow steps 3-20x
        if spec["debug"]:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        _, backend = place_rank(spec["device"], spec["backend"], local_rank, local_world,
                                local_gpu_count())
        device = choose_device(spec["device"], local_rank, local_world, spec["backend"])
        timeout = timedelta(seconds=spec["timeout_s"])
        if "file" in init:
            step_ledger.watch_disk(os.path.dirname(os.path.abspath(init["file"])))
            store = dist.FileStore(init["file"], world)
            store.set_timeout(timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                    timeout=timeout)
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            init_under_torchrun_agent_store(backend, rank, world, timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
        set_group_timeout(timeout)  # the mesh's groups wait as long as the world does
        result = spec["fn"](rank, world, device, log, *spec["args"])
        if spec.get("save_result"):
            torch.save(result, os.path.join(spec["run_dir"], f"result{rank}.pt"))
        # Leave together: a rank tearing down its connections while a peer still uses them
        # can abort the peer. A peer still in a step reads "finished" and stops waiting
        # (step_ledger.peers_left), said with the step mismatch.
        step_ledger.mark("finished")
        with steps_explained(None):
            dist.barrier()
        dist.destroy_process_group()
        log.write("done", last_step=log.last_step)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the caller
        step_ledger.mark(f"failed: {type(e).__name__}: {e}")  # the peers' waits end naming it
        # the step in progress when it failed (the last one logged was finished)
        log.write("error", step=log.last_step + 1, error=f"{type(e).__name__}: {e}",
                  traceback=traceback.format_exc())
        log.close()
        if "env" in init:  # torchrun: no Run reads the log, so the terminal gets the traceback
            print(f"[rank {rank}] " + traceback.format_exc(), file=sys.stderr, flush=True)
        os._exit(1)  # skip interpreter teardown: peers may be wedged in a collective with us
    log.close()


DISTLAB_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def forward_warnings(log) -> None:
    """distlab's own warnings in a rank (uneven rows under DDP, a checkpoint skipped on resume)
    also become "warning" events, which the caller's Run reports; others stay on stderr."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if os.path.abspath(filename).startswith(DISTLAB_DIR + os.sep):
            log.write("warning", message=str(message))
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def init_under_torchrun_agent_store(backend: str, rank: int, world: int, timeout: timedelta):
    """Join torchrun's process group in the store its agent keeps across restarts, under a
    prefix per attempt. env:// alone uses the same keys every attempt, so after a restart
    (--max-restarts) a rank could read a dead worker's address and fail with "Gloo
    connectFullMesh failed ... Connect timeout" (measured: 4 of 6 restarts; pytorch#135712)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          False, timeout=timeout)
    store = dist.PrefixStore(f"distlab/attempt{attempt}", agent)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _own_process_group() -> None:
    """The rank leads a process group of its own, so the caller ends it together with every
    process it started (a model factory's workers), by group, not by pid."""
    try:
        os.setpgid(0, 0)
    except OSError:  # already a group leader (a platform that starts it so)
        pass


def _die_with_parent(launcher_pid: int) -> None:
    """Linux: SIGKILL from the kernel when the rank's parent exits. The parent-watching thread
    cannot act in a stopped rank (SIGSTOP, a debugger); the kernel's signal still lands."""
    if sys.platform.startswith("linux"):
        import ctypes
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    # A parent already gone sends no signal: a fork server killed as it forked this rank may
    # have died before telling the launcher its pid. Such a rank would join the rendezvous
    # beside the rank the launcher starts again in its place (distlab.caller.fork_server).
    if _orphaned(launcher_pid):
        os._exit(3)


def _orphaned(launcher_pid: int) -> bool:
    """Neither the rank's parent (spawned) nor its parent's parent (forked from the fork
    server) is the launcher: the rank was re-parented. False where /proc cannot say."""
    parent = os.getppid()
    if parent == launcher_pid:
        return False
    try:
        with open(f"/proc/{parent}/stat") as f:
            grandparent = int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return False
    return grandparent != launcher_pid


def _release_fork_server() -> None:
    """A rank forked from the fork server holds a copy of the fd that keeps the server alive
    (multiprocessing passes it to every child, so children may fork too). A rank that cannot
    exit (stopped) would then keep the server, and through it itself, alive after the launcher
    is killed. The ranks start no processes through it, so they let go of it: the server exits
    with the launcher, and the kernel ends its ranks (PR_SET_PDEATHSIG)."""
    from multiprocessing import forkserver
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def _stderr_to_file(path: str) -> None:
    """fd 2 into the run folder, where the caller reads it: a backend's abort message (gloo's
    "terminate called ..." before SIGABRT) and the stack a silent rank dumps on SIGUSR1
    (faulthandler) would otherwise scroll past in the terminal that started Jupyter."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        return  # a full or read-only disk: keep the inherited stderr
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def loopback_interface() -> str:
    """The name of the interface that holds 127.0.0.1: "lo" on Linux, "lo0" on macOS."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((n for n in ("lo", "lo0") if n in names), "lo")


def _spawned_rank(rank: int, world: int, spec: dict, rendezvous: str, parent_pid: int):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller decides when a run stops
    _own_process_group()
    _die_with_parent(parent_pid)
    _release_fork_server()
    _stderr_to_file(rank_stderr_path(spec["run_dir"], rank))
    # the launcher's environment now, as a spawned process gets it (the fork server's is that of
    # the first launch)
    os.environ.clear()
    os.environ.update(spec["env"])
    # a local run talks over loopback only; a user who wants another interface sets these
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback_interface())
    # and fresh Python, NumPy and torch generators, seeded from the OS as a new interpreter's
    # are (a fork copies the server's: every rank of every run would draw the same numbers)
    random.seed()
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    rank_body(rank, world, spec, {"file": rendezvous})
    # Everything is logged and flushed; skip interpreter teardown, where C++ threads of the
    # store client have aborted ranks ("terminate called without an active exception").
    os._exit(0)


def _check_importable(fn):
    if getattr(fn, "__module__", "__main__") == "__main__" or "<locals>" in fn.__qualname__:
        raise ValueError(f"{fn.__qualname__} must be a module-level function of an importable "
                         "module: spawned ranks cannot import a notebook's or script's __main__")


def start_ranks(fn, world: int, args: tuple, run_dir: str, *, backend="auto", device="auto",
                timeout_s=60.0, threads=0, debug=False, save_result=False):
    """Spawn `world` processes running fn(rank, world, device, log, *args). Returns
    (processes, the rendezvous file), which the Run removes when the run ends."""
    _check_importable(fn)
    # an impossible device/backend request fails here, in the caller, before any rank starts
    place_rank(device, backend, 0, world, local_gpu_count())
    os.makedirs(run_dir, exist_ok=True)
    # The rendezvous is a file of this run's folder: no port to pick, none open to the network.
    rendezvous = os.path.join(run_dir, RENDEZVOUS_FILE)
    spec = {"fn": fn, "args": args, "run_dir": run_dir, "backend": backend, "device": device,
            "timeout_s": timeout_s, "threads": threads, "debug": debug,
            "save_result": save_result, "env": dict(os.environ)}
    ctx = rank_context()
    # all ranks again if the fork server dies as they start (those started went with it)
    procs = fork_server.start(lambda: _start_each(ctx, world, spec, rendezvous))
    return procs, rendezvous


def _start_each(ctx, world: int, spec: dict, rendezvous: str) -> list:
    """Start every rank, or none: one that fails to start ends those started before it."""
    # a file left by an earlier launch into the same folder, or by the ranks of an attempt that
    # failed to start, would hand out dead addresses
    if os.path.exists(rendezvous):
        os.remove(rendezvous)
    procs, server = [], None
    try:
        for rank in range(world):
            p = ctx.Process(target=_spawned_rank, name=f"distlab-rank{rank}", daemon=False,
                            args=(rank, world, spec, rendezvous, os.getpid()))
            p.start()
            procs.append(p)
            server = fork_server.same_server(server)  # all from one server, or start again
    except BaseException:
        for p in procs:
            p.kill()
            p.join(5.0)
        raise
    return procs


def launch(cfg: RunConfig, block: bool = False, run_dir: str | None = None,
           progress_every: int = 0):
    """Start a training run of `cfg` and return its `Run` handle at once (or, with block=True,
    after it finished; failures then raise RunError). progress_every > 0: one rank prints a
    line every that many steps and a summary on stdout (distlab.caller.progress; the command line's)."""
    from distlab.caller import preflight
    from distlab.caller.run import Run
    from distlab.rank.train import train_rank

    # this machine: paths, your model (checked in a process from where the ranks start), memory
    preflight.check(cfg, runs_root(cfg.runs_root), rank_context())
    run_dir = run_dir or new_run_dir(runs_root(cfg.runs_root),
                                     cfg.name or f"{cfg.strategy}-w{cfg.world_size}")
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        f.write(cfg.to_json())
    if cfg.nodes > 1:  # one torchrun agent per simulated node
        from distlab.caller.cluster_run import launch_on_nodes
        run = launch_on_nodes(cfg, run_dir)
        return run.wait() if block else run
    fn, args = train_rank, (cfg.to_dict(),)
    if progress_every > 0:
        from distlab.caller.progress import train_rank_with_progress
        fn, args = train_rank_with_progress, (cfg.to_dict(), progress_every)
    procs, rendezvous = start_ranks(fn, cfg.processes, args, run_dir, backend=cfg.backend,
                                    device=cfg.device, timeout_s=cfg.timeout_s,
                                    threads=cfg.threads_per_rank, debug=cfg.debug)
    run = Run(run_dir, cfg=cfg, processes=procs, rendezvous=rendezvous)
    return run.wait() if block else run


def run_ranks(fn, world: int, *args, timeout_s: float = 60.0, backend="auto", device="auto",
              threads=0, debug=False, run_dir: str | None = None, wall_timeout_s=None,
              on_start: Callable[[Run], None] | None = None):
    """Run fn(rank, world, device, log, *args) on `world` ranks and return the list of their
    return values (rank order). For demos and tests of collectives; fn must be importable and
    return tensors, numbers, strings, lists or dicts (loaded back with weights_only=True).

    on_start(run) is called with the live Run right after the ranks started, before the wait:
    a caller in another thread (an explorer's Run button) reads its progress from it and may
    stop it; a run stopped before its ranks returned raises RunStopped."""
    from distlab.caller.run import Run, RunStopped

    run_dir = run_dir or new_run_dir(runs_root(), f"{fn.__name__}-w{world}")
    procs, rendezvous = start_ranks(fn, world, args, run_dir, backend=backend, device=device,
                                    timeout_s=timeout_s, threads=threads, debug=debug,
                                    save_result=True)
    run = Run(run_dir, processes=procs, rendezvous=rendezvous, world_size=world)
    if on_start is not None:
        try:
            on_start(run)
        except BaseException:  # the caller's hook failed: no rank may be left running
            run.stop()
            raise
    run.wait(timeout=wall_timeout_s)
    if run.status != "done":  # stopped or preempted: no rank wrote its result
        raise RunStopped(f"run {os.path.basename(run_dir)} ended {run.status!r} before its "
                         "ranks returned their results")
    return [_take_result(run_dir, r) for r in range(world)]


def _take_result(run_dir: str, rank: int):
    """Rank's return value, read back and its file removed: the caller holds it now, and a
    notebook's launches of whole state dicts would otherwise fill the disk (one pass over the
    workbook left 191 MB of them from notebook 04 alone)."""
    path = os.path.join(run_dir, f"result{rank}.pt")
    result = torch.load(path, weights_only=True)
    os.remove(path)
    return result
