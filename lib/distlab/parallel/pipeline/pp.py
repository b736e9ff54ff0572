"""Pipeline parallelism (`pp`): the model's blocks split into stages, one stage per rank (or v
chunks per rank, interleaved), activations sent forward and gradients sent back with send/recv.

    rank 0: tok/pos emb + blocks[0:L/p]  --act-->  rank 1: blocks[L/p:2L/p]  ...  rank p-1: ... + ln_f, head, loss
            <--grad--                                <--grad--

The executor is written once, for any stage modules: `PipelineSchedule` (exported from distlab;
step(x, y) as torch.distributed.pipelining's schedules); the `pp` strategy gives it the GPT's
stages (GPTStage). A schedule is data: for each rank, the list of (op, microbatch, chunk) it
runs in order, op "F" (forward) or "B" (backward); chunk c of rank r is global stage s = c·p + r
(Megatron's loop placement; zbv's V: rank_stages). `make_schedule` is a pure function, so
schedules are unit-tested and plotted without processes; `simulate` runs one with fixed op costs
to give its ideal timeline.

Schedules (p stages, m micro-batches, v chunks per rank):
    naive        F0 B0 F1 B1 ...: one micro-batch in the pipe at a time; bubble (p-1)/p
    gpipe        all F then all B (Huang et al. 2019); bubble (p-1)/(m+p-1) of total time,
                 m micro-batches' activations stashed at once
    1f1b         warm-up p-r-1 F, then F/B pairs, then cool-down B (PipeDream-Flush, Narayanan
                 et al. 2019/2021); same bubble as gpipe, at most p-r micro-batches in flight
    interleaved  1f1b over v chunks per rank (Narayanan et al. 2021); bubble (p-1)/(v·m) of
                 the *ideal* time (m·(tf+tb)), i.e. the bubble shrinks by v
    zb1p         ZB-H1 (Qi et al. 2024): backward split into B (the input's gradient) and W (the
                 weights', split_backward.py); W fills what 1F1B leaves idle. Bubble
                 (p-1)(tf+tb-tw) against 1F1B's (p-1)(tf+tb+tw) (tb, tw: B's and W's times), a
                 third of it when the three are equal
    zbv          ZBV (Qi et al. 2024, section 6): the same split, two chunks per rank placed in a
                 V, rank r holding stages r and 2p-1-r, so stage 0 and the loss sit on rank 0
                 and the turn of the V (stages p-1 and p) on rank p-1, handed over in memory
    dualpipev    DualPipeV (DeepSeek's DualPipe, cut in half): zbv's V and split backward,
                 ordered so that in its steady state each rank runs a forward of one chunk
                 beside the whole backward of the other (F&B: on a GPU one's communication
                 hides behind the other's compute; here they run one after the other). Needs
                 m >= 2p

Sends never block (Comm.isend, waited at the end of the step); receives block, and the time a
rank waits in a receive is idle time: measured bubble = 1 - (forward + backward time) / step
time, per rank. A barrier at each end of the step gives every rank the same step start and end
(GPipe's convention: the step lasts until the last stage finishes).
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab.comm import Comm
from distlab.parallel.base import Strategy
from distlab.parallel.composed_checkpoint import ComposedCheckpoints
from distlab.parallel.pipeline.split_backward import WeightGradStore, split_weight_gradients
from distlab.step_ledger import StepCounter

# The convention each textbook formula uses (see bubble_formula).
FORMULA_CONVENTION = {"naive": "total", "gpipe": "total", "1f1b": "total",
                      "interleaved": "ideal", "zb1p": "total", "zbv": "total",
                      "dualpipev": "total"}
SPLIT_BACKWARD = frozenset({"zb1p", "zbv", "dualpipev"})  # schedules whose backward is B then W
MULTI_CHUNK = frozenset({"interleaved", "zbv", "dualpipev"})  # more than one chunk per rank
V_SHAPED = frozenset({"zbv", "dualpipev"})  # two chunks per rank, rank r: stages r, 2p-1-r


# -- the split -------------------------------------------------------------------------------
def stage_blocks(n_layer: int, n_stages: int, stage: int) -> range:
    """Blocks of global stage `stage` when n_layer blocks split into n_stages equal stages."""
    per = n_layer // n_stages
    return range(stage * per, (stage + 1) * per)


def rank_stages(rank: int, p: int, v: int = 1, kind: str = "") -> list[int]:
    """Global stages held by `rank`: chunk c is stage c·p + rank (loop placement), or for
    the V-shaped kinds (zbv, dualpipev) stages rank and 2p-1-rank (V placement)."""
    if kind in V_SHAPED:
        return [rank, 2 * p - 1 - rank]
    return [c * p + rank for c in range(v)]


def stage_rank(stage: int, p: int, kind: str = "") -> int:
    """The rank holding global stage `stage` (rank_stages' inverse)."""
    if kind in V_SHAPED:
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def split_model(model, rank: int, p: int, v: int = 1, kind: str = ""):
    """Keep only this rank's stages of `model` (a GPT), in place. Kept modules keep their
    names, so the rank's state_dict keys are a subset of the unsplit model's."""
    n_stages, n_layer, mine = p * v, len(model.blocks), rank_stages(rank, p, v, kind)
    keep = {i for s in mine for i in stage_blocks(n_layer, n_stages, s)}
    for i in range(n_layer):
        if i not in keep:
            model.blocks[i] = nn.Identity()
    if 0 not in mine:
        model.tok_emb = model.pos_emb = None
    if n_stages - 1 not in mine:
        model.ln_f = model.head = None
    return model


def stage_forward(model, stage: int, n_stages: int, h, targets=None):
    """Run global stage `stage` of the split GPT: embeddings on the first, blocks, then
    ln_f/head (and the loss when targets are given) on the last. Same ops as GPT.forward."""
    if stage == 0:  # context parallelism holds other positions than the first T (GPT.forward)
        pos = getattr(model, "token_positions", None)
        pos = pos.to(h.device) if pos is not None else torch.arange(h.shape[1], device=h.device)
        h = model.tok_emb(h) + model.pos_emb(pos)
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
    """Per rank, the ordered list of (op, microbatch, chunk); op is "F" or "B" (the whole
    backward), or with a split backward (SPLIT_BACKWARD) "F", "B" (the input's gradient) and
    "W" (the weights')."""
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
    if kind == "zb1p":
        return [_zb_h1(r, p, m) for r in range(p)]
    if kind == "zbv":
        return _zero_bubble(p, m, [rank_stages(r, p, 2, "zbv") for r in range(p)], cap=2 * p + 2)
    if kind == "dualpipev":
        if m < 2 * p:
            raise ValueError(f"dualpipev needs microbatches ({m}) >= 2·pp ({2 * p}): its "
                             f"steady state runs from micro-batch 2p on")
        return [_dualpipe_v(r, p, m) for r in range(p)]
    raise ValueError(f"schedule {kind!r} is not one of {', '.join(FORMULA_CONVENTION)}")


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


def _zb_h1(r: int, p: int, m: int) -> list[tuple]:
    """ZB-H1 on rank r: 1F1B's p-r-1 warm-up forwards, then a forward and a B per micro-batch,
    each B followed by the oldest W once r W's are pending, and the W's still pending at the
    end. Rank r holds back r W's: the deeper the rank, the longer it waits for gradients in
    the cool-down, and the W's it kept fill that wait. At most p micro-batches are between
    their F and their W on any rank, as 1F1B's p between F and backward; with F = B = W every
    rank idles p - 1 units, (p-1)(F+B-2W) (the tests simulate it)."""
    warmup = min(p - r - 1, m)
    out, f, w = [("F", i, 0) for i in range(warmup)], warmup, 0
    for b in range(m):
        if f < m:
            out.append(("F", f, 0))
            f += 1
        out.append(("B", b, 0))
        if b + 1 - w > r:
            out.append(("W", w, 0))
            w += 1
    return out + [("W", i, 0) for i in range(w, m)]


def _zero_bubble(p: int, m: int, stages: list[list[int]], cap: int) -> list[list[tuple]]:
    """A zero-bubble order made as the paper makes its automatic schedules: a greedy list
    schedule, run with F, B and W of every chunk costing one unit. stages[r]: the global
    stages rank r holds (its chunks, in order). A rank free at a tick runs, of the ops whose
    inputs have arrived: a B (the input's gradient: others wait for it; the earlier stage
    first), else an F while fewer than `cap` micro-batch chunks are between their F and their
    W on this rank (what they hold; the later stage first, which drains the pipe), else its
    oldest pending W. zbv: the V's two chunks, cap 2p + 2 chunks (each half a stage: one
    micro-batch more than 1F1B's p stages' worth). With m >= 2p every rank then idles only
    the V's fill, p - 1 chunk forwards (the tests simulate p up to 10); with fewer
    micro-batches it may idle more."""
    S = sum(len(x) for x in stages)
    nxt = {(op, s): 0 for op in "FBW" for s in range(S)}  # next micro-batch of op at stage s
    done, busy, held, out, t = {}, [0] * p, [0] * p, [[] for _ in range(p)], 0
    while any(len(out[r]) < 3 * m * len(stages[r]) for r in range(p)):
        if all(busy[r] <= t for r in range(p)) and t > 0 and not any(
                done_t == t for done_t in done.values()):
            raise RuntimeError(f"zero-bubble schedule deadlocks at tick {t} (cap {cap})")
        for r in range(p):
            if busy[r] > t:
                continue
            ready = lambda key: done.get(key, t + 1) <= t  # noqa: E731 (finished by tick t)
            cands = []
            for s in stages[r]:
                f, b, w = nxt[("F", s)], nxt[("B", s)], nxt[("W", s)]
                if b < f and ready(("F", b, s)) and (s == S - 1 or ready(("B", b, s + 1))):
                    cands.append((0, s, b, "B", s))
                if f < m and held[r] < cap and (s == 0 or ready(("F", f, s - 1))):
                    cands.append((1, -s, f, "F", s))
                if w < b:
                    cands.append((2, w, -s, "W", s))
            if not cands:
                continue
            *_, op, s = min(cands)
            mb = nxt[(op, s)]
            done[(op, mb, s)], busy[r] = t + 1, t + 1
            out[r].append((op, mb, stages[r].index(s)))
            nxt[(op, s)] += 1
            held[r] += {"F": 1, "B": 0, "W": -1}[op]
        t += 1
    return out


def _dualpipe_v(r: int, p: int, m: int) -> list[tuple]:
    """DualPipeV on rank r (DeepSeek-AI's DualPipe repository, 2025): chunk 0 is stage r, on
    the V's way down, chunk 1 stage 2p-1-r, on its way up. "BW" below is a whole backward (B
    then its W at once); a lone "B" leaves its W to fill a later gap, oldest first. In order:
    fill the V (forwards of chunk 0, then of both), a zero-bubble warm-up (B, a pending W, F
    on chunk 1), the steady state (F&B pairs: a forward of one chunk beside the whole backward
    of the other), then the drain, whose second half splits its backwards so the W's fill the
    cool-down. The same order as torch's ScheduleDualPipeV (the tests compare them)."""
    out, nxt, waiting = [], {}, []

    def run(*ops):  # (op, chunk) pairs; ("W", None): the oldest pending W, if any
        for op, c in ops:
            if op == "W":
                out.extend(waiting[:1])
                del waiting[:1]
                continue
            mb = nxt.get((op[0], c), 0)
            nxt[(op[0], c)] = mb + 1
            out.append((op[0], mb, c))
            (out if op == "BW" else waiting if op == "B" else []).append(("W", mb, c))

    down = p - r - 1  # how far rank r is from the turn of the V
    run(*[("F", 0)] * (2 * down))
    for _ in range(r + 1):
        run(("F", 0), ("F", 1))
    for _ in range(down):
        run(("B", 1), ("W", None), ("F", 1))
    for _ in range(m - 2 * p + r + 1):  # the steady state: F&B, F&B
        run(("F", 0), ("BW", 1), ("F", 1), ("BW", 0))
    for _ in range(down):
        run(("BW", 1), ("F", 1), ("BW", 0))
    # the drain: whole backwards, then from its middle on split ones (odd ranks switch one
    # backward earlier), whose W's fill the wait for the last gradients
    split, half = False, (r + 1) // 2
    for i in range(r + 1):
        split = split or (i == half and r % 2 == 1)
        run(("B" if split else "BW", 1))
        split = split or (i == half and r % 2 == 0)
        run(("B" if split else "BW", 0))
    for _ in range(down):
        run(("W", None), ("B" if split else "BW", 0))
    run(*[("W", None)] * len(waiting))
    return out


def simulate(schedule, p: int, v: int = 1, tf: float = 1.0, tb: float = 1.0, tw: float = 0.0,
             kind: str = ""):
    """Run `schedule` with every forward costing tf, every backward tb + tw (tb the input's
    gradient, tw the weights'; a split schedule's B costs tb and its W tw) and free
    communication; a V-shaped kind (zbv, dualpipev) places the chunks in a V (rank_stages).
    Returns per rank a list of (op, mb, chunk, start, end). Raises if the schedule deadlocks
    (an op waits on one that can never run before it)."""
    split = any(op == "W" for ops in schedule for op, _, _ in ops)
    cost = {"F": tf, "B": tb if split else tb + tw, "W": tw}
    S, done, pos = p * v, {}, [0] * p
    clock, out = [0.0] * p, [[] for _ in range(p)]
    while any(pos[r] < len(schedule[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(schedule[r]):
                op, mb, c = schedule[r][pos[r]]
                s = rank_stages(r, p, v, kind)[c]
                deps = [("F", mb, s - 1)] if op == "F" and s > 0 else []
                if op == "B":
                    deps = [("F", mb, s)] + ([("B", mb, s + 1)] if s < S - 1 else [])
                if op == "W":
                    deps = [("B", mb, s)]
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = done[(op, mb, s)] = start + cost[op]
                out[r].append((op, mb, c, start, clock[r]))
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule deadlocks at positions {pos}")
    return out


def in_flight(rank_schedule, until: str = "B") -> int:
    """Most micro-batch chunks whose forward ran and whose `until` op did not yet: "B" (the
    default) counts the stashed activations backward needs; with a split backward, "W" counts
    what a rank holds until the weights' gradients are done."""
    live = peak = 0
    for op, _, _ in rank_schedule:
        live += 1 if op == "F" else -1 if op == until else 0
        peak = max(peak, live)
    return peak


def bubble_formula(schedule: str, p: int, m: int, v: int = 1, of: str | None = None,
                   tf: float = 1.0, tb: float = 1.0, tw: float = 1.0) -> float:
    """The textbook bubble. of="total": idle / step time (GPipe's convention, (p-1)/(m+p-1));
    of="ideal": idle / ideal compute time m·(tf+tb) (Megatron's, (p-1)/(v·m) interleaved).
    One number in two units: total = ideal / (1 + ideal). A measured bubble (1 - busy / step
    time) compares with of="total". Default: the convention the schedule's paper uses
    (FORMULA_CONVENTION). Only the split schedules' depend on the op times (tf forward, tb the
    input's gradient, tw the weights', per chunk): zb1p idles (p-1)(tf+tb-tw) against an ideal
    m(tf+tb+tw), the (p-1)(F+B-2W) of DeepSeek-V3's table with B the whole backward tb + tw;
    zbv (p-1)·tf against 2m(tf+tb+tw), the V's fill, after which no rank waits when the three
    are equal and m >= 2p: derived from the schedule made here (the paper says "near zero"),
    and checked against simulate() in the tests; dualpipev the (PP/2-1)(F&B+B-3W) of
    DeepSeek-AI's DualPipe table, PP = 2p stages, F&B = tf+tb+tw (run one after the other
    here), B = tb+tw. The table's is a bound: the order made here idles less (simulate(): p-1
    units when the three are equal, the table 2(p-1)); the tests check it is never exceeded."""
    of = of or FORMULA_CONVENTION[schedule]
    if schedule == "naive":
        ideal = p - 1  # one micro-batch in the pipe: p-1 idle slots per busy slot
    elif schedule in ("gpipe", "1f1b"):
        ideal = (p - 1) / m
    elif schedule == "interleaved":
        ideal = (p - 1) / (v * m)
    elif schedule == "zb1p":
        ideal = (p - 1) * (tf + tb - tw) / (m * (tf + tb + tw))
    elif schedule == "zbv":  # the V's fill: the last rank starts after p-1 chunk forwards
        ideal = (p - 1) * tf / (2 * m * (tf + tb + tw))
    elif schedule == "dualpipev":  # (PP/2-1)(F&B+B-3W), PP = 2p stages, B the whole backward
        ideal = (p - 1) * ((tf + tb + tw) + (tb + tw) - 3 * tw) / (2 * m * (tf + tb + tw))
    else:
        raise ValueError(f"schedule {schedule!r} is not one of {list(FORMULA_CONVENTION)}")
    return ideal if of == "ideal" else ideal / (1 + ideal)


# -- the schedule, run over any stage modules -------------------------------------------------
# A stage's output shape travels once, in a header sent before its first activation: dtype (an
# index into _DTYPES), the number of dims, the dims. Fixed size, so the receiver can post it.
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.bool)
_MAX_DIMS = 6


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
        raise TypeError(f"a stage's output goes to the next stage as one tensor of at most "
                        f"{_MAX_DIMS} dims and a dtype in {_DTYPES}; got {t.dtype}, "
                        f"{t.dim()} dims")
    h = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=t.device)  # NCCL: on the GPU
    h[0], h[1] = _DTYPES.index(t.dtype), t.dim()
    h[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def _from_header(h: torch.Tensor) -> tuple[tuple, torch.dtype]:
    n = int(h[1])
    return tuple(int(d) for d in h[2:2 + n]), _DTYPES[int(h[0])]


class PipelineSchedule:
    """A pipeline over stage modules the caller built, one group rank per stage (or v stages
    per rank, interleaved), modelled on torch.distributed.pipelining's ScheduleGPipe /
    Schedule1F1B `step()`:

        sched = distlab.PipelineSchedule(my_stage, schedule="1f1b", n_microbatches=4,
                                         loss_fn=F.mse_loss)
        loss = sched.step(x, y)   # the loss on the rank holding the last stage, else None

    stages          this rank's stage: a module taking one tensor and returning one; or a
                    list of v modules for "interleaved" (chunk c is global stage c·p + rank),
                    or of 2 for "zbv" and "dualpipev" (stages rank and 2p-1-rank)
    schedule        "naive", "gpipe", "1f1b", "interleaved", "zb1p", "zbv" or "dualpipev"
                    (make_schedule; the last three split each stage's backward:
                    split_backward.py)
    n_microbatches  m: step() cuts x and y into m equal micro-batches along dim 0
    loss_fn         loss_fn(last stage's output, y's micro-batch), a mean over its rows
    group / comm    a process group (default: the world), or a distlab Comm to go through
    n_stages        optional: the total the caller built, checked against ranks × v
    timed           barriers at both ends of step() and a timeline in `info` (events, busy,
                    bubble, stashed activation bytes); op_delay_s: a sleep per op (demos)

    step(x, y) leaves in each stage's .grad the gradient of the mean of the m micro-batch
    losses (each loss is divided by m before its backward), i.e. of the whole batch's mean
    loss; the rank holding stage 0 needs x, the one holding the last stage y (others may
    pass them too). Activation shapes are not assumed: each stage learns its input's shape
    and dtype from a small header its predecessor sends with its first activation (one per
    stage boundary, first step only, booked as "pp_shapes" on a Comm of its own so a step's
    pp bytes stay the activations' and gradients'). Every later step must use the first
    step's micro-batch shape (as in torch's pipelining): a change raises.
    """

    def __init__(self, stages, schedule: str = "1f1b", n_microbatches: int = 1, loss_fn=None,
                 group=None, n_stages: int | None = None, comm: Comm | None = None,
                 timed: bool = False, op_delay_s: float = 0.0):
        self.stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        self.comm = comm if comm is not None else Comm(group)
        self.p, self.rank, self.v, self.m = (self.comm.world, self.comm.rank, len(self.stages),
                                             n_microbatches)
        self.S, self.kind, self.loss_fn = self.p * self.v, schedule, loss_fn
        self._agree(self._problem(n_stages))
        self.ids = rank_stages(self.rank, self.p, self.v, schedule)
        self.local: dict[int, torch.Tensor] = {}  # hand-offs between two stages of this rank
        self.ops = make_schedule(schedule, self.p, self.m, self.v)[self.rank]
        self.meta = Comm(self.comm.group, name=self.comm.name)  # the shape headers
        self.inputs: dict[int, tuple] = {}  # stage -> (shape, dtype) of its input micro-batch
        self.outputs: dict[int, tuple] = {}  # stage -> (shape, dtype) its header announced
        self.timed, self.delay, self.info = timed, op_delay_s, {}
        self._in_step = False
        self._steps = StepCounter("PipelineSchedule")  # a failing send/recv says so
        # where received activations land: the stages' device (NCCL sends only GPU tensors)
        self.device = next((p.device for st in self.stages for p in st.parameters()),
                           torch.device("cpu"))
        for c, st in enumerate(self.stages):
            st._distlab_pipeline = self
            st.register_forward_pre_hook(lambda mod, args, s=self.ids[c]: self._outside(s))
        self.w_store = WeightGradStore() if schedule in SPLIT_BACKWARD else None
        if self.w_store is not None:
            for st in self.stages:
                split_weight_gradients(st, self.w_store)

    # -- construction checks: every rank raises the same error, none waits on a peer ----------
    def _problem(self, n_stages) -> str | None:
        if self.kind not in FORMULA_CONVENTION:
            return f"schedule={self.kind!r} is not one of {', '.join(FORMULA_CONVENTION)}"
        if not self.stages or not all(isinstance(s, nn.Module) for s in self.stages):
            return "stages must be this rank's stage module, or a list of them (interleaved)"
        if self.kind in V_SHAPED and self.v != 2:
            return (f"{self.kind} runs two stages per rank, rank r holding stages r and "
                    f"2p-1-r; this rank has {self.v}: pass [stage r, stage 2p-1-r]")
        if self.kind == "dualpipev" and self.m < 2 * self.p:
            return (f"dualpipev needs n_microbatches ({self.m}) >= 2 × the {self.p} ranks")
        if self.v > 1 and self.kind not in MULTI_CHUNK:
            return (f"schedule {self.kind!r} runs one stage per rank and this rank has "
                    f"{self.v}: pass one module, or use schedule='interleaved'")
        if n_stages is not None and n_stages != self.S:
            return (f"n_stages={n_stages} stages do not fit {self.p} ranks holding {self.v} "
                    f"each ({self.S}): launch {n_stages // self.v or 1} ranks, or build "
                    f"{self.S} stages")
        if self.m < 1:
            return f"n_microbatches={self.m}: need at least 1"
        if any(getattr(s, "_distlab_pipeline", None) is not None for s in self.stages):
            return ("a stage module is already in a PipelineSchedule: one schedule per stage "
                    "(its hooks and shape headers belong to the first)")
        if self.kind == "interleaved" and self.m % self.p:
            return (f"interleaved needs n_microbatches ({self.m}) divisible by the {self.p} "
                    f"ranks")
        return None

    def _agree(self, problem):
        last = stage_rank(self.S - 1, self.p, self.kind)  # the last stage needs loss_fn
        if problem is None and self.rank == last and self.loss_fn is None:
            problem = "the rank holding the last stage needs loss_fn (loss_fn(output, y))"
        mine = (problem, self.v, self.kind, self.m)
        every = [None] * self.p
        dist.all_gather_object(every, mine, group=self.comm.group)
        for r, (prob, *_) in enumerate(every):
            if prob is not None:
                raise ValueError(f"PipelineSchedule (rank {r}): {prob}")
        if len({tuple(e[1:]) for e in every}) > 1:
            raise ValueError("the ranks disagree on (stages per rank, schedule, "
                             f"n_microbatches): {[tuple(e[1:]) for e in every]}; every rank "
                             "must build its schedule with the same settings")

    def _outside(self, stage):
        if not self._in_step and torch.is_grad_enabled():
            raise RuntimeError(
                f"this module is stage {stage} of {self.S} of a distlab.PipelineSchedule: "
                f"called directly it computes only its stage, and a loss and backward from it "
                f"would train part of the model on the wrong target; train with "
                f"schedule.step(x, y), or call it under torch.no_grad() to inspect its output")

    # -- one step ---------------------------------------------------------------------------
    def step(self, x=None, y=None, scale_loss=None):
        """Forward and backward of every micro-batch in this rank's schedule order. Returns
        the mean micro-batch loss on the rank holding the last stage, None elsewhere.
        scale_loss: applied to each micro-batch loss before its backward (loss scaling)."""
        xs = self._split(x, "x") if 0 in self.ids else None
        ys = self._split(y, "y") if self.S - 1 in self.ids else None
        if xs is not None:
            meta = (tuple(xs[0].shape), xs[0].dtype)
            self._same_shape(0, meta, "micro-batch input", self.inputs)
        self._in_step = True
        self._steps.begin()
        try:
            return self._run(xs, ys, scale_loss or (lambda loss: loss))
        finally:
            self._in_step = False

    def _split(self, t, name):
        if t is None:
            need = "stage 0" if name == "x" else "the last stage"
            raise ValueError(f"this rank holds {need}: pass {name} to step()")
        if t.shape[0] % self.m:
            raise ValueError(f"{name} has {t.shape[0]} rows, not divisible into "
                             f"n_microbatches={self.m} equal micro-batches")
        return t.chunk(self.m)

    def _same_shape(self, stage, meta, what, seen):
        if seen.setdefault(stage, meta) != meta:
            raise ValueError(f"stage {stage}'s {what} is {meta}, not the first step's "
                             f"{seen[stage]}: activation shapes are learnt once; keep the "
                             f"micro-batch shape fixed, or build a new PipelineSchedule")

    def _peer(self, stage):
        return stage_rank(stage, self.p, self.kind)

    def _tag(self, mb, stage, backward):
        return (mb * self.S + stage) * 2 + int(backward)

    def _header_tag(self, stage):
        return 2 * self.m * self.S + stage  # past every activation and gradient tag

    def _run(self, xs, ys, scale_loss):
        self.stash, self.sends, self.events, self.loss = {}, [], [], None
        self.live_bytes = self.peak_bytes = 0
        self.params = {q.untyped_storage().data_ptr() for st in self.stages
                       for q in st.parameters()}
        if self.timed:  # a common step start: a rank's last step must not show as idle here
            self.comm.barrier()
        self.t_start = time.perf_counter()
        self.peak_w_bytes = 0
        for op, mb, c in self.ops:
            if op == "F":
                self._forward(mb, c, xs, ys)
            elif op == "B":
                self._backward(mb, c, scale_loss)
            else:
                self._weights(mb, c)
        for w in self.sends:
            w.wait()
        if self.timed:
            self.comm.barrier()  # a common step end: the pipeline's step is the slowest rank's
            self.info = timeline(self.events, time.perf_counter() - self.t_start)
            self.info.update(schedule=self.kind, stages=self.ids, peak_stash_bytes=self.peak_bytes,
                             peak_in_flight=in_flight(self.ops))
            if self.w_store is not None:  # what deferred W's held, and for how many micro-batches
                self.info.update(peak_w_bytes=self.peak_w_bytes,
                                 peak_until_w=in_flight(self.ops, until="W"))
        return self.loss

    def _record(self, op, mb, c, t0):
        self.events.append({"op": op, "mb": mb, "chunk": c, "t0": t0 - self.t_start,
                            "t1": time.perf_counter() - self.t_start})

    def _forward(self, mb, c, xs, ys):
        s = self.ids[c]
        inp = xs[mb] if s == 0 else self._receive_activation(mb, s, c)
        t0 = time.perf_counter()
        saved = _SavedBytes(self.params)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            out = self.stages[c](inp)
            if s == self.S - 1:  # the mean over micro-batches: each loss / m
                out = self.loss_fn(out, ys[mb]) / self.m
                self.loss = (self.loss or 0.0) + out.item()
        self._sleep()
        self._record("F", mb, c, t0)
        self.live_bytes += saved.bytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.stash[(mb, c)] = (inp, out, saved.bytes)
        if s < self.S - 1:
            self._send_activation(out, mb, s, c)

    def _mine(self, stage):
        """Is `stage` on this rank (the turn of zbv's and dualpipev's V): then hand-offs stay
        in memory."""
        return self._peer(stage) == self.rank

    def _receive_activation(self, mb, s, c):
        if self._mine(s - 1):  # a new leaf: this stage's backward stops at its own input
            return self.local.pop(self._tag(mb, s, False)).detach().requires_grad_()
        t0 = time.perf_counter()
        if s not in self.inputs:  # first step: the shape header comes first
            h = self.meta.recv(torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=self.device),
                               self._peer(s - 1),
                               "pp_shapes", self._header_tag(s))
            self.inputs[s] = _from_header(h)
        shape, dtype = self.inputs[s]
        inp = torch.empty(shape, dtype=dtype, device=self.device)
        self.comm.recv(inp, self._peer(s - 1), "pp_recv_act", self._tag(mb, s, False))
        self._record("recv", mb, c, t0)
        return inp.requires_grad_() if inp.is_floating_point() else inp

    def _send_activation(self, out, mb, s, c):
        if not torch.is_tensor(out):
            raise TypeError(f"stage {s} returned a {type(out).__name__}: a stage before the "
                            f"last must return one tensor (the next stage's input)")
        t0 = time.perf_counter()
        meta = (tuple(out.shape), out.dtype)
        if self._mine(s + 1):
            self._same_shape(s, meta, "output", self.outputs)
            self.local[self._tag(mb, s + 1, False)] = out.detach()
            return
        if s not in self.outputs:
            self.sends.append(self.meta.isend(_header(out), self._peer(s + 1), "pp_shapes",
                                              self._header_tag(s + 1)))
        self._same_shape(s, meta, "output", self.outputs)
        self.sends.append(self.comm.isend(out.detach(), self._peer(s + 1), "pp_send_act",
                                          self._tag(mb, s + 1, False)))
        self._record("send", mb, c, t0)

    def _backward(self, mb, c, scale_loss):
        s = self.ids[c]
        inp, out, nbytes = self.stash.pop((mb, c))
        grad = None
        if s < self.S - 1 and self._mine(s + 1):
            grad = self.local.pop(self._tag(mb, s, True))
        elif s < self.S - 1:
            t0 = time.perf_counter()
            grad = self.comm.recv(torch.empty_like(out), self._peer(s + 1), "pp_recv_grad",
                                  self._tag(mb, s, True))
            self._record("recv", mb, c, t0)
        t0 = time.perf_counter()
        with self.w_store.collecting((mb, c)) if self.w_store is not None else nullcontext():
            if grad is None:
                scale_loss(out).backward()
            else:
                torch.autograd.backward(out, grad)
        self._sleep()
        self._record("B", mb, c, t0)
        self.live_bytes -= nbytes
        if self.w_store is not None:
            self.peak_w_bytes = max(self.peak_w_bytes, self.w_store.pending_bytes())
        if s > 0:
            t0 = time.perf_counter()
            g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
            if self._mine(s - 1):
                self.local[self._tag(mb, s - 1, True)] = g
                return
            self.sends.append(self.comm.isend(g, self._peer(s - 1), "pp_send_grad",
                                              self._tag(mb, s - 1, True)))
            self._record("send", mb, c, t0)

    def _weights(self, mb, c):
        """W: the weights' gradients this micro-batch's B left (split_backward.py)."""
        t0 = time.perf_counter()
        self.w_store.run((mb, c))
        self._sleep()
        self._record("W", mb, c, t0)

    def _sleep(self):
        if self.delay:  # equal, known stage costs, so the measured bubble can meet the formula
            time.sleep(self.delay)


# -- the strategy: distlab's GPT cut into stages, run by PipelineSchedule ------------------------
class GPTStage(nn.Module):
    """One global stage of the split GPT as a module: forward(h) -> h (logits on the last).
    It registers only its own stage's modules: with v stages per rank, torch's pipelining
    scales (and zeroes) each stage's parameters' gradients, so stages must not share any."""

    def __init__(self, gpt, stage, n_stages):
        super().__init__()
        self._gpt, self.stage, self.n_stages = [gpt], stage, n_stages  # a list: not registered
        names = [str(i) for i in stage_blocks(len(gpt.blocks), n_stages, stage)]
        names += ["tok_emb", "pos_emb"] if stage == 0 else []
        names += ["ln_f", "head"] if stage == n_stages - 1 else []
        self.parts = nn.ModuleDict({n: gpt.blocks[int(n)] if n.isdigit() else getattr(gpt, n)
                                    for n in names})

    def forward(self, h):
        return stage_forward(self._gpt[0], self.stage, self.n_stages, h)


def gpt_loss(logits, targets):
    """GPT.forward's loss, on the last stage's logits."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def pipeline_shape(cfg) -> tuple[int, int, int, int]:
    """(p ranks, m micro-batches, v model chunks per rank, S = p·v stages) of a config."""
    v = cfg.virtual_stages if cfg.schedule == "interleaved" else 2 if cfg.schedule in V_SHAPED \
        else 1
    return cfg.pp, cfg.microbatches, v, cfg.pp * v


class PipelineParallel(ComposedCheckpoints, Strategy):
    """`pp`: this rank holds stages rank_stages(rank, pp, v) of the GPT and runs cfg.schedule
    with PipelineSchedule (timed: its timeline is the step's "pipeline" field)."""
    name = "pp"
    any_model = False  # distlab's GPT only (Strategy.any_model)
    degrees = frozenset({"pp"})
    knobs = frozenset({"microbatches", "schedule", "virtual_stages", "pp_op_delay_s"})

    @classmethod
    def mesh_preset(cls, cfg):
        return {"pp": cfg.world_size, "zero_stage": 0}

    def __init__(self, cfg, comm):
        super().__init__(cfg, comm)
        self.p, self.m, self.v, self.S = pipeline_shape(cfg)

    def wrap(self, model):
        kind = self.cfg.schedule
        model = split_model(model, self.rank, self.p, self.v, kind)
        stages = [GPTStage(model, s, self.S) for s in rank_stages(self.rank, self.p, self.v, kind)]
        self.sched = PipelineSchedule(stages, self.cfg.schedule, self.m, gpt_loss,
                                      n_stages=self.S, comm=self.comm, timed=True,
                                      op_delay_s=self.cfg.pp_op_delay_s)
        return model

    def batch(self, data, step):
        return data.rank_batch(step, self.cfg.global_batch, 0, 1)  # every stage: whole batch

    def forward_backward(self, model, x, y, scale_loss):
        return self.sched.step(x, y, scale_loss=scale_loss)

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
        return {"pipeline": self.sched.info}

    @property
    def pp_s(self):  # ComposedCheckpoints: the stages to gather are this strategy's
        return self


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
    """Busy time (forward, backward and, split, the weights' W), idle gaps between them, and the
    measured bubble."""
    compute = sorted((e for e in events if e["op"] in ("F", "B", "W")), key=lambda e: e["t0"])
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
