"""The control panel offers only what runs.

Every strategy in the panel's menu, at world sizes 1, 2 and 4, driven as a user drives it (the
strategy, then the world size; the panel fits its other knobs): the config it describes either
trains 2 steps to the end, or is refused before launch with a message naming why (in the
status line, with Run disabled or refusing). The knobs shown under each strategy are the ones
the registry says it reads. The dashboard reads every strategy's bytes and activations from
the step event (distlab.step_event), 3d's included. The pipeline explorer offers virtual stages
with the interleaved schedule only.
"""

from __future__ import annotations

import html
import math

import pytest

from distlab import RunConfig
from distlab.caller import preflight
from distlab.caller.launch import rank_context, runs_root
from distlab.config import FEATURE_FIELDS
from distlab.parallel import DEGREES, KNOBS, strategy_class

pytest.importorskip("ipywidgets")

WORLDS = (1, 2, 4)
TINY = dict(n_layer=2, n_embd=32, n_head=2, seq_len=16, threads_per_rank=1, steps=2)
GENERAL = ("strategy", "world_size", "steps", "lr", "precision", "global_batch", "nodes")


def _panel(**defaults):
    from distlab.lab.panel import ControlPanel
    return ControlPanel(**{**TINY, **defaults})


def _walk(panel):
    """{(strategy picked, world picked): RunConfig or the refusal's message}, each as the
    panel left it after the user picked the strategy, then the world size."""
    out = {}
    for s in panel.knobs["strategy"].options:
        for w in WORLDS:
            panel.knobs["strategy"].value = s
            panel.knobs["world_size"].value = w
            shown = html.unescape(panel.status.value)
            try:
                cfg = panel.config()
            except ValueError as e:
                assert panel.run_button.disabled and str(e) in shown, (s, w, shown)
                out[s, w] = str(e)
                continue
            try:
                preflight.check(cfg, runs_root(cfg.runs_root), rank_context())  # launch()'s checks
            except ValueError as e:
                panel._on_run_click(None)  # the user presses Run: nothing starts, it says why
                assert not panel.runs and str(e) in html.unescape(panel.status.value)
                out[s, w] = str(e)
                continue
            assert not panel.run_button.disabled and "ready" in shown, (s, w, shown)
            out[s, w] = cfg
    return out


@pytest.fixture(scope="module")
def menu():
    """The walk, and one launch per process count training every accepted config in turn."""
    from distlab.lab.runs import launch_together
    walked = _walk(_panel())
    configs = {}  # one run per distinct config ('single' at world 2 is the panel's allreduce)
    for (s, w), cfg in walked.items():
        if isinstance(cfg, RunConfig):
            configs.setdefault(cfg.to_json(), (f"{s}@{w}", cfg))
    runs = {}
    for procs in sorted({cfg.processes for _, cfg in configs.values()}):
        group = {label: cfg for label, cfg in configs.values() if cfg.processes == procs}
        runs.update(launch_together(group, name="panel-menu"))
    by_walk = {key: runs[label] for label, cfg in configs.values()
               for key, c in walked.items() if c is cfg or c == cfg}
    return walked, by_walk


@pytest.mark.slow
def test_every_strategy_at_every_world_size_runs_or_is_refused_with_a_reason(menu):
    walked, runs = menu
    assert len(walked) == len(_panel().knobs["strategy"].options) * len(WORLDS)
    for key, outcome in walked.items():
        if isinstance(outcome, str):
            assert outcome.strip(), f"{key}: refused without a message"
            continue
        run = runs[key]
        assert run.status == "done" and run.steps_done() == TINY["steps"], key
        assert all(math.isfinite(v) for v in run.losses()), key
    # the reported failures: each runs now, with the knobs its strategy needs
    for s in ("tp", "tp-torch"):
        assert walked[s, 2].tp == 2
    for s in ("pp", "pp-torch"):
        assert walked[s, 2].pp == 2 and walked[s, 2].microbatches >= 2
    assert (walked["3d", 4].tp, walked["3d", 4].pp) == (2, 2)
    # ps-async at 4: 3 workers cannot split a batch of 16; the panel says so before launch
    assert "does not divide among 3" in walked["ps-async", 4]
    # 'single' at more ranks is the panel's next strategy, as its status line said
    assert walked["single", 2].strategy == "allreduce"
    refused = sorted(k for k, v in walked.items() if isinstance(v, str))
    print(f"\n{len(walked) - len(refused)} ran, {len(refused)} refused: {refused}")


@pytest.mark.slow
def test_the_dashboard_reads_3d_bytes_and_pipeline_activations(menu):
    from distlab.lab.panel import dashboard_for, step_events
    from distlab.step_event import bytes_sent, memory
    _, runs = menu
    for key in (("3d", 4), ("pp", 2)):
        run = runs[key]
        dash = dashboard_for(run)
        dash._draw_ranks(run, key[0])
        traces = {t.name: t for t in dash.fig.data}
        last = step_events(run, run.steps_done() - 1)
        assert list(traces["booked"].customdata) == [bytes_sent(e) for e in last]
        assert all(b > 0 for b in traces["booked"].customdata), key  # 3d: the mesh groups'
        # the schedule ran the forward, so the loop measured none: the stash is the figure
        assert all(e["memory"]["activations"] == 0 for e in last), key
        acts = list(traces["activations"].customdata)
        assert acts == [memory(e)["activations"] for e in last] and all(a > 0 for a in acts)
        assert "sent nothing" not in dash.fig.layout.xaxis3.title.text, key
    one = dashboard_for(runs["single", 1])
    one._draw_ranks(runs["single", 1], "single")
    assert one.fig.layout.xaxis3.title.text.endswith("sent nothing: one process")


@pytest.mark.slow
def test_the_dashboard_adds_the_load_per_expert_when_a_mixture_of_experts_runs(menu):
    """A dense run watched first, then ep's: the figure gains a fourth chart, the dense run's
    loss line stays, and the bars are each rank's tokens per expert of block 0 at the last
    step, with each block's MaxVio over all ranks under them."""
    from distlab.lab.panel import dashboard_for, step_events
    from distlab.models.moe import max_violation
    _, runs = menu
    ep = runs["ep", 2]
    assert ep.cfg.n_experts
    dash = dashboard_for(runs["single", 1])
    assert not dash.experts and "yaxis4" not in dash.fig.layout
    dash.watch(ep)
    dash.refresh()
    assert dash.experts and "yaxis4" in dash.fig.layout
    dense = runs["single", 1]
    assert set(dash._loss_traces) == {id(dense), id(ep)}  # the dense run's line added back
    for r in (dense, ep):
        assert len(dash.fig.data[dash._loss_traces[id(r)]].x) == r.steps_done()
    last = step_events(ep, ep.steps_done() - 1)
    bars = {t.name: list(t.y) for t in dash.fig.data if t.legend == "legend4"}
    assert bars == {f"rank {e['rank']}": e["moe"][0]["tokens_per_expert"] for e in last}
    vio = max_violation([sum(c) for c in zip(*bars.values())])
    assert f"MaxVio per block {vio:.2f}" in dash.fig.layout.xaxis4.title.text


def test_the_knobs_shown_are_the_ones_the_registry_says_each_strategy_reads():
    from distlab.lab.panel import PANEL_FEATURES
    panel = _panel()
    strategy_knobs = {*KNOBS, *DEGREES, *PANEL_FEATURES}
    assert strategy_knobs <= set(panel.knobs)  # a widget for every knob the registry lists
    for s in panel.knobs["strategy"].options:
        panel.knobs["strategy"].value = s
        cls = strategy_class(s)
        expected = ({k for k, readers in KNOBS.items() if s in readers} | set(cls.degrees)
                    | {FEATURE_FIELDS[f] for f in cls.supports} & set(PANEL_FEATURES))
        assert set(panel.shown()) == set(GENERAL) | expected, s
    # the same, spelt out for the strategies of the report
    for s, knobs in {"tp": {"tp", "sp"}, "pp": {"pp", "schedule", "microbatches",
                                                "virtual_stages", "pp_op_delay_s"},
                     "3d": {"tp", "pp", "schedule", "microbatches", "virtual_stages",
                            "pp_op_delay_s", "mesh_order"},
                     "zero3": {"offload", "param_dtype", "reduce_dtype", "fsdp_units",
                               "fsdp_prefetch", "fsdp_layout", "fp8_all_gather"},
                     "ps-async": set()}.items():
        panel.knobs["strategy"].value = s
        assert set(panel.shown()) - set(GENERAL) == knobs, s


def test_knobs_get_valid_defaults_and_the_rest_is_refused_before_launch():
    panel = _panel(n_layer=4, n_embd=64, n_head=4)
    knobs = panel.knobs
    knobs["strategy"].value, knobs["world_size"].value = "pp", 4
    assert (knobs["pp"].value, knobs["pp"].options, knobs["pp"].disabled) == (4, (4,), True)
    knobs["schedule"].value = "1f1b"  # needs microbatches >= pp: the panel offers only those
    assert min(knobs["microbatches"].options) == 4 and panel.config().microbatches == 4
    assert knobs["virtual_stages"].disabled and "interleaved" in knobs["virtual_stages"].tooltip
    knobs["strategy"].value = "3d"
    assert (panel.config().tp, panel.config().pp) == (2, 2)
    knobs["tp"].value = 4  # the pipeline degree moves to what fits: world = dp x tp x pp
    assert (panel.config().tp, panel.config().pp) == (4, 1)
    knobs["strategy"].value = "ps-async"
    assert panel.run_button.disabled and "does not divide among 3" in panel.status.value
    knobs["global_batch"].value = 15
    assert not panel.run_button.disabled and panel.config().global_batch == 15
    knobs["global_batch"].value, knobs["strategy"].value = 16, "zero3"
    knobs["precision"].value = "bf16"  # zero3's param dtype and autocast exclude each other
    assert knobs["param_dtype"].options == ("fp32",) and "precision" in knobs[
        "param_dtype"].tooltip


def test_virtual_stages_only_with_the_interleaved_schedule():
    from distlab.lab.pipeline_parallel import PipelineExplorer
    base = RunConfig(strategy="pp", world_size=2, pp=2, microbatches=2, **TINY)
    explorer = PipelineExplorer(base, virtual_stages=(1, 2))
    explorer.schedule.value = "interleaved"
    assert not explorer.virtual.disabled and "interleaved" not in explorer.virtual_note.value
    explorer.virtual.value = 2
    explorer.schedule.value = "gpipe"
    assert explorer.virtual.disabled and explorer.virtual.value == 1
    assert "only the interleaved schedule" in explorer.virtual_note.value
    with pytest.raises(ValueError, match="only the interleaved schedule"):
        explorer.run(schedule="gpipe", virtual_stages=2)  # refused, not silently ignored
    with pytest.raises(ValueError, match="virtual_stages=2: only the interleaved"):
        base.replace(schedule="gpipe", virtual_stages=2)  # and by RunConfig, for any caller


def test_step_event_reads_3d_bytes_under_mesh_and_a_pipeline_stash():
    from distlab.step_event import bytes_sent, comm, memory
    stats = lambda b: {"calls": 1, "bytes_sent": b, "bytes_recv": 0}  # noqa: E731
    three_d = {"comm": {}, "memory": {"params": 8, "activations": 0},
               "mesh": {"comm": {"tp": {"tp.all_reduce": stats(100)}, "pp": {"send": stats(7)}}},
               "pipeline": {"peak_stash_bytes": 640}}
    assert bytes_sent(three_d) == 107 and set(comm(three_d)) == {"tp.tp.all_reduce", "pp.send"}
    assert memory(three_d) == {"params": 8, "activations": 640}
    ddp = {"comm": {"all_reduce": stats(50)}, "memory": {"activations": 33}}
    assert (bytes_sent(ddp), memory(ddp)["activations"]) == (50, 33)


def test_launch_checks_refuse_in_the_status_line_and_start_nothing(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    panel = _panel(runs_root=str(blocker / "runs"))  # RunConfig accepts it; preflight cannot
    assert not panel.run_button.disabled
    panel._on_run_click(None)
    shown = html.unescape(panel.status.value)
    assert not panel.runs and "not started" in shown and "is a file, not a folder" in shown


def test_the_status_prints_as_words_not_html():
    # 11 printed "&#x27;" for an apostrophe (issue 25): cells print status_text now
    from distlab.lab.panel import status_text
    import ipywidgets as widgets
    w = widgets.HTML(html.escape("'lr too high': 1 finding(s)") + " <b>and more</b>")
    assert status_text(w) == "'lr too high': 1 finding(s) and more"


def test_the_status_printed_after_wait_says_done_not_running(tmp_path, monkeypatch):
    """10 printed "running ... step 70/80" under a run that had ended (issue 25): the cell
    read the status before the dashboard thread's last redraw. status_text redraws first."""
    monkeypatch.setenv("DISTLAB_RUNS", str(tmp_path))
    panel = _panel(steps=3)
    run = panel.run()
    run.wait(timeout=120)
    text = panel.status_text
    assert run.status == "done" and text.startswith("done"), text
    assert "running" not in text, text
    assert panel.dashboard.fig.layout.yaxis.title.text == "loss (nats/token)"  # the GPT's


def test_the_loss_axis_says_what_the_loss_is_a_mean_over():
    """The dashboard labelled 10's classifier's loss "nats/token" (issue 25)."""
    from distlab.lab.panel import loss_axis_title
    assert loss_axis_title(RunConfig()) == "loss (nats/token)"
    assert loss_axis_title(RunConfig(model="bnnet")) == "loss (nats/sample)"
    spec = RunConfig(model="pkg.mod:make_model", data="pkg.mod:make_data")
    assert loss_axis_title(spec) == "loss"


def test_nodes_and_their_link_are_knobs_checked_like_the_rest():
    """The simulated nodes' two knobs: the link shows only between nodes, the config carries
    both, and a layout RunConfig refuses (one process on two nodes) is said, Run disabled."""
    panel = _panel()
    k = panel.knobs
    assert k["nodes"].value == 1 and k["link_mbit"].layout.display == "none"
    k["strategy"].value, k["world_size"].value = "ddp", 4
    k["nodes"].value = 2
    assert k["link_mbit"].layout.display is None and "link_mbit" in panel.shown()
    k["link_mbit"].value = 25.0
    cfg = panel.config()
    assert (cfg.nodes, cfg.link_mbit, cfg.processes) == (2, 25.0, 4)
    k["strategy"].value = "single"  # one process: nothing to place on two nodes
    assert panel.run_button.disabled
    assert "one process" in html.unescape(panel.status.value)
