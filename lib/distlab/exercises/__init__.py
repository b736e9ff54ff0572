"""Exercises checked on real ranks: the learner writes a function, one call runs it on
spawned ranks against the reference and says what differs (values, bytes against the
formula, deadlocks as a clear timeout).

    from distlab import exercises
    def ring_all_reduce(x, rank, world, exchange): ...      # yours
    exercises.check("ring", ring_all_reduce)                 # a Report: passed, or what differs
    exercises.solution("ring")                               # the reference's source, when asked

Each exercise is one module (its docstring states the task and how it is checked):
ring (ring all-reduce from send/recv), bucket (DDP's bucket hook), zero1 (a ZeRO-1 step),
column and row (Megatron's parallel linears), one_f_one_b (the 1F1B schedule).

May import: everything below it (it launches ranks through distlab.run_ranks).
"""

from __future__ import annotations

import inspect

from distlab.exercises import bucket, one_f_one_b, ring, tensor_parallel, zero1
from distlab.exercises.harness import Report

EXERCISES = {
    "ring": (ring.check, ring.reference, ring),
    "bucket": (bucket.check, bucket.reference, bucket),
    "zero1": (zero1.check, zero1.reference, zero1),
    "column": (tensor_parallel.check_column, tensor_parallel.column_parallel, tensor_parallel),
    "row": (tensor_parallel.check_row, tensor_parallel.row_parallel, tensor_parallel),
    "one_f_one_b": (one_f_one_b.check, one_f_one_b.reference, one_f_one_b),
}


def _entry(name: str):
    if name not in EXERCISES:
        raise ValueError(f"no exercise {name!r}: one of {', '.join(EXERCISES)}")
    return EXERCISES[name]


def check(name: str, fn) -> Report:
    """Run your function `fn` for exercise `name` on real ranks; a Report of what differs."""
    return _entry(name)[0](fn)


def reference(name: str):
    """The reference solution (a function), e.g. to check the checker."""
    return _entry(name)[1]


def solution(name: str) -> str:
    """The reference solution's source, for when you want to compare."""
    return inspect.getsource(_entry(name)[1])


def task(name: str) -> str:
    """The exercise's statement: its module's docstring."""
    return inspect.getdoc(_entry(name)[2])


__all__ = ["EXERCISES", "Report", "check", "reference", "solution", "task"]
