"""Every collective the library uses goes through here, and here it is counted.

`Comm` wraps torch.distributed for one rank and keeps, per collective kind, the number of
calls, the bytes this rank sent and received, and the seconds spent waiting.

Two kinds of byte counts, and the convention for each:

* **Counted** (`all_reduce.ring`, `all_reduce.naive`, `send`, `recv`): algorithms written here
  from point-to-point messages. Every byte handed to `isend`/`irecv` is added up; these are the
  bytes this rank really put on (or took off) the wire.
* **Modeled** (`all_reduce`, `all_gather`, `reduce_scatter`, `broadcast`): the backend's own
  collectives, whose wire traffic we cannot see. We record what the bandwidth-optimal ring
  algorithm moves per rank (the "bus bytes" convention of nccl-tests), e.g. 2(N-1)/N·S for an
  all-reduce of S bytes. `Comm.MODELED` lists these kinds.

**On the wire** (`wire_sent`, distlab.wire): what the kernel counted this process writing
while a blocking call ran alone, headers included; Linux and gloo only. Asynchronous calls
overlap, so their bytes are measured over the whole step (`wire.LEDGER`), not per call.

**Asynchronous** collectives (`all_reduce_async`, `all_gather_async`) book their bytes when
they are issued and return a `Pending` handle; `Pending.wait()` books the seconds the caller
was blocked, so for them `seconds` is the *exposed* communication time, not the time on the wire
(the part hidden behind computation costs nothing and is not booked).

The module also holds the α-β cost model (time = latency + bytes / bandwidth) that predicts how
long each algorithm takes on a given link.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab import gloo_exit, step_ledger, wire
from distlab.units import tensor_bytes

# Every group's collective timeout: the launcher sets the world's (RunConfig.timeout_s) here.
# torch gives a group made by dist.new_group a default of its own, 30 minutes on gloo (measured
# with torch 2.13), not the world's: a peer stopped inside a tp, pp or cp group would hold its
# ranks that long, and only the caller's watch on silent ranks would end the run.
_group_timeout = None


def set_group_timeout(timeout) -> None:
    """The timeout (a timedelta) every group new_group makes gets: the world's."""
    global _group_timeout
    _group_timeout = timeout


_groups: dict = {}  # members -> the group made for them, in the world _groups_world holds
_groups_world: list = []  # that world's group object (held, so a new world is never mistaken)


def new_group(ranks: list[int]):
    """dist.new_group with the world's collective timeout (set_group_timeout), not torch's
    default for a new group. Like dist.new_group, a collective over the whole world.

    Made once per members and world: a launch that trains several configs in turn
    (distlab.rank.train.train_with_state) asks every rank for the same groups in the same
    order, and each dist.new_group connects its members anew (measured: 15 mesh configs at
    world 8 spent 5 of their 40 s making groups). A new world (destroy_process_group, then
    init_process_group) starts the cache again."""
    world = dist.group.WORLD
    if not _groups_world or _groups_world[0] is not world:
        _groups.clear()
        _groups_world[:] = [world]
    key = tuple(ranks)
    if key not in _groups:
        _groups[key] = dist.new_group(ranks, timeout=_group_timeout)
    return _groups[key]


@dataclass
class KindStats:
    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    seconds: float = 0.0
    wire_sent: int = 0  # bytes the kernel saw written during the calls measured alone
    wire_calls: int = 0  # how many calls were measured alone (see distlab.wire.Ledger)

    def as_dict(self):
        return {"calls": self.calls, "bytes_sent": self.bytes_sent,
                "bytes_recv": self.bytes_recv, "seconds": self.seconds,
                "wire_sent": self.wire_sent if self.wire_calls else None,
                "wire_calls": self.wire_calls}


# torch 2.13 renamed the tensor forms of all-gather and reduce-scatter; older releases have only
# the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Work handles in flight in this process (async collectives, isend): while one is, the write
# counter's growth cannot be pinned on a single call.
_IN_FLIGHT: list = []


def _busy() -> bool:
    _IN_FLIGHT[:] = [w for w in _IN_FLIGHT if not w.is_completed()]
    return bool(_IN_FLIGHT)


@contextlib.contextmanager
def steps_explained(group):
    """A collective that fails because a peer failed or left its loop, or while the ranks are
    at different steps (distlab.step_ledger), fails with that said first."""
    try:
        yield
    except step_ledger.PeersLeft:
        raise  # already says why
    except RuntimeError as e:
        why = (step_ledger.peers_left(group, own_error=str(e))
               or step_ledger.disagreement(group))
        if why is None:
            raise
        raise RuntimeError(f"{why}.\n{e}") from e


# a wait that ends early, saying why, when a peer failed or left its loop (step_ledger's)
wait_watching = step_ledger.wait_watching


class Watched:
    """A point-to-point Work whose wait() is wait_watching's (what isend/irecv return);
    `what` says it to the peers while it blocks ("recv from rank 1")."""

    def __init__(self, work, group, what: str):
        self.work, self.group, self.what = work, group, what

    def wait(self):
        with steps_explained(self.group):
            wait_watching(self.work, self.group, self.what)
        _forget(self.work)
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _forget(work) -> None:
    """A waited Work leaves _IN_FLIGHT now: it holds its tensors, and a result with an autograd
    graph (tensor parallelism's g) would otherwise keep the graph, and through its saved-tensor
    hooks the model, alive after the run (Works are invisible to Python's collector)."""
    for i, w in enumerate(_IN_FLIGHT):
        if w is work:
            del _IN_FLIGHT[i]
            return


class Pending:
    """A collective in flight, from `Comm.all_reduce_async` or `Comm.all_gather_async`.

    Its bytes were booked when it was issued. `wait()` blocks until it has finished, books the
    seconds it blocked under the same kind, and returns the result tensor. Three moments, on
    the time.perf_counter clock, draw its life:

        issued   the call that started it returned
        done     it finished: a callback on the backend's future notes the time. The callback
                 needs the GIL, so it can lag by up to sys.getswitchinterval() (5 ms) while the
                 main thread runs Python code. Checked on CPU/gloo only; on NCCL prefer
                 `waited`
        waited   wait() returned (None until then)
    """

    def __init__(self, comm: "Comm", kind: str, work, result: torch.Tensor,
                 unsliced: str | None = None):
        self.comm, self.kind, self.work, self.result = comm, kind, work, result
        self.unsliced = unsliced  # wait_watching's: what to publish while it blocks
        self.issued = time.perf_counter()
        _IN_FLIGHT.append(work)
        comm._unmeasured(kind)
        self.done: float | None = None
        self.waited: float | None = None
        try:
            work.get_future().then(self._mark_done)
        except (RuntimeError, AttributeError):  # a backend without futures: done = waited
            pass

    def _mark_done(self, fut):
        if self.done is None:  # wait() may have noted it first
            self.done = time.perf_counter()

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def future(self):
        """The backend's future (what a torch DDP comm hook must return)."""
        return self.work.get_future()

    def wait(self) -> torch.Tensor:
        if self.waited is None:
            t0 = time.perf_counter()
            with steps_explained(self.comm.group):
                wait_watching(self.work, self.comm.group, self.unsliced)
            self.waited = time.perf_counter()
            _forget(self.work)
            self.done = self.done if self.done is not None else self.waited
            self.comm._add(self.kind, 0, 0, self.waited - t0, calls=0)
        return self.result


class Comm:
    """Instrumented collectives for one rank of a process group."""

    MODELED = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")

    def __init__(self, group=None, name: str = ""):
        self.group, self.name = group, name  # name: the mesh group ("tp", "dp", "pp")
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.members = dist.get_process_group_ranks(group or dist.group.WORLD)  # global ranks
        self.stats: dict[str, KindStats] = {}
        self.buffer_bytes_peak = 0  # largest scratch buffer an algorithm here allocated
        backend = dist.get_backend(group)
        if wire.LEDGER.blind == wire.NO_COUNTER:  # the first Comm of this process
            wire.LEDGER.open(backend)
        if backend == "gloo":
            gloo_exit.arm()  # no abort at exit while a gloo worker still holds a tensor

    # -- accounting ------------------------------------------------------------------------
    def _add(self, kind, sent, recv, seconds, calls=1, wire_sent=None):
        s = self.stats.setdefault(kind, KindStats())
        s.calls += calls
        s.bytes_sent += int(sent)
        s.bytes_recv += int(recv)
        s.seconds += seconds
        if wire_sent is not None:
            s.wire_sent += wire_sent
            s.wire_calls += calls

    def _key(self, kind: str) -> str:
        return f"{self.name}.{kind}" if self.name else kind

    def _unmeasured(self, kind: str) -> None:
        wire.LEDGER.add_unmeasured(self._key(kind))

    def _call(self, kind, sent, recv, fn, unsliced: str | None = None):
        """Run `fn` (which starts a collective and returns its Work) and wait for it
        (wait_watching), book `sent`/`recv` bytes and its seconds under `kind`, and the bytes
        the kernel saw written meanwhile if nothing else was in flight."""
        w0 = self._wire_start()
        t0 = time.perf_counter()
        with steps_explained(self.group):
            out = fn()
            wait_watching(out, self.group, unsliced)
        seconds = time.perf_counter() - t0
        self._add(kind, sent, recv, seconds, wire_sent=self._wire_stop(kind, w0))
        return out

    def _wire_start(self) -> int | None:
        return None if _busy() else wire.LEDGER.now()

    def _wire_stop(self, kind: str, w0: int | None) -> int | None:
        """Bytes written since `w0`, booked as exact, or None (the step's total has them)."""
        if w0 is not None and not _busy():
            w = wire.LEDGER.now() - w0
            wire.LEDGER.add_exact(self._key(kind), w)
            return w
        if wire.LEDGER.blind is None:
            self._unmeasured(kind)
        return None

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        self.buffer_bytes_peak = max(self.buffer_bytes_peak, tensor_bytes(like))
        return torch.empty_like(like)

    def note_buffer(self, nbytes: int):
        """A strategy holds a communication buffer of `nbytes` this step (DDP's buckets)."""
        self.buffer_bytes_peak = max(self.buffer_bytes_peak, int(nbytes))

    def snapshot(self) -> dict:
        return {k: v.as_dict() for k, v in self.stats.items()}

    def take_step_stats(self) -> tuple[dict, int]:
        """Stats since the last call (a step's worth), and the step's peak buffer bytes."""
        out, peak = self.snapshot(), self.buffer_bytes_peak
        self.stats, self.buffer_bytes_peak = {}, 0
        return out, peak

    def _unsliced(self, kind: str) -> str:
        """What a wait that cannot be sliced publishes (step_ledger.wait_watching): gloo's
        reduce-scatter ignores a wait's timeout."""
        return f"{kind} on ranks {','.join(map(str, self.members))}"

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    # -- backend collectives (modeled bytes) ----------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: str = "sum", algorithm: str = "torch"):
        """Reduce `t` in place across ranks. op: "sum" or "avg". algorithm: torch|ring|naive."""
        if op not in ("sum", "avg"):
            raise ValueError(f"op={op!r} is not one of 'sum', 'avg'")
        if algorithm == "ring":
            self.ring_all_reduce(t)
        elif algorithm == "naive":
            self.naive_all_reduce(t)
        elif algorithm == "torch":
            n, S = self.world, tensor_bytes(t)
            self._call("all_reduce", 2 * (n - 1) * S / n, 2 * (n - 1) * S / n,
                       lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group,
                                               async_op=True))
        else:
            raise ValueError(f"algorithm={algorithm!r} is not one of 'torch', 'ring', 'naive'")
        if op == "avg":
            t.div_(self.world)
        return t

    def all_reduce_async(self, t: torch.Tensor, kind: str = "all_reduce") -> Pending:
        """Start summing `t` in place across ranks and return at once. Books the ring's
        2(N-1)/N·S bytes now, under `kind`; the handle's wait() books the seconds blocked.
        Every rank must issue its async collectives in the same order."""
        n, S = self.world, tensor_bytes(t)
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._add(kind, 2 * (n - 1) * S / n, 2 * (n - 1) * S / n, 0.0)
        return Pending(self, kind, work, t)

    def all_gather_async(self, out: torch.Tensor, t: torch.Tensor,
                         kind: str = "all_gather") -> Pending:
        """Start gathering every rank's `t` into `out` (world × t.numel(), flat, rank order).
        Books the ring's (N-1)/N·|out| bytes now; wait() returns `out`."""
        n, S = self.world, tensor_bytes(out)
        work = _all_gather_tensor(out, t, group=self.group, async_op=True)
        self._add(kind, (n - 1) * S / n, (n - 1) * S / n, 0.0)
        return Pending(self, kind, work, out)

    def reduce_scatter_async(self, out: torch.Tensor, t: torch.Tensor,
                             kind: str = "reduce_scatter") -> Pending:
        """Start summing every rank's `t` (flat, world × out.numel()) and return at once; `out`
        gets this rank's block of the sum. Books the ring's (N-1)/N·|t| bytes now."""
        n, S = self.world, tensor_bytes(t)
        work = _reduce_scatter_tensor(out, t, op=dist.ReduceOp.SUM, group=self.group,
                                      async_op=True)
        self._add(kind, (n - 1) * S / n, (n - 1) * S / n, 0.0)
        return Pending(self, kind, work, out, self._unsliced("reduce_scatter"))

    def broadcast(self, t: torch.Tensor, src: int = 0):
        """Copy `t` from group rank `src` to every rank (modeled as a pipelined chain)."""
        n, S = self.world, tensor_bytes(t)
        pos = (self.rank - src) % n  # place in the chain src -> src+1 -> ...
        self._call("broadcast", S if pos < n - 1 else 0, S if pos > 0 else 0,
                   lambda: dist.broadcast(t, src=self._global(src), group=self.group,
                                          async_op=True))
        return t

    def broadcast_tensors(self, tensors, src: int = 0) -> None:
        """Every tensor of `tensors` from group rank `src` to every rank, as one flat message
        per dtype and device (one broadcast per tensor cost ~1 ms each: a GPT's 100 or so
        made TP's and DP's setup seconds on 8 ranks)."""
        groups: dict = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for same in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            self.broadcast(flat, src=src)
            for t, part in zip(same, flat.split([t.numel() for t in same])):
                t.copy_(part.view_as(t))

    def all_gather(self, out: torch.Tensor, t: torch.Tensor, kind: str = "all_gather"):
        """out (world × t.numel(), flat) gets every rank's `t`, in rank order."""
        n, S = self.world, tensor_bytes(out)
        self._call(kind, (n - 1) * S / n, (n - 1) * S / n,
                   lambda: _all_gather_tensor(out, t, group=self.group, async_op=True))
        return out

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, op: str = "sum"):
        """out gets this rank's 1/world block of the sum (or mean) of every rank's `t`."""
        n, S = self.world, tensor_bytes(t)
        self._call("reduce_scatter", (n - 1) * S / n, (n - 1) * S / n,
                   lambda: _reduce_scatter_tensor(out, t, op=dist.ReduceOp.SUM,
                                                  group=self.group, async_op=True),
                   unsliced=self._unsliced("reduce_scatter"))
        if op == "avg":
            out.div_(n)
        return out

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None, kind: str = "all_to_all"):
        """Block i of `t` (dim 0; in_splits[i] rows, or equal blocks) goes to rank i; `out`
        gets rank i's block for this rank at block i (out_splits[i] rows). The payload to and
        from the other ranks is booked, exact: |t| - own block sent, |out| - own block
        received; with equal blocks (N-1)/N of the buffer (the single form,
        all_to_all_single, which gloo has run since 2020; the list form only since 2026)."""
        row = t[0].numel() * t.element_size() if t.dim() and len(t) else 0
        orow = out[0].numel() * out.element_size() if out.dim() and len(out) else 0
        n, me = self.world, self.rank
        own_in = in_splits[me] if in_splits is not None else len(t) // n
        own_out = out_splits[me] if out_splits is not None else len(out) // n
        self._call(kind, (len(t) - own_in) * row, (len(out) - own_out) * orow,
                   lambda: dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits,
                                                  group=self.group, async_op=True))
        return out

    def barrier(self):
        # torch's own barrier (step_ledger notes the user's calls of dist.barrier)
        self._call("barrier", 0, 0, lambda: dist.distributed_c10d.barrier(group=self.group,
                                                                           async_op=True))

    # -- point to point (counted bytes) -----------------------------------------------------
    def send(self, t: torch.Tensor, dst: int, kind: str = "send"):
        self._call(kind, tensor_bytes(t), 0,
                   lambda: dist.isend(t.contiguous(), dst=self._global(dst), group=self.group),
                   unsliced=f"send to rank {self._global(dst)}")

    def recv(self, t: torch.Tensor, src: int, kind: str = "recv", tag: int = 0):
        self._call(kind, 0, tensor_bytes(t),
                   lambda: dist.irecv(t, src=self._global(src), group=self.group, tag=tag),
                   unsliced=f"recv from rank {self._global(src)}")
        return t

    def isend(self, t: torch.Tensor, dst: int, kind: str = "send", tag: int = 0):
        """Start sending `t` and return the work handle (wait() on it before reusing `t`).
        A pipeline sends without blocking, so two stages sending to each other cannot both
        wait for the other's receive. Books the bytes now."""
        t = t.contiguous()
        work = dist.isend(t, dst=self._global(dst), group=self.group, tag=tag)
        _IN_FLIGHT.append(work)
        self._unmeasured(kind)
        self._add(kind, tensor_bytes(t), 0, 0.0)
        return Watched(work, self.group, f"send to rank {self._global(dst)}")

    def irecv(self, t: torch.Tensor, src: int, kind: str = "recv", tag: int = 0):
        """Start receiving into `t` from group rank `src`; wait() on the handle before reading
        `t`. Books the bytes now."""
        work = dist.irecv(t, src=self._global(src), group=self.group, tag=tag)
        _IN_FLIGHT.append(work)
        self._unmeasured(kind)
        self._add(kind, 0, tensor_bytes(t), 0.0)
        return Watched(work, self.group, f"recv from rank {self._global(src)}")

    def _exchange(self, send_t, dst, recv_t, src):
        """Send one tensor and receive another at once (no deadlock in a ring).

        The receive is posted first, as MPI practice advises: gloo's send waits for the
        peer's posted receive. Measured across a 100 Mbit/s link between simulated nodes, two
        pairs of ranks each exchanging 4 MiB both ways: 0.98-1.05 s with the send posted
        first, 0.72 s with the receive first (one way alone: 0.70 s)."""
        reqs = [dist.irecv(recv_t, src=self._global(src), group=self.group),
                dist.isend(send_t, dst=self._global(dst), group=self.group)]
        for r in reqs:
            r.wait()
        return tensor_bytes(send_t), tensor_bytes(recv_t)

    # -- all-reduce algorithms built from send/recv ----------------------------------------
    def ring_all_reduce(self, t: torch.Tensor):
        """Ring all-reduce (sum): reduce-scatter then all-gather around the ring.

        The tensor is cut into N chunks. In N-1 reduce-scatter steps each rank passes one chunk
        to its right neighbour and adds the chunk arriving from its left; afterwards rank r holds
        the full sum of chunk r+1. In N-1 all-gather steps the finished chunks travel round the
        ring. Each rank sends and receives 2(N-1) chunks: 2(N-1)/N·S bytes, whatever N is, which
        is why the ring is bandwidth-optimal (Patarasuk & Yuan 2009; Baidu's ring all-reduce).
        """
        n, r = self.world, self.rank
        if n == 1:
            return t
        flat = t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)
        chunks = list(flat.tensor_split(n))
        right, left = (r + 1) % n, (r - 1) % n
        sent = recv = 0
        w0, t0 = self._wire_start(), time.perf_counter()
        incoming = self._buffer(chunks[0])  # chunk 0 is the largest of tensor_split's chunks
        for k in range(n - 1):  # reduce-scatter
            si, ri = (r - k) % n, (r - k - 1) % n
            buf = incoming[: chunks[ri].numel()]
            s, v = self._exchange(chunks[si], right, buf, left)
            chunks[ri].add_(buf)
            sent, recv = sent + s, recv + v
        for k in range(n - 1):  # all-gather
            si, ri = (r + 1 - k) % n, (r - k) % n
            s, v = self._exchange(chunks[si], right, chunks[ri], left)
            sent, recv = sent + s, recv + v
        self._add("all_reduce.ring", sent, recv, time.perf_counter() - t0,
                  wire_sent=self._wire_stop("all_reduce.ring", w0))
        if not t.is_contiguous():
            t.copy_(flat.view_as(t))
        return t

    def naive_all_reduce(self, t: torch.Tensor):
        """Gather every tensor to rank 0, sum there, send the sum back: the parameter-server
        pattern. Rank 0 receives (N-1)·S and sends (N-1)·S; its link is the bottleneck."""
        n = self.world
        if n == 1:
            return t
        sent = recv = 0
        w0, t0 = self._wire_start(), time.perf_counter()
        if self.rank == 0:
            incoming = self._buffer(t)
            for src in range(1, n):  # sum in rank order
                dist.recv(incoming, src=self._global(src), group=self.group)
                t.add_(incoming)
                recv += tensor_bytes(incoming)
            for dst in range(1, n):
                dist.send(t, dst=self._global(dst), group=self.group)
                sent += tensor_bytes(t)
        else:
            dist.send(t, dst=self._global(0), group=self.group)
            dist.recv(t, src=self._global(0), group=self.group)
            sent, recv = tensor_bytes(t), tensor_bytes(t)
        self._add("all_reduce.naive", sent, recv, time.perf_counter() - t0,
                  wire_sent=self._wire_stop("all_reduce.naive", w0))
        return t


# -- theory: bytes per rank --------------------------------------------------------------------
def ring_allreduce_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of `nbytes`: 2(N-1)/N·S."""
    return 2 * (n - 1) * nbytes / n


def naive_allreduce_bytes(nbytes: float, n: int) -> dict:
    """Gather-to-root then broadcast: the root moves (N-1)·S each way, the others S each way."""
    return {"root_sent": (n - 1) * nbytes, "root_recv": (n - 1) * nbytes,
            "other_sent": nbytes, "other_recv": nbytes}


# -- the α-β cost model ---------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """A point-to-point link: α seconds per message, β bytes per second in one direction."""
    name: str
    alpha_s: float
    bandwidth_Bps: float
    source: str


# Bandwidths are per direction, from the named specifications. The α values are not vendor
# figures: they are order-of-magnitude assumptions for the per-message latency of a collective
# library over that link (kernel launch, protocol and software overhead dominate the wire's own
# latency). 01_collectives fits α and β for this machine's loopback from measurements instead.
LINKS = {
    "NVLink 4 (H100)": Link("NVLink 4 (H100)", 3e-6, 450e9,
                            "NVIDIA H100 datasheet: 900 GB/s NVLink per GPU, both directions"),
    "NVLink 3 (A100)": Link("NVLink 3 (A100)", 3e-6, 300e9,
                            "NVIDIA A100 datasheet: 600 GB/s NVLink per GPU, both directions"),
    "PCIe 4.0 x16": Link("PCIe 4.0 x16", 5e-6, 31.5e9,
                         "PCIe 4.0: 16 GT/s x 16 lanes, 128b/130b encoding"),
    "InfiniBand NDR": Link("InfiniBand NDR", 5e-6, 50e9,
                           "InfiniBand NDR: 400 Gb/s per port (NVIDIA ConnectX-7)"),
    "Ethernet 10G": Link("Ethernet 10G", 30e-6, 1.25e9, "IEEE 802.3 10GBASE: 10 Gb/s line rate"),
}


def ring_allreduce_time(nbytes: float, n: int, link: Link) -> float:
    """2(N-1) steps, each one message of S/N bytes: 2(N-1)·(α + S/(N·β))."""
    if n == 1:
        return 0.0
    return 2 * (n - 1) * (link.alpha_s + nbytes / (n * link.bandwidth_Bps))


def naive_allreduce_time(nbytes: float, n: int, link: Link) -> float:
    """The root takes N-1 whole messages in, then sends N-1 out, one after another on its one
    link: 2(N-1)·(α + S/β). Grows linearly in N, where the ring's bandwidth term does not."""
    if n == 1:
        return 0.0
    return 2 * (n - 1) * (link.alpha_s + nbytes / link.bandwidth_Bps)


def fit_alpha_beta(nbytes, seconds, n_messages, relative: bool = False,
                   factor: bool = False) -> tuple[float, float]:
    """Least-squares fit of t = m·α + B/β to measurements, where m messages carried B bytes on
    the busiest link. Returns (α seconds, β bytes/s). relative: minimise the relative error
    (each row divided by its t), so small messages count as much as large ones. factor:
    minimise the squared log of model / t, so a model 2× over a point costs what 2× under it
    does (relative error caps an under-estimate's cost at 1 and leaves the fit low); started
    from the relative fit, then Gauss-Newton on log α and log(1/β), which keeps both positive."""
    import numpy as np
    t = np.asarray(seconds, float)
    A = np.stack([np.asarray(n_messages, float), np.asarray(nbytes, float)], axis=1)
    if relative or factor:
        (alpha, inv_beta), *_ = np.linalg.lstsq(A / t[:, None], np.ones_like(t), rcond=None)
    else:
        (alpha, inv_beta), *_ = np.linalg.lstsq(A, t, rcond=None)
    if factor and alpha > 0 and inv_beta > 0:
        theta = np.log([alpha, inv_beta])
        for _ in range(50):
            parts = A * np.exp(theta)  # each point's latency and bandwidth seconds
            model = parts.sum(axis=1)
            jac = parts / model[:, None]  # d log(model) / d theta
            step, *_ = np.linalg.lstsq(jac, np.log(t) - np.log(model), rcond=None)
            theta += step
            if np.abs(step).max() < 1e-10:
                break
        alpha, inv_beta = np.exp(theta)
    return float(alpha), float(1.0 / inv_beta) if inv_beta > 0 else float("inf")
