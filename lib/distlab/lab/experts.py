"""The experts notebook's companion (15): MoE runs, the load per expert, the capacity trade,
and its explorer.

Runs are the `ep` strategy (distlab.parallel.expert.strategy) through launch_together; each
step event carries, per MoE block, the tokens routed to each expert on that rank, the
choices dropped over capacity and the balance loss (ExpertParallelDP.step_info).
"""

from __future__ import annotations

import html
import threading
import time

import ipywidgets as W
import plotly.graph_objects as go
import torch

from distlab.config import RunConfig
from distlab.lab.panel import Explorer
from distlab.lab.runs import launch_together
from distlab.models.moe import max_violation

LEGEND = dict(orientation="h", yanchor="top", y=-0.25, x=0)


def flops_per_token(d: int, hidden: int, n_experts: int, top_k: int, tokens: int = 256,
                    n_shared: int = 0) -> float:
    """Forward FLOPs per token of one MoE layer in one process, counted by PyTorch's
    FlopCounterMode (matmuls), dropless (every choice reaches its expert)."""
    from torch.utils.flop_counter import FlopCounterMode

    from distlab.models.moe import MoE
    torch.manual_seed(0)
    moe = MoE(d, hidden, n_experts, top_k=top_k, capacity_factor=0, n_shared=n_shared)
    x = torch.randn(tokens, d)
    with FlopCounterMode(display=False) as counter:
        moe(x)
    return counter.get_total_flops() / tokens


def layouts_table(d: int, layouts: dict) -> list[float]:
    """One MoE layer per layout, {name: (experts, top_k, shared, expert width)}: parameters
    (theory.moe_params), those a token meets and forward FLOPs per token (theory.moe_active)
    beside the FLOPs FlopCounterMode counts, and the expert combinations C(E, k), as a table.
    Returns the measured FLOPs per token, in order."""
    import math

    from distlab.lab.common import table
    from distlab.theory.context_and_experts import moe_active, moe_params
    rows, measured = [], []
    for name, (e, k, s, h) in layouts.items():
        active, flops = moe_active(d, h, e, k, s), flops_per_token(d, h, e, k, n_shared=s)
        measured.append(flops)
        rows.append([name, f"{moe_params(d, h, e, s)['total']:,}", f"{active['params']:,}",
                     f"{flops:,.0f}", f"{active['forward_flops']:,}", f"{math.comb(e, k):,}"])
    table(["layer", "parameters", "active per token (modelled)",
           "forward FLOPs per token (measured)", "modelled", "expert combinations C(E, k)"],
          rows)
    return measured


def global_loads(run) -> dict[int, list[list[int]]]:
    """{step: per block, the tokens routed to each expert, summed over the ranks}."""
    out: dict[int, list[list[int]]] = {}
    for e in run.history("step"):
        for b, m in enumerate(e.get("moe") or []):
            rows = out.setdefault(e["step"], [])
            if len(rows) <= b:
                rows.append([0] * len(m["tokens_per_expert"]))
            rows[b] = [a + t for a, t in zip(rows[b], m["tokens_per_expert"])]
    return dict(sorted(out.items()))


def expert_load(run, block: int = 0) -> list[list[int]]:
    """Per step: tokens routed to each expert in `block`, summed over the ranks."""
    return [blocks[block] for blocks in global_loads(run).values()]


def dropped_fraction(run) -> float:
    """Choices dropped over capacity, over all blocks, ranks and steps, as a fraction of the
    choices made (tokens x top_k)."""
    dropped = made = 0
    for e in run.history("step"):
        for m in e.get("moe") or []:
            dropped += m["dropped"]
            made += sum(m["tokens_per_expert"])
    return dropped / made if made else 0.0


def dispatch_bytes(run) -> float:
    """Mean bytes a rank sent per step in the dispatch all-to-all (forward)."""
    sent = [e["comm"].get("ep.dispatch", {}).get("bytes_sent", 0) for e in run.history("step")]
    return sum(sent) / len(sent) if sent else 0.0


def rank_load_figure(events: list[dict], block: int = 0, fig=None, title: str = ""):
    """Tokens routed to each expert at one step, stacked by rank: `events` are that step's
    events, one per rank."""
    fig = fig if fig is not None else go.Figure()
    fig.data = ()
    for e in sorted(events, key=lambda e: e["rank"]):
        load = e["moe"][block]["tokens_per_expert"]
        fig.add_bar(x=[f"expert {i}" for i in range(len(load))], y=load,
                    name=f"rank {e['rank']}'s tokens")
    fig.update_layout(barmode="stack", height=330, template="plotly_white", legend=LEGEND,
                      title=title or f"block {block}: tokens per expert",
                      yaxis_title="tokens routed")
    return fig


def last_step_events(run) -> list[dict]:
    """The events of the last step every rank has logged (with routing stats)."""
    steps = [e for e in run.history("step") if e.get("moe")]
    if not steps:
        return []
    done = min(max(e["step"] for e in steps if e["rank"] == r)
               for r in {e["rank"] for e in steps})
    return [e for e in steps if e["step"] == done]


def capacity_figure(rows: list[dict]):
    """Dropped choices and dispatch bytes against the capacity factor."""
    fig = go.Figure()
    cfs = [r["capacity_factor"] for r in rows]
    fig.add_scatter(x=cfs, y=[100 * r["dropped"] for r in rows], mode="lines+markers",
                    name="choices dropped (%)")
    fig.add_scatter(x=cfs, y=[r["dispatch_bytes"] / 1024 for r in rows], mode="lines+markers",
                    name="dispatch sent per rank per step (KiB)", yaxis="y2")
    fig.update_layout(height=330, template="plotly_white", legend=LEGEND,
                      title="what the capacity factor trades", xaxis_title="capacity factor",
                      yaxis=dict(title="dropped (%)", rangemode="tozero"),
                      # its own round ticks: synced to the left axis's grid they read 4.29 /
                      # 5.92 / 7.54 KiB
                      yaxis2=dict(title="KiB", overlaying="y", side="right", tickmode="auto",
                                  showgrid=False, rangemode="tozero"))
    return fig


class ExpertsExplorer(Explorer):
    """Top-k, the capacity (or none: dropless), the balancing (Switch's loss, DeepSeek-V3's
    bias, or nothing) and a shared expert; Run trains the MoE GPT under `ep` and draws the
    tokens each expert got from each rank, live, step by step."""

    LIVE_S = 0.5  # how often the live bars are redrawn while the run goes
    # the balancing menu: label -> (aux_loss_coef, expert_bias_rate)
    BALANCE = {"Switch's loss (0.01)": (0.01, 0.0), "bias (1e-3, no loss)": (0.0, 1e-3),
               "none": (0.0, 0.0)}

    def __init__(self, base: RunConfig):
        super().__init__()
        self.base = base
        style = {"description_width": "initial"}
        self.top_k = W.Dropdown(options=[1, 2], value=base.top_k, description="top-k",
                                style=style, layout=W.Layout(width="110px"))
        self.cf = W.Dropdown(options=[("dropless", 0.0)] + [(str(v), v) for v in
                                                            (0.5, 1.0, 1.25, 2.0)],
                             value=base.capacity_factor, description="capacity factor",
                             style=style, layout=W.Layout(width="210px"))
        self.balance = W.Dropdown(options=list(self.BALANCE), description="balance",
                                  style=style, layout=W.Layout(width="260px"))
        self.shared = W.Dropdown(options=[0, 1], value=base.n_shared_experts,
                                 description="shared experts", style=style,
                                 layout=W.Layout(width="160px"))
        self.fig = go.Figure()
        self.fig.update_layout(height=330, template="plotly_white", legend=LEGEND)
        self.last: dict | None = None
        self.widget = self._box([W.HBox([self.top_k, self.cf, self.balance, self.shared]),
                                 W.HBox([self.button, self.stop_button]), self.status,
                                 self._view_of(self.fig)])

    def _clear(self):
        super()._clear()
        with self.fig.batch_update():
            self.fig.data = ()
            self.fig.layout.title.text = "running: the load comes at the end"

    def _run(self, **values) -> dict:
        """Set the knobs (top_k=, capacity_factor=, balance= a BALANCE label,
        n_shared_experts=), train, redraw."""
        for key, w in (("top_k", self.top_k), ("capacity_factor", self.cf),
                       ("balance", self.balance), ("n_shared_experts", self.shared)):
            if key in values:
                w.value = values[key]
        coef, rate = self.BALANCE[self.balance.value]
        cfg = self.base.replace(top_k=self.top_k.value, capacity_factor=self.cf.value,
                                aux_loss_coef=coef, expert_bias_rate=rate,
                                n_shared_experts=self.shared.value)
        capacity = (f"capacity factor {cfg.capacity_factor}" if cfg.capacity_factor
                    else "dropless")
        self._announce(f"training ep: top-{cfg.top_k}, {capacity}, balance: "
                       f"{self.balance.value}, {cfg.n_shared_experts} shared ...")
        run = launch_together({"explorer": cfg}, name="ep-explorer",
                              on_start=self._live)["explorer"]
        self._draw(run, "done")
        last = expert_load(run)[-1]
        self._say(html.escape(f"last step, block 0: tokens per expert {last} (MaxVio "
                              f"{max_violation(last):.2f}); dropped "
                              f"{100 * dropped_fraction(run):.1f}% of the choices; final loss "
                              f"{run.losses()[-1]:.3f}"))
        self.last = {"config": cfg, "run": run}
        return self.last

    def _live(self, run):
        """on_start: the Explorer's bookkeeping, then a thread redrawing the bars until the
        run ends."""
        self._started(run)

        def redraw():
            while not run.done:
                self._draw(run, "live")
                time.sleep(self.LIVE_S)

        threading.Thread(target=redraw, daemon=True, name="distlab-ep-live").start()

    def _draw(self, run, when: str):
        events = last_step_events(run)
        if events:
            with self.fig.batch_update():
                rank_load_figure(events, fig=self.fig,
                                 title=f"{when}, step {events[0]['step']}: block 0's tokens per "
                                       "expert, by rank")
