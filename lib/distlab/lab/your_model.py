"""10 · your_model: a model the notebook defines itself, trained by distlab's loop under several
strategies (RunConfig(model="file.py:make_model", data="file.py:make_data"), distlab.models.factory),
each set beside one process training the same global batch.

    single, runs = compare(base, {"ddp": dict(strategy="ddp", world_size=2), ...})
    loss_figure(single, runs); rows(single, runs)
"""

from __future__ import annotations

import plotly.graph_objects as go

from distlab.config import RunConfig
from distlab.lab.common import RUN_COLORS, fmt_bytes
from distlab.lab.runs import launch_together, max_step_loss_diff, worst_param_diff
from distlab.caller.run import Run
from distlab.step_event import comm


def compare(base: RunConfig, variants: dict[str, dict]) -> tuple[Run, dict[str, Run]]:
    """`single` (base, one process), then every variant (base with its changes) in one launch:
    they must all need the same number of processes. Returns (single, {label: Run})."""
    single = launch_together({"single": base.replace(strategy="single", world_size=1)},
                             name="your-model-single")["single"]
    runs = launch_together({label: base.replace(**changes) for label, changes in variants.items()},
                           name="your-model")
    return single, runs


def last_step(run: Run) -> dict:
    """Rank 0's last step event: its bytes are a step's in the steady state."""
    return max(run.history("step", rank=0), key=lambda e: e["step"])


def step_bytes(run: Run, field: str = "bytes_sent") -> int:
    """Rank 0's bytes per step, summed over its collectives (booked by distlab.comm; torch's
    own collectives, as in fsdp-torch, are not booked), from its last step."""
    return sum(v.get(field, 0) or 0 for v in comm(last_step(run)).values())


def all_gather_bytes(run: Run) -> int:
    """Bytes rank 0's all-gathers sent in its last step (ZeRO-3 gathering the parameters): what
    a param_dtype policy shrinks, as it casts the shards before gathering them."""
    return comm(last_step(run))["all_gather"]["bytes_sent"]


def worst_diffs(single: Run, runs: dict[str, Run]) -> dict[str, float]:
    """{label: largest parameter difference from single over every rank}."""
    return {label: max(worst_param_diff(s, single.states[0]) for s in run.states)
            for label, run in runs.items()}


def rows(single: Run, runs: dict[str, Run]) -> list[list]:
    """Per variant: its strategy, the largest per-step loss difference and the largest parameter
    difference from `single` (every rank's full parameters), rank 0's bytes per step."""
    worst = worst_diffs(single, runs)
    return [[label, run.cfg.strategy,
             f"{max_step_loss_diff(run.losses(), single.losses()):.1e}", f"{worst[label]:.1e}",
             fmt_bytes(step_bytes(run))] for label, run in runs.items()]


def loss_figure(single: Run, runs: dict[str, Run]) -> go.Figure:
    """Every variant's loss per step over single's (drawn wide and grey, underneath)."""
    fig = go.Figure()
    fig.add_scatter(y=single.losses(), name="single (one process)", mode="lines",
                    line=dict(color="#bbbbbb", width=8))
    for i, (label, run) in enumerate(runs.items()):
        fig.add_scatter(y=run.losses(), name=label, mode="lines",
                        line=dict(color=RUN_COLORS[i % len(RUN_COLORS)], width=2,
                                  dash="dot" if i % 2 else "solid"))
    fig.update_layout(height=360, margin=dict(l=50, r=20, t=40, b=40),
                      title="your model: loss per step, each strategy over one process",
                      xaxis_title="step", yaxis_title="loss (cross-entropy)")
    return fig
