"""Caller-side helpers of 12_out_of_memory (out of memory after hours of training): the batching
policies run side by side against one memory budget, the leak's variants, the allocator's
fragmentation report, and their figures and tables.

The training and the measuring are the runtime's (distlab.studies.memory_budget, distlab.studies.leak,
distlab.studies.fragmentation); this module picks the policies, runs them in turn in this process and
draws what they measured.

    batches = policy_batches(docs, rows=8, cap=72, max_tokens=576, steps=100)
    runs = run_policies(docs, batches, budget, model_cfg)       # {policy: BudgetRun}
    peak_figure(runs, budget).show(); table(*policy_table(runs))
    leaks = {k: leak_run(k, steps=8) for k in KEEPS}
    leak_figure(leaks).show(); table(*leak_table(leaks))
"""

from __future__ import annotations

import plotly.graph_objects as go

from distlab.studies.fragmentation import FragmentationReport
from distlab.lab.common import RUN_COLORS as COLORS
from distlab.lab.common import KiB, MiB
from distlab.studies.leak import growth_per_step
from distlab.studies.long_sequences import (
    Documents,
    capped,
    pad_to_longest,
    reserve_first,
    token_buckets,
    worst_shape,
)
from distlab.studies.memory_budget import BudgetRun, predicted_peak, train_under_budget

# How far the held-out loss must fall, as a share of the way from its start to the data's
# floor, for a run to count as learning. A run that dies at step 0 moves it ~1% (one SGD
# step); a run that trains normally covers most of the way (>70% in 100 steps here): a
# quarter separates the two with room on both sides.
LEARN_SHARE = 0.25


def policy_batches(docs: Documents, rows: int, cap: int, max_tokens: int, steps: int,
                   window: int = 256, seed: int = 0) -> dict[str, list]:
    """The policies compared, each `steps` batches long (a reserve_first probe comes on top):
    pad to longest; the same with one probe step at rows × max_len first; a length cap;
    token-budget buckets with their own worst shape probed first."""
    pad = pad_to_longest(docs, rows)[:steps]
    buckets = token_buckets(docs, max_tokens, window, seed)[:steps]
    if len(pad) < steps or len(buckets) < steps:
        raise ValueError(f"{docs.n} documents make fewer than {steps} batches: draw more")
    return {
        "pad to longest": pad,
        "pad + reserve at start": reserve_first(pad, *worst_shape("pad", docs, rows)),
        "length cap": capped(docs, rows, cap)[:steps],
        "buckets + reserve at start": reserve_first(
            buckets, *worst_shape("buckets", docs, rows, max_tokens=max_tokens)),
    }


def run_policies(docs: Documents, batches: dict[str, list], budget: int, model_cfg,
                 lr: float = 0.3, seed: int = 0) -> dict[str, BudgetRun]:
    """train_under_budget for each policy in turn (the same model init and seed), each run
    ending at its first step over the budget."""
    return {name: train_under_budget(docs, b, budget, model_cfg, lr=lr, seed=seed, name=name)
            for name, b in batches.items()}


def learned(run: BudgetRun, floor: float) -> bool:
    """Did the held-out loss fall LEARN_SHARE of the way from its start to the floor?"""
    return run.eval_after < run.eval_before - LEARN_SHARE * (run.eval_before - floor)


def oom_cause(run: BudgetRun, batches: list) -> dict | None:
    """What the first OOM's batch held: its shape, its longest row, the next longest and the
    median row (one long document among short ones, or a batch of long ones?)."""
    o = run.first_oom
    if o is None:
        return None
    lengths = sorted(batches[o.step].lengths, reverse=True)
    return {"step": o.step, "elapsed_s": o.elapsed_s, "rows": o.rows, "T": o.T,
            "peak": o.peak, "longest": lengths[0],
            "second": lengths[1] if len(lengths) > 1 else 0,
            "median": lengths[len(lengths) // 2], "probe": o.probe}


def longest_step(run: BudgetRun):
    """The step with the most padded tokens (ties: the first)."""
    return max(run.steps, key=lambda s: (s.padded_tokens, -s.step))


def steps_over_budget(run: BudgetRun) -> list:
    """The steps whose peak exceeded the budget (with stop_at_oom=False, every one that would
    have failed; otherwise at most the last)."""
    return [s for s in run.steps if s.oom]


def highest_peak(steps: list) -> int:
    """The highest peak among the steps (0 for none: a run that died at its first step)."""
    return max((s.peak for s in steps), default=0)


def tokens_in(batches: list) -> int:
    """The real (unpadded) tokens the batches hold: what a run of them all would train."""
    return sum(b.tokens for b in batches)


def formula_check(run: BudgetRun, model_cfg) -> dict:
    """The measured peak of the run's largest batch against memory_budget.predicted_peak."""
    s = longest_step(run)
    pred = predicted_peak(model_cfg, s.rows, s.T)
    return {"step": s.step, "rows": s.rows, "T": s.T, "measured": s.peak, "predicted": pred,
            "rel_err": abs(s.peak - pred) / pred}


def formula_checks(runs: dict[str, BudgetRun], model_cfg,
                   unbounded: BudgetRun | None = None) -> dict[str, dict]:
    """formula_check per run, and for the run that went on past the budget ("had it gone on")
    where there is one: its largest batches are the ones no other run reached."""
    checked = {**runs, **({"had it gone on": unbounded} if unbounded is not None else {})}
    return {name: formula_check(r, model_cfg) for name, r in checked.items()}


def largest_batch(checks: dict[str, dict]) -> dict:
    """The formula check of the largest batch (most padded tokens) of all the runs checked."""
    return max(checks.values(), key=lambda c: c["rows"] * c["T"])


# -- (a) figures and tables ---------------------------------------------------------------------
def lengths_figure(docs: Documents, fit: int, rows: int) -> go.Figure:
    """Documents per length (log scale), with the longest padded length that fits the budget
    and the modelled tail P(L > l) beside it."""
    import numpy as np
    counts = np.bincount(docs.lengths, minlength=docs.max_len + 1)
    ls = np.nonzero(counts)[0]
    fig = go.Figure()
    fig.add_bar(x=ls, y=counts[ls], name="documents", marker_color=COLORS[0])
    fig.add_vline(x=fit + 0.5, line=dict(color="#222222", dash="dash"),
                  annotation_text=f"{rows} rows fit up to {fit} tokens",
                  annotation_position="top right")
    fig.update_layout(title=f"document lengths: {docs.n:,} documents, Pareto α = {docs.alpha}, "
                            f"median {int(np.median(docs.lengths))}, longest {docs.lengths.max()}",
                      xaxis_title="tokens", yaxis_title="documents (log scale)",
                      yaxis_type="log", template="plotly_white", height=320, showlegend=False)
    return fig


def peak_figure(runs: dict[str, BudgetRun], budget: int,
                unbounded: BudgetRun | None = None) -> go.Figure:
    """Peak per step per policy (MiB), the budget as a line, each run's first OOM marked ✕
    (the run ends there), probe steps marked ◆. `unbounded`: a run that went on past the
    budget (stop_at_oom=False), drawn in grey: every step that would have failed."""
    fig = go.Figure()
    if unbounded is not None:
        over = steps_over_budget(unbounded)
        fig.add_scatter(x=[s.step for s in unbounded.steps],
                        y=[s.peak / MiB for s in unbounded.steps], mode="lines",
                        line=dict(color=COLORS[-1], width=1, dash="dot"),
                        name=f"{unbounded.name} (had it gone on)")
        fig.add_scatter(x=[s.step for s in over], y=[s.peak / MiB for s in over],
                        mode="markers", marker=dict(symbol="x-thin-open", size=9,
                                                    color=COLORS[-1]),
                        name="steps over the budget", hovertemplate="step %{x}: %{y:.3f} MiB")
    for i, (name, run) in enumerate(runs.items()):
        c = COLORS[i % len(COLORS)]
        fig.add_scatter(x=[s.step for s in run.steps], y=[s.peak / MiB for s in run.steps],
                        mode="lines", name=name,
                        # the first (plain) run wide: the next ones retrace it until they differ
                        line=dict(color=c, width=4 if i == 0 else 1.5),
                        legendgroup=name,
                        customdata=[[s.rows, s.T, s.elapsed_s] for s in run.steps],
                        hovertemplate="step %{x}: %{y:.3f} MiB, %{customdata[0]} rows × "
                                      "%{customdata[1]} tokens, %{customdata[2]:.2f} s in"
                                      "<extra>" + name + "</extra>")
        probes = [s for s in run.steps if s.probe]
        if probes:
            fig.add_scatter(x=[s.step for s in probes], y=[s.peak / MiB for s in probes],
                            mode="markers", marker=dict(symbol="diamond", size=10, color=c),
                            name=f"{name}: probe", legendgroup=name, showlegend=False)
        oom = run.first_oom
        if oom is not None:
            fig.add_scatter(x=[oom.step], y=[oom.peak / MiB], mode="markers+text",
                            marker=dict(symbol="x", size=13, color=c), legendgroup=name,
                            text=[f"OOM step {oom.step}"], textposition="top center",
                            name=f"{name}: first OOM", showlegend=False)
    fig.add_hline(y=budget / MiB, line=dict(color="#222222", dash="dash"),
                  annotation_text=f"device budget {budget / MiB:.2f} MiB",
                  annotation_position="bottom right")
    fig.update_layout(title="peak memory per step by batching policy (✕ first OOM: the run "
                            "ends; ◆ reserve-at-start probe)",
                      xaxis_title="step", yaxis_title="peak of aten allocations (MiB)",
                      template="plotly_white", height=420)
    fig.update_yaxes(rangemode="tozero")
    return fig


def policy_table(runs: dict[str, BudgetRun], floor: float) -> tuple[list, list]:
    """(header, rows) per policy: steps run, first OOM (step, time in, batch shape), max peak,
    tokens trained, padding share, held-out loss before → after, learns."""
    header = ["policy", "steps run", "first OOM: step (s in, rows × T)", "max peak MiB",
              "tokens trained", "padding", "held-out loss", "learns"]
    rows = []
    for name, r in runs.items():
        o = r.first_oom
        oom = "none" if o is None else f"{o.step} ({o.elapsed_s:.2f} s, {o.rows} × {o.T})"
        rows.append([name, len(r.survived), oom, f"{r.max_peak / MiB:.3f}",
                     f"{r.tokens_trained:,}", f"{r.padding_fraction:.0%}",
                     f"{r.eval_before:.2f} → {r.eval_after:.2f}",
                     "yes" if learned(r, floor) else "no"])
    return header, rows


def formula_table(checks: dict[str, dict]) -> tuple[list, list]:
    """(header, rows) per run: its largest batch, the measured peak beside predicted_peak's,
    their difference in bytes and relative to the formula."""
    header = ["run", "largest batch", "measured peak MiB", "formula MiB", "difference"]
    rows = [[n, f"{c['rows']} × {c['T']} (step {c['step']})", f"{c['measured'] / MiB:.4f}",
             f"{c['predicted'] / MiB:.4f}",
             f"{c['measured'] - c['predicted']:+,} B ({c['rel_err']:.4%})"]
            for n, c in checks.items()]
    return header, rows


# -- (b) the leak ---------------------------------------------------------------------------------
LEAK_LABELS = {"item": "history.append(loss.item())",
               "detach": "history.append(loss.detach())",
               "tensor": "backward(); history.append(loss)",
               "retain_graph": "backward(retain_graph=True); history.append(loss)",
               "eval_tensor": "eval loss without no_grad, kept"}


def leak_figure(leaks: dict[str, list[dict]]) -> go.Figure:
    """Live bytes at each step's end (MiB) for each way of keeping the loss."""
    fig = go.Figure()
    for i, (keep, rows) in enumerate(leaks.items()):
        fig.add_scatter(x=[r["step"] for r in rows], y=[r["live"] / MiB for r in rows],
                        mode="lines+markers", name=LEAK_LABELS.get(keep, keep),
                        line=dict(color=COLORS[i % len(COLORS)],
                                  dash="dot" if keep in ("tensor", "detach") else "solid"))
    fig.update_layout(title="live bytes at each step's end: what the history keeps",
                      xaxis_title="step", yaxis_title="live aten-allocated bytes (MiB)",
                      template="plotly_white", height=380)
    fig.update_yaxes(rangemode="tozero")
    return fig


def leak_summary(rows: list[dict]) -> dict:
    """Growth per step, the activations of the forward whose result was kept (bytes of the
    last step), their ratio, and graph nodes added per step."""
    growth = growth_per_step(rows)
    act = rows[-1]["activations"]
    nodes = (rows[-1]["graph_nodes"] - rows[0]["graph_nodes"]) / (len(rows) - 1)
    return {"growth": growth, "activations": act, "ratio": growth / act, "nodes": nodes}


def leak_table(leaks: dict[str, list[dict]]) -> tuple[list, list]:
    header = ["what the loop keeps", "live growth per step", "one step's activations",
              "growth / activations", "graph nodes kept per step"]
    rows = []
    for keep, r in leaks.items():
        s = leak_summary(r)
        rows.append([LEAK_LABELS.get(keep, keep), f"{s['growth']:,.0f} B",
                     f"{s['activations'] / KiB:,.1f} KiB", f"{s['ratio']:.6f}",
                     f"{s['nodes']:.0f}"])
    return header, rows


# -- (c) fragmentation ----------------------------------------------------------------------
def fragmentation_table(report: FragmentationReport) -> tuple[list, list]:
    """(header, rows): the allocator's figures after each phase of the workload."""
    header = ["phase", "allocated MiB", "reserved MiB", "fragmentation",
              "inactive split MiB", "alloc retries", "OOMs"]
    rows = [[phase, f"{p['allocated'] / MiB:,.1f}", f"{p['reserved'] / MiB:,.1f}",
             f"{p['fragmentation']:.0%}", f"{p['inactive_split'] / MiB:,.1f}",
             p["num_alloc_retries"], p["num_ooms"]] for phase, p in report.phases.items()]
    return header, rows


def gpu_allocator_claims(frag: FragmentationReport, limits) -> list[dict]:
    """The allocator's rows, which only a GPU answers: fragmentation, empty_cache() and the
    memory fraction. On a CUDA device each is measured (distlab.studies.fragmentation,
    distlab.studies.allocator_limits) and can read no; elsewhere it reads "not measured here"
    and names the GPU test that measures it."""
    from distlab.lab.common import claim
    from distlab.studies.allocator_limits import (empty_cache_released, fraction_capped,
                                                  freed, released)
    where = "no CUDA device here; measured by pytest -m gpu (tests/gpu/{})"
    rows = []
    if frag.cuda:
        ph = frag.phases
        rows.append(claim(
            "fragmented free memory cannot serve a larger request", "CUDA caching allocator",
            f"{ph['every other freed']['inactive_split'] / MiB:.0f} MiB free in split segments; "
            f"{frag.large_granted} of 5 requests of 14 MiB granted under a cap; "
            f"retries {ph['large requests']['num_alloc_retries']}",
            bool(frag.oom) and ph["large requests"]["inactive_split"] >= 28 * MiB))
    else:
        rows.append(claim("fragmented free memory cannot serve a larger request",
                          "CUDA caching allocator", where.format("test_fragmentation.py"),
                          None, "not measured here"))
    if limits.cuda:
        rows.append(claim(
            "empty_cache() returns cached memory to the driver, but not the holes between live "
            "blocks", "torch.cuda.empty_cache's documentation",
            f"all freed: {released(limits, 'all freed') / MiB:.0f} MiB released; half freed: "
            f"{released(limits, 'half freed') / MiB:.0f} of {freed(limits, 'half freed') / MiB:.0f}"
            " MiB freed released", empty_cache_released(limits)))
        rows.append(claim(
            "set_per_process_memory_fraction(f) caps the process below what the GPU has",
            "torch.cuda.set_per_process_memory_fraction's documentation",
            f"cap {limits.fraction:.4f} of the device: a request past it: "
            f"{limits.capped_oom or 'granted'}; without the cap: "
            f"{'granted' if limits.uncapped_ok else 'refused'}", fraction_capped(limits)))
    else:
        rows += [claim("empty_cache() returns cached memory to the driver, but not the holes "
                       "between live blocks", "torch.cuda.empty_cache's documentation",
                       where.format("test_allocator_limits.py"), None, "not measured here"),
                 claim("set_per_process_memory_fraction(f) caps the process below what the "
                       "GPU has", "torch.cuda.set_per_process_memory_fraction's documentation",
                       where.format("test_allocator_limits.py"), None, "not measured here")]
    return rows
