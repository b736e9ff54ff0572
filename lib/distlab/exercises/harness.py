"""Running a learner's function on real ranks and saying what differs.

A notebook's function cannot be imported by the spawned ranks (they import by module name,
and a notebook has none), so its source travels instead: `source_of(fn)` reads it
(IPython keeps every cell's source), each rank executes it in a namespace that has `torch`
and `F` (torch.nn.functional) and calls it. The function must therefore be self-contained:
it may use torch, F and its own arguments, not the notebook's other names.

`run_exercise(name, fn, world)` runs the exercise's rank function (exercises/<name>.py's
`on_rank`) on `world` ranks with a short timeout, so a deadlock (every rank waiting to
receive) ends as a clear message instead of a hung cell, and returns a `Report`: what each
rank found wrong, or that everything matched.
"""

from __future__ import annotations

import html
import inspect
import re
import textwrap
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def source_of(fn) -> tuple[str, str]:
    """(the function's name, its source, dedented)."""
    if not callable(fn) or not hasattr(fn, "__name__"):
        raise TypeError(f"pass the function itself (def ...), not {type(fn).__name__}")
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError) as e:
        raise TypeError(f"the source of {fn.__name__} cannot be read ({e}): define it with "
                        "def in a notebook cell or a file") from e
    return fn.__name__, textwrap.dedent(src)


def load(name: str, source: str):
    """On a rank: the learner's function, from its source."""
    namespace = {"torch": torch, "F": F}
    exec(compile(source, f"<your {name}>", "exec"), namespace)  # the learner's own code
    return namespace[name]


@dataclass
class Report:
    """What the check found: `ok`, and the lines that say what differs (or what matched)."""
    exercise: str
    ok: bool
    lines: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        head = f"{self.exercise}: {'passed' if self.ok else 'NOT passed'}"
        return "\n".join([head] + [f"  - {line}" for line in self.lines])

    def _repr_html_(self) -> str:
        colour = "#2ca02c" if self.ok else "#d62728"
        items = "".join(f"<li>{html.escape(line)}</li>" for line in self.lines)
        return (f"<div><b style='color:{colour}'>{html.escape(self.exercise)}: "
                f"{'passed' if self.ok else 'not passed yet'}</b><ul>{items}</ul></div>")


def run_exercise(exercise: str, on_rank, fn, world: int, *args, timeout_s: float = 20.0,
                 judge=None) -> Report:
    """Run `on_rank(rank, world, device, log, name, source, *args)` on `world` ranks; each
    returns {"problems": [...], "facts": [...]}; `judge(results)` may add problems that need
    every rank's results. A rank that raises or times out becomes the report's first line."""
    from distlab import run_ranks
    from distlab.caller.run import RunError
    name, source = source_of(fn)
    try:
        results = run_ranks(on_rank, world, name, source, *args, timeout_s=timeout_s,
                            wall_timeout_s=timeout_s * 3 + 30)
    except RunError as e:
        return Report(exercise, False, [_explain(e, timeout_s)])
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res["problems"]]
    if judge is not None and not problems:
        problems += judge(results)
    facts = results[0].get("facts", [])
    return Report(exercise, not problems, problems or facts)


def _explain(e, timeout_s: float) -> str:
    msg = str(getattr(e, "message", e)).strip()
    tb = getattr(e, "traceback", "")
    if re.search(r"time[sd]? ?out|did not finish|timed out|never joined", msg + tb, re.I):
        return (f"rank {e.rank} was still waiting after {timeout_s:g} s: a deadlock? (every "
                "rank receiving before any sends, or a send with no matching receive). "
                f"The rank said: {msg.splitlines()[0][:300]}")
    where = ""
    for line in tb.splitlines():  # the learner's own line, if the error is in it
        if "<your " in line:
            where = f" ({line.strip()})"
    last = tb.strip().splitlines()[-1] if tb.strip() else msg
    if last.startswith("NotImplementedError"):
        return "not written yet: replace the stub's body (it raises NotImplementedError)"
    return f"rank {e.rank} raised: {last[:400]}{where}"
