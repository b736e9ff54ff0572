"""The long-context notebook's companion (14): runs, tables, figures and its explorer.

The measurements are distlab.studies.long_context's rank functions; the formulas are
distlab.theory.context_and_experts and distlab.parallel.context.layout's.
"""

from __future__ import annotations

import html

import ipywidgets as W
import plotly.graph_objects as go

from distlab import run_ranks
from distlab.lab.panel import Explorer
from distlab.parallel.context import layout as L
from distlab.studies.long_context import METHODS, activation_bytes, attention_pass, work_table

LEGEND = dict(orientation="h", yanchor="top", y=-0.25, x=0)
COLORS = {("ring", "contiguous"): "#d62728", ("ring", "zigzag"): "#1f77b4",
          ("ulysses", "contiguous"): "#2ca02c"}


def split_rows(T: int, world: int) -> list[list]:
    """Per layout and rank: the positions it holds and the chunk pairs it computes."""
    rows = []
    for layout in L.LAYOUTS:
        work = L.causal_work(world, layout)
        for r in range(world):
            pos = L.positions(T, r, world, layout).tolist()
            runs, start = [], pos[0]
            for a, b in zip(pos, pos[1:] + [None]):
                if b != a + 1:
                    runs.append(f"{start}–{a}")
                    start = b
            rows.append([layout, r, ", ".join(runs), work[r]])
    return rows


def measure_attention(world: int, T: int, repeats: int, on_start=None) -> list[dict]:
    """attention_pass on `world` ranks (B=1, H=4, D=32): work_table's rows."""
    return work_table(run_ranks(attention_pass, world, 1, 4, T, 32, repeats, timeout_s=600,
                                on_start=on_start))


def work_figure(rows: list[dict], fig=None, title: str = ""):
    """Compute seconds per rank, one group of bars per method and layout; the gap up to the
    slowest rank of a method is the time that rank's peers wait for it."""
    fig = fig if fig is not None else go.Figure()
    fig.data = ()
    for row in rows:
        key = (row["method"], row["layout"])
        secs = [s * 1e3 for s in row["compute s per rank"]]
        fig.add_bar(x=[f"rank {r}" for r in range(len(secs))], y=secs,
                    name=f"{row['method']}, {row['layout']}", marker_color=COLORS[key],
                    hovertemplate="%{y:.1f} ms<extra>%{fullData.name}</extra>")
    fig.update_layout(barmode="group", height=330, template="plotly_white", legend=LEGEND,
                      title=title or "attention's work per rank (CPU ms, forward + backward)",
                      yaxis_title="CPU ms of the rank's thread")
    return fig


def memory_by_length(seq_lens, worlds=(1, 2, 4)) -> dict:
    """{world: activation_bytes' result}: saved-for-backward bytes per rank per length."""
    return {w: run_ranks(activation_bytes, w, tuple(seq_lens), timeout_s=300)[0] for w in worlds}


def memory_figure(per_world: dict, seq_lens):
    """Measured activations per rank against T for each cp size, the modelled 1/N of one rank's
    dashed beside them, and the parameters (flat: not split)."""
    from distlab.theory.context_and_experts import cp_activation_fraction
    fig = go.Figure()
    one = per_world[1]
    for w, res in per_world.items():
        fig.add_scatter(x=list(seq_lens), y=[res[T] / 2**20 for T in seq_lens],
                        mode="lines+markers", name=f"activations, {w} rank(s), measured")
        if w > 1:
            fig.add_scatter(x=list(seq_lens),
                            y=[one[T] * cp_activation_fraction(w) / 2**20 for T in seq_lens],
                            mode="lines", line=dict(dash="dash"),
                            name=f"{w} ranks, modelled: 1/{w} of one rank's")
    fig.add_scatter(x=list(seq_lens), y=[one["params"] / 2**20] * len(seq_lens), mode="lines",
                    line=dict(color="black", dash="dot"), name="parameters, every rank")
    fig.update_layout(height=360, template="plotly_white", legend=LEGEND,
                      title="memory per rank against sequence length",
                      xaxis_title="sequence length T (tokens)", yaxis_title="MiB")
    return fig


def at_scale(seqs=(131072, 262144), gpus: int = 64, global_batch: int = 8,
             cps=(1, 2, 4, 8, 16)) -> tuple[list[list], dict]:
    """The planner (distlab.theory.plan, modelled) on an 8B Llama-shaped model (32 layers,
    width 4096, 32 heads, vocabulary 128256) on `gpus` A100s of 80 GB: per sequence length,
    the fastest layout that fits without and with context parallelism. Returns the table's
    rows and {(seq, "3D only" | "with cp"): whether anything fits}."""
    from distlab.theory.plan import Cluster, Model, best
    from distlab.units import GB
    rows, fits = [], {}
    for seq in seqs:
        llama = Model(32, 4096, 32, seq=seq, vocab=128256, n_params=8.0e9)
        for name, tried in (("3D only", (1,)), ("with cp", cps)):
            r = best(llama, Cluster(gpus=gpus), global_batch=global_batch, cps=tried)
            fits[seq, name] = r is not None
            rows.append([f"{seq // 1024}k", name] + (
                ["nothing fits", "", "", ""] if r is None else
                [f"dp {r.dp} x tp {r.tp} x pp {r.pp} x cp {r.cp}, ZeRO-{r.zero}, {r.recompute}",
                 f"{r.memory / GB:.1f}", f"{r.step_s:.1f}", f"{r.cp_comm_s:.2f}"]))
    return rows, fits


class LongContextExplorer(Explorer):
    """Ranks and sequence length; Run measures ring attention (both splits) and Ulysses on
    real ranks and redraws the work per rank."""

    def __init__(self, worlds=(2, 4), lengths=(512, 1024, 2048, 4096), repeats: int = 1):
        super().__init__()
        style = {"description_width": "initial"}
        self.world = W.Dropdown(options=list(worlds), value=worlds[0], description="ranks",
                                style=style)
        self.length = W.Dropdown(options=list(lengths), value=lengths[0],
                                 description="sequence length", style=style)
        self.repeats = repeats
        self.fig = go.Figure()
        self.fig.update_layout(height=330, template="plotly_white", legend=LEGEND)
        self.last: list[dict] | None = None
        self.widget = self._box([W.HBox([self.world, self.length, self.button,
                                          self.stop_button]),
                                 self.status, self._view_of(self.fig)])

    def _clear(self):
        super()._clear()
        with self.fig.batch_update():
            self.fig.data = ()
            self.fig.layout.title.text = "running: the bars come at the end"

    def _run(self, **values) -> list[dict]:
        """Set the knobs (world=, length=), measure, redraw; returns work_table's rows."""
        if "world" in values:
            self.world.value = values["world"]
        if "length" in values:
            self.length.value = values["length"]
        N, T = self.world.value, self.length.value
        L.check_length(T, N, "zigzag")
        self._announce(f"running ring attention and Ulysses on {N} ranks, T={T} ...")
        rows = measure_attention(N, T, self.repeats, on_start=self._started)
        with self.fig.batch_update():
            work_figure(rows, fig=self.fig, title=f"{N} ranks, T={T}: work per rank")
        ratios = {f"{r['method']}, {r['layout']}": r["slowest / mean (measured)"] for r in rows}
        self._say("slowest rank / mean: " + html.escape(", ".join(
            f"{k} {v:.2f}" for k, v in ratios.items())) + html.escape(
            f" (formula by chunk pairs: contiguous {2 * N / (N + 1):.2f}, zig-zag 1.00)"))
        self.last = rows
        return rows


__all__ = ["METHODS", "LongContextExplorer", "at_scale", "measure_attention", "memory_by_length",
           "memory_figure", "split_rows", "work_figure"]
