"""Figures that read well: one byte unit per axis, labels on log axes where their lines are,
a hint instead of empty axes, legends only for what is drawn, one-rank groups folded.

No launches: each figure function gets made-up inputs of the shape the runs log.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
import pytest

from distlab.lab import common
from distlab.lab.common import GiB, KiB, MiB


@pytest.mark.parametrize("values, unit", [
    ([0], "KiB"), ([None, 900], "KiB"), ([1023 * KiB], "KiB"), ([25_000 * KiB], "MiB"),
    ([MiB, 3], "MiB"), ([2.5 * GiB], "GiB"), ([[10], (3 * MiB,)], "MiB")])
def test_byte_unit_is_the_largest_in_which_the_top_value_is_at_least_one(values, unit):
    scale, name = common.byte_unit(*values) if isinstance(values[0], list) else \
        common.byte_unit(values)
    assert name == unit and scale == {"KiB": KiB, "MiB": MiB, "GiB": GiB}[unit]


def test_a_label_on_a_log_axis_sits_at_its_line():
    from distlab.theory.estimate import FP32_ADAM, MIXED_ADAM
    from distlab.lab.zero_and_fsdp import reduction_figure
    fig = reduction_figure({"mixed": MIXED_ADAM, "fp32": FP32_ADAM}, {"zero1 measured": (4, 1.6)})
    labels = {a.text: a.y for a in fig.layout.annotations}
    # plotly reads an annotation's y on a log axis as log10 of the value
    assert labels == {"4×": pytest.approx(math.log10(4)), "8×": pytest.approx(math.log10(8))}
    assert sorted(s.y0 for s in fig.layout.shapes) == [4, 8]  # shapes take the value itself


def test_the_tolerance_label_of_the_equivalence_figure_is_on_its_line():
    from distlab.lab.zero_and_fsdp import equivalence_figure
    fig = equivalence_figure({"single": [3.0, 2.0], "ddp": [3.0, 2.001]}, "single", 1e-3, "t")
    (label,) = [a for a in fig.layout.annotations if a.text.startswith("tolerance")]
    assert label.y == pytest.approx(-3) and label.yref == "y2"


def test_a_hint_hides_the_axes_and_titles_until_data_and_then_goes():
    from plotly.subplots import make_subplots
    fig = go.FigureWidget(make_subplots(rows=2, cols=1, subplot_titles=("a", "b")))
    fig.add_bar(x=[], y=[], row=1, col=1)
    fig.update_layout(height=700)
    common.show_hint(fig, "press Run")
    common.show_hint(fig, "starting")  # a second hint replaces the first
    assert [(a.text, a.visible) for a in fig.layout.annotations] == [
        ("a", False), ("b", False), ("starting", None)]
    assert fig.layout.xaxis2.visible is False and fig.layout.showlegend is False
    assert fig.layout.height == common.HINT_HEIGHT
    common.clear_hint(fig)
    assert [(a.text, a.visible) for a in fig.layout.annotations] == [("a", True), ("b", True)]
    assert fig.layout.xaxis2.visible is True and fig.layout.showlegend is None
    assert fig.layout.height == 700 and not common.has_hint(fig)


def test_the_dashboard_starts_with_a_hint_and_one_legend_per_chart():
    from distlab.lab.panel import EMPTY_HINT, LiveDashboard
    dash = LiveDashboard()
    assert [a.text for a in dash.fig.layout.annotations if a.name == common.HINT] == [EMPTY_HINT]
    legends = {t.legend or "legend" for t in dash.fig.data}
    assert legends == {"legend2", "legend3"}  # memory, bytes; the runs' join "legend"
    # each legend's top is its chart's top: memory beside memory, bytes beside bytes
    for legend, axis in (("legend", "yaxis"), ("legend2", "yaxis2"), ("legend3", "yaxis3")):
        assert dash.fig.layout[legend].y == dash.fig.layout[axis].domain[1]


def test_a_gantt_chart_lists_only_ops_wide_enough_to_see():
    from distlab.lab.pipeline_parallel import gantt
    ev = lambda op, t0, t1: {"op": op, "mb": 0, "chunk": None, "t0": t0, "t1": t1}  # noqa
    pipes = [{"events": [ev("F", 0, 0.5), ev("send", 0.5, 0.500001), ev("B", 0.6, 1.0)]},
             {"events": [ev("recv", 0, 0.5), ev("F", 0.5, 1.0)]}]
    fig = gantt(pipes, title="t")
    listed = {t.name for t in fig.data if t.showlegend}
    assert listed == {"forward", "backward", "recv (waiting)"}
    assert "send" in {t.name for t in fig.data}  # drawn (its hover tells), not listed
    assert "too thin to see: send" in fig.layout.title.text


def test_groups_of_one_rank_fold_into_one_line():
    from distlab.lab.parallelism_3d import group_table_rows
    base = {"formula": "f", "source": "s", "collectives": {"tp.all_reduce": 64}}
    rows = [{**base, "kind": "tp", "group": i, "ranks": [i], "measured": 0, "predicted": 0}
            for i in range(4)]
    rows.append({**base, "kind": "dp", "group": 0, "ranks": [0, 1, 2, 3], "measured": 96,
                 "predicted": 96, "collectives": {"dp.all_reduce": 1}})
    out = group_table_rows(rows)
    assert len(out) == 2 and out[0][0] == "dp"
    assert out[1][:2] == ["tp", "4 groups of one rank each"] and "sends nothing" in out[1][2]
    # a one-rank group that booked bytes is a bug to see, not to fold away
    rows[0]["measured"] = 8
    assert len(group_table_rows(rows)) == 3


def test_memory_figure_picks_one_unit_for_the_axis():
    from distlab.lab.zero_and_fsdp import memory_figure
    mem = {"params": 3 * MiB, "grads": 3 * MiB, "optim": 6 * MiB, "activations": 12 * MiB}
    fig = memory_figure({"ddp": {"r0": mem}}, "t")
    assert fig.layout.yaxis.title.text == "bytes per rank (MiB)"
    assert {t.name: t.y[0] for t in fig.data}["optimizer state"] == 6


def test_say_shows_text_literally():
    assert common.md_escape("a_b *c* |d| 1.") == "a\\_b \\*c\\* \\|d\\| 1\\."
