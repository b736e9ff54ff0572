"""Caller-side helpers of the LoRA and fine-tuning notebook (workbook/08_lora_finetuning): read
the "eval" events (held-out loss on both tasks) that fine-tuning runs log, build the sweeps'
configs and rows, draw the figures, time merged vs unmerged inference, and a widget that
fine-tunes with another rank / targets / learning rate and redraws.

Nothing here runs inside a rank or changes how anything trains; it reads what the runs logged
(distlab.finetune.forgetting writes the eval events, distlab.finetune.lora builds the adapters).

    runs = launch_together({"pre": pre, "full": full, "lora": lora})
    final_eval(runs["full"])           # {"task0": ..., "task1": ...} after the last step
    eval_curve(runs["full"], "task0")  # the forgetting curve
"""

from __future__ import annotations

import os
import statistics

import ipywidgets as W
import plotly.graph_objects as go
import torch

from distlab.config import RunConfig
from distlab.lab.common import RUN_COLORS as COLORS, byte_unit, fmt_bytes
from distlab.lab.runs import launch_together
from distlab.lab.panel import Explorer
from distlab.caller.launch import new_run_dir, runs_root
from distlab.finetune.lora import merge_lora, merged_state_dict, trainable_parameters, unmerge_lora
from distlab.caller.run import Run
from distlab.step_event import bytes_sent, memory
from distlab.rank.build import build_model

TARGET_COLORS = {"qv": "#1f5fbf", "attn": "#e8590c", "attn_mlp": "#2b8a3e"}
# no "star": that marks full fine-tuning in sweep_figure
RANK_SYMBOLS = {1: "circle", 2: "diamond", 4: "square", 8: "triangle-up", 16: "pentagon",
                32: "hexagon"}


# -- reading the runs ---------------------------------------------------------------------------
def evals(run: Run, rank: int = 0) -> list[dict]:
    """The run's "eval" events of one rank, in step order."""
    return sorted(run.history("eval", rank=rank), key=lambda e: e["step"])


def final_eval(run: Run) -> dict:
    """Held-out loss per task after the last step: {"task0": ..., "task1": ...}."""
    return evals(run)[-1]["loss"]


def start_eval(run: Run) -> dict:
    """Held-out loss per task before the first step."""
    return evals(run)[0]["loss"]


def eval_curve(run: Run, task: str) -> tuple[list[int], list[float]]:
    """(steps, held-out loss of `task`) over the run: step 0 is before training."""
    ev = evals(run)
    return [e["step"] for e in ev], [e["loss"][task] for e in ev]


def steps_to_reach(run: Run, task: str, target: float) -> int | None:
    """The first evaluated step at which `task`'s held-out loss is <= target (None: never)."""
    for s, loss in zip(*eval_curve(run, task)):
        if loss <= target:
            return s
    return None


def gain_recovered(loss: float, start: float, full: float) -> float:
    """Share of full fine-tuning's improvement a run reached: (start - loss) / (start - full),
    losses on the new task; 1 = as good as full fine-tuning, 0 = no better than the start."""
    return (start - loss) / (start - full)


def model_of(cfg: RunConfig) -> torch.nn.Module:
    """cfg's model as a rank builds it (under LoRA: adapters injected, the rest frozen), freshly
    initialised: init_from is dropped, as counting the model's values, or loading a run's final
    state into it, needs no pre-trained weights."""
    return build_model(cfg.replace(init_from=""))


def trainable_of(cfg: RunConfig) -> int:
    """Trainable values of cfg's model (adapters only under LoRA), counted on the module."""
    return trainable_parameters(model_of(cfg))


def frozen_keys(state: dict) -> list[str]:
    """The entries of a LoRA model's state dict that fine-tuning must leave bitwise untouched:
    all but the adapters' lora_A / lora_B."""
    return [k for k in state if "lora" not in k]


def last_memory(run: Run, rank: int = 0) -> dict:
    """The last step's memory by category (bytes) on one rank."""
    return memory(max(run.history("step", rank=rank), key=lambda e: e["step"]))


def last_step_bytes_sent(run: Run, rank: int = 0) -> int:
    """Bytes one rank sent in the last step, every collective kind together."""
    e = max(run.history("step", rank=rank), key=lambda e: e["step"])
    return bytes_sent(e)


def last_step_wire(run: Run, rank: int = 0) -> int | None:
    """Bytes the kernel saw one rank write in the last step (distlab.wire), None where it
    cannot see them."""
    e = max(run.history("step", rank=rank), key=lambda e: e["step"])
    return e.get("wire", {}).get("sent")


def preset_shapes(c, targets: str) -> list[tuple[int, int]]:
    """(d_in, d_out) of the Linears a preset adapts in a GPT of GPTConfig `c`, by formula (no
    model built: works for a 4096-wide GPT too; checked against lora.target_shapes)."""
    d, h = c.n_embd, c.mlp_ratio * c.n_embd
    per_layer = {"qv": [(d, d)] * 2, "attn": [(d, d)] * 4,
                 "attn_mlp": [(d, d)] * 4 + [(d, h), (h, d)]}[targets]
    return per_layer * c.n_layer


def weights_path(label: str = "pretrained") -> str:
    """A fresh file path under the runs folder for a run's save_final (a new folder each call)."""
    return os.path.join(new_run_dir(runs_root(), label), "model.pt")


# -- sweeps -------------------------------------------------------------------------------------
def sweep_configs(ft: RunConfig, targets, ranks, lrs, steps=None) -> dict[str, RunConfig]:
    """LoRA fine-tuning configs over targets x ranks x learning rates (x step counts)."""
    out = {}
    for t in targets:
        for r in ranks:
            for lr in lrs:
                for n in (steps or (ft.steps,)):
                    label = f"{t} r={r} lr={lr:g}" + (f" {n} steps" if n != ft.steps else "")
                    out[label] = ft.replace(lora_rank=r, lora_targets=t, lr=lr, steps=n,
                                            eval_every=max(1, n // 10))
    return out


def sweep_rows(runs: dict[str, Run], start: float, full: float) -> list[dict]:
    """One row per LoRA run: targets, rank, lr, steps, trainable values, final held-out losses,
    and the share of full fine-tuning's task-1 gain it recovered."""
    rows = []
    for label, run in runs.items():
        c, fin = run.cfg, final_eval(run)
        rows.append({"run": label, "targets": c.lora_targets, "rank": c.lora_rank, "lr": c.lr,
                     "steps": c.steps, "trainable": trainable_of(c), "task1": fin["task1"],
                     "task0": fin["task0"],
                     "recovered": gain_recovered(fin["task1"], start, full)})
    return rows


def best_first(rows: list[dict]) -> list[dict]:
    """sweep_rows' rows by task-1 held-out loss, lowest (the best LoRA run) first."""
    return sorted(rows, key=lambda r: r["task1"])


def tradeoff_points(runs: dict[str, Run], labels, lora_rows: list[dict], steps: int,
                    lr: float) -> dict[str, dict]:
    """{label: final held-out loss per task} of the runs named, then of the LoRA sweep's runs
    at `lr` trained `steps` steps ("LoRA <run>"): forgetting (task 0) against learning (task 1),
    the points of tradeoff_figure."""
    points = {k: final_eval(runs[k]) for k in labels}
    points |= {f"LoRA {r['run']}": {"task0": r["task0"], "task1": r["task1"]}
               for r in lora_rows if r["steps"] == steps and r["lr"] == lr}
    return points


# -- figures ------------------------------------------------------------------------------------
def memory_figure(groups: dict[str, dict], title: str) -> go.Figure:
    """Grouped bars of bytes per category (params, grads, optim) for each run label."""
    cats = ("params", "grads", "optim")
    scale, unit = byte_unit([g.get(c, 0) for g in groups.values() for c in cats])
    fig = go.Figure()
    for i, cat in enumerate(cats):
        fig.add_bar(name=cat, x=list(groups), y=[g.get(cat, 0) / scale for g in groups.values()],
                    marker_color=COLORS[i], text=[fmt_bytes(g.get(cat, 0))
                                                  for g in groups.values()],
                    textposition="outside")
    fig.update_layout(title=title, barmode="group", yaxis_title=f"bytes on rank 0 ({unit})",
                      height=380, template="plotly_white")
    return fig


def sweep_figure(rows: list[dict], full: float, start: float, full_trainable: int,
                 floor: float, title: str) -> go.Figure:
    """Task-1 loss reached vs trainable values (log x): one marker per LoRA run (colour:
    targets, symbol and label: rank, lines join the ranks of one targets/lr; open markers: a
    longer run), full fine-tuning as a star."""
    fig = go.Figure()
    keys = sorted({(r["targets"], r["lr"], r["steps"]) for r in rows})
    base_steps = min(k[2] for k in keys)
    for t, lr, n in keys:
        pts = sorted((r for r in rows if (r["targets"], r["lr"], r["steps"]) == (t, lr, n)),
                     key=lambda r: r["trainable"])
        fig.add_scatter(x=[r["trainable"] for r in pts], y=[r["task1"] for r in pts],
                        mode="lines+markers+text", name=f"{t}, lr {lr:g}, {n} steps",
                        line=dict(color=TARGET_COLORS.get(t, "#555"),
                                  dash="solid" if lr == max(k[1] for k in keys) else "dot"),
                        marker=dict(size=10, symbol=[
                            RANK_SYMBOLS.get(r["rank"], "circle")
                            + ("-open" if n != base_steps else "") for r in pts]),
                        # a line's end labels lean inwards, clear of the next line's
                        text=[f"r={r['rank']}" for r in pts],
                        textposition=["top center" if len(pts) == 1 else "top right" if j == 0
                                      else "top left" if j == len(pts) - 1 else "top center"
                                      for j in range(len(pts))],
                        textfont=dict(size=10, color=TARGET_COLORS.get(t, "#555")),
                        hovertemplate="%{text}: %{x:,} trainable, loss %{y:.3f}"
                                      "<extra></extra>")
    fig.add_scatter(x=[full_trainable], y=[full], mode="markers", name="full fine-tuning",
                    marker=dict(size=16, symbol="star", color="#000"))
    fig.add_hline(y=start, line_dash="dot", line_color="#868e96",
                  annotation_text=f"pre-trained model, before fine-tuning ({start:.2f})")
    fig.add_hline(y=floor, line_dash="dash", line_color="#555",
                  annotation_text=f"task-1 loss floor {floor:.3f}",
                  annotation_position="bottom right")
    fig.update_layout(title=title, xaxis_title="trainable values (log scale)",
                      yaxis_title="task-1 held-out loss after fine-tuning (nats)", xaxis_type="log",
                      height=460, template="plotly_white")
    return fig


def curves_figure(runs: dict[str, Run], task: str, title: str, floor: float | None = None,
                  xaxis: str = "fine-tuning step") -> go.Figure:
    """Held-out loss of `task` over the steps, one line per run; the floor's label goes under
    its line, where no loss can be, with room made for it below."""
    fig = go.Figure()
    ys = []
    for i, (label, run) in enumerate(runs.items()):
        x, y = eval_curve(run, task)
        ys += y
        fig.add_scatter(x=x, y=y, mode="lines+markers", name=label,
                        line=dict(color=COLORS[i % len(COLORS)]), marker=dict(size=5))
    if floor is not None:
        fig.add_hline(y=floor, line_dash="dash", line_color="#555",
                      annotation_text=f"{task.replace('task', 'task-')} loss floor {floor:.3f}",
                      annotation_position="bottom right")
        span = max(ys + [floor]) - min(ys + [floor])
        fig.update_yaxes(range=[min(ys + [floor]) - 0.12 * span, max(ys) + 0.05 * span])
    fig.update_layout(title=title, xaxis_title=xaxis,
                      yaxis_title=f"{task.replace('task', 'task-')} held-out loss (nats)",
                      height=380, template="plotly_white")
    return fig


def tradeoff_figure(points: dict[str, dict], title: str) -> go.Figure:
    """Each run's final (task-1 loss, task-0 loss): learning the new task vs keeping the old.
    One colour per family (the label's first word: full, replay, EWC, LoRA); from left to right
    the labels go above and below their points in turn, so close neighbours do not overprint,
    and the axes leave room for them."""
    fig = go.Figure()
    families = list(dict.fromkeys(label.split()[0] for label in points))
    for j, label in enumerate(sorted(points, key=lambda k: points[k]["task1"])):
        p = points[label]
        fig.add_scatter(x=[p["task1"]], y=[p["task0"]], mode="markers+text", name=label,
                        text=[label], textposition="top center" if j % 2 == 0 else
                        "bottom center", cliponaxis=False,
                        marker=dict(size=12, color=COLORS[families.index(label.split()[0])
                                                          % len(COLORS)]))
    xs = [p["task1"] for p in points.values()]
    ys = [p["task0"] for p in points.values()]
    xpad, ypad = 0.15 * max(max(xs) - min(xs), 0.1), 0.15 * max(max(ys) - min(ys), 0.1)
    fig.update_xaxes(range=[min(xs) - xpad, max(xs) + xpad])
    fig.update_yaxes(range=[min(ys) - ypad, max(ys) + ypad])
    fig.update_layout(title=title, xaxis_title="task-1 loss (new task; lower = learnt), nats",
                      yaxis_title="task-0 loss (old task; lower = kept), nats", height=420,
                      template="plotly_white", showlegend=False)
    return fig


# -- merged inference ---------------------------------------------------------------------------
def merge_check(cfg: RunConfig, state: dict, x: torch.Tensor, repeats: int = 50) -> dict:
    """Load a LoRA run's final state into its model; compare outputs and forward times
    unmerged, merged, and of a plain model (no adapters) loaded with merged_state_dict. Merged
    and plain are timed interleaved (distlab.lab.timed.interleaved), so load falls on both
    alike; "*_samples" hold every repeat's seconds, "*_s" their medians."""
    from distlab.lab.timed import interleaved, repeat
    torch.set_num_threads(1)  # the ranks' setting: one thread, so times compare like for like
    model = model_of(cfg)
    model.load_state_dict(state)
    plain = model_of(cfg.replace(lora_rank=0))
    plain.load_state_dict(merged_state_dict(model))
    with torch.no_grad():
        unmerged_out = model(x)
        t_unmerged = repeat(lambda: model(x), repeats)
        merge_lora(model)
        merged_out = model(x)
        plain_out = plain(x)
        t_merged, t_plain = interleaved(lambda: model(x), lambda: plain(x), repeats)
    unmerge_lora(model)
    med = statistics.median
    return {"max_diff_merged": (merged_out - unmerged_out).abs().max().item(),
            "max_diff_plain": (plain_out - unmerged_out).abs().max().item(),
            "unmerged_samples": t_unmerged, "merged_samples": t_merged, "plain_samples": t_plain,
            "unmerged_s": med(t_unmerged), "merged_s": med(t_merged), "plain_s": med(t_plain)}


def merge_latency_claim(m: dict, bound: float = 1.25) -> dict:
    """"A merged adapter adds no inference latency": merge_check's interleaved pairs, merged /
    plain per pair, must lie under `bound` (distlab.lab.timed.within); undecided where their
    middle half straddles it."""
    from distlab.lab.timed import ratios, timed_claim, within
    r = ratios(m["merged_samples"], m["plain_samples"])
    return timed_claim(
        f"a merged adapter adds no inference latency (merged within {bound - 1:.0%} of a "
        "plain GPT)", "Hu et al. 2021 §4.1", within(r, hi=bound),
        {"forward, merged / plain": r}, scale=1, unit="×", interleaved_=True,
        note=f"each interleaved pair's ratio; medians merged {m['merged_s'] * 1e3:.2f} ms, "
             f"plain {m['plain_s'] * 1e3:.2f} ms, unmerged {m['unmerged_s'] * 1e3:.2f} ms; "
             f"outputs within {m['max_diff_merged']:.0e}")


# -- the widget ---------------------------------------------------------------------------------
class LoRAExplorer(Explorer):
    """Rank, targets and learning rate; Run fine-tunes `ft` (a config with init_from and
    lora settings) with them in one launch and redraws task-1 and task-0 held-out loss beside
    the reference runs given (e.g. full fine-tuning). An invalid combination is refused with
    RunConfig's message in the status line."""

    def __init__(self, ft: RunConfig, references: dict[str, Run], ranks=(1, 2, 4, 8, 16),
                 targets=("qv", "attn", "attn_mlp"), lrs=(1e-3, 3e-3, 1e-2)):
        super().__init__()  # Run, Stop, the status line
        self.ft, self.references = ft, references
        self.rank = W.Dropdown(options=list(ranks), value=ft.lora_rank if ft.lora_rank in ranks
                               else ranks[0], description="rank")
        self.targets = W.Dropdown(options=list(targets), value=ft.lora_targets
                                  if ft.lora_targets in targets else targets[0],
                                  description="targets")
        self.lr = W.Dropdown(options=list(lrs), value=ft.lr if ft.lr in lrs else lrs[0],
                             description="lr")
        self.fig = go.Figure()
        self.fig.update_layout(height=340, template="plotly_white", margin=dict(t=30),
                               xaxis_title="fine-tuning step",
                               yaxis_title="held-out loss (nats)")
        self.last: dict | None = None
        self.widget = self._box([W.HBox([self.rank, self.targets, self.lr, self.button,
                                         self.stop_button]),
                                 self.status, self._view_of(self.fig)])

    def config(self) -> RunConfig:
        return self.ft.replace(lora_rank=self.rank.value, lora_targets=self.targets.value,
                               lr=self.lr.value)

    def _clear(self):
        super()._clear()
        self.fig.data = ()  # the last fine-tuning's curves are not this run's

    def _run(self, **values) -> dict:
        """Set the knobs (rank=, targets=, lr=), fine-tune, redraw; returns {"config", "run",
        "trainable", "task0", "task1"} (final held-out losses; `run(**values)`, or the Run
        button)."""
        for k, w in (("rank", self.rank), ("targets", self.targets), ("lr", self.lr)):
            if k in values:
                w.value = values[k]
        cfg = self.config()
        self._announce(f"fine-tuning: rank {cfg.lora_rank}, {cfg.lora_targets}, "
                       f"lr {cfg.lr:g} ...")
        run = launch_together({"explorer": cfg}, name="lora-explorer",
                              on_start=self._started)["explorer"]
        label = f"LoRA r={cfg.lora_rank} {cfg.lora_targets} lr={cfg.lr:g}"
        with self.fig.batch_update():
            self.fig.data = ()
            for i, (name, r) in enumerate({**self.references, label: run}.items()):
                for task, dash in (("task1", "solid"), ("task0", "dot")):
                    x, y = eval_curve(r, task)
                    self.fig.add_scatter(x=x, y=y, mode="lines", name=f"{name}: {task}",
                                         line=dict(color=COLORS[i % len(COLORS)], dash=dash,
                                                   width=4 if r is run else 2))
        fin, n = final_eval(run), trainable_of(cfg)
        self._say(f"{label}: {n:,} trainable values; held-out loss task 1 "
                  f"{fin['task1']:.3f}, task 0 {fin['task0']:.3f}")
        self.last = {"config": cfg, "run": run, "trainable": n, **fin}
        return self.last
