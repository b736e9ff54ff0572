"""03's FP8 section: the formats, the outlier sweep's figure, and an explorer that shows where
the values beside an outlier land on e4m3's scale (distlab.studies.fp8_scaling measures;
distlab.fp8 is the arithmetic)."""

from __future__ import annotations

import html
import math

import ipywidgets as W
import plotly.graph_objects as go
import torch

from distlab import fp8
from distlab.lab.explorer import Explorer
from distlab.studies.fp8_scaling import with_outliers
from distlab.studies.fp8_training import BASE, gathers, precisions

LEGEND = dict(orientation="h", yanchor="top", y=-0.25, x=0)
SCHEME_COLORS = {"tensorwise": "#c2255c", "rowwise": "#e8590c", "block1x128": "#2b8a3e",
                 "block128x128": "#1f5fbf"}


def formats_rows() -> list[list]:
    """e4m3 and e5m2 beside fp16 and bf16: bits, eps, smallest normal, smallest subnormal,
    max, from the dtypes (distlab.fp8.format_facts)."""
    rows = []
    for name, dt in (("fp8 e4m3", fp8.E4M3), ("fp8 e5m2", fp8.E5M2), ("fp16", torch.float16),
                     ("bf16", torch.bfloat16)):
        f = fp8.format_facts(dt)
        rows.append([name, f["bits"], f"{f['eps']:.3g}", f"{f['smallest_normal']:.3g}",
                     f"{f['smallest_subnormal']:.3g}", f"{f['max']:.4g}"])
    return rows


def sweep_figure(rows: list[dict]):
    """Per scheme, against the outlier size (log): the relative error of the other values
    (left) and the share of them flushed to zero (right, dashed)."""
    fig = go.Figure()
    for scheme, color in SCHEME_COLORS.items():
        mine = [r for r in rows if r["scheme"] == scheme]
        sizes = [r["size"] for r in mine]
        fig.add_scatter(x=sizes, y=[r["rel_error"] for r in mine], mode="lines+markers",
                        name=f"{scheme}: error", line=dict(color=color))
        fig.add_scatter(x=sizes, y=[100 * r["flushed"] for r in mine], mode="lines+markers",
                        name=f"{scheme}: flushed (%)", yaxis="y2",
                        line=dict(color=color, dash="dash"))
    fig.update_layout(height=380, template="plotly_white", legend=LEGEND,
                      title="e4m3: what an outlier channel does to the other values",
                      xaxis=dict(title="outlier size (x the channel's own values)",
                                 type="log"),
                      yaxis=dict(title="relative error of the others", rangemode="tozero"),
                      # its own round ticks, not the left axis's grid (13.2, 26.4, ...)
                      yaxis2=dict(title="flushed to zero (%)", overlaying="y", side="right",
                                  rangemode="tozero", showgrid=False, tickmode="auto"))
    return fig


def scaled_histogram(x: torch.Tensor, keep: torch.Tensor, scheme: str, fig=None):
    """log2 |value x its scale| of the values beside the outliers, against e4m3's smallest
    subnormal, smallest normal and max: left of the normal line a value has fewer mantissa
    bits, left of half the smallest subnormal it is zero."""
    fig = fig if fig is not None else go.Figure()
    _, scale = fp8.quantize(x, scheme)
    sel = keep.expand_as(x)
    v = (x[sel] * scale[sel]).abs()
    v = v[v > 0]
    facts = fp8.format_facts(fp8.E4M3)
    fig.data = ()
    fig.add_histogram(x=torch.log2(v).tolist(), nbinsx=80, name="the other values, scaled",
                      marker_color=SCHEME_COLORS[scheme])
    lines = ((facts["smallest_subnormal"] / 2, "zero below ", "right"),
             (facts["smallest_normal"], " subnormal below", "left"),
             (facts["max"], "max ", "right"))
    fig.layout.shapes = [dict(type="line", xref="x", yref="paper", x0=math.log2(v),
                              x1=math.log2(v), y0=0, y1=1, line=dict(color="#555", dash="dot"))
                         for v, _, _ in lines]
    fig.layout.annotations = [dict(xref="x", yref="paper", x=math.log2(v), y=1.02, text=label,
                                   xanchor=side, showarrow=False, font=dict(size=11))
                              for v, label, side in lines]
    fig.update_layout(height=330, template="plotly_white", showlegend=False,
                      xaxis_title="log2 |value x scale|", yaxis_title="values",
                      title=f"{scheme}: where the values beside the outliers land in e4m3")
    return fig


class FP8Explorer(Explorer):
    """The scheme and the outlier size; Run scales one activation matrix of the GPT (its
    first MLP's input, 4 channels made outliers) and draws where the other values land."""

    SIZES = (1, 10, 100, 1000, 10_000, 100_000)

    def __init__(self, activation: torch.Tensor):
        super().__init__()
        self.activation = activation
        style = {"description_width": "initial"}
        self.scheme = W.Dropdown(options=list(fp8.SCHEMES), description="scaling", style=style)
        self.size = W.Dropdown(options=[(f"{s:g}x", s) for s in self.SIZES], value=1000,
                               description="outlier size", style=style)
        self.fig = go.Figure()
        self.fig.update_layout(height=330, template="plotly_white")
        self.last: dict | None = None
        self.widget = self._box([W.HBox([self.scheme, self.size, self.button,
                                         self.stop_button]), self.status,
                                 self._view_of(self.fig)])

    def _clear(self):
        super()._clear()
        with self.fig.batch_update():
            self.fig.data = ()

    def _run(self, **values) -> dict:
        """Set the knobs (scheme=, size=), scale, redraw; returns error_stats' figures."""
        for key, w in (("scheme", self.scheme), ("size", self.size)):
            if key in values:
                w.value = values[key]
        self._announce(f"scaling with {self.scheme.value}, outliers x{self.size.value:g} ...")
        x, keep = with_outliers(self.activation, self.size.value)
        stats = fp8.error_stats(x, self.scheme.value, where=keep)
        with self.fig.batch_update():
            scaled_histogram(x, keep, self.scheme.value, fig=self.fig)
        self._say(html.escape(
            f"{self.scheme.value}, outliers x{self.size.value:g}: the other values' relative "
            f"error {stats['rel_error']:.4f}; flushed to zero {100 * stats['flushed']:.2f}%, "
            f"subnormal {100 * stats['subnormal']:.1f}%; {stats['scales']} scales"))
        self.last = stats
        return stats


PRECISION_COLORS = {"fp32": "#495057", "bf16": "#1f5fbf", "fp8 tensorwise": "#c2255c",
                    "fp8 rowwise": "#e8590c", "fp8 blockwise": "#2b8a3e"}


def training_figure(losses: dict[str, list[float]], ref: str = "bf16"):
    """Each precision's loss minus `ref`'s, step by step: the curves themselves lie on top of
    each other at this scale, their differences show how far apart they run."""
    fig = go.Figure()
    base = losses[ref]
    for name, ls in losses.items():
        fig.add_scatter(x=list(range(len(ls))), y=[a - b for a, b in zip(ls, base)],
                        mode="lines", name=name, line=dict(color=PRECISION_COLORS.get(name),
                                                           dash="dot" if name == ref else None))
    fig.update_layout(height=360, template="plotly_white", legend=LEGEND,
                      title=f"the same GPT and data in each precision (ddp, 2 ranks): loss minus "
                            f"{ref}'s, per step",
                      xaxis=dict(title="step"), yaxis=dict(title=f"loss - {ref}'s loss"))
    return fig


def run_precisions(base=BASE, name: str = "fp8-training", on_start=None,
                   with_gathers: bool = False):
    """Every precision of distlab.studies.fp8_training.precisions(base) trained in one
    launch, and with_gathers, zero3's three all-gathers of the FP8 weights after them:
    {name: Run}."""
    from distlab.lab.runs import launch_together
    cfgs = {**precisions(base), **(gathers(base) if with_gathers else {})}
    return launch_together(cfgs, name=name, on_start=on_start)


def gather_bytes(runs: dict) -> dict[str, tuple[float, float]]:
    """{gather: (the FP8 Linears' all-gather bytes, the amaxes' bytes)} per step, rank 0's
    median over the steps, for the "zero3 ... gather" runs of run_precisions."""
    import statistics

    from distlab.lab.runs import bytes_per_step
    return {name: (statistics.median(bytes_per_step(run, "all_gather.fp8_linears")),
                   statistics.median(bytes_per_step(run, "fp8.amax")))
            for name, run in runs.items() if name.startswith("zero3")}
