"""Pipeline parallelism (`pp`): the model's blocks split into stages, one stage per rank (or v
chunks per rank, interleaved), activations sent forward and gradients sent back with send/recv.

    rank 0: tok/pos emb + blocks[0:L/p]  --act-->  rank 1: blocks[L/p:2L/p]  ...  rank p-1: ... + ln_f, head, loss
            <--grad--                                <--grad--

A schedule is data: for each rank, the list of (op, microbatch, chunk) it runs in order, op "F"
(forward) or "B" (backward); chunk c of rank r is global stage s = c·p + r (Megatron's loop
placement). `make_schedule` is a pure function, so schedules are unit-tested and plotted
without processes; `simulate` runs one with fixed op costs to give its ideal timeline.

Schedules (p stages, m micro-batches, v chunks per rank):
    naive        F0 B0 F1 B1 ...: one micro-batch in the pipe at a time; bubble (p-1)/p
    gpipe        all F then all B (Huang et al. 2019); bubble (p-1)/(m+p-1) of total time,
                 m micro-batches' activations stashed at once
    1f1b         warm-up p-r-1 F, then F/B pairs, then cool-down B (PipeDream-Flush, Narayanan
                 et al. 2019/2021); same bubble as gpipe, at most p-r micro-batches in flight
    interleaved  1f1b over v chunks per rank (Narayanan et al. 2021); bubble (p-1)/(v·m) of
                 the *ideal* time (m·(tf+tb)), i.e. the bubble shrinks by v

Sends never block (Comm.isend, waited at the end of the step); receives block, and the time a
rank waits in a receive is idle time: measured bubble = 1 - (forward + backward time) / step
time, per rank. A barrier at each end of the step gives every rank the same step start and end
(GPipe's convention: the step lasts until the last stage finishes).
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlab.parallel.base import Strategy

# The convention each textbook formula uses (see bubble_formula).
FORMULA_CONVENTION = {"naive": "total", "gpipe": "total", "1f1b": "total",
                      "interleaved": "ideal"}


# -- the split -------------------------------------------------------------------------------
def stage_blocks(n_layer: int, n_stages: int, stage: int) -> range:
    """Blocks of global stage `stage` when n_layer blocks split into n_stages equal stages."""
    per = n_layer // n_stages
    return range(stage * per, (stage + 1) * per)


def rank_stages(rank: int, p: int, v: int = 1) -> list[int]:
    """Global stages held by `rank`: chunk c is stage c·p + rank (loop placement)."""
    return [c * p + rank for c in range(v)]


def split_model(model, rank: int, p: int, v: int = 1):
    """Keep only this rank's stages of `model` (a GPT), in place. Kept modules keep their
    names, so the rank's state_dict keys are a subset of the unsplit model's."""
    n_stages, n_layer = p * v, len(model.blocks)
    keep = {i for s in rank_stages(rank, p, v) for i in stage_blocks(n_layer, n_stages, s)}
    for i in range(n_layer):
        if i not in keep:
            model.blocks[i] = nn.Identity()
    if 0 not in rank_stages(rank, p, v):
        model.tok_emb = model.pos_emb = None
    if n_stages - 1 not in rank_stages(rank, p, v):
        model.ln_f = model.head = None
    return model


def stage_forward(model, stage: int, n_stages: int, h, targets=None):
    """Run global stage `stage` of the split GPT: embeddings on the first, blocks, then
    ln_f/head (and the loss when targets are given) on the last. Same ops as GPT.forward."""
    if stage == 0:
        h = model.tok_emb(h) + model.pos_emb(torch.arange(h.shape[1], device=h.device))
    for i in stage_blocks(len(model.blocks), n_stages, stage):
        h = model.blocks[i](h)
    if stage < n_stages - 1:
        return h
    logits = model.head(model.ln_f(h))
    if targets is None:
        return logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# -- schedules (pure functions) ----------------------------------------------------------------
def make_schedule(kind: str, p: int, m: int, v: int = 1) -> list[list[tuple]]:
    """Per rank, the ordered list of (op, microbatch, chunk); op is "F" or "B"."""
    if kind == "naive":
        return [[(op, i, 0) for i in range(m) for op in "FB"] for _ in range(p)]
    if kind == "gpipe":
        return [[("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
                for _ in range(p)]
    if kind == "1f1b":
        return [_one_f_one_b([("F", i, 0) for i in range(m)], [("B", i, 0) for i in range(m)],
                             min(p - r - 1, m)) for r in range(p)]
    if kind == "interleaved":
        return [_interleaved(r, p, m, v) for r in range(p)]
    raise ValueError(f"schedule {kind!r} is not one of naive, gpipe, 1f1b, interleaved")


def _one_f_one_b(fwd, bwd, warmup):
    """warm-up forwards, then one forward / one backward pairs, then the remaining backwards."""
    out = fwd[:warmup]
    for k in range(len(fwd) - warmup):
        out += [fwd[warmup + k], bwd[k]]
    return out + bwd[len(fwd) - warmup:]


def _interleaved(r, p, m, v):
    """Megatron's interleaved 1F1B order: forwards go p micro-batches through chunk 0, then the
    same p through chunk 1, ...; backwards likewise from the last chunk. Needs m % p == 0."""
    if m % p:
        raise ValueError(f"interleaved schedule needs microbatches ({m}) divisible by pp ({p})")
    n = m * v

    def unit(k, backward):
        chunk = (k // p) % v
        return ("B" if backward else "F", (k // (p * v)) * p + k % p,
                v - 1 - chunk if backward else chunk)

    warmup = min((p - r - 1) * 2 + (v - 1) * p, n)
    return _one_f_one_b([unit(k, False) for k in range(n)], [unit(k, True) for k in range(n)],
                        warmup)


def simulate(schedule, p: int, v: int = 1, tf: float = 1.0, tb: float = 1.0):
    """Run `schedule` with every forward costing tf and every backward tb and free
    communication. Returns per rank a list of (op, mb, chunk, start, end). Raises if the
    schedule deadlocks (an op waits on one that can never run before it)."""
    S, done, pos = p * v, {}, [0] * p
    clock, out = [0.0] * p, [[] for _ in range(p)]
    while any(pos[r] < len(schedule[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(schedule[r]):
                op, mb, c = schedule[r][pos[r]]
                s = c * p + r
                deps = [("F", mb, s - 1)] if op == "F" and s > 0 else []
                if op == "B":
                    deps = [("F", mb, s)] + ([("B", mb, s + 1)] if s < S - 1 else [])
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = done[(op, mb, s)] = start + (tf if op == "F" else tb)
                out[r].append((op, mb, c, start, clock[r]))
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule deadlocks at positions {pos}")
    return out


def in_flight(rank_schedule) -> int:
    """Most micro-batch chunks whose forward ran and backward did not yet (stashed activations)."""
    live = peak = 0
    for op, _, _ in rank_schedule:
        live += 1 if op == "F" else -1
        peak = max(peak, live)
    return peak


def bubble_formula(schedule: str, p: int, m: int, v: int = 1, of: str | None = None) -> float:
    """The textbook bubble. of="total": idle / step time (GPipe's convention, (p-1)/(m+p-1));
    of="ideal": idle / ideal compute time m·(tf+tb) (Megatron's, (p-1)/(v·m) interleaved).
    One number in two units: total = ideal / (1 + ideal). A measured bubble (1 - busy / step
    time) compares with of="total". Default: the convention the schedule's paper uses
    (FORMULA_CONVENTION)."""
    of = of or FORMULA_CONVENTION[schedule]
    if schedule == "naive":
        ideal = p - 1  # one micro-batch in the pipe: p-1 idle slots per busy slot
    elif schedule in ("gpipe", "1f1b"):
        ideal = (p - 1) / m
    elif schedule == "interleaved":
        ideal = (p - 1) / (v * m)
    else:
        raise ValueError(f"schedule {schedule!r} is not one of {list(FORMULA_CONVENTION)}")
    return ideal if of == "ideal" else ideal / (1 + ideal)


# -- the strategy ------------------------------------------------------------------------------
def pipeline_shape(cfg) -> tuple[int, int, int, int]:
    """(p ranks, m micro-batches, v model chunks per rank, S = p·v stages) of a config."""
    v = cfg.virtual_stages if cfg.schedule == "interleaved" else 1
    return cfg.pp, cfg.microbatches, v, cfg.pp * v


class PipelineParallel(Strategy):
    """`pp`: this rank holds stages rank_stages(rank, pp, v) and runs cfg.schedule."""
    name = "pp"
    any_model = False  # distlab's GPT only (Strategy.any_model)
    degrees = frozenset({"pp"})

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        self.p, self.m, self.v, self.S = pipeline_shape(cfg)
        self.schedule = make_schedule(cfg.schedule, self.p, self.m, self.v)[self.rank]
        self.delay = cfg.pp_op_delay_s
        self._info = {}

    def wrap(self, model):
        model = split_model(model, self.rank, self.p, self.v)
        self.after_model_split(model)
        return model

    def after_model_split(self, model) -> None:
        """Remember where the parameters' storage is, so stashed activations do not count it
        (called again in 3d once ZeRO has moved the parameters into its flat buffers)."""
        self._param_ptrs = {q.untyped_storage().data_ptr() for q in model.parameters()}

    def batch(self, data, step):
        return data.rank_batch(step, self.cfg.global_batch, 0, 1)  # every stage: whole batch

    def _peer(self, stage):
        return stage % self.p

    def _tag(self, mb, stage, backward):
        return (mb * self.S + stage) * 2 + int(backward)

    def forward_backward(self, model, x, y, scale_loss):
        xs, ys = x.chunk(self.m), y.chunk(self.m)
        shape = (xs[0].shape[0], xs[0].shape[1], self.cfg.n_embd)
        dtype = next(model.parameters()).dtype
        stash, sends, events, loss = {}, [], [], None
        live_bytes = peak_bytes = 0
        # a common step start: otherwise one rank's optimizer step and logging show up as the
        # next rank's idle time in the next step's timeline
        self.comm.barrier()
        t_start = time.perf_counter()

        def record(op, mb, c, t0):
            events.append({"op": op, "mb": mb, "chunk": c, "t0": t0 - t_start,
                           "t1": time.perf_counter() - t_start})

        for op, mb, c in self.schedule:
            s = c * self.p + self.rank
            if op == "F":
                if s == 0:
                    inp = xs[mb]
                else:
                    t0 = time.perf_counter()
                    inp = torch.empty(shape, dtype=dtype, device=x.device)
                    self.comm.recv(inp, self._peer(s - 1), "pp_recv_act", self._tag(mb, s, False))
                    record("recv", mb, c, t0)
                    inp.requires_grad_()
                t0 = time.perf_counter()
                saved = _SavedBytes(self._param_ptrs)
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                    out = stage_forward(model, s, self.S, inp, ys[mb] if s == self.S - 1 else None)
                if s == self.S - 1:
                    out = out / self.m
                    loss = (loss or 0.0) + out.item()
                self._sleep()
                record("F", mb, c, t0)
                live_bytes += saved.bytes
                peak_bytes = max(peak_bytes, live_bytes)
                stash[(mb, c)] = (inp, out, saved.bytes)
                if s < self.S - 1:
                    t0 = time.perf_counter()
                    sends.append(self.comm.isend(out.detach(), self._peer(s + 1), "pp_send_act",
                                                 self._tag(mb, s + 1, False)))
                    record("send", mb, c, t0)
            else:
                inp, out, nbytes = stash.pop((mb, c))
                if s == self.S - 1:
                    grad = None
                else:
                    t0 = time.perf_counter()
                    grad = torch.empty_like(out)
                    self.comm.recv(grad, self._peer(s + 1), "pp_recv_grad", self._tag(mb, s, True))
                    record("recv", mb, c, t0)
                t0 = time.perf_counter()
                if grad is None:
                    scale_loss(out).backward()
                else:
                    torch.autograd.backward(out, grad)
                self._sleep()
                record("B", mb, c, t0)
                live_bytes -= nbytes
                if s > 0:
                    t0 = time.perf_counter()
                    sends.append(self.comm.isend(inp.grad, self._peer(s - 1), "pp_send_grad",
                                                 self._tag(mb, s - 1, True)))
                    record("send", mb, c, t0)
        for w in sends:
            w.wait()
        self.comm.barrier()  # a common step end: the pipeline's step is the slowest rank's
        step_s = time.perf_counter() - t_start
        self._info = timeline(events, step_s)
        self._info.update(schedule=self.cfg.schedule, stages=rank_stages(self.rank, self.p, self.v),
                          peak_in_flight=in_flight(self.schedule), peak_stash_bytes=peak_bytes)
        return loss

    def _sleep(self):
        if self.delay:  # equal, known stage costs, so the measured bubble can meet the formula
            time.sleep(self.delay)

    def clip_gradients(self, model, max_norm):
        """The global norm: each stage's squared norm, summed across stages."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        sq = torch.stack([g.pow(2).sum() for g in grads]).sum().reshape(1)
        norm = float(self.comm.all_reduce(sq).sqrt())
        if norm > max_norm:
            for g in grads:
                g.mul_(max_norm / (norm + 1e-6))
        return norm

    def step_info(self):
        return {"pipeline": self._info}


class _SavedBytes:
    """Bytes of the tensors autograd saves for backward during one stage forward (storages
    counted once; parameters are saved too but are not activations)."""

    def __init__(self, param_ptrs):
        self.bytes, self._seen = 0, set(param_ptrs)

    def pack(self, t):
        st = t.untyped_storage()
        if st.data_ptr() not in self._seen:
            self._seen.add(st.data_ptr())
            self.bytes += st.nbytes()
        return t


def timeline(events, step_s):
    """Busy time (forward + backward), idle gaps between them, and the measured bubble."""
    compute = sorted((e for e in events if e["op"] in ("F", "B")), key=lambda e: e["t0"])
    busy = sum(e["t1"] - e["t0"] for e in compute)
    idle, t = [], 0.0
    for e in compute + [{"t0": step_s, "t1": step_s}]:
        if e["t0"] > t:
            idle.append({"op": "idle", "mb": None, "chunk": None, "t0": t, "t1": e["t0"]})
        t = max(t, e["t1"])
    return {"events": events + idle, "busy_s": busy, "step_s": step_s,
            "bubble": 1 - busy / step_s if step_s > 0 else 0.0}


def p2p_bytes_per_step(cfg) -> dict:
    """Bytes each boundary carries per step: m micro-batches × (B/m)·T·h·4 bytes, each way.
    With v chunks per rank there are p·v - 1 boundaries."""
    per_mb = cfg.global_batch // cfg.microbatches * cfg.seq_len * cfg.n_embd * 4
    return {"per_microbatch": per_mb, "per_boundary_each_way": per_mb * cfg.microbatches}
