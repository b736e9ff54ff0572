"""Exercise: the 1F1B pipeline schedule (PipeDream-Flush; Narayanan et al. 2019, 2021).

    def one_f_one_b(rank, p, m):
        # The order in which pipeline stage `rank` (of p) runs the forwards and backwards of
        # m micro-batches: a list of ("F", i) and ("B", i). Every forward and backward once.

GPipe runs all m forwards, then all m backwards: every stage stashes the activations of m
micro-batches. 1F1B starts the backwards as early as it can: after a warm-up of p-1-rank
forwards, each stage alternates one forward and one backward, so it never holds more than
p-rank micro-batches' activations, whatever m, with the same bubble.

The check, first by simulation (distlab.parallel.pipeline.pp.simulate: a stage waits for the
forward before it and the backward after it): every op once, no deadlock, at most
min(p-rank, m) micro-batches in flight on each stage. Then on real ranks: 4 stages of a small
MLP run the schedule with distlab.PipelineSchedule (activations and gradients sent between
them), and the gradients equal one process's on the whole batch (tolerance 1e-5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distlab.exercises.harness import Report, load, run_exercise, source_of

WORLD, M = 4, 8


def one_f_one_b(rank, p, m):
    warmup = min(p - 1 - rank, m)
    order = [("F", i) for i in range(warmup)]
    for k in range(m - warmup):  # steady state: one forward, one backward
        order += [("F", warmup + k), ("B", k)]
    return order + [("B", k) for k in range(m - warmup, m)]


reference = one_f_one_b


def static_problems(fn, p: int = WORLD, m: int = M) -> list[str]:
    """What the schedule gets wrong before any rank runs it."""
    from distlab.parallel.pipeline.pp import in_flight, simulate
    orders = [[(op, i, 0) for op, i in fn(r, p, m)] for r in range(p)]
    for r, order in enumerate(orders):
        want = sorted((op, i) for op in "FB" for i in range(m))
        if sorted((op, i) for op, i, _ in order) != want:
            return [f"stage {r}'s list is not every ('F', i) and ('B', i) once for i < {m}"]
    try:
        simulate(orders, p)
    except RuntimeError as e:
        return [f"the schedule deadlocks ({e}): a stage waits for an op that waits for it"]
    problems = []
    for r, order in enumerate(orders):
        limit = min(p - r, m)
        if in_flight(order) > limit:
            problems.append(f"stage {r} holds {in_flight(order)} micro-batches in flight; "
                            f"1F1B holds at most p - rank = {limit} (this is GPipe's memory?)")
    return problems


def _stages():
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(WORLD)]


def _batch():
    g = torch.Generator().manual_seed(5)
    return torch.randn(M * 2, 8, generator=g), torch.randn(M * 2, 8, generator=g)


def on_rank(rank, world, device, log, name, source):
    from distlab import PipelineSchedule
    fn = load(name, source)
    stage = _stages()[rank]
    sched = PipelineSchedule(stage, schedule="1f1b", n_microbatches=M, loss_fn=F.mse_loss)
    sched.ops = [(op, i, 0) for op, i in fn(rank, world, M)]  # the learner's order
    x, y = _batch()
    sched.step(x, y)
    ref = nn.Sequential(*_stages())
    F.mse_loss(ref(x), y).backward()
    mine = ref[rank]
    diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(stage.parameters(),
                                                                    mine.parameters()))
    problems = [] if diff <= 1e-5 else [f"stage {rank}'s gradients are off by {diff:.3g}"]
    return {"problems": problems,
            "facts": [f"on {world} real ranks the gradients equal one process's (max |diff| "
                      f"{diff:.1e})"]}


def check(fn, timeout_s: float = 30.0):
    name, _ = source_of(fn)
    try:
        problems = static_problems(fn)
    except NotImplementedError:
        return Report("1F1B schedule", False, ["not written yet: replace the stub's body (it "
                                               "raises NotImplementedError)"])
    except Exception as e:  # the learner's function raised while building the lists
        return Report("1F1B schedule", False, [f"{name} raised {type(e).__name__}: {e}"])
    if problems:
        return Report("1F1B schedule", False, problems)
    report = run_exercise("1F1B schedule", on_rank, fn, WORLD, timeout_s=timeout_s)
    if report.ok:
        from distlab.parallel.pipeline.pp import in_flight
        peaks = [in_flight([(op, i, 0) for op, i in fn(r, WORLD, M)]) for r in range(WORLD)]
        report.lines.append(f"micro-batches in flight per stage {peaks} (GPipe: {M} on each)")
    return report
