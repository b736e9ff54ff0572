"""Parameter servers: rank 0 holds the master weights and the optimizer; ranks 1..W train.

    worker 1 ─┐ push gradient (P bytes)          ┌─► worker 1   pull weights (P bytes)
    worker 2 ─┼──────────────────► server ───────┼─► worker 2
    worker W ─┘   (rank 0: apply, optimizer.step) └─► worker W

Every message goes through the server: per update it takes in N·P bytes and sends N·P out,
while a worker moves P each way, so the server's link carries N times a worker's (N gradients
per update). That is the bottleneck that ring all-reduce removes (each rank 2(N-1)/N·P).

`ps-sync` (synchronous SGD through a server; Chen et al. 2016, "Revisiting Distributed
Synchronous SGD"). Each update the server waits for the first N = cfg.dp_degree gradients that
were computed on the current weights, averages them, steps the optimizer and sends the new weights
to those N workers. With `backup_workers` b > 0 there are N+b workers: a gradient that arrives
after its update was made (computed on old weights) is dropped and its worker gets the current
weights at once, so the update never waits for the b slowest. With b = 0 worker i takes rows
block i of the global batch and the run follows `single` step for step.

`ps-async` (Downpour SGD, Dean et al. 2012; Hogwild-style): the server applies each gradient the
moment it arrives and sends the current weights back to that worker only. Nobody waits, but a
gradient computed on version v is applied to version v + s: s is its *staleness*, recorded per
update (server step events: `staleness`, `worker`, `worker_step`).

Protocol, point to point through Comm (counted bytes, kinds "ps.push", "ps.pull", "ps.ctl"):
each worker step, after backward, the worker sends its flat gradient and waits for the reply:
a control message [version, used, staleness] and the flat weights. Every worker does cfg.steps
steps, so the server knows it will receive W·steps gradients and answer each once; sync makes
exactly cfg.steps updates (every worker that took part in update k pushes again on version k+1,
so N fresh gradients always come), async makes W·steps. The server receives from any source
(gloo's recv-any), so it serves whoever arrives first; a lost peer ends in cfg.timeout_s.

Events: workers log their loss as usual, with `ps` = {based_on, version, used, staleness}. The
server logs one step event per update with loss None (Run.losses() skips it): step time (the
time between updates), `grads_used`, `dropped`, `staleness`, and the bytes it moved, and at the
end a "server_done" event with totals (pushes, used, dropped, drain traffic).

Buffers (BatchNorm running statistics) stay where they are: the server's are never updated.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from distlab.memory import model_state_bytes
from distlab import wire
from distlab.parallel.base import Strategy


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unflat_into(flat: torch.Tensor, tensors):
    off = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[off:off + n].view_as(t))
            off += n


class _ParameterServer(Strategy):
    ASYNC = False
    servers = 1

    @classmethod
    def dp_degree(cls, cfg) -> int:
        """The workers that split a global batch: not the server, not the backup workers
        (whose gradients are extra)."""
        return cfg.world_size - 1 - cfg.backup_workers

    @classmethod
    def check_config(cls, cfg):
        scaled = cfg.loss_scale == "dynamic" or (cfg.loss_scale == "auto"
                                                 and cfg.precision == "fp16")
        if scaled or cfg.grad_clip:
            raise ValueError(f"{cfg.strategy}: the server applies each update as gradients "
                             "arrive, so loss scaling and grad_clip (which act between the "
                             "gradient reduction and the step) do not apply; set grad_clip=0 "
                             "and loss_scale='none'")
        if cfg.world_size < 2 + cfg.backup_workers:
            raise ValueError(f"world_size={cfg.world_size}: {cfg.strategy} needs rank 0 "
                             f"as the server plus at least {1 + cfg.backup_workers} "
                             "worker(s) (backup_workers included)")
        if cfg.straggler_rank == 0:
            raise ValueError("straggler_rank=0 is the parameter server, which does not "
                             "train; pick a worker rank (1 or more)")

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        self.n_workers = self.world - 1  # every rank but the server trains
        self.n_used = 1 if self.ASYNC else cfg.dp_degree  # gradients per update
        self.based_on = 0  # worker: the version of the weights it computes on
        self._info: dict = {}

    def is_server(self) -> bool:
        return self.rank == 0

    def wrap(self, model):
        with torch.no_grad():  # one starting point, by construction (setup, not a step's)
            for t in list(model.parameters()) + list(model.buffers()):
                self.comm.broadcast(t.data, src=0)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        return model

    def batch(self, data, step: int):
        """Worker i (rank i+1) takes block i of W equal blocks of local_batch rows: with no
        backup workers (W = N) that is exactly block i of the global batch; backup workers
        read extra rows of their own (the same generator, a larger batch)."""
        w = self.n_workers
        return data.rank_batch(step, self.cfg.local_batch * w, self.rank - 1, w)

    # -- worker ------------------------------------------------------------------------------
    def reduce_gradients(self, model):
        """Push this step's gradient, then pull the weights the server sends back."""
        grads = _flat([p.grad if p.grad is not None else torch.zeros_like(p)
                       for p in self.params])
        self.comm.send(grads, 0, kind="ps.push")
        ctl = torch.zeros(3, dtype=torch.int64, device=grads.device)
        self.comm.recv(ctl, 0, kind="ps.ctl")
        weights = torch.empty_like(grads)
        self.comm.recv(weights, 0, kind="ps.pull")
        _unflat_into(weights, self.params)
        version, used, staleness = (int(v) for v in ctl.tolist())
        nbytes = grads.numel() * grads.element_size()
        self._info = {"ps": {"based_on": self.based_on, "version": version, "used": bool(used),
                             "staleness": staleness}, "bytes_out": nbytes, "bytes_in": nbytes}
        self.based_on = version

    def optimizer_step(self, optimizer):
        """Workers do not step: the server applied the update and sent the weights."""

    def step_info(self) -> dict:
        info, self._info = self._info, {}
        return info

    # -- server ------------------------------------------------------------------------------
    def _recv_any(self, buf: torch.Tensor) -> int:
        """The next gradient from whichever worker sends first (gloo's recv from any source);
        bytes booked under "ps.push" like every other counted message."""
        t0 = time.perf_counter()
        src = dist.recv(buf, group=self.comm.group)
        self.comm._add("ps.push", 0, buf.numel() * buf.element_size(), time.perf_counter() - t0)
        return src

    def _reply(self, worker: int, weights: torch.Tensor, version: int, used: bool,
               staleness: int):
        # The worker is already waiting in recv (it pushed and waits for this), so these
        # blocking sends return at once.
        ctl = torch.tensor([version, int(used), staleness], dtype=torch.int64)
        self.comm.send(ctl, worker, kind="ps.ctl")
        self.comm.send(weights, worker, kind="ps.pull")
        self._based_on[worker] = version

    def _apply(self, optimizer, flat_grad: torch.Tensor, lr: float):
        off = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat_grad[off:off + n].view_as(p).clone()
            off += n
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()

    def _log_update(self, model, optimizer, step, t_prev, rows, held_bytes, **fields):
        stats, _ = self.comm.take_step_stats()
        push, pull = stats.get("ps.push", {}), stats.get("ps.pull", {})
        now = time.perf_counter()
        memory = {**model_state_bytes(model, optimizer), "activations": 0,
                  "comm_buffers": held_bytes}
        self.log.write("step", step=step, loss=None, role="server", step_s=now - t_prev,
                       tokens=rows * self.cfg.seq_len, memory=memory, comm=stats,
                       wire=wire.LEDGER.end(),
                       bytes_in=push.get("bytes_recv", 0), bytes_out=pull.get("bytes_sent", 0),
                       **fields)
        return now

    def serve(self, model, optimizer):
        cfg, W, N = self.cfg, self.n_workers, self.n_used
        if dist.get_backend(self.comm.group) != "gloo":
            raise NotImplementedError(f"{cfg.strategy} receives from any source, which needs "
                                      "the gloo backend (NCCL has no recv-any)")
        total = W * cfg.steps  # gradients the server will receive, and answer
        pushes = [0] * (W + 1)  # per worker rank: gradients received so far
        self._based_on = [0] * (W + 1)  # per worker rank: version of the weights it holds
        version, weights = 0, _flat(self.params)
        accepted: dict[int, tuple[torch.Tensor, int]] = {}  # rank -> (gradient, its step)
        dropped: list[dict] = []
        n_used = n_dropped = 0
        staleness_all: list[int] = []
        wire.LEDGER.begin()  # setup traffic (the initial broadcast) is no update's
        t_prev = time.perf_counter()
        for _ in range(total):
            buf = torch.empty(self.numel, dtype=weights.dtype)
            src = self._recv_any(buf)
            k, pushes[src] = pushes[src], pushes[src] + 1
            stale = version - self._based_on[src]
            if self.ASYNC:
                self._apply(optimizer, buf, cfg.lr_at(k))
                version += 1
                weights = _flat(self.params)
                self._reply(src, weights, version, True, stale)
                n_used += 1
                staleness_all.append(stale)
                t_prev = self._log_update(model, optimizer, version - 1, t_prev, cfg.local_batch,
                                          buf.numel() * buf.element_size(), lr=cfg.lr_at(k),
                                          grads_used=1, worker=src, worker_step=k,
                                          staleness=stale, version=version)
                continue
            # sync: only gradients computed on the current weights count, the first N of them
            if stale == 0 and version < cfg.steps and len(accepted) < N:
                accepted[src] = (buf, k)
                if len(accepted) < N:
                    continue
                used = sorted(accepted)  # sum in rank order: deterministic
                mean = accepted[used[0]][0].clone()
                for r in used[1:]:
                    mean.add_(accepted[r][0])
                mean.div_(N)
                held = sum(b.numel() * b.element_size() for b, _ in accepted.values())
                self._apply(optimizer, mean, cfg.lr_at(version))
                version += 1
                weights = _flat(self.params)
                for r in used:
                    self._reply(r, weights, version, True, 0)
                n_used += N
                t_prev = self._log_update(
                    model, optimizer, version - 1, t_prev, N * cfg.local_batch, held,
                    lr=cfg.lr_at(version - 1), grads_used=N, workers=used,
                    worker_steps=[accepted[r][1] for r in used], dropped=len(dropped),
                    dropped_from=dropped, staleness=0, version=version)
                accepted, dropped = {}, []
            else:  # late: computed on weights that are no longer current. Drop it.
                dropped.append({"worker": src, "worker_step": k, "staleness": stale})
                n_dropped += 1
                self._reply(src, weights, version, False, stale)
        stats, _ = self.comm.take_step_stats()  # traffic after the last update (late pushes)
        self.log.write("server_done", updates=version, pushes=total, used=n_used,
                       dropped=n_dropped, dropped_after_last_update=dropped, comm=stats,
                       staleness_mean=(sum(staleness_all) / len(staleness_all)
                                       if staleness_all else 0.0),
                       staleness_max=max(staleness_all, default=0))
        if len(accepted):
            raise RuntimeError(f"server ended with {len(accepted)} gradient(s) of an unfinished "
                               "update: the workers' step counts disagree")


class SyncParameterServer(_ParameterServer):
    """RunConfig(strategy="ps-sync", world_size=1+N+b, backup_workers=b)."""
    name = "ps-sync"
    supports = frozenset({"backup_workers"})


class AsyncParameterServer(_ParameterServer):
    """RunConfig(strategy="ps-async", world_size=1+W): W workers, every gradient applied."""
    name = "ps-async"
    supports = frozenset()

    ASYNC = True

    def __init__(self, cfg, comm):
        if cfg.backup_workers:
            raise ValueError(f"backup_workers={cfg.backup_workers}: ps-async never waits for a "
                             "gradient, so it has no use for backup workers (use ps-sync)")
        super().__init__(cfg, comm)
