"""How far from the limit: 13_search_and_time's figure and tables for each strategy's measured
step beside what this machine allows (distlab.studies.step_limit measures the parts,
distlab.theory.step_time adds them up).

    limit_figure(result)     per strategy two bars: predicted (compute + exposed communication)
                             and measured (time not blocked + time blocked in waits), with the
                             cores bound as a tick
    limit_rows(result)       the table under it: ratio, the gap's two measured parts, the why
    term_rows(result)        the model's exposed terms by name, per strategy
    growth_figure(points)    ddp's step over ranks and over width (step_limit.growth_points):
                             measured, predicted and serial, with the modelled compute and
                             communication whose crossing is where communication dominates
    growth_summary(points)   per curve: the worst deviation from the prediction, and the first
                             point where the modelled communication exceeds compute
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from distlab.lab.common import RUN_COLORS

PARTS = {"compute": "compute: its step in one process, collectives no-ops",
         "exposed": "exposed communication: α-β × its overlap rule",
         "not_blocked": "measured: not blocked in a wait",
         "blocked": "measured: blocked in waits"}


def _ms(seconds: float) -> float:
    return 1e3 * seconds


def limit_figure(result: dict, title: str = "") -> go.Figure:
    rows = result["rows"]
    x = [r["strategy"] for r in rows]
    compute = [_ms(r["prediction"].compute.total) for r in rows]
    exposed = [_ms(r["prediction"].exposed) for r in rows]
    blocked = [_ms(r["blocked_s"]) for r in rows]
    not_blocked = [_ms(r["measured_s"] - r["blocked_s"]) for r in rows]
    terms = ["<br>".join(f"{k}: {_ms(v):.2f} ms" for k, v in r["prediction"].terms.items())
             or "none" for r in rows]
    fig = go.Figure()
    fig.add_bar(x=x, y=compute, name=PARTS["compute"], offsetgroup="predicted",
                marker_color=RUN_COLORS[0], opacity=0.55,
                hovertemplate="%{x} compute %{y:.1f} ms<extra>predicted</extra>")
    fig.add_bar(x=x, y=exposed, base=compute, name=PARTS["exposed"], offsetgroup="predicted",
                marker_color=RUN_COLORS[1], opacity=0.55, customdata=terms,
                hovertemplate="%{x} exposed %{y:.2f} ms<br>%{customdata}<extra>predicted"
                              "</extra>")
    fig.add_bar(x=x, y=not_blocked, name=PARTS["not_blocked"], offsetgroup="measured",
                marker_color=RUN_COLORS[0],
                hovertemplate="%{x} not blocked %{y:.1f} ms<extra>measured</extra>")
    fig.add_bar(x=x, y=blocked, base=not_blocked, name=PARTS["blocked"],
                offsetgroup="measured", marker_color=RUN_COLORS[1],
                text=[f"{r['ratio']:.2f}×" for r in rows], textposition="outside",
                hovertemplate="%{x} blocked %{y:.2f} ms<extra>measured</extra>")
    fig.add_scatter(x=x, y=[_ms(r["cores_bound_s"]) for r in rows], mode="markers",
                    name="cores bound: N × CPU seconds a step / cores",
                    marker=dict(symbol="line-ew-open", size=28, color="black",
                                line=dict(width=2)))
    world = result.get("world", "")
    fig.update_layout(
        template="plotly_white", barmode="group", height=440, width=860,
        title=title or f"How far from the limit: {world} ranks, {result['cores']} cores "
                       "(left bar predicted, right bar measured; label: measured / predicted)",
        xaxis_title="strategy", yaxis_title="ms per step (median)",
        legend=dict(orientation="h", y=-0.2))
    return fig


def limit_rows(result: dict) -> list[list]:
    """Per strategy: measured, predicted, ratio, the gap's parts, the backend's CPU, why."""
    out = []
    for r in result["rows"]:
        p = r["prediction"]
        out.append([r["strategy"], f"{_ms(r['measured_s']):.1f}", f"{_ms(p.total):.1f}",
                    f"{r['ratio']:.2f}", f"{_ms(r['blocked_s']):.1f} / {_ms(p.exposed):.1f}",
                    f"{_ms(r['waits_beyond_s']):+.1f}", f"{_ms(r['compute_slower_s']):+.1f}",
                    f"{_ms(r['backend_cpu_s']):.1f}", f"{_ms(r['cores_bound_s']):.1f}",
                    r["why"]])
    return out


LIMIT_HEADER = ["strategy", "measured (ms)", "predicted (ms)", "measured / predicted",
                "exposed: measured / modelled (ms)", "waits beyond α-β (ms)",
                "compute slower than alone (ms)", "backend threads' CPU (ms)",
                "cores bound (ms)", "why"]


def term_rows(result: dict) -> list[list]:
    """Per strategy, the exposed communication's terms by name (what the overlap rule says
    cannot hide) and the collectives' modelled seconds by kind."""
    return [[r["strategy"],
             "; ".join(f"{k} {_ms(v):.2f}" for k, v in r["prediction"].terms.items()) or "none",
             "; ".join(f"{k} {_ms(v):.2f}" for k, v in r["prediction"].comm.items()) or "none"]
            for r in result["rows"]]


TERM_HEADER = ["strategy", "exposed terms (ms)", "all its communication by kind, α-β (ms)"]


# -- how cost grows with the work ---------------------------------------------------------------
def growth_curves(points: list) -> dict:
    """The points split into the two curves: over ranks (at the most common width) and over
    width (at 2 ranks), each sorted along its axis."""
    widths = [p["n_embd"] for p in points]
    width = max(set(widths), key=widths.count)
    return {"ranks": sorted((p for p in points if p["n_embd"] == width),
                            key=lambda p: p["world"]),
            "width": sorted((p for p in points if p["world"] == 2), key=lambda p: p["n_embd"])}


def growth_summary(points: list) -> dict:
    """Per curve: the worst |measured / predicted - 1| and |measured / serial - 1|, and the
    first point whose modelled communication exceeds its compute (None: none does)."""
    out = {}
    for name, curve in growth_curves(points).items():
        cross = next((p for p in curve
                      if p["prediction"].comm_total > p["prediction"].compute.total), None)
        out[name] = {
            "worst": max(abs(p["measured_s"] / p["prediction"].total - 1) for p in curve),
            "worst_serial": max(abs(p["measured_s"] / p["serial_s"] - 1) for p in curve),
            "crossover": cross}
    return out


def growth_figure(points: list) -> go.Figure:
    curves = growth_curves(points)
    width = curves["ranks"][0]["n_embd"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        f"over ranks (n_embd {width})", "over width (2 ranks)"))
    lines = {"measured": (lambda p: p["measured_s"], "solid", "black"),
             "predicted: compute + exposed": (lambda p: p["prediction"].total, "dash", "black"),
             "serial: compute + all communication": (lambda p: p["serial_s"], "dot", "gray"),
             "modelled compute": (lambda p: p["prediction"].compute.total, "solid",
                                  RUN_COLORS[0]),
             "modelled communication (all)": (lambda p: p["prediction"].comm_total, "solid",
                                              RUN_COLORS[1])}
    for col, (name, curve) in enumerate(curves.items(), start=1):
        x = [p["world"] if name == "ranks" else p["n_embd"] for p in curve]
        hover = [f"{p['world']} rank(s), n_embd {p['n_embd']}<br>bytes sent per rank per "
                 f"step {p['sent_bytes']:,.0f} (ring 2(N-1)/N·4·params: "
                 f"{p['ring_bytes']:,.0f})" for p in curve]
        for label, (value, dash, color) in lines.items():
            fig.add_scatter(x=x, y=[_ms(value(p)) for p in curve], name=label,
                            legendgroup=label, showlegend=col == 1, mode="lines+markers",
                            line=dict(dash=dash, color=color), customdata=hover,
                            hovertemplate="%{customdata}<br>" + label
                                          + " %{y:.1f} ms<extra></extra>", row=1, col=col)
        fig.update_xaxes(title_text="ranks" if name == "ranks" else "n_embd",
                         tickvals=x, row=1, col=col)
    fig.update_yaxes(title_text="ms per step (median)", row=1, col=1)
    fig.update_layout(template="plotly_white", height=440, width=980,
                      title="How cost grows with the work: ddp, measured against the model",
                      legend=dict(orientation="h", y=-0.22))
    return fig


def ratio_samples(row: dict) -> list[float]:
    """A strategy's steps, each over its predicted step (the ratio the limit table gives at the
    median): the repeats a timed claim reads (distlab.lab.timed)."""
    return [e["step_s"] / row["prediction"].total for e in row["steps"]]
