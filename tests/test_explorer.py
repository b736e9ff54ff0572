"""The explorers' base (distlab.lab.panel.Explorer): a click on Run clears the stale result at
once and trains in a thread, the live run's progress line reaches the status before it ends, a
second click meanwhile is refused, Stop ends every rank with the status "stopped"; a cell's
run() blocks and returns the result. And the hook that hands the caller the live Run:
run_ranks' and launch_together's on_start, and the control panel's "starting" state."""

from __future__ import annotations

import html
import re
import time

import pytest

from distlab import RunConfig, RunStopped
from distlab.lab.panel import Explorer, ExplorerBusy, describe
from distlab.lab.runs import launch_together
from distlab.caller.launch import run_ranks
from distlab.caller.run import Run

TINY = dict(global_batch=4, seq_len=8, n_layer=1, n_embd=16, n_head=2, timeout_s=30,
            threads_per_rank=1)


class TinyExplorer(Explorer):
    """The smallest explorer: one config, trained with launch_together; its "figure" is a list."""

    def __init__(self, cfg: RunConfig):
        super().__init__()
        self.cfg, self.drawn, self.cleared = cfg, ["stale"], 0

    def _clear(self):
        super()._clear()
        self.drawn, self.cleared = [], self.cleared + 1

    def _run(self, steps: int | None = None):
        cfg = self.cfg if steps is None else self.cfg.replace(steps=steps)
        self._announce("running tiny ...")
        run = launch_together({"a": cfg, "b": cfg}, name="tiny-explorer",
                              on_start=self._started)["b"]
        self.drawn = run.losses()
        self._say(f"done: {len(self.drawn)} steps")
        return run


def _until(predicate, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while not predicate():
        assert time.time() < deadline, what
        time.sleep(0.05)


def _status(explorer) -> str:
    return html.unescape(explorer.status.value)


@pytest.mark.slow
def test_a_click_runs_in_a_thread_shows_progress_refuses_a_second_click_and_stops():
    # 0.05 s a step, 2 × 100 steps: ~10 s if nothing stopped it, far past the test's checks
    explorer = TinyExplorer(RunConfig(steps=100, step_delay_s=0.05, **TINY))
    t0 = time.time()
    explorer._on_run_click(None)
    assert time.time() - t0 < 1.0  # the kernel is free at once: the work is in a thread
    assert explorer.cleared == 1 and explorer.drawn == []  # the stale result went at once
    assert explorer.busy and not explorer.stop_button.disabled
    _until(lambda: "step " in _status(explorer), 30, "no progress line in the status")
    live = explorer.live
    # which of the two configs runs, and its own steps (Run.progress_line's config_steps)
    assert not live.done and re.search(r"config [12]/2: step \d+/100", _status(explorer))
    assert _status(explorer).startswith("running tiny: config ")
    explorer._on_run_click(None)  # a second click while it runs
    assert "Run refused: one run at a time" in _status(explorer)
    assert explorer.cleared == 1  # and nothing of the live run was cleared
    with pytest.raises(ExplorerBusy):
        explorer.run()  # a cell asking meanwhile is refused too
    explorer._on_stop_click(None)
    assert explorer.join(30)
    assert _status(explorer).startswith("stopped tiny after "), _status(explorer)
    assert live.status == "stopped" and isinstance(explorer.error, RunStopped)
    assert all(p.exitcode is not None for p in live.processes)  # no rank left behind
    assert not explorer.busy and explorer.stop_button.disabled
    assert len(live.history("step", rank=0)) < 200


@pytest.mark.slow
def test_a_cell_run_blocks_and_returns_the_result():
    explorer = TinyExplorer(RunConfig(steps=3, **TINY))
    run = explorer.run(steps=2)
    assert run.status == "done" and explorer.drawn == run.losses() and len(run.losses()) == 2
    assert _status(explorer) == "done: 2 steps" and not explorer.busy


@pytest.mark.slow
def test_an_error_shows_in_the_status_and_the_explorer_is_free_again():
    explorer = TinyExplorer(RunConfig(steps=3, **TINY).replace(runs_root="/dev/null/runs"))
    explorer._on_run_click(None)
    assert explorer.join(30)
    assert "failed" in _status(explorer) and explorer.error is not None
    assert not explorer.busy and explorer.stop_button.disabled


@pytest.mark.slow
def test_on_start_hands_over_the_live_run(tmp_path):
    seen = []

    def hook(run: Run):
        seen.append((run.done, len(run.processes), run.total_steps))

    cfg = RunConfig(steps=2, runs_root=str(tmp_path), **TINY)
    runs = launch_together({"a": cfg, "b": cfg.replace(steps=3)}, on_start=hook)
    assert seen == [(False, 1, 5)] and runs["b"].status == "done"

    def failing(run: Run):
        seen.append(run)
        raise KeyError("the caller's hook failed")

    with pytest.raises(KeyError):
        run_ranks(_rank_sleeps, 2, 30.0, on_start=failing)
    live = seen[-1]
    assert live.status == "stopped" and all(p.exitcode is not None for p in live.processes)


def _rank_sleeps(rank, world, device, log, seconds):
    time.sleep(seconds)
    return rank


def test_the_status_says_starting_until_a_step_arrives(tmp_path):
    cfg = RunConfig(steps=200, world_size=1, **TINY)
    run = Run(str(tmp_path), cfg=cfg)
    run._finished.clear()  # as a live run is before its ranks log their first step
    assert describe(run, "single×1 fp32").startswith("starting single×1 fp32: 1 rank(s) starting")
    run.events.append({"kind": "step", "rank": 0, "step": 0, "loss": 4.0, "time": 0.0})
    assert describe(run, "single×1 fp32").startswith("running single×1 fp32: step 1/200")


@pytest.mark.slow
def test_a_real_explorer_clears_its_chart_at_the_click_and_stops():
    from distlab.lab.pipeline_parallel import PipelineExplorer
    base = RunConfig(strategy="pp", world_size=2, pp=2, microbatches=2, steps=300,
                     step_delay_s=0.05, **{**TINY, "n_layer": 2})  # ~15 s unless stopped
    explorer = PipelineExplorer(base, microbatches=(2,))
    explorer.fig.add_bar(x=[1], y=["rank 0"])  # the last run's chart
    explorer._on_run_click(None)
    assert explorer.fig.data == ()  # gone at once, before the ranks start
    _until(lambda: "step " in _status(explorer), 30, "no progress line in the status")
    assert "/300" in _status(explorer)
    explorer._on_stop_click(None)
    assert explorer.join(30) and _status(explorer).startswith("stopped 1f1b, m=2 after ")
    assert all(p.exitcode is not None for p in explorer.live.processes)


def test_keep_for_reload_gives_new_views_the_figure_as_drawn():
    """plotly's FigureWidget builds a new view (a page reload) from _widget_data and
    _widget_layout, which stay as first displayed unless set again: the reload showed an empty,
    squashed grid. keep_for_reload sets them to the figure now; anything else passes."""
    import plotly.graph_objects as go

    from distlab.lab.panel import keep_for_reload

    fig = go.FigureWidget()
    fig._repr_mimebundle_()  # displayed: the state a new view starts from is taken now
    fig.add_scatter(x=[0, 1, 2], y=[3.0, 2.0, 1.0])
    fig.update_layout(height=640)
    assert fig._widget_data == [] and "height" not in fig._widget_layout  # what a reload drew
    keep_for_reload(fig)
    assert list(fig._widget_data[0]["x"]) == [0, 1, 2] and fig._widget_layout["height"] == 640
    keep_for_reload(None)  # an explorer without a figure
    keep_for_reload(go.Figure())  # a static figure has no view state
