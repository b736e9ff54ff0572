"""`dp`: DataParallel as torch.nn.DataParallel does it: one process, one replica per device,
threads instead of ranks.

On CPU, torch's own `nn.DataParallel` silently does nothing (with no accelerator it sets
`device_ids=[]` and just calls the module), so this file writes it out. Every forward:

    replica 0 (holds the master weights; the optimizer steps here)
      │ replicate  parameters broadcast to replicas 1..n-1          (n-1)·P bytes out
      │ scatter    the batch cut into n blocks, blocks 1..n-1 sent  (n-1)/n·X bytes out
      ├──────────► parallel_apply: replica i runs forward on its block, one Python thread each
      │ gather     outputs (logits) of replicas 1..n-1 come back    (n-1)/n·O bytes in
      │ loss       computed on replica 0 over the whole batch
    backward (autograd runs the same path in reverse):
      │ gather's backward scatters d(loss)/d(outputs)               (n-1)/n·O bytes out
      │ replicas' backward
      │ replicate's backward reduce-adds every replica's gradients  (n-1)·P bytes in
      ▼ optimizer.step() on replica 0

`_Broadcast` is torch's `Broadcast` (replicate) and its backward `ReduceAddCoalesced`; `_Gather`
is torch's `Gather`, whose backward is a scatter. Every byte replica 0 sends, replica i receives
once (1/(n-1) of it), so replica 0 moves exactly n-1 times the bytes of any other replica: the
bottleneck that made PyTorch recommend DDP, plus the loss and the optimizer step, which only
replica 0 does.

**What the bytes mean here.** On CPU all replicas live in one process's memory. A byte is
counted when it crosses from one replica to another: the copies this file really makes (the
parameter and input clones that replicas 1..n-1 get, the gradient-of-output slices sent back)
and the bytes replica 0 reads from another replica's tensors (gathering outputs, summing
gradients), which on GPUs are device-to-device copies. Replica 0's own share is a view, never
counted, as on a GPU where it stays on device 0.

**Threads and the GIL.** Replicas run forward in Python threads (`parallel_apply`). Tensor ops
release the GIL inside their kernels, but the Python between them (module calls, hooks) holds it,
so threads overlap only the kernels. Step events record each replica's forward wall and CPU time
and the threaded wall time; `RunConfig(dp_threads=False)` runs the replicas one after
another for the comparison (`gil_cost` does both). On CPU the backward of all replicas runs on one
autograd thread (GPUs get one per device), so backward does not overlap at all.

Knobs: RunConfig.dp_threads (True), RunConfig.dp_gather: "logits" (replicas return outputs,
replica 0 computes the token-mean cross-entropy, as a user of nn.DataParallel does) or "loss"
(replicas compute their own loss with the model's forward(x, y); replica 0 gathers n scalars
and averages them, weighted by rows).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Function

from distlab.parallel.base import Strategy
from distlab.units import tensor_bytes

GATHER_MODES = ("logits", "loss")
KINDS = ("broadcast", "scatter", "gather", "grad_scatter", "reduce_add")


class _Stats:
    """Bytes per replica per kind and seconds per phase, summed over one step's micro-batches."""

    def __init__(self, n: int):
        self.n = n
        self.reset()

    def reset(self):
        self.sent = {k: [0] * self.n for k in KINDS}
        self.recv = {k: [0] * self.n for k in KINDS}
        self.seconds: dict[str, float] = {}
        self.replica_forward_s = [0.0] * self.n
        self.replica_cpu_s = [0.0] * self.n
        self.backward_start = None

    def move(self, kind: str, src: int, dst: int, nbytes: int):
        self.sent[kind][src] += nbytes
        self.recv[kind][dst] += nbytes

    def add_time(self, phase: str, seconds: float):
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


class _Broadcast(Function):
    """replicate: every parameter to n replicas. Replica 0 gets a view of the master tensor (it
    is already there), replicas 1..n-1 a copy. Backward is the reduce-add: replica i's gradient
    goes to replica 0 and is summed there, in replica order, so the master gradient is the sum
    over replicas (each replica's loss term is already weighted by its share of the batch)."""

    @staticmethod
    def forward(ctx, n, stats, *tensors):
        ctx.n, ctx.stats, ctx.k = n, stats, len(tensors)
        t0 = time.perf_counter()
        out = []
        for i in range(n):
            for t in tensors:
                if i == 0:
                    out.append(t.view_as(t))
                else:
                    out.append(t.clone())
                    stats.move("broadcast", 0, i, tensor_bytes(t))
        stats.add_time("replicate_s", time.perf_counter() - t0)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        n, k, stats = ctx.n, ctx.k, ctx.stats
        t0 = time.perf_counter()
        summed = []
        for j in range(k):
            total = None
            for i in range(n):
                g = grads[i * k + j]
                if g is None:
                    continue
                if i > 0:
                    stats.move("reduce_add", i, 0, tensor_bytes(g))
                total = g.clone() if total is None else total.add_(g)
            summed.append(total)
        t1 = time.perf_counter()
        stats.add_time("reduce_add_s", t1 - t0)
        if stats.backward_start is not None:  # gather's backward ran first: the replicas' part
            stats.add_time("backward_s", t1 - stats.backward_start)
            stats.backward_start = None
        return (None, None, *summed)


class _Gather(Function):
    """gather: the replicas' outputs concatenated on replica 0 (scalars are stacked). Backward
    scatters the gradient: each replica gets the slice for its own rows."""

    @staticmethod
    def forward(ctx, stats, *outputs):
        ctx.stats = stats
        t0 = time.perf_counter()
        ctx.scalar = outputs[0].dim() == 0
        ctx.sizes = [1 if ctx.scalar else o.shape[0] for o in outputs]
        for i, o in enumerate(outputs[1:], start=1):
            stats.move("gather", i, 0, tensor_bytes(o))
        out = torch.stack(outputs) if ctx.scalar else torch.cat(outputs, 0)
        stats.add_time("gather_s", time.perf_counter() - t0)
        return out

    @staticmethod
    def backward(ctx, grad):
        stats = ctx.stats
        t0 = time.perf_counter()
        stats.backward_start = t0
        parts = list(grad.split(ctx.sizes, 0))
        out = []
        for i, g in enumerate(parts):
            if ctx.scalar:
                g = g.reshape(())
            if i > 0:
                g = g.clone()
                stats.move("grad_scatter", 0, i, tensor_bytes(g))
            out.append(g)
        stats.add_time("grad_scatter_s", time.perf_counter() - t0)
        return (None, *out)


class _Failure:
    def __init__(self, replica: int, exc: BaseException):
        self.replica, self.exc, self.tb = replica, exc, traceback.format_exc()


def _current_saved_tensor_hooks():
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _mark_parameters_seen(replica_tensors):
    """Replica parameter copies that a layer saves for backward (Linear saves its weight) are
    parameters, not activations: when the caller measures activations with distlab's
    ActivationMeter, mark their storages as seen, as it does for the master parameters."""
    hooks = _current_saved_tensor_hooks()
    seen = getattr(getattr(hooks[0], "__self__", None), "_seen", None) if hooks else None
    if isinstance(seen, set):
        seen.update(t.untyped_storage().data_ptr() for t in replica_tensors)


def _saved_tensor_hooks_for_threads():
    """The caller's saved-tensor hooks (the ActivationMeter's) are thread-local: re-enter them
    in each replica thread, serialised by a lock (the hook updates shared counters)."""
    hooks = _current_saved_tensor_hooks()
    if hooks is None:
        return contextlib.nullcontext
    pack, unpack = hooks
    lock = threading.Lock()

    def locked_pack(t):
        with lock:
            return pack(t)

    return lambda: torch.autograd.graph.saved_tensors_hooks(locked_pack, unpack)


class DataParallelModule(nn.Module):
    """The wrapped model: `module` holds the master weights (replica 0); `forward(x, y)` runs
    the replicate / scatter / parallel_apply / gather cycle and returns the global-batch loss.

    `state_dict()` is the inner module's, so checkpoints and comparisons see the same keys as
    an unwrapped model (torch's nn.DataParallel adds a "module." prefix)."""

    def __init__(self, module: nn.Module, n: int, stats: _Stats, threads: bool = True,
                 gather: str = "logits"):
        super().__init__()
        if gather not in GATHER_MODES:
            raise ValueError(f"dp_gather={gather!r} is not one of {GATHER_MODES}")
        self.module, self.n, self.threads, self.gather = module, n, threads, gather
        self._stats = stats
        # Replica skeletons, built once: their parameter slots are filled every forward with
        # the broadcast's outputs (as torch.nn.parallel.replicate does) and emptied after.
        # A plain list, so they are not submodules: parameters() is the master's alone.
        self._replicas = [copy.deepcopy(module) for _ in range(n)]
        self._master = [(m, k) for m in module.modules() for k, p in m._parameters.items()
                        if p is not None]
        self._master_buffers = [(m, k) for m in module.modules() for k, b in m._buffers.items()
                                if b is not None]
        self._slots = []
        for r in self._replicas:
            slots = [(m, k) for m in r.modules() for k, p in m._parameters.items() if p is not None]
            bufs = [(m, k) for m in r.modules() for k, b in m._buffers.items() if b is not None]
            for m, k in slots:
                m._parameters[k] = None  # free the deep copy's weights: filled each forward
            self._slots.append((slots, bufs))

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)

    # -- the four steps of nn.DataParallel ------------------------------------------------------
    def _replicate(self):
        params = [m._parameters[k] for m, k in self._master]
        copies = _Broadcast.apply(self.n, self._stats, *params)
        t0 = time.perf_counter()
        for i, (slots, bufs) in enumerate(self._slots):
            for (m, k), t in zip(slots, copies[i * len(params):(i + 1) * len(params)]):
                m._parameters[k] = t
            for (m, k), (mm, kk) in zip(bufs, self._master_buffers):  # buffers: no gradient
                b = mm._buffers[kk]
                if i == 0:
                    m._buffers[k] = b  # replica 0 updates the real running statistics
                else:
                    m._buffers[k] = b.clone()
                    self._stats.move("broadcast", 0, i, tensor_bytes(b))
            self._replicas[i].train(self.training)
        self._stats.add_time("replicate_s", time.perf_counter() - t0)
        return copies

    def _scatter(self, *tensors):
        """Cut each tensor into n row blocks; blocks 1..n-1 are copied to their replicas."""
        t0 = time.perf_counter()
        out = [[] for _ in range(self.n)]
        for t in tensors:
            for i, block in enumerate(t.chunk(self.n, 0)):
                if i > 0:
                    block = block.clone()
                    self._stats.move("scatter", 0, i, tensor_bytes(block))
                out[i].append(block)
        self._stats.add_time("scatter_s", time.perf_counter() - t0)
        return out

    def _parallel_apply(self, inputs, replica_params):
        n, stats = self.n, self._stats
        results: list = [None] * n

        def work(i, hooks_ctx=contextlib.nullcontext):
            try:
                t0, c0 = time.perf_counter(), time.thread_time()
                with torch.set_grad_enabled(grad_enabled), autocast(), hooks_ctx():
                    results[i] = self._replicas[i](*inputs[i])
                stats.replica_forward_s[i] += time.perf_counter() - t0
                stats.replica_cpu_s[i] += time.thread_time() - c0
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                results[i] = _Failure(i, e)

        grad_enabled = torch.is_grad_enabled()
        dev = self.module_device()
        ac_on = torch.is_autocast_enabled(dev)
        ac_dtype = torch.get_autocast_dtype(dev)

        def autocast():
            return torch.autocast(dev, dtype=ac_dtype) if ac_on else contextlib.nullcontext()

        _mark_parameters_seen(replica_params)
        t0 = time.perf_counter()
        if self.threads and n > 1:
            hooks_ctx = _saved_tensor_hooks_for_threads()
            threads = [threading.Thread(target=work, args=(i, hooks_ctx), daemon=True,
                                        name=f"dp-replica{i}") for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for i in range(n):
                work(i)
        stats.add_time("forward_wall_s", time.perf_counter() - t0)
        for r in results:
            if isinstance(r, _Failure):
                raise RuntimeError(f"dp replica {r.replica} failed in forward:\n{r.tb}") from r.exc
        return results

    def module_device(self) -> str:
        p = next(self.module.parameters(), None)
        return p.device.type if p is not None else "cpu"

    def forward(self, x, targets=None):
        copies = self._replicate()
        if self.gather == "loss" and targets is not None:
            inputs = self._scatter(x, targets)
        else:
            inputs = self._scatter(x)
        try:
            outputs = self._parallel_apply(inputs, copies[len(self._master):])
        finally:
            for slots, bufs in self._slots:  # the graph keeps what backward needs
                for m, k in slots:
                    m._parameters[k] = None
                for m, k in bufs:
                    m._buffers[k] = None
        gathered = _Gather.apply(self._stats, *outputs)
        if targets is None:
            return gathered
        t0 = time.perf_counter()
        if self.gather == "loss":
            # each replica returned the mean over its rows: weight by rows for the global mean
            rows = torch.tensor([float(b[0].shape[0]) for b in inputs], dtype=gathered.dtype,
                                device=gathered.device)
            loss = (gathered * rows).sum() / rows.sum()
        else:  # the model's loss, computed on replica 0 over the gathered outputs
            loss = F.cross_entropy(gathered.float().reshape(-1, gathered.shape[-1]),
                                   targets.reshape(-1))
        self._stats.add_time("loss_s", time.perf_counter() - t0)
        return loss


class DataParallel(Strategy):
    """RunConfig(strategy="dp", world_size=n): n replicas in one process (cfg.processes == 1)."""
    name = "dp"
    any_model = False  # distlab's GPT only (Strategy.any_model)
    knobs = frozenset({"dp_threads", "dp_gather"})

    @classmethod
    def processes(cls, cfg) -> int:
        return 1  # the replicas are threads of one process

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        if comm.world != 1:
            raise ValueError(f"strategy 'dp' runs its {cfg.world_size} replicas as threads of "
                             f"one process, but was started on {comm.world} ranks "
                             "(launch it with cfg.processes, which is 1)")
        self.n = cfg.world_size
        self.threads, self.gather = cfg.dp_threads, cfg.dp_gather
        self.stats = _Stats(self.n)
        self.param_bytes = 0

    def wrap(self, model):
        self.param_bytes = sum(tensor_bytes(p) for p in model.parameters())
        return DataParallelModule(model, self.n, self.stats, threads=self.threads,
                                  gather=self.gather)

    def optimizer_step(self, optimizer):
        t0 = time.perf_counter()
        optimizer.step()  # only replica 0 holds an optimizer
        self.stats.add_time("optimizer_s", time.perf_counter() - t0)

    def step_info(self) -> dict:
        s, n = self.stats, self.n
        sent = [sum(s.sent[k][i] for k in KINDS) for i in range(n)]
        recv = [sum(s.recv[k][i] for k in KINDS) for i in range(n)]
        seconds = dict(s.seconds)
        replica0_only = sum(seconds.get(k, 0.0) for k in (
            "replicate_s", "scatter_s", "gather_s", "loss_s", "grad_scatter_s", "reduce_add_s",
            "optimizer_s"))
        info = {"dp": {
            "replicas": n,
            "threads": n if (self.threads and n > 1) else 0,  # Python threads for forward
            "intra_op_threads": torch.get_num_threads(),  # torch's own pool, shared by them
            "gather": self.gather,
            "bytes_sent": sent, "bytes_recv": recv,  # per replica
            "bytes": {k: {"sent": s.sent[k], "recv": s.recv[k]} for k in KINDS},
            "replica_param_bytes": (n - 1) * self.param_bytes,  # the copies' memory
            "seconds": seconds,  # replica-0 phases, forward wall, backward
            "replica0_only_s": replica0_only,  # work no other replica shares
            "replica_forward_s": s.replica_forward_s,
            "replica_cpu_s": s.replica_cpu_s,  # thread CPU time: wall - CPU = waiting
        }}
        s.reset()
        return info
