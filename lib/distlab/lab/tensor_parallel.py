"""Caller-side helpers of the tensor-parallelism notebook (workbook/05_tensor_parallel): the
Megatron byte formulas, a trace of where the collectives sit in one step, the bytes figure and
the control panel with tp and sp knobs.

Nothing here runs inside a rank or changes how anything trains. `collective_trace` builds the
same TensorParallel wrapping a rank builds, in this process, on a recording stand-in for
distlab.comm with one rank (every collective is then the identity), and notes each collective
with the module whose forward ran last or whose gradient arrived last: where the collectives
sit does not depend on how many ranks share the work, only their bytes do.
"""

from __future__ import annotations

import types

import ipywidgets as W
import plotly.graph_objects as go
import torch

from distlab.config import RunConfig
from distlab.lab.common import RUN_COLORS as COLORS, byte_unit
from distlab.lab.runs import max_step_loss_diff, worst_param_diff
from distlab.step_event import bytes_sent

FP32 = 4


# -- theory ------------------------------------------------------------------------------------


def measured_bytes(run) -> dict[str, set]:
    """{comm kind: {(calls, bytes sent)} over every rank and step} of a run: one element per
    kind when every rank moved the same in every step."""
    out: dict[str, set] = {}
    for e in run.history("step"):
        for kind, v in e.get("comm", {}).items():
            out.setdefault(kind, set()).add((v["calls"], v["bytes_sent"]))
    return out


def wire_range(run) -> tuple[int, int] | None:
    """(least, most) bytes the kernel saw one rank write in one step, over every rank and step
    of a run (distlab.wire), or None where it could not see them."""
    sent = [e.get("wire", {}).get("sent") for e in run.history("step")]
    if not sent or None in sent:
        return None
    return min(sent), max(sent)


def booked_per_step(run) -> set:
    """The distinct totals distlab.comm booked for one rank in one step, over every rank and
    step of a run."""
    return {bytes_sent(e) for e in run.history("step")}


def equivalence_gaps(runs: dict, reference) -> dict[str, tuple[float, float]]:
    """{run: (largest per-step loss gap, worst parameter gap on any rank)} against `reference`
    (one process) for every other run in `runs`: TP must take one process's steps, up to the
    order of its additions."""
    return {k: (max_step_loss_diff(r.losses(), reference.losses()),
                max(worst_param_diff(s, reference.states[0]) for s in r.states))
            for k, r in runs.items() if r is not reference}


def wire_table_rows(runs: dict, wire: dict[str, tuple[int, int] | None]) -> list[list]:
    """The wire table's rows, one per run in `wire` ({run: wire_range}): the totals booked for
    a rank in a step, the range the kernel saw written, and its top over the most booked."""
    rows = []
    for k, w in wire.items():
        b = booked_per_step(runs[k])
        rows.append([k, ", ".join(f"{x:,.0f}" for x in sorted(b)) or "nothing",
                     "not measured here" if w is None else f"{w[0]:,} to {w[1]:,}",
                     "—" if w is None or not max(b) else f"{w[1] / max(b):.3f}"])
    return rows


# -- where the collectives sit -------------------------------------------------------------------
class _Recorder:
    """A one-rank stand-in for distlab.comm.Comm that records each collective it is asked for."""

    rank, world = 0, 1

    def __init__(self):
        self.events: list = []   # ("module", phase, name) and ("comm", kind)

    def _done(self, kind, result):
        self.events.append(("comm", kind))
        return types.SimpleNamespace(wait=lambda: result)

    def all_reduce_async(self, t, kind="all_reduce"):
        return self._done(kind, t)

    def all_gather_async(self, out, t, kind="all_gather"):
        out.copy_(t)
        return self._done(kind, out)

    def reduce_scatter_async(self, out, t, kind="reduce_scatter"):
        out.copy_(t)
        return self._done(kind, out)


def _on_grad(out, rec, name):
    if out.requires_grad:
        out.register_hook(lambda g: rec.events.append(("grad", name)))


def collective_trace(cfg: RunConfig, sp: bool = False) -> list[dict]:
    """One forward and backward of cfg's GPT wrapped by TensorParallel (one rank, recording):
    one row per collective in the order issued, {"phase", "kind", "inside", "after",
    "before"}: the leaf module whose forward was running when it was issued (None between
    modules), the leaf module that finished its forward last (forward) or whose output
    gradient arrived last (backward), and the next leaf module to start."""
    import warnings

    from distlab.models import GPT, GPTConfig
    from distlab.parallel.tensor.tp import TensorParallel

    torch.manual_seed(0)
    rec = _Recorder()
    strategy = TensorParallel(types.SimpleNamespace(sp=sp, model="gpt"), rec)
    model = strategy.wrap(GPT(GPTConfig.from_run(cfg)))
    for name, m in model.named_modules():
        if name and not list(m.children()):  # leaves: linears, LayerNorms, embeddings
            m.register_forward_pre_hook(lambda *_, n=name: rec.events.append(("enter", n)))
            m.register_forward_hook(lambda *_, n=name: rec.events.append(("leave", n)))
            # the output's gradient, by a tensor hook: a module backward hook would wrap the
            # inputs in new tensors, and q, k, v would no longer share one f (layers._RegionEntry)
            m.register_forward_hook(lambda m, i, out, n=name: _on_grad(out, rec, n))
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with warnings.catch_warnings():  # token ids need no gradient: hooks fire on outputs
        warnings.simplefilter("ignore", UserWarning)
        model(x, x).backward()  # GPT returns the loss when given targets
    rows, open_, last, phase = [], None, None, "forward"
    for ev in rec.events:
        if ev[0] == "comm":
            rows.append({"phase": phase, "kind": ev[1], "inside": open_, "after": last,
                         "before": None})
            continue
        for r in rows:
            if r["before"] is None:
                r["before"] = ev[1]
        if ev[0] == "enter":
            open_ = ev[1]
        elif ev[0] == "leave":
            open_, last = None, ev[1]
        else:
            phase, open_, last = "backward", None, ev[1]
    return rows


def where_issued(row: dict, styles: dict[str, str]) -> str:
    """Where a collective_trace row's collective sits, in words: inside a module (with its plan
    style, `styles` being plan_table's), on that module's partial output, or between two."""
    if row["inside"]:
        return (f"inside {row['inside']} ({styles.get(row['inside'], 'replicated')}), "
                f"on its partial output")
    return f"between {row['after']} and {row['before']}"


# -- figures -------------------------------------------------------------------------------------
def bytes_figure(rows: list[tuple[str, str, float, float]], title: str) -> go.Figure:
    """rows (config, kind, formula bytes, measured bytes) as grouped bars, formula beside
    measured, one pair per config and kind."""
    x = [f"{c}<br>{k}" for c, k, _, _ in rows]
    scale, unit = byte_unit([f for _, _, f, _ in rows], [m for *_, m in rows])
    fig = go.Figure()
    fig.add_bar(x=x, y=[f / scale for _, _, f, _ in rows], name="formula",
                marker_color=COLORS[0], customdata=[f for _, _, f, _ in rows],
                hovertemplate="formula: %{customdata:,.0f} B<extra></extra>")
    fig.add_bar(x=x, y=[m / scale for *_, m in rows], name="measured (every rank, every step)",
                marker_color=COLORS[1], customdata=[m for *_, m in rows],
                hovertemplate="measured: %{customdata:,.0f} B<extra></extra>")
    fig.update_layout(barmode="group", title=title,
                      yaxis_title=f"sent per rank per step ({unit})",
                      height=420, template="plotly_white")
    return fig


# -- the control panel ---------------------------------------------------------------------------
def tp_panel(**defaults):
    """A lab.ControlPanel whose tp knob leads: the world size follows it, since every rank of
    `tp` / `tp-torch` is a tensor-parallel rank (the panel's own tp knob follows the world size
    instead; its sp knob shows under the strategies that support sp)."""
    from distlab.lab.panel import ControlPanel

    tp = W.Dropdown(options=[2, 4], value=defaults.get("tp", 2), description="tp")
    defaults = {"strategy": "tp", **defaults, "world_size": tp.value, "tp": tp.value}
    panel = ControlPanel(extra_widgets={"tp": tp}, **defaults)

    def follow(change):
        panel.knobs["world_size"].value = change["new"]
    tp.observe(follow, names="value")
    return panel
