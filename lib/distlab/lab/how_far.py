"""How far from the limit: 13_search_and_time's figure and tables for each strategy's measured
step beside what this machine allows (distlab.studies.step_limit measures the parts,
distlab.theory.step_time adds them up).

    limit_figure(result)     per strategy two bars: predicted (compute + exposed communication)
                             and measured (time not blocked + time blocked in waits), with the
                             cores bound as a tick
    limit_rows(result)       the table under it: ratio, the gap's two measured parts, the why
    term_rows(result)        the model's exposed terms by name, per strategy
"""

from __future__ import annotations

import plotly.graph_objects as go

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
