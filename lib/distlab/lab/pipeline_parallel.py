"""Caller-side helpers of the pipeline notebook (workbook/06_pipeline_parallel): a Gantt chart per
rank from a `pp` step's recorded events, the ideal timeline of a schedule, the measured bubble
of a run, and a widget that re-runs the real pipeline and redraws its chart.

Nothing here runs inside a rank; it reads what the runs logged (e["pipeline"], written by
distlab.parallel.pipeline.pp.PipelineParallel.step_info).

    runs = launch_together({"gpipe": cfg})
    gantt(runs["gpipe"], step=-1).show()      # forward / backward / send / recv / idle per rank
    measured_bubble(runs["gpipe"])            # median over steps (first dropped) and ranks
"""

from __future__ import annotations

import html
import statistics

import ipywidgets as W
import plotly.graph_objects as go

from distlab.config import RunConfig
from distlab.lab.runs import launch_together
from distlab.lab.panel import Explorer
from distlab.parallel.pipeline.pp import (SPLIT_BACKWARD, V_SHAPED, bubble_formula,
                                          make_schedule, simulate)
from distlab.caller.run import Run

OP_COLORS = {"F": "#1f5fbf", "B": "#2b8a3e", "W": "#94d82d", "send": "#e8590c",
             "recv": "#c2255c", "idle": "#dee2e6"}
# "B" is the whole backward, except in a split schedule (SPLIT_BACKWARD), where it is the
# input's gradient and "W" the weights'
OP_NAMES = {"F": "forward", "B": "backward", "W": "weights' gradient (W)", "send": "send",
            "recv": "recv (waiting)", "idle": "idle"}


# -- reading the runs ---------------------------------------------------------------------------
def step_pipelines(run: Run, step: int = -1) -> list[dict]:
    """e["pipeline"] of one step, one dict per rank (rank order). step=-1: the last step."""
    steps = sorted({e["step"] for e in run.history("step")})
    s = steps[step]
    by_rank = {e["rank"]: e["pipeline"] for e in run.history("step") if e["step"] == s}
    return [by_rank[r] for r in sorted(by_rank)]


def bubble_samples(run: Run, skip: int = 1) -> list[float]:
    """e["pipeline"]["bubble"] (1 - busy / step time) of every rank's steps, the first `skip`
    steps dropped (warm-up): read from a clock, the repeats a timed claim reads
    (distlab.lab.timed)."""
    return [e["pipeline"]["bubble"] for e in run.history("step") if e["step"] >= skip]


def measured_bubble(run: Run, skip: int = 1) -> float:
    """Median of bubble_samples: over every rank's steps, the first `skip` dropped."""
    return statistics.median(bubble_samples(run, skip))


def idle_over_busy(bubbles: list[float]) -> list[float]:
    """Bubbles as fractions of total time, b, turned into idle / busy = b / (1 − b): the
    ideal-time convention of Megatron's (p−1)/(v·m)."""
    return [b / (1 - b) for b in bubbles]


def op_seconds(run: Run, skip: int = 1) -> dict[str, float]:
    """Median seconds of each compute op ("F", "B" and, split, "W") over every rank's steps,
    the first `skip` dropped: the F, B and W a zero-bubble formula is priced with."""
    times: dict[str, list[float]] = {}
    for e in run.history("step"):
        if e["step"] >= skip:
            for x in e["pipeline"]["events"]:
                if x["op"] in ("F", "B", "W"):
                    times.setdefault(x["op"], []).append(x["t1"] - x["t0"])
    return {op: statistics.median(ts) for op, ts in times.items()}


def simulated_bubble(schedule: str, p: int, m: int, v: int, ops: dict[str, float]) -> float:
    """The bubble (of total time, mean over ranks) of the schedule's own order run by
    simulate() with the measured median op times `ops` and free communication: modelled, the
    order's figure where a formula is only a bound (dualpipev)."""
    split = schedule in SPLIT_BACKWARD
    timeline = simulate(make_schedule(schedule, p, m, v), p, v, tf=ops["F"], tb=ops["B"],
                        tw=ops["W"] if split else 0.0, kind=schedule)
    end = max(e[4] for rank in timeline for e in rank)
    return statistics.mean(1 - sum(e[4] - e[3] for e in rank) / end for rank in timeline)


def bubble_rows(runs: dict[str, Run], skip: int = 1) -> list[dict]:
    """Per run: schedule, p, m, v, measured bubble (of total time), both formulas (the split
    schedules' priced with the run's own median F, B and W: op_seconds) and the order's own
    bubble simulated with those times (simulated_bubble)."""
    rows = []
    for label, run in runs.items():
        c = run.cfg
        v = c.virtual_stages if c.schedule == "interleaved" else 1
        ops = op_seconds(run, skip)
        costs = ({"tf": ops["F"], "tb": ops["B"], "tw": ops["W"]}
                 if c.schedule in SPLIT_BACKWARD else {})
        rows.append({"run": label, "schedule": c.schedule, "p": c.pp, "m": c.microbatches, "v": v,
                     "measured": measured_bubble(run, skip),
                     "samples": bubble_samples(run, skip), "op_seconds": ops,
                     "total": bubble_formula(c.schedule, c.pp, c.microbatches, v, of="total",
                                             **costs),
                     "ideal": bubble_formula(c.schedule, c.pp, c.microbatches, v, of="ideal",
                                             **costs),
                     "simulated": simulated_bubble(c.schedule, c.pp, c.microbatches,
                                                   2 if c.schedule in V_SHAPED else v, ops)})
    return rows


# -- the claims table's timed rows: bubbles over every rank's steps ------------------------------
def bubble_curve_claim(curve: list[dict], tol: float) -> dict:
    """GPipe's bubble falls with m and matches (p−1)/(m+p−1) within `tol`: each m's bubbles
    below the previous m's and within the formula ± tol (bubble_rows' rows, m ascending)."""
    from distlab.lab.timed import all_of, below, timed_claim, within
    falls = [below(b["samples"], a["samples"]) for a, b in zip(curve, curve[1:])]
    fits = [within(r["samples"], r["total"] - tol, r["total"] + tol) for r in curve]
    return timed_claim(
        "more micro-batches shrink the bubble: (p−1)/(m+p−1) of total time",
        "Huang et al. 2019 (GPipe)", all_of(*falls, *fits),
        {f"m={r['m']}": r["samples"] for r in curve}, scale=1, unit="", interleaved_=False,
        note=f"GPipe p={curve[0]['p']}, every rank's step; formula "
             + ", ".join(f"m={r['m']}: {r['total']:.3f}" for r in curve) + f" (± {tol:g})")


def interleaving_claim(f1: dict, il: dict, v: int, factor: float = 1.5) -> dict:
    """Interleaving divides idle / busy by v: yes when interleaved's idle / busy lies wholly
    under 1F1B's divided by `factor` (1.5 for v = 2: the bubble tolerance allows ~1.6x-2.6x)."""
    from distlab.lab.timed import below, timed_claim
    a, b = idle_over_busy(f1["samples"]), idle_over_busy(il["samples"])
    ratio = statistics.median(a) / statistics.median(b)
    return timed_claim(
        "interleaving divides the bubble by v: (p−1)/(v·m) of ideal time",
        "Narayanan et al. 2021", below(b, a, 1 / factor),
        {"idle/busy 1f1b": a, f"interleaved v={v}": b}, scale=1, unit="",
        interleaved_=False,
        note=f"p={f1['p']}, m={f1['m']}, every rank's step; medians {ratio:.2f}x smaller "
             f"(formula {f1['ideal']:.3f} vs {il['ideal']:.3f}); yes needs more than "
             f"{factor:g}x")


def naive_bubble_claim(naive: dict, tol: float) -> dict:
    """The naive pipeline idles (p−1)/p of the time: yes when its bubbles lie within ± tol."""
    from distlab.lab.timed import timed_claim, within
    p = naive["p"]
    return timed_claim(
        "naive pipeline: (p−1)/p idle", "Huang et al. 2019",
        within(naive["samples"], (p - 1) / p - tol, (p - 1) / p + tol),
        {"measured bubble": naive["samples"]}, scale=1, unit="", interleaved_=False,
        note=f"p={p}, m={naive['m']}, every rank's step; (p−1)/p = {(p - 1) / p:.3f} "
             f"(± {tol:g})")


def modules_held(state: dict) -> list[str]:
    """The modules a rank's state dict covers, a block by its index ("blocks.3"), sorted: which
    part of the model its pipeline stages hold."""
    return sorted({k.split(".")[0] + (("." + k.split(".")[1]) if k.startswith("blocks") else "")
                   for k in state})


def blocks_held(state: dict) -> list[int]:
    """The indices of the transformer blocks in a rank's state dict, sorted."""
    return sorted({int(k.split(".")[1]) for k in state if k.startswith("blocks.")})


def whole_model(states: list[dict]) -> dict:
    """The ranks' state dicts as one: each stage keeps its parameters under the unsplit model's
    names, so together they are the whole model, comparable with one process's."""
    return {k: t for s in states for k, t in s.items()}


def p2p_per_step(run: Run, kind: str, field: str = "bytes_sent") -> dict[int, int]:
    """{step: bytes of one point-to-point kind ("pp_send_act", ...; its `field`) summed over
    the ranks}: what crossed the stage boundaries that way in that step."""
    per_step: dict[int, int] = {}
    for e in run.history("step"):
        per_step[e["step"]] = per_step.get(e["step"], 0) + e["comm"].get(kind, {}).get(field, 0)
    return per_step


def wire_per_step(run: Run) -> list[int] | None:
    """Each step's bytes on the wire summed over the ranks (distlab.wire), in ascending order;
    None where the kernel could not see some rank's traffic in some step."""
    per_step: dict[int, int | None] = {}
    for e in run.history("step"):
        w, before = e.get("wire", {}).get("sent"), per_step.get(e["step"], 0)
        per_step[e["step"]] = None if w is None or before is None else before + w
    return None if None in per_step.values() else sorted(per_step.values())


def schedule_rows(kind: str, p: int, m: int, v: int = 1) -> list[list[str]]:
    """make_schedule as table rows: one row per rank, ops written F0, B0 (chunk as F0.1)."""
    out = []
    for r, ops in enumerate(make_schedule(kind, p, m, v)):
        out.append([f"rank {r}", " ".join(f"{op}{mb}" + (f".{c}" if v > 1 else "")
                                          for op, mb, c in ops)])
    return out


# -- figures ------------------------------------------------------------------------------------
# A bar narrower than this share of the chart's time span is under a pixel wide: drawn (its
# hover still tells), but an op whose every bar is that thin gets no legend entry.
VISIBLE_SHARE = 0.002


def _bars(fig, rows_events, row_label, scale=1e3, unit=" ms") -> list[str]:
    """Add one horizontal bar per event: rows_events is [(row name, [events]), ...]. Each op
    drawn gets one legend entry, and only ops with a bar wide enough to see do (a send that
    returns at once would list a colour found nowhere in the chart). Returns the ops too thin
    to see, each with its widest bar, for the axis title to say so."""
    events = [e for _, evs in rows_events for e in evs]
    span = (max(e["t1"] for e in events) - min(e["t0"] for e in events)) if events else 0
    widest: dict[str, float] = {}
    for e in events:
        widest[e["op"]] = max(widest.get(e["op"], 0.0), e["t1"] - e["t0"])
    visible = {op for op, w in widest.items() if w >= VISIBLE_SHARE * span}
    names = OP_NAMES | ({"B": "input's gradient (B)"} if "W" in widest else {})
    seen = set()
    for name, evs in rows_events:
        for e in sorted(evs, key=lambda e: (e["op"] != "idle", e["t0"])):
            op = e["op"]
            text = "" if e.get("mb") is None else f"{e['mb']}" + (
                f".{e['chunk']}" if e.get("chunk") else "")
            fig.add_bar(y=[name], x=[(e["t1"] - e["t0"]) * scale], base=[e["t0"] * scale],
                        orientation="h", marker_color=OP_COLORS[op], name=names[op],
                        legendgroup=op, showlegend=op in visible and op not in seen,
                        text=text if op in ("F", "B", "W") else "", textposition="inside",
                        hovertemplate=f"{row_label(name)} {names[op]} mb {e.get('mb')} "
                                      f"chunk {e.get('chunk')}: %{{base:.1f}}–%{{x:.1f}}<extra></extra>")
            seen.add(op)
    return [f"{names[op]} (each at most {widest[op] * scale:.2g}{unit})"
            for op in OP_NAMES if op in widest and op not in visible]


def _title(title: str, thin: list[str]) -> str:
    """The chart's title, and under it the ops too thin to see (no room under the axis: the
    legend sits there)."""
    return title + (f"<br><sup>too thin to see: {', '.join(thin)}</sup>" if thin else "")


def gantt(pipelines: list[dict], title: str = "", fig: go.Figure | None = None) -> go.Figure:
    """Per-rank Gantt chart (ms) of one step from its recorded events: forward, backward,
    send, recv (time blocked in the receive) and idle (gaps between forward/backward)."""
    fig = fig if fig is not None else go.Figure()
    fig.data = ()
    rows = [(f"rank {r}", p["events"]) for r, p in enumerate(pipelines)]
    thin = _bars(fig, rows, lambda n: n)
    fig.update_layout(title=_title(title, thin), barmode="overlay",
                      xaxis_title="time in the step (ms)",
                      height=170 + 50 * len(rows), template="plotly_white", legend=LEGEND,
                      yaxis=dict(autorange="reversed", categoryorder="array",
                                 categoryarray=[n for n, _ in rows]))
    return fig


# One row under the chart: a vertical legend of six ops does not fit a two-rank chart's height.
LEGEND = dict(orientation="h", yanchor="top", y=-0.45, x=0)


def ideal_gantt(kind: str, p: int, m: int, v: int = 1, title: str = "") -> go.Figure:
    """The same chart for simulate(): unit forward and backward costs, free communication (a
    split schedule's B and W one unit each, the zero-bubble paper's F = B = W)."""
    tl = simulate(make_schedule(kind, p, m, v), p, v, tw=1.0 if kind in SPLIT_BACKWARD else 0.0,
                  kind=kind)
    end = max(e[4] for r in tl for e in r)
    rows = []
    for r, ops in enumerate(tl):
        evs = [{"op": op, "mb": mb, "chunk": c, "t0": t0, "t1": t1} for op, mb, c, t0, t1 in ops]
        t = 0.0
        for e in sorted(evs, key=lambda e: e["t0"]) + [{"t0": end, "t1": end}]:
            if e["t0"] > t:
                evs.append({"op": "idle", "mb": None, "chunk": None, "t0": t, "t1": e["t0"]})
            t = max(t, e["t1"])
        rows.append((f"rank {r}", evs))
    fig = go.Figure()
    thin = _bars(fig, rows, lambda n: n, scale=1, unit=" forward")
    fig.update_layout(title=_title(title or f"{kind}: ideal timeline (p={p}, m={m}, v={v})",
                                   thin),
                      barmode="overlay", xaxis_title="time (units of one forward)",
                      height=170 + 50 * p, template="plotly_white", legend=LEGEND,
                      yaxis=dict(autorange="reversed"))
    return fig


def bubble_curve(rows: list[dict], title: str) -> go.Figure:
    """Measured bubble vs m beside (p-1)/(m+p-1), for rows of one schedule and p."""
    ms = [r["m"] for r in rows]
    fig = go.Figure()
    fig.add_scatter(x=ms, y=[r["measured"] for r in rows], mode="lines+markers",
                    name="measured (idle / step time)", line=dict(color="#1f5fbf", width=3))
    fig.add_scatter(x=ms, y=[r["total"] for r in rows], mode="lines+markers",
                    name="(p-1)/(m+p-1) (Huang et al. 2019)",
                    line=dict(color="#e8590c", dash="dash"))
    fig.update_layout(title=title, xaxis_title="micro-batches m", yaxis_title="bubble fraction",
                      xaxis_type="log", height=360, template="plotly_white")
    fig.update_xaxes(tickvals=ms)
    return fig


# -- the widget ---------------------------------------------------------------------------------
class PipelineExplorer(Explorer):
    """Schedule, micro-batches and virtual stages; Run trains the real `pp` pipeline (one
    launch, `base`'s other settings) and redraws the Gantt chart of its last step. An invalid
    combination is refused with RunConfig's message in the status line. Virtual stages are
    offered with the interleaved schedule only (the others run one model chunk per rank): the
    knob is disabled under the others, and says why beside it."""

    def __init__(self, base: RunConfig,
                 schedules=("naive", "gpipe", "1f1b", "interleaved", "zb1p", "zbv",
                            "dualpipev"),
                 microbatches=(1, 2, 4, 8), virtual_stages=(1, 2)):
        super().__init__()  # Run, Stop, the status line
        self.base = base
        # "initial": the whole description beside each dropdown (the default width cuts
        # "micro-batches" to "micro-bat…")
        style = {"description_width": "initial"}
        self.schedule = W.Dropdown(options=list(schedules), value="1f1b", description="schedule",
                                   style=style)
        self.microbatches = W.Dropdown(options=list(microbatches),
                                       value=max(m for m in microbatches if m <= 4),
                                       description="micro-batches", style=style)
        self.virtual = W.Dropdown(options=list(virtual_stages), value=virtual_stages[0],
                                  description="virtual stages", style=style)
        self.virtual_note = W.HTML()  # why the virtual stages are disabled, when they are
        self.schedule.observe(lambda _change: self._offer_virtual(), names="value")
        self._offer_virtual()
        self.fig = go.Figure()
        self.fig.update_layout(height=270, template="plotly_white", legend=LEGEND)
        self.last: dict | None = None
        self.widget = self._box([W.HBox([self.schedule, self.microbatches, self.virtual,
                                         self.button, self.stop_button]), self.virtual_note,
                                 self.status, self._view_of(self.fig)])

    def _offer_virtual(self):
        """Virtual stages only under the interleaved schedule: disabled (at 1) otherwise."""
        sc = self.schedule.value
        interleaved = sc == "interleaved"
        self.virtual.disabled = not interleaved
        if not interleaved and 1 in self.virtual.options:
            self.virtual.value = 1
        why = ("" if interleaved else "virtual stages: only the interleaved schedule reads "
               "them; " + (f"{sc} runs two chunks per rank, placed in a V" if sc in V_SHAPED
                           else f"{sc} runs one model chunk per rank"))
        self.virtual.tooltip = why
        self.virtual_note.value = f"<small style='color:#666'>{html.escape(why)}</small>"

    def config(self) -> RunConfig:
        sc = self.schedule.value
        return self.base.replace(schedule=sc, microbatches=self.microbatches.value,
                                 virtual_stages=self.virtual.value if sc == "interleaved" else 1)

    def _clear(self):
        super()._clear()
        with self.fig.batch_update():  # the last chart is not this run's: empty it
            self.fig.data = ()
            self.fig.layout.title.text = "running: the chart of the last step comes at the end"

    def _run(self, **values) -> dict:
        """Set the knobs (schedule=, microbatches=, virtual_stages=), train, redraw; returns
        {"config", "run", "measured", "total", "ideal", "pipelines"} (`run(**values)`, or
        the Run button)."""
        for k, w in (("schedule", self.schedule), ("microbatches", self.microbatches)):
            if k in values:
                w.value = values[k]
        v = values.get("virtual_stages", 1)
        if v != 1 and self.schedule.value != "interleaved":
            raise ValueError(f"virtual_stages={v}: only the interleaved schedule reads it "
                             f"(schedule={self.schedule.value!r} runs one model chunk per rank)")
        if "virtual_stages" in values:
            self.virtual.value = v
        cfg = self.config()
        self._announce(f"running {cfg.schedule}, m={cfg.microbatches} ...")
        run = launch_together({"explorer": cfg}, name="pp-explorer",
                              on_start=self._started)["explorer"]
        (row,) = bubble_rows({"explorer": run})
        pipes = step_pipelines(run)
        with self.fig.batch_update():
            gantt(pipes, fig=self.fig,
                  title=f"{cfg.schedule}, p={cfg.pp}, m={cfg.microbatches}, v={row['v']}: "
                        f"last step")
        self._say(f"measured bubble {row['measured']:.3f} (idle / step time); formula "
                  f"{row['total']:.3f} of total, {row['ideal']:.3f} of ideal time")
        self.last = {"config": cfg, "run": run, "pipelines": pipes, **row}
        return self.last
